//! Sums and means of f32, f16 and bf16 tensors on CPU, accumulated in f64.
//!
//! candle's CPU sum adds the values one after another in a few f32 accumulators: over 2e7
//! values of 0.1 it is 0.6% off, and a cross-entropy's mean over 2^20 rows is wrong in its
//! fourth digit. PyTorch's cascade sum is exact to about 1e-7 there. These sums read each row
//! as it is (half values widened on the fly), add it in eight f64 lanes, a long row split over
//! the kernels' pool, and return f32: the exact sum rounded once, short of a cancellation of
//! nine orders of magnitude. The gradient is the incoming one spread over the row, in the
//! input's dtype, as the sum's backward.

use candle_core::shape::Dims;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::kernels::affine::affine;
use crate::kernels::elem::{cpu_float, wide, with_floats, Real};
use crate::kernels::parallel;
use crate::kernels::widen::widened;

/// Elements per parallel task of one row.
const CHUNK: usize = 1 << 16;

/// The sum of `x` over `dims` (kept as size 1), in f32: this op for an f32, f16 or bf16 tensor
/// on CPU, candle's `sum_keepdim` of the f32 (or f64) tensor elsewhere; an integer tensor's is
/// candle's.
pub(crate) fn sum_keepdim<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    let dims = dims.to_indexes(x.shape(), "sum")?;
    sum_keepdim_at(x, &dims)
}

/// [`sum_keepdim`] with the dimensions removed.
pub(crate) fn sum<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    let dims = dims.to_indexes(x.shape(), "sum")?;
    squeezed(&sum_keepdim_at(x, &dims)?, x, &dims)
}

/// [`sum_keepdim`] over every dimension: a scalar.
pub(crate) fn sum_all(x: &Tensor) -> Result<Tensor> {
    let dims: Vec<usize> = (0..x.rank()).collect();
    sum_keepdim_at(x, &dims)?.reshape(())
}

/// The mean of `x` over `dims` (kept as size 1), in f32: [`sum_keepdim`] times `1 / n`.
pub(crate) fn mean_keepdim<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    let dims = dims.to_indexes(x.shape(), "mean")?;
    mean_keepdim_at(x, &dims)
}

/// [`mean_keepdim`] with the dimensions removed.
pub(crate) fn mean<D: Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    let dims = dims.to_indexes(x.shape(), "mean")?;
    squeezed(&mean_keepdim_at(x, &dims)?, x, &dims)
}

/// [`mean_keepdim`] over every dimension: a scalar.
pub(crate) fn mean_all(x: &Tensor) -> Result<Tensor> {
    let dims: Vec<usize> = (0..x.rank()).collect();
    mean_keepdim_at(x, &dims)?.reshape(())
}

fn mean_keepdim_at(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if !x.dtype().is_float() {
        // candle's integer mean (a routed one is refused before it gets here).
        return x.mean_keepdim(dims);
    }
    let n: usize = dims.iter().map(|&d| x.dims()[d]).product();
    #[allow(clippy::cast_precision_loss)] // an element count
    affine(&sum_keepdim_at(x, dims)?, 1.0 / n as f64, 0.0)
}

/// `r` (`x` reduced over `dims`, kept) without those dimensions.
fn squeezed(r: &Tensor, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let shape: Vec<usize> = (0..x.rank())
        .filter(|d| !dims.contains(d))
        .map(|d| x.dims()[d])
        .collect();
    r.reshape(shape)
}

fn sum_keepdim_at(x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let mut dims = dims.to_vec();
    dims.sort_unstable();
    dims.dedup();
    if !x.dtype().is_float() {
        return x.sum_keepdim(dims);
    }
    let shape: Vec<usize> = (0..x.rank())
        .map(|d| if dims.contains(&d) { 1 } else { x.dims()[d] })
        .collect();
    // candle's sum of nothing (0, and a zero gradient to what made the empty tensor).
    if !cpu_float(x) || x.elem_count() == 0 {
        return crate::kernels::convert::to_dtype(x, wide(x.dtype()))?.sum_keepdim(dims);
    }
    // The reduced dimensions last, so that each output value is one contiguous row.
    let kept: Vec<usize> = (0..x.rank()).filter(|d| !dims.contains(d)).collect();
    let order: Vec<usize> = kept.iter().chain(&dims).copied().collect();
    let len: usize = dims.iter().map(|&d| x.dims()[d]).product();
    let rows = x.elem_count() / len;
    let moved = if order.iter().copied().eq(0..x.rank()) {
        x.clone()
    } else {
        x.permute(order.as_slice())?
    };
    let sums = moved.contiguous()?.apply_op1(RowSums { rows, len })?;
    sums.reshape(shape)
}

