//! A convolution and the training batch norm after it as one node of the autograd graph, off the
//! CPU (CUDA): the convolution's forward, the batch's statistics and the normalisation run as
//! the ops they are on their own (the conv op's cuDNN or cuBLAS forward, `BatchStats`, the
//! affine pass of `Normalisation`), and one op over the conv's input, its kernel and the layer's
//! per-channel parameters stands for all of them in the graph.
//!
//! Against the two layers in a row this spares, per layer and training step: the conv bias's
//! add (a pass over the output) and its gradient's sum (another), and one full-size node, whose
//! gradient candle's backward stores as a zero tensor plus an add (on `quantized_sine --size
//! 512`'s 256-channel layers, each such add took longer than the conv's forward product).
//! The conv's output is rounded to the input's precision before it is normalised, as in the two
//! layers (and PyTorch): this is the CPU op of `after_conv` minus its f32 sums, which would
//! double the bytes the statistics' passes read on a GPU.
//!
//! The conv bias is folded as there: it only moves each channel's mean, which the batch's own
//! statistics remove, so the output is that of the biasless conv, the running mean moves towards
//! the batch's mean plus the bias, and the bias's gradient is exactly 0 (summing the output's
//! gradient would give the rounding noise of a cancelling sum).

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::{batch_stats, Normalisation};
use crate::kernels::conv::{self, Conv2dParams};
use crate::kernels::leaf_grads::wanted;

/// The per-channel parameters and statistics of [`conv_batch_norm_train`].
pub(crate) struct Running<'a> {
    pub mean: &'a Tensor,
    pub var: &'a Tensor,
    pub eps: f64,
    pub momentum: f64,
}

/// `batch_norm(conv2d(x, k) + conv_bias) * gamma + beta` with the batch's statistics, through a
/// ReLU if `relu`, for `params = [conv_bias, gamma, beta]` (f32, `(3, c_out)`), in `x`'s dtype;
/// `k` may be the f32 master of a half `x`. Also returns the `(4, c_out)` f32 rows of
/// [`batch_stats`] (the batch's mean and inverse deviation, the new running mean and variance).
/// `check` sees the conv's output dimensions before the statistics are taken (the batch
/// norm's checks). For the convolutions `conv::one_op_on_cuda` takes (and any on CPU, where the
/// tests run it against the two layers).
pub(crate) fn conv_batch_norm_train(
    x: &Tensor,
    k: &Tensor,
    params: &Tensor,
    conv: Conv2dParams,
    running: Running<'_>,
    relu: bool,
    check: impl FnOnce(&[usize]) -> Result<()>,
) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    // Outside the graph: the op below is the conv's node.
    let z = conv::conv2d(&x.detach(), &k.detach(), None, conv)?;
    check(z.dims())?;
    let params = params.contiguous()?;
    let conv_bias = params.get(0)?.detach();
    let rows = batch_stats(
        &z,
        running.mean,
        running.var,
        Some(&conv_bias),
        running.eps,
        running.momentum,
    )?;
    let norm = Normalisation {
        mean: rows.get(0)?,
        invstd: rows.get(1)?,
        train: true,
        affine: true,
        relu,
    };
    let y = x.apply_op3(&k.contiguous()?, &params, AfterConv { z, norm, conv })?;
    Ok((y, rows))
}

/// The op of [`conv_batch_norm_train`]: the conv's output `z` and its statistics are computed,
/// the forward normalises `z`, the backward goes back through the batch norm and the conv.
struct AfterConv {
    z: Tensor,
    norm: Normalisation,
    conv: Conv2dParams,
}

impl AfterConv {
    /// The layouts of `gamma` and `beta`, rows 1 and 2 of the contiguous `(3, c)` parameters.
    fn affine_rows(lp: &Layout) -> Result<(Layout, Layout)> {
        let (Some((start, end)), &[3, c]) = (lp.contiguous_offsets(), lp.dims()) else {
            candle_core::bail!(
                "conv + batch norm: parameters {:?}, (3, c) expected",
                lp.dims()
            )
        };
        debug_assert_eq!(end - start, 3 * c);
        let row = |r: usize| Layout::contiguous_with_offset(c, start + r * c);
        Ok((row(1), row(2)))
    }
}

