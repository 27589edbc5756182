//! `Tensor<P>`: a candle tensor whose precision is part of its type.
//!
//! Method names and argument order follow `candle_core::Tensor`. What changes is what compiles:
//! - binary ops take operands of one precision ([`SamePrecision`]);
//! - fp32-class ops (`sum`, `exp`, `log`, ...) exist on `Tensor<F32>` only ([`Fp32Input`]), and
//!   return `Tensor<F32>`; under an autocast region the policy upcasts for you;
//! - lower-precision ops (`matmul`, `conv2d`) and precision-preserving ops run in `P`.
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

use crate::fp32;
use crate::op::{self, Fp32Input, SamePrecision};
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

/// The error `from_candle` returns for a tensor of the wrong dtype.
pub(crate) fn dtype_error<P: Precision>(what: &str, got: DType) -> Error {
    Error::Msg(format!(
        "{what}: expected a {:?} tensor for `Tensor<{}>`, got {got:?}; convert it first with \
         `.to_dtype(DType::{:?})` or use `Tensor<{}>`",
        P::DTYPE,
        P::NAME,
        P::DTYPE,
        match got {
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            _ => "a float type: F32, F16 or BF16",
        }
    ))
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
            Ok(Tensor::wrap(crate::autocast::convert(
                &self.inner,
                Q::DTYPE,
            )?))
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
        Ok(Self::wrap(candle_core::Tensor::zeros(
            shape,
            P::DTYPE,
            device,
        )?))
    }

    /// A tensor of ones.
    pub fn ones<S: Into<Shape>>(shape: S, device: &Device) -> Result<Self> {
        Ok(Self::wrap(candle_core::Tensor::ones(
            shape,
            P::DTYPE,
            device,
        )?))
    }

    /// A tensor filled with `value` (rounded to `P`).
    pub fn full<S: Into<Shape>>(value: f64, shape: S, device: &Device) -> Result<Self> {
        Self::ones(shape, device)?.affine(0.0, value)
    }

    /// Zeros of the same shape and device.
    pub fn zeros_like(&self) -> Result<Self> {
        Ok(Self::wrap(self.inner.zeros_like()?))
    }

    /// Ones of the same shape and device.
    pub fn ones_like(&self) -> Result<Self> {
        Ok(Self::wrap(self.inner.ones_like()?))
    }

    /// Normal samples with the given mean and standard deviation, drawn in f32 then rounded to `P`.
    pub fn randn<S: Into<Shape>>(mean: f64, std: f64, shape: S, device: &Device) -> Result<Self> {
        let t = candle_core::Tensor::randn(mean as f32, std as f32, shape, device)?;
        Ok(Self::wrap(t.to_dtype(P::DTYPE)?))
    }

    /// Uniform samples in `[lo, up)`, drawn in f32 then rounded to `P`.
    pub fn rand<S: Into<Shape>>(lo: f64, up: f64, shape: S, device: &Device) -> Result<Self> {
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

    /// The shape.
    pub fn shape(&self) -> &Shape {
        self.inner.shape()
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.inner.dims()
    }

    /// The size of one dimension.
    pub fn dim<D: candle_core::shape::Dim>(&self, dim: D) -> Result<usize> {
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
    pub fn device(&self) -> &Device {
        self.inner.device()
    }

    /// A copy on another device.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self::wrap(self.inner.to_device(device)?))
    }

    /// The same values, cut from the autograd graph.
    pub fn detach(&self) -> Self {
        Self::wrap(self.inner.detach())
    }
}

// ---------------------------------------------------------------------------------------------
// Precision-preserving ops: unary maps and shape ops run in `P` and return `Tensor<P>`.
macro_rules! preserve_unary {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> Result<Self> {
            Ok(Self::wrap(self.inner.$name()?))
        }
    )*};
}

macro_rules! preserve_along_dim {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Self> {
            Ok(Self::wrap(self.inner.$name(dim)?))
        }
    )*};
}

impl<P: Precision> Tensor<P> {
    preserve_unary!(
        /// `max(x, 0)`.
        relu,
        /// GELU, tanh approximation (candle's `gelu`).
        gelu,
        /// GELU, exact erf form (PyTorch's default `gelu`).
        gelu_erf,
        /// `x * sigmoid(x)`.
        silu,
        /// Hyperbolic tangent.
        tanh,
        /// `-x`.
        neg,
        /// `x * x`.
        sqr,
        /// Square root.
        sqrt,
        /// Absolute value.
        abs,
        /// A contiguous copy (or the same tensor when already contiguous).
        contiguous,
        /// Transpose of the last two dimensions.
        t,
        /// Flattens every dimension into one.
        flatten_all,
    );

