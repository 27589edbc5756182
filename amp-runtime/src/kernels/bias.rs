//! The layers' bias add: `y + bias` along one dimension as one op, the bias's gradient summed
//! per channel in f32 (the batch-norm sums) rather than by candle in the gradient's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType,
};

use crate::kernels::channels::{channel_sum, column_sums, rounded_like, Affine, Geometry};
use crate::kernels::convert::to_dtype;
#[cfg(feature = "cuda")]
use crate::kernels::cuda;
use crate::kernels::elem::with_floats;
use crate::kernels::layout::contiguous;
use crate::kernels::leaf_grads::{offer, wanted};
use crate::kernels::parallel;

/// `y + bias` for an f32 master `bias` of `y`'s size along `dim` (the outputs' channels), with
/// the bias's gradient summed in f32: the composed paths' bias add (off the CPU, where the
/// layers' fused ops do not run). On CPU and CUDA, for f32, f16 and bf16 outputs, one op
/// ([`bias_add`]). Elsewhere candle ops: for a half `y` the bias is broadcast in
/// f32 and then rounded to `y`'s dtype (a copy of `y`'s size), so that candle's backward sums
/// the gradient over the broadcast dimensions in f32: rounding the bias first would have it
/// summed in half (candle's CUDA f16 sum accumulates in f16, so would its CPU one; 300 bf16
/// ones summed to 256).
pub(crate) fn add_bias(
    y: &candle_core::Tensor,
    bias: &candle_core::Tensor,
    dim: usize,
) -> candle_core::Result<candle_core::Tensor> {
    if bias_supported(y, bias) {
        return bias_add(y, bias, dim);
    }
    let mut shape = vec![1; y.rank()];
    let Some(at) = shape.get_mut(dim) else {
        candle_core::bail!("bias add: dimension {dim} of a rank-{} output", y.rank())
    };
    *at = bias.elem_count();
    let bias = bias.reshape(shape)?.broadcast_as(y.shape())?;
    if bias.dtype() == y.dtype() {
        return y + bias;
    }
    y + to_dtype(&bias, y.dtype())?
}

