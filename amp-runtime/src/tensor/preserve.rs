//! Precision-preserving ops of `Tensor<P>`: unary maps and shape ops run in `P` and return
//! `Tensor<P>`.

use candle_core::{Result, Shape};

use super::Tensor;
use crate::kernels::layout::empty_at_start;
use crate::op;
use crate::precision::Precision;

macro_rules! preserve_unary {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> Result<Self> {
            self.unary_op::<op::$name, P>(|x| x.$name())
        }
    )*};
}

macro_rules! preserve_along_dim {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Self> {
            self.unary_op::<op::$name, P>(|x| x.$name(dim))
        }
    )*};
}

impl<P: Precision> Tensor<P> {
    /// `max(x, 0)`; NaN stays NaN, as in PyTorch (one op with a one-pass backward on CPU).
    pub fn relu(&self) -> Result<Self> {
        self.unary_op::<op::relu, P>(crate::kernels::relu)
    }

    /// GELU, tanh approximation (candle's `gelu`, PyTorch's `approximate="tanh"`); on CPU one
    /// op computed in f32 and rounded once, with a one-pass backward.
    pub fn gelu(&self) -> Result<Self> {
        self.unary_op::<op::gelu, P>(crate::kernels::gelu)
    }

    /// GELU, exact erf form (PyTorch's default `gelu`); on CPU as [`Self::gelu`].
    pub fn gelu_erf(&self) -> Result<Self> {
        self.unary_op::<op::gelu_erf, P>(crate::kernels::gelu_erf)
    }

    /// `x * sigmoid(x)`; on CPU as [`Self::gelu`].
    pub fn silu(&self) -> Result<Self> {
        self.unary_op::<op::silu, P>(crate::kernels::silu)
    }

    preserve_unary!(
        /// Hyperbolic tangent.
        tanh,
        /// `-x`.
        neg,
        /// Square root.
        sqrt,
        /// A contiguous copy (or the same tensor when already contiguous).
        contiguous,
        /// Transpose of the last two dimensions.
        t,
        /// Flattens every dimension into one.
        flatten_all,
    );

    /// `1 / (1 + exp(-x))`, differentiable (candle-nn's `ops::sigmoid`), computed in f32 and
    /// rounded once for a half tensor, as PyTorch's.
    pub fn sigmoid(&self) -> Result<Self> {
        self.unary_op::<op::sigmoid, P>(|x| crate::kernels::in_f32(x, candle_nn::ops::sigmoid))
    }

    /// `x * mul + add`, computed in f32 and rounded once for a half tensor (candle's `affine`
    /// rounds `mul` and `add` to the tensor's dtype first, then rounds twice).
    pub fn affine(&self, mul: f64, add: f64) -> Result<Self> {
        self.unary_op::<op::affine, P>(|x| crate::kernels::affine(x, mul, add))
    }

    /// Same data, new shape (one dimension may be `()`-inferred as in candle).
    pub fn reshape<S: candle_core::shape::ShapeWithOneHole>(&self, shape: S) -> Result<Self> {
        // candle multiplies the dimensions unchecked while it resolves the shape: a debug build
        // panics on a product that overflows (a release build wraps, then reports a mismatch).
        let n = self.elem_count();
        let resolve = std::panic::AssertUnwindSafe(move || shape.into_shape(n));
        let shape = std::panic::catch_unwind(resolve).map_err(|_| {
            candle_core::Error::Msg(
                "reshape: the shape's size overflows: too large to allocate".into(),
            )
        })??;
        let shape = super::allocatable("reshape", shape)?;
        self.unary_op::<op::reshape, P>(|x| x.reshape(shape))
    }

    /// Swaps two dimensions.
    pub fn transpose<D1: candle_core::shape::Dim, D2: candle_core::shape::Dim>(
        &self,
        dim1: D1,
        dim2: D2,
    ) -> Result<Self> {
        self.unary_op::<op::transpose, P>(|x| x.transpose(dim1, dim2))
    }

    /// Reorders the dimensions.
    pub fn permute<D: candle_core::shape::Dims>(&self, dims: D) -> Result<Self> {
        self.unary_op::<op::permute, P>(|x| x.permute(dims))
    }

    /// `len` entries of dimension `dim` starting at `start`.
    pub fn narrow<D: candle_core::shape::Dim>(
        &self,
        dim: D,
        start: usize,
        len: usize,
    ) -> Result<Self> {
        self.unary_op::<op::narrow, P>(|x| empty_at_start(x.narrow(dim, start, len)?, x))
    }

