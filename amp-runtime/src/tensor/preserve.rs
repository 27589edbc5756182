//! Precision-preserving ops of `Tensor<P>`: unary maps and shape ops run in `P` and return
//! `Tensor<P>`.

use candle_core::{Result, Shape};

use super::Tensor;
use crate::precision::Precision;

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
    /// `max(x, 0)`; NaN stays NaN, as in PyTorch (one op with a one-pass backward on CPU).
    pub fn relu(&self) -> Result<Self> {
        crate::kernels::relu(&self.inner).map(Self::wrap)
    }

    /// GELU, tanh approximation (candle's `gelu`, PyTorch's `approximate="tanh"`); on CPU one
    /// op computed in f32 and rounded once, with a one-pass backward.
    pub fn gelu(&self) -> Result<Self> {
        crate::kernels::gelu(&self.inner).map(Self::wrap)
    }

    /// GELU, exact erf form (PyTorch's default `gelu`); on CPU as [`Self::gelu`].
    pub fn gelu_erf(&self) -> Result<Self> {
        crate::kernels::gelu_erf(&self.inner).map(Self::wrap)
    }

    /// `x * sigmoid(x)`; on CPU as [`Self::gelu`].
    pub fn silu(&self) -> Result<Self> {
        crate::kernels::silu(&self.inner).map(Self::wrap)
    }

    preserve_unary!(
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

    /// `x * mul + add`, computed in f32 and rounded once for a half tensor (candle's `affine`
    /// rounds `mul` and `add` to the tensor's dtype first, then rounds twice).
    pub fn affine(&self, mul: f64, add: f64) -> Result<Self> {
        crate::kernels::affine(&self.inner, mul, add).map(Self::wrap)
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

    /// Broadcasts to `shape`: a view, except that a half tensor that tracks is copied through
    /// f32, so that its gradient is summed over the new dimensions in f32 (candle sums a view's
    /// gradient in half).
    pub fn broadcast_as<S: Into<Shape>>(&self, shape: S) -> Result<Self> {
        crate::kernels::spread(&self.inner, &shape.into()).map(Self::wrap)
    }

    /// Broadcasts by adding leading dimensions (as [`Self::broadcast_as`]).
    pub fn broadcast_left<S: Into<Shape>>(&self, left: S) -> Result<Self> {
        let shape = [left.into().dims(), self.dims()].concat();
        crate::kernels::spread(&self.inner, &Shape::from(shape)).map(Self::wrap)
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

    /// Any candle function on the data, run in `P` (outside a region: the op's class is the
    /// caller's business; inside one the region routes it as a lower-precision op). The result
    /// must have `P`'s dtype.
    pub fn lower_op(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Self> {
        Self::from_candle(f(&self.inner)?)
    }

    /// Any candle function on the data, run in `P`, precision-preserving (outside a region the
    /// same as [`Tensor::lower_op`]; inside one the value keeps its dtype). The result must have
    /// `P`'s dtype.
    pub fn preserve_op(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Self> {
        self.lower_op(f)
    }

    /// Clamps to `[min, max]`.
    pub fn clamp(&self, min: f64, max: f64) -> Result<Self> {
        Ok(Self::wrap(self.inner.clamp(min, max)?))
    }

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
        let kernel = kernel.to_usize2();
        self.max_pool2d_with_stride(kernel, kernel)
    }

    /// 2-D max pooling with an explicit stride (on CPU with a backward for any stride, where
    /// candle's has none unless stride = window, and each gradient whole on its maximum).
    pub fn max_pool2d_with_stride<T: candle_core::ToUsize2>(
        &self,
        kernel: T,
        stride: T,
    ) -> Result<Self> {
        let pool = crate::kernels::Pool2d {
            kernel: kernel.to_usize2(),
            stride: stride.to_usize2(),
            padding: 0,
        };
        crate::kernels::max_pool2d(&self.inner, pool).map(Self::wrap)
    }

    /// 2-D average pooling, stride = kernel size. Stays in `P` (PyTorch's autocast does not
    /// upcast pooling); on CPU each window is summed in f32 and the mean rounded once.
    pub fn avg_pool2d<T: candle_core::ToUsize2>(&self, kernel: T) -> Result<Self> {
        let kernel = kernel.to_usize2();
        self.avg_pool2d_with_stride(kernel, kernel)
    }

    /// 2-D average pooling with an explicit stride (on CPU with a backward for any stride,
    /// where candle's has none unless stride = window).
    pub fn avg_pool2d_with_stride<T: candle_core::ToUsize2>(
        &self,
        kernel: T,
        stride: T,
    ) -> Result<Self> {
        let pool = crate::kernels::Pool2d {
            kernel: kernel.to_usize2(),
            stride: stride.to_usize2(),
            padding: 0,
        };
        crate::kernels::avg_pool2d(&self.inner, pool).map(Self::wrap)
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
