//! The CUDA ops against the CPU ops on the same inputs: values and every gradient, in f32, f16
//! and bf16 (needs a GPU; built with `--features cuda`, and `cudnn` for the cuDNN
//! convolutions): convolutions, batch norm, max pooling, attention, softmax, layer norm. The CPU op is the reference: f32
//! accumulation, one rounding per output.
//!
//! Tolerances: the two devices sum in different orders, and cuDNN rounds the kernel gradient
//! to the input's dtype before widening it (the CPU op keeps it in f32); f32 convolutions may
//! use TF32 (10-bit mantissa products), PyTorch's default. Each value is compared against
//! `tol * max(|reference|, mean |reference|)`.
#![cfg(feature = "cuda")]
// Exact comparisons where a value must be exactly zero.
#![allow(clippy::float_cmp)]

use candle_amp::nn::{self, Conv1dConfig, Conv2dConfig};
use candle_amp::{autocast, Precision, Tensor, BF16, F16, F32};
use candle_core::{DType, Device, Result, Var};

mod common;

/// Relative tolerance of one precision (a few units of its last place; TF32's for f32).
fn tol(dtype: DType) -> f32 {
    if dtype == DType::BF16 {
        4.0 * 2f32.powi(-8)
    } else {
        // f16's 11 significant bits; TF32's too.
        4.0 * 2f32.powi(-11)
    }
}

fn assert_close(
    what: &str,
    got: &candle_core::Tensor,
    want: &candle_core::Tensor,
    tol: f32,
) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let want = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let scale = want.iter().map(|v| v.abs()).sum::<f32>() / want.len().max(1) as f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let bound = tol * w.abs().max(scale);
        assert!(
            (g - w).abs() <= bound,
            "{what}[{i}]: cuda {g} vs cpu {w} (bound {bound})"
        );
    }
    Ok(())
}

/// What one run of a layer gives: the output, and the gradients of the input, weight and bias
/// of `sum(y * r)` for fixed random `r`.
struct Run {
    y: candle_core::Tensor,
    grads: Vec<candle_core::Tensor>,
}

/// Values from [`common::values`] as an f32 tensor on `dev`.
fn randn(shape: &[usize], seed: u64, dev: &Device) -> Result<candle_core::Tensor> {
    let n = shape.iter().product();
    candle_core::Tensor::from_vec(common::values(n, seed), shape, dev)
}

