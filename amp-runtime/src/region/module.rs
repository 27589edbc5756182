//! Modules as values: [`AmpModule`] for generic bounds and `Box<dyn AmpModule>` layer stacks,
//! and `.apply(&m)` on region values.

use candle_core::Result;

use super::call::{calls, RegionCall};
use super::policy::{CallerPolicy, Policy, PolicyScope};
use super::value::{AmpTensor, AsAmp};

/// A module of one tensor, callable from an autocast region: every candle-amp layer with a
/// `forward(x)`, and every `#[autocast]` impl whose `forward` takes one tensor. Use it as a
/// generic bound (`M: AmpModule`) or as `Box<dyn AmpModule>` / `Vec<Box<dyn AmpModule>>`; a
/// region calls such a module with `h.apply(&m)`, or `m.forward(&h)` when its type is known
/// (a `dyn AmpModule` included), and it runs under that region's policy. A type parameter
/// bounded by `AmpModule` alone is called with `h.apply(&m)`: `m.forward(..)` needs the module's
/// own `RegionCall`, which the bound does not carry.
///
/// Three layers are not `AmpModule`s, as in candle-nn they are not plain `Module`s of an
/// activation: `BatchNorm2d` and `Dropout` behave differently in training and evaluation (call
/// `forward_t(x, train)`; they are `candle_nn::ModuleT`), and `Embedding` takes token ids, not an
/// activation.
///
/// ```
/// # extern crate amp_runtime as candle_amp;
/// # use amp_macros::autocast;
/// use candle_amp::nn;
/// use candle_amp::{AmpModule, Tensor, F32};
/// use candle_core::{DType, Device, Result};
/// use candle_nn::{VarBuilder, VarMap};
///
/// struct Stack {
///     layers: Vec<Box<dyn AmpModule>>,
/// }
///
/// #[autocast(bf16)]
/// impl Stack {
///     fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
///         let mut h = x.clone();
///         for layer in &self.layers {
///             h = layer.forward(&h)?.relu()?;
///             assert_eq!(h.dtype(), DType::BF16);
///         }
///         Ok(h)
///     }
/// }
///
/// # fn main() -> Result<()> {
/// let vars = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
/// let layers: Vec<Box<dyn AmpModule>> = vec![
///     Box::new(nn::linear(4, 8, vb.pp("a"))?),
///     Box::new(nn::linear(8, 2, vb.pp("b"))?),
/// ];
/// let x = Tensor::<F32>::ones((3, 4), &Device::Cpu)?;
/// assert_eq!(Stack { layers }.forward(&x)?.dims(), &[3, 2]);
/// # Ok(()) }
/// ```
pub trait AmpModule {
    /// Runs the module on a region value, under the policy of the region running on this
    /// thread (f32 outside any).
    fn forward_amp(&self, x: &AmpTensor) -> Result<AmpTensor>;
}

impl<M> AmpModule for M
where
    M: RegionCall<CallerPolicy, calls::forward, (AmpTensor,), Output = AmpTensor>,
{
    fn forward_amp(&self, x: &AmpTensor) -> Result<AmpTensor> {
        self.region_call((x.clone(),))
    }
}

/// A module behind `dyn` loses the static policy: the call pushes it for [`CallerPolicy`].
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for dyn AmpModule {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        let _policy = PolicyScope::enter::<Pol>();
        self.forward_amp(&x.to_amp())
    }
}

impl AmpTensor {
    /// `m` on this value, as candle's `Tensor::apply`: under the policy of the region running.
    pub fn apply<M: AmpModule + ?Sized>(&self, m: &M) -> Result<AmpTensor> {
        m.forward_amp(self)
    }
}
