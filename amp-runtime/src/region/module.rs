//! Modules as values: [`AmpModule`] for generic bounds and `Box<dyn AmpModule>` layer stacks,
//! and `.apply(&m)` on region values.

use std::marker::PhantomData;

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
/// For any lifetime of the object (`m: &dyn AmpModule` in a signature is a borrowed one, not
/// `'static`).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for dyn AmpModule + '_ {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        let _policy = PolicyScope::enter::<Pol>();
        self.forward_amp(&x.to_amp())
    }
}

/// `h.apply(&m)` and `h.apply_t(&m, train)` in a region (candle's way to call a module): the
/// rewrite turns them into `(&&Applied::<Pol, _>::new(&m)).__amp_apply(&h)`, and Rust's method
/// probe picks the call by the module's type (autoref specialisation, tried in order):
/// 1. a module with a `RegionCall` ([`ApplyRegionCall`]): a module call under the region's
///    policy, as `m.forward(&h)`;
/// 2. an [`AmpModule`] ([`ApplyAmpModule`]), such as a type parameter bounded by it alone:
///    under the policy of the region running (its frame is on the thread).
///
/// A plain candle module is neither: candle's own `apply` would run it in whatever dtype its
/// input holds, so it is a compile error naming `AmpModule`.
#[derive(Debug)]
pub struct Applied<'m, Pol, M: ?Sized> {
    module: &'m M,
    policy: PhantomData<Pol>,
}

impl<'m, Pol, M: ?Sized> Applied<'m, Pol, M> {
    /// The module `h.apply(&m)` names.
    pub fn new(module: &'m M) -> Self {
        Self {
            module,
            policy: PhantomData,
        }
    }
}

/// Way 1 of [`Applied`]: a module call.
pub trait ApplyRegionCall<'x> {
    /// The module's result in the region.
    type Output;
    /// `m.forward(x)`.
    fn __amp_apply(self, x: &'x AmpTensor) -> Result<Self::Output>;
}

impl<'x, Pol: Policy, M> ApplyRegionCall<'x> for &&Applied<'_, Pol, M>
where
    M: RegionCall<Pol, calls::forward, (&'x AmpTensor,)> + ?Sized,
{
    type Output = M::Output;
    fn __amp_apply(self, x: &'x AmpTensor) -> Result<M::Output> {
        self.module.region_call((x,))
    }
}

/// Way 1 of [`Applied`] for `apply_t`: a module call with the train flag.
pub trait ApplyTRegionCall<'x> {
    /// The module's result in the region.
    type Output;
    /// `m.forward_t(x, train)`.
    fn __amp_apply_t(self, x: &'x AmpTensor, train: bool) -> Result<Self::Output>;
}

impl<'x, Pol: Policy, M> ApplyTRegionCall<'x> for &&Applied<'_, Pol, M>
where
    M: RegionCall<Pol, calls::forward_t, (&'x AmpTensor, bool)> + ?Sized,
{
    type Output = M::Output;
    fn __amp_apply_t(self, x: &'x AmpTensor, train: bool) -> Result<M::Output> {
        self.module.region_call((x, train))
    }
}

/// Way 2 of [`Applied`]: an [`AmpModule`].
pub trait ApplyAmpModule {
    /// `m.forward_amp(x)`.
    fn __amp_apply(self, x: &AmpTensor) -> Result<AmpTensor>;
}

impl<Pol, M: AmpModule + ?Sized> ApplyAmpModule for &Applied<'_, Pol, M> {
    fn __amp_apply(self, x: &AmpTensor) -> Result<AmpTensor> {
        self.module.forward_amp(x)
    }
}