/// `layer(x)` on `dev` from the f32 master weight and bias and an input rounded to `P`, with
/// the gradients of `sum(y * r)` (input, weight, bias).
fn run<P: Precision>(
    dev: &Device,
    x_shape: &[usize],
    w_shape: &[usize],
    layer: impl Fn(Var, Var) -> Result<Box<dyn Fn(&Tensor<P>) -> Result<Tensor<P>>>>,
) -> Result<Run> {
    let x = Var::from_tensor(&randn(x_shape, 1, dev)?.to_dtype(P::DTYPE)?)?;
    let w = Var::from_tensor(&(randn(w_shape, 2, dev)? * 0.5)?)?;
    let b = Var::from_tensor(&randn(&[w_shape[0]], 3, dev)?)?;
    let forward = layer(w.clone(), b.clone())?;
    let y = forward(&Tensor::<P>::from_candle(x.as_tensor().clone())?)?;
    let y = y.as_candle().clone();
    let r = randn(y.dims(), 4, dev)?;
    let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
    let grads = [&x, &w, &b]
        .iter()
        .map(|v| {
            grads
                .get(v)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("a gradient is missing".into()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Run { y, grads })
}

/// The CUDA run against the CPU run: values, then each gradient (the weight's and bias's f32).
fn compare<P: Precision>(
    what: &str,
    x_shape: &[usize],
    w_shape: &[usize],
    layer: impl Fn(Var, Var) -> Result<Box<dyn Fn(&Tensor<P>) -> Result<Tensor<P>>>>,
) -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    let want = run::<P>(&Device::Cpu, x_shape, w_shape, &layer)?;
    let got = run::<P>(&cuda, x_shape, w_shape, &layer)?;
    assert_eq!(got.y.dtype(), P::DTYPE, "{what}: output dtype");
    let t = tol(P::DTYPE);
    assert_close(&format!("{what} {:?} y", P::DTYPE), &got.y, &want.y, t)?;
    for (name, (g, w)) in ["grad x", "grad w", "grad b"]
        .iter()
        .zip(got.grads.iter().zip(&want.grads))
    {
        if *name != "grad x" {
            assert_eq!(g.dtype(), DType::F32, "{what}: {name} of an f32 master");
        }
        assert_close(&format!("{what} {:?} {name}", P::DTYPE), g, w, t)?;
    }
    Ok(())
}

/// The geometries the convolution tests run: 3x3 same-padding, strided, a strided 1x1 (the
/// ResNet downsample), the 7x7 stem, dilated, grouped.
fn conv2d_configs() -> Vec<(usize, Conv2dConfig)> {
    let cfg = |padding, stride, dilation, groups| Conv2dConfig {
        padding,
        stride,
        dilation,
        groups,
        ..Default::default()
    };
    vec![
        (3, cfg(1, 1, 1, 1)),
        (3, cfg(1, 2, 1, 1)),
        (1, cfg(0, 2, 1, 1)),
        (7, cfg(3, 2, 1, 1)),
        (3, cfg(2, 1, 2, 1)),
        (3, cfg(1, 1, 1, 2)),
        (1, cfg(0, 1, 1, 1)),
    ]
}

fn conv2d_matches_cpu<P: Precision>() -> Result<()> {
    for (k, cfg) in conv2d_configs() {
        let what = format!("conv2d k{k} {cfg:?}");
        compare::<P>(
            &what,
            &[2, 4, 11, 11],
            &[6, 4 / cfg.groups, k, k],
            |w, b| {
                let conv = nn::Conv2d::new(w, Some(b), cfg)?;
                Ok(Box::new(move |x: &Tensor<P>| conv.forward(x)))
            },
        )?;
    }
    Ok(())
}

fn conv1d_matches_cpu<P: Precision>() -> Result<()> {
    for (padding, stride) in [(2, 1), (0, 2)] {
        let cfg = Conv1dConfig {
            padding,
            stride,
            ..Default::default()
        };
        compare::<P>(
            &format!("conv1d {cfg:?}"),
            &[2, 4, 17],
            &[6, 4, 5],
            |w, b| {
                let conv = nn::Conv1d::new(w, Some(b), cfg)?;
                Ok(Box::new(move |x: &Tensor<P>| conv.forward(x)))
            },
        )?;
    }
    Ok(())
}

/// The transposed conv (the tensor method; no bias: `b` is added to the output instead, in f32,
/// so that the comparison still covers a bias gradient). The kernel is `(c_in, c_out, kh, kw)`: 6 in,
/// 6 out, as the bias's length.
fn conv_transpose2d_matches_cpu<P: Precision>() -> Result<()> {
    for (k, padding, output_padding, stride) in [(3, 1, 1, 2), (4, 1, 0, 2), (3, 0, 0, 1)] {
        let what = format!("conv_transpose2d k{k} p{padding} op{output_padding} s{stride}");
        compare::<P>(&what, &[2, 6, 7, 7], &[6, 6, k, k], move |w, b| {
            Ok(Box::new(move |x: &Tensor<P>| {
                let k = Tensor::<F32>::from_candle(w.as_tensor().clone())?.cast::<P>()?;
                let y = x.conv_transpose2d(&k, padding, output_padding, stride, 1)?;
                // The bias added in f32 (candle's broadcast add of half values would sum the
                // bias's gradient in half, in a different order on each device).
                let b = b.as_tensor().reshape((1, 6, 1, 1))?;
                let y = y.cast::<F32>()?.into_candle().broadcast_add(&b)?;
                Tensor::<F32>::from_candle(y)?.cast::<P>()
            }))
        })?;
    }
    Ok(())
}

/// Batch norm in training and evaluation; rows of 25 values (one at a time), of 32 (the
/// kernels' 16-byte loads), and the small rows of a late layer, whose 16-byte groups of several
/// rows share a block of the affine pass: 4 values (f32: one group a row; half: one at a time)
/// and 16 (two groups a row in f32, one in half).
fn batch_norm_matches_cpu<P: Precision>() -> Result<()> {
    for x_shape in [[4, 6, 5, 5], [2, 6, 8, 4], [5, 6, 2, 2], [3, 6, 4, 4]] {
        batch_norm_matches_cpu_on::<P>(&x_shape)?;
    }
    Ok(())
}

/// `BatchNorm2d` in training mode (batch statistics, the running ones moved), then in evaluation
/// mode with the moved running statistics: both outputs, batched, so that the comparison covers
/// the running-statistics update too.
fn batch_norm_matches_cpu_on<P: Precision>(x_shape: &[usize]) -> Result<()> {
    compare::<P>("batch_norm2d", x_shape, &[6], |w, b| {
        let dev = w.device().clone();
        let running_mean = Var::from_tensor(&(randn(&[6], 5, &dev)? * 0.1)?)?;
        let running_var = Var::from_tensor(&(randn(&[6], 6, &dev)?.abs()? + 0.5)?)?;
        let bn = nn::BatchNorm2d::new(running_mean, running_var, Some((w, b)), 1e-5, 0.1)?;
        Ok(Box::new(move |x: &Tensor<P>| {
            let train = bn.forward_t(x, true)?;
            let eval = bn.forward_t(x, false)?;
            Tensor::<P>::from_candle(candle_core::Tensor::cat(
                &[train.as_candle(), eval.as_candle()],
                0,
            )?)
        }))
    })
}

/// `MaxPool2d` (ResNet's stem pool: 3x3, stride 2, padding 1, overlapping windows): the same
/// values, bit for bit (each output is a copy of its window's first maximum), and the input
/// gradient (summed in f32 where windows overlap, rounded once).
fn max_pool_matches_cpu<P: Precision>() -> Result<()> {
    let run = |dev: &Device| -> Result<(candle_core::Tensor, candle_core::Tensor)> {
        let x = Var::from_tensor(&randn(&[2, 3, 9, 9], 7, dev)?.to_dtype(P::DTYPE)?)?;
        let pool = nn::MaxPool2d::with_stride(3, 2).with_padding(1);
        let y = pool
            .forward(&Tensor::<P>::from_candle(x.as_tensor().clone())?)?
            .into_candle();
        let r = randn(y.dims(), 8, dev)?;
        let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
        let gx = grads
            .get(&x)
            .cloned()
            .ok_or_else(|| candle_core::Error::Msg("no input gradient".into()))?;
        Ok((y, gx))
    };
    let (want_y, want_g) = run(&Device::Cpu)?;
    let (got_y, got_g) = run(&Device::new_cuda(0)?)?;
    assert_close(&format!("max_pool {:?} y", P::DTYPE), &got_y, &want_y, 0.0)?;
    assert_close(
        &format!("max_pool {:?} grad x", P::DTYPE),
        &got_g,
        &want_g,
        tol(P::DTYPE),
    )
}

/// `ConvBnReLU2d` on CUDA, where batch norm and the ReLU are one op, against `ConvBn2d` and a
/// separate ReLU on the same device and variables: the same values (rounding commutes with
/// ReLU) and gradients (the mask from the output is the mask from the input), up to the order
/// of the statistics' sums.
fn conv_bn_relu_matches_conv_bn_then_relu<P: Precision>() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let x = Var::from_tensor(&randn(&[2, 4, 9, 9], 11, &dev)?.to_dtype(P::DTYPE)?)?;
    let w = Var::from_tensor(&(randn(&[6, 4, 3, 3], 12, &dev)? * 0.5)?)?;
    let (gamma, beta) = (
        Var::from_tensor(&(randn(&[6], 13, &dev)? + 1.0)?)?,
        Var::from_tensor(&randn(&[6], 14, &dev)?)?,
    );
    let layer = |relu: bool| -> Result<(candle_core::Tensor, Vec<candle_core::Tensor>)> {
        let cfg = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let conv = nn::Conv2d::new(w.clone(), None, cfg)?;
        let stats = |v: f32| Var::from_tensor(&candle_core::Tensor::full(v, 6, &dev)?);
        let bn = nn::BatchNorm2d::new(
            stats(0.0)?,
            stats(1.0)?,
            Some((gamma.clone(), beta.clone())),
            1e-5,
            0.1,
        )?;
        let xt = Tensor::<P>::from_candle(x.as_tensor().clone())?;
        let y = if relu {
            nn::ConvBnReLU2d::new(conv, bn)?.forward_t(&xt, true)?
        } else {
            nn::ConvBn2d::new(conv, bn)?.forward_t(&xt, true)?.relu()?
        };
        let y = y.into_candle();
        let r = randn(y.dims(), 15, &dev)?;
        let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
        let grads = [&x, &w, &gamma, &beta]
            .iter()
            .map(|v| grads.get(v).cloned())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| candle_core::Error::Msg("a gradient is missing".into()))?;
        Ok((y, grads))
    };
    let (fused, fused_grads) = layer(true)?;
    let (apart, apart_grads) = layer(false)?;
    let what = format!("conv_bn_relu {:?}", P::DTYPE);
    // The batch-norm sums are f64 atomics: their order, not their terms, may differ between
    // the runs, and move a rounding by a unit.
    assert_close(&format!("{what} y"), &fused, &apart, tol(P::DTYPE))?;
    for (g, w) in fused_grads.iter().zip(&apart_grads) {
        assert_close(&format!("{what} grads"), g, w, tol(P::DTYPE))?;
    }
    Ok(())
}