    /// Splits into `chunks` pieces along `dim`, as PyTorch's `chunk`: pieces of
    /// `ceil(size / chunks)`, the last one shorter, fewer than `chunks` when they run out (`7`
    /// in 3: `3, 3, 1`; `6` in 4: `2, 2, 2`), and `chunks` empty pieces of an empty dimension,
    /// so that `let [a, b] = ..` holds. candle's `chunk`, which a region value's is, spreads the
    /// remainder over the first pieces instead (`3, 2, 2`); an even split is the same in both.
    pub fn chunk<D: candle_core::shape::Dim>(&self, chunks: usize, dim: D) -> Result<Vec<Self>> {
        if chunks == 0 {
            candle_core::bail!("chunk: the number of chunks must be positive, got 0")
        }
        let dim = dim.to_index(self.inner.shape(), "chunk")?;
        let size = self.inner.dim(dim)?;
        if size == 0 {
            return Ok(vec![self.clone(); chunks]);
        }
        let piece = size.div_ceil(chunks);
        (0..size)
            .step_by(piece)
            .map(|start| {
                let view = self.inner.narrow(dim, start, piece.min(size - start))?;
                Ok(Self::wrap(empty_at_start(view, &self.inner)?))
            })
            .collect()
    }

    /// Flattens dimensions `start..=end` into one.
    pub fn flatten<D1: candle_core::shape::Dim, D2: candle_core::shape::Dim>(
        &self,
        start: D1,
        end: D2,
    ) -> Result<Self> {
        let (first, last) = (
            start.to_index(self.shape(), "flatten")?,
            end.to_index(self.shape(), "flatten")?,
        );
        if first > last {
            candle_core::bail!("flatten: the start dimension {first} comes after the end {last}")
        }
        self.unary_op::<op::flatten, P>(|x| x.flatten(first, last))
    }

    /// Broadcasts to `shape`: a view, except that a half tensor that tracks is copied through
    /// f32, so that its gradient is summed over the new dimensions in f32 (candle sums a view's
    /// gradient in half).
    pub fn broadcast_as<S: Into<Shape>>(&self, shape: S) -> Result<Self> {
        let shape = super::allocatable("broadcast_as", shape)?;
        self.unary_op::<op::broadcast_as, P>(|x| crate::kernels::spread(x, &shape))
    }

    /// Broadcasts by adding leading dimensions (as [`Self::broadcast_as`]).
    pub fn broadcast_left<S: Into<Shape>>(&self, left: S) -> Result<Self> {
        let shape =
            super::allocatable("broadcast_left", [left.into().dims(), self.dims()].concat())?;
        self.unary_op::<op::broadcast_left, P>(|x| crate::kernels::spread(x, &shape))
    }