impl CustomOp3 for AfterConv {
    fn name(&self) -> &'static str {
        "amp-conv-batch-norm-train"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        _k: &CpuStorage,
        _lk: &Layout,
        params: &CpuStorage,
        lp: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gamma, beta) = Self::affine_rows(lp)?;
        let (z, lz) = self.z.storage_and_layout();
        let Storage::Cpu(z) = &*z else {
            candle_core::bail!("conv + batch norm: the conv's output is not on the CPU")
        };
        self.norm.cpu_fwd(z, lz, params, &gamma, params, &beta)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        _k: &candle_core::CudaStorage,
        _lk: &Layout,
        params: &candle_core::CudaStorage,
        lp: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (gamma, beta) = Self::affine_rows(lp)?;
        let (z, lz) = self.z.storage_and_layout();
        let Storage::Cuda(z) = &*z else {
            candle_core::bail!("conv + batch norm: the conv's output is not on the CUDA device")
        };
        self.norm.cuda_fwd(z, lz, params, &gamma, params, &beta)
    }

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        params: &Tensor,
        _y: &Tensor, // the ReLU's mask is recomputed from z
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let affine = (&params.get(1)?, &params.get(2)?);
        let (dz, consts) = self.norm.grads(&self.z, affine, dy, |z, dy, grad| {
            z.apply_op2_no_bwd(dy, grad)
        })?;
        let (dx, dk) = conv::conv2d_grads(x, k, self.conv, &dz)?;
        // Rows 3 to 5 of the constants: 0 for the conv bias, then the scale's and shift's.
        let dparams = wanted(params, || consts.narrow(0, 3, 3))?;
        Ok((dx, dk, dparams))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::kernels::batch_norm::batch_norm;

    /// The op against the conv op and the batch-norm op in a row on the CPU, the conv there
    /// without its bias: the same rounding points and kernels, so the output and the gradients
    /// of the input, kernel, scale and shift agree bit for bit; the conv bias (which the batch's
    /// mean removes) gets a gradient of exactly 0 and moves only the running mean, by
    /// `momentum * bias`. Pointwise and 3x3 convolutions, with and without the ReLU, in f32, f16
    /// and bf16 (an f32 master kernel).
    #[test]
    fn matches_the_conv_and_batch_norm_ops_in_a_row() -> Result<()> {
        let dev = &Device::Cpu;
        let values = |n: usize, seed: u64| -> Result<Tensor> {
            let v = crate::kernels::testing::values(n, seed);
            Tensor::from_vec(v, n, dev)
        };
        let pointwise = Conv2dParams {
            padding: 0,
            stride: 1,
            dilation: 1,
            groups: 1,
        };
        let padded = Conv2dParams {
            padding: 1,
            ..pointwise
        };
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (conv, ks) in [(pointwise, 1), (padded, 3)] {
                for relu in [false, true] {
                    let (n, c_in, c, hw) = (2, 3, 4, 5);
                    let x = Var::from_tensor(
                        &values(n * c_in * hw * hw, 1)?
                            .reshape((n, c_in, hw, hw))?
                            .to_dtype(dtype)?,
                    )?;
                    let k = Var::from_tensor(
                        &(values(c * c_in * ks * ks, 2)?.reshape((c, c_in, ks, ks))? * 0.5)?,
                    )?;
                    let bias = Var::from_tensor(&values(c, 3)?)?;
                    let gamma = Var::from_tensor(&(values(c, 4)? + 1.0)?)?;
                    let beta = Var::from_tensor(&values(c, 5)?)?;
                    let (rm, rv) = (Tensor::full(0.25f32, c, dev)?, Tensor::full(2f32, c, dev)?);
                    let running = || Running {
                        mean: &rm,
                        var: &rv,
                        eps: 1e-5,
                        momentum: 0.1,
                    };
                    let r = values(n * c * hw * hw, 6)?.reshape((n, c, hw, hw))?;
                    let grads_of =
                        |y: &Tensor| (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward();

                    let params =
                        Tensor::stack(&[bias.as_tensor(), gamma.as_tensor(), beta.as_tensor()], 0)?;
                    let (y, rows) =
                        conv_batch_norm_train(&x, &k, &params, conv, running(), relu, |_| Ok(()))?;
                    let g = grads_of(&y)?;

                    let z = conv::conv2d(&x, &k, None, conv)?;
                    let want_rows = batch_stats(&z, &rm, &rv, None, 1e-5, 0.1)?;
                    let norm = Normalisation {
                        mean: want_rows.get(0)?,
                        invstd: want_rows.get(1)?,
                        train: true,
                        affine: true,
                        relu,
                    };
                    let want = batch_norm(&z, &gamma, &beta, norm)?;
                    let wg = grads_of(&want)?;

                    let case = format!("{dtype:?} {ks}x{ks} relu {relu}");
                    assert_eq!(y.dtype(), dtype, "{case}");
                    let bits = |t: &Tensor| -> Result<Vec<f32>> {
                        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
                    };
                    assert_eq!(bits(&y)?, bits(&want)?, "{case}: output");
                    for (name, v) in [("x", &x), ("k", &k), ("gamma", &gamma), ("beta", &beta)] {
                        let (got, exp) = (g.get(v), wg.get(v));
                        let (Some(got), Some(exp)) = (got, exp) else {
                            panic!("{case}: no gradient of {name}")
                        };
                        assert_eq!(got.dtype(), v.dtype(), "{case}: {name}'s gradient dtype");
                        assert_eq!(bits(got)?, bits(exp)?, "{case}: gradient of {name}");
                    }
                    let zero = g.get(&bias).map(bits).transpose()?;
                    assert_eq!(zero, Some(vec![0.0; c]), "{case}: the conv bias's gradient");
                    // Rows 0, 1 and 3 (mean, invstd, running variance) are the batch norm's;
                    // the running mean moves towards the mean plus the bias.
                    for row in [0, 1, 3] {
                        assert_eq!(
                            bits(&rows.get(row)?)?,
                            bits(&want_rows.get(row)?)?,
                            "{case}"
                        );
                    }
                    let (moved, want_moved, b) = (
                        bits(&rows.get(2)?)?,
                        bits(&want_rows.get(2)?)?,
                        bits(&bias)?,
                    );
                    for ((m, w), b) in moved.iter().zip(&want_moved).zip(&b) {
                        assert!(
                            (m - (w + 0.1 * b)).abs() <= 1e-6,
                            "{case}: running mean {m} vs {w} + 0.1 * {b}"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