/// What a training step of a conv + batch norm + ReLU gives: the output, the gradients of the
/// input, kernel, scale and shift (and the conv bias, when it has one), and the new running mean
/// and variance.
struct ConvBnRun {
    y: candle_core::Tensor,
    grads: Vec<candle_core::Tensor>,
    running: [candle_core::Tensor; 2],
}

/// `ConvBnReLU2d` in training on CUDA, one op there (the conv's forward, the batch's statistics
/// and the normalisation behind one graph node), against the CPU's `Conv2d`, `BatchNorm2d` and
/// ReLU as three layers, the conv there without the bias (which the batch's mean removes): the
/// values, the gradients of the input, kernel, scale and shift, the running variance; on CUDA
/// the bias's gradient is exactly 0 and the running mean moves by `momentum * bias` more.
/// Pointwise and 3x3 convolutions (both cuDNN's with `cudnn`), on 9x9 images (rows read one
/// value at a time) and 8x8 (16-byte loads).
fn conv_bn_relu_train_matches_cpu_layers<P: Precision>() -> Result<()> {
    let run = |dev: &Device, ks: usize, side: usize, fused: bool| -> Result<ConvBnRun> {
        let x = Var::from_tensor(&randn(&[2, 4, side, side], 21, dev)?.to_dtype(P::DTYPE)?)?;
        let w = Var::from_tensor(&(randn(&[6, 4, ks, ks], 22, dev)? * 0.5)?)?;
        let b = Var::from_tensor(&randn(&[6], 23, dev)?)?;
        let gamma = Var::from_tensor(&(randn(&[6], 24, dev)? + 1.0)?)?;
        let beta = Var::from_tensor(&randn(&[6], 25, dev)?)?;
        let cfg = Conv2dConfig {
            padding: ks / 2,
            ..Default::default()
        };
        let stats = |v: f32| Var::from_tensor(&candle_core::Tensor::full(v, 6, dev)?);
        let (running_mean, running_var) = (stats(0.5)?, stats(2.0)?);
        let bn = nn::BatchNorm2d::new(
            running_mean.clone(),
            running_var.clone(),
            Some((gamma.clone(), beta.clone())),
            1e-5,
            0.1,
        )?;
        let xt = Tensor::<P>::from_candle(x.as_tensor().clone())?;
        let (y, mut vars) = if fused {
            let conv = nn::Conv2d::new(w.clone(), Some(b.clone()), cfg)?;
            let y = nn::ConvBnReLU2d::new(conv, bn)?.forward_t(&xt, true)?;
            (y, vec![&x, &w, &gamma, &beta, &b])
        } else {
            let conv = nn::Conv2d::new(w.clone(), None, cfg)?;
            let y = bn.forward_t(&conv.forward(&xt)?, true)?.relu()?;
            (y, vec![&x, &w, &gamma, &beta])
        };
        let y = y.into_candle();
        let r = randn(y.dims(), 26, dev)?;
        let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
        let grads = vars
            .drain(..)
            .map(|v| grads.get(v).cloned())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| candle_core::Error::Msg("a gradient is missing".into()))?;
        let running = [
            running_mean.as_tensor().clone(),
            running_var.as_tensor().clone(),
        ];
        Ok(ConvBnRun { y, grads, running })
    };
    let cuda = Device::new_cuda(0)?;
    let t = tol(P::DTYPE);
    for (ks, side) in [(1, 9), (3, 9), (1, 8), (3, 8)] {
        let got = run(&cuda, ks, side, true)?;
        let want = run(&Device::Cpu, ks, side, false)?;
        let what = format!(
            "conv_bn_relu train {ks}x{ks} on {side}x{side} {:?}",
            P::DTYPE
        );
        assert_eq!(got.y.dtype(), P::DTYPE, "{what}: output dtype");
        assert_close(&format!("{what} y"), &got.y, &want.y, t)?;
        for (name, (g, w)) in ["x", "w", "gamma", "beta"]
            .iter()
            .zip(got.grads.iter().zip(&want.grads))
        {
            assert_close(&format!("{what} grad {name}"), g, w, t)?;
        }
        let bias_grad = got.grads[4].to_vec1::<f32>()?;
        assert_eq!(bias_grad, vec![0.0; 6], "{what}: the conv bias's gradient");
        let bias = randn(&[6], 23, &Device::Cpu)?;
        let moved = (&want.running[0] + (bias * 0.1)?)?;
        assert_close(&format!("{what} running mean"), &got.running[0], &moved, t)?;
        assert_close(
            &format!("{what} running var"),
            &got.running[1],
            &want.running[1],
            t,
        )?;
    }
    Ok(())
}

