//! The AMP-aware layers: gradients reach every f32 master parameter from every precision the
//! layer runs in, numerics match f32 references, and bad weights are errors, not panics.

// Exact float equality is intended where the expected value is exactly representable.
#![allow(clippy::float_cmp)]

use candle_amp::nn::{self, loss, AmpLayer};
use candle_amp::{fp32, Op, OpClass, Precision, RegionValue, Tensor, BF16, F16, F32};
use candle_core::{DType, Device, Result, Var};
use candle_nn::{VarBuilder, VarMap};

mod common;

fn dev() -> Device {
    Device::Cpu
}

fn vars() -> (VarMap, VarBuilder<'static>) {
    vars_on(&dev())
}

fn vars_on(dev: &Device) -> (VarMap, VarBuilder<'static>) {
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, dev);
    (map, vb)
}

/// Backpropagates `loss` and asserts every variable of `map` got an f32 gradient that is finite
/// and not all zero. candle-nn's fused `layer_norm`/`rms_norm`/`softmax_last_dim` have no
/// backward: a layer built on them would leave its parameters without a gradient and fail here.
fn assert_every_parameter_learns(what: &str, map: &VarMap, loss: &Tensor<F32>) -> Result<()> {
    let grads = loss.as_candle().backward()?;
    let data = map.data().lock().unwrap();
    let mut names: Vec<_> = data.keys().cloned().collect();
    names.sort();
    for name in names {
        if name.starts_with("running_") || name.contains(".running_") {
            continue; // batch-norm statistics are buffers, not parameters
        }
        let var = &data[&name];
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("{what}: no gradient reached `{name}`"));
        assert_eq!(g.dtype(), DType::F32, "{what}: `{name}` gradient dtype");
        let v = g.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            v.iter().all(|x| x.is_finite()),
            "{what}: `{name}` non-finite gradient"
        );
        assert!(
            v.iter().any(|x| *x != 0.0),
            "{what}: `{name}` all-zero gradient"
        );
    }
    Ok(())
}

/// A loss that depends on every output element with distinct weights.
fn weighted_loss<P: Precision>(y: &Tensor<P>) -> Result<Tensor<F32>> {
    let y = y.cast::<F32>()?;
    let w = Tensor::<F32>::rand(0.5, 1.5, y.dims(), y.device())?;
    (&y * &w)?.sqr()?.mean_all()
}

fn lower_precision_layers_learn<P: Precision>(dev: &Device) -> Result<()> {
    let (map, vb) = vars_on(dev);
    let fc = nn::linear(6, 5, vb.pp("fc"))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 6), dev)?.cast::<P>()?;
    let y = fc.forward(&x)?;
    assert_eq!((y.dtype(), y.dims()), (P::DTYPE, &[2, 3, 5][..]));
    assert_every_parameter_learns("Linear", &map, &weighted_loss(&y)?)?;

    let (map, vb) = vars_on(dev);
    let c1 = nn::conv1d(
        3,
        4,
        3,
        nn::Conv1dConfig {
            padding: 1,
            ..Default::default()
        },
        vb.pp("c1"),
    )?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 9), dev)?.cast::<P>()?;
    let y = c1.forward(&x)?;
    assert_eq!((y.dtype(), y.dims()), (P::DTYPE, &[2, 4, 9][..]));
    assert_every_parameter_learns("Conv1d", &map, &weighted_loss(&y)?)?;

    let (map, vb) = vars_on(dev);
    let cfg = nn::Conv2dConfig {
        padding: 1,
        stride: 2,
        ..Default::default()
    };
    let c2 = nn::conv2d(3, 4, 3, cfg, vb.pp("c2"))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 8, 8), dev)?.cast::<P>()?;
    let y = c2.forward(&x)?;
    assert_eq!((y.dtype(), y.dims()), (P::DTYPE, &[2, 4, 4, 4][..]));
    assert_every_parameter_learns("Conv2d", &map, &weighted_loss(&y)?)?;

    // Pooling between layers keeps the precision and passes gradients on.
    let (map, vb) = vars_on(dev);
    let c2 = nn::conv2d_no_bias(3, 4, 3, nn::Conv2dConfig::default(), vb.pp("c2"))?;
    let y = nn::MaxPool2d::new(2).forward(&c2.forward(&x)?)?;
    let y = nn::AvgPool2d::new(2).forward(&y)?;
    assert_eq!((y.dtype(), y.dims()), (P::DTYPE, &[2, 4, 1, 1][..]));
    assert_every_parameter_learns("Conv2d + pools", &map, &weighted_loss(&y)?)?;

    // Batch norm: input precision out, f32 parameters and statistics inside.
    let (map, vb) = vars_on(dev);
    let bn = nn::batch_norm2d(3, 1e-5, vb.pp("bn"))?;
    let y = bn.forward_train(&x)?;
    assert_eq!(y.dtype(), P::DTYPE);
    assert_every_parameter_learns("BatchNorm2d", &map, &weighted_loss(&y)?)?;
    Ok(())
}

fn lower_precision_layers_learn_f32(dev: &Device) -> Result<()> {
    lower_precision_layers_learn::<F32>(dev)
}
test_device!(
    lower_precision_layers_learn_f32,
    lower_precision_layers_learn_f32_cpu,
    lower_precision_layers_learn_f32_cuda
);

fn lower_precision_layers_learn_f16(dev: &Device) -> Result<()> {
    lower_precision_layers_learn::<F16>(dev)
}
test_device!(
    lower_precision_layers_learn_f16,
    lower_precision_layers_learn_f16_cpu,
    lower_precision_layers_learn_f16_cuda
);

fn lower_precision_layers_learn_bf16(dev: &Device) -> Result<()> {
    lower_precision_layers_learn::<BF16>(dev)
}
test_device!(
    lower_precision_layers_learn_bf16,
    lower_precision_layers_learn_bf16_cpu,
    lower_precision_layers_learn_bf16_cuda
);

/// Every biased layer sums its bias's and weight's gradients in f32 in every precision: 3000
/// output positions of ones give 3000, where a half sum stops at 2048 (f16) or 256 (bf16), as
/// candle's broadcast backward did off the CPU. Linear, Conv1d and Conv2d on CPU (fused ops):
/// the output is `sum(w) + b` (`w` and `b` rounded to P) rounded once, the weight's gradient
/// reaches the master in f32. Every layer off the CPU (candle's product on the weight cast to P,
/// as PyTorch's autocast;
/// cuBLAS accumulates in f32): the product is rounded before the bias is added and the weight's
/// gradient is P's, 3000 rounded to P once (bf16: 3008).
fn biased_layers_sum_gradients_in_f32<P: Precision>(dev: &Device) -> Result<()> {
    let check = |what: &str, map: &VarMap, y: &Tensor<P>, fan_in: usize| -> Result<()> {
        let composed = !dev.is_cpu();
        let data = map.data().lock().unwrap();
        let (w, b) = (
            &data[&format!("{what}.weight")],
            &data[&format!("{what}.bias")],
        );
        // The product runs on the weight rounded to P; then the bias, then one rounding to P
        // (one unit in P's last place of slack for the summation order).
        let w_p = w.to_dtype(P::DTYPE)?.to_dtype(DType::F32)?;
        let sum_w = w_p
            .flatten_all()?
            .to_vec1::<f32>()?
            .chunks(fan_in)
            .map(|r| r.iter().sum::<f32>())
            .collect::<Vec<_>>();
        let ulp = if P::DTYPE == DType::BF16 {
            2f32.powi(-7)
        } else {
            2f32.powi(-10)
        };
        // The bias too is rounded to P, as autocast casts a lower-precision op's bias.
        let bias = b
            .to_dtype(P::DTYPE)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        // Channels are the last dimension of a Linear output, the second of a conv's.
        let y = if what == "fc" {
            y.cast::<F32>()?.as_candle().flatten_to(1)?
        } else {
            y.cast::<F32>()?
                .as_candle()
                .transpose(0, 1)?
                .flatten_from(1)?
                .t()?
        };
        for row in y.to_vec2::<f32>()? {
            for (c, &v) in row.iter().enumerate() {
                let want = candle_core::Tensor::new(&[sum_w[c] + bias[c]], dev)?
                    .to_dtype(P::DTYPE)?
                    .to_dtype(DType::F32)?
                    .to_vec1::<f32>()?[0];
                let slack = if composed {
                    ulp * (sum_w[c].abs() + want.abs())
                } else {
                    ulp * want.abs()
                };
                assert!((v - want).abs() <= slack, "{what}: {v} vs {want}");
            }
        }
        let grads = y.sum_all()?.backward()?;
        let in_p = |v: f32| -> Result<f32> {
            candle_core::Tensor::new(&[v], dev)?
                .to_dtype(P::DTYPE)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()
                .map(|v| v[0])
        };
        let weight_sum = if composed { in_p(3000.0)? } else { 3000.0 };
        for (name, var, want) in [("weight", w, weight_sum), ("bias", b, 3000.0)] {
            let g = grads
                .get(var)
                .unwrap_or_else(|| panic!("{what}: no {name} gradient"));
            let g = g.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                g.iter().all(|&v| v == want),
                "{what} {name}: {:?}, not {want}",
                &g[..3]
            );
        }
        Ok(())
    };
    let (map, vb) = vars_on(dev);
    let fc = nn::linear(4, 3, vb.pp("fc"))?;
    let y = fc.forward(&Tensor::<F32>::ones((3, 1000, 4), dev)?.cast::<P>()?)?;
    check("fc", &map, &y, 4)?;
    let (map, vb) = vars_on(dev);
    let c1 = nn::conv1d(4, 3, 1, nn::Conv1dConfig::default(), vb.pp("c1"))?;
    let y = c1.forward(&Tensor::<F32>::ones((3, 4, 1000), dev)?.cast::<P>()?)?;
    check("c1", &map, &y, 4)?;
    let (map, vb) = vars_on(dev);
    let c2 = nn::conv2d(4, 3, 1, nn::Conv2dConfig::default(), vb.pp("c2"))?;
    let y = c2.forward(&Tensor::<F32>::ones((3, 4, 20, 50), dev)?.cast::<P>()?)?;
    check("c2", &map, &y, 4)
}

fn biased_layers_sum_gradients_in_f32_f16(dev: &Device) -> Result<()> {
    biased_layers_sum_gradients_in_f32::<F16>(dev)
}
test_device!(
    biased_layers_sum_gradients_in_f32_f16,
    biased_layers_sum_gradients_in_f32_f16_cpu,
    biased_layers_sum_gradients_in_f32_f16_cuda
);

fn biased_layers_sum_gradients_in_f32_bf16(dev: &Device) -> Result<()> {
    biased_layers_sum_gradients_in_f32::<BF16>(dev)
}
test_device!(
    biased_layers_sum_gradients_in_f32_bf16,
    biased_layers_sum_gradients_in_f32_bf16_cpu,
    biased_layers_sum_gradients_in_f32_bf16_cuda
);

#[test]
fn fp32_layers_learn_from_every_precision() -> Result<()> {
    let (map, vb) = vars();
    let ln = nn::layer_norm(6, 1e-5, vb.pp("ln"))?;
    let rms = nn::rms_norm(6, 1e-6, vb.pp("rms"))?;
    let emb = nn::embedding(10, 6, vb.pp("emb"))?;
    let ids = candle_core::Tensor::new(&[[1u32, 4, 4], [9, 0, 2]], &dev())?;
    let e = emb.forward(&ids)?;
    assert_eq!(e.dims(), &[2, 3, 6]);
    let y = rms.forward(&ln.forward(&e)?)?;
    assert_every_parameter_learns("Embedding + LayerNorm + RmsNorm", &map, &weighted_loss(&y)?)?;

    // The same layers' fp32 path from half inputs (what an autocast policy calls).
    for half in [DType::F16, DType::BF16] {
        let (map, vb) = vars();
        let ln = nn::layer_norm(6, 1e-5, vb.pp("ln"))?;
        let x = Tensor::<F32>::randn(0.0, 1.0, (4, 6), &dev())?;
        let y = if half == DType::F16 {
            fp32::layer_norm(
                &x.cast::<F16>()?,
                &weight(ln.weight()),
                bias(ln.bias()).as_ref(),
                1e-5,
            )?
        } else {
            fp32::layer_norm(
                &x.cast::<BF16>()?,
                &weight(ln.weight()),
                bias(ln.bias()).as_ref(),
                1e-5,
            )?
        };
        assert_every_parameter_learns("LayerNorm from half", &map, &weighted_loss(&y)?)?;
    }
    Ok(())
}

