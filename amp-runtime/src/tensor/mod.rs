//! `Tensor<P>`: a candle tensor whose precision is part of its type.
//!
//! Method names and argument order follow `candle_core::Tensor`. What changes is what compiles:
//! - binary ops take operands of one precision ([`SamePrecision`](crate::op::SamePrecision));
//! - fp32-class ops (`sum`, `exp`, `log`, ...) exist on `Tensor<F32>` only
//!   ([`Fp32Input`](crate::op::Fp32Input)), and return `Tensor<F32>`; under an autocast region
//!   the policy upcasts for you (they are defined in [`crate::fp32`], next to their
//!   any-precision forms);
//! - lower-precision ops (`matmul`, `conv2d`) and precision-preserving ops run in `P`.
//!
//! In code an autocast region calls (a plain helper, a trait default method, a closure: autocast
//! is per thread, as in PyTorch), every typed op runs where the region's policy puts it instead,
//! and its result is cast back to the precision the signature names ([`follow`]).
//!
//! `binary.rs` has the two-tensor ops, convolutions and operators; `preserve.rs` the
//! precision-preserving ones.
//!
//! ```
//! use amp_runtime::{Tensor, F16, F32};
//! use candle_core::Device;
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let x = Tensor::<F32>::new(&[[1f32, 2.], [3., 4.]], &dev)?;
//! let h: Tensor<F16> = x.cast::<F16>()?.matmul(&x.cast::<F16>()?)?.relu()?;
//! let total: Tensor<F32> = h.cast::<F32>()?.sum_all()?;
//! assert_eq!(total.to_scalar::<f32>()?, 54.0);
//! # Ok(()) }
//! ```

use std::marker::PhantomData;

use candle_core::{DType, Device, Shape, WithDType};
use candle_core::{Error, Result};

use crate::autocast_state;
use crate::cast::convert;
use crate::op::Op;
use crate::precision::{same, Precision, Promote, F32};

/// A tensor of precision `P` (`F32` by default): a zero-cost newtype over `candle_core::Tensor`.
///
/// The device stays a runtime value, as in candle; only the dtype is in the type.
#[repr(transparent)]
pub struct Tensor<P: Precision = F32> {
    inner: candle_core::Tensor,
    precision: PhantomData<P>,
}

impl<P: Precision> Clone for Tensor<P> {
    fn clone(&self) -> Self {
        Self::wrap(self.inner.clone())
    }
}

impl<P: Precision> std::fmt::Debug for Tensor<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor<{}>{:?}", P::NAME, self.inner)
    }
}

impl<P: Precision> std::fmt::Display for Tensor<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.inner, f)
    }
}

impl<P: Precision> AsRef<candle_core::Tensor> for Tensor<P> {
    fn as_ref(&self) -> &candle_core::Tensor {
        &self.inner
    }
}

impl<P: Precision> AsRef<Tensor<P>> for Tensor<P> {
    fn as_ref(&self) -> &Tensor<P> {
        self
    }
}

impl<P: Precision> TryFrom<candle_core::Tensor> for Tensor<P> {
    type Error = Error;
    fn try_from(t: candle_core::Tensor) -> Result<Self> {
        Self::from_candle(t)
    }
}

impl<P: Precision> From<Tensor<P>> for candle_core::Tensor {
    fn from(t: Tensor<P>) -> Self {
        t.inner
    }
}

/// The error `from_candle` returns for a tensor of the wrong dtype: for a float tensor, the
/// typed tensor it would fit; for an integer one (token ids, masks), that typed tensors are
/// floating only and candle tensors pass through.
pub(crate) fn dtype_error<P: Precision>(what: &str, got: DType) -> Error {
    let fits = match got {
        DType::F16 => Some("F16"),
        DType::BF16 => Some("BF16"),
        DType::F32 => Some("F32"),
        _ => None,
    };
    let hint = match fits {
        Some(fits) => format!(
            "convert it first with `.to_dtype(DType::{:?})` or use `Tensor<{fits}>`",
            P::DTYPE
        ),
        None => format!(
            "typed tensors hold f32, f16 or bf16 values; keep integer tensors (token ids, \
             masks) as `candle_core::Tensor`, which regions and layers take as they are, or \
             convert values with `.to_dtype(DType::{:?})`",
            P::DTYPE
        ),
    };
    Error::Msg(format!(
        "{what}: expected a {:?} tensor for `Tensor<{}>`, got {got:?}; {hint}",
        P::DTYPE,
        P::NAME,
    ))
}