/// The mask of one attention case.
#[derive(Clone, Copy, Debug)]
enum AttnMask {
    None,
    /// A float `(t_q, t_k)` mask added to the scores.
    Additive,
    /// A boolean (`u8`) `(b, 1, t_q, t_k)` mask, each batch's row 0 hiding every key.
    Boolean,
}

/// `ops::scaled_dot_product_attention` on CUDA (one op: cuBLAS products in `P`, the masked
/// softmax in one f32 kernel) against the CPU op (f32 between the products): the output and the
/// three gradients, grouped-query heads, for query/key lengths 1, 7, 64, 1000 and a KV cache's
/// 7 against 20, with no mask, an additive mask, a boolean mask with a row that sees no key (its
/// output and gradients 0 on both, no NaN anywhere) and the causal mask. Both keep the scores
/// in f32; the tolerance is four times the others' for the sums over up to 1000 rounded
/// probabilities and scores' gradients, taken in different orders.
fn attention_matches_cpu<P: Precision>() -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    let cases = [
        (1, 1, AttnMask::None, false),
        (7, 7, AttnMask::Boolean, false),
        (7, 7, AttnMask::None, true),
        (64, 64, AttnMask::Additive, true),
        (7, 20, AttnMask::Boolean, true),
        (1000, 1000, AttnMask::None, true),
    ];
    for (tq, tk, mask_kind, causal) in cases {
        let run = |dev: &Device| -> Result<Vec<candle_core::Tensor>> {
            let head = |heads: usize, t: usize, seed: u64| -> Result<Var> {
                Var::from_tensor(&randn(&[2, heads, t, 16], seed, dev)?.to_dtype(P::DTYPE)?)
            };
            let (q, k, v) = (head(4, tq, 1)?, head(2, tk, 2)?, head(2, tk, 3)?);
            let typed = |x: &Var| Tensor::<P>::from_candle(x.as_tensor().clone());
            let mask = match mask_kind {
                AttnMask::None => None,
                AttnMask::Additive => Some(randn(&[tq, tk], 5, dev)?),
                AttnMask::Boolean => {
                    let keep: Vec<u8> = (0..2 * tq * tk)
                        .map(|e| u8::from(e % (tq * tk) >= tk && (e * 7) % 5 != 0))
                        .collect();
                    Some(candle_core::Tensor::from_vec(keep, (2, 1, tq, tk), dev)?)
                }
            };
            let y = candle_amp::ops::scaled_dot_product_attention(
                &typed(&q)?,
                &typed(&k)?,
                &typed(&v)?,
                mask.as_ref(),
                None,
                causal,
            )?;
            let y = y.as_candle().clone();
            let r = randn(y.dims(), 4, dev)?;
            let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
            let mut out = vec![y];
            for x in [&q, &k, &v] {
                out.push(grads.get(x).cloned().expect("a gradient for q, k and v"));
            }
            Ok(out)
        };
        let (want, got) = (run(&Device::Cpu)?, run(&cuda)?);
        for (name, (g, w)) in ["y", "grad q", "grad k", "grad v"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            assert_eq!(g.dtype(), P::DTYPE, "attention {name}: dtype");
            let what = format!(
                "attention {:?} {tq}x{tk} {mask_kind:?} causal {causal} {name}",
                P::DTYPE
            );
            let values = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(values.iter().all(|x| x.is_finite()), "{what}: not finite");
            assert_close(&what, g, w, 4.0 * tol(P::DTYPE))?;
        }
        if matches!(mask_kind, AttnMask::Boolean) {
            // Row 0 of each batch sees no key: output 0, and no gradient into its query.
            let y0 = got[0]
                .narrow(2, 0, 1)?
                .abs()?
                .sum_all()?
                .to_dtype(DType::F32)?;
            let dq0 = got[1]
                .narrow(2, 0, 1)?
                .abs()?
                .sum_all()?
                .to_dtype(DType::F32)?;
            assert_eq!(
                y0.to_scalar::<f32>()?,
                0.0,
                "a row that sees no key: output"
            );
            assert_eq!(
                dq0.to_scalar::<f32>()?,
                0.0,
                "a row that sees no key: query gradient"
            );
        }
    }
    Ok(())
}

