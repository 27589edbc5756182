//! 2-D pooling, PyTorch's `nn.MaxPool2d` and `nn.AvgPool2d`: square windows over the last two
//! dimensions of `(batch, channels, h, w)`, stride = kernel unless given.
//!
//! Pooling has no weights and is on no autocast list (`op::max_pool2d`/`op::avg_pool2d`): it
//! preserves its input's precision, outside a region as inside. Behind a convolution in a bf16
//! region it pools the bf16 activations; on an f32 value it stays in f32.
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! # use amp_macros::autocast;
//! use candle_amp::nn::{self, AvgPool2d, Conv2d, Conv2dConfig, MaxPool2d};
//! use candle_amp::{Tensor, F16, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 8, 8), &dev)?;
//! let pool = MaxPool2d::new(2);
//! assert_eq!(pool.forward(&x)?.dims(), &[2, 3, 4, 4]); // no region: f32
//! let h: Tensor<F16> = AvgPool2d::with_stride(2, 2).forward(&x.cast::<F16>()?)?; // f16 stays
//! assert_eq!(h.dims(), &[2, 3, 4, 4]);
//!
//! struct Stem { conv: Conv2d, pool: MaxPool2d }
//! #[autocast(bf16)]
//! impl Stem {
//!     fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
//!         let f = self.pool.forward(&x)?;
//!         assert_eq!(f.dtype(), DType::F32); // an f32 value pools in f32
//!         let h = self.pool.forward(&self.conv.forward(&x)?)?;
//!         assert_eq!(h.dtype(), DType::BF16); // the conv's bf16 output pools in bf16
//!         Ok(h)
//!     }
//! }
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! let conv = nn::conv2d(3, 4, 3, Conv2dConfig::default(), vb.pp("conv"))?; // 8x8 -> 6x6
//! assert_eq!(Stem { conv, pool }.forward(&x)?.dims(), &[2, 4, 3, 3]);
//! # Ok(()) }
//! ```

use candle_core::Result;

use super::{region_forward, AmpLayer};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A square-window pooling layer over `crate::kernels::$kernel`: `new`, `with_stride`,
/// `with_padding` (`$pad` names what the padding holds) and `forward`.
macro_rules! pool_layer {
    ($(#[$doc:meta])* $name:ident, $kernel:ident, $pad:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name {
            kernel: usize,
            stride: usize,
            padding: usize,
        }

        impl $name {
            /// A square window of `kernel`, stride = kernel (PyTorch's default).
            pub fn new(kernel: usize) -> Self {
                Self::with_stride(kernel, kernel)
            }

            /// A square window of `kernel` moved by `stride`.
            pub fn with_stride(kernel: usize, stride: usize) -> Self {
                Self {
                    kernel,
                    stride,
                    padding: 0,
                }
            }

            #[doc = concat!("The same pool with `padding` ", $pad, " rows and columns on each side:")]
            /// at most half the window, as PyTorch requires (a wider padding is an error at
            /// `forward`).
            pub fn with_padding(self, padding: usize) -> Self {
                Self { padding, ..self }
            }

            /// Pools the last two dimensions of `(batch, channels, h, w)`, in `x`'s precision.
            pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
                if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
                    return y;
                }
                if self.kernel == 0 || self.stride == 0 {
                    candle_core::bail!(
                        "{}: kernel and stride must be positive",
                        stringify!($name)
                    )
                }
                let pool = crate::kernels::Pool2d {
                    kernel: (self.kernel, self.kernel),
                    stride: (self.stride, self.stride),
                    padding: self.padding,
                };
                crate::kernels::$kernel(x.as_candle(), pool).map(Tensor::wrap)
            }
        }

        impl AmpLayer for $name {
            type Op = op::$kernel;
        }
        region_forward!($name);
    };
}

pool_layer!(
    /// 2-D max pooling, precision-preserving, with optional -inf padding (PyTorch's
    /// `MaxPool2d`): ResNet's stem is `MaxPool2d::with_stride(3, 2).with_padding(1)`. On CPU it
    /// trains with any stride, each output's gradient going whole to its window's maximum
    /// (candle's own backward needs stride = window and divides the gradient by the window's
    /// area).
    MaxPool2d,
    max_pool2d,
    "-inf"
);
pool_layer!(
    /// 2-D average pooling, precision-preserving, with optional zero padding counted in each
    /// window's area (PyTorch's `AvgPool2d` with its default `count_include_pad=True`). On CPU
    /// each window is summed in f32 and the mean rounded once, and it trains with any stride,
    /// each output's gradient spread evenly over its window (candle's own average pool sums half
    /// values in half precision, and has no backward unless stride = window).
    AvgPool2d,
    avg_pool2d,
    "zero"
);

