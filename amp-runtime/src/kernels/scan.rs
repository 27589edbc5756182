//! Cumulative sums whose infinities and NaNs reach only the sums after them.
//!
//! candle's `cumsum` is a product with a triangle of ones, so an infinity or NaN meets the
//! triangle's zeros (`0 * inf = NaN`) and turns every sum before it NaN too: `[1, inf, 2]` gave
//! `[NaN, inf, inf]`. Here the sums are a log-step scan (Hillis and Steele): `ceil(log2 n)`
//! rounds, each adding the running sums shifted by `2^r` places, with no product at all, so the
//! gradient (the same scan reversed, candle's backward of the shifts and sums) has none either.
//! Float sums are taken in f64 and rounded once, as PyTorch's CPU `cumsum` accumulates f32 in
//! double: `[3e38, 3e38, -3e38]` sums to `[3e38, inf, 3e38]`.

use candle_core::shape::Dim;
use candle_core::{DType, Result, Tensor};

/// The cumulative sum of `x` along `dim`.
pub(crate) fn cumsum<D: Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "cumsum")?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// PyTorch's values (torch 2.15, f32): an infinity or NaN reaches the sums from its place
    /// on; sums over f32's range come back; every prefix of 1000 values within rounding of an
    /// f64 reference; the gradient (weights `w`) is the reversed cumulative sum of `w`.
    #[test]
    fn sums_from_each_place_on_as_pytorch() -> Result<()> {
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let dev = &Device::Cpu;
        let same = |got: &[f32], want: &[f32]| {
            got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(g, w)| (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits())
        };
        for (x, want) in [
            (vec![1f32, inf, 2.0], vec![1f32, inf, inf]),
            (vec![1.0, inf, 2.0, nan, 3.0], vec![1.0, inf, inf, nan, nan]),
            (vec![3e38, 3e38, -3e38], vec![3e38, inf, 3e38]),
            (vec![], vec![]),
        ] {
            let got = cumsum(&Tensor::new(x.as_slice(), dev)?, 0)?.to_vec1::<f32>()?;
            assert!(same(&got, &want), "{x:?}: {got:?} vs {want:?}");
        }
        let rows = Tensor::new(&[[1f32, 2.0, nan], [4.0, 5.0, 6.0]], dev)?;
        let got = cumsum(&rows, 1)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(same(&got, &[1.0, 3.0, nan, 4.0, 9.0, 15.0]), "{got:?}");
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let v = Var::new(x.as_slice(), dev)?;
        let w: Vec<f32> = (0..1000).map(|i| (i % 13) as f32).collect();
        let y = cumsum(v.as_tensor(), 0)?;
        let grads = (&y * Tensor::new(w.as_slice(), dev)?)?
            .sum_all()?
            .backward()?;
        let mut run = 0f64;
        for (i, got) in y.to_vec1::<f32>()?.iter().enumerate() {
            run += f64::from(x[i]);
            assert_eq!(got.to_bits(), (run as f32).to_bits(), "prefix {i}");
        }
        let g = grads.get(&v).unwrap().to_vec1::<f32>()?;
        let mut back = 0f32;
        for i in (0..1000).rev() {
            back += w[i];
            assert_eq!(g[i].to_bits(), back.to_bits(), "gradient {i}");
        }
        // Integers stay integers.
        let ids = Tensor::new(&[1u32, 2, 3], dev)?;
        assert_eq!(cumsum(&ids, 0)?.to_vec1::<u32>()?, [1, 3, 6]);
        Ok(())
    }
}
