//! The op methods of a routed tensor receiver, each routed by its class under the policy.
//!
//! `x.matmul(&w)` in a region becomes `Routed::<Pol, _>::new(&x).matmul(&w)`; the receiver may
//! be a region value or a typed tensor, by reference or not (any [`AsAmp`]). For any other
//! receiver these methods do not apply (their `T: AsAmp` bound fails) and `Routed` derefs to the
//! receiver's own method.

use candle_core::Result;

use super::policy::Policy;
use super::route::{at, binary, routed, Routed};
use super::value::{AmpTensor, AsAmp, Operand, OperandOrScalar, Rhs};
use crate::kernels::layout::empty_at_start;
use crate::op;

/// The routed method of each `method` row of the op table: generated for the common shapes
/// (no argument, one dim, dims, one tensor operand, a comparison, a candle function); `custom` rows are
/// written below by hand.
macro_rules! routed {
    ($($shape:ident $arity:literal $name:ident;)*) => {$(
        routed!(@$shape $name);
    )*};
    (@custom $name:ident) => {};
    // Ops whose candle results differ from PyTorch's at NaN and infinities: PyTorch's values
    // (`crate::kernels::extrema`, `crate::composite`). Before the generic arms, which would match first.
    (@binary pow) => { routed!(@composite_fn pow, crate::composite::pow); };
    (@binary broadcast_pow) => { routed!(@composite_fn broadcast_pow, crate::composite::broadcast_pow); };
    (@dim max) => { routed!(@extremum max, max, false); };
    (@dim max_keepdim) => { routed!(@extremum max_keepdim, max, true); };
    (@dim min) => { routed!(@extremum min, min, false); };
    (@dim min_keepdim) => { routed!(@extremum min_keepdim, min, true); };
    (@extremum $name:ident, $f:ident, $keep:literal) => {
        #[doc = concat!("Routed `", stringify!($name), "` (NaN where the slice holds one).")]
        pub fn $name<D: candle_core::shape::Dim>(&self, dim: D) -> Result<AmpTensor> {
            self.unary::<op::$name>(|x| crate::kernels::extrema::$f(x, dim, $keep))
        }
    };
    (@unary abs) => {
        /// Routed `abs` (gradient `sign(x)`: 0 at 0 and NaN, as PyTorch's).
        pub fn abs(&self) -> Result<AmpTensor> {
            self.unary::<op::abs>(crate::kernels::extrema::abs)
        }
    };
    (@dim cumsum) => {
        /// Routed `cumsum` (an infinity or NaN reaches only the sums after it).
        pub fn cumsum<D: candle_core::shape::Dim>(&self, dim: D) -> Result<AmpTensor> {
            self.unary::<op::cumsum>(|x| crate::kernels::cumsum(x, dim))
        }
    };
    (@unary max_all) => {
        /// Routed `max_all` (NaN if any element is).
        pub fn max_all(&self) -> Result<AmpTensor> {
            self.unary::<op::max_all>(crate::kernels::extrema::max_all)
        }
    };
    (@unary min_all) => {
        /// Routed `min_all` (NaN if any element is).
        pub fn min_all(&self) -> Result<AmpTensor> {
            self.unary::<op::min_all>(crate::kernels::extrema::min_all)
        }
    };
    (@binary maximum) => { routed!(@extremum_or_scalar maximum); };
    (@binary minimum) => { routed!(@extremum_or_scalar minimum); };
    (@extremum_or_scalar $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "` with a tensor or a number (NaN where \
            either operand is).")]
        pub fn $name(&self, rhs: impl OperandOrScalar) -> Result<AmpTensor> {
            match rhs.operand_or_scalar()? {
                Rhs::Tensor(b) => self.binary::<op::$name>(&b, crate::kernels::extrema::$name),
                Rhs::Scalar(s) => self.unary::<op::$name>(|x| {
                    crate::kernels::extrema::$name(x, &Rhs::scalar_like(&s, x)?)
                }),
            }
        }
    };
    (@composite_fn $name:ident, $f:path) => {
        #[doc = concat!("Routed `", stringify!($name), "`.")]
        pub fn $name(&self, rhs: impl Operand) -> Result<AmpTensor> {
            self.binary::<op::$name>(&rhs.operand(), $f)
        }
    };
    // Sums and means accumulate in f64 (`kernels::reduce`).
    (@dims sum) => { routed!(@reduce_dims sum); };
    (@dims sum_keepdim) => { routed!(@reduce_dims sum_keepdim); };
    (@dims mean) => { routed!(@reduce_dims mean); };
    (@dims mean_keepdim) => { routed!(@reduce_dims mean_keepdim); };
    (@unary sum_all) => { routed!(@reduce_all sum_all); };
    (@unary mean_all) => { routed!(@reduce_all mean_all); };
    (@reduce_dims $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "` (accumulated in f64).")]
        pub fn $name<D: candle_core::shape::Dims>(&self, dims: D) -> Result<AmpTensor> {
            self.unary::<op::$name>(|x| crate::kernels::reduce::$name(x, dims))
        }
    };
    (@reduce_all $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "` (accumulated in f64).")]
        pub fn $name(&self) -> Result<AmpTensor> {
            self.unary::<op::$name>(crate::kernels::reduce::$name)
        }
    };
    (@dims log_sum_exp) => {
        /// Routed `log_sum_exp`.
        pub fn log_sum_exp<D: candle_core::shape::Dims>(&self, dims: D) -> Result<AmpTensor> {
            self.unary::<op::log_sum_exp>(|x| crate::composite::log_sum_exp(x, dims))
        }
    };
    (@unary $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "`.")]
        pub fn $name(&self) -> Result<AmpTensor> {
            self.unary::<op::$name>(candle_core::Tensor::$name)
        }
    };
    (@dim $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "`.")]
        pub fn $name<D: candle_core::shape::Dim>(&self, dim: D) -> Result<AmpTensor> {
            self.unary::<op::$name>(|x| x.$name(dim))
        }
    };
    (@dims $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "`.")]
        pub fn $name<D: candle_core::shape::Dims>(&self, dims: D) -> Result<AmpTensor> {
            self.unary::<op::$name>(|x| x.$name(dims))
        }
    };
    (@closure $name:ident) => {
        #[doc = concat!("Any candle function on the value, run as the `", stringify!($name), "` op's class \
            under the policy (a foreign op): its input cast there first.")]
        pub fn $name(
            &self,
            f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
        ) -> Result<AmpTensor> {
            self.unary::<op::$name>(f)
        }
    };
    (@compare $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "`: tensor operands meet in their promoted \
            dtype, as PyTorch compares, a number in the receiver's (candle's rule); the result \
            is a u8 candle mask, never cast.")]
        pub fn $name(&self, rhs: impl OperandOrScalar) -> Result<candle_core::Tensor> {
            let a = self.amp();
            match rhs.operand_or_scalar()? {
                Rhs::Tensor(b) => {
                    routed::<Pol, op::$name>(&[&a, &b], |t| at(&a, t)?.$name(&at(&b, t)?))
                }
                Rhs::Scalar(s) => routed::<Pol, op::$name>(&[&a], |t| {
                    let a = at(&a, t)?;
                    a.$name(&Rhs::scalar_like(&s, &a)?)
                }),
            }
        }
    };
    // Sums and differences run on candle-amp's op, which gives no gradient to an operand that
    // tracks nothing (a mask).
    (@binary add) => { routed!(@kernel add); };
    (@binary sub) => { routed!(@kernel sub); };
    (@binary broadcast_add) => { routed!(@kernel broadcast_add); };
    (@binary broadcast_sub) => { routed!(@kernel broadcast_sub); };
    // The other broadcast ops sum a broadcast half operand's gradient in f32 there.
    (@binary broadcast_mul) => { routed!(@kernel broadcast_mul); };
    (@binary broadcast_div) => { routed!(@kernel broadcast_div); };
    (@binary broadcast_maximum) => { routed!(@kernel broadcast_maximum); };
    (@binary broadcast_minimum) => { routed!(@kernel broadcast_minimum); };
    (@kernel $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "`.")]
        pub fn $name(&self, rhs: impl Operand) -> Result<AmpTensor> {
            self.binary::<op::$name>(&rhs.operand(), crate::kernels::$name)
        }
    };
    (@binary $name:ident) => {
        #[doc = concat!("Routed `", stringify!($name), "`.")]
        pub fn $name(&self, rhs: impl Operand) -> Result<AmpTensor> {
            self.binary::<op::$name>(&rhs.operand(), |a, b| a.$name(b))
        }
    };
}