/// Adaptive average pooling to a fixed output size (PyTorch's `AdaptiveAvgPool2d`):
/// output cell `(i, j)` averages rows `floor(i * H / oh) .. ceil((i + 1) * H / oh)` and the
/// columns likewise, so every input size maps to `(oh, ow)`; `(1, 1)` is the global average
/// pool of a classifier head. Precision-preserving: computed in f32 and rounded once to the
/// input's precision, as PyTorch accumulates half inputs in f32.
#[derive(Clone, Copy, Debug)]
pub struct AdaptiveAvgPool2d {
    out: (usize, usize),
}

impl AdaptiveAvgPool2d {
    /// Pools to `(out_h, out_w)` (both at least 1).
    pub fn new(out: (usize, usize)) -> Result<Self> {
        if out.0 == 0 || out.1 == 0 {
            candle_core::bail!("AdaptiveAvgPool2d: the output size must be positive, got {out:?}")
        }
        Ok(Self { out })
    }

    /// The output size.
    pub fn output_size(&self) -> (usize, usize) {
        self.out
    }

    /// Pools `x` `(batch, channels, h, w)`, or one image `(channels, h, w)` as PyTorch's layer
    /// takes it, in f32, the result in `P`.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        let pooled =
            crate::kernels::batched("AdaptiveAvgPool2d", x.as_candle(), |x| self.pool_batch(x))?;
        Tensor::from_candle(crate::cast::convert(&pooled, P::DTYPE)?)
    }

    /// The pool of a batch, in f32.
    fn pool_batch(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let (b, c, h, w) = x.dims4()?;
        crate::kernels::layout::check_allocatable(
            "AdaptiveAvgPool2d",
            &[b, c, self.out.0, self.out.1],
        )?;
        let wide = crate::cast::convert(x, candle_core::DType::F32)?;
        if self.out == (1, 1) && h * w > 0 {
            // The global mean as one sum over each image's values, in their order, as PyTorch
            // takes it: the mean of the rows' means summed a column's values first, and `3e38`
            // over `1e38` overflowed where `3e38 - 3e38 + 1e38 + 1` did not.
            wide.flatten_from(2)?.mean_keepdim(2)?.unsqueeze(3)
        } else {
            adaptive_mean(&adaptive_mean(&wide, 2, h, self.out.0)?, 3, w, self.out.1)
        }
    }
}

/// The adaptive mean over dimension `dim` (2 or 3 of a rank-4 `x`) of size `n`, to `out`
/// cells: one cell the dimension's mean; more, the sums of each cell's window as one product
/// with its 0/1 membership matrix `(n, out)`, divided by the windows' lengths (a node per cell
/// would make a graph as long as the output is wide).
fn adaptive_mean(
    x: &candle_core::Tensor,
    dim: usize,
    n: usize,
    out: usize,
) -> Result<candle_core::Tensor> {
    if n == 0 {
        candle_core::bail!(
            "AdaptiveAvgPool2d: the input {:?} is empty along dimension {dim}: no window has a \
             value to average (PyTorch rejects it too)",
            x.dims()
        );
    }
    if n == out {
        return Ok(x.clone());
    }
    if out == 1 {
        return x.mean_keepdim(dim);
    }
    crate::kernels::layout::check_allocatable("AdaptiveAvgPool2d", &[n, out])?;
    let mut member = vec![0f32; n * out];
    let mut lens = vec![0f32; out];
    for (i, len) in lens.iter_mut().enumerate() {
        // In u128: `i * n` may not fit a usize for a wide output.
        let (i, n128, out128) = (i as u128, n as u128, out as u128);
        let start = (i * n128 / out128) as usize;
        let end = ((i + 1) * n128).div_ceil(out128) as usize;
        for j in start..end {
            member[j * out + i as usize] = 1.0;
        }
        *len = (end - start) as f32;
    }
    let member = candle_core::Tensor::from_vec(member, (n, out), x.device())?;
    let lens = candle_core::Tensor::from_vec(lens, out, x.device())?;
    let last = x.rank() - 1;
    let sums = x.transpose(dim, last)?.broadcast_matmul(&member)?;
    sums.broadcast_div(&lens)?.transpose(dim, last)
}

impl AmpLayer for AdaptiveAvgPool2d {
    type Op = op::adaptive_avg_pool2d;
}
region_forward!(AdaptiveAvgPool2d);
