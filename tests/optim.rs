//! `candle_amp::optim`: the in-place `SGD` and `AdamW` against independent expectations:
//! candle-nn's `SGD` bit for bit, AdamW written out in f64 from its paper form, hand-computed
//! first steps, and the same training loop run one batch per region.
#![allow(clippy::float_cmp)]

use candle_amp::nn::loss;
use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW, SGD};
use candle_amp::{autocast, GradScaler, Tensor, F32};
use candle_core::{DType, Device, Result, Var};
use half::bf16;

mod common;

use common::values;

fn tensor(shape: &[usize], seed: u64, dev: &Device) -> Result<candle_core::Tensor> {
    candle_core::Tensor::from_vec(values(shape.iter().product(), seed), shape, dev)
}

fn var(shape: &[usize], seed: u64, dev: &Device) -> Result<Var> {
    Var::from_tensor(&tensor(shape, seed, dev)?)
}

fn bits(v: &Var) -> Result<Vec<u32>> {
    Ok(v.flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

/// The loss `sum(w * c)`: its gradient with respect to `w` is `c`, so a test picks the
/// gradients it feeds an optimizer.
fn linear_loss(w: &Var, c: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    (w.as_tensor() * c.to_dtype(w.dtype())?)?.sum_all()
}

/// A two-layer MLP in plain candle ops, its first weight large enough (300 x 300) that the
/// in-place pass splits it over the thread pool.
fn mlp_loss(
    vars: &[Var],
    x: &candle_core::Tensor,
    y: &candle_core::Tensor,
) -> Result<candle_core::Tensor> {
    let h = x.matmul(&vars[0].t()?)?.broadcast_add(&vars[1])?.relu()?;
    let out = h.matmul(&vars[2].t()?)?;
    (out - y)?.sqr()?.mean_all()
}

fn sgd_steps_bit_for_bit_like_candle_nn(dev: &Device) -> Result<()> {
    let make = || -> Result<Vec<Var>> {
        Ok(vec![
            var(&[300, 300], 1, dev)?,
            var(&[300], 2, dev)?,
            var(&[7, 300], 3, dev)?,
        ])
    };
    let (ours, theirs) = (make()?, make()?);
    let mut opt = SGD::new(ours.clone(), 0.05)?;
    let mut reference = candle_nn::SGD::new(theirs.clone(), 0.05)?;
    for step in 0..3u64 {
        let x = tensor(&[16, 300], 10 + step, dev)?;
        let y = tensor(&[16, 7], 20 + step, dev)?;
        opt.backward_step(&mlp_loss(&ours, &x, &y)?)?;
        reference.backward_step(&mlp_loss(&theirs, &x, &y)?)?;
        for (a, b) in ours.iter().zip(&theirs) {
            assert_eq!(bits(a)?, bits(b)?, "step {step}");
        }
    }
    // The weights did move.
    assert_ne!(bits(&ours[0])?, bits(&var(&[300, 300], 1, dev)?)?);
    Ok(())
}
test_device!(
    sgd_steps_bit_for_bit_like_candle_nn,
    sgd_steps_bit_for_bit_like_candle_nn_cpu,
    sgd_steps_bit_for_bit_like_candle_nn_cuda
);

/// AdamW in f64 from the paper's form (bias-corrected moments `m_hat`, `v_hat`), not PyTorch's
/// factoring: `w <- w (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`. Returns the weights after
/// each gradient of `grads` in turn.
fn adamw_reference(w: &[f64], grads: &[Vec<f64>], p: &ParamsAdamW) -> Vec<f64> {
    let mut w = w.to_vec();
    let (mut m, mut v) = (vec![0.0; w.len()], vec![0.0; w.len()]);
    for (t, g) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        for i in 0..w.len() {
            m[i] = p.beta1 * m[i] + (1.0 - p.beta1) * g[i];
            v[i] = p.beta2 * v[i] + (1.0 - p.beta2) * g[i] * g[i];
            let m_hat = m[i] / (1.0 - p.beta1.powi(t));
            let v_hat = v[i] / (1.0 - p.beta2.powi(t));
            w[i] = w[i] * (1.0 - p.lr * p.weight_decay) - p.lr * m_hat / (v_hat.sqrt() + p.eps);
        }
    }
    w
}

fn params() -> ParamsAdamW {
    ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.1,
        ..ParamsAdamW::default()
    }
}