/// `ops::scaled_dot_product_attention_packed` on CUDA (the parts read from the packed
/// projection, the output written `(b, t, h, d)`) against the CPU op: the output and the packed
/// gradient, causal.
fn packed_attention_matches_cpu<P: Precision>() -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    let run = |dev: &Device| -> Result<[candle_core::Tensor; 2]> {
        let qkv = Var::from_tensor(&randn(&[2, 9, 3, 4, 16], 1, dev)?.to_dtype(P::DTYPE)?)?;
        let options = candle_amp::ops::Attention {
            causal: true,
            ..Default::default()
        };
        let y = candle_amp::ops::scaled_dot_product_attention_packed(
            &Tensor::<P>::from_candle(qkv.as_tensor().clone())?,
            &options,
        )?;
        let y = y.as_candle().clone();
        let r = randn(y.dims(), 4, dev)?;
        let grads = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
        Ok([y, grads.get(&qkv).cloned().expect("a gradient for qkv")])
    };
    let (want, got) = (run(&Device::Cpu)?, run(&cuda)?);
    for (name, (g, w)) in ["y", "grad qkv"].iter().zip(got.iter().zip(&want)) {
        assert_eq!(g.dtype(), P::DTYPE, "packed attention {name}: dtype");
        let what = format!("packed attention {:?} {name}", P::DTYPE);
        assert_close(&what, g, w, 4.0 * tol(P::DTYPE))?;
    }
    Ok(())
}