fn weight(v: &Var) -> Tensor<F32> {
    Tensor::from_candle(v.as_tensor().clone()).unwrap()
}

fn bias(v: Option<&Var>) -> Option<Tensor<F32>> {
    v.map(weight)
}

/// LayerNorm's gradients equal those of candle-nn's differentiable reference composition.
#[test]
fn layer_norm_gradients_match_candle_reference() -> Result<()> {
    let (_map, vb) = vars();
    let ln = nn::layer_norm(5, 1e-5, vb)?;
    ln.weight().set(&candle_core::Tensor::new(
        &[1f32, 2., 0.5, -1., 3.],
        &dev(),
    )?)?;
    let x = Var::from_tensor(&candle_core::Tensor::randn(0f32, 1., (3, 5), &dev())?)?;
    let y = ln.forward(&Tensor::<F32>::from_candle(x.as_tensor().clone())?)?;
    let grads = weighted_sum(&y.into_candle())?.backward()?;

    let reference = candle_nn::ops::layer_norm_slow(
        x.as_tensor(),
        ln.weight().as_tensor(),
        ln.bias().unwrap().as_tensor(),
        1e-5,
    )?;
    let ref_grads = weighted_sum(&reference)?.backward()?;
    for v in [&x, ln.weight(), ln.bias().unwrap()] {
        let a = grads.get(v).unwrap().flatten_all()?.to_vec1::<f32>()?;
        let b = ref_grads.get(v).unwrap().flatten_all()?.to_vec1::<f32>()?;
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
    Ok(())
}

fn weighted_sum(y: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    let n = y.elem_count();
    let w = candle_core::Tensor::arange(1f32, n as f32 + 1.0, &dev())?.reshape(y.shape())?;
    (y * w)?.sum_all()
}

/// PyTorch's BatchNorm2d semantics, computed by hand on a 2x2x1x2 input.
#[test]
fn batch_norm2d_matches_pytorch_semantics() -> Result<()> {
    let (_map, vb) = vars();
    let bn = nn::batch_norm2d(2, 1e-5, vb)?;
    bn.weight()
        .unwrap()
        .set(&candle_core::Tensor::new(&[2f32, 1.], &dev())?)?;
    bn.bias()
        .unwrap()
        .set(&candle_core::Tensor::new(&[0f32, 1.], &dev())?)?;
    // channel 0 values: 1, 3, 5, 7 (mean 4, biased var 5, unbiased var 20/3);
    // channel 1 values: 0, 0, 2, 2 (mean 1, biased var 1, unbiased var 4/3).
    let x = Tensor::<F32>::new(
        &[[[[1f32, 3.]], [[0., 0.]]], [[[5., 7.]], [[2., 2.]]]],
        &dev(),
    )?;
    let y = bn.forward_train(&x)?.to_flat_vec::<f32>()?;
    let (s0, s1) = ((5.0f64 + 1e-5).sqrt(), (1.0f64 + 1e-5).sqrt());
    let want = [
        -6.0 / s0,
        -2.0 / s0,
        -1.0 / s1 + 1.0,
        -1.0 / s1 + 1.0,
        2.0 / s0,
        6.0 / s0,
        1.0 / s1 + 1.0,
        1.0 / s1 + 1.0,
    ];
    for (got, want) in y.iter().zip(want) {
        assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
    }
    // Running statistics: (1 - 0.1) * initial + 0.1 * batch, with the unbiased variance.
    let rm = bn.running_mean().to_vec1::<f32>()?;
    let rv = bn.running_var().to_vec1::<f32>()?;
    assert!(
        (rm[0] - 0.4).abs() < 1e-6 && (rm[1] - 0.1).abs() < 1e-6,
        "{rm:?}"
    );
    let want_rv = [0.9 + 0.1 * 20.0 / 3.0, 0.9f32 + 0.1 * 4.0 / 3.0];
    assert!(
        (rv[0] - want_rv[0]).abs() < 1e-5 && (rv[1] - want_rv[1]).abs() < 1e-5,
        "{rv:?}"
    );

    // Eval uses the running statistics and leaves them alone.
    let e = bn.forward_t(&x, false)?.to_flat_vec::<f32>()?;
    let want0 = 2.0 * (1.0 - 0.4) / (f64::from(want_rv[0]) + 1e-5).sqrt();
    assert!(
        (f64::from(e[0]) - want0).abs() < 1e-5,
        "{} vs {want0}",
        e[0]
    );
    assert_eq!(bn.running_mean().to_vec1::<f32>()?, rm);

    // Half input: half output within half tolerance of the f32 result.
    let y16 = bn.forward_t(&x.cast::<F16>()?, false)?;
    assert_eq!(y16.dtype(), DType::F16);
    for (a, b) in y16.to_flat_vec::<f32>()?.iter().zip(&e) {
        assert!((a - b).abs() < 4e-3 * (1.0 + b.abs()), "{a} vs {b}");
    }
    Ok(())
}

/// The batch norm's output and its gradients for the input, the scale and the shift, in every
/// precision, training and eval, affine or not, from a non-contiguous input: against candle's
/// autograd through the textbook formula in f64, on the same (rounded) input.
fn batch_norm2d_gradients_match_an_f64_reference(d: &Device) -> Result<()> {
    fn check<P: Precision>(d: &Device, train: bool, affine: bool, tol: f64) -> Result<()> {
        let what = format!("{:?} train={train} affine={affine}", P::DTYPE);
        let c = 4;
        let gamma = candle_core::Tensor::new(&[1.5f32, -0.5, 2.0, 0.75], d)?;
        let beta = candle_core::Tensor::new(&[0.1f32, -0.2, 0.3, 0.0], d)?;
        let mean0 = candle_core::Tensor::new(&[0.2f32, -0.1, 0.5, 1.0], d)?;
        let var0 = candle_core::Tensor::new(&[1.5f32, 0.5, 2.0, 0.8], d)?;
        let var = |t: &candle_core::Tensor| Var::from_tensor(t);
        let bn = nn::BatchNorm2d::new(
            var(&mean0)?,
            var(&var0)?,
            affine
                .then(|| Ok::<_, candle_core::Error>((var(&gamma)?, var(&beta)?)))
                .transpose()?,
            1e-5,
            0.1,
        )?;
        // (3, 5, c, 6) transposed to (3, c, 5, 6): a strided input; values in P's grid.
        let raw = candle_core::Tensor::randn(1f32, 2.0, (3, 5, c, 6), d)?
            .to_dtype(P::DTYPE)?
            .to_dtype(DType::F32)?;
        let xv = Var::from_tensor(&raw)?;
        let x = Tensor::<F32>::from_candle(xv.as_tensor().transpose(1, 2)?)?.cast::<P>()?;
        let r = candle_core::Tensor::randn(0f32, 1.0, (3, c, 5, 6), d)?
            .to_dtype(P::DTYPE)?
            .to_dtype(DType::F32)?;
        let y = bn.forward_t(&x, train)?;
        assert_eq!(y.dtype(), P::DTYPE, "{what}");
        let y = y.cast::<F32>()?.into_candle();
        let grads = (&y * &r)?.sum_all()?.backward()?;

        // Reference in f64.
        let f64v = |t: &candle_core::Tensor| Var::from_tensor(&t.to_dtype(DType::F64)?);
        let (x64, g64, b64) = (f64v(&raw)?, f64v(&gamma)?, f64v(&beta)?);
        let xt = x64.as_tensor().transpose(1, 2)?;
        let per_channel = |t: &candle_core::Tensor| t.reshape((1, c, 1, 1));
        let (mean, v) = if train {
            let mean = xt.mean_keepdim((0, 2, 3))?;
            let v = xt.broadcast_sub(&mean)?.sqr()?.mean_keepdim((0, 2, 3))?;
            (mean, v)
        } else {
            (
                per_channel(&mean0.to_dtype(DType::F64)?)?,
                per_channel(&var0.to_dtype(DType::F64)?)?,
            )
        };
        let mut want = xt
            .broadcast_sub(&mean)?
            .broadcast_div(&(v + 1e-5)?.sqrt()?)?;
        if affine {
            want = want
                .broadcast_mul(&per_channel(g64.as_tensor())?)?
                .broadcast_add(&per_channel(b64.as_tensor())?)?;
        }
        let want_grads = (&want * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;

        let close = |name: &str, got: &candle_core::Tensor, want: &candle_core::Tensor| {
            let got = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let want = want.flatten_all()?.to_vec1::<f64>()?;
            let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f64, f64::max);
            assert!(
                worst <= tol * scale,
                "{what}: {name} max error {worst} vs scale {scale}"
            );
            Ok::<_, candle_core::Error>(())
        };
        close("output", &y, &want)?;
        close("dx", grads.get(&xv).unwrap(), want_grads.get(&x64).unwrap())?;
        if affine {
            let (w, b) = (bn.weight().unwrap(), bn.bias().unwrap());
            close(
                "dweight",
                grads.get(w).unwrap(),
                want_grads.get(&g64).unwrap(),
            )?;
            close(
                "dbias",
                grads.get(b).unwrap(),
                want_grads.get(&b64).unwrap(),
            )?;
        }
        // Running statistics move only in training, by PyTorch's rule.
        let moved = bn.running_mean().to_vec1::<f32>()? != mean0.to_vec1::<f32>()?;
        assert_eq!(moved, train, "{what}: running mean updated");
        Ok(())
    }
    for train in [true, false] {
        for affine in [true, false] {
            check::<F32>(d, train, affine, 1e-5)?;
            check::<F16>(d, train, affine, 4e-3)?;
            check::<BF16>(d, train, affine, 3e-2)?;
        }
    }
    Ok(())
}
test_device!(
    batch_norm2d_gradients_match_an_f64_reference,
    batch_norm2d_gradients_cpu,
    batch_norm2d_gradients_cuda
);

#[test]
fn bf16_conv2d_layer_matches_f32_on_cpu() -> Result<()> {
    let (_map, vb) = vars();
    let conv = nn::conv2d(
        4,
        8,
        3,
        nn::Conv2dConfig {
            padding: 1,
            ..Default::default()
        },
        vb,
    )?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4, 16, 16), &dev())?.cast::<BF16>()?;
    let y = conv.forward(&x)?; // candle 0.11 alone: "unsupported dtype BF16 for op matmul"
    assert_eq!(y.dtype(), DType::BF16);
    // Reference: f32 conv on the bf16-rounded input and weights.
    let w = Tensor::<F32>::from_candle(conv.weight().as_tensor().clone())?.cast::<BF16>()?;
    let b = conv
        .bias()
        .unwrap()
        .as_tensor()
        .reshape((1, 8, 1, 1))?
        .to_dtype(DType::BF16)?;
    let reference = x
        .cast::<F32>()?
        .conv2d(&w.cast::<F32>()?, 1, 1, 1, 1)?
        .into_candle()
        .broadcast_add(&b.to_dtype(DType::F32)?)?;
    let got = y.to_flat_vec::<f32>()?;
    let want = reference.flatten_all()?.to_vec1::<f32>()?;
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 2e-2 * scale, "max error {worst} vs scale {scale}");
    Ok(())
}

#[test]
fn layers_declare_their_op_class() {
    fn class<L: AmpLayer>() -> OpClass {
        <L::Op as Op>::CLASS
    }
    assert_eq!(class::<nn::Linear>(), OpClass::LowerPrecision);
    assert_eq!(class::<nn::Conv1d>(), OpClass::LowerPrecision);
    assert_eq!(class::<nn::Conv2d>(), OpClass::LowerPrecision);
    assert_eq!(class::<nn::LayerNorm>(), OpClass::Fp32);
    assert_eq!(class::<nn::RmsNorm>(), OpClass::Fp32);
    assert_eq!(class::<nn::BatchNorm2d>(), OpClass::Preserve);
    assert_eq!(class::<nn::Embedding>(), OpClass::Preserve);
    assert_eq!(class::<nn::MaxPool2d>(), OpClass::Preserve);
    assert_eq!(class::<nn::AvgPool2d>(), OpClass::Preserve);
}

