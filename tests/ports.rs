//! Ports of candle code: models written as candle and candle-transformers write theirs, made
//! mixed precision by `#[autocast]` lines and one import (`tests/ports/`). Each trains in f32,
//! bf16 and fp16 (with the GradScaler), each op runs in its class's precision, and called from
//! plain code a ported model is the f32 program it was.

extern crate candle_core as candle;

// The ports import candle-nn's `Module` as candle code does for `layer.forward(..)`; in a
// region those calls are module calls, which do not name the trait. The tests use a part of
// each model's configuration, and the files keep candle-transformers' style, not these lints.
#[allow(unused_imports, dead_code, clippy::pedantic)]
#[path = "ports/decoder.rs"]
mod decoder;
#[allow(unused_imports, dead_code, clippy::pedantic)]
#[path = "ports/encoder.rs"]
mod encoder;
#[allow(unused_imports, dead_code, clippy::pedantic)]
#[path = "ports/mnist.rs"]
mod mnist;

mod common;

use candle_amp::report::{self, PrecisionReport};
use candle_amp::{autocast, GradScaler, OpClass};
use candle_core::{DType, Device, IndexOp, Result, Tensor, Var, D};
use candle_nn::{Module, Optimizer, VarBuilder, VarMap, SGD};
use mnist::Model;

fn dev() -> Device {
    Device::Cpu
}

/// The three ways a training step runs: plain f32, and the two autocast policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    F32,
    Bf16,
    Fp16,
}

const MODES: [Mode; 3] = [Mode::F32, Mode::Bf16, Mode::Fp16];

/// `$body` (an expression over `$args`) as three functions: plain (`$f32`), and in an
/// `#[autocast(bf16)]` and an `#[autocast(fp16)]` region, as PyTorch's `with autocast():`
/// around the forward and the loss; and `$name(mode, ..)`, the one of `mode`.
macro_rules! in_each_mode {
    (
        $name:ident: $f32:ident, $bf16:ident, $fp16:ident,
        ($($arg:ident: $ty:ty),*) -> $ret:ty $body:block
    ) => {
        fn $f32($($arg: $ty),*) -> Result<$ret> $body

        #[autocast(bf16)]
        fn $bf16($($arg: $ty),*) -> Result<$ret> $body

        #[autocast(fp16)]
        fn $fp16($($arg: $ty),*) -> Result<$ret> $body

        #[allow(dead_code)] // not every test picks its mode at run time
        fn $name(mode: Mode, $($arg: $ty),*) -> Result<$ret> {
            match mode {
                Mode::F32 => $f32($($arg),*),
                Mode::Bf16 => $bf16($($arg),*),
                Mode::Fp16 => $fp16($($arg),*),
            }
        }
    };
}

/// Every variable's value, drawn again from a fixed seed (uniform, with the spread of its
/// random initialisation; constant ones, such as norms' scales, kept), so that each run starts
/// from the same weights; and a copy of them, to start each mode there.
fn snapshot(vars: &VarMap) -> Vec<(Var, Tensor)> {
    let data = vars.data().lock().unwrap();
    let mut named: Vec<_> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named
        .into_iter()
        .zip(1u64..)
        .map(|((_, var), seed)| {
            let t = var.as_tensor();
            let std = t
                .flatten_all()
                .and_then(|f| f.var_keepdim(0))
                .and_then(|v| v.sqrt()?.squeeze(0)?.to_scalar::<f32>());
            let std = std.unwrap_or(0.0);
            if std > 0.0 {
                let u: Vec<f32> = common::values(t.elem_count(), seed)
                    .iter()
                    .map(|v| v * std * 3f32.sqrt())
                    .collect();
                var.set(&Tensor::from_vec(u, t.shape(), t.device()).unwrap())
                    .unwrap();
            }
            (var.clone(), var.as_tensor().copy().unwrap())
        })
        .collect()
}

fn restore(init: &[(Var, Tensor)]) -> Result<()> {
    for (var, value) in init {
        var.set(value)?;
    }
    Ok(())
}

/// One optimizer step on `loss` (f32): through a GradScaler in fp16, plainly otherwise.
fn step(mode: Mode, loss: &Tensor, opt: &mut SGD, scaler: &mut GradScaler) -> Result<f32> {
    if mode == Mode::Fp16 {
        let grads = scaler.scale(loss)?.backward()?;
        let _ = scaler.step(opt, grads)?;
        scaler.update()?;
    } else {
        opt.backward_step(loss)?;
    }
    loss.to_scalar::<f32>()
}