/// Runs `steps` AdamW steps on a parameter of `n` elements of `dtype` from the gradients
/// `values(n, 100 + step)`; returns (the parameter's values after, the f64 reference).
fn adamw_run(dev: &Device, dtype: DType, n: usize, steps: u64) -> Result<(Vec<f64>, Vec<f64>)> {
    let w0 = tensor(&[n], 7, dev)?.to_dtype(dtype)?;
    let w = Var::from_tensor(&w0)?;
    let mut opt = AdamW::new(vec![w.clone()], params())?;
    let mut grads = Vec::new();
    for step in 0..steps {
        let c = tensor(&[n], 100 + step, dev)?.to_dtype(dtype)?;
        grads.push(c.to_dtype(DType::F64)?.to_vec1::<f64>()?);
        opt.backward_step(&linear_loss(&w, &c)?)?;
    }
    let start = w0.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok((
        w.to_dtype(DType::F64)?.to_vec1::<f64>()?,
        adamw_reference(&start, &grads, &params()),
    ))
}

fn adamw_follows_the_f64_reference(dev: &Device) -> Result<()> {
    // Small (one thread) and large (split over the pool).
    for n in [37, 100_003] {
        let (got, want) = adamw_run(dev, DType::F32, n, 5)?;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Five steps of ~lr each: f32 rounding leaves ~1e-7 of |w|.
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "n {n}, element {i}: {g} vs {w}"
            );
        }
    }
    Ok(())
}
test_device!(
    adamw_follows_the_f64_reference,
    adamw_follows_the_f64_reference_cpu,
    adamw_follows_the_f64_reference_cuda
);

fn adamw_steps_bit_for_bit_like_candle_nn(dev: &Device) -> Result<()> {
    // Small (one thread) and large (split over the pool), with weight decay.
    for shape in [[64, 33], [300, 300]] {
        let (ours, theirs) = (var(&shape, 5, dev)?, var(&shape, 5, dev)?);
        let mut opt = AdamW::new(vec![ours.clone()], params())?;
        let mut reference = candle_nn::AdamW::new(vec![theirs.clone()], params())?;
        for step in 0..10 {
            let c = tensor(&shape, 200 + step, dev)?;
            opt.backward_step(&linear_loss(&ours, &c)?)?;
            reference.backward_step(&linear_loss(&theirs, &c)?)?;
            assert_eq!(bits(&ours)?, bits(&theirs)?, "{shape:?}, step {step}");
        }
    }
    Ok(())
}
test_device!(
    adamw_steps_bit_for_bit_like_candle_nn,
    adamw_steps_bit_for_bit_like_candle_nn_cpu,
    adamw_steps_bit_for_bit_like_candle_nn_cuda
);

#[test]
fn f64_parameters_take_the_tensor_path_in_f64() -> Result<()> {
    let (got, want) = adamw_run(&Device::Cpu, DType::F64, 50, 5)?;
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-14 * w.abs().max(1.0), "{g} vs {w}");
    }
    Ok(())
}

#[test]
fn bf16_parameters_are_updated_in_f32_with_f32_moments() -> Result<()> {
    // A bf16 parameter, lr 1e-2 and weights near 1: every update is under a bf16 ulp's size,
    // so where each step rounds matters. The reference keeps f64 moments and rounds the weight
    // to bf16 after every step: one rounding per step, as promised.
    let dev = Device::Cpu;
    let n = 200;
    let w0: Vec<bf16> = values(n, 9)
        .iter()
        .map(|&x| bf16::from_f32(1.0 + x))
        .collect();
    let w = Var::from_tensor(&candle_core::Tensor::from_vec(w0.clone(), n, &dev)?)?;
    let mut opt = AdamW::new(vec![w.clone()], params())?;
    let p = params();
    let mut reference: Vec<f64> = w0.iter().map(|x| f64::from(x.to_f32())).collect();
    let (mut m, mut v) = (vec![0f64; n], vec![0f64; n]);
    for step in 0..20u64 {
        // Large gradients first, then small ones: bf16 moments would stop decaying (0.999 v
        // rounds back to v in bf16); f32 ones keep following the reference.
        let scale = if step < 5 { 1.0 } else { 1e-3 };
        let c: Vec<bf16> = values(n, 300 + step)
            .iter()
            .map(|&x| bf16::from_f32(x * scale))
            .collect();
        opt.backward_step(&linear_loss(
            &w,
            &candle_core::Tensor::from_vec(c.clone(), n, &dev)?,
        )?)?;
        let t = (step + 1) as i32;
        for i in 0..n {
            let g = f64::from(c[i].to_f32());
            m[i] = p.beta1 * m[i] + (1.0 - p.beta1) * g;
            v[i] = p.beta2 * v[i] + (1.0 - p.beta2) * g * g;
            let (m_hat, v_hat) = (
                m[i] / (1.0 - p.beta1.powi(t)),
                v[i] / (1.0 - p.beta2.powi(t)),
            );
            let next = reference[i] * (1.0 - p.lr * p.weight_decay)
                - p.lr * m_hat / (v_hat.sqrt() + p.eps);
            reference[i] = f64::from(bf16::from_f64(next).to_f32());
        }
    }
    let got = w.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut off = 0;
    for (g, r) in got.iter().zip(&reference) {
        let ulp = f64::from(bf16::EPSILON.to_f32()) * r.abs();
        // f32 arithmetic can land a value on the other side of a bf16 rounding boundary.
        assert!((f64::from(*g) - r).abs() <= ulp, "{g} vs {r}");
        off += usize::from(f64::from(*g) != *r);
    }
    assert!(off <= n / 20, "{off} of {n} values off the reference");
    Ok(())
}