#[test]
fn bad_weights_are_errors_not_panics() -> Result<()> {
    let d = dev();
    let half = Var::from_tensor(&candle_core::Tensor::zeros((3, 2), DType::F16, &d)?)?;
    let err = nn::Linear::new(half, None).unwrap_err().to_string();
    assert!(err.contains("f32") && err.contains("F16"), "{err}");
    let w = Var::zeros((3, 2), DType::F32, &d)?;
    let wrong_bias = Var::zeros(4, DType::F32, &d)?;
    assert!(nn::Linear::new(w.clone(), Some(wrong_bias)).is_err());
    assert!(nn::Conv2d::new(w.clone(), None, nn::Conv2dConfig::default()).is_err());
    assert!(nn::Embedding::new(Var::zeros(3, DType::F32, &d)?).is_err());
    let stats = Var::zeros(3, DType::F32, &d)?;
    assert!(nn::BatchNorm2d::new(stats.clone(), stats.clone(), None, 0.0, 0.1).is_err());
    // A VarBuilder in f16 cannot make master weights.
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F16, &d);
    assert!(nn::linear(2, 3, vb).is_err());
    // Wrong input shapes surface as errors.
    let bn = nn::BatchNorm2d::new(
        stats.clone(),
        Var::ones(3, DType::F32, &d)?,
        None,
        1e-5,
        0.1,
    )?;
    assert!(bn
        .forward_train(&Tensor::<F32>::zeros((2, 3), &d)?)
        .is_err());
    assert!(bn
        .forward_train(&Tensor::<F32>::zeros((2, 4, 2, 2), &d)?)
        .is_err());
    assert!(nn::MaxPool2d::new(0)
        .forward(&Tensor::<F32>::zeros((1, 1, 2, 2), &d)?)
        .is_err());
    Ok(())
}

#[test]
fn a_small_mixed_precision_training_step_reduces_the_loss() -> Result<()> {
    // f16 hidden layer, f32 loss, SGD on the f32 masters: the loss goes down.
    let (map, vb) = vars();
    let fc1 = nn::linear(4, 16, vb.pp("fc1"))?;
    let fc2 = nn::linear(16, 1, vb.pp("fc2"))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (64, 4), &dev())?;
    let target = x.sum_keepdim(1)?;
    let mut sgd = <candle_nn::SGD as candle_nn::Optimizer>::new(map.all_vars(), 0.05)?;
    let step = |sgd: &mut candle_nn::SGD| -> Result<f32> {
        let h = fc1.forward(&x.cast::<F16>()?)?.relu()?;
        let y = fc2.forward(&h)?.cast::<F32>()?;
        let l = loss::mse(&y, &target)?;
        candle_nn::Optimizer::backward_step(sgd, l.as_candle())?;
        l.to_scalar::<f32>()
    };
    let first = step(&mut sgd)?;
    let mut last = first;
    for _ in 0..30 {
        last = step(&mut sgd)?;
    }
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    Ok(())
}

/// The layers are `candle_nn::Module`s for candle code: `xs.apply(&layer)` on a candle tensor is
/// the typed forward in f32, and a region value's `.apply(&m)` runs under the region's policy.
#[test]
fn layers_are_candle_modules_and_apply_in_regions() -> Result<()> {
    use candle_amp::{autocast, AmpTensor};
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let fc = nn::linear(4, 3, vb.pp("fc"))?;
    let ln = nn::layer_norm(3, 1e-5, vb.pp("ln"))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &Device::Cpu)?;
    let plain = x.as_candle().apply(&fc)?.apply(&ln)?;
    let typed = ln.forward(&fc.forward(&x)?)?;
    assert_eq!(plain.dtype(), DType::F32);
    assert_eq!(plain.to_vec2::<f32>()?, typed.to_vec2::<f32>()?);

    #[autocast(bf16)]
    fn applied(fc: &nn::Linear, ln: &nn::LayerNorm, x: &Tensor<F32>) -> Result<Vec<DType>> {
        let h: AmpTensor = x.apply(fc)?;
        Ok(vec![h.dtype(), h.apply(ln)?.dtype()])
    }
    assert_eq!(applied(&fc, &ln, &x)?, [DType::BF16, DType::F32]);
    Ok(())
}

/// An `#[autocast(bf16)] impl candle_nn::Module` drops into f32 candle code: it takes and
/// returns candle tensors in the input's dtype, and runs its layers under bf16 inside.
#[test]
fn an_autocast_candle_module_drops_into_candle_code() -> Result<()> {
    use candle_amp::autocast;
    struct Mlp {
        fc1: nn::Linear,
        fc2: nn::Linear,
    }
    #[autocast(bf16)]
    impl candle_nn::Module for Mlp {
        fn forward(&self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
            let h = self.fc1.forward(xs)?.relu()?;
            assert_eq!(h.dtype(), DType::BF16);
            self.fc2.forward(&h)
        }
    }
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let mlp = Mlp {
        fc1: nn::linear(4, 8, vb.pp("fc1"))?,
        fc2: nn::linear(8, 2, vb.pp("fc2"))?,
    };
    let xs = candle_core::Tensor::randn(0f32, 1., (3, 4), &Device::Cpu)?;
    let ys = xs.apply(&mlp)?;
    assert_eq!((ys.dtype(), ys.dims()), (DType::F32, &[3usize, 2][..]));
    // Against the f32 program: bf16 rounding only (8-bit mantissas: a few parts in 100 of the
    // output's scale after two layers).
    let reference = xs.apply(&mlp.fc1)?.relu()?.apply(&mlp.fc2)?;
    let diff = (&ys - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = reference.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff <= 0.03 * (1.0 + scale), "{diff} at scale {scale}");
    Ok(())
}

/// `#[autocast(fp16)] impl candle_nn::Module`: the matmuls run in f16; the result leaves in the
/// input's dtype (f32 or bf16 in, the same out), or in the one `output = ..` names.
#[test]
fn an_fp16_candle_module_returns_the_inputs_dtype_or_the_output_it_names() -> Result<()> {
    use candle_amp::autocast;
    use std::cell::Cell;
    struct Proj {
        fc: nn::Linear,
        seen: Cell<Option<DType>>,
    }
    #[autocast(fp16)]
    impl candle_nn::Module for Proj {
        fn forward(&self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
            let h = self.fc.forward(xs)?;
            self.seen.set(Some(h.dtype()));
            Ok(h)
        }
    }
    struct Half(Proj);
    #[autocast(fp16, output = f16)]
    impl candle_nn::Module for Half {
        fn forward(&self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
            self.0.forward(xs)
        }
    }
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let proj = Proj {
        fc: nn::linear(4, 3, vb.pp("fc"))?,
        seen: Cell::new(None),
    };
    let xs = candle_core::Tensor::randn(0f32, 1., (2, 4), &Device::Cpu)?;
    let reference = xs.apply(&proj.fc)?;
    for input in [DType::F32, DType::BF16] {
        let ys = xs.to_dtype(input)?.apply(&proj)?;
        assert_eq!((ys.dtype(), proj.seen.get()), (input, Some(DType::F16)));
    }
    // Called from a region (`Half`'s), `Proj` gives its f16 result back uncast.
    let half = Half(proj);
    let ys = xs.apply(&half)?;
    assert_eq!(
        (ys.dtype(), half.0.seen.get()),
        (DType::F16, Some(DType::F16))
    );
    let diff = (ys.to_dtype(DType::F32)? - &reference)?.abs()?.max_all()?;
    assert!(diff.to_scalar::<f32>()? < 1e-2, "{diff}");
    Ok(())
}

/// An `#[autocast] impl candle_nn::Module` called from a region (as candle-transformers' blocks
/// call each other) runs under that region's policy, and its result stays what its body made:
/// the softmax's f32, not recast to the f16 input's dtype as it is for candle callers.
#[test]
fn a_candle_module_called_from_a_region_keeps_its_bodys_precision() -> Result<()> {
    use candle_amp::{autocast, ops, Tensor, F32};
    struct Head {
        fc: nn::Linear,
    }
    #[autocast]
    impl candle_nn::Module for Head {
        fn forward(&self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
            let h = self.fc.forward(xs)?;
            ops::softmax_last_dim(&h)
        }
    }
    struct Model {
        head: Head,
    }
    #[autocast(fp16)]
    impl Model {
        fn run(&self, x: &Tensor<F32>) -> Result<(Tensor<F32>, Vec<DType>)> {
            let h = x.relu()?.matmul(&x.t()?)?; // f16
            let p = self.head.forward(&h)?;
            let q = h.apply(&self.head)?;
            Ok((p.cast::<F32>()?, vec![h.dtype(), p.dtype(), q.dtype()]))
        }
    }
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let m = Model {
        head: Head {
            fc: nn::linear(3, 3, vb.pp("fc"))?,
        },
    };
    let x = Tensor::<F32>::new(
        &[[0.5f32, -1.0, 2.0], [1.0, 0.25, 0.75], [0.1, 0.2, 0.3]],
        &Device::Cpu,
    )?;
    let (p, dtypes) = m.run(&x)?;
    assert_eq!(dtypes, [DType::F16, DType::F32, DType::F32]);
    // Rows of a softmax sum to one; and the same module from candle code, fed f16, returns f16
    // (its input's dtype) with its linear run in f32, the caller's (no region's) policy.
    let sums = p.as_candle().sum(1)?.to_vec1::<f32>()?;
    assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "{sums:?}");
    let h = x.as_candle().relu()?.matmul(&x.as_candle().t()?)?;
    let plain = h.to_dtype(DType::F16)?.apply(&m.head)?;
    assert_eq!(plain.dtype(), DType::F16);
    let reference = candle_nn::ops::softmax_last_dim(&h.apply(&m.head.fc)?)?;
    let diff = (p.as_candle() - &reference)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(diff < 5e-3, "{diff}");
    Ok(())
}

/// candle-nn's own layers in a region run in their op class, and train: gradients reach their
/// weights, the layer norm's too (candle-nn's fused `layer_norm` has no backward).
#[test]
fn candle_nn_layers_in_a_region_run_in_their_class_and_train() -> Result<()> {
    use candle_amp::{autocast, loss};
    struct Net {
        emb: candle_nn::Embedding,
        fc: candle_nn::Linear,
        ln: candle_nn::LayerNorm,
    }
    #[autocast(fp16)]
    impl Net {
        fn losses(&self, ids: &candle_core::Tensor) -> Result<(Vec<DType>, Tensor<F32>)> {
            let e = self.emb.forward(ids)?;
            let h = self.fc.forward(&e)?;
            let y = self.ln.forward(&h)?;
            let l = loss::mse(&y, &e)?;
            Ok((vec![e.dtype(), h.dtype(), y.dtype()], l.cast::<F32>()?))
        }
    }
    let map = VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let net = Net {
        emb: candle_nn::embedding(6, 4, vb.pp("emb"))?,
        fc: candle_nn::linear(4, 4, vb.pp("fc"))?,
        ln: candle_nn::layer_norm(4, 1e-5, vb.pp("ln"))?,
    };
    let ids = candle_core::Tensor::new(&[0u32, 2, 5], &Device::Cpu)?;
    let (dtypes, l) = net.losses(&ids)?;
    assert_eq!(dtypes, [DType::F32, DType::F16, DType::F32]);
    let grads = l.as_candle().backward()?;
    for w in [net.fc.weight(), net.ln.weight(), net.emb.embeddings()] {
        let g = grads.get(w).expect("a gradient for every weight");
        assert_eq!(g.dtype(), DType::F32);
        assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
    }
    Ok(())
}

// ---- The transformer layers: dropout, activations, softmax_last_dim, causal mask, configs. ----

#[candle_amp::autocast(bf16)]
fn transformer_bits(
    x: &Tensor<F32>,
    drop: &nn::Dropout,
    act: &nn::Activation,
    train: bool,
) -> Result<Vec<DType>> {
    let h = x.cast::<BF16>()?;
    let dropped = drop.forward(&h, train)?;
    let kept = drop.forward_t(&h, false)?;
    let a = act.forward(&h)?;
    let p = candle_amp::ops::softmax_last_dim(&h)?;
    Ok(vec![dropped.dtype(), kept.dtype(), a.dtype(), p.dtype()])
}

#[test]
fn dropout_and_activations_keep_their_input_precision_and_softmax_last_dim_is_f32() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 8), &dev())?;
    let drop = nn::Dropout::new(0.5);
    let dtypes = transformer_bits(&x, &drop, &nn::Activation::GeluPytorchTanh, true)?;
    assert_eq!(dtypes, [DType::BF16, DType::BF16, DType::BF16, DType::F32]);
    // Dropout: identity in evaluation; in training each value is 0 or doubled.
    let ones = Tensor::<F32>::ones((64, 64), &dev())?;
    assert_eq!(
        drop.forward(&ones, false)?.to_vec2::<f32>()?,
        ones.to_vec2::<f32>()?
    );
    let trained: Vec<f32> = drop.forward(&ones, true)?.flatten_all()?.to_vec1()?;
    assert!(trained.iter().all(|&v| v == 0.0 || v == 2.0));
    let kept = trained.iter().filter(|&&v| v == 2.0).count() as f64 / trained.len() as f64;
    assert!((kept - 0.5).abs() < 0.05, "kept {kept}");
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn candle_dropout(x: &Tensor<F32>, drop: &candle_nn::Dropout) -> Result<Vec<DType>> {
    let h = x.cast::<BF16>()?;
    let dropped = drop.forward(&h, true)?;
    let kept = drop.forward_t(&h, false)?;
    let full = drop.forward(&x, true)?;
    let values = dropped.cast::<F32>()?.to_flat_vec::<f32>()?;
    assert!(values.iter().all(|&v| v == 0.0 || v == 2.0), "{values:?}");
    assert!(values.contains(&0.0) && values.contains(&2.0));
    Ok(vec![dropped.dtype(), kept.dtype(), full.dtype()])
}

