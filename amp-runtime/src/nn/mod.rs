//! AMP-aware layers, candle-nn style: plain structs holding f32 master weights (`Var`s), a `new`
//! taking the Vars, a free constructor taking a `VarBuilder`, and `forward`.
//!
//! A layer casts its master weights to the precision it runs in, per call; gradients come back
//! to the f32 masters (candle's `to_dtype` backward casts back). Each layer names its op class
//! through [`AmpLayer`], which the autocast macros use to route it:
//! `Linear`/`Conv*` are lower-precision (they run in their input's precision), `LayerNorm` and
//! `RmsNorm` are fp32-class (f32 output), `BatchNorm2d` runs in its input's precision with f32
//! statistics and compute inside, pooling and `Embedding` preserve precision. `ConvBn2d` and
//! `ConvBnReLU2d` pair a `Conv2d` with the `BatchNorm2d` after it (and a ReLU): lower-precision,
//! and on CPU one op that normalises the conv's f32 sums before rounding.
//!
//! ```
//! use amp_runtime::nn::{self, loss};
//! use amp_runtime::{Tensor, F16, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! let fc1 = nn::linear(4, 8, vb.pp("fc1"))?;
//! let fc2 = nn::linear(8, 1, vb.pp("fc2"))?;
//!
//! let x = Tensor::<F32>::randn(0.0, 1.0, (16, 4), &dev)?;
//! // The hidden layers run in f16 (weights cast per call), the loss in f32.
//! let h: Tensor<F16> = fc1.forward(&x.cast::<F16>()?)?.relu()?;
//! let y: Tensor<F32> = fc2.forward(&h)?.cast::<F32>()?;
//! let loss = loss::mse(&y, &Tensor::zeros((16, 1), &dev)?)?;
//! let grads = loss.as_candle().backward()?;
//! assert_eq!(grads.get(fc1.weight()).unwrap().dtype(), DType::F32); // f32 master gradient
//! # Ok(()) }
//! ```

mod candle;
pub mod conv;
pub mod conv_bn;
pub mod dropout;
pub mod embedding;
pub mod linear;
pub mod norm;
pub mod pool;
pub mod upsample;

pub use crate::loss;

/// candle-nn's activations, usable as they are: called from a region (`self.act.forward(&h)`)
/// they run in their input's precision, as PyTorch's autocast runs them (on no list).
pub use candle_nn::Activation;
pub use candle_nn::{
    BatchNormConfig, Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, LayerNormConfig,
};
pub use conv::{
    conv1d, conv1d_no_bias, conv2d, conv2d_no_bias, conv_transpose2d, conv_transpose2d_no_bias,
    Conv1d, Conv2d, ConvTranspose2d,
};
pub use conv_bn::{ConvBn2d, ConvBnReLU2d};
pub use dropout::Dropout;
pub use embedding::{embedding, Embedding};
pub use linear::{linear, linear_b, linear_no_bias, Linear, LinearAct};
pub use norm::{
    batch_norm1d, batch_norm2d, group_norm, layer_norm, rms_norm, BatchNorm1d, BatchNorm2d,
    GroupNorm, LayerNorm, RmsNorm,
};
pub use pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d};
pub use upsample::{Upsample, UpsampleMode};

use candle_core::{Result, Var};

use crate::op::Op;
use crate::precision::{Precision, F32};
use crate::region::{AmpTensor, CallerPolicy, RegionCall, RegionValue};
use crate::tensor::{dtype_error, Tensor};

/// A layer's typed forward in code an autocast region calls (a plain helper given typed
/// tensors; autocast is per thread, as in PyTorch): the layer's routed call `C` under the
/// region's policy, its result in the precision `R` the typed signature names. `None` elsewhere
/// (and inside the routed call itself): the typed forward runs as written.
fn followed<R: Precision, C, A>(
    layer: &impl RegionCall<CallerPolicy, C, A, Output = AmpTensor>,
    args: A,
) -> Option<Result<Tensor<R>>> {
    crate::autocast_state::followed()?;
    Some(layer.region_call(args).and_then(|y| y.cast::<R>()))
}