/// The mean of a run's last five losses.
fn tail_mean(losses: &[f32]) -> f32 {
    let tail = &losses[losses.len() - 5..];
    tail.iter().sum::<f32>() / tail.len() as f32
}

/// `runs` (one per mode of [`MODES`], f32 first): each learned (its last losses below `drop`
/// times its first), and each half mode ended within 10% of f32's final loss.
fn assert_learns_as_f32_does(what: &str, runs: &[Vec<f32>], drop: f32) {
    let finals: Vec<f32> = runs.iter().map(|losses| tail_mean(losses)).collect();
    for ((mode, losses), last) in MODES.iter().zip(runs).zip(&finals) {
        assert!(
            losses.iter().all(|l| l.is_finite()),
            "{what} {mode:?}: {losses:?}"
        );
        assert!(
            *last < drop * losses[0],
            "{what} {mode:?} did not learn: {losses:?}"
        );
        let gap = (last - finals[0]).abs() / finals[0];
        assert!(
            gap < 0.1,
            "{what} {mode:?}: final loss {last} against f32's {}",
            finals[0]
        );
    }
}

// ---- The decoder (candle-transformers' GPT-BigCode shape). ----

fn decoder_config(use_cache: bool) -> decoder::Config {
    decoder::Config {
        vocab_size: 16,
        max_position_embeddings: 16,
        num_hidden_layers: 2,
        hidden_size: 32,
        layer_norm_epsilon: 1e-5,
        n_inner: None,
        num_attention_heads: 4,
        multi_query: true,
        use_cache,
    }
}

/// Sequences counting up by a per-row stride modulo the vocabulary, and each next id: a task a
/// small decoder learns in a few dozen steps.
fn counting(batch: usize, len: usize) -> Result<(Tensor, Tensor)> {
    let rows: Vec<Vec<u32>> = (0..batch)
        .map(|b| (0..=len).map(|i| ((b + 1) * i % 16) as u32).collect())
        .collect();
    let ids: Vec<u32> = rows.iter().flat_map(|r| r[..len].to_vec()).collect();
    let next: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    Ok((
        Tensor::from_vec(ids, (batch, len), &dev())?,
        Tensor::from_vec(next, (batch, len), &dev())?,
    ))
}

in_each_mode!(decoder_loss: decoder_loss_f32, decoder_loss_bf16, decoder_loss_fp16,
    (m: &mut decoder::Decoder, ids: &Tensor, next: &Tensor) -> Tensor {
        let logits = m.forward(ids, 0)?;
        let (b, t, v) = logits.dims3()?;
        candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, &next.reshape(b * t)?)
    }
);

#[test]
fn the_decoder_port_trains_in_each_mode_as_f32_does() -> Result<()> {
    let vars = VarMap::new();
    let mut m = decoder::Decoder::load(
        VarBuilder::from_varmap(&vars, DType::F32, &dev()),
        decoder_config(false),
    )?;
    let init = snapshot(&vars);
    let (ids, next) = counting(8, 12)?;
    let mut runs = Vec::new();
    for mode in MODES {
        restore(&init)?;
        let mut opt = SGD::new(vars.all_vars(), 0.5)?;
        let mut scaler = GradScaler::builder().init_scale(1024.0).build()?;
        let mut losses = Vec::new();
        for _ in 0..40 {
            let loss = decoder_loss(mode, &mut m, &ids, &next)?;
            assert_eq!(loss.dtype(), DType::F32, "{mode:?}: the loss leaves in f32");
            losses.push(step(mode, &loss, &mut opt, &mut scaler)?);
        }
        runs.push(losses);
    }
    assert_learns_as_f32_does("decoder", &runs, 0.6);
    Ok(())
}

/// The ops of one step, by class: the precision report of the loss and its backward.
fn classes(report: &PrecisionReport) -> Vec<(&'static str, OpClass, DType)> {
    report
        .entries
        .iter()
        .map(|e| (e.op, e.class, e.output))
        .collect()
}

/// Every product in the policy's half dtype, every fp32-class op (softmax, layer norm, the
/// loss) in f32, and the ones the port's code names among them.
fn assert_classes(report: &PrecisionReport, lower: DType, named: &[&str]) {
    for (op, class, out) in classes(report) {
        match class {
            OpClass::LowerPrecision => assert_eq!(out, lower, "{op} in {report}"),
            OpClass::Fp32 => assert_eq!(out, DType::F32, "{op} in {report}"),
            OpClass::Promote | OpClass::Preserve => {}
        }
    }
    for op in named {
        assert!(report.op(op).next().is_some(), "no `{op}` in {report}");
    }
}