    /// `1 / (1 + exp(-x))`, differentiable (candle-nn's `ops::sigmoid`).
    pub fn sigmoid(&self) -> Result<Self> {
        Ok(Self::wrap(candle_nn::ops::sigmoid(&self.inner)?))
    }

    /// `x * mul + add`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<Self> {
        Ok(Self::wrap(self.inner.affine(mul, add)?))
    }

    /// Same data, new shape (one dimension may be `()`-inferred as in candle).
    pub fn reshape<S: candle_core::shape::ShapeWithOneHole>(&self, shape: S) -> Result<Self> {
        Ok(Self::wrap(self.inner.reshape(shape)?))
    }

    /// Swaps two dimensions.
    pub fn transpose<D1: candle_core::shape::Dim, D2: candle_core::shape::Dim>(
        &self,
        dim1: D1,
        dim2: D2,
    ) -> Result<Self> {
        Ok(Self::wrap(self.inner.transpose(dim1, dim2)?))
    }

    /// Reorders the dimensions.
    pub fn permute<D: candle_core::shape::Dims>(&self, dims: D) -> Result<Self> {
        Ok(Self::wrap(self.inner.permute(dims)?))
    }

    /// `len` entries of dimension `dim` starting at `start`.
    pub fn narrow<D: candle_core::shape::Dim>(
        &self,
        dim: D,
        start: usize,
        len: usize,
    ) -> Result<Self> {
        Ok(Self::wrap(self.inner.narrow(dim, start, len)?))
    }

    /// Splits into `chunks` pieces along `dim`.
    pub fn chunk<D: candle_core::shape::Dim>(&self, chunks: usize, dim: D) -> Result<Vec<Self>> {
        Ok(self
            .inner
            .chunk(chunks, dim)?
            .into_iter()
            .map(Self::wrap)
            .collect())
    }

    /// Flattens dimensions `start..=end` into one.
    pub fn flatten<D1: candle_core::shape::Dim, D2: candle_core::shape::Dim>(
        &self,
        start: D1,
        end: D2,
    ) -> Result<Self> {
        Ok(Self::wrap(self.inner.flatten(start, end)?))
    }

    /// Broadcasts to `shape`.
    pub fn broadcast_as<S: Into<Shape>>(&self, shape: S) -> Result<Self> {
        Ok(Self::wrap(self.inner.broadcast_as(shape)?))
    }

    /// Broadcasts by adding leading dimensions.
    pub fn broadcast_left<S: Into<Shape>>(&self, left: S) -> Result<Self> {
        Ok(Self::wrap(self.inner.broadcast_left(left)?))
    }

    /// Pads `dim` with zeros on both sides.
    pub fn pad_with_zeros<D: candle_core::shape::Dim>(
        &self,
        dim: D,
        left: usize,
        right: usize,
    ) -> Result<Self> {
        Ok(Self::wrap(self.inner.pad_with_zeros(dim, left, right)?))
    }

    /// Rows selected by integer ids along `dim` (ids are a plain candle tensor).
    pub fn index_select<D: candle_core::shape::Dim>(
        &self,
        ids: &candle_core::Tensor,
        dim: D,
    ) -> Result<Self> {
        Ok(Self::wrap(self.inner.index_select(ids, dim)?))
    }

    preserve_along_dim!(
        /// Flattens dimensions `dim..` into one.
        flatten_from,
        /// Flattens dimensions `..=dim` into one.
        flatten_to,
        /// Removes a dimension of size 1.
        squeeze,
        /// Inserts a dimension of size 1.
        unsqueeze,
        /// Maximum over `dim`, kept as a size-1 dimension. Exact in any precision, so it is
        /// precision-preserving (PyTorch's autocast does not upcast it either).
        max_keepdim,
        /// Maximum over `dim`.
        max,
        /// Minimum over `dim`, kept as a size-1 dimension.
        min_keepdim,
        /// Minimum over `dim`.
        min,
    );

    /// Maximum of all elements (rank 0).
    pub fn max_all(&self) -> Result<Self> {
        Ok(Self::wrap(self.inner.max_all()?))
    }

    /// Minimum of all elements (rank 0).
    pub fn min_all(&self) -> Result<Self> {
        Ok(Self::wrap(self.inner.min_all()?))
    }

    /// Indices of the maxima over `dim`, as a plain `u32` candle tensor.
    pub fn argmax<D: candle_core::shape::Dim>(&self, dim: D) -> Result<candle_core::Tensor> {
        self.inner.argmax(dim)
    }

    /// 2-D max pooling over the last two dimensions, stride = kernel size.
    pub fn max_pool2d<T: candle_core::ToUsize2>(&self, kernel: T) -> Result<Self> {
        Ok(Self::wrap(self.inner.max_pool2d(kernel)?))
    }

    /// 2-D max pooling with an explicit stride.
    pub fn max_pool2d_with_stride<T: candle_core::ToUsize2>(
        &self,
        kernel: T,
        stride: T,
    ) -> Result<Self> {
        Ok(Self::wrap(
            self.inner.max_pool2d_with_stride(kernel, stride)?,
        ))
    }

    /// 2-D average pooling, stride = kernel size. Averages a few values only, so it stays in
    /// `P` (PyTorch's autocast does not upcast pooling).
    pub fn avg_pool2d<T: candle_core::ToUsize2>(&self, kernel: T) -> Result<Self> {
        Ok(Self::wrap(self.inner.avg_pool2d(kernel)?))
    }

    /// 2-D average pooling with an explicit stride.
    pub fn avg_pool2d_with_stride<T: candle_core::ToUsize2>(
        &self,
        kernel: T,
        stride: T,
    ) -> Result<Self> {
        Ok(Self::wrap(
            self.inner.avg_pool2d_with_stride(kernel, stride)?,
        ))
    }

    /// Concatenates tensors of one precision along `dim`.
    ///
    /// Mixed precisions do not fit in one slice: promote them first with
    /// [`Tensor::promote_with`] or `.cast()`, or concatenate inside an autocast region.
    pub fn cat<A: AsRef<Tensor<P>>, D: candle_core::shape::Dim>(
        tensors: &[A],
        dim: D,
    ) -> Result<Self> {
        let inner: Vec<&candle_core::Tensor> = tensors.iter().map(|t| &t.as_ref().inner).collect();
        Ok(Self::wrap(candle_core::Tensor::cat(&inner, dim)?))
    }

    /// Stacks tensors of one precision along a new dimension `dim`.
    pub fn stack<A: AsRef<Tensor<P>>, D: candle_core::shape::Dim>(
        tensors: &[A],
        dim: D,
    ) -> Result<Self> {
        let inner: Vec<&candle_core::Tensor> = tensors.iter().map(|t| &t.as_ref().inner).collect();
        Ok(Self::wrap(candle_core::Tensor::stack(&inner, dim)?))
    }
}