/// Whether [`bias_add`] handles `y + bias`: an f32, f16 or bf16 `y` and an f32 `bias` on CPU,
/// or (feature `cuda`) on a CUDA device.
pub(crate) fn bias_supported(y: &Tensor, bias: &Tensor) -> bool {
    let float = matches!(y.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let device = y.device().is_cpu() || (cfg!(feature = "cuda") && y.device().is_cuda());
    float && device && bias.dtype() == DType::F32 && y.device().same_device(bias.device())
}

/// `y + bias` for an f32 `bias` of one value per index of dimension `dim` of `y`: the bias
/// rounded to `y`'s dtype (the cast autocast gives a lower-precision op's bias, as the fused
/// CPU layers do), each sum computed in f32 and rounded once to `y`'s dtype, as one op with
/// its own backward. The bias's gradient is summed per channel in f32 runs and f64 totals (the
/// batch-norm sums); composed of candle ops, the broadcast bias would be a full-size node of the
/// graph and candle would sum its gradient in the gradient's dtype (half under autocast).
pub(crate) fn bias_add(y: &Tensor, bias: &Tensor, dim: usize) -> Result<Tensor> {
    y.contiguous()?.apply_op2(bias, BiasAdd { dim })
}

/// The op of [`bias_add`]; its forwards also finish the ops of the pointwise convolution off
/// the CPU and of `Linear` on CUDA.
pub(crate) struct BiasAdd {
    pub dim: usize,
}

impl BiasAdd {
    /// The geometry of `y` around `dim`, after checking that `bias` has one f32 per channel.
    fn geometry(&self, ly: &Layout, bias: DType, lb: &Layout) -> Result<Geometry> {
        let g = Geometry::along(ly.dims(), self.dim)?;
        if bias != DType::F32 || lb.shape().elem_count() != g.c {
            candle_core::bail!(
                "bias add: the bias must be {} f32 values, got {:?} {:?}",
                g.c,
                lb.shape(),
                bias
            )
        }
        Ok(g)
    }
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "amp-bias-add"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        ly: &Layout,
        bias: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = self.geometry(ly, bias.dtype(), lb)?;
        let CpuStorage::F32(b) = bias else {
            unreachable!("geometry checked the dtype")
        };
        let b = contiguous(b, lb, "bias add")?;
        let (zeros, ones) = (vec![0f32; g.c], vec![1f32; g.c]);
        let out = with_floats!("bias add", y, ly, |ys| {
            // The bias rounded to y's dtype (the identity for f32), then (y - 0) * 1 + b: the
            // affine pass's arithmetic is then exactly y + b.
            let b = rounded_like(ys, b);
            let affine = Affine {
                center: &zeros,
                scale: &ones,
                shift: &b,
            };
            WithDType::to_cpu_storage_owned(affine.apply(ys, None, g))
        });
        Ok((out, ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        bias: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = self.geometry(ly, bias.dtype(), lb)?;
        cuda::batch_norm::bias_add(y, ly, bias, lb, g)
    }

    fn bwd(
        &self,
        y: &Tensor,
        bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dim = self.dim;
        Ok((
            wanted(y, || Ok(grad.clone()))?,
            offer(bias, || channel_sums(grad, dim, bias.shape()))?,
        ))
    }
}

/// The gradient of a bias added along dimension `dim` of an output whose gradient is `grad`:
/// its per-channel sums (see [`ChannelSums`]), shaped as the bias.
pub(crate) fn channel_sums(grad: &Tensor, dim: usize, shape: &Shape) -> Result<Tensor> {
    grad.contiguous()?
        .apply_op1_no_bwd(&ChannelSums { dim })?
        .reshape(shape)
}

/// Per-channel sums along dimension `dim` as `(channels)` f32 values, summed as the
/// batch-norm statistics are: f32 within runs, f64 across them, rounded to f32 at the end.
struct ChannelSums {
    dim: usize,
}

impl CustomOp1 for ChannelSums {
    fn name(&self) -> &'static str {
        "amp-channel-sums"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::along(layout.dims(), self.dim)?;
        let sums: Vec<f64> = with_floats!("bias add", storage, layout, |xs| {
            if g.hw == 1 {
                column_sums(xs, g)
            } else {
                parallel::map_indices(g.c, |c| channel_sum(xs, g, c, |x| x))
            }
        });
        let sums = sums.into_iter().map(|s| s as f32).collect();
        Ok((CpuStorage::F32(sums), Shape::from(g.c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let g = Geometry::along(layout.dims(), self.dim)?;
        let (sums, _) = cuda::batch_norm::sums(storage, layout, g, None, 0, None, None, None)?;
        // Row 0 of the f64 sums, rounded to f32 on the device.
        let sums = sums.to_dtype(&Layout::contiguous(g.c), candle_core::DType::F32)?;
        Ok((sums, Shape::from(g.c)))
    }
}

#[cfg(test)]
mod tests {
    /// The bias gradient of channels innermost (a `Linear`'s, summed by columns) has the bits
    /// of the per-channel sums, in f32 and bf16, odd column counts across the column blocks.
    #[test]
    fn column_sums_are_the_channel_sums() {
        use crate::kernels::channels::{channel_sum, column_sums, Geometry};
        use crate::kernels::elem::Real;
        use crate::kernels::testing::values;
        /// Both sums' bits for every channel of `xs`.
        fn both<T: Real>(xs: &[T], g: Geometry) -> (Vec<u64>, Vec<u64>) {
            let columns = column_sums(xs, g).iter().map(|s| s.to_bits()).collect();
            let channels = (0..g.c)
                .map(|c| channel_sum(xs, g, c, |x| x).to_bits())
                .collect();
            (columns, channels)
        }
        for (n, c) in [(1, 1), (7, 3), (300, 257), (1024, 768)] {
            let g = Geometry { n, c, hw: 1 };
            let xs: Vec<f32> = values(n * c, 3).iter().map(|v| v * 1e3).collect();
            let bf: Vec<half::bf16> = xs.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let (columns, channels) = both(&xs, g);
            assert_eq!(columns, channels, "f32 {n}x{c}");
            let (columns, channels) = both(&bf, g);
            assert_eq!(columns, channels, "bf16 {n}x{c}");
        }
    }

    /// The bias add: values `y + b` in `y`'s dtype, and the bias's gradient summed over the
    /// other dimensions in f32: 300 rows of a bf16 output give 300 (rounding the bias to bf16
    /// before broadcasting it has candle sum its gradient in bf16: 256).
    #[test]
    fn the_bias_add_sums_its_gradient_in_f32() -> candle_core::Result<()> {
        use crate::kernels::bias::add_bias;
        use candle_core::{DType, Device, Tensor, Var};
        let dev = Device::Cpu;
        let y = Tensor::ones((300, 2), DType::BF16, &dev)?;
        let b = Var::new(&[0.5f32, -2.0], &dev)?;
        let out = add_bias(&y, &b, 1)?;
        assert_eq!(out.dtype(), DType::BF16);
        let rows = out.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        assert!(rows.iter().all(|r| r == &[1.5, -1.0]));
        let grads = out.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(&b).expect("a gradient").to_vec1::<f32>()?;
        assert_eq!(g, [300.0, 300.0]);
        let rounded_first = y.broadcast_add(&b.to_dtype(DType::BF16)?)?;
        let grads = rounded_first.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(&b).expect("a gradient").to_vec1::<f32>()?;
        assert_eq!(g, [256.0, 256.0], "candle sums a bf16 gradient in bf16");
        // Per channel along dimension 1 of a conv output.
        let y = Tensor::zeros((2, 2, 3, 3), DType::F16, &dev)?;
        let out = add_bias(&y, &b, 1)?.to_dtype(DType::F32)?;
        assert_eq!(out.sum((0, 2, 3))?.to_vec1::<f32>()?, [9.0, -36.0]);
        Ok(())
    }

    /// The bias add's values are `y + b` (`b` rounded to `y`'s dtype) computed in f32 and rounded
    /// once to `y`'s dtype, its
    /// input gradient is the output gradient itself and its bias gradient the per-channel sum
    /// of it (against f64), for any dimension, strided inputs and every float dtype.
    #[test]
    fn the_bias_add_matches_an_f64_reference() -> candle_core::Result<()> {
        use crate::kernels::bias::add_bias;
        use candle_core::{DType, Device, Tensor, Var};
        let dev = Device::Cpu;
        let draw = |n: usize, seed: u64| -> Vec<f32> {
            let mut s = seed;
            (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695);
                    ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 3.0
                })
                .collect()
        };
        let cases: [(&[usize], usize); 5] = [
            (&[3, 5, 4, 2], 1),
            (&[7, 300], 1),
            (&[2, 4, 9], 1),
            (&[6], 0),
            (&[4, 3, 2], 2),
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (case, &(dims, dim)) in cases.iter().enumerate() {
                for strided in [false, true] {
                    let n: usize = dims.iter().product();
                    let y = Tensor::from_vec(draw(n, case as u64 + 1), dims, &dev)?;
                    // The same values through a transposed view when asked (rank >= 2).
                    let y = if strided && dims.len() >= 2 {
                        y.t()?.contiguous()?.t()?
                    } else {
                        y
                    };
                    let y = Var::from_tensor(&y.to_dtype(dtype)?)?;
                    let c = dims[dim];
                    let b = Var::new(draw(c, 99 + case as u64), &dev)?;
                    let out = add_bias(&y, &b, dim)?;
                    assert_eq!((out.dtype(), out.dims()), (dtype, dims));
                    // Reference: the bias rounded to the dtype; y and b are then f32 values,
                    // so their f32 sum is the exact sum rounded to f32; then one rounding to
                    // the dtype.
                    let inner: usize = dims[dim + 1..].iter().product();
                    let ys = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let bs = b.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    let channel = |i: usize| (i / inner) % c;
                    let expect: Vec<f32> = ys
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| v + bs[channel(i)])
                        .collect();
                    let expect = Tensor::new(expect, &dev)?
                        .to_dtype(dtype)?
                        .to_dtype(DType::F32)?;
                    let got = out.to_dtype(DType::F32)?.flatten_all()?;
                    let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
                        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
                    };
                    assert_eq!(bits(&got)?, bits(&expect)?, "{dtype:?} {dims:?} dim {dim}");

                    let w = Tensor::from_vec(draw(n, 7 + case as u64), dims, &dev)?;
                    let grads = (out.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
                    let dy = grads.get(&y).expect("a gradient for y");
                    let dout = w.to_dtype(dtype)?; // candle's to_dtype backward rounds
                    assert_eq!(dy.dtype(), dtype);
                    assert_eq!(
                        bits(&dy.to_dtype(DType::F32)?.flatten_all()?)?,
                        bits(&dout.to_dtype(DType::F32)?.flatten_all()?)?
                    );
                    let dout = dout.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let mut exact = vec![0f64; c];
                    let mut scale = vec![0f64; c];
                    for (i, &g) in dout.iter().enumerate() {
                        exact[channel(i)] += f64::from(g);
                        scale[channel(i)] += f64::from(g.abs());
                    }
                    let db = grads.get(&b).expect("a gradient for b").to_vec1::<f32>()?;
                    for ((&got, &want), &scale) in db.iter().zip(&exact).zip(&scale) {
                        let tol = 1e-6 * scale + f64::from(f32::EPSILON) * want.abs();
                        assert!((f64::from(got) - want).abs() <= tol, "{got} vs {want}");
                    }
                }
            }
        }
        Ok(())
    }
}