/// `fp32::softmax` and `fp32::log_softmax` over the last dimension (one kernel each way on
/// CUDA, `softmax.cu`) against the CPU op: the f32 output and the input's gradient, in the
/// input's dtype, for rows of 1, 7, 300 (more than a block) and 2048 values, one with a `-inf`.
fn softmax_matches_cpu<P: Precision>() -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    for n in [1, 7, 300, 2048] {
        for log in [false, true] {
            let run = |dev: &Device| -> Result<Vec<candle_core::Tensor>> {
                let mut v = common::values(3 * n, 7);
                if n > 1 {
                    v[1] = f32::NEG_INFINITY; // a hidden column in the first row
                }
                let x = candle_core::Tensor::from_vec(v, (3, n), dev)?.to_dtype(P::DTYPE)?;
                let x = Var::from_tensor(&(x * 4.0)?)?;
                let typed = Tensor::<P>::from_candle(x.as_tensor().clone())?;
                let y = if log {
                    candle_amp::fp32::log_softmax(&typed, candle_core::D::Minus1)?
                } else {
                    candle_amp::fp32::softmax(&typed, candle_core::D::Minus1)?
                };
                // A hidden column's log-probability is -inf: compared, and weighted, as 0.
                let y = finite_or_zero(y.as_candle())?;
                let r = randn(y.dims(), 4, dev)?;
                let grads = (&y * r)?.sum_all()?.backward()?;
                let g = grads.get(&x).cloned().expect("a gradient for x");
                Ok(vec![y, g])
            };
            let (want, got) = (run(&Device::Cpu)?, run(&cuda)?);
            let what = format!(
                "{} n {n} {:?}",
                if log { "log_softmax" } else { "softmax" },
                P::DTYPE
            );
            assert_eq!(got[0].dtype(), DType::F32, "{what}: the output is f32");
            assert_eq!(
                got[1].dtype(),
                P::DTYPE,
                "{what}: the gradient is the input's"
            );
            assert_close(&format!("{what} y"), &got[0], &want[0], 1e-5)?;
            assert_close(&format!("{what} grad"), &got[1], &want[1], tol(P::DTYPE))?;
        }
    }
    Ok(())
}