/// candle-nn's `Dropout`, the layer most candle models hold, runs in a region in the value's
/// precision (it was refused at compile time), `forward` and `forward_t` alike.
#[test]
fn candle_nns_dropout_runs_in_a_region_in_the_values_precision() -> Result<()> {
    let x = Tensor::<F32>::ones((16, 16), &dev())?;
    let dtypes = candle_dropout(&x, &candle_nn::Dropout::new(0.5))?;
    assert_eq!(dtypes, [DType::BF16, DType::BF16, DType::F32]);
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn activate(x: &Tensor<F32>, act: &nn::Activation) -> Result<(DType, Tensor<F32>)> {
    let a = act.forward(&x.cast::<BF16>()?)?;
    Ok((a.dtype(), a.cast::<F32>()?))
}

#[test]
fn candle_nn_activations_in_a_region_keep_bf16_and_run_the_typed_methods_kernels() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 2.0, (4, 64), &dev())?;
    let h = x.cast::<BF16>()?;
    for (act, want) in [
        (nn::Activation::Gelu, h.gelu_erf()?),
        (nn::Activation::NewGelu, h.gelu()?),
        (nn::Activation::GeluPytorchTanh, h.gelu()?),
        (nn::Activation::Relu, h.relu()?),
        (nn::Activation::Silu, h.silu()?),
    ] {
        let (dtype, got) = activate(&x, &act)?;
        assert_eq!(dtype, DType::BF16, "{act:?}");
        assert_eq!(
            got.to_vec2::<f32>()?,
            want.cast::<F32>()?.to_vec2::<f32>()?,
            "{act:?}"
        );
    }
    Ok(())
}

#[test]
fn softmax_last_dim_trains_and_matches_softmax() -> Result<()> {
    let w = Var::new(&[[1.0f32, 2.0, 3.0], [0.5, 0.5, -1.0]], &dev())?;
    let x = Tensor::<F32>::from_candle(w.as_tensor().clone())?;
    let p = candle_amp::ops::softmax_last_dim(&x)?;
    let reference = candle_amp::ops::softmax(&x, 1)?;
    assert_eq!(p.to_vec2::<f32>()?, reference.to_vec2::<f32>()?);
    // candle-nn's fused `softmax_last_dim` has no backward; this one does.
    let grads = (p.as_candle()
        * &candle_core::Tensor::new(&[[1f32, 0., 0.], [0., 1., 0.]], &dev())?)?
        .sum_all()?
        .backward()?;
    let g = grads.get(w.as_tensor()).expect("a gradient");
    // d p0 / d x0 = p0 (1 - p0) for the first row.
    let p0 = p.to_vec2::<f32>()?[0][0];
    assert!((g.to_vec2::<f32>()?[0][0] - p0 * (1.0 - p0)).abs() < 1e-6);
    Ok(())
}

#[test]
fn causal_mask_hides_the_future_after_a_cache() -> Result<()> {
    let m = candle_amp::ops::causal_mask(2, 1, &dev())?.to_vec2::<f32>()?;
    let inf = f32::NEG_INFINITY;
    // Query 0 sits at position 1: it sees keys 0 and 1; query 1 (position 2) sees all three.
    assert_eq!(m, [[0.0, 0.0, inf], [0.0, 0.0, 0.0]]);
    Ok(())
}

#[test]
fn layer_norm_takes_candle_nn_configs_and_linear_b_its_bias_flag() -> Result<()> {
    let (map, vb) = vars();
    let eps = nn::layer_norm(4, 1e-6, vb.pp("a"))?;
    assert_eq!(eps.eps(), 1e-6);
    let fixed = nn::layer_norm(
        4,
        nn::LayerNormConfig {
            affine: false,
            ..Default::default()
        },
        vb.pp("b"),
    )?;
    assert!(fixed.bias().is_none());
    let rms = nn::layer_norm(
        4,
        nn::LayerNormConfig {
            remove_mean: false,
            ..Default::default()
        },
        vb.pp("c"),
    );
    assert!(rms.unwrap_err().to_string().contains("rms_norm"));
    assert!(nn::linear_b(4, 2, false, vb.pp("d"))?.bias().is_none());
    assert!(nn::linear_b(4, 2, true, vb.pp("e"))?.bias().is_some());
    // The non-affine norm adds no trained parameters.
    let names: Vec<String> = map.data().lock().unwrap().keys().cloned().collect();
    assert!(names.iter().all(|n| !n.starts_with("b.")), "{names:?}");
    Ok(())
}

// ---- The scaler's backward takes the masters' gradients straight from the ops. ----

/// Half `Linear`, conv2d, batch and layer norm and `Embedding` hand their variables' gradients
/// to the scaler's backward directly (sparing candle's zeros-and-add per weight): the gradients
/// are the ones candle's own backward computes, for a weight used twice, a weight also used by a
/// candle op, a kernel computed from a variable (not a leaf: its gradient must flow on to the
/// variable), the norms' scales and shifts, and an embedding table looked up with repeated ids.
#[test]
fn the_scaler_s_backward_gives_candle_s_gradients() -> Result<()> {
    let (map, vb) = vars();
    let fc = nn::linear(8, 8, vb.pp("fc"))?;
    let conv = nn::conv2d(2, 4, 1, nn::Conv2dConfig::default(), vb.pp("conv"))?;
    let emb = nn::embedding(6, 8, vb.pp("emb"))?;
    let bn = nn::batch_norm2d(4, 1e-5, vb.pp("bn"))?;
    let ln = nn::layer_norm(8, 1e-5, vb.pp("ln"))?;
    let ids = candle_core::Tensor::new(&[[4u32, 1, 4], [0, 5, 4]], &dev())?;
    let raw = Var::randn(0f32, 0.5, (3, 2, 1, 1), &dev())?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (3, 8), &dev())?;
    let img = Tensor::<F32>::randn(0.0, 1.0, (2, 2, 5, 5), &dev())?;
    let loss = || -> Result<candle_core::Tensor> {
        let h = fc.forward(&fc.forward(&x.cast::<BF16>()?)?.relu()?)?;
        let c = conv.forward(&img.cast::<BF16>()?)?;
        let c = (&c + &bn.forward_t(&c, true)?.relu()?)?;
        let normed = ln
            .forward(&h.cast::<F32>()?)?
            .as_candle()
            .sqr()?
            .sum_all()?;
        let k = Tensor::<F32>::from_candle((raw.as_tensor() * 2.0)?)?.cast::<BF16>()?;
        let d = img.cast::<BF16>()?.conv2d(&k, 0, 1, 1, 1)?;
        let sum = |t: Tensor<BF16>| t.cast::<F32>()?.as_candle().sum_all();
        let tied = fc.weight().as_tensor().sqr()?.sum_all()?;
        let e = (emb.forward(&ids)?.as_candle().sqr()?.sum_all()? * 0.1)?;
        (((sum(h)? + sum(c)?)? + (sum(d)? + tied)?)? + e)? + normed
    };
    let plain = loss()?.backward()?;
    let scaler = candle_amp::GradScaler::builder().enabled(false).build()?;
    let scaled = scaler.scale(&loss()?)?.backward()?;
    let mut vars = map.all_vars();
    vars.push(raw.clone());
    // The running statistics are variables without a gradient.
    vars.retain(|v| plain.get(v).is_some());
    assert_eq!(vars.len(), 10);
    for var in &vars {
        let want = plain.get(var).expect("candle's gradient");
        let got = scaled.get(var).expect("the scaler's gradient");
        assert_eq!(got.dtype(), DType::F32);
        let (got, want) = (
            got.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
        );
        for (g, w) in got.iter().zip(&want) {
            // The tied weight's two parts are added in another order: f32 rounding apart.
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
        }
    }
    // Candle's own backward afterwards still gets every gradient from the ops.
    let again = loss()?.backward()?;
    assert!(vars.iter().all(|v| again.get(v).is_some()));
    Ok(())
}

// ---- ConvBn2d: a conv and its batch norm, the conv's sums normalised before any rounding. ----

/// A `ConvBn2d` and the two layers it pairs, sharing their variables.
fn conv_bn(c_in: usize, c_out: usize, k: usize, vb: &VarBuilder) -> Result<nn::ConvBn2d> {
    let cfg = nn::Conv2dConfig {
        padding: k / 2,
        ..Default::default()
    };
    nn::ConvBn2d::new(
        nn::conv2d(c_in, c_out, k, cfg, vb.pp("conv"))?,
        nn::batch_norm2d(c_out, 1e-5, vb.pp("bn"))?,
    )
}

/// A padded 3x3 `ConvBn2d` from 3 to 5 channels, its batch norm's scale and shift set away
/// from 1 and 0 (one scale negative), with an input `(2, 3, 6, 7)` and the weights of a loss
/// `sum(y * weights)` over its output.
fn padded_conv_bn(
    map: &VarMap,
    vb: &VarBuilder,
) -> Result<(nn::ConvBn2d, Var, candle_core::Tensor)> {
    let block = conv_bn(3, 5, 3, vb)?;
    let gamma = candle_core::Tensor::new(&[1.5f32, -0.5, 2.0, 0.75, 1.0], &dev())?;
    let beta = candle_core::Tensor::new(&[0.1f32, -0.2, 0.3, 0.0, 0.5], &dev())?;
    for (name, t) in [("bn.weight", &gamma), ("bn.bias", &beta)] {
        map.data().lock().expect("vars")[name].set(t)?;
    }
    let x = Var::randn(0f32, 1.0, (2, 3, 6, 7), &dev())?;
    let weights = candle_core::Tensor::randn(0f32, 1.0, (2, 5, 6, 7), &dev())?;
    Ok((block, x, weights))
}

/// Conv outputs far from zero against their spread, as a trained conv's often are: the pair
/// of layers rounds them to bf16 before subtracting the mean, which leaves errors of a quarter
/// of the normalised unit; `ConvBn2d` is within bf16's rounding of its own output against
/// f64 on the same bf16 operands, in training and in eval mode.
#[test]
fn conv_bn_normalises_the_conv_s_sums_before_rounding() -> Result<()> {
    let (_map, vb) = vars();
    let block = conv_bn(4, 2, 1, &vb)?;
    let (w, b) = (block.conv().weight(), block.conv().bias().expect("a bias"));
    // Sums near 240 (bf16 steps of 1 there) with a spread of about 2.
    w.set(&candle_core::Tensor::ones(
        (2, 4, 1, 1),
        DType::F32,
        &dev(),
    )?)?;
    b.set(&candle_core::Tensor::new(&[0.5f32, -3.0], &dev())?)?;
    let values: Vec<f32> = (0..4 * 64)
        .map(|i| 60.0 + ((i * 37) % 11) as f32 * 0.25)
        .collect();
    let x = Tensor::<F32>::from_vec(values, (1, 4, 8, 8), &dev())?.cast::<BF16>()?;
    let x64: Vec<f64> = x.to_flat_vec::<f32>()?.into_iter().map(f64::from).collect();
    // f64: y = sum over channels + bias, normalised with the batch's statistics (biased var).
    let y: Vec<Vec<f64>> = [0.5, -3.0]
        .iter()
        .map(|&bias| {
            (0..64)
                .map(|p| (0..4).map(|c| x64[c * 64 + p]).sum::<f64>() + f64::from(bias as f32))
                .collect()
        })
        .collect();
    let normalised = |ys: &[f64], mean: f64, var: f64| -> Vec<f64> {
        ys.iter()
            .map(|v| (v - mean) / (var + 1e-5).sqrt())
            .collect()
    };
    let expected: Vec<f64> = y
        .iter()
        .flat_map(|ys| {
            let mean = ys.iter().sum::<f64>() / 64.0;
            let var = ys.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 64.0;
            normalised(ys, mean, var)
        })
        .collect();
    let worst = |got: &Tensor<BF16>, want: &[f64]| -> Result<f64> {
        let got = got.to_flat_vec::<f32>()?;
        Ok(got
            .iter()
            .zip(want)
            .map(|(g, w)| (f64::from(*g) - w).abs() / w.abs().max(1.0))
            .fold(0.0, f64::max))
    };
    let fused = block.forward_t(&x, true)?;
    assert_eq!(fused.dtype(), DType::BF16);
    // Relative to max(1, |z|): bf16 rounds by at most 2^-9 of |z|.
    assert!(
        worst(&fused, &expected)? < 4e-3,
        "{}",
        worst(&fused, &expected)?
    );
    let pair = block.bn().forward_t(&block.conv().forward(&x)?, true)?;
    assert!(
        worst(&pair, &expected)? > 0.1,
        "{}",
        worst(&pair, &expected)?
    );
    // Eval mode normalises with the running statistics, also before rounding.
    let (rm, rv) = (
        block.bn().running_mean().to_vec1::<f32>()?,
        block.bn().running_var().to_vec1::<f32>()?,
    );
    let expected: Vec<f64> = y
        .iter()
        .zip(rm.iter().zip(&rv))
        .flat_map(|(ys, (&m, &v))| normalised(ys, f64::from(m), f64::from(v)))
        .collect();
    let eval = block.forward_t(&x, false)?;
    assert!(
        worst(&eval, &expected)? < 4e-3,
        "{}",
        worst(&eval, &expected)?
    );
    Ok(())
}