// ---------------------------------------------------------------------------------------------
// Binary ops: operands of one precision outside autocast.

macro_rules! binary {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
        where
            Q: SamePrecision<P, op::$name>,
        {
            Ok(Self::wrap(self.inner.$name(&rhs.inner)?))
        }
    )*};
}

impl<P: Precision> Tensor<P> {
    binary!(
        /// Elementwise sum (same shapes).
        add,
        /// Elementwise difference (same shapes).
        sub,
        /// Elementwise product (same shapes).
        mul,
        /// Elementwise quotient (same shapes).
        div,
        /// Sum with broadcasting.
        broadcast_add,
        /// Difference with broadcasting.
        broadcast_sub,
        /// Product with broadcasting.
        broadcast_mul,
        /// Quotient with broadcasting.
        broadcast_div,
        /// Elementwise maximum.
        maximum,
        /// Elementwise minimum.
        minimum,
        /// Matrix product over the last two dimensions (a lower-precision op under autocast).
        matmul,
        /// Matrix product with broadcasting of the batch dimensions.
        broadcast_matmul,
    );
}

// ---------------------------------------------------------------------------------------------
// Convolutions: lower-precision ops. Half-precision conv2d on CPU (bf16, which candle lacks,
// and f16) goes through `crate::kernels`.
impl<P: Precision> Tensor<P> {
    /// 1-D convolution; `self` is `(batch, c_in, length)`, `kernel` `(c_out, c_in / groups, k)`.
    pub fn conv1d<Q>(
        &self,
        kernel: &Tensor<Q>,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Self>
    where
        Q: SamePrecision<P, op::conv1d>,
    {
        Ok(Self::wrap(self.inner.conv1d(
            &kernel.inner,
            padding,
            stride,
            dilation,
            groups,
        )?))
    }

    /// 2-D convolution; `self` is `(batch, c_in, h, w)`, `kernel` `(c_out, c_in / groups, kh, kw)`.
    pub fn conv2d<Q>(
        &self,
        kernel: &Tensor<Q>,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Self>
    where
        Q: SamePrecision<P, op::conv2d>,
    {
        let params = crate::kernels::Conv2dParams {
            padding,
            stride,
            dilation,
            groups,
        };
        crate::kernels::conv2d(&self.inner, &kernel.inner, params).map(Self::wrap)
    }

    /// 1-D transposed convolution; `kernel` is `(c_in, c_out / groups, k)`.
    pub fn conv_transpose1d<Q>(
        &self,
        kernel: &Tensor<Q>,
        padding: usize,
        output_padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<Self>
    where
        Q: SamePrecision<P, op::conv_transpose1d>,
    {
        Ok(Self::wrap(self.inner.conv_transpose1d(
            &kernel.inner,
            padding,
            output_padding,
            stride,
            dilation,
            groups,
        )?))
    }

    /// 2-D transposed convolution; `kernel` is `(c_in, c_out, kh, kw)`.
    pub fn conv_transpose2d<Q>(
        &self,
        kernel: &Tensor<Q>,
        padding: usize,
        output_padding: usize,
        stride: usize,
        dilation: usize,
    ) -> Result<Self>
    where
        Q: SamePrecision<P, op::conv_transpose2d>,
    {
        Ok(Self::wrap(self.inner.conv_transpose2d(
            &kernel.inner,
            padding,
            output_padding,
            stride,
            dilation,
        )?))
    }
}

// ---------------------------------------------------------------------------------------------
// fp32-class ops: `Tensor<F32>` only outside autocast (the bound names the op in the error).
// They accumulate in f32; `crate::fp32` has the same ops for any input precision.
macro_rules! fp32_methods {
    ($($(#[$doc:meta])* $name:ident $(<$g:ident: $bound:path>)? ($($arg:ident: $ty:ty),*);)*) => {$(
        $(#[$doc])*
        pub fn $name$(<$g: $bound>)?(&self, $($arg: $ty),*) -> Result<Tensor<F32>>
        where
            P: Fp32Input<op::$name>,
        {
            fp32::$name(self, $($arg),*)
        }
    )*};
}

impl<P: Precision> Tensor<P> {
    fp32_methods! {
        /// Sum over `dims`, kept as size-1 dimensions.
        sum_keepdim<D: candle_core::shape::Dims>(dims: D);
        /// Sum over `dims`.
        sum<D: candle_core::shape::Dims>(dims: D);
        /// Sum of all elements (rank 0).
        sum_all();
        /// Mean over `dims`, kept as size-1 dimensions.
        mean_keepdim<D: candle_core::shape::Dims>(dims: D);
        /// Mean over `dims`.
        mean<D: candle_core::shape::Dims>(dims: D);
        /// Mean of all elements (rank 0).
        mean_all();
        /// `exp(x)`.
        exp();
        /// Natural logarithm.
        log();
        /// `x ^ e` for a scalar exponent.
        powf(e: f64);
        /// `x ^ rhs` elementwise.
        pow(rhs: &Tensor<F32>);
        /// `1 / x`.
        recip();
        /// `log(sum(exp(x)))` over `dims`, computed stably.
        log_sum_exp<D: candle_core::shape::Dims>(dims: D);
        /// Cumulative sum along `dim`.
        cumsum<D: candle_core::shape::Dim>(dim: D);
    }
}

// ---------------------------------------------------------------------------------------------
// Operators on references: `&a + &b` (one precision) and `&a * 2.0` (or `a * 2.0`), returning
// `Result` as candle's operators do.
macro_rules! operator {
    ($trait:ident, $fn:ident, $op:ident, $mul:expr, $add:expr) => {
        impl<'a, P: Precision, Q> std::ops::$trait<&'a Tensor<Q>> for &'a Tensor<P>
        where
            Q: SamePrecision<P, op::$op>,
        {
            type Output = Result<Tensor<P>>;
            fn $fn(self, rhs: &'a Tensor<Q>) -> Result<Tensor<P>> {
                self.$op(rhs)
            }
        }

        impl<P: Precision> std::ops::$trait<f64> for &Tensor<P> {
            type Output = Result<Tensor<P>>;
            fn $fn(self, rhs: f64) -> Result<Tensor<P>> {
                let (mul, add): (fn(f64) -> f64, fn(f64) -> f64) = ($mul, $add);
                self.affine(mul(rhs), add(rhs))
            }
        }

        impl<P: Precision> std::ops::$trait<f64> for Tensor<P> {
            type Output = Result<Tensor<P>>;
            fn $fn(self, rhs: f64) -> Result<Tensor<P>> {
                std::ops::$trait::$fn(&self, rhs)
            }
        }
    };
}
operator!(Add, add, add, |_| 1.0, |s| s);
operator!(Sub, sub, sub, |_| 1.0, |s| -s);
operator!(Mul, mul, mul, |s| s, |_| 0.0);
operator!(Div, div, div, |s| 1.0 / s, |_| 0.0);

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