impl<Pol: Policy, T: AsAmp + ?Sized> Routed<'_, Pol, T> {
    amp_macros::__op_table!(methods => routed);

    /// Routed `sigmoid` (in f32, rounded once for a half value).
    pub fn sigmoid(&self) -> Result<AmpTensor> {
        self.unary::<op::sigmoid>(|x| crate::kernels::in_f32(x, candle_nn::ops::sigmoid))
    }
    /// Routed `affine`.
    pub fn affine(&self, mul: f64, add: f64) -> Result<AmpTensor> {
        self.unary::<op::affine>(|x| crate::kernels::affine(x, mul, add))
    }
    /// Routed `powf` (gradient 0 at `e = 0`, as PyTorch's).
    pub fn powf(&self, e: f64) -> Result<AmpTensor> {
        self.unary::<op::powf>(|x| crate::kernels::powf(x, e))
    }
    /// Routed `reshape`.
    pub fn reshape<S: candle_core::shape::ShapeWithOneHole>(&self, s: S) -> Result<AmpTensor> {
        self.unary::<op::reshape>(|x| x.reshape(s))
    }
    /// Routed `transpose`.
    pub fn transpose<D1: candle_core::shape::Dim, D2: candle_core::shape::Dim>(
        &self,
        a: D1,
        b: D2,
    ) -> Result<AmpTensor> {
        self.unary::<op::transpose>(|x| x.transpose(a, b))
    }
    /// Routed `narrow`.
    pub fn narrow<D: candle_core::shape::Dim>(
        &self,
        dim: D,
        start: usize,
        len: usize,
    ) -> Result<AmpTensor> {
        self.unary::<op::narrow>(|x| empty_at_start(x.narrow(dim, start, len)?, x))
    }
    /// Routed `flatten`.
    pub fn flatten<D1: candle_core::shape::Dim, D2: candle_core::shape::Dim>(
        &self,
        a: D1,
        b: D2,
    ) -> Result<AmpTensor> {
        self.unary::<op::flatten>(|x| x.flatten(a, b))
    }
    /// Routed `broadcast_as` (a half value that tracks is copied through f32, so that its
    /// gradient is summed in f32).
    pub fn broadcast_as<S: Into<candle_core::Shape>>(&self, s: S) -> Result<AmpTensor> {
        self.unary::<op::broadcast_as>(|x| crate::kernels::spread(x, &s.into()))
    }
    /// Routed `broadcast_left` (as `broadcast_as`).
    pub fn broadcast_left<S: Into<candle_core::Shape>>(&self, s: S) -> Result<AmpTensor> {
        self.unary::<op::broadcast_left>(|x| {
            let shape = [s.into().dims(), x.dims()].concat();
            crate::kernels::spread(x, &candle_core::Shape::from(shape))
        })
    }
    /// Routed `pad_with_zeros`.
    pub fn pad_with_zeros<D: candle_core::shape::Dim>(
        &self,
        dim: D,
        left: usize,
        right: usize,
    ) -> Result<AmpTensor> {
        self.unary::<op::pad_with_zeros>(|x| x.pad_with_zeros(dim, left, right))
    }
    /// Routed `index_select`.
    pub fn index_select<D: candle_core::shape::Dim>(
        &self,
        ids: &candle_core::Tensor,
        dim: D,
    ) -> Result<AmpTensor> {
        self.unary::<op::index_select>(|x| {
            crate::kernels::index_select(x, ids, dim.to_index(x.shape(), "index_select")?)
        })
    }
    /// Routed `max_pool2d`.
    pub fn max_pool2d<K: candle_core::ToUsize2>(&self, k: K) -> Result<AmpTensor> {
        let pool = crate::kernels::Pool2d::tiling(k.to_usize2());
        self.unary::<op::max_pool2d>(|x| crate::kernels::max_pool2d(x, pool))
    }
    /// Routed `avg_pool2d`.
    pub fn avg_pool2d<K: candle_core::ToUsize2>(&self, k: K) -> Result<AmpTensor> {
        let pool = crate::kernels::Pool2d::tiling(k.to_usize2());
        self.unary::<op::avg_pool2d>(|x| crate::kernels::avg_pool2d(x, pool))
    }
    /// Routed `max_pool2d_with_stride` (candle-amp's pool: checked geometry, a backward for
    /// any stride).
    pub fn max_pool2d_with_stride<K: candle_core::ToUsize2>(
        &self,
        kernel: K,
        stride: K,
    ) -> Result<AmpTensor> {
        let pool = crate::kernels::Pool2d::strided(kernel.to_usize2(), stride.to_usize2());
        self.unary::<op::max_pool2d_with_stride>(|x| crate::kernels::max_pool2d(x, pool))
    }
    /// Routed `avg_pool2d_with_stride` (as `max_pool2d_with_stride`).
    pub fn avg_pool2d_with_stride<K: candle_core::ToUsize2>(
        &self,
        kernel: K,
        stride: K,
    ) -> Result<AmpTensor> {
        let pool = crate::kernels::Pool2d::strided(kernel.to_usize2(), stride.to_usize2());
        self.unary::<op::avg_pool2d_with_stride>(|x| crate::kernels::avg_pool2d(x, pool))
    }
    /// Routed `chunk`.
    pub fn chunk<D: candle_core::shape::Dim>(
        &self,
        chunks: usize,
        dim: D,
    ) -> Result<Vec<AmpTensor>> {
        let x = self.amp();
        // Routed (and reported) as the cast of the whole; the chunks are views of it, split as
        // candle splits (the typed `chunk` is PyTorch's, see there).
        let whole = routed::<Pol, op::chunk>(&[&x], |t| at(&x, t))?;
        whole
            .chunk(chunks, dim)?
            .into_iter()
            .map(|c| empty_at_start(c, &whole))
            .collect()
    }
    /// Routed `argmax`: integer ids, a plain candle tensor (a slice holding NaN: its first
    /// NaN's index).
    pub fn argmax<D: candle_core::shape::Dim>(&self, dim: D) -> Result<candle_core::Tensor> {
        crate::kernels::extrema::argmax(&self.amp(), dim)
    }
    /// Routed `conv1d`.
    pub fn conv1d(
        &self,
        kernel: impl Operand,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<AmpTensor> {
        let params = crate::kernels::Conv2dParams {
            padding,
            stride,
            dilation,
            groups,
        };
        self.binary::<op::conv1d>(&kernel.operand(), |x, k| {
            crate::kernels::conv1d(x, k, None, params)
        })
    }
    /// Routed `relu` (NaN stays NaN, as in PyTorch).
    pub fn relu(&self) -> Result<AmpTensor> {
        self.unary::<op::relu>(crate::kernels::relu)
    }
    /// Routed `gelu`, tanh approximation (on CPU one op computed in f32, rounded once).
    pub fn gelu(&self) -> Result<AmpTensor> {
        self.unary::<op::gelu>(crate::kernels::gelu)
    }
    /// Routed `gelu_erf` (on CPU one op computed in f32, rounded once).
    pub fn gelu_erf(&self) -> Result<AmpTensor> {
        self.unary::<op::gelu_erf>(crate::kernels::gelu_erf)
    }
    /// Routed `silu` (on CPU one op computed in f32, rounded once).
    pub fn silu(&self) -> Result<AmpTensor> {
        self.unary::<op::silu>(crate::kernels::silu)
    }
    /// Routed `matmul` (bf16 and f16 on CPU through candle-amp's GEMM).
    pub fn matmul(&self, rhs: impl Operand) -> Result<AmpTensor> {
        self.binary::<op::matmul>(&rhs.operand(), crate::kernels::matmul)
    }
    /// Routed `broadcast_matmul` (bf16 and f16 on CPU through candle-amp's GEMM).
    pub fn broadcast_matmul(&self, rhs: impl Operand) -> Result<AmpTensor> {
        self.binary::<op::broadcast_matmul>(&rhs.operand(), crate::kernels::broadcast_matmul)
    }
    /// Routed `conv2d` (bf16 on CPU through candle-amp's kernel).
    pub fn conv2d(
        &self,
        kernel: impl Operand,
        padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<AmpTensor> {
        let params = crate::kernels::Conv2dParams {
            padding,
            stride,
            dilation,
            groups,
        };
        self.binary::<op::conv2d>(&kernel.operand(), |x, k| {
            crate::kernels::conv2d(x, k, None, params)
        })
    }
    /// Routed `conv_transpose1d`.
    pub fn conv_transpose1d(
        &self,
        kernel: impl Operand,
        padding: usize,
        output_padding: usize,
        stride: usize,
        dilation: usize,
        groups: usize,
    ) -> Result<AmpTensor> {
        self.binary::<op::conv_transpose1d>(&kernel.operand(), |x, k| {
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
    /// Routed `conv_transpose2d`.
    pub fn conv_transpose2d(
        &self,
        kernel: impl Operand,
        padding: usize,
        output_padding: usize,
        stride: usize,
        dilation: usize,
    ) -> Result<AmpTensor> {
        self.binary::<op::conv_transpose2d>(&kernel.operand(), |x, k| {
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
    /// Routed `clamp`, to `[min, max]` (scalars of any of candle's element types, as candle's
    /// `clamp` takes), in the receiver's dtype.
    pub fn clamp<A: candle_core::WithDType, B: candle_core::WithDType>(
        &self,
        min: A,
        max: B,
    ) -> Result<AmpTensor> {
        let (min, max) = (min.to_f64(), max.to_f64());
        self.unary::<op::clamp>(|x| crate::kernels::extrema::clamp(x, min, max))
    }
}

/// `mask.where_cond(&on_true, &on_false)` with an integer mask (never cast; a candle tensor or a
/// region value): promote-class over the two branches, the result of `on_true`'s kind.
impl<Pol: Policy, M: AsAmp + ?Sized> Routed<'_, Pol, M> {
    /// Routed `where_cond`: `on_true` where the mask is non-zero, else `on_false`.
    pub fn where_cond<A: AsAmp>(&self, on_true: A, on_false: impl Operand) -> Result<AmpTensor> {
        let mask = self.amp();
        binary::<Pol, op::where_cond>(&on_true.to_amp(), &on_false.operand(), |a, b| {
            mask.where_cond(a, b)
        })
    }
}