#[test]
fn adamw_counts_steps_per_parameter_as_pytorch() -> Result<()> {
    // `b` has no gradient at the first step; at the second it takes *its* first step, whose
    // size is lr * g / (|g| + eps) (bias-corrected moments g and g^2), after decay.
    let dev = Device::Cpu;
    let (a, b) = (var(&[4], 1, &dev)?, var(&[4], 2, &dev)?);
    let b0 = b.to_vec1::<f32>()?;
    let mut opt = AdamW::new(vec![a.clone(), b.clone()], params())?;
    let g = candle_core::Tensor::new(&[0.5f32, -2.0, 3.0, -0.25], &dev)?;
    opt.backward_step(&linear_loss(&a, &g)?)?;
    assert_eq!(b.to_vec1::<f32>()?, b0, "no gradient, no step");
    opt.backward_step(&(linear_loss(&a, &g)? + linear_loss(&b, &g)?)?)?;
    let p = params();
    for ((got, w), g) in b.to_vec1::<f32>()?.iter().zip(&b0).zip(g.to_vec1::<f32>()?) {
        let (w, g) = (f64::from(*w), f64::from(g));
        let want = w * (1.0 - p.lr * p.weight_decay) - p.lr * g / (g.abs() + p.eps);
        assert!((f64::from(*got) - want).abs() < 1e-6, "{got} vs {want}");
    }
    Ok(())
}

#[test]
fn a_skipped_scaler_step_leaves_weights_and_moments_untouched() -> Result<()> {
    let dev = Device::Cpu;
    let w = var(&[5], 3, &dev)?;
    let w0 = bits(&w)?;
    let mut opt = AdamW::new(vec![w.clone()], params())?;
    let mut scaler = GradScaler::new();
    let bad = candle_core::Tensor::new(&[1f32, f32::INFINITY, 0.0, 1.0, 1.0], &dev)?;
    let grads = scaler.scale(&linear_loss(&w, &bad)?)?.backward()?;
    assert!(scaler.step(&mut opt, grads)?.is_skipped());
    scaler.update()?;
    assert_eq!(bits(&w)?, w0);
    // The next step is the parameter's first: lr * g / |g| after decay, as if the skip never
    // happened (a counted step would shrink it by the t = 2 bias corrections).
    let g = candle_core::Tensor::new(&[1f32, -1.0, 2.0, -0.5, 0.25], &dev)?;
    let grads = scaler.scale(&linear_loss(&w, &g)?)?.backward()?;
    assert!(scaler.step(&mut opt, grads)?.is_stepped());
    let p = params();
    let start: Vec<f32> = w0.iter().map(|&b| f32::from_bits(b)).collect();
    for ((got, w), g) in w
        .to_vec1::<f32>()?
        .iter()
        .zip(start)
        .zip(g.to_vec1::<f32>()?)
    {
        let (w, g) = (f64::from(w), f64::from(g));
        let want = w * (1.0 - p.lr * p.weight_decay) - p.lr * g.signum();
        assert!((f64::from(*got) - want).abs() < 1e-6, "{got} vs {want}");
    }
    Ok(())
}