/// The sum of a run of values in eight f64 lanes (a sum of f32 values then errs by about
/// `n * 1e-16` of their magnitudes: exact once rounded to f32, short of a cancellation by nine
/// orders of magnitude).
fn run_sum<T: Real>(xs: &[T]) -> f64 {
    let mut lanes = [0f64; 8];
    widened(xs, |x| {
        let chunks = x.chunks_exact(8);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (l, &v) in lanes.iter_mut().zip(chunk) {
                *l += f64::from(v);
            }
        }
        for (l, &v) in lanes.iter_mut().zip(rest) {
            *l += f64::from(v);
        }
    });
    lanes.iter().sum()
}

/// The f32 sums of `rows` contiguous rows of `len` values.
struct RowSums {
    rows: usize,
    len: usize,
}

impl RowSums {
    fn sums<T: Real + Sync>(&self, xs: &[T]) -> Vec<f32> {
        let len = self.len;
        #[allow(clippy::cast_possible_truncation)] // the sum's one rounding to f32
        if self.rows == 1 {
            // One long row (a `sum_all`): its chunks in parallel, added in order.
            let parts = parallel::map_indices(len.div_ceil(CHUNK), |i| {
                run_sum(&xs[i * CHUNK..((i + 1) * CHUNK).min(len)])
            });
            vec![parts.iter().sum::<f64>() as f32]
        } else {
            #[allow(clippy::cast_possible_truncation)]
            parallel::map_indices(self.rows, |r| run_sum(&xs[r * len..(r + 1) * len]) as f32)
        }
    }
}

impl CustomOp1 for RowSums {
    fn name(&self) -> &'static str {
        "amp-row-sums"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let sums = with_floats!("sum", x, l, |xs| self.sums(xs));
        Ok((CpuStorage::F32(sums), Shape::from(self.rows)))
    }

    /// Each row's gradient is its sum's, spread over the row, in the input's dtype.
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let spread = grad
            .reshape((self.rows, 1))?
            .broadcast_as((self.rows, self.len))?;
        Ok(Some(
            crate::kernels::convert::to_dtype(&spread, x.dtype())?.reshape(x.shape())?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// 2e7 values of 0.1 (f16 0.0999755859375 each): candle's f32 sum is 0.6% off; this one is
    /// the f64 sum of the same values to f32's precision. Sums over the middle dimension of a
    /// view, means, and the gradient (ones, spread in the input's dtype) by hand.
    #[test]
    fn sums_are_exact_to_f32_and_spread_their_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let n = 20_000_000;
        let tenth = half::f16::from_f32(0.1);
        let x = Tensor::from_vec(vec![tenth; n], n, &dev)?;
        #[allow(clippy::cast_precision_loss)]
        let want = f64::from(tenth.to_f32()) * n as f64;
        let got = f64::from(sum_all(&x)?.to_scalar::<f32>()?);
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
        let candle = f64::from(x.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?);
        assert!(
            (candle - want).abs() > 1e-3 * want,
            "candle's own is {candle}"
        );

        // (2, 3, 4) values 0..24 as bf16, transposed to (2, 4, 3): sums over dimension 1.
        let v: Vec<f32> = (0..24u8).map(f32::from).collect();
        let base = Var::from_tensor(&Tensor::from_vec(v, (2, 3, 4), &dev)?.to_dtype(DType::BF16)?)?;
        let view = base.as_tensor().transpose(1, 2)?;
        let s = sum_keepdim(&view, 1)?;
        assert_eq!(s.dims(), [2, 1, 3]);
        // Row (b, ., c) of the view sums base[b, c, 0..4]: 4 * (12 b + 4 c) + 6.
        let by_hand: Vec<f32> = (0..2u8)
            .flat_map(|b| {
                (0..3u8).map(move |c| 4.0 * (12.0 * f32::from(b) + 4.0 * f32::from(c)) + 6.0)
            })
            .collect();
        assert_eq!(s.flatten_all()?.to_vec1::<f32>()?, by_hand);
        let m = mean_keepdim(&view, 1)?;
        let halves: Vec<f32> = by_hand.iter().map(|v| v / 4.0).collect();
        assert_eq!(m.flatten_all()?.to_vec1::<f32>()?, halves);
        let grads = s.sum_all()?.backward()?;
        let g = grads.get(base.as_tensor()).expect("a gradient");
        assert_eq!(g.dtype(), DType::BF16);
        assert_eq!(
            g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            vec![1.0; 24]
        );
        Ok(())
    }
}