/// A residual sum in a region: the f32 stream plus (minus) a half product, one op reading the
/// half operand as it is (`binary.cu` on CUDA).
#[autocast(fp16)]
fn residual_fp16(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    let y = (x + x.matmul(w)?)?;
    Ok((&y - x.matmul(w)?.relu()?)?)
}

#[autocast(bf16)]
fn residual_bf16(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    let y = (x + x.matmul(w)?)?;
    Ok((&y - x.matmul(w)?.relu()?)?)
}

/// The region's widening sums (an f32 and a half operand, summed in f32 without a cast) on
/// CUDA against the CPU: the output and the gradients of the stream and the weight, fp16 and
/// bf16.
#[test]
fn widening_sums_match_cpu_cuda() -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    for half in [DType::F16, DType::BF16] {
        let run = |dev: &Device| -> Result<Vec<candle_core::Tensor>> {
            let x = Var::from_tensor(&randn(&[6, 40], 1, dev)?)?;
            let w = Var::from_tensor(&(randn(&[40, 40], 2, dev)? * 0.2)?)?;
            let (tx, tw) = (
                Tensor::<F32>::from_candle(x.as_tensor().clone())?,
                Tensor::<F32>::from_candle(w.as_tensor().clone())?,
            );
            let y = if half == DType::F16 {
                residual_fp16(&tx, &tw)?
            } else {
                residual_bf16(&tx, &tw)?
            };
            let y = y.as_candle().clone();
            let r = randn(y.dims(), 4, dev)?;
            let grads = (&y * r)?.sum_all()?.backward()?;
            Ok(vec![
                y,
                grads.get(&x).cloned().expect("a gradient for x"),
                grads.get(&w).cloned().expect("a gradient for w"),
            ])
        };
        let (want, got) = (run(&Device::Cpu)?, run(&cuda)?);
        for (name, (g, w)) in ["y", "grad x", "grad w"].iter().zip(got.iter().zip(&want)) {
            assert_eq!(g.dtype(), DType::F32, "widening sum {name}: dtype");
            assert_close(&format!("widening sum {half:?} {name}"), g, w, tol(half))?;
        }
    }
    Ok(())
}

/// Layer norm and RMS norm (`layer_norm.cu` on CUDA: the rows' forward, the backward's rows
/// and columns) against the CPU op: the output, and the gradients of the input and of the f32 scale and
/// shift, over rows of 7 and 300 values (more than a block).
fn layer_norm_matches_cpu<P: Precision>() -> Result<()> {
    for n in [7, 300] {
        compare::<P>(&format!("layer_norm n {n}"), &[5, 3, n], &[n], |w, b| {
            Ok(Box::new(move |x: &Tensor<P>| {
                let (w, b) = (
                    Tensor::<F32>::from_candle(w.as_tensor().clone())?,
                    Tensor::<F32>::from_candle(b.as_tensor().clone())?,
                );
                candle_amp::fp32::layer_norm(x, &w, Some(&b), 1e-5)?.cast::<P>()
            }))
        })?;
        // RMS norm, the same kernels without the centring (the shift added after it).
        compare::<P>(&format!("rms_norm n {n}"), &[5, 3, n], &[n], |w, b| {
            Ok(Box::new(move |x: &Tensor<P>| {
                let (w, b) = (
                    Tensor::<F32>::from_candle(w.as_tensor().clone())?,
                    Tensor::<F32>::from_candle(b.as_tensor().clone())?,
                );
                candle_amp::fp32::rms_norm(x, &w, 1e-5)?
                    .broadcast_add(&b)?
                    .cast::<P>()
            }))
        })?;
    }
    Ok(())
}