#[test]
fn the_decoder_ports_ops_run_in_their_class() -> Result<()> {
    let vars = VarMap::new();
    let mut m = decoder::Decoder::load(
        VarBuilder::from_varmap(&vars, DType::F32, &dev()),
        decoder_config(false),
    )?;
    let (ids, next) = counting(2, 6)?;
    let named = [
        "linear",
        "matmul",
        "softmax",
        "layer_norm",
        "cross_entropy",
        "cat",
    ];
    for (mode, lower) in [(Mode::Bf16, DType::BF16), (Mode::Fp16, DType::F16)] {
        let (loss, rep) = report::record(|| decoder_loss(mode, &mut m, &ids, &next));
        loss?;
        // No cache in training: `Tensor::cat` is the one of the cached run below.
        assert_classes(&rep, lower, &named[..5]);
        // The attention's `where_cond` with an f32 `-inf` fill promotes the half scores to f32.
        let fill = rep.op("where_cond").next().expect("where_cond");
        assert_eq!(fill.output, DType::F32, "{rep}");
    }
    Ok(())
}

in_each_mode!(decoder_logits: decoder_logits_f32, decoder_logits_bf16, decoder_logits_fp16,
    (m: &mut decoder::Decoder, ids: &Tensor, past: usize) -> Tensor {
        m.forward(ids, past)
    }
);

type Logits = fn(&mut decoder::Decoder, &Tensor, usize) -> Result<Tensor>;

/// Generation with the KV cache (a candle `Option<Tensor>` field grown with `Tensor::cat`)
/// gives the last position's logits of a full recompute, in f32 and in bf16.
#[test]
fn the_decoder_ports_kv_cache_matches_a_full_recompute() -> Result<()> {
    let vars = VarMap::new();
    let mut m = decoder::Decoder::load(
        VarBuilder::from_varmap(&vars, DType::F32, &dev()),
        decoder_config(true),
    )?;
    snapshot(&vars);
    let (ids, _) = counting(2, 6)?;
    for (logits, tol) in [
        (decoder_logits_f32 as Logits, 1e-5),
        (decoder_logits_bf16, 0.1),
        (decoder_logits_fp16, 0.02),
    ] {
        m.clear_cache();
        let full = logits(&mut m, &ids, 0)?.i((.., 5))?;
        m.clear_cache();
        let mut last = None;
        for t in 0..6 {
            last = Some(logits(&mut m, &ids.narrow(1, t, 1)?, t)?.i((.., 0))?);
        }
        let last = last.unwrap();
        assert_eq!(
            full.dtype(),
            DType::F32,
            "logits leave in the ids' absent float: f32"
        );
        let diff = (full - last)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < tol, "{diff}");
    }
    // The cache of a bf16 run holds bf16 keys and values, which the next step's join keeps.
    m.clear_cache();
    decoder_logits_bf16(&mut m, &ids.narrow(1, 0, 1)?, 0)?;
    let (logits, rep) = report::record(|| decoder_logits_bf16(&mut m, &ids.narrow(1, 1, 1)?, 1));
    logits?;
    assert_classes(&rep, DType::BF16, &["cat"]);
    let cat = rep.op("cat").next().expect("cat");
    assert_eq!(
        (cat.inputs.as_slice(), cat.output),
        ([DType::BF16; 2].as_slice(), DType::BF16)
    );
    // A cache filled in another precision does not mix silently: f16 keys with bf16 ones fail.
    m.clear_cache();
    decoder_logits_fp16(&mut m, &ids.narrow(1, 0, 1)?, 0)?;
    let err = decoder_logits_bf16(&mut m, &ids.narrow(1, 1, 1)?, 1).unwrap_err();
    assert!(err.to_string().contains("f16 and bf16"), "{err}");
    Ok(())
}

// ---- The encoder (candle-transformers' BERT shape, with its tracing wrappers). ----

fn encoder_config() -> encoder::Config {
    encoder::Config {
        vocab_size: 16,
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 64,
        hidden_act: encoder::HiddenAct::Gelu,
        max_position_embeddings: 16,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.1,
    }
}

/// A token-tagging head on the encoder, as a user's training code adds one.
struct Tagger {
    encoder: encoder::Encoder,
    head: candle_nn::Linear,
}

in_each_mode!(tagger_loss: tagger_loss_f32, tagger_loss_bf16, tagger_loss_fp16,
    (m: &Tagger, ids: &Tensor, mask: &Tensor, tags: &Tensor) -> Tensor {
        let types = ids.zeros_like()?;
        let hidden = m.encoder.forward(ids, &types, Some(mask))?;
        let logits = m.head.forward(&hidden)?;
        let (b, t, n) = logits.dims3()?;
        candle_nn::loss::cross_entropy(&logits.reshape((b * t, n))?, &tags.reshape(b * t)?)
    }
);