/// In f32 `ConvBn2d` is the pair of layers: outputs, the gradients of the input and of every
/// variable, and the running statistics it leaves, for a padded 3x3 conv (training) and in
/// eval mode.
#[test]
fn conv_bn_is_the_conv_then_the_batch_norm() -> Result<()> {
    let (map, vb) = vars();
    let (block, x, weights) = padded_conv_bn(&map, &vb)?;
    let loss = |y: candle_core::Tensor| y.to_dtype(DType::F32)?.mul(&weights)?.sum_all();
    let mut tracked: Vec<&Var> = block.vars();
    tracked.push(&x);
    assert_eq!(tracked.len(), 5);
    let running = |bn: &nn::BatchNorm2d| -> Result<Vec<f32>> {
        Ok([
            bn.running_mean().to_vec1::<f32>()?,
            bn.running_var().to_vec1::<f32>()?,
        ]
        .concat())
    };
    let start = running(block.bn())?;
    let reset = |bn: &nn::BatchNorm2d| -> Result<()> {
        bn.running_mean()
            .set(&candle_core::Tensor::new(&start[..5], &dev())?)?;
        bn.running_var()
            .set(&candle_core::Tensor::new(&start[5..], &dev())?)
    };
    for train in [true, false] {
        let x32 = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
        let fused = block.forward_t(&x32, train)?;
        let after_fused = running(block.bn())?;
        reset(block.bn())?;
        let pair = block.bn().forward_t(&block.conv().forward(&x32)?, train)?;
        let after_pair = running(block.bn())?;
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (a, b) in a.iter().zip(b) {
                assert!(
                    (a - b).abs() <= 2e-5 * (1.0 + b.abs()),
                    "{what} train={train}: {a} vs {b}"
                );
            }
        };
        close(&fused.to_flat_vec()?, &pair.to_flat_vec()?, "output");
        close(&after_fused, &after_pair, "running statistics");
        let (gf, gp) = (
            loss(fused.into_candle())?.backward()?,
            loss(pair.into_candle())?.backward()?,
        );
        for v in &tracked {
            let (a, b) = (
                gf.get(v).expect("a gradient"),
                gp.get(v).expect("a gradient"),
            );
            close(
                &a.flatten_all()?.to_vec1()?,
                &b.flatten_all()?.to_vec1()?,
                "gradient",
            );
        }
        reset(block.bn())?;
    }
    // As a candle module (eval mode, no state changes): the same values.
    let via_module = candle_nn::ModuleT::forward_t(&block, x.as_tensor(), false)?;
    let direct = block.forward_t(&Tensor::<F32>::from_candle(x.as_tensor().clone())?, false)?;
    assert_eq!(
        via_module.flatten_all()?.to_vec1::<f32>()?,
        direct.to_flat_vec::<f32>()?
    );
    Ok(())
}

/// In bf16 `ConvBn2d`'s variables get f32 gradients within bf16's error of f32's, and the conv
/// bias's is exactly 0 in training mode.
#[test]
fn conv_bn_bf16_gradients_are_f32_and_near_f32_s() -> Result<()> {
    let (map, vb) = vars();
    let (block, x, weights) = padded_conv_bn(&map, &vb)?;
    let loss = |y: candle_core::Tensor| y.to_dtype(DType::F32)?.mul(&weights)?.sum_all();
    let x16 = Tensor::<F32>::from_candle(x.as_tensor().clone())?.cast::<BF16>()?;
    let g16 = loss(block.forward_t(&x16, true)?.into_candle())?.backward()?;
    let x32 = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
    let g32 = loss(block.forward_t(&x32, true)?.into_candle())?.backward()?;
    let bias = block.conv().bias().expect("a bias");
    for v in block.vars() {
        let (a, b) = (
            g16.get(v).expect("a gradient"),
            g32.get(v).expect("a gradient"),
        );
        assert_eq!(a.dtype(), DType::F32);
        if std::ptr::eq(v, bias) {
            continue; // below
        }
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
        let err = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 0.05 * scale, "{err} against {scale}");
    }
    // The conv bias's gradient in training mode is exactly 0 in both precisions (batch norm
    // subtracts the mean the bias moves); summed from dy it would be rounding noise, which Adam
    // would scale into full-size steps of the bias.
    for g in [&g16, &g32] {
        let got = g.get(bias).expect("a gradient").to_vec1::<f32>()?;
        assert_eq!(got, [0.0; 5]);
    }
    Ok(())
}

/// `ConvBnReLU2d` is `ConvBn2d` and `relu` with one op: the same outputs (ReLU commutes with
/// rounding, so bf16 too, bit for bit), the same gradients of the input and of every variable
/// (the mask taken from the output), in training and eval mode; NaN passes through its ReLU as
/// through `relu`.
#[test]
fn conv_bn_relu_is_conv_bn_then_relu() -> Result<()> {
    let (_map, vb) = vars();
    let cfg = nn::Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    // Two layers over the same variables: the VarMap hands out the same ones by name.
    let layers = || -> Result<(nn::Conv2d, nn::BatchNorm2d)> {
        Ok((
            nn::conv2d(3, 4, 3, cfg, vb.pp("conv"))?,
            nn::batch_norm2d(4, 1e-5, vb.pp("bn"))?,
        ))
    };
    let (conv, bn) = layers()?;
    let fused = nn::ConvBnReLU2d::new(conv, bn)?;
    let (conv, bn) = layers()?;
    let plain = nn::ConvBn2d::new(conv, bn)?;
    let x = Var::randn(0f32, 1.0, (2, 3, 5, 6), &dev())?;
    let weights = candle_core::Tensor::randn(0f32, 1.0, (2, 4, 5, 6), &dev())?;
    let loss = |y: candle_core::Tensor| y.to_dtype(DType::F32)?.mul(&weights)?.sum_all();
    let mut tracked: Vec<&Var> = fused.vars();
    tracked.push(&x);
    let x32 = || Tensor::<F32>::from_candle(x.as_tensor().clone());
    for train in [true, false] {
        for bf16 in [false, true] {
            let (y, want) = if bf16 {
                let x = x32()?.cast::<BF16>()?;
                let want = plain.forward_t(&x, train)?.relu()?;
                (
                    fused.forward_t(&x, train)?.into_candle(),
                    want.into_candle(),
                )
            } else {
                let want = plain.forward_t(&x32()?, train)?.relu()?;
                (
                    fused.forward_t(&x32()?, train)?.into_candle(),
                    want.into_candle(),
                )
            };
            let flat = |t: &candle_core::Tensor| -> Result<Vec<f32>> {
                t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
            };
            let what = format!("train={train} bf16={bf16}");
            assert_eq!(flat(&y)?, flat(&want)?, "output, {what}");
            assert!(flat(&y)?.contains(&0.0), "some cut, {what}");
            let (gf, gp) = (loss(y)?.backward()?, loss(want)?.backward()?);
            for v in &tracked {
                let (a, b) = (
                    gf.get(v).expect("a gradient"),
                    gp.get(v).expect("a gradient"),
                );
                assert_eq!(flat(a)?, flat(b)?, "gradient, {what}");
            }
        }
    }
    // As a candle module (eval mode): the same values.
    let via_module = candle_nn::ModuleT::forward_t(&fused, x.as_tensor(), false)?;
    let direct = fused.forward_t(&x32()?, false)?;
    assert_eq!(
        via_module.flatten_all()?.to_vec1::<f32>()?,
        direct.to_flat_vec::<f32>()?
    );
    // NaN in the input: the channel's statistics and outputs are NaN, not cut to 0.
    let mut values = x.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    values[0] = f32::NAN;
    let x = Tensor::<F32>::from_vec(values, (2, 3, 5, 6), &dev())?;
    let y = fused.forward_t(&x, true)?.to_flat_vec::<f32>()?;
    assert!(
        y.iter().all(|v| v.is_nan()),
        "a NaN input reaches every output"
    );
    Ok(())
}

// ---- Sums over many positions stay f32 on every path into a half convolution or product. ----

struct CandleLinear {
    fc: candle_nn::Linear,
}
#[candle_amp::autocast(bf16)]
impl CandleLinear {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.fc.forward(&x)
    }
}

struct CandleConv1d {
    conv: candle_nn::Conv1d,
}
#[candle_amp::autocast(bf16)]
impl CandleConv1d {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.conv.forward(&x)
    }
}

/// candle-nn's `Linear` and `Conv1d` called from a bf16 region, and this crate's `Conv1d` from
/// a bf16 input: bias gradients over 300 positions and an input gradient over 300 kernel taps
/// of ones are 300 (bf16 sums stop at 256), the weights' gradients f32.
#[test]
fn half_layers_sum_bias_and_input_gradients_in_f32() -> Result<()> {
    let (_map, vb) = vars();
    let ones = |dims: &[usize]| candle_core::Tensor::ones(dims, DType::F32, &dev());
    let linear = CandleLinear {
        fc: candle_nn::linear(2, 2, vb.pp("fc"))?,
    };
    let y = linear.forward(&Tensor::<F32>::zeros((3, 100, 2), &dev())?)?;
    assert_eq!(y.dims(), &[3, 100, 2]);
    let g = y.as_candle().sum_all()?.backward()?;
    let bias = g
        .get(linear.fc.bias().expect("a bias"))
        .expect("a gradient");
    assert_eq!(bias.to_vec1::<f32>()?, [300.0, 300.0]);
    let conv = CandleConv1d {
        conv: candle_nn::conv1d(1, 1, 1, nn::Conv1dConfig::default(), vb.pp("c1"))?,
    };
    let y = conv.forward(&Tensor::<F32>::zeros((1, 1, 300), &dev())?)?;
    let g = y.as_candle().sum_all()?.backward()?;
    let bias = g
        .get(conv.conv.bias().expect("a bias"))
        .expect("a gradient");
    assert_eq!(bias.to_vec1::<f32>()?, [300.0]);
    // The crate's Conv1d: a 300-tap kernel of ones over a bf16 input of ones, padded.
    let cfg = nn::Conv1dConfig {
        padding: 2,
        ..Default::default()
    };
    let layer = nn::Conv1d::new(Var::from_tensor(&ones(&[1, 1, 300])?)?, None, cfg)?;
    let x = Var::from_tensor(&ones(&[1, 1, 599])?.to_dtype(DType::BF16)?)?;
    let y = layer.forward(&Tensor::<BF16>::from_candle(x.as_tensor().clone())?)?;
    assert_eq!(y.dims(), &[1, 1, 304]);
    let g = y.cast::<F32>()?.as_candle().sum_all()?.backward()?;
    let gx = g
        .get(&x)
        .expect("a gradient")
        .to_dtype(DType::F32)?
        .to_vec3::<f32>()?;
    // Position 299 is under all 304 outputs' windows but the kernel's 300 taps reach it once each.
    assert_eq!(gx[0][0][299], 300.0);
    assert_eq!(
        g.get(layer.weight()).expect("a gradient").dtype(),
        DType::F32
    );
    Ok(())
}

// ---- GroupNorm: fp32-class, PyTorch's arithmetic. ----