/// candle's shape accessors (`shape`, `dims`, `dim`, `dims1()`..`dims5()`, `rank`,
/// `elem_count`, `device`, `is_contiguous`) and indexing `i(..)`, for the typed tensor and the
/// region value alike (both wrap a candle tensor in `inner`).
macro_rules! shape_accessors {
    () => {
        /// The shape.
        pub fn shape(&self) -> &candle_core::Shape {
            self.inner.shape()
        }

        /// The dimensions.
        pub fn dims(&self) -> &[usize] {
            self.inner.dims()
        }

        /// The size of one dimension (`D::Minus1` for the last, as in candle).
        pub fn dim<D: candle_core::shape::Dim>(&self, dim: D) -> candle_core::Result<usize> {
            self.inner.dim(dim)
        }

        /// The number of dimensions.
        pub fn rank(&self) -> usize {
            self.inner.rank()
        }

        /// The number of elements.
        pub fn elem_count(&self) -> usize {
            self.inner.elem_count()
        }

        /// The device the data lives on.
        pub fn device(&self) -> &candle_core::Device {
            self.inner.device()
        }

        /// Whether the data is laid out contiguously.
        pub fn is_contiguous(&self) -> bool {
            self.inner.is_contiguous()
        }

        shape_accessors!(@ dims1 -> usize, dims2 -> (usize, usize),
            dims3 -> (usize, usize, usize), dims4 -> (usize, usize, usize, usize),
            dims5 -> (usize, usize, usize, usize, usize));

        /// Indexing as candle's `IndexOp::i`: `x.i((.., 0))`, `x.i(1..3)`; the same precision.
        /// An inclusive range ending at `usize::MAX` is an error (candle adds 1 to its end
        /// unchecked: a debug build panics there).
        pub fn i<I>(&self, index: I) -> candle_core::Result<Self>
        where
            candle_core::Tensor: candle_core::IndexOp<I>,
        {
            let inner = &self.inner;
            let index = std::panic::AssertUnwindSafe(move || candle_core::IndexOp::i(inner, index));
            let indexed = std::panic::catch_unwind(index).map_err(|_| {
                candle_core::Error::Msg(format!(
                    "i: an index range past the end of the dimensions {:?} (an inclusive range \
                     ending at usize::MAX overflows)",
                    self.inner.dims()
                ))
            })?
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "i: an index out of range of the dimensions {:?} (candle: {e})",
                    self.inner.dims()
                ))
            })?;
            Ok(Self::wrap(crate::kernels::layout::empty_at_start(indexed, inner)?))
        }
    };
    (@ $($name:ident -> $out:ty),*) => {$(
        #[doc = concat!("The dimensions, as candle's `", stringify!($name), "` (an error for another rank).")]
        pub fn $name(&self) -> candle_core::Result<$out> {
            self.inner.$name()
        }
    )*};
}

// ---------------------------------------------------------------------------------------------
// Typed ops in code a region calls. Autocast is per thread, as in PyTorch: a plain fn, method or
// trait default method called from a region, given typed tensors (a model's fields, `cast`
// results), runs each typed op where the region's policy puts it, not in the type's precision.

/// `t` at `dtype` (`None`: as it is).
pub(crate) fn at(t: &candle_core::Tensor, dtype: Option<DType>) -> Result<candle_core::Tensor> {
    match dtype {
        Some(d) => convert(t, d),
        None => Ok(t.clone()),
    }
}