/// Ids, an attention mask hiding each row's last two tokens, and each token's tag: whether it
/// is larger than the token before it (the encoder must attend to learn it).
fn tagging(batch: usize, len: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let ids: Vec<u32> = common::values(batch * len, 3)
        .iter()
        .map(|v| ((v + 1.0) * 8.0) as u32 % 16)
        .collect();
    let tags: Vec<u32> = ids
        .chunks(len)
        .flat_map(|row| (0..len).map(move |i| u32::from(i > 0 && row[i] > row[i - 1])))
        .collect();
    let mask: Vec<u32> = (0..batch)
        .flat_map(|_| (0..len).map(|i| u32::from(i < len - 2)))
        .collect();
    Ok((
        Tensor::from_vec(ids, (batch, len), &dev())?,
        Tensor::from_vec(mask, (batch, len), &dev())?,
        Tensor::from_vec(tags, (batch, len), &dev())?,
    ))
}

#[test]
fn the_encoder_port_trains_in_each_mode_as_f32_does() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let m = Tagger {
        encoder: encoder::Encoder::load(vb.pp("bert"), &encoder_config())?,
        head: candle_nn::linear(32, 2, vb.pp("head"))?,
    };
    let init = snapshot(&vars);
    let (ids, mask, tags) = tagging(8, 10)?;
    let mut runs = Vec::new();
    for mode in MODES {
        restore(&init)?;
        let mut opt = SGD::new(vars.all_vars(), 0.1)?;
        let mut scaler = GradScaler::new();
        let mut losses = Vec::new();
        for _ in 0..40 {
            let loss = tagger_loss(mode, &m, &ids, &mask, &tags)?;
            losses.push(step(mode, &loss, &mut opt, &mut scaler)?);
        }
        runs.push(losses);
    }
    assert_learns_as_f32_does("encoder", &runs, 0.8);
    for (mode, lower) in [(Mode::Bf16, DType::BF16), (Mode::Fp16, DType::F16)] {
        let (loss, rep) = report::record(|| tagger_loss(mode, &m, &ids, &mask, &tags));
        loss?;
        assert_classes(
            &rep,
            lower,
            &["linear", "matmul", "softmax", "layer_norm", "gelu_erf"],
        );
    }
    Ok(())
}

// ---- The MNIST models. ----

/// Synthetic "images": 784 values per row, labelled by the largest of ten fixed projections,
/// so that a linear model can learn them.
fn images(n: usize) -> Result<(Tensor, Tensor)> {
    let x = Tensor::from_vec(
        common::values(n * mnist::IMAGE_DIM, 7),
        (n, mnist::IMAGE_DIM),
        &dev(),
    )?;
    let w = Tensor::from_vec(
        common::values(mnist::IMAGE_DIM * mnist::LABELS, 11),
        (mnist::IMAGE_DIM, mnist::LABELS),
        &dev(),
    )?;
    let labels = x.matmul(&w)?.argmax(D::Minus1)?;
    Ok((x, labels))
}

in_each_mode!(mnist_loss: mnist_loss_f32, mnist_loss_bf16, mnist_loss_fp16,
    (logits: &Tensor, labels: &Tensor) -> Tensor {
        let log_sm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
        candle_nn::loss::nll(&log_sm, labels)
    }
);

in_each_mode!(mlp_logits: mlp_logits_f32, mlp_logits_bf16, mlp_logits_fp16,
    (m: &mnist::Mlp, xs: &Tensor) -> Tensor {
        m.forward(xs)
    }
);

in_each_mode!(linear_logits: linear_logits_f32, linear_logits_bf16, linear_logits_fp16,
    (m: &mnist::LinearModel, xs: &Tensor) -> Tensor {
        m.forward(xs)
    }
);

in_each_mode!(conv_logits: conv_logits_f32, conv_logits_bf16, conv_logits_fp16,
    (m: &mnist::ConvNet, xs: &Tensor, train: bool) -> Tensor {
        m.forward(xs, train)
    }
);