/// Reduced maxima and minima (the op sharing the gradient among ties, NaN through a slice
/// holding one) against the CPU: the input's gradient bit for bit and the values equal, on
/// integer values with many ties and one NaN. The values are compared by `==`: a slice holding
/// both 0 and -0 has either as its extremum (they tie; the devices scan in different orders, as
/// PyTorch's do), and the gradient shares among them alike.
fn extrema_match_cpu<P: Precision>() -> Result<()> {
    let cuda = Device::new_cuda(0)?;
    let run = |dev: &Device| -> Result<Vec<Vec<f32>>> {
        let mut v: Vec<f32> = common::values(6 * 50, 9)
            .iter()
            .map(|v| v.round())
            .collect();
        v[7] = f32::NAN;
        let x = candle_core::Tensor::from_vec(v, (6, 50), dev)?.to_dtype(P::DTYPE)?;
        let x = Var::from_tensor(&x)?;
        let typed = Tensor::<P>::from_candle(x.as_tensor().clone())?;
        let max = typed.max(1)?.into_candle();
        let min = typed.min_keepdim(0)?.into_candle().flatten_all()?;
        let grads = (max.sum_all()? + min.sum_all()?)?.backward()?;
        let g = grads.get(&x).cloned().expect("a gradient for x");
        [max, min, g.flatten_all()?]
            .iter()
            .map(|t| t.to_dtype(DType::F32)?.to_vec1::<f32>())
            .collect()
    };
    let (want, got) = (run(&Device::Cpu)?, run(&cuda)?);
    for (what, (g, w)) in ["max", "min", "grad"].iter().zip(got.iter().zip(&want)) {
        let same = g.iter().zip(w).all(|(g, w)| {
            let equal = if *what == "grad" {
                g.to_bits() == w.to_bits()
            } else {
                g == w
            };
            equal || (g.is_nan() && w.is_nan())
        });
        assert!(same, "extrema {:?} {what}: {g:?} vs {w:?}", P::DTYPE);
    }
    Ok(())
}

/// `y` with its `-inf` values as 0 (a log-softmax of a hidden column), for comparing.
fn finite_or_zero(y: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    y.ne(f32::NEG_INFINITY)?.where_cond(y, &y.zeros_like()?)
}

macro_rules! per_precision {
    ($body:ident: $f32:ident, $f16:ident, $bf16:ident) => {
        #[test]
        fn $f32() -> Result<()> {
            $body::<F32>()
        }
        #[test]
        fn $f16() -> Result<()> {
            $body::<F16>()
        }
        #[test]
        fn $bf16() -> Result<()> {
            $body::<BF16>()
        }
    };
}

per_precision!(conv2d_matches_cpu: conv2d_f32_cuda, conv2d_f16_cuda, conv2d_bf16_cuda);
per_precision!(batch_norm_matches_cpu: batch_norm_f32_cuda, batch_norm_f16_cuda, batch_norm_bf16_cuda);
per_precision!(max_pool_matches_cpu: max_pool_f32_cuda, max_pool_f16_cuda, max_pool_bf16_cuda);
per_precision!(
    conv_bn_relu_matches_conv_bn_then_relu: conv_bn_relu_f32_cuda,
    conv_bn_relu_f16_cuda,
    conv_bn_relu_bf16_cuda
);
per_precision!(
    conv_bn_relu_train_matches_cpu_layers: conv_bn_relu_train_f32_cuda,
    conv_bn_relu_train_f16_cuda,
    conv_bn_relu_train_bf16_cuda
);
per_precision!(conv1d_matches_cpu: conv1d_f32_cuda, conv1d_f16_cuda, conv1d_bf16_cuda);
per_precision!(softmax_matches_cpu: softmax_f32_cuda, softmax_f16_cuda, softmax_bf16_cuda);
per_precision!(extrema_match_cpu: extrema_f32_cuda, extrema_f16_cuda, extrema_bf16_cuda);
per_precision!(
    layer_norm_matches_cpu: layer_norm_f32_cuda,
    layer_norm_f16_cuda,
    layer_norm_bf16_cuda
);
per_precision!(
    conv_transpose2d_matches_cpu: conv_transpose2d_f32_cuda,
    conv_transpose2d_f16_cuda,
    conv_transpose2d_bf16_cuda
);
per_precision!(attention_matches_cpu: attention_f32_cuda, attention_f16_cuda, attention_bf16_cuda);
per_precision!(
    packed_attention_matches_cpu: packed_attention_f32_cuda,
    packed_attention_f16_cuda,
    packed_attention_bf16_cuda
);