/// Runs typed op `O` on `inputs`: as written (`run(None)`), except while a region that
/// autocasts is running on this thread outside any routed op
/// ([`followed`](crate::autocast_state::followed)): then `run` gets the dtype the region's policy
/// runs `O` in for these inputs and casts them there with [`at`], and the op is reported as a
/// routed one is. The result is what `run` made; [`Tensor::typed`] casts it to the signature's
/// precision.
pub(crate) fn follow<O: Op>(
    inputs: &[&candle_core::Tensor],
    run: impl FnOnce(Option<DType>) -> Result<candle_core::Tensor>,
) -> Result<candle_core::Tensor> {
    let Some(frame) = autocast_state::followed() else {
        return run(None);
    };
    let dtypes: Vec<DType> = autocast_state::promoting(inputs)
        .map(candle_core::Tensor::dtype)
        .collect();
    let target = frame.target::<O>(&dtypes)?;
    autocast_state::run_op(O::NAME, frame.class::<O>(), || inputs.to_vec(), target, run)
}

impl<P: Precision> Tensor<P> {
    /// A typed op's result in `P`, cast back when it followed a region into another dtype.
    pub(crate) fn typed(t: candle_core::Tensor) -> Result<Self> {
        convert(&t, P::DTYPE).map(Self::wrap)
    }