/// A model of the example trained 30 steps in `mode` from `init`: its losses.
fn train_mnist(
    mode: Mode,
    vars: &VarMap,
    init: &[(Var, Tensor)],
    logits: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Vec<f32>> {
    restore(init)?;
    let (x, labels) = images(64)?;
    let mut opt = SGD::new(vars.all_vars(), 0.5)?;
    let mut scaler = GradScaler::new();
    (0..30)
        .map(|_| {
            let loss = mnist_loss(mode, &logits(&x)?, &labels)?;
            step(mode, &loss, &mut opt, &mut scaler)
        })
        .collect()
}

#[test]
fn the_mnist_linear_and_mlp_ports_train_in_each_mode_as_f32_does() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let linear = mnist::LinearModel::new(vb.pp("linear"))?;
    let mlp = mnist::Mlp::new(vb.pp("mlp"))?;
    let init = snapshot(&vars);
    for model in ["linear", "mlp"] {
        let mut runs = Vec::new();
        for mode in MODES {
            let losses = train_mnist(mode, &vars, &init, |x| match model {
                "linear" => linear_logits(mode, &linear, x),
                _ => mlp_logits(mode, &mlp, x),
            })?;
            runs.push(losses);
        }
        assert_learns_as_f32_does(model, &runs, 0.7);
    }
    Ok(())
}

#[test]
fn the_mnist_convnet_port_runs_its_convs_in_half_and_its_loss_in_f32() -> Result<()> {
    let vars = VarMap::new();
    let net = mnist::ConvNet::new(VarBuilder::from_varmap(&vars, DType::F32, &dev()))?;
    let (x, labels) = images(4)?;
    for (mode, lower) in [(Mode::Bf16, DType::BF16), (Mode::Fp16, DType::F16)] {
        let (loss, rep) = report::record(|| -> Result<Tensor> {
            mnist_loss(mode, &conv_logits(mode, &net, &x, true)?, &labels)
        });
        let loss = loss?;
        assert_eq!(loss.dtype(), DType::F32);
        assert_classes(
            &rep,
            lower,
            &["conv2d", "linear", "max_pool2d", "log_softmax", "nll"],
        );
        let grads = loss.backward()?;
        for var in vars.all_vars() {
            let g = grads.get(&var).expect("every parameter gets a gradient");
            assert_eq!(g.dtype(), DType::F32);
            assert!(g
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .all(|v| v.is_finite()));
        }
    }
    // Evaluation (no dropout) from plain code: the f32 program, in f32.
    let plain = net.forward(&x, false)?;
    assert_eq!(plain.dtype(), DType::F32);
    assert_eq!(
        conv_logits_f32(&net, &x, false)?.to_vec2::<f32>()?,
        plain.to_vec2::<f32>()?
    );
    Ok(())
}

/// Called from plain f32 code, a ported model is the f32 program it was: no cast, f32 out, the
/// same values as the same layers called by hand.
#[test]
fn a_ported_model_called_from_plain_code_is_the_f32_program() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let mlp = mnist::Mlp::new(vb.pp("mlp"))?;
    let (x, _) = images(8)?;
    let casts = candle_amp::cast_count();
    let y = mlp.forward(&x)?;
    assert_eq!(candle_amp::cast_count(), casts, "no cast");
    assert_eq!(y.dtype(), DType::F32);
    let data = vars.data().lock().unwrap();
    let (w1, b1) = (
        data["mlp.ln1.weight"].as_tensor(),
        data["mlp.ln1.bias"].as_tensor(),
    );
    let (w2, b2) = (
        data["mlp.ln2.weight"].as_tensor(),
        data["mlp.ln2.bias"].as_tensor(),
    );
    let h = x.matmul(&w1.t()?)?.broadcast_add(b1)?.relu()?;
    let want = h.matmul(&w2.t()?)?.broadcast_add(b2)?;
    let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-5, "{diff}");
    // A bf16 region hands the logits back in bf16 inside it, in f32 to plain code.
    assert_eq!(mlp_logits_bf16(&mlp, &x)?.dtype(), DType::F32);
    Ok(())
}

/// The port files hold candle code, the `#[autocast]` lines and one import: nothing else of
/// candle-amp's (no typed tensor, no `AmpTensor`, no cast).
#[test]
fn the_ports_add_only_attributes_and_one_import() {
    for (file, src) in [
        ("decoder.rs", include_str!("ports/decoder.rs")),
        ("encoder.rs", include_str!("ports/encoder.rs")),
        ("mnist.rs", include_str!("ports/mnist.rs")),
    ] {
        let amp: Vec<&str> = src
            .lines()
            .filter(|l| l.contains("candle_amp") || l.contains("autocast"))
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect();
        assert!(
            amp.iter()
                .all(|l| l.trim() == "#[autocast]" || l.trim() == "use candle_amp::autocast;"),
            "{file}: {amp:?}"
        );
        assert_eq!(
            amp.iter().filter(|l| l.contains("use ")).count(),
            1,
            "{file}"
        );
        for word in ["AmpTensor", "Tensor<", ".cast::<", "as_candle"] {
            assert!(!src.contains(word), "{file} mentions {word}");
        }
    }
}
