//! Upsampling, PyTorch's `nn.Upsample` with `mode="nearest"` and `mode="bilinear"`
//! (`align_corners=False`, PyTorch's default) over `(batch, channels, h, w)`.
//!
//! Precision-preserving (`op::upsample`): each output is read, or interpolated, in f32 from the
//! input's values and rounded once to the input's precision, and the backward sums each
//! input's share of the gradient in f32, as PyTorch's kernels accumulate half inputs in f32
//! (candle's `upsample_nearest2d` sums a half gradient in half, and its bilinear upsampling has
//! no backward).
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! use candle_amp::nn::{Upsample, UpsampleMode};
//! use candle_amp::{Tensor, F32};
//! # fn main() -> candle_core::Result<()> {
//! let x = Tensor::<F32>::from_candle(candle_core::Tensor::new(
//!     &[[[[1f32, 2.], [3., 4.]]]],
//!     &candle_core::Device::Cpu,
//! )?)?;
//! let first_row = |y: Tensor<F32>| y.as_candle().get(0)?.get(0)?.get(0)?.to_vec1::<f32>();
//! let up = Upsample::with_scale(2.0, UpsampleMode::Nearest)?;
//! assert_eq!(first_row(up.forward(&x)?)?, [1.0, 1.0, 2.0, 2.0]);
//! // PyTorch's `F.interpolate(x, size=4, mode="bilinear")`.
//! let up = Upsample::with_size((4, 4), UpsampleMode::Bilinear)?;
//! assert_eq!(first_row(up.forward(&x)?)?, [1.0, 1.25, 1.75, 2.0]);
//! # Ok(()) }
//! ```

use candle_core::{DType, Result, Tensor as Candle};

use super::{region_forward, AmpLayer};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// How [`Upsample`] computes an output from the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpsampleMode {
    /// The input value at `floor(i * ratio)`, and at `i` and `i / 2` where the output is the
    /// input's size or twice it (PyTorch's `"nearest"`).
    Nearest,
    /// Linear in each direction between the two nearest inputs, at `(i + 0.5) * ratio - 0.5`
    /// (PyTorch's `"bilinear"` with `align_corners=False`).
    Bilinear,
}

/// The output's size: given, or the input's times a factor.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Size {
    To(usize, usize),
    Scale(f64),
}

/// Upsampling of `(batch, channels, h, w)` (PyTorch's `nn.Upsample`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Upsample {
    size: Size,
    mode: UpsampleMode,
}

impl Upsample {
    /// To the output size `(out_h, out_w)` (both at least 1): PyTorch's `size=`; each
    /// direction's ratio is `in / out`.
    pub fn with_size(out: (usize, usize), mode: UpsampleMode) -> Result<Self> {
        if out.0 == 0 || out.1 == 0 {
            candle_core::bail!("Upsample: the output size must be positive, got {out:?}")
        }
        Ok(Self {
            size: Size::To(out.0, out.1),
            mode,
        })
    }

    /// By `scale` in both directions (finite and positive): PyTorch's `scale_factor=`; the
    /// output is `floor(in * scale)` and the ratio `1 / scale`, as PyTorch computes them.
    pub fn with_scale(scale: f64, mode: UpsampleMode) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            candle_core::bail!(
                "Upsample: the scale factor must be finite and positive, got {scale}"
            )
        }
        Ok(Self {
            size: Size::Scale(scale),
            mode,
        })
    }

    /// The mode.
    pub fn mode(&self) -> UpsampleMode {
        self.mode
    }

    /// Upsamples `x` in f32, the result in `P`.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        let Ok((_, _, h, w)) = x.dims4() else {
            candle_core::bail!(
                "Upsample: the input is (batch, channels, h, w), got {:?}{}",
                x.dims(),
                if x.rank() == 3 {
                    ": PyTorch's Upsample reads a 3-D input as (batch, channels, length) and \
                     resamples the length; this layer does that to a (batch, channels, 1, \
                     length) input (`x.unsqueeze(2)`) with `Upsample::with_size((1, length_out), \
                     mode)`"
                } else {
                    ""
                }
            )
        };
        let ((oh, rh), (ow, rw)) = (self.axis(h, 0)?, self.axis(w, 1)?);
        // Contiguous: candle's `index_select` refuses a view (a transposed or narrowed image).
        let wide = crate::cast::convert(x.as_candle(), DType::F32)?.contiguous()?;
        let y = self.resample(&self.resample(&wide, 2, h, oh, rh)?, 3, w, ow, rw)?;
        Tensor::from_candle(crate::cast::convert(&y, P::DTYPE)?)
    }

    /// The output size along axis `which` (0: height, 1: width) of `n` inputs, and the ratio
    /// of input to output positions.
    #[allow(clippy::cast_precision_loss)] // sizes far inside f64's exact range
    fn axis(&self, n: usize, which: usize) -> Result<(usize, f64)> {
        let (out, ratio) = match self.size {
            Size::To(oh, ow) => {
                let out = [oh, ow][which];
                (out, n as f64 / out as f64)
            }
            Size::Scale(s) => ((n as f64 * s).floor() as usize, 1.0 / s),
        };
        // Positions are indexed as u32 (candle's index type); a larger output is an error, not
        // an attempt to allocate it.
        if out == 0 || n == 0 || u32::try_from(out).is_err() {
            candle_core::bail!("Upsample: {n} inputs would make {out} outputs along an axis")
        }
        Ok((out, ratio))
    }

    /// `x` resampled along `dim` from `n` to `out` positions at `ratio`.
    fn resample(&self, x: &Candle, dim: usize, n: usize, out: usize, ratio: f64) -> Result<Candle> {
        let dev = x.device();
        let index = |i: Vec<u32>| Candle::from_vec(i, out, dev);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // floors of
        // non-negative positions below `n`
        match self.mode {
            UpsampleMode::Nearest => {
                // PyTorch's `nearest_idx`: the identity at the same size and `i / 2` at twice
                // it, whatever the scale that gave the size; otherwise `floor(i * ratio)` in
                // f32, the ratio rounded to f32 as there.
                let ratio = match self.size {
                    Size::To(..) => n as f32 / out as f32,
                    Size::Scale(s) => (1.0 / s) as f32,
                };
                let src = (0..out).map(|i| {
                    if out == n {
                        i
                    } else if out == 2 * n {
                        i / 2
                    } else {
                        ((i as f32 * ratio).floor() as usize).min(n - 1)
                    }
                });
                x.index_select(&index(src.map(|s| s as u32).collect())?, dim)
            }
            UpsampleMode::Bilinear => {
                let (mut lo, mut hi, mut frac) = (Vec::new(), Vec::new(), Vec::new());
                for i in 0..out {
                    let src = ((i as f64 + 0.5) * ratio - 0.5).max(0.0);
                    let i0 = (src.floor() as usize).min(n - 1);
                    lo.push(i0 as u32);
                    hi.push((i0 + 1).min(n - 1) as u32);
                    frac.push((src - i0 as f64) as f32);
                }
                let mut shape = [1usize; 4];
                shape[dim] = out;
                let upper = Candle::from_vec(frac, &shape[..], dev)?;
                let lower = (1.0 - &upper)?;
                let a = x.index_select(&index(lo)?, dim)?.broadcast_mul(&lower)?;
                let b = x.index_select(&index(hi)?, dim)?.broadcast_mul(&upper)?;
                a + b
            }
        }
    }
}

impl AmpLayer for Upsample {
    type Op = op::upsample;
}
region_forward!(Upsample);