/// `F.group_norm` in f64 by hand: per sample and group, the mean and biased variance over the
/// group's channels and all positions.
fn group_norm_f64(
    x: &[f32],
    dims: (usize, usize, usize),
    groups: usize,
    w: &[f32],
    b: &[f32],
    eps: f64,
) -> Vec<f32> {
    let (n, c, hw) = dims;
    let per = c / groups * hw;
    let mut out = vec![0f32; x.len()];
    for s in 0..n {
        for g in 0..groups {
            let start = s * c * hw + g * per;
            let vals: Vec<f64> = x[start..start + per]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let mean = vals.iter().sum::<f64>() / per as f64;
            let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / per as f64;
            for (i, v) in vals.iter().enumerate() {
                let ch = g * (c / groups) + i / hw;
                let y = (v - mean) / (var + eps).sqrt() * f64::from(w[ch]) + f64::from(b[ch]);
                out[start + i] = y as f32;
            }
        }
    }
    out
}

#[candle_amp::autocast(bf16)]
fn group_norms_bf16(
    ours: &nn::GroupNorm,
    theirs: &candle_nn::GroupNorm,
    x: &Tensor<F32>,
) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
    let h = x.cast::<BF16>()?;
    Ok((ours.forward(&h)?, theirs.forward(&h)?))
}

#[candle_amp::autocast(bf16)]
fn group_norm_region(norm: &nn::GroupNorm, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    norm.forward(x)
}

#[test]
fn group_norm_matches_pytorchs_arithmetic_and_runs_in_f32_from_half() -> Result<()> {
    let dev = Device::Cpu;
    let (n, c, h, w) = (2, 6, 3, 3);
    let xs: Vec<f32> = common::values(n * c * h * w, 5)
        .iter()
        .map(|v| v * 3.0 + 1.0)
        .collect();
    let (scale, shift): (Vec<f32>, Vec<f32>) = (
        (0..c).map(|i| 0.5 + i as f32 * 0.25).collect(),
        (0..c).map(|i| i as f32 * 0.1 - 0.2).collect(),
    );
    let weight = candle_core::Var::from_vec(scale.clone(), c, &dev)?;
    let bias = candle_core::Var::from_vec(shift.clone(), c, &dev)?;
    let norm = nn::GroupNorm::new(weight.clone(), bias.clone(), 3, 1e-5)?;
    let x = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(
        xs.clone(),
        (n, c, h, w),
        &dev,
    )?)?;
    let y = norm
        .forward(&x)?
        .as_candle()
        .flatten_all()?
        .to_vec1::<f32>()?;
    let want = group_norm_f64(&xs, (n, c, h * w), 3, &scale, &shift, 1e-5);
    let err = y
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err < 1e-5, "{err}");

    // In a bf16 region, ours and candle-nn's are f32 of the bf16 input, as the typed f32
    // forward of the rounded input; the input's gradient comes back in bf16, the weight's f32.
    let theirs = candle_nn::GroupNorm::new(
        weight.as_tensor().clone(),
        bias.as_tensor().clone(),
        c,
        3,
        1e-5,
    )?;
    let (ours, cand) = group_norms_bf16(&norm, &theirs, &x)?;
    let rounded = x.cast::<BF16>()?.cast::<F32>()?;
    let want = norm.forward(&rounded)?.into_candle();
    for (name, got) in [("ours", &ours), ("candle-nn's", &cand)] {
        assert_eq!(got.dtype(), DType::F32, "{name}");
        let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{name}: {diff}");
    }
    let xv = candle_core::Var::from_tensor(&x.cast::<BF16>()?.into_candle())?;
    let grads = group_norm_region(&norm, xv.as_tensor())?
        .sum_all()?
        .backward()?;
    assert_eq!(
        grads.get(xv.as_tensor()).map(candle_core::Tensor::dtype),
        Some(DType::BF16)
    );
    assert_eq!(
        grads
            .get(weight.as_tensor())
            .map(candle_core::Tensor::dtype),
        Some(DType::F32)
    );

    // PyTorch's constructor checks.
    let v = |n| candle_core::Var::ones(n, DType::F32, &dev);
    assert!(nn::GroupNorm::new(v(6)?, v(6)?, 4, 1e-5)
        .unwrap_err()
        .to_string()
        .contains("divisible"));
    assert!(nn::GroupNorm::new(v(6)?, v(6)?, 0, 1e-5).is_err());
    assert!(nn::GroupNorm::new(v(6)?, v(6)?, 3, 0.0)
        .unwrap_err()
        .to_string()
        .contains("eps"));
    assert!(nn::GroupNorm::new(v(6)?, v(5)?, 3, 1e-5).is_err());
    Ok(())
}

// ---- BatchNorm1d: BatchNorm2d's op over (batch, channels[, length]). ----

#[candle_amp::autocast(bf16)]
fn batch_norm1d_bf16(bn: &nn::BatchNorm1d, x: &Tensor<F32>) -> Result<DType> {
    Ok(bn.forward_t(&x.cast::<BF16>()?, true)?.dtype())
}

#[test]
fn batch_norm1d_is_batch_norm2d_over_a_length_and_matches_a_hand_computation() -> Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let bn1 = nn::batch_norm1d(4, 1e-5, vb.pp("bn1"))?;
    let bn2 = nn::batch_norm2d(4, 1e-5, vb.pp("bn2"))?;
    let x3 = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(
        common::values(8 * 4 * 5, 9),
        (8, 4, 5),
        &dev,
    )?)?;
    let y1 = bn1.forward_t(&x3, true)?.into_candle();
    let y2 = bn2
        .forward_t(&x3.reshape((8, 4, 5, 1))?, true)?
        .into_candle()
        .reshape((8, 4, 5))?;
    let bits = |t: &candle_core::Tensor| -> Result<Vec<u32>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    };
    assert_eq!(bits(&y1)?, bits(&y2)?);
    let (a, b) = (bn1.as_batch_norm2d(), &bn2);
    assert_eq!(
        bits(a.running_var().as_tensor())?,
        bits(b.running_var().as_tensor())?
    );

    // (batch, channels): each channel normalised over the batch, the running variance moved a
    // tenth of the way to the unbiased batch variance, by hand.
    let bn = nn::batch_norm1d(3, 1e-5, vb.pp("bn3"))?;
    let xs = common::values(6 * 3, 4);
    let x2 = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(xs.clone(), (6, 3), &dev)?)?;
    let y = bn.forward_t(&x2, true)?.into_candle().to_vec2::<f32>()?;
    let rv = bn
        .as_batch_norm2d()
        .running_var()
        .as_tensor()
        .to_vec1::<f32>()?;
    for c in 0..3 {
        let col: Vec<f64> = (0..6).map(|r| f64::from(xs[r * 3 + c])).collect();
        let mean = col.iter().sum::<f64>() / 6.0;
        let var = col.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 6.0;
        for (r, v) in col.iter().enumerate() {
            let want = (v - mean) / (var + 1e-5).sqrt();
            assert!(
                (f64::from(y[r][c]) - want).abs() < 1e-5,
                "{} vs {want}",
                y[r][c]
            );
        }
        let want_rv = 0.9 + 0.1 * var * 6.0 / 5.0;
        assert!(
            (f64::from(rv[c]) - want_rv).abs() < 1e-6,
            "{} vs {want_rv}",
            rv[c]
        );
    }

    // In a bf16 region it runs in its input's precision, as BatchNorm2d (on no PyTorch list).
    assert_eq!(batch_norm1d_bf16(&bn, &x2)?, DType::BF16);
    let x4 = x3.reshape((8, 4, 5, 1))?;
    let err = bn1.forward_t(&x4, true).unwrap_err().to_string();
    assert!(err.contains("BatchNorm2d's"), "{err}");
    Ok(())
}

// ---- AdaptiveAvgPool2d: PyTorch's windows, precision-preserving. ----

/// The pooled bf16 value's dtype in the region, and the value (leaving in the input's f32).
#[candle_amp::autocast(bf16)]
fn adaptive_pool_bf16(
    pool: &nn::AdaptiveAvgPool2d,
    x: &Tensor<F32>,
) -> Result<(DType, candle_core::Tensor)> {
    let y = pool.forward(&x.cast::<BF16>()?)?;
    Ok((y.dtype(), y))
}

#[test]
fn adaptive_avg_pool_uses_pytorchs_windows_and_keeps_the_precision() -> Result<()> {
    let dev = Device::Cpu;
    let (h, w) = (5, 7);
    let xs = common::values(2 * h * w, 6);
    let x = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(
        xs.clone(),
        (1, 2, h, w),
        &dev,
    )?)?;
    // Fewer cells than rows and columns (overlapping windows), and more (windows of one value,
    // some repeated).
    for (oh, ow) in [(2, 3), (8, 9)] {
        let y = nn::AdaptiveAvgPool2d::new((oh, ow))?
            .forward(&x)?
            .into_candle()
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut k = 0;
        for c in 0..2 {
            for i in 0..oh {
                for j in 0..ow {
                    let (r0, r1) = (i * h / oh, ((i + 1) * h).div_ceil(oh));
                    let (c0, c1) = (j * w / ow, ((j + 1) * w).div_ceil(ow));
                    let cells: Vec<f64> = (r0..r1)
                        .flat_map(|r| (c0..c1).map(move |q| (r, q)))
                        .map(|(r, q)| f64::from(xs[c * h * w + r * w + q]))
                        .collect();
                    let want = cells.iter().sum::<f64>() / cells.len() as f64;
                    assert!(
                        (f64::from(y[k]) - want).abs() < 1e-6,
                        "{oh}x{ow} ({c},{i},{j}): {} vs {want}",
                        y[k]
                    );
                    k += 1;
                }
            }
        }
    }
    // An output no memory holds is an error, not a hang building its cells.
    let huge = nn::AdaptiveAvgPool2d::new((usize::MAX, 1))?.forward(&x);
    assert!(huge.is_err_and(|e| e.to_string().contains("too large")));
    let pool = nn::AdaptiveAvgPool2d::new((2, 3))?;
    let global = nn::AdaptiveAvgPool2d::new((1, 1))?
        .forward(&x)?
        .into_candle();
    let mean = x.as_candle().mean_keepdim(3)?.mean_keepdim(2)?;
    let diff = (global - mean)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-6, "{diff}");
    // In a bf16 region: bf16 out, the f32 average of the bf16 input rounded once.
    let (dtype, y16) = adaptive_pool_bf16(&pool, &x)?;
    assert_eq!(dtype, DType::BF16);
    let want = pool
        .forward(&x.cast::<BF16>()?.cast::<F32>()?)?
        .into_candle();
    let want = want.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
    assert_eq!(
        y16.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    assert!(nn::AdaptiveAvgPool2d::new((0, 1)).is_err());
    // One image `(c, h, w)`, as PyTorch's layer takes it: the batch of one's values, unbatched.
    let image = x.as_candle().squeeze(0)?;
    let y = pool.forward(&Tensor::<F32>::from_candle(image)?)?;
    let batched = pool.forward(&x)?.into_candle().squeeze(0)?;
    assert_eq!(y.dims(), &[2, 2, 3]);
    assert_eq!(
        y.into_candle().flatten_all()?.to_vec1::<f32>()?,
        batched.flatten_all()?.to_vec1::<f32>()?
    );
    let flat = x.as_candle().flatten_from(1)?;
    let e = pool
        .forward(&Tensor::<F32>::from_candle(flat)?)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("AdaptiveAvgPool2d") && e.contains("(channels, h, w)"),
        "{e}"
    );
    Ok(())
}

// ---- ConvTranspose2d ----

/// PyTorch's `conv_transpose2d` by hand in f64 (no groups): every input pixel scatters its
/// weighted kernel into the output at stride, dilation and padding.
fn conv_transpose2d_f64(
    x: &[f32],
    (n, c_in, h, w): (usize, usize, usize, usize),
    k: &[f32],
    (c_out, kh, kw): (usize, usize, usize),
    bias: &[f32],
    cfg: &nn::ConvTranspose2dConfig,
) -> (Vec<f32>, (usize, usize)) {
    let side = |size: usize, taps: usize| {
        (size - 1) * cfg.stride + cfg.dilation * (taps - 1) + cfg.output_padding + 1
            - 2 * cfg.padding
    };
    let (oh, ow) = (side(h, kh), side(w, kw));
    let mut out: Vec<f64> = (0..n * c_out * oh * ow)
        .map(|i| f64::from(bias[i / (oh * ow) % c_out]))
        .collect();
    for s in 0..n {
        for ci in 0..c_in {
            for (i, j) in (0..h).flat_map(|i| (0..w).map(move |j| (i, j))) {
                let v = f64::from(x[((s * c_in + ci) * h + i) * w + j]);
                for co in 0..c_out {
                    for (a, b) in (0..kh).flat_map(|a| (0..kw).map(move |b| (a, b))) {
                        let (y, z) = (
                            (i * cfg.stride + a * cfg.dilation) as isize - cfg.padding as isize,
                            (j * cfg.stride + b * cfg.dilation) as isize - cfg.padding as isize,
                        );
                        if (0..oh as isize).contains(&y) && (0..ow as isize).contains(&z) {
                            let wk = f64::from(k[((ci * c_out + co) * kh + a) * kw + b]);
                            out[((s * c_out + co) * oh + y as usize) * ow + z as usize] += v * wk;
                        }
                    }
                }
            }
        }
    }
    (out.iter().map(|&v| v as f32).collect(), (oh, ow))
}