/// An optimizer built before the model's layers, from a `VarMap` still empty, has nothing to
/// update: PyTorch refuses it ("optimizer got an empty parameter list"). Here it may be built
/// (candle-nn's `SGD` may be built empty and given variables by `push`), but a step, direct or
/// through the scaler, is an error, where it stepped nothing and the scaler said `Stepped`; once
/// pushed a variable, the SGD steps it.
#[test]
fn an_optimizer_without_variables_refuses_to_step() -> Result<()> {
    let dev = Device::Cpu;
    let map = candle_nn::VarMap::new();
    let mut sgd = SGD::new(map.all_vars(), 0.1)?;
    let mut adamw = AdamW::new(map.all_vars(), params())?;
    let _ = candle_nn::linear(
        3,
        2,
        candle_nn::VarBuilder::from_varmap(&map, DType::F32, &dev),
    )?;
    let w = map
        .all_vars()
        .into_iter()
        .find(|v| v.rank() == 2)
        .expect("the weight");
    let c = candle_core::Tensor::ones(w.dims(), DType::F32, &dev)?;
    let mut scaler = GradScaler::new();
    for (name, err) in [
        (
            "SGD",
            scaler.step(&mut sgd, scaler.scale(&linear_loss(&w, &c)?)?.backward()?),
        ),
        (
            "AdamW",
            scaler.step(&mut adamw, scaler.scale(&linear_loss(&w, &c)?)?.backward()?),
        ),
    ] {
        let e = err.expect_err("an optimizer without variables").to_string();
        assert!(
            e.contains(name) && e.contains("no variables to update"),
            "{e}"
        );
    }
    let grads = linear_loss(&w, &c)?.backward()?;
    assert!(adamw.step(&grads).is_err() && sgd.step(&grads).is_err());
    let ints = Var::new(&[1u32, 2], &dev)?;
    assert!(SGD::new(vec![ints], 0.1)?.step(&grads).is_err());
    let before = w.to_vec2::<f32>()?;
    sgd.push(&w);
    sgd.step(&grads)?;
    assert!(
        w.to_vec2::<f32>()? != before,
        "a pushed variable is stepped"
    );
    Ok(())
}

// ---- A loop written in one region body sees each step's weights. ----

/// An epoch whose forward is written in the region's own body, on a master weight used as it is
/// (its bf16 cast is cached for the body), the step taken directly on the optimizer (no
/// scaler): the step itself must drop the cached cast.
#[autocast(bf16)]
fn epoch_in_one_body(
    w: &Tensor<F32>,
    opt: &mut SGD,
    batches: &[(Tensor<F32>, Tensor<F32>)],
) -> Result<Vec<f32>> {
    let mut losses = Vec::new();
    for (x, y) in batches {
        let l = loss::mse(&x.matmul(w)?, y)?;
        opt.backward_step(&l)?;
        losses.push(l.to_scalar()?);
    }
    Ok(losses)
}

/// One batch as its own region: the reference.
#[autocast(bf16)]
fn one_batch(w: &Tensor<F32>, opt: &mut SGD, x: &Tensor<F32>, y: &Tensor<F32>) -> Result<f32> {
    let l = loss::mse(&x.matmul(w)?, y)?;
    opt.backward_step(&l)?;
    l.to_scalar()
}

#[test]
fn a_step_inside_a_region_body_drops_the_stale_weight_casts() -> Result<()> {
    let dev = Device::Cpu;
    let run = |in_one_body: bool| -> Result<Vec<f32>> {
        let master = var(&[6, 3], 4, &dev)?;
        let w = Tensor::<F32>::from_candle(master.as_tensor().clone())?;
        let mut opt = SGD::new(vec![master], 0.5)?;
        let batches: Vec<_> = (0..4u64)
            .map(|i| {
                Ok((
                    Tensor::<F32>::from_candle(tensor(&[8, 6], 40 + i, &dev)?)?,
                    Tensor::<F32>::from_candle(tensor(&[8, 3], 50 + i, &dev)?)?,
                ))
            })
            .collect::<Result<_>>()?;
        if in_one_body {
            epoch_in_one_body(&w, &mut opt, &batches)
        } else {
            batches
                .iter()
                .map(|(x, y)| one_batch(&w, &mut opt, x, y))
                .collect()
        }
    };
    let reference = run(false)?;
    assert_eq!(run(true)?, reference);
    assert!(
        reference.windows(2).all(|w| (w[0] - w[1]).abs() > 1e-3),
        "the weights move between batches: {reference:?}"
    );
    Ok(())
}

/// A step refused for a gradient of another dtype than its parameter (here `u32`) changes
/// nothing: the next good step is a fresh optimizer's first (the refused one had counted a
/// step, so AdamW's bias correction was one step ahead). PyTorch refuses such a gradient when
/// it is assigned.
#[test]
fn a_refused_step_leaves_the_optimizer_as_it_was() -> Result<()> {
    let run = |refused_first: bool| -> Result<Vec<f32>> {
        let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
        if refused_first {
            let mut bad = candle_core::backprop::GradStore::default();
            bad.insert(
                w.as_tensor(),
                candle_core::Tensor::new(&[1u32, 1], &Device::Cpu)?,
            );
            let err = opt.step(&bad).expect_err("a u32 gradient").to_string();
            assert!(err.contains("a U32 gradient for a F32 parameter"), "{err}");
            assert_eq!(w.as_tensor().to_vec1::<f32>()?, [1.0, 2.0]);
        }
        let g = (w.as_tensor() * 3.0)?.sum_all()?.backward()?;
        opt.step(&g)?;
        w.as_tensor().to_vec1::<f32>()
    };
    let (after_refusal, fresh) = (run(true)?, run(false)?);
    assert_eq!(
        after_refusal
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        fresh.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    Ok(())
}
