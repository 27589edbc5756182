//! Cumulative sums whose infinities and NaNs reach only the sums after them.
//!
//! candle's `cumsum` is a product with a triangle of ones, so an infinity or NaN meets the
//! triangle's zeros (`0 * inf = NaN`) and turns every sum before it NaN too: `[1, inf, 2]` gave
//! `[NaN, inf, inf]`. On the CPU an f32 or f64 tensor is summed in order in f64, each sum
//! rounded once, as PyTorch's CPU `cumsum` does (so `[1e20, 1, -1e20, 1]` sums to
//! `[1e20, 1e20, 0, 1]`, and `[3e38, 3e38, -3e38]` to `[3e38, inf, 3e38]`); its gradient is the
//! same scan run backwards over the output's gradient, PyTorch's too. Elsewhere the sums are a
//! log-step scan (Hillis and Steele) in f64: `ceil(log2 n)` rounds, each adding the running sums
//! shifted by `2^r` places, with no product at all (its order of additions is a tree's, so a
//! prefix that cancels catastrophically can differ from the sequential sum's).

use candle_core::shape::Dim;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use crate::kernels::custom_grad::with_gradient;

/// The cumulative sum of `x` along `dim`.
pub(crate) fn cumsum<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "cumsum")?;
    if x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64) {
        let value = x.detach().contiguous()?.apply_op1_no_bwd(&Scan {
            dim,
            reverse: false,
        })?;
        return with_gradient(x, value, move |_, grad| {
            grad.contiguous()?
                .apply_op1_no_bwd(&Scan { dim, reverse: true })
        });
    }
    tree_scan(x, dim)
}

/// The log-step scan of the module docs, in f64 for float values (any device).
fn tree_scan(x: &Tensor, dim: usize) -> Result<Tensor> {
    let n = x.dim(dim)?;
    let mut sums = if x.dtype().is_float() {
        x.to_dtype(DType::F64)?
    } else {
        x.clone()
    };
    let mut shift = 1;
    while shift < n {
        let moved = sums
            .narrow(dim, 0, n - shift)?
            .pad_with_zeros(dim, shift, 0)?;
        sums = (sums + moved)?;
        shift *= 2;
    }
    sums.to_dtype(x.dtype())
}

/// The sums of a contiguous CPU tensor along `dim`, in order (from the end with `reverse`),
/// accumulated in f64 and each rounded once to the tensor's dtype.
struct Scan {
    dim: usize,
    reverse: bool,
}

impl Scan {
    fn run<T: candle_core::WithDType>(&self, x: &[T], dims: &[usize]) -> Vec<T> {
        let n = dims[self.dim];
        let inner: usize = dims[self.dim + 1..].iter().product();
        let mut out = x.to_vec();
        for block in out.chunks_exact_mut((n * inner).max(1)) {
            for i in 0..inner {
                let mut sum = 0f64;
                let mut step = |j: usize| {
                    sum += block[j * inner + i].to_f64();
                    block[j * inner + i] = T::from_f64(sum);
                };
                if self.reverse {
                    (0..n).rev().for_each(&mut step);
                } else {
                    (0..n).for_each(&mut step);
                }
            }
        }
        out
    }
}

impl CustomOp1 for Scan {
    fn name(&self) -> &'static str {
        "cumsum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some(x) = l.contiguous_offsets().map(|(from, to)| from..to) else {
            candle_core::bail!("cumsum kernel: the input must be contiguous")
        };
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(self.run(&v[x], l.dims())),
            CpuStorage::F64(v) => CpuStorage::F64(self.run(&v[x], l.dims())),
            _ => candle_core::bail!("cumsum kernel: f32 or f64 values only"),
        };
        Ok((out, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    type Scanner = fn(&Tensor, usize) -> Result<Tensor>;

    /// Both scans: the CPU's sequential one (`cumsum` on the CPU) and the tree (what other
    /// devices run), here on the CPU.
    const SCANS: [(&str, Scanner); 2] = [("sequential", |x, d| cumsum(x, d)), ("tree", tree_scan)];

    fn same(got: &[f32], want: &[f32]) -> bool {
        got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits())
    }

    /// PyTorch's values (torch 2.15, f32): an infinity or NaN reaches the sums from its place
    /// on; sums over f32's range come back; a prefix that cancels is the sequential sum's (the
    /// CPU's; the tree's order differs there); every prefix of 1000 values within rounding of
    /// an f64 reference; the gradient (weights `w`) is the reversed cumulative sum of `w`.
    #[test]
    fn sums_from_each_place_on_as_pytorch() -> Result<()> {
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let dev = &Device::Cpu;
        let cancelling = (
            vec![1e20f32, 1.0, -1e20, 1.0],
            vec![1e20f32, 1e20, 0.0, 1.0],
        );
        let got = cumsum(&Tensor::new(cancelling.0.as_slice(), dev)?, 0)?.to_vec1::<f32>()?;
        assert!(same(&got, &cancelling.1), "{got:?}");
        for (how, scan) in SCANS {
            for (x, want) in [
                (vec![1f32, inf, 2.0], vec![1f32, inf, inf]),
                (vec![1.0, inf, 2.0, nan, 3.0], vec![1.0, inf, inf, nan, nan]),
                (vec![3e38, 3e38, -3e38], vec![3e38, inf, 3e38]),
                (vec![], vec![]),
            ] {
                let got = scan(&Tensor::new(x.as_slice(), dev)?, 0)?.to_vec1::<f32>()?;
                assert!(same(&got, &want), "{how} {x:?}: {got:?} vs {want:?}");
            }
            let rows = Tensor::new(&[[1f32, 2.0, nan], [4.0, 5.0, 6.0]], dev)?;
            let got = scan(&rows, 1)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                same(&got, &[1.0, 3.0, nan, 4.0, 9.0, 15.0]),
                "{how} {got:?}"
            );
            let cols = scan(&rows.t()?.contiguous()?, 0)?.t()?.flatten_all()?;
            assert!(
                same(&cols.to_vec1::<f32>()?, &[1.0, 3.0, nan, 4.0, 9.0, 15.0]),
                "{how}"
            );
            let x: Vec<f32> = (0..1000)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let v = Var::new(x.as_slice(), dev)?;
            let w: Vec<f32> = (0..1000).map(|i| (i % 13) as f32).collect();
            let y = scan(v.as_tensor(), 0)?;
            let grads = (&y * Tensor::new(w.as_slice(), dev)?)?
                .sum_all()?
                .backward()?;
            let mut run = 0f64;
            for (i, got) in y.to_vec1::<f32>()?.iter().enumerate() {
                run += f64::from(x[i]);
                assert!(
                    (f64::from(*got) - run).abs() <= 1e-6 * run.abs().max(1.0),
                    "{how} {i}"
                );
            }
            let g = grads.get(&v).unwrap().to_vec1::<f32>()?;
            let mut back = 0f32;
            for i in (0..1000).rev() {
                back += w[i];
                assert_eq!(g[i].to_bits(), back.to_bits(), "{how} gradient {i}");
            }
        }
        // Integers stay integers.
        let ids = Tensor::new(&[1u32, 2, 3], dev)?;
        assert_eq!(cumsum(&ids, 0)?.to_vec1::<u32>()?, [1, 3, 6]);
        Ok(())
    }
}