/// Both layers in a bf16 region: the dtypes they ran in, and their results (which leave the
/// region for plain code in f32, exactly their bf16 values).
#[candle_amp::autocast(bf16)]
fn transposed_bf16(
    ours: &nn::ConvTranspose2d,
    theirs: &candle_nn::ConvTranspose2d,
    x: &Tensor<F32>,
) -> Result<((DType, DType), candle_core::Tensor, candle_core::Tensor)> {
    let (a, b) = (ours.forward(x)?, theirs.forward(x)?);
    Ok(((a.dtype(), b.dtype()), a, b))
}

/// `nn::ConvTranspose2d` against a hand computation of PyTorch's definition (strided, padded,
/// dilated, an output padding) in f32; in a bf16 region it runs in bf16 (a lower-precision op)
/// within bf16's precision of the f32 result on the rounded values, its weight's and bias's
/// gradients f32, and candle-nn's layer of the same weights runs the same there.
#[test]
fn conv_transpose2d_matches_pytorchs_definition_and_runs_in_the_half_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let (n, c_in, h, w, c_out, k) = (2, 3, 4, 5, 2, 3);
    let cfg = nn::ConvTranspose2dConfig {
        padding: 1,
        output_padding: 1,
        stride: 2,
        dilation: 1,
    };
    let xs = common::values(n * c_in * h * w, 3);
    let ks: Vec<f32> = common::values(c_in * c_out * k * k, 4);
    let bs = vec![0.25f32, -0.5];
    let weight = candle_core::Var::from_vec(ks.clone(), (c_in, c_out, k, k), &dev)?;
    let bias = candle_core::Var::from_vec(bs.clone(), c_out, &dev)?;
    let layer = nn::ConvTranspose2d::new(weight.clone(), Some(bias.clone()), cfg)?;
    let x = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(
        xs.clone(),
        (n, c_in, h, w),
        &dev,
    )?)?;
    let (want, (oh, ow)) =
        conv_transpose2d_f64(&xs, (n, c_in, h, w), &ks, (c_out, k, k), &bs, &cfg);
    let y = layer.forward(&x)?;
    assert_eq!(y.dims(), [n, c_out, oh, ow]);
    let got = y.as_candle().flatten_all()?.to_vec1::<f32>()?;
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err < 1e-5, "f32: {err}");

    let theirs = candle_nn::ConvTranspose2d::new(
        weight.as_tensor().clone(),
        Some(bias.as_tensor().clone()),
        cfg,
    );
    let (dtypes, ours_bf16, theirs_bf16) = transposed_bf16(&layer, &theirs, &x)?;
    assert_eq!(dtypes, (DType::BF16, DType::BF16), "a lower-precision op");
    assert_eq!(
        ours_bf16
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        theirs_bf16
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        "candle-nn's layer runs the same op in a region"
    );
    // The f32 op on the bf16-rounded values: bf16's precision apart.
    let round = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let (want_bf16, _) = conv_transpose2d_f64(
        &round(&xs),
        (n, c_in, h, w),
        &round(&ks),
        (c_out, k, k),
        &round(&bs),
        &cfg,
    );
    let got = ours_bf16
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let scale = want_bf16.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .zip(&want_bf16)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err <= 1e-2 * scale, "bf16: {err} of {scale}");
    let grads = ours_bf16
        .to_dtype(DType::F32)?
        .sqr()?
        .sum_all()?
        .backward()?;
    for (name, var) in [("weight", &weight), ("bias", &bias)] {
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("a gradient for the {name}"));
        assert_eq!(g.dtype(), DType::F32, "{name}");
        assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0, "{name}");
    }

    Ok(())
}

/// Arguments PyTorch's `nn.ConvTranspose2d` rejects are errors naming them.
#[test]
fn conv_transpose2d_rejects_what_pytorch_rejects() -> Result<()> {
    let dev = Device::Cpu;
    let weight = candle_core::Var::zeros((3, 2, 3, 3), DType::F32, &dev)?;
    let bias = candle_core::Var::zeros(2, DType::F32, &dev)?;
    let cfg = nn::ConvTranspose2dConfig {
        stride: 2,
        ..Default::default()
    };
    let bad = |c: nn::ConvTranspose2dConfig| {
        nn::ConvTranspose2d::new(weight.clone(), Some(bias.clone()), c)
            .expect_err("rejected")
            .to_string()
    };
    assert!(bad(nn::ConvTranspose2dConfig { stride: 0, ..cfg }).contains("stride"));
    assert!(bad(nn::ConvTranspose2dConfig {
        output_padding: 2,
        ..cfg
    })
    .contains("output padding"));
    let wrong_bias = candle_core::Var::zeros(3, DType::F32, &dev)?;
    let err = nn::ConvTranspose2d::new(weight.clone(), Some(wrong_bias), cfg)
        .expect_err("a bias per output channel")
        .to_string();
    assert!(err.contains("expected shape [2]"), "{err}");
    Ok(())
}

// ---- Upsample ----

/// PyTorch's `F.interpolate` by hand in f64 (`align_corners=False`): for each output, the
/// input positions and weights of each axis (nearest: PyTorch's `nearest_idx`, `i` at the same
/// size, `i / 2` at twice it, else `min(floor(i * r), n - 1)` in f32; bilinear: at
/// `max((i + 0.5) * r - 0.5, 0)` between its floor and the next input), their products summed.
/// Checked against PyTorch 2.15's `F.interpolate` on these cases when written (to 1e-15).
fn interpolate_f64(
    x: &[f32],
    (n, c, h, w): (usize, usize, usize, usize),
    (oh, ow): (usize, usize),
    (rh, rw): (f64, f64),
    mode: nn::UpsampleMode,
) -> Vec<f64> {
    let taps = |len: usize, out: usize, r: f64| -> Vec<Vec<(usize, f64)>> {
        (0..out)
            .map(|i| match mode {
                nn::UpsampleMode::Nearest => {
                    let src = if out == len {
                        i
                    } else if out == 2 * len {
                        i / 2
                    } else {
                        ((i as f32 * r as f32).floor() as usize).min(len - 1)
                    };
                    vec![(src, 1.0)]
                }
                nn::UpsampleMode::Bilinear => {
                    let src = ((i as f64 + 0.5) * r - 0.5).max(0.0);
                    let i0 = (src.floor() as usize).min(len - 1);
                    let l = src - i0 as f64;
                    vec![(i0, 1.0 - l), ((i0 + 1).min(len - 1), l)]
                }
            })
            .collect()
    };
    let (th, tw) = (taps(h, oh, rh), taps(w, ow, rw));
    let mut y = vec![0f64; n * c * oh * ow];
    for p in 0..n * c {
        for (i, ti) in th.iter().enumerate() {
            for (j, tj) in tw.iter().enumerate() {
                for &(a, wa) in ti {
                    for &(b, wb) in tj {
                        y[(p * oh + i) * ow + j] += wa * wb * f64::from(x[(p * h + a) * w + b]);
                    }
                }
            }
        }
    }
    y
}

#[candle_amp::autocast(bf16)]
fn upsample_bf16(up: &nn::Upsample, x: &Tensor<F32>) -> Result<DType> {
    Ok(up.forward(&x.cast::<BF16>()?)?.dtype())
}

/// A view (a transposed image) upsamples as its contiguous copy does: candle's `index_select`
/// refused it ("index-select only supports contiguous tensors"), where PyTorch reads it.
#[test]
fn upsample_reads_a_view() -> Result<()> {
    let xs: Vec<f32> = (0..30).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = Tensor::<F32>::from_vec(xs, (1, 2, 5, 3), &Device::Cpu)?.transpose(2, 3)?;
    for mode in [nn::UpsampleMode::Nearest, nn::UpsampleMode::Bilinear] {
        let up = nn::Upsample::with_size((5, 7), mode)?;
        let (view, copy) = (up.forward(&x)?, up.forward(&x.contiguous()?)?);
        assert_eq!(
            view.to_flat_vec::<f32>()?,
            copy.to_flat_vec::<f32>()?,
            "{mode:?}"
        );
    }
    Ok(())
}

/// A 3-D input is `(batch, channels, length)` to PyTorch's `Upsample` (a 1-D resampling), not an
/// image: an error naming the layout and the 4-D form that does it, where it was candle's bare
/// "unexpected rank"; the named form resamples the length as PyTorch's 1-D nearest does
/// (`[1, 2, 3]` to 6: each value twice).
#[test]
fn upsample_of_a_3d_input_names_the_layout() -> Result<()> {
    let x = Tensor::<F32>::from_vec(vec![1f32, 2.0, 3.0], (1, 1, 3), &Device::Cpu)?;
    let up = nn::Upsample::with_scale(2.0, nn::UpsampleMode::Nearest)?;
    let e = up.forward(&x).unwrap_err().to_string();
    assert!(
        e.contains("(batch, channels, length)") && e.contains("unsqueeze(2)"),
        "{e}"
    );
    let by_length = nn::Upsample::with_size((1, 6), nn::UpsampleMode::Nearest)?;
    let y = by_length.forward(&x.unsqueeze(2)?)?.squeeze(2)?;
    assert_eq!(y.to_flat_vec::<f32>()?, [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    Ok(())
}

/// `nn::Upsample` against PyTorch's definition (nearest and bilinear, by size and by scale,
/// integer and fractional), values and the input's gradient of `sum(y * r)` (each output's
/// weights sent back to its inputs, in f64 by hand); precision-preserving in a region (a bf16
/// value stays bf16); sizes and scales PyTorch rejects are errors.
#[test]
fn upsample_matches_pytorchs_interpolate_and_its_gradient() -> Result<()> {
    let dev = Device::Cpu;
    let dims = (1, 2, 3, 5);
    let xs: Vec<f32> = (0..30).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
    let x = candle_core::Var::from_vec(xs.clone(), dims, &dev)?;
    let typed = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
    for mode in [nn::UpsampleMode::Nearest, nn::UpsampleMode::Bilinear] {
        let cases = [
            (
                nn::Upsample::with_size((5, 7), mode)?,
                (5, 7),
                (3.0 / 5.0, 5.0 / 7.0),
            ),
            (
                nn::Upsample::with_size((4, 9), mode)?,
                (4, 9),
                (3.0 / 4.0, 5.0 / 9.0),
            ),
            (nn::Upsample::with_scale(2.0, mode)?, (6, 10), (0.5, 0.5)),
            (
                nn::Upsample::with_scale(1.5, mode)?,
                (4, 7),
                (1.0 / 1.5, 1.0 / 1.5),
            ),
            // Nearest at the input's size (3 rows) and at twice it (6 rows) by a scale that is
            // neither 1 nor 2: PyTorch copies and halves there (the ratio dropped row 2 at 1.2
            // and took rows [0, 0, 0, 1, 1, 2] at 2.3).
            (
                nn::Upsample::with_scale(1.2, mode)?,
                (3, 6),
                (1.0 / 1.2, 1.0 / 1.2),
            ),
            (
                nn::Upsample::with_scale(2.3, mode)?,
                (6, 11),
                (1.0 / 2.3, 1.0 / 2.3),
            ),
        ];
        for (up, out, ratio) in cases {
            let y = up.forward(&typed)?;
            assert_eq!(y.dims(), [1, 2, out.0, out.1], "{mode:?} {out:?}");
            let want = interpolate_f64(&xs, dims, out, ratio, mode);
            let got = y.as_candle().flatten_all()?.to_vec1::<f32>()?;
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (f64::from(*g) - w).abs() < 1e-5,
                    "{mode:?} {out:?}: {g} vs {w}"
                );
            }
            // d sum(y * r) / dx: each output's r, times its weights, back to its inputs. By
            // linearity it is the map's transpose applied to r, computed here as the
            // interpolation of each unit input.
            let r: Vec<f32> = (0..want.len()).map(|i| (i as f32 * 0.11).cos()).collect();
            let rt = candle_core::Tensor::from_vec(r.clone(), y.dims(), &dev)?;
            let grads = (y.as_candle() * rt)?.sum_all()?.backward()?;
            let g = grads
                .get(&x)
                .expect("a gradient")
                .flatten_all()?
                .to_vec1::<f32>()?;
            for (k, gk) in g.iter().enumerate() {
                let mut unit = vec![0f32; xs.len()];
                unit[k] = 1.0;
                let column = interpolate_f64(&unit, dims, out, ratio, mode);
                let want: f64 = column.iter().zip(&r).map(|(a, b)| a * f64::from(*b)).sum();
                assert!(
                    (f64::from(*gk) - want).abs() < 1e-5,
                    "{mode:?} {out:?} grad {k}"
                );
            }
        }
        assert_eq!(
            upsample_bf16(&nn::Upsample::with_scale(2.0, mode)?, &typed)?,
            DType::BF16
        );
    }
    assert!(nn::Upsample::with_size((0, 3), nn::UpsampleMode::Nearest).is_err());
    let huge = nn::Upsample::with_scale(1e12, nn::UpsampleMode::Nearest)?.forward(&typed);
    assert!(huge
        .expect_err("too large")
        .to_string()
        .contains("outputs along an axis"));
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(
            nn::Upsample::with_scale(bad, nn::UpsampleMode::Bilinear).is_err(),
            "{bad}"
        );
    }
    Ok(())
}