    /// Pads `dim` with zeros on both sides.
    pub fn pad_with_zeros<D: candle_core::shape::Dim>(
        &self,
        dim: D,
        left: usize,
        right: usize,
    ) -> Result<Self> {
        let d = dim.to_index(self.shape(), "pad_with_zeros")?;
        let mut dims = self.dims().to_vec();
        dims[d] = dims[d]
            .checked_add(left)
            .and_then(|n| n.checked_add(right))
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("pad_with_zeros: {left} + {right} overflows"))
            })?;
        super::allocatable("pad_with_zeros", dims)?;
        self.unary_op::<op::pad_with_zeros, P>(|x| x.pad_with_zeros(d, left, right))
    }

    /// Rows selected by integer ids along `dim` (ids are a plain candle tensor).
    pub fn index_select<D: candle_core::shape::Dim>(
        &self,
        ids: &candle_core::Tensor,
        dim: D,
    ) -> Result<Self> {
        self.unary_op::<op::index_select, P>(|x| {
            crate::kernels::index_select(x, ids, dim.to_index(x.shape(), "index_select")?)
        })
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
    );

    /// Maximum over `dim`, kept as a size-1 dimension; NaN where the slice holds one, as
    /// PyTorch (candle's skips it). Exact in any precision, so it is precision-preserving
    /// (PyTorch's autocast does not upcast it either).
    pub fn max_keepdim<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Self> {
        self.unary_op::<op::max_keepdim, P>(|x| crate::kernels::extrema::max(x, dim, true))
    }

    /// Maximum over `dim` (NaN as [`Self::max_keepdim`]).
    pub fn max<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Self> {
        self.unary_op::<op::max, P>(|x| crate::kernels::extrema::max(x, dim, false))
    }

    /// Minimum over `dim`, kept as a size-1 dimension (NaN as [`Self::max_keepdim`]).
    pub fn min_keepdim<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Self> {
        self.unary_op::<op::min_keepdim, P>(|x| crate::kernels::extrema::min(x, dim, true))
    }

    /// Minimum over `dim` (NaN as [`Self::max_keepdim`]).
    pub fn min<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Self> {
        self.unary_op::<op::min, P>(|x| crate::kernels::extrema::min(x, dim, false))
    }

    /// Any candle function on the data, run in `P` (outside a region: the op's class is the
    /// caller's business; inside one, or in code one calls, it runs as a lower-precision op).
    /// `f` must return the dtype it is given.
    pub fn lower_op(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Self> {
        self.closure_op::<op::lower_op, P>(f)
    }

    /// Any candle function on the data, run in `P`, precision-preserving (outside a region the
    /// same as [`Tensor::lower_op`]; inside one the value keeps its dtype). `f` must return the
    /// dtype it is given.
    pub fn preserve_op(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Self> {
        self.closure_op::<op::preserve_op, P>(f)
    }

    /// Absolute value; its gradient is PyTorch's, `sign(x)`: 0 at 0, -0.0 and NaN.
    pub fn abs(&self) -> Result<Self> {
        self.unary_op::<op::abs, P>(crate::kernels::extrema::abs)
    }

    /// Clamps to `[min, max]` (NaN kept; scalars of any of candle's element types); the gradient
    /// passes strictly inside, as PyTorch's.
    pub fn clamp<A: candle_core::WithDType, B: candle_core::WithDType>(
        &self,
        min: A,
        max: B,
    ) -> Result<Self> {
        let (min, max) = (min.to_f64(), max.to_f64());
        self.unary_op::<op::clamp, P>(|x| crate::kernels::extrema::clamp(x, min, max))
    }

    /// Maximum of all elements (rank 0), NaN if any is.
    pub fn max_all(&self) -> Result<Self> {
        self.unary_op::<op::max_all, P>(crate::kernels::extrema::max_all)
    }

    /// Minimum of all elements (rank 0), NaN if any is.
    pub fn min_all(&self) -> Result<Self> {
        self.unary_op::<op::min_all, P>(crate::kernels::extrema::min_all)
    }

    /// Indices of the maxima over `dim`, as a plain `u32` candle tensor; a slice holding NaN
    /// gives its first NaN's index, as PyTorch.
    pub fn argmax<D: candle_core::shape::Dim>(&self, dim: D) -> Result<candle_core::Tensor> {
        crate::kernels::extrema::argmax(&self.inner, dim)
    }

    /// 2-D max pooling over the last two dimensions, stride = kernel size.
    pub fn max_pool2d<T: candle_core::ToUsize2>(&self, kernel: T) -> Result<Self> {
        let pool = crate::kernels::Pool2d::tiling(kernel.to_usize2());
        self.unary_op::<op::max_pool2d, P>(|x| crate::kernels::max_pool2d(x, pool))
    }

    /// 2-D max pooling with an explicit stride (on CPU with a backward for any stride, where
    /// candle's has none unless stride = window, and each gradient whole on its maximum).
    pub fn max_pool2d_with_stride<T: candle_core::ToUsize2>(
        &self,
        kernel: T,
        stride: T,
    ) -> Result<Self> {
        let pool = crate::kernels::Pool2d::strided(kernel.to_usize2(), stride.to_usize2());
        self.unary_op::<op::max_pool2d_with_stride, P>(|x| crate::kernels::max_pool2d(x, pool))
    }

    /// 2-D average pooling, stride = kernel size. Stays in `P` (PyTorch's autocast does not
    /// upcast pooling); on CPU each window is summed in f32 and the mean rounded once.
    pub fn avg_pool2d<T: candle_core::ToUsize2>(&self, kernel: T) -> Result<Self> {
        let pool = crate::kernels::Pool2d::tiling(kernel.to_usize2());
        self.unary_op::<op::avg_pool2d, P>(|x| crate::kernels::avg_pool2d(x, pool))
    }

    /// 2-D average pooling with an explicit stride (on CPU with a backward for any stride,
    /// where candle's has none unless stride = window).
    pub fn avg_pool2d_with_stride<T: candle_core::ToUsize2>(
        &self,
        kernel: T,
        stride: T,
    ) -> Result<Self> {
        let pool = crate::kernels::Pool2d::strided(kernel.to_usize2(), stride.to_usize2());
        self.unary_op::<op::avg_pool2d_with_stride, P>(|x| crate::kernels::avg_pool2d(x, pool))
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
        check_joined("cat", &inner, |a, b| a.len() == b.len(), "of one rank")?;
        Ok(Self::wrap(candle_core::Tensor::cat(&inner, dim)?))
    }

    /// Stacks tensors of one precision along a new dimension `dim`.
    pub fn stack<A: AsRef<Tensor<P>>, D: candle_core::shape::Dim>(
        tensors: &[A],
        dim: D,
    ) -> Result<Self> {
        let inner: Vec<&candle_core::Tensor> = tensors.iter().map(|t| &t.as_ref().inner).collect();
        check_joined("stack", &inner, |a, b| a == b, "of one shape")?;
        Ok(Self::wrap(candle_core::Tensor::stack(&inner, dim)?))
    }
}

/// An error naming `op` and the first tensor whose dimensions do not `fit` the first one's
/// (`cat`: one rank, candle's own check then naming the dimension that differs; `stack`: one
/// shape, where candle's error named `cat` and the shapes with the new dimension in them).
fn check_joined(
    op: &str,
    tensors: &[&candle_core::Tensor],
    fit: impl Fn(&[usize], &[usize]) -> bool,
    what: &str,
) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    if let Some((i, t)) = tensors
        .iter()
        .enumerate()
        .find(|(_, t)| !fit(first.dims(), t.dims()))
    {
        candle_core::bail!(
            "{op}: the tensors must be {what}: tensor {i} is {:?}, tensor 0 {:?}",
            t.dims(),
            first.dims()
        )
    }
    Ok(())
}