    /// One-input typed op `O` with an `R` result, `f` run on the input ([`follow`]).
    pub(crate) fn unary_op<O: Op, R: Precision>(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Tensor<R>> {
        Tensor::typed(follow::<O>(&[&self.inner], |t| f(&at(&self.inner, t)?))?)
    }

    /// Two-input typed op `O` with a `P` result, `f` run on both inputs ([`follow`]).
    pub(crate) fn binary_op<O: Op, Q: Precision>(
        &self,
        rhs: &Tensor<Q>,
        f: impl FnOnce(&candle_core::Tensor, &candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Self> {
        let (a, b) = (&self.inner, &rhs.inner);
        Self::typed(follow::<O>(&[a, b], |t| {
            let (x, y) = (at(a, t)?, at(b, t)?);
            crate::kernels::custom_grad::keep_operands(f(&x, &y)?, &x, &y)
        })?)
    }

    /// A user function `f` as typed op `O` (`lower_op`, `preserve_op`, `fp32_op`), with an `R`
    /// result: `f` must return the dtype it is given.
    pub(crate) fn closure_op<O: Op, R: Precision>(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Tensor<R>> {
        self.unary_op::<O, R>(|x| {
            let y = f(x)?;
            if y.dtype() == x.dtype() {
                Ok(y)
            } else {
                candle_core::bail!(
                    "`{}`: the function was given a {:?} tensor and returned {:?}; it must \
                     return the dtype it is given",
                    O::NAME,
                    x.dtype(),
                    y.dtype()
                )
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Boundary with candle, casts, constructors, accessors.
impl<P: Precision> Tensor<P> {
    /// Wraps a candle tensor whose dtype the caller guarantees to be `P::DTYPE`.
    pub(crate) fn wrap(inner: candle_core::Tensor) -> Self {
        debug_assert_eq!(inner.dtype(), P::DTYPE, "typed-tensor invariant broken");
        Self {
            inner,
            precision: PhantomData,
        }
    }

    /// Wraps a candle tensor, checking once that its dtype is `P::DTYPE`.
    ///
    /// A tensor of another dtype is an `Err` naming both dtypes; nothing is converted silently.
    pub fn from_candle(t: candle_core::Tensor) -> Result<Self> {
        if t.dtype() == P::DTYPE {
            Ok(Self::wrap(t))
        } else {
            Err(dtype_error::<P>("Tensor::from_candle", t.dtype()))
        }
    }

    /// The underlying candle tensor.
    pub fn as_candle(&self) -> &candle_core::Tensor {
        &self.inner
    }

    /// Unwraps into the underlying candle tensor.
    pub fn into_candle(self) -> candle_core::Tensor {
        self.inner
    }

    /// Casts to precision `Q`. When `Q` is `P` this is resolved at compile time to a handle
    /// clone: no kernel, no graph node, no copy.
    pub fn cast<Q: Precision>(&self) -> Result<Tensor<Q>> {
        if const { same::<P, Q>() } {
            Ok(Tensor::wrap(self.inner.clone()))
        } else {
            Ok(Tensor::wrap(convert(&self.inner, Q::DTYPE)?))
        }
    }

    /// Casts both operands to their promoted precision (the widest of the two), as PyTorch's
    /// promote-class ops do under autocast. `F16` with `BF16` does not compile.
    #[allow(clippy::type_complexity)]
    pub fn promote_with<Q: Precision>(
        &self,
        rhs: &Tensor<Q>,
    ) -> Result<(Tensor<P::Output>, Tensor<P::Output>)>
    where
        P: Promote<Q>,
    {
        Ok((self.cast()?, rhs.cast()?))
    }

    /// A tensor of zeros.
    pub fn zeros<S: Into<Shape>>(shape: S, device: &Device) -> Result<Self> {
        let shape = allocatable("zeros", shape)?;
        Ok(Self::wrap(candle_core::Tensor::zeros(
            shape,
            P::DTYPE,
            device,
        )?))
    }

    /// A tensor of ones.
    pub fn ones<S: Into<Shape>>(shape: S, device: &Device) -> Result<Self> {
        let shape = allocatable("ones", shape)?;
        Ok(Self::wrap(candle_core::Tensor::ones(
            shape,
            P::DTYPE,
            device,
        )?))
    }

    /// A tensor filled with `value` (rounded to `P`, `-0.0` kept); a finite value beyond `P`'s
    /// range is an error (f16 holds at most 65504: 70000 would be inf, which PyTorch's `full`
    /// gives without a word).
    pub fn full<S: Into<Shape>>(value: f64, shape: S, device: &Device) -> Result<Self> {
        if value.is_finite() && !fits::<P>(value) {
            candle_core::bail!("full: {value} overflows {:?}", P::DTYPE)
        }
        let shape = allocatable("full", shape)?;
        let t = candle_core::Tensor::full(value as f32, shape, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// Zeros of the same shape and device.
    pub fn zeros_like(&self) -> Result<Self> {
        Ok(Self::wrap(self.inner.zeros_like()?))
    }

    /// Ones of the same shape and device.
    pub fn ones_like(&self) -> Result<Self> {
        Ok(Self::wrap(self.inner.ones_like()?))
    }

    /// Normal samples with the given mean and standard deviation (finite, the deviation >= 0,
    /// as PyTorch's `normal_` requires), drawn in f32 then rounded to `P`.
    pub fn randn<S: Into<Shape>>(mean: f64, std: f64, shape: S, device: &Device) -> Result<Self> {
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            candle_core::bail!(
                "randn: the mean must be finite and the std finite and >= 0, got {mean} and {std}"
            )
        }
        let shape = allocatable("randn", shape)?;
        let t = candle_core::Tensor::randn(mean as f32, std as f32, shape, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// Uniform samples in `[lo, up)` (finite, `lo <= up`, as PyTorch's `uniform_` requires),
    /// drawn in f32 then rounded to `P`.
    pub fn rand<S: Into<Shape>>(lo: f64, up: f64, shape: S, device: &Device) -> Result<Self> {
        if !(lo.is_finite() && up.is_finite() && lo <= up) {
            candle_core::bail!("rand: the range must be finite with lo <= up, got [{lo}, {up})")
        }
        // A bound past `P`'s range would draw infinities (PyTorch: "to is out of bounds for
        // c10::Half").
        for (name, bound) in [("lo", lo), ("up", up)] {
            if !fits::<P>(bound) {
                candle_core::bail!(
                    "rand: {name} = {bound:e} is out of bounds for {:?} (its values would be inf)",
                    P::DTYPE
                )
            }
        }
        let shape = allocatable("rand", shape)?;
        if lo as f32 >= up as f32 {
            // An empty range, which candle's generator refuses: every value is `lo`, as
            // PyTorch's `uniform_(lo, lo)`.
            return Self::full(lo, shape, device);
        }
        let t = candle_core::Tensor::rand(lo as f32, up as f32, shape, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// A tensor from a (nested) array; the values are converted to `P`.
    pub fn new<A: candle_core::NdArray>(array: A, device: &Device) -> Result<Self> {
        let t = candle_core::Tensor::new(array, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// A tensor of the given shape from a slice; the values are converted to `P`.
    pub fn from_slice<D: WithDType, S: candle_core::shape::ShapeWithOneHole>(
        data: &[D],
        shape: S,
        device: &Device,
    ) -> Result<Self> {
        let t = candle_core::Tensor::from_slice(data, shape, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// A tensor of the given shape from a vector; the values are converted to `P`.
    pub fn from_vec<D: WithDType, S: candle_core::shape::ShapeWithOneHole>(
        data: Vec<D>,
        shape: S,
        device: &Device,
    ) -> Result<Self> {
        let t = candle_core::Tensor::from_vec(data, shape, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// The candle tensor converted to element type `S` (a no-op when `S` is `P`'s element type).
    fn as_elements<S: WithDType>(&self) -> Result<candle_core::Tensor> {
        self.inner.to_dtype(S::DTYPE)
    }

    /// The single value of a rank-0 tensor, converted to `S`.
    pub fn to_scalar<S: WithDType>(&self) -> Result<S> {
        self.as_elements::<S>()?.to_scalar()
    }

    /// Same as [`Tensor::to_scalar`], named like candle's.
    pub fn to_vec0<S: WithDType>(&self) -> Result<S> {
        self.to_scalar()
    }

    /// The values of a rank-1 tensor, converted to `S` (`to_vec1::<f32>()` works on any `P`).
    pub fn to_vec1<S: WithDType>(&self) -> Result<Vec<S>> {
        self.as_elements::<S>()?.to_vec1()
    }

    /// The values of a rank-2 tensor, converted to `S`.
    pub fn to_vec2<S: WithDType>(&self) -> Result<Vec<Vec<S>>> {
        self.as_elements::<S>()?.to_vec2()
    }

    /// The values of a rank-3 tensor, converted to `S`.
    pub fn to_vec3<S: WithDType>(&self) -> Result<Vec<Vec<Vec<S>>>> {
        self.as_elements::<S>()?.to_vec3()
    }

    /// All values in row-major order, converted to `S`, whatever the rank.
    pub fn to_flat_vec<S: WithDType>(&self) -> Result<Vec<S>> {
        self.as_elements::<S>()?.flatten_all()?.to_vec1()
    }

    /// The candle dtype, always `P::DTYPE`.
    pub fn dtype(&self) -> DType {
        P::DTYPE
    }

    shape_accessors!();

    /// A copy on another device.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self::wrap(self.inner.to_device(device)?))
    }

    /// The same values, cut from the autograd graph.
    pub fn detach(&self) -> Self {
        Self::wrap(self.inner.detach())
    }
}

mod binary;
mod preserve;

/// Whether `value` rounded to `P` is finite.
#[allow(clippy::cast_possible_truncation)] // the rounding asked about
fn fits<P: Precision>(value: f64) -> bool {
    match P::DTYPE {
        DType::F16 => half::f16::from_f64(value).is_finite(),
        DType::BF16 => half::bf16::from_f64(value).is_finite(),
        _ => (value as f32).is_finite(),
    }
}

/// `shape`, when a tensor of it could exist ([`crate::kernels::layout::check_allocatable`]):
/// candle multiplies the dimensions unchecked (a panic in a debug build, a wrapped size in a
/// release one).
pub(crate) fn allocatable<S: Into<Shape>>(op: &str, shape: S) -> Result<Shape> {
    let shape = shape.into();
    crate::kernels::layout::check_allocatable(op, shape.dims())?;
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::{BF16, F16};

    #[test]
    fn from_candle_rejects_the_wrong_dtype_with_both_names() {
        let t = candle_core::Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let err = Tensor::<F16>::from_candle(t).unwrap_err().to_string();
        assert!(err.contains("F16") && err.contains("F32"), "{err}");
        let t = candle_core::Tensor::zeros(3, DType::U32, &Device::Cpu).unwrap();
        assert!(Tensor::<BF16>::from_candle(t).is_err());
    }

    #[test]
    fn cast_to_same_precision_shares_storage() -> Result<()> {
        let x = Tensor::<F16>::ones(4, &Device::Cpu)?;
        let y = x.cast::<F16>()?;
        assert_eq!(x.as_candle().id(), y.as_candle().id());
        let z = x.cast::<F32>()?;
        assert_ne!(x.as_candle().id(), z.as_candle().id());
        Ok(())
    }
}