/// `LinearAct` is `Linear` then the activation, bit for bit: the output and the gradients of
/// the input, the weight and the bias, for each fused activation, in bf16 and f16 (one op on
/// CPU) and f32 (the two ops), with a rank-3 input; and in a bf16 region it runs in bf16.
#[test]
fn linear_act_is_the_linear_then_the_activation_bit_for_bit() -> Result<()> {
    use candle_nn::Activation;
    fn run<P: Precision>(act: Activation, fused: bool) -> Result<Vec<Vec<f32>>> {
        let (map, vb) = vars();
        let linear = nn::linear(6, 5, vb.pp("fc"))?;
        // The same values every run, from fixed seeds.
        let seeded =
            |n: usize, seed: u64| candle_core::Tensor::from_vec(common::values(n, seed), n, &dev());
        let x = Var::from_tensor(&seeded(36, 1)?.reshape((2, 3, 6))?.affine(2.0, 0.0)?)?;
        // Weight and bias in name order (`all_vars` has no fixed order).
        let params: Vec<Var> = {
            let data = map.data().lock().unwrap();
            let mut named: Vec<_> = data.iter().collect();
            named.sort_by(|a, b| a.0.cmp(b.0));
            named.into_iter().map(|(_, v)| v.clone()).collect()
        };
        for (i, v) in params.iter().enumerate() {
            v.set(&seeded(v.elem_count(), 10 + i as u64)?.reshape(v.shape())?)?;
        }
        let xp = Tensor::<F32>::from_candle(x.as_tensor().clone())?.cast::<P>()?;
        let y = if fused {
            nn::LinearAct::new(linear.clone(), act)?.forward(&xp)?
        } else {
            let z = linear.forward(&xp)?;
            match act {
                Activation::Gelu => z.gelu_erf()?,
                Activation::NewGelu => z.gelu()?,
                Activation::Silu => z.silu()?,
                _ => z.relu()?,
            }
        };
        let w = seeded(30, 99)?.reshape((2, 3, 5))?;
        let loss = (y.as_candle().to_dtype(DType::F32)? * &w)?.sum_all()?;
        let grads = loss.backward()?;
        let mut out = vec![y
            .as_candle()
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?];
        for v in std::iter::once(&x).chain(&params) {
            let g = grads.get(v).expect("a gradient for every operand");
            out.push(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }
    for act in [
        Activation::Gelu,
        Activation::NewGelu,
        Activation::Silu,
        Activation::Relu,
    ] {
        assert_eq!(
            run::<BF16>(act, true)?,
            run::<BF16>(act, false)?,
            "{act:?} bf16"
        );
        assert_eq!(
            run::<F16>(act, true)?,
            run::<F16>(act, false)?,
            "{act:?} f16"
        );
        assert_eq!(
            run::<F32>(act, true)?,
            run::<F32>(act, false)?,
            "{act:?} f32"
        );
    }
    let (_, vb) = vars();
    let e = nn::LinearAct::new(nn::linear(2, 2, vb.pp("t"))?, Activation::Elu(1.0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no fused form"), "{e}");
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn linear_act_in_region(l: &nn::LinearAct, x: &Tensor<F32>) -> Result<candle_core::DType> {
    Ok(l.forward(x)?.dtype())
}

/// In a bf16 region the fused layer is lower precision, as `Linear`: bf16 out of f32 in.
#[test]
fn linear_act_runs_in_the_regions_lower_precision() -> Result<()> {
    let (_, vb) = vars();
    let layer = nn::LinearAct::new(nn::linear(4, 3, vb.pp("fc"))?, candle_nn::Activation::Gelu)?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev())?;
    assert_eq!(linear_act_in_region(&layer, &x)?, DType::BF16);
    assert_eq!(layer.forward(&x)?.dtype(), DType::F32);
    Ok(())
}

/// A candle-nn conv block as upstream writes it, `bn.forward_t(&conv.forward(&x)?, train)`, in a
/// bf16 region: candle-nn's `BatchNorm` met the conv's bf16 output with its f32 statistics
/// (`dtype mismatch in sub`). It runs as `BatchNorm2d`'s class (the input's precision out, f32
/// inside): the output, the running statistics it updates and the conv weight's gradient match
/// the same code in f32 within bf16's rounding of the conv.
#[candle_amp::autocast(bf16)]
fn conv_bn_block(
    conv: &candle_nn::Conv2d,
    bn: &candle_nn::BatchNorm,
    x: &Tensor<F32>,
    train: bool,
) -> Result<Tensor<F32>> {
    let h = conv.forward(x)?;
    bn.forward_t(&h, train)
}

#[test]
fn candle_nn_batch_norm_runs_in_a_region_as_written() -> Result<()> {
    use candle_core::{Module, ModuleT};
    let build = || -> Result<(VarMap, candle_nn::Conv2d, candle_nn::BatchNorm)> {
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
        let conv = candle_nn::conv2d(3, 4, 3, candle_nn::Conv2dConfig::default(), vb.pp("conv"))?;
        let bn = candle_nn::batch_norm(4, 1e-5, vb.pp("bn"))?;
        Ok((vars, conv, bn))
    };
    let (vars_a, conv_a, bn_a) = build()?;
    let (vars_b, conv_b, bn_b) = build()?;
    for (name, var) in vars_a.data().lock().unwrap().iter() {
        vars_b.data().lock().unwrap()[name].set(var.as_tensor())?;
    }
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 6, 6), &dev())?;
    let r = candle_core::Tensor::randn(0f32, 1.0, (2, 4, 4, 4), &dev())?;
    let conv_weight = |vars: &VarMap| vars.data().lock().unwrap()["conv.weight"].clone();
    for train in [true, false] {
        let got = conv_bn_block(&conv_a, &bn_a, &x, train)?.into_candle();
        let want = bn_b.forward_t(&conv_b.forward(x.as_candle())?, train)?;
        let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 0.05, "train {train}: {err}");
        // The conv weight's gradient through the batch norm: bf16's rounding of the conv apart.
        let grad = |y: &candle_core::Tensor, vars: &VarMap| -> Result<Vec<f32>> {
            let grads = (y * &r)?.sum_all()?.backward()?;
            grads
                .get(&conv_weight(vars))
                .expect("a gradient")
                .flatten_all()?
                .to_vec1()
        };
        let (ga, gb) = (grad(&got, &vars_a)?, grad(&want, &vars_b)?);
        let norm = gb.iter().map(|v| v * v).sum::<f32>().sqrt();
        let diff = ga
            .iter()
            .zip(&gb)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        assert!(
            diff <= 0.02 * norm,
            "train {train}: gradient off by {diff} of {norm}"
        );
        let stats = |bn: &candle_nn::BatchNorm| -> Result<Vec<f32>> {
            bn.running_mean().flatten_all()?.to_vec1()
        };
        let (a, b) = (stats(&bn_a)?, stats(&bn_b)?);
        assert!(
            a.iter().zip(&b).all(|(a, b)| (a - b).abs() < 0.01),
            "{a:?} {b:?}"
        );
    }
    Ok(())
}

/// A row of finite values whose variance overflows f32 (deviations near 3e38, reachable from
/// bf16 activations) is normalised: the layer and RMS norms take such a row's moments in f64
/// (the f32 variance was inf, every output the shift and every gradient 0, all finite, so
/// that not even the gradient scaler saw it; PyTorch gives NaN). Against an f64 reference.
#[test]
fn norms_of_a_row_whose_variance_overflows_f32() -> Result<()> {
    let row = [3e38f32, -3e38, 1e38, 1.0];
    let x = Var::from_slice(&row, (1, 4), &Device::Cpu)?;
    let typed = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
    let (ones, zeros) = (
        Tensor::<F32>::ones(4, &Device::Cpu)?,
        Tensor::<F32>::zeros(4, &Device::Cpu)?,
    );
    let wide: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
    let mean = wide.iter().sum::<f64>() / 4.0;
    let var = wide.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 4.0;
    let rms = (wide.iter().map(|v| v * v).sum::<f64>() / 4.0).sqrt();
    for (what, y, want) in [
        (
            "layer_norm",
            candle_amp::ops::layer_norm(&typed, &ones, &zeros, 1e-5)?,
            wide.iter()
                .map(|v| (v - mean) / var.sqrt())
                .collect::<Vec<_>>(),
        ),
        (
            "rms_norm",
            candle_amp::ops::rms_norm(&typed, &ones, 1e-5)?,
            wide.iter().map(|v| v / rms).collect(),
        ),
    ] {
        let got = y.to_flat_vec::<f32>()?;
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (f64::from(*g) - w).abs() < 1e-5,
                "{what}: {got:?}, f64 {want:?}"
            );
        }
        let grads = (y.as_candle()
            * &candle_core::Tensor::new(&[[1f32, 2.0, 3.0, 4.0]], &Device::Cpu)?)?
            .sum_all()?
            .backward()?;
        let g = grads
            .get(&x)
            .expect("a gradient")
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert!(
            g.iter().all(|v| v.is_finite()) && g.iter().any(|&v| v != 0.0),
            "{what}: gradient {g:?}"
        );
    }
    Ok(())
}

/// The global adaptive average (`(1, 1)`, a ResNet's head) sums each image's values in their
/// order, as PyTorch: `[[3e38, -3e38], [1e38, 1]]` averages to 2.5e37, where the mean of the
/// columns' sums overflowed (`3e38 + 1e38`) to inf. Its gradient is `1 / (h w)` everywhere.
#[test]
fn the_global_average_pool_sums_in_pytorchs_order() -> Result<()> {
    let x = Var::from_slice(&[3e38f32, -3e38, 1e38, 1.0], (1, 1, 2, 2), &Device::Cpu)?;
    let y = nn::AdaptiveAvgPool2d::new((1, 1))?
        .forward(&Tensor::<F32>::from_candle(x.as_tensor().clone())?)?;
    assert_eq!(y.dims(), [1, 1, 1, 1]);
    let v = y.to_flat_vec::<f32>()?[0];
    assert!((v - 2.5e37).abs() <= 2.5e37 * 1e-6, "{v}");
    let g = y.as_candle().sum_all()?.backward()?;
    let g = g
        .get(&x)
        .expect("a gradient")
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_eq!(g, [0.25; 4]);
    Ok(())
}

/// A group of finite values whose variance overflows f32 comes out NaN, as PyTorch's
/// `F.group_norm` (it gave the shift, finite, with a zero gradient: nothing downstream, the
/// gradient scaler included, could see it); the other group of the same input is normalised.
#[test]
fn group_norm_of_a_group_whose_variance_overflows_is_nan() -> Result<()> {
    let vars = VarMap::new();
    let gn = nn::group_norm(
        2,
        4,
        1e-5,
        VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu),
    )?;
    let x = candle_core::Tensor::new(&[3e38f32, -3e38, 1.0, 3.0], &Device::Cpu)?
        .reshape((1, 4, 1, 1))?;
    let y = candle_nn::Module::forward(&gn, &x)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert!(y[0].is_nan() && y[1].is_nan(), "{y:?}");
    // (x - 2) / sqrt(1 + 1e-5) for the second group.
    let want = 1.0 / (1.0f64 + 1e-5).sqrt();
    assert!(
        (f64::from(y[2]) + want).abs() < 1e-6 && (f64::from(y[3]) - want).abs() < 1e-6,
        "{y:?}"
    );
    Ok(())
}
