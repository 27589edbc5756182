//! Checkpoints resume a run bit for bit: N steps, save, a fresh model, optimizer and scaler
//! loaded from the file, M more steps end where N + M uninterrupted steps end, in f32, bf16 and
//! fp16 (whose scaler skips steps and grows its scale on the way). Bad files are errors naming
//! the entry, with nothing written.

use candle_amp::checkpoint;
use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW, SGD};
use candle_amp::{autocast, GradScaler};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, VarBuilder, VarMap};

mod common;

fn dev() -> Device {
    Device::Cpu
}

struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

#[autocast]
impl Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(xs)?.relu()?;
        self.fc2.forward(&h)
    }
}

#[derive(Clone, Copy, Debug)]
enum Mode {
    F32,
    Bf16,
    Fp16,
}

#[autocast(bf16)]
fn loss_bf16(m: &Mlp, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    candle_nn::loss::mse(&m.forward(x)?, y)
}

#[autocast(fp16)]
fn loss_fp16(m: &Mlp, x: &Tensor, y: &Tensor) -> Result<Tensor> {
    candle_nn::loss::mse(&m.forward(x)?, y)
}

/// A model, an AdamW and a scaler (on in fp16: a first scale that overflows, so that the run
/// skips steps, and a short growth interval, so that the scale also grows), with weights drawn
/// from a fixed seed.
fn fresh(mode: Mode) -> Result<(VarMap, Mlp, AdamW, GradScaler)> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let m = Mlp {
        fc1: candle_nn::linear(8, 16, vb.pp("fc1"))?,
        fc2: candle_nn::linear(16, 4, vb.pp("fc2"))?,
    };
    for (seed, var) in (1u64..).zip(sorted(&vars)) {
        let values = common::values(var.elem_count(), seed);
        var.set(&Tensor::from_vec(values, var.shape(), &dev())?)?;
    }
    let opt = AdamW::new(
        vars.all_vars(),
        ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        },
    )?;
    let scaler = GradScaler::builder()
        .enabled(matches!(mode, Mode::Fp16))
        .init_scale(2f64.powi(40))
        .growth_interval(2)
        .build()?;
    Ok((vars, m, opt, scaler))
}

fn sorted(vars: &VarMap) -> Vec<candle_core::Var> {
    let data = vars.data().lock().unwrap();
    let mut named: Vec<_> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named.into_iter().map(|(_, v)| v.clone()).collect()
}

/// Training steps `range` (each its own batch, by the step's number): the losses.
fn train(
    mode: Mode,
    (m, opt, scaler): (&Mlp, &mut AdamW, &mut GradScaler),
    range: std::ops::Range<u64>,
) -> Result<Vec<f32>> {
    range
        .map(|step| {
            let x = Tensor::from_vec(common::values(32 * 8, 100 + step), (32, 8), &dev())?;
            let y = Tensor::from_vec(common::values(32 * 4, 200 + step), (32, 4), &dev())?;
            let loss = match mode {
                Mode::F32 => candle_nn::loss::mse(&m.forward(&x)?, &y)?,
                Mode::Bf16 => loss_bf16(m, &x, &y)?,
                Mode::Fp16 => loss_fp16(m, &x, &y)?,
            };
            let grads = scaler.scale(&loss)?.backward()?;
            let _ = scaler.step(opt, grads)?;
            scaler.update()?;
            loss.to_scalar::<f32>()
        })
        .collect()
}

fn bits(vars: &VarMap) -> Result<Vec<Vec<u32>>> {
    sorted(vars)
        .iter()
        .map(|v| {
            let values = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            Ok(values.iter().map(|x| x.to_bits()).collect())
        })
        .collect()
}

fn path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "candle-amp-{}-{name}.safetensors",
        std::process::id()
    ))
}