/// `RegionCall` for a layer with a typed `forward::<P>`: routed by the layer's op class like any
/// op, then the typed forward runs in the precision the input was cast to.
macro_rules! region_forward {
    ($($layer:ty),*) => {$(
        impl<Pol: $crate::region::Policy, A: $crate::region::AsAmp>
            $crate::region::RegionCall<Pol, $crate::region::calls::forward, (A,)> for $layer
        {
            type Output = $crate::region::AmpTensor;
            fn region_call(&self, (x,): (A,)) -> Result<$crate::region::AmpTensor> {
                $crate::region::unary::<Pol, <$layer as $crate::nn::AmpLayer>::Op>(
                    &x.to_amp(),
                    |x| {
                        $crate::region::with_precision!(x.dtype(), P => self
                            .forward(&Tensor::<P>::wrap(x.clone()))
                            .map(Tensor::into_candle))
                    },
                )
            }
        }
    )*};
}
use region_forward;

/// [`region_forward`] for a layer with a `train` flag (`forward_t::<P>(x, train)`):
/// `forward_t` and `forward_train` (training mode) routed by the layer's op class.
macro_rules! region_forward_t {
    ($($layer:ty),*) => {$(
        impl<Pol: $crate::region::Policy, A: $crate::region::AsAmp>
            $crate::region::RegionCall<Pol, $crate::region::calls::forward_t, (A, bool)> for $layer
        {
            type Output = $crate::region::AmpTensor;
            fn region_call(&self, (x, train): (A, bool)) -> Result<$crate::region::AmpTensor> {
                $crate::region::unary::<Pol, <$layer as $crate::nn::AmpLayer>::Op>(
                    &x.to_amp(),
                    |x| {
                        $crate::region::with_precision!(x.dtype(), P => self
                            .forward_t(&Tensor::<P>::wrap(x.clone()), train)
                            .map(Tensor::into_candle))
                    },
                )
            }
        }

        impl<Pol: $crate::region::Policy, A: $crate::region::AsAmp>
            $crate::region::RegionCall<Pol, $crate::region::calls::forward_train, (A,)> for $layer
        {
            type Output = $crate::region::AmpTensor;
            fn region_call(&self, (x,): (A,)) -> Result<$crate::region::AmpTensor> {
                $crate::region::RegionCall::<Pol, $crate::region::calls::forward_t, (A, bool)>
                    ::region_call(self, (x, true))
            }
        }
    )*};
}
use region_forward_t;

/// A layer's op class, for the autocast macros: `Linear` is `op::linear` (lower precision),
/// `LayerNorm` is `op::layer_norm` (fp32), and so on.
pub trait AmpLayer {
    /// The op marker whose [`OpClass`](crate::OpClass) decides where the layer runs.
    type Op: Op;
}

/// `candle_nn::Module` (and `ModuleT`) for the layers, so they drop into candle code
/// (`xs.apply(&layer)`, `candle_nn::seq()`): the call runs as a module call from the region
/// running on this thread (f32 outside any region), on a candle tensor of any float dtype.
macro_rules! candle_module {
    ($($layer:ty),*) => {$(
        impl candle_nn::Module for $layer {
            fn forward(&self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
                $crate::region::AmpModule::forward_amp(self, xs)
            }
        }
    )*};
}
candle_module!(
    Linear,
    Conv1d,
    Conv2d,
    MaxPool2d,
    AvgPool2d,
    AdaptiveAvgPool2d,
    LayerNorm,
    RmsNorm,
    GroupNorm
);

/// `candle_nn::ModuleT` for the layers with a `train` flag, as [`candle_module`] does for the
/// others.
macro_rules! candle_module_t {
    ($($layer:ty),*) => {$(
        impl candle_nn::ModuleT for $layer {
            fn forward_t(
                &self,
                xs: &candle_core::Tensor,
                train: bool,
            ) -> Result<candle_core::Tensor> {
                use crate::region::{calls, AmpTensor, CallerPolicy, RegionCall};
                RegionCall::<CallerPolicy, calls::forward_t, (AmpTensor, bool)>::region_call(
                    self,
                    (xs.clone(), train),
                )
            }
        }
    )*};
}
candle_module_t!(BatchNorm1d, BatchNorm2d, ConvBn2d, ConvBnReLU2d);

impl candle_nn::Module for Embedding {
    fn forward(&self, ids: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        Ok(Embedding::forward(self, ids)?.into_candle())
    }
}

