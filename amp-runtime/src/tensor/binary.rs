//! Ops of two tensors of `Tensor<P>`: elementwise binary ops and matmul (operands of one
//! precision outside autocast), convolutions, and the operators `+ - * /`.

use candle_core::Result;

use super::Tensor;
use crate::op::{self, SamePrecision};
use crate::precision::Precision;

macro_rules! binary {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
        where
            Q: SamePrecision<P, op::$name>,
        {
            self.binary_op::<op::$name, Q>(rhs, |a, b| a.$name(b))
        }
    )*};
}

/// Binary ops through `crate::kernels`: sums and differences (candle-amp's op on CPU, which
/// gives no gradient to an operand that tracks nothing) and the broadcast ops (a broadcast
/// half operand's gradient summed in f32).
macro_rules! kernel {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
        where
            Q: SamePrecision<P, op::$name>,
        {
            self.binary_op::<op::$name, Q>(rhs, crate::kernels::$name)
        }
    )*};
}

/// Comparisons: operands of one precision, the result a candle mask (integer, never cast).
macro_rules! compare {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        pub fn $name<Q>(&self, rhs: &Tensor<Q>) -> Result<candle_core::Tensor>
        where
            Q: SamePrecision<P, op::$name>,
        {
            let (a, b) = (&self.inner, &rhs.inner);
            super::follow::<op::$name>(&[a, b], |t| super::at(a, t)?.$name(&super::at(b, t)?))
        }
    )*};
}

impl<P: Precision> Tensor<P> {
    kernel!(
        /// Elementwise sum (same shapes).
        add,
        /// Elementwise difference (same shapes).
        sub,
        /// Sum with broadcasting.
        broadcast_add,
        /// Difference with broadcasting.
        broadcast_sub,
        /// Product with broadcasting (a broadcast operand's gradient summed in f32).
        broadcast_mul,
        /// Quotient with broadcasting (a broadcast operand's gradient summed in f32).
        broadcast_div,
        /// Elementwise maximum with broadcasting (a broadcast operand's gradient summed in f32).
        broadcast_maximum,
        /// Elementwise minimum with broadcasting (a broadcast operand's gradient summed in f32).
        broadcast_minimum,
    );

    binary!(
        /// Elementwise product (same shapes).
        mul,
        /// Elementwise quotient (same shapes).
        div,
    );

    /// Elementwise maximum, NaN where either operand is (PyTorch's; candle's keeps the other).
    pub fn maximum<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
    where
        Q: SamePrecision<P, op::maximum>,
    {
        self.binary_op::<op::maximum, Q>(rhs, crate::kernels::extrema::maximum)
    }

    /// Elementwise minimum, NaN where either operand is.
    pub fn minimum<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
    where
        Q: SamePrecision<P, op::minimum>,
    {
        self.binary_op::<op::minimum, Q>(rhs, crate::kernels::extrema::minimum)
    }

    compare!(
        /// `self == rhs` with broadcasting, as a u8 candle mask (for `where_cond`).
        broadcast_eq,
        /// `self != rhs` with broadcasting, as a u8 candle mask.
        broadcast_ne,
        /// `self < rhs` with broadcasting, as a u8 candle mask.
        broadcast_lt,
        /// `self <= rhs` with broadcasting, as a u8 candle mask.
        broadcast_le,
        /// `self > rhs` with broadcasting, as a u8 candle mask.
        broadcast_gt,
        /// `self >= rhs` with broadcasting, as a u8 candle mask.
        broadcast_ge,
    );

    /// Matrix product over the last two dimensions (a lower-precision op under autocast); bf16
    /// and f16 on CPU run on candle-amp's GEMM (f32 accumulation).
    pub fn matmul<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
    where
        Q: SamePrecision<P, op::matmul>,
    {
        self.binary_op::<op::matmul, Q>(rhs, crate::kernels::matmul)
    }

    /// Matrix product with broadcasting of the batch dimensions.
    pub fn broadcast_matmul<Q>(&self, rhs: &Tensor<Q>) -> Result<Self>
    where
        Q: SamePrecision<P, op::broadcast_matmul>,
    {
        self.binary_op::<op::broadcast_matmul, Q>(rhs, crate::kernels::broadcast_matmul)
    }
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
        let params = crate::kernels::Conv2dParams {
            padding,
            stride,
            dilation,
            groups,
        };
        self.binary_op::<op::conv1d, Q>(kernel, |x, k| crate::kernels::conv1d(x, k, None, params))
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
        self.binary_op::<op::conv2d, Q>(kernel, |x, k| crate::kernels::conv2d(x, k, None, params))
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
        self.binary_op::<op::conv_transpose1d, Q>(kernel, |x, k| {
            let t = crate::kernels::TransposeParams {
                padding,
                output_padding,
                stride,
                dilation,
                groups,
            };
            crate::kernels::conv_transpose(x, k, t)
        })
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
        self.binary_op::<op::conv_transpose2d, Q>(kernel, |x, k| {
            let t = crate::kernels::TransposeParams {
                padding,
                output_padding,
                stride,
                dilation,
                groups: 1,
            };
            crate::kernels::conv_transpose(x, k, t)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Operators on references: `&a + &b` (one precision) and `&a * 2.0` (or `a * 2.0`), returning
// `Result` as candle's operators do.
macro_rules! operator {
    ($trait:ident, $fn:ident, $op:ident, |$x:ident, $s:ident| $scalar:expr) => {
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
                let ($x, $s) = (self, rhs);
                $scalar
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
/// `s op x` with an `f64` on the left: `s + x`, `s - x`, `s * x` in `P`; `s / x` is PyTorch's
/// fp32-class `rdiv`, defined next to `recip` in `crate::fp32` for `Tensor<F32>` only.
macro_rules! scalar_lhs {
    ($trait:ident, $fn:ident, |$x:ident, $s:ident| $body:expr) => {
        impl<P: Precision> std::ops::$trait<&Tensor<P>> for f64 {
            type Output = Result<Tensor<P>>;
            fn $fn(self, $x: &Tensor<P>) -> Result<Tensor<P>> {
                let $s = self;
                $body
            }
        }
        impl<P: Precision> std::ops::$trait<Tensor<P>> for f64 {
            type Output = Result<Tensor<P>>;
            fn $fn(self, x: Tensor<P>) -> Result<Tensor<P>> {
                std::ops::$trait::$fn(self, &x)
            }
        }
    };
}
scalar_lhs!(Add, add, |x, s| x.affine(1.0, s));
scalar_lhs!(Sub, sub, |x, s| x.affine(-1.0, s));
scalar_lhs!(Mul, mul, |x, s| x.affine(s, -0.0));

// A scaling's `add` is -0.0, the sum's neutral element (see `kernels::affine`); a division is
// a quotient (`kernels::div_scalar`), not a product by the reciprocal.
operator!(Add, add, add, |x, s| x.affine(1.0, s));
operator!(Sub, sub, sub, |x, s| x.affine(1.0, -s));
operator!(Mul, mul, mul, |x, s| x.affine(s, -0.0));
operator!(Div, div, div, |x, s| x
    .unary_op::<op::affine, P>(|t| crate::kernels::div_scalar(t, s)));