#[test]
fn a_resumed_run_matches_the_uninterrupted_run_bit_for_bit() -> Result<()> {
    for mode in [Mode::F32, Mode::Bf16, Mode::Fp16] {
        let (vars, m, mut opt, mut scaler) = fresh(mode)?;
        let whole = train(mode, (&m, &mut opt, &mut scaler), 0..12)?;
        let file = path(&format!("{mode:?}"));

        let (vars_a, m_a, mut opt_a, mut scaler_a) = fresh(mode)?;
        let first = train(mode, (&m_a, &mut opt_a, &mut scaler_a), 0..6)?;
        checkpoint::save(&file, &vars_a, &opt_a, &scaler_a, 6)?;
        drop((vars_a, m_a, opt_a, scaler_a));

        let (vars_b, m_b, mut opt_b, mut scaler_b) = fresh(mode)?;
        // Start elsewhere, to be sure the load, not the seed, puts the weights back.
        for var in sorted(&vars_b) {
            var.set(&var.as_tensor().zeros_like()?)?;
        }
        let step = checkpoint::load(&file, &vars_b, &mut opt_b, &mut scaler_b)?;
        assert_eq!(step, 6);
        let rest = train(mode, (&m_b, &mut opt_b, &mut scaler_b), 6..12)?;

        let resumed: Vec<u32> = first.iter().chain(&rest).map(|l| l.to_bits()).collect();
        let whole_bits: Vec<u32> = whole.iter().map(|l| l.to_bits()).collect();
        assert_eq!(resumed, whole_bits, "{mode:?}: losses");
        assert_eq!(bits(&vars_b)?, bits(&vars)?, "{mode:?}: weights");
        assert_eq!(scaler_b.state(), scaler.state(), "{mode:?}: scaler");
        if matches!(mode, Mode::Fp16) {
            let state = scaler.state();
            assert!(
                state.skipped_steps > 0,
                "the fp16 run skipped steps: {state:?}"
            );
        }
        std::fs::remove_file(&file).ok();
    }
    Ok(())
}

/// The optimizer's hyper-parameters resume as they were when the file was saved, as PyTorch's
/// `load_state_dict` restores its `param_groups`: a learning rate and a weight decay changed
/// mid-run (a schedule) came back as the program built them at start-up, and the resumed run
/// drifted from the uninterrupted one (sweep 15: every weight differed after 6 more steps).
#[test]
fn a_changed_learning_rate_and_weight_decay_resume_as_saved() -> Result<()> {
    let schedule = |opt: &mut AdamW, step: u64| {
        if step == 3 {
            opt.set_learning_rate(5e-2);
            opt.set_params(ParamsAdamW {
                weight_decay: 0.5,
                ..*opt.params()
            });
        }
    };
    let run = |opt: &mut AdamW, m: &Mlp, scaler: &mut GradScaler, range: std::ops::Range<u64>| {
        for step in range {
            schedule(opt, step);
            train(Mode::F32, (m, &mut *opt, &mut *scaler), step..step + 1)?;
        }
        Ok::<_, candle_core::Error>(())
    };
    let (vars, m, mut opt, mut scaler) = fresh(Mode::F32)?;
    run(&mut opt, &m, &mut scaler, 0..10)?;

    let file = path("hyper");
    let (vars_a, m_a, mut opt_a, mut scaler_a) = fresh(Mode::F32)?;
    run(&mut opt_a, &m_a, &mut scaler_a, 0..6)?;
    checkpoint::save(&file, &vars_a, &opt_a, &scaler_a, 6)?;
    let (vars_b, m_b, mut opt_b, mut scaler_b) = fresh(Mode::F32)?;
    checkpoint::load(&file, &vars_b, &mut opt_b, &mut scaler_b)?;
    assert_eq!(opt_b.learning_rate().to_bits(), 5e-2f64.to_bits());
    assert_eq!(opt_b.params().weight_decay.to_bits(), 0.5f64.to_bits());
    run(&mut opt_b, &m_b, &mut scaler_b, 6..10)?;
    assert_eq!(bits(&vars_b)?, bits(&vars)?, "weights");

    // A saved rate out of range is refused, naming it, before anything is written.
    let mut tensors = candle_core::safetensors::load(&file, &dev())?;
    tensors.insert("optimizer.lr".into(), Tensor::new(f64::NAN, &dev())?);
    candle_core::safetensors::save(&tensors, &file)?;
    let (vars_c, _m_c, mut opt_c, mut scaler_c) = fresh(Mode::F32)?;
    let before = bits(&vars_c)?;
    let err = checkpoint::load(&file, &vars_c, &mut opt_c, &mut scaler_c)
        .expect_err("a NaN learning rate")
        .to_string();
    assert!(err.contains("invalid learning rate NaN"), "{err}");
    assert_eq!(bits(&vars_c)?, before, "nothing written");
    std::fs::remove_file(&file).ok();
    Ok(())
}