/// PyTorch's initialisation of a layer whose outputs each see `fan_in` inputs: the weight's
/// (candle-nn's default, Kaiming-normal) and the bias's (uniform in `+-1/sqrt(fan_in)`). With no
/// input (`fan_in` 0, a zero-element weight) both are zeros: PyTorch builds that layer (its
/// initialisers skip empty tensors, its bias bound is 0), where candle-nn's fail on the
/// infinite bound ("non-finite range in uniform distribution").
fn fan_in_init(fan_in: usize) -> (candle_nn::Init, candle_nn::Init) {
    if fan_in == 0 {
        return (candle_nn::Init::Const(0.0), candle_nn::Init::Const(0.0));
    }
    let bound = 1.0 / (fan_in as f64).sqrt();
    (
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
        candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        },
    )
}

/// `vb.get_with_hints(shape, name, init)`, the size checked first: a shape whose element count
/// overflows (`linear(usize::MAX / 2, 4)`: candle's arithmetic panicked) or whose f32 values no
/// allocation can hold (`linear(1 << 20, 1 << 20)`, 4 TiB: the process aborted) is an error
/// naming the parameter, as PyTorch's "can't allocate memory".
fn parameter<S: Into<candle_core::Shape>>(
    vb: &candle_nn::VarBuilder,
    shape: S,
    name: &str,
    init: candle_nn::Init,
) -> Result<candle_core::Tensor> {
    let shape = shape.into();
    let what = format!("parameter `{}`", vb.pp(name).prefix());
    crate::kernels::layout::check_allocatable(&what, shape.dims())?;
    let bytes = shape.elem_count() * 4;
    // Past what the machine can map, the allocation inside the VarBuilder aborts the process:
    // ask for the bytes first, where a refusal is an error.
    if Vec::<u8>::new().try_reserve_exact(bytes).is_err() {
        candle_core::bail!(
            "{what}: cannot allocate {bytes} bytes for the shape {:?}",
            shape.dims()
        )
    }
    vb.get_with_hints(shape, name, init)
}

/// Checks that a master weight is an f32 `Var` (what optimizers need: candle-nn's AdamW keeps
/// its moments in the Var's dtype, so f16 masters break training).
fn master(var: Var, what: &str) -> Result<Var> {
    if var.dtype() == F32::DTYPE {
        Ok(var)
    } else {
        Err(dtype_error::<F32>(
            &format!("{what}: master weights must be f32"),
            var.dtype(),
        ))
    }
}

/// Counts, for a layer whose op rounds its f32 master weight (and bias) to `P` inside itself,
/// the casts that rounding stands for (none in f32), so that `cast_count` and the precision
/// report see the same casts as for a layer that casts first.
fn count_master_casts<P: Precision>(weight: &Var, bias: Option<&Var>) {
    if P::DTYPE != candle_core::DType::F32 {
        let elements = weight.elem_count() + bias.map_or(0, |b| b.elem_count());
        crate::cast::count_casts(1 + u64::from(bias.is_some()), elements, P::DTYPE);
    }
}

/// A master weight cast to the precision `P` the layer runs in (a handle clone for `F32`).
fn weight_as<P: Precision>(var: &Var) -> Result<Tensor<P>> {
    Tensor::<F32>::wrap(var.as_tensor().clone()).cast()
}

/// Checks a layer's master weight (f32, `rank` dimensions) and optional bias (f32, one value
/// per output channel, i.e. per row of the weight).
fn master_weight_and_bias(
    weight: Var,
    bias: Option<Var>,
    layer: &str,
    rank: usize,
) -> Result<(Var, Option<Var>)> {
    let weight = master(weight, &format!("{layer} weight"))?;
    expect_dims(&weight, &format!("{layer} weight"), rank)?;
    let bias = bias
        .map(|b| master(b, &format!("{layer} bias")))
        .transpose()?;
    if let Some(b) = &bias {
        if b.dims() != [weight.dim(0)?] {
            candle_core::bail!(
                "{layer} bias: expected shape [{}], got {:?}",
                weight.dim(0)?,
                b.dims()
            )
        }
    }
    Ok((weight, bias))
}

/// Checks a weight's shape at construction, so that a wrong checkpoint fails early and clearly.
fn expect_dims(var: &Var, what: &str, rank: usize) -> Result<()> {
    if var.rank() == rank {
        Ok(())
    } else {
        candle_core::bail!(
            "{what}: expected a rank-{rank} weight, got shape {:?}",
            var.dims()
        )
    }
}