#[test]
fn a_bad_checkpoint_names_the_entry_and_writes_nothing() -> Result<()> {
    let (vars, m, mut opt, mut scaler) = fresh(Mode::F32)?;
    train(Mode::F32, (&m, &mut opt, &mut scaler), 0..2)?;
    let file = path("bad");
    checkpoint::save(&file, &vars, &opt, &scaler, 2)?;
    let err = |e: candle_core::Error| e.to_string();

    // Another model: a variable the file lacks.
    let other = VarMap::new();
    let vb = VarBuilder::from_varmap(&other, DType::F32, &dev());
    let _ = candle_nn::linear(8, 16, vb.pp("fc1"))?;
    let _ = candle_nn::linear(16, 4, vb.pp("fc2"))?;
    let _ = candle_nn::linear(4, 4, vb.pp("fc3"))?;
    let before = bits(&other)?;
    let mut opt2 = AdamW::new(other.all_vars(), ParamsAdamW::default())?;
    let e = err(checkpoint::load(&file, &other, &mut opt2, &mut GradScaler::new()).unwrap_err());
    assert!(
        e.contains("no `model.fc3.weight`") || e.contains("no `model.fc3.bias`"),
        "{e}"
    );
    assert_eq!(bits(&other)?, before, "nothing written");

    // Another optimizer: AdamW's state where SGD keeps none is an unexpected entry.
    let (vars3, _, _, mut scaler3) = fresh(Mode::F32)?;
    let before = bits(&vars3)?;
    let mut sgd = SGD::new(vars3.all_vars(), 0.1)?;
    let e = err(checkpoint::load(&file, &vars3, &mut sgd, &mut scaler3).unwrap_err());
    assert!(e.contains("unexpected entry `optim.fc1.bias.m`"), "{e}");
    assert_eq!(bits(&vars3)?, before, "nothing written");

    // An optimizer holding other variables than the saved one: SGD has no per-variable state
    // that would tell, and the variable it lacks (or was `push`ed after the save) would be
    // left untrained without a word. PyTorch refuses a parameter group of another size.
    let (vars5, _, _, mut scaler5) = fresh(Mode::F32)?;
    let all = sorted(&vars5);
    let file5 = path("sgd_vars");
    checkpoint::save(&file5, &vars5, &SGD::new(all.clone(), 0.1)?, &scaler5, 1)?;
    let before = bits(&vars5)?;
    let mut fewer = SGD::new(all[1..].to_vec(), 0.1)?;
    let e = err(checkpoint::load(&file5, &vars5, &mut fewer, &mut scaler5).unwrap_err());
    assert!(e.contains("saved only: `fc1.bias`; held only: none"), "{e}");
    assert_eq!(bits(&vars5)?, before, "nothing written");
    let mut same = SGD::new(all, 0.1)?;
    assert_eq!(
        checkpoint::load(&file5, &vars5, &mut same, &mut scaler5)?,
        1
    );
    std::fs::remove_file(&file5).ok();

    // A variable of another shape.
    let wide = VarMap::new();
    let vb = VarBuilder::from_varmap(&wide, DType::F32, &dev());
    let _ = candle_nn::linear(8, 32, vb.pp("fc1"))?;
    let _ = candle_nn::linear(32, 4, vb.pp("fc2"))?;
    let mut opt4 = AdamW::new(wide.all_vars(), ParamsAdamW::default())?;
    let e = err(checkpoint::load(&file, &wide, &mut opt4, &mut GradScaler::new()).unwrap_err());
    assert!(e.contains("`model.fc1.bias`") && e.contains("[32]"), "{e}");

    // Not a checkpoint.
    std::fs::write(&file, b"not safetensors")?;
    let e = err(checkpoint::load(&file, &vars, &mut opt, &mut scaler).unwrap_err());
    assert!(e.contains(&file.display().to_string()), "{e}");
    std::fs::remove_file(&file).ok();
    Ok(())
}
