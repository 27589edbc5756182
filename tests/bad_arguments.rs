//! Arguments and shapes a user gets wrong are errors that say what is wrong: never a panic,
//! never a silent wrong result. Each case below was a panic or a silent result before, and
//! each is checked on every path that reaches its check: the typed op, the op in a region, the
//! layer's constructor, candle-nn's layer in a region.
//!
//! The expectations are PyTorch's (its constructors and ops reject these arguments, mostly
//! with the same wording), and where PyTorch lets a value through that corrupts training (a
//! NaN learning rate, a NaN dropout probability), an error here too.

use candle_amp::nn::{self, Conv1dConfig, Conv2dConfig};
use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW, SGD};
use candle_amp::{autocast, Tensor, BF16, F16, F32};
use candle_core::{DType, Device, Result, Var};
use candle_nn::{VarBuilder, VarMap};

fn dev() -> Device {
    Device::Cpu
}

/// The error's message, or a failure naming what was wrongly accepted.
fn message<T>(what: &str, r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("{what}: accepted, expected an error"),
        Err(e) => e.to_string(),
    }
}

fn assert_err<T>(what: &str, r: Result<T>, expected: &str) {
    let msg = message(what, r);
    assert!(
        msg.contains(expected),
        "{what}: the error should say `{expected}`, said: {msg}"
    );
}

fn image<P: candle_amp::Precision>(dims: (usize, usize, usize, usize)) -> Result<Tensor<P>> {
    Tensor::<F32>::randn(0.0, 1.0, dims, &dev())?.cast::<P>()
}

// ---- Convolution geometry: checked before candle sees it. ----

/// candle divides by the stride and the dilation (a panic at 0), answers a kernel larger
/// than the input with sizes that wrapped around (`usize::MAX`), a zero dilation with each
/// output its own pixel times the kernel's sum, an empty kernel with zeros.
fn conv_geometry_is_checked<P: candle_amp::Precision>() -> Result<()> {
    let x = image::<P>((1, 2, 3, 3))?;
    let k = image::<P>((2, 2, 3, 3))?;
    assert_err(
        "stride 0",
        x.conv2d(&k, 0, 0, 1, 1),
        "stride must be positive",
    );
    assert_err(
        "dilation 0",
        x.conv2d(&k, 0, 1, 0, 1),
        "dilation must be positive",
    );
    assert_err(
        "groups 0",
        x.conv2d(&k, 0, 1, 1, 0),
        "groups must be positive",
    );
    let big = image::<P>((2, 2, 5, 5))?;
    assert_err(
        "5x5 kernel on 3x3",
        x.conv2d(&big, 0, 1, 1, 1),
        "no output position",
    );
    // With padding 1 the 5x5 kernel fits (output 1x1), as in PyTorch.
    assert_eq!(x.conv2d(&big, 1, 1, 1, 1)?.dims(), [1, 2, 1, 1]);
    let x1 = image::<P>((1, 1, 3, 3))?;
    let empty = Tensor::<F32>::zeros((2, 1, 0, 0), &dev())?.cast::<P>()?;
    assert_err("an empty kernel", x1.conv2d(&empty, 0, 1, 1, 1), "size 0");
    let k3 = image::<P>((2, 3, 3, 3))?;
    assert_err(
        "channels",
        x.conv2d(&k3, 1, 1, 1, 1),
        "the input has 2 channels",
    );
    let line = Tensor::<F32>::randn(0.0, 1.0, (1, 2, 4), &dev())?.cast::<P>()?;
    let k1 = Tensor::<F32>::randn(0.0, 1.0, (2, 2, 5), &dev())?.cast::<P>()?;
    assert_err(
        "conv1d stride 0",
        line.conv1d(&k1, 2, 0, 1, 1),
        "stride must be positive",
    );
    assert_err(
        "conv1d too long",
        line.conv1d(&k1, 0, 1, 1, 1),
        "conv1d: the kernel spans 5",
    );
    // Arguments near `usize::MAX` overflowed the check itself (a panic), or passed it with an
    // output no allocation can hold (a capacity overflow's panic).
    let huge = usize::MAX / 2;
    let small = image::<P>((2, 2, 3, 3))?;
    assert_err(
        "padding near usize::MAX",
        x.conv2d(&small, huge, 1, 1, 1),
        "too large to allocate",
    );
    assert_err(
        "dilation usize::MAX",
        x.conv2d(&small, 0, 1, usize::MAX, 1),
        "no output position",
    );
    assert_err(
        "padding 2^62",
        line.conv1d(&k1, 1 << 62, 1, 1, 1),
        "too large to allocate",
    );
    assert_err(
        "groups usize::MAX",
        x.conv2d(&k, 0, 1, 1, usize::MAX),
        "per group",
    );
    Ok(())
}

#[test]
fn conv_geometry_is_checked_in_every_precision() -> Result<()> {
    conv_geometry_is_checked::<F32>()?;
    conv_geometry_is_checked::<F16>()?;
    conv_geometry_is_checked::<BF16>()
}

#[test]
fn transposed_conv_geometry_is_checked() -> Result<()> {
    let x = image::<F16>((1, 2, 3, 3))?;
    let k = image::<F16>((2, 4, 3, 3))?;
    assert_eq!(x.conv_transpose2d(&k, 0, 0, 1, 1)?.dims(), [1, 4, 5, 5]);
    assert_err(
        "stride 0",
        x.conv_transpose2d(&k, 0, 0, 0, 1),
        "stride must be positive",
    );
    assert_err(
        "dilation 0",
        x.conv_transpose2d(&k, 0, 0, 1, 0),
        "dilation must be positive",
    );
    assert_err(
        "output_padding >= stride",
        x.conv_transpose2d(&k, 0, 2, 2, 1),
        "output_padding 2 must be smaller",
    );
    assert_err(
        "padding eats the output",
        x.conv_transpose2d(&k, 3, 0, 1, 1),
        "no output",
    );
    let wrong = image::<F16>((3, 4, 3, 3))?;
    assert_err(
        "channels",
        x.conv_transpose2d(&wrong, 0, 0, 1, 1),
        "input has 2 channels",
    );
    let line = Tensor::<F32>::randn(0.0, 1.0, (1, 2, 4), &dev())?;
    let k1 = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 3), &dev())?;
    assert_eq!(line.conv_transpose1d(&k1, 0, 0, 1, 1, 1)?.dims(), [1, 3, 6]);
    assert_err(
        "1-D groups 0",
        line.conv_transpose1d(&k1, 0, 0, 1, 1, 0),
        "groups must be",
    );
    // A stride near `usize::MAX` overflowed the output's size (a panic).
    assert_err(
        "stride near usize::MAX",
        x.conv_transpose2d(&k, 0, 0, usize::MAX / 2, 1),
        "too large to allocate",
    );
    assert_err(
        "dilation usize::MAX",
        line.conv_transpose1d(&k1, 0, 0, 1, usize::MAX, 1),
        "too large to allocate",
    );
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn pool_in_region(pool: &nn::MaxPool2d, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    pool.forward(x)
}

#[test]
fn pools_reject_overflowing_padding_and_empty_planes() -> Result<()> {
    let x = image::<F32>((1, 1, 4, 4))?;
    // A padding near `usize::MAX / 2` overflowed the window check (a panic).
    let wide = nn::MaxPool2d::with_stride(usize::MAX, 1).with_padding(usize::MAX / 2 + 1);
    assert_err("max pool padding", wide.forward(&x), "does not fit");
    assert_err(
        "max pool padding, region",
        pool_in_region(&wide, &x),
        "does not fit",
    );
    let avg = nn::AvgPool2d::with_stride(usize::MAX, 1).with_padding(usize::MAX / 2 + 1);
    assert_err("avg pool padding", avg.forward(&x), "does not fit");
    // An empty plane: every window lay in the padding (-inf or -0.0 out, as if valid).
    let empty = Tensor::<F32>::zeros((1, 1, 0, 4), &dev())?;
    let pool = nn::MaxPool2d::with_stride(2, 1).with_padding(1);
    assert_err("max pool of 0x4", pool.forward(&empty), "are empty");
    assert_err(
        "max pool of 0x4, region",
        pool_in_region(&pool, &empty),
        "are empty",
    );
    let avg = nn::AvgPool2d::with_stride(2, 1).with_padding(1);
    assert_err("avg pool of 0x4", avg.forward(&empty), "are empty");
    Ok(())
}

#[test]
fn rope_of_an_empty_head_is_empty() -> Result<()> {
    // A head dimension of 0 divided by zero (a panic) in the kernel's row blocking.
    let x = Tensor::<F32>::zeros((1, 1, 3, 0), &dev())?;
    let table = candle_core::Tensor::zeros((3, 0), DType::F32, &dev())?;
    for rope in [candle_amp::ops::rope::<F32>, candle_amp::ops::rope_i::<F32>] {
        assert_eq!(rope(&x, &table, &table)?.dims(), [1, 1, 3, 0]);
    }
    let thd = Tensor::<F32>::zeros((1, 3, 1, 0), &dev())?;
    assert_eq!(
        candle_amp::ops::rope_thd(&thd, &table, &table)?.dims(),
        [1, 3, 1, 0]
    );
    Ok(())
}

struct Stem {
    conv: nn::Conv2d,
}

#[autocast(bf16)]
impl Stem {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.conv.forward(x)
    }
}

struct CandleStem {
    conv: candle_nn::Conv2d,
}

#[autocast(bf16)]
impl CandleStem {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.conv.forward(x)
    }
}

#[autocast(fp16)]
fn routed_conv(x: &Tensor<F32>, k: &Tensor<F32>, stride: usize) -> Result<Tensor<F32>> {
    x.conv2d(k, 0, stride, 1, 1)
}

/// The layer rejects a configuration candle would divide by (PyTorch's `Conv2d` rejects
/// `groups` that do not divide the channels; a zero stride fails its forward); in a region, the
/// routed op and candle-nn's layer (whose constructor checks nothing) fail with the same words.
#[test]
fn conv_layers_and_routed_convs_check_their_configuration() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let zero_stride = Conv2dConfig {
        stride: 0,
        ..Default::default()
    };
    assert_err(
        "nn::conv2d stride 0",
        nn::conv2d(2, 2, 3, zero_stride, vb.pp("a")),
        "stride must be positive",
    );
    let grouped = Conv2dConfig {
        groups: 2,
        ..Default::default()
    };
    assert_err(
        "3 channels in 2 groups",
        nn::conv2d(3, 2, 3, grouped, vb.pp("b")),
        "must split into groups",
    );
    let zero_dilation = Conv1dConfig {
        dilation: 0,
        ..Default::default()
    };
    assert_err(
        "nn::conv1d dilation 0",
        nn::conv1d(2, 2, 3, zero_dilation, vb.pp("c")),
        "dilation must be positive",
    );
    let w = Var::from_tensor(&candle_core::Tensor::ones(
        (2, 2, 3, 3),
        DType::F32,
        &dev(),
    )?)?;
    assert_err(
        "Conv2d::new stride 0",
        nn::Conv2d::new(w.clone(), None, zero_stride),
        "stride must be positive",
    );

    let x = Tensor::<F32>::randn(0.0, 1.0, (1, 2, 3, 3), &dev())?;
    let stem = Stem {
        conv: nn::conv2d(2, 2, 5, Conv2dConfig::default(), vb.pp("d"))?,
    };
    assert_err(
        "a 5x5 layer on 3x3, bf16",
        stem.forward(&x),
        "no output position",
    );
    let candle_stem = CandleStem {
        conv: candle_nn::Conv2d::new(w.as_tensor().clone(), None, zero_stride),
    };
    assert_err(
        "candle-nn's Conv2d with stride 0, in a region",
        candle_stem.forward(&x),
        "stride must be positive",
    );
    let k = Tensor::<F32>::randn(0.0, 1.0, (2, 2, 3, 3), &dev())?;
    assert_err(
        "routed stride 0",
        routed_conv(&x, &k, 0),
        "stride must be positive",
    );
    assert_eq!(routed_conv(&x, &k, 1)?.dims(), [1, 2, 1, 1]);
    Ok(())
}

// ---- Normalisation: eps, and NaN statistics. ----

/// A negative `eps` made every output NaN (`BatchNorm2d` already rejected `eps <= 0`); every
/// norm now checks it, the layers when built and the ops when run (candle-nn's layer norm in a
/// region included).
#[test]
fn norms_reject_an_eps_that_is_not_positive_and_finite() -> Result<()> {
    let ones = || Var::from_tensor(&candle_core::Tensor::ones(4, DType::F32, &dev()).unwrap());
    for eps in [-1.0, 0.0, f64::NAN, f64::INFINITY] {
        assert_err(
            "LayerNorm",
            nn::LayerNorm::new(ones()?, None, eps),
            "eps must be finite",
        );
        assert_err(
            "RmsNorm",
            nn::RmsNorm::new(ones()?, eps),
            "eps must be finite",
        );
        assert_err(
            "BatchNorm2d",
            nn::BatchNorm2d::new(ones()?, ones()?, Some((ones()?, ones()?)), eps, 0.1),
            "eps must be finite",
        );
    }
    assert_err(
        "BatchNorm2d momentum NaN",
        nn::BatchNorm2d::new(ones()?, ones()?, None, 1e-5, f64::NAN),
        "momentum must be in [0, 1]",
    );
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev())?;
    let w = ones()?.as_tensor().clone();
    assert_err(
        "fp32::layer_norm eps -1",
        candle_amp::fp32::layer_norm(&x, &Tensor::from_candle(w.clone())?, None, -1.0),
        "eps must be finite",
    );
    let candle_ln =
        candle_nn::LayerNorm::new(w, candle_core::Tensor::zeros(4, DType::F32, &dev())?, -1.0);
    assert_err(
        "candle-nn's LayerNorm eps -1, in a region",
        norm_in_region(&candle_ln, &x),
        "eps must be finite",
    );
    Ok(())
}

#[autocast(bf16)]
fn norm_in_region(ln: &candle_nn::LayerNorm, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    ln.forward(x)
}

/// One NaN pixel in training: the batch's mean and variance of that channel are NaN, and so
/// are both running statistics (the variance's clamp at 0 turned NaN into 0, leaving a running
/// variance that looked healthy beside a NaN running mean). PyTorch gives NaN in both.
#[test]
fn a_nan_input_makes_both_running_statistics_nan() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let bn = nn::batch_norm2d(2, 1e-5, vb.pp("bn"))?;
    let mut values = vec![0.5f32; 2 * 2 * 3 * 3];
    values[4] = f32::NAN; // channel 0 of image 0
    let x =
        Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(values, (2, 2, 3, 3), &dev())?)?;
    let y = bn.forward_train(&x)?.to_flat_vec::<f32>()?;
    let mean = bn.running_mean().as_tensor().to_vec1::<f32>()?;
    let var = bn.running_var().as_tensor().to_vec1::<f32>()?;
    assert!(
        mean[0].is_nan() && var[0].is_nan(),
        "channel 0: {mean:?} {var:?}"
    );
    assert!(
        mean[1].is_finite() && var[1].is_finite(),
        "channel 1: {mean:?} {var:?}"
    );
    // The output: channel 0 of both images NaN, channel 1 finite.
    for (i, v) in y.iter().enumerate() {
        assert_eq!(v.is_nan(), (i / 9) % 2 == 0, "output {i}: {v}");
    }
    Ok(())
}

// ---- Dropout's probability. ----

/// `Dropout::new` keeps candle-nn's infallible signature, so `p` is checked when the layer
/// runs: NaN and negative values returned the input unchanged in training (1.5 was an error).
#[test]
fn dropout_rejects_a_probability_outside_zero_to_one() -> Result<()> {
    let x = Tensor::<F32>::ones((4, 4), &dev())?;
    for p in [f32::NAN, -0.5, 1.5] {
        let drop = nn::Dropout::new(p);
        assert_err("training", drop.forward(&x, true), "dropout probability");
        assert_err("evaluation", drop.forward(&x, false), "dropout probability");
    }
    assert_eq!(
        nn::Dropout::new(0.0)
            .forward(&x, true)?
            .to_flat_vec::<f32>()?,
        vec![1.0; 16]
    );
    // p = 1, as PyTorch (`input * 0`): everything dropped in training, a NaN staying NaN;
    // nothing dropped in evaluation.
    let with_nan = Tensor::<F32>::new(&[1f32, f32::NAN], &dev())?;
    let all = nn::Dropout::new(1.0);
    let dropped = all.forward(&with_nan, true)?.to_vec1::<f32>()?;
    assert!(dropped[0] == 0.0 && dropped[1].is_nan(), "{dropped:?}");
    assert_eq!(all.forward(&x, false)?.to_flat_vec::<f32>()?, vec![1.0; 16]);
    Ok(())
}

// ---- Optimizers' hyper-parameters: PyTorch's ranges, NaN and infinity rejected. ----

fn weights() -> Result<Var> {
    Var::from_tensor(&candle_core::Tensor::ones(3, DType::F32, &dev())?)
}

#[test]
fn optimizers_reject_hyper_parameters_outside_pytorchs_ranges() -> Result<()> {
    for lr in [f64::NAN, -1.0, f64::INFINITY] {
        assert_err(
            "SGD lr",
            SGD::new(vec![weights()?], lr),
            "invalid learning rate",
        );
        assert_err(
            "AdamW lr",
            AdamW::new_lr(vec![weights()?], lr),
            "invalid learning rate",
        );
    }
    let bad = [
        (
            "beta1",
            ParamsAdamW {
                beta1: 1.0,
                ..Default::default()
            },
            "invalid beta1",
        ),
        (
            "beta2",
            ParamsAdamW {
                beta2: -0.1,
                ..Default::default()
            },
            "invalid beta2",
        ),
        (
            "eps",
            ParamsAdamW {
                eps: -1.0,
                ..Default::default()
            },
            "invalid eps",
        ),
        (
            "weight_decay",
            ParamsAdamW {
                weight_decay: f64::NAN,
                ..Default::default()
            },
            "invalid weight_decay",
        ),
    ];
    for (what, params, expected) in bad {
        assert_err(what, AdamW::new(vec![weights()?], params), expected);
    }
    // lr 0 and eps 0 are allowed, as in PyTorch.
    let _ = SGD::new(vec![weights()?], 0.0)?;
    let _ = AdamW::new(
        vec![weights()?],
        ParamsAdamW {
            eps: 0.0,
            lr: 0.0,
            ..Default::default()
        },
    )?;
    Ok(())
}

/// `set_learning_rate` cannot fail (candle-nn's trait), so a bad rate set there fails the next
/// step, which then changes no weight.
#[test]
fn a_bad_learning_rate_set_later_fails_the_step_and_changes_nothing() -> Result<()> {
    let w = weights()?;
    let grads = (w.as_tensor() * 2.0)?.sum_all()?.backward()?;
    let mut sgd = SGD::new(vec![w.clone()], 0.1)?;
    sgd.set_learning_rate(f64::INFINITY);
    assert_err("SGD step", sgd.step(&grads), "invalid learning rate inf");
    let mut adamw = AdamW::new_lr(vec![w.clone()], 0.1)?;
    adamw.set_learning_rate(f64::NAN);
    assert_err(
        "AdamW step",
        adamw.step(&grads),
        "invalid learning rate NaN",
    );
    adamw.set_params(ParamsAdamW {
        beta1: 1.0,
        ..Default::default()
    });
    assert_err("AdamW step", adamw.step(&grads), "invalid beta1");
    assert_eq!(w.as_tensor().to_vec1::<f32>()?, [1.0, 1.0, 1.0]);
    Ok(())
}

// ---- Ids. ----

/// Float ids are an error naming the ids (candle's `index_select` said "unsupported dtype F32"
/// for f16 ids, naming the table), in the layer, candle-nn's layer in a region, and the op.
#[test]
fn float_ids_are_an_error_naming_the_ids() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let emb = nn::embedding(10, 4, vb.pp("emb"))?;
    let ids = candle_core::Tensor::new(&[1f32, 2.0], &dev())?.to_dtype(DType::F16)?;
    assert_err(
        "Embedding, f16 ids",
        emb.forward(&ids),
        "the ids must be integers",
    );
    let candle_emb = candle_nn::embedding(10, 4, vb.pp("candle_emb"))?;
    assert_err(
        "candle-nn's Embedding in a region",
        lookup_in_region(&candle_emb, &ids),
        "the ids must be integers",
    );
    let table = Tensor::<F16>::ones((10, 4), &dev())?;
    let f32_ids = candle_core::Tensor::new(&[1f32, 2.0], &dev())?;
    assert_err(
        "index_select, f32 ids",
        table.index_select(&f32_ids, 0),
        "index_select: the ids must be integers",
    );
    let good = candle_core::Tensor::new(&[1u32, 2], &dev())?;
    assert_eq!(emb.forward(&good)?.dims(), [2, 4]);
    Ok(())
}

#[autocast(bf16)]
fn lookup_in_region(emb: &candle_nn::Embedding, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    emb.forward(ids)
}

// ---- Shapes a layer cannot take, and losses with nothing to average. ----

#[autocast(bf16)]
fn linear_in_region(l: &candle_nn::Linear, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    l.forward(x)
}

#[autocast(bf16)]
fn rms_in_region(n: &candle_nn::RmsNorm, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    n.forward(x)
}

/// candle names its own op (`shape mismatch in matmul`, `in broadcast_mul`) for an input of the
/// wrong width; the layers name themselves, both sizes and which parameter disagrees, on every
/// path. An empty adaptive pool averaged nothing into NaN.
#[test]
fn layers_name_the_width_they_take_and_an_empty_pool_is_an_error() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 5), &dev())?;
    let linear = nn::linear(4, 3, vb.pp("l"))?;
    assert_err(
        "Linear",
        linear.forward(&x),
        "the input [2, 5] has 5 features",
    );
    assert_err(
        "Linear, bf16",
        linear.forward(&x.cast::<BF16>()?),
        "takes 4 (in_features)",
    );
    let candle_linear = candle_nn::linear(4, 3, vb.pp("cl"))?;
    assert_err(
        "candle-nn's Linear in a region",
        linear_in_region(&candle_linear, &x),
        "takes 4 (in_features)",
    );
    let ln = nn::layer_norm(4, 1e-5, vb.pp("ln"))?;
    assert_err(
        "LayerNorm",
        ln.forward(&x),
        "layer_norm: the input [2, 5] is normalised over its last dimension (5 values)",
    );
    let rms = candle_nn::rms_norm(4, 1e-5, vb.pp("rms"))?;
    assert_err(
        "candle-nn's RmsNorm in a region",
        rms_in_region(&rms, &x),
        "but the scale has shape [4]",
    );
    let pool = nn::AdaptiveAvgPool2d::new((1, 1))?;
    let empty = Tensor::<F32>::zeros((1, 1, 0, 2), &dev())?;
    assert_err(
        "AdaptiveAvgPool2d, empty input",
        pool.forward(&empty),
        "is empty along dimension 2",
    );
    Ok(())
}

/// A batch whose every target is `ignore_index` (or whose kept classes weigh 0 in all) has no
/// mean: PyTorch returns NaN, and a training step on it makes every weight NaN. A NaN class
/// weight does the same to every row of its class.
#[test]
fn cross_entropy_with_nothing_to_average_is_an_error() -> Result<()> {
    use candle_amp::loss::{self, CrossEntropy};
    let logits = Tensor::<F32>::randn(0.0, 1.0, (2, 3), &dev())?;
    let ignored = candle_core::Tensor::new(&[-100i64, -100], &dev())?;
    let options = CrossEntropy {
        ignore_index: Some(-100),
        ..Default::default()
    };
    assert_err(
        "every row ignored",
        loss::cross_entropy_with(&logits, &ignored, &options),
        "total class weight of 0",
    );
    let ids = candle_core::Tensor::new(&[0u32, 1], &dev())?;
    let cancel = CrossEntropy {
        weight: Some(candle_core::Tensor::new(&[-1f32, 1.0, 1.0], &dev())?),
        ..Default::default()
    };
    assert_err(
        "weights adding up to 0",
        loss::cross_entropy_with(&logits, &ids, &cancel),
        "total class weight of 0",
    );
    let nan = CrossEntropy {
        weight: Some(candle_core::Tensor::new(&[f32::NAN, 1.0, 1.0], &dev())?),
        ..Default::default()
    };
    assert_err(
        "a NaN class weight",
        loss::cross_entropy_with(&logits, &ids, &nan),
        "the class weights must be finite",
    );
    // One row kept: its loss alone, finite.
    let one = candle_core::Tensor::new(&[1i64, -100], &dev())?;
    let l = loss::cross_entropy_with(&logits, &one, &options)?.to_scalar::<f32>()?;
    assert!(l.is_finite() && l > 0.0, "{l}");
    Ok(())
}

// ---- The second sweep's findings: losses, layers without inputs, values finite only in f64. ----

#[autocast(bf16)]
fn cross_entropy_in_region(x: &Tensor<F32>, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    candle_amp::loss::cross_entropy(x, ids)
}

/// Losses: class ids out of range or of a float dtype (candle's gather named index
/// 18446744073709551615, or its dtype), an empty batch for the weighted cross-entropy (candle's
/// "empty tensor for reduce"), a prediction and target of other shapes (candle's `sub`); and
/// the mean squared error of nothing, NaN as PyTorch's (it was 0, a silent "perfect" loss).
#[test]
fn losses_check_their_targets_and_average_nothing_into_nan() -> Result<()> {
    let logits = Tensor::<F32>::randn(0.0, 1.0, (2, 3), &dev())?;
    let negative = candle_core::Tensor::new(&[-1i64, 0], &dev())?;
    let beyond = candle_core::Tensor::new(&[0u32, 3], &dev())?;
    let floats = candle_core::Tensor::new(&[0f32, 1.0], &dev())?;
    // PyTorch's default padding target: the error says how to skip it.
    let padded = candle_core::Tensor::new(&[-100i64, 0], &dev())?;
    for (what, ids, expected) in [
        ("id -1", &negative, "class ids must be in 0..3, got -1"),
        (
            "id -100",
            &padded,
            "-100 is PyTorch's default `ignore_index`: to skip those rows, call \
             `loss::cross_entropy_with",
        ),
        ("id 3", &beyond, "class ids must be in 0..3, got 3"),
        ("f32 ids", &floats, "integer class ids"),
    ] {
        assert_err(
            what,
            candle_amp::loss::cross_entropy(&logits, ids),
            expected,
        );
        assert_err(what, cross_entropy_in_region(&logits, ids), expected);
        let logp = candle_amp::ops::log_softmax(&logits, 1)?;
        assert_err(what, candle_amp::loss::nll(&logp, ids), expected);
    }
    let empty = Tensor::<F32>::zeros((0, 3), &dev())?;
    let no_ids = candle_core::Tensor::zeros(0, DType::U32, &dev())?;
    assert_err(
        "weighted cross-entropy of no row",
        candle_amp::loss::cross_entropy_with(
            &empty,
            &no_ids,
            &candle_amp::loss::CrossEntropy::default(),
        ),
        "empty batch has no row to average",
    );
    let column = Tensor::<F32>::zeros((3, 1), &dev())?;
    let row = Tensor::<F32>::zeros(3, &dev())?;
    assert_err(
        "mse (3, 1) vs (3)",
        candle_amp::loss::mse(&column, &row),
        "mse: the prediction [3, 1] and the target [3]",
    );
    assert_err(
        "l1",
        candle_amp::loss::l1(&column, &row),
        "l1: the prediction",
    );
    assert_err(
        "smooth_l1",
        candle_amp::loss::smooth_l1(&column, &row, 1.0),
        "smooth_l1: the prediction",
    );
    assert_err(
        "bce",
        candle_amp::loss::binary_cross_entropy_with_logits(&column, &row),
        "binary_cross_entropy_with_logits: the prediction",
    );
    let nothing = Tensor::<F32>::zeros(0, &dev())?;
    let mse = candle_amp::loss::mse(&nothing, &nothing)?.to_scalar::<f32>()?;
    assert!(mse.is_nan(), "the mean of no error is NaN, got {mse}");
    Ok(())
}

/// A layer with no input feature or channel builds, as PyTorch's does (zero weights and bias:
/// candle-nn's initialisers failed on the infinite bound 1/sqrt(0)); a group norm of an empty
/// batch is empty; a checkpoint's step beyond the file's i64 is an error naming it.
#[test]
fn layers_without_inputs_build_and_empty_batches_pass_through() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let linear = nn::linear(0, 3, vb.pp("l"))?;
    let y = linear.forward(&Tensor::<F32>::zeros((2, 0), &dev())?)?;
    assert_eq!(y.to_vec2::<f32>()?, vec![vec![0.0; 3]; 2]);
    let conv = nn::conv2d(0, 2, 3, Conv2dConfig::default(), vb.pp("c"))?;
    assert_eq!(conv.weight().dims(), [2, 0, 3, 3]);
    assert!(nn::conv1d(0, 2, 3, Conv1dConfig::default(), vb.pp("c1")).is_ok());
    let gn = nn::group_norm(2, 4, 1e-5, vb.pp("gn"))?;
    let empty = Tensor::<F32>::zeros((0, 4, 2, 2), &dev())?;
    assert_eq!(gn.forward(&empty)?.dims(), [0, 4, 2, 2]);
    let opt = SGD::new(vars.all_vars(), 0.1)?;
    let scaler = candle_amp::GradScaler::new();
    let path = std::env::temp_dir().join(format!("bad-step-{}.safetensors", std::process::id()));
    assert_err(
        "step u64::MAX",
        candle_amp::checkpoint::save(&path, &vars, &opt, &scaler, u64::MAX),
        "does not fit the file's i64 `step`",
    );
    Ok(())
}

/// Hyper-parameters finite as f64 and infinite as the f32 the kernels apply (a learning rate of
/// 1e39 made the weights -inf; an attention scale of 1e300 every output NaN).
#[test]
fn values_finite_only_in_f64_are_rejected() -> Result<()> {
    let w = Var::ones(2, DType::F32, &dev())?;
    assert_err(
        "SGD lr 1e39",
        SGD::new(vec![w.clone()], 1e39),
        "invalid learning rate",
    );
    let adamw = ParamsAdamW {
        lr: 1e39,
        ..Default::default()
    };
    assert_err(
        "AdamW lr 1e39",
        AdamW::new(vec![w], adamw),
        "invalid learning rate",
    );
    let q = Tensor::<F32>::randn(0.0, 1.0, (1, 1, 2, 4), &dev())?;
    assert_err(
        "attention scale 1e300",
        candle_amp::ops::scaled_dot_product_attention(&q, &q, &q, None, Some(1e300), false),
        "the scale must be finite",
    );
    Ok(())
}

// ---- The third sweep's findings. ----

/// A gradient of another shape (as many values: `(4)` for a `(2, 2)` weight) updated the
/// weights in its own layout; a zero-element parameter (`nn::linear(0, n)`'s weight) made the
/// in-place pass fail. PyTorch rejects the first and steps over the second.
#[test]
fn optimizers_check_gradient_shapes_and_step_over_empty_parameters() -> Result<()> {
    let w = Var::ones((2, 2), DType::F32, &dev())?;
    let wrong = Var::ones(4, DType::F32, &dev())?;
    let mut grads = candle_core::backprop::GradStore::default();
    grads.insert(w.as_tensor(), wrong.as_tensor().clone());
    let mut sgd = SGD::new(vec![w.clone()], 0.1)?;
    assert_err(
        "SGD",
        sgd.step(&grads),
        "a gradient of shape [4] for a parameter of shape [2, 2]",
    );
    let mut adamw = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    assert_err("AdamW", adamw.step(&grads), "a gradient of shape [4]");
    assert_eq!(w.as_tensor().to_vec2::<f32>()?, [[1.0, 1.0], [1.0, 1.0]]);
    let empty = Var::zeros((3, 0), DType::F32, &dev())?;
    let mut grads = candle_core::backprop::GradStore::default();
    grads.insert(empty.as_tensor(), empty.as_tensor().clone());
    AdamW::new(vec![empty.clone()], ParamsAdamW::default())?.step(&grads)?;
    SGD::new(vec![empty], 0.1)?.step(&grads)?;
    Ok(())
}

/// A loss that reaches no variable was stepped as `Stepped` (PyTorch's backward raises); an
/// integer loss was scaled; f16 parameters' gradients were unscaled in f16 (PyTorch raises
/// "Attempting to unscale FP16 gradients").
#[test]
fn the_scaler_refuses_losses_without_gradients_and_f16_gradients() -> Result<()> {
    let scaler = candle_amp::GradScaler::new();
    let constant = candle_core::Tensor::new(5f32, &dev())?;
    assert_err(
        "a constant loss",
        scaler.scale(&constant)?.backward(),
        "depends on no variable",
    );
    let ids = candle_core::Tensor::new(5u32, &dev())?;
    assert_err("a u32 loss", scaler.scale(&ids), "must be a float value");
    let w = Var::ones(2, DType::F16, &dev())?;
    let loss = w.as_tensor().to_dtype(DType::F32)?.sum_all()?;
    let mut scaler = candle_amp::GradScaler::new();
    let grads = scaler.scale(&loss)?.backward()?;
    assert_err(
        "f16 gradients",
        scaler.unscale(grads),
        "Attempting to unscale FP16 gradients",
    );
    Ok(())
}

/// An optimizer stepped with the gradients of a loss over other parameters reported `Stepped`
/// and updated nothing; PyTorch raises "No inf checks were recorded for this optimizer". The
/// optimizer whose parameters the loss reaches steps as before.
#[test]
fn the_scaler_refuses_an_optimizer_without_gradients() -> Result<()> {
    let (a, b) = (
        Var::ones(2, DType::F32, &dev())?,
        Var::ones(2, DType::F32, &dev())?,
    );
    let mut opt_a = SGD::new(vec![a.clone()], 0.5)?;
    let mut opt_b = AdamW::new(vec![b.clone()], ParamsAdamW::default())?;
    let mut scaler = candle_amp::GradScaler::new();
    let loss = a.as_tensor().sum_all()?;
    assert_err(
        "AdamW over b, stepped with a's gradients",
        scaler.step(&mut opt_b, scaler.scale(&loss)?.backward()?),
        "No inf checks were recorded for this optimizer",
    );
    assert_eq!(b.as_tensor().to_vec1::<f32>()?, [1.0, 1.0]);
    assert_eq!(
        scaler.step(&mut opt_a, scaler.scale(&loss)?.backward()?)?,
        candle_amp::StepOutcome::Stepped
    );
    assert_eq!(a.as_tensor().to_vec1::<f32>()?, [0.5, 0.5]);
    scaler.update()?;
    Ok(())
}

/// Shapes whose size overflows reached candle's unchecked multiplications (a panic in a debug
/// build); `chunk(0)` divided by zero; `flatten(1, 0)` did nothing, `full(70000)` in f16 gave
/// inf, `randn` took a negative deviation (PyTorch raises on each).
#[test]
fn typed_tensors_check_sizes_and_arguments() -> Result<()> {
    let huge = usize::MAX;
    assert_err(
        "zeros",
        Tensor::<F32>::zeros((huge, 2), &dev()),
        "too large",
    );
    assert_err("ones", Tensor::<F16>::ones((huge, 2), &dev()), "too large");
    let x = Tensor::<F32>::ones((2, 3), &dev())?;
    assert_err("reshape", x.reshape((huge, 2, 3)), "too large");
    assert_err("broadcast_left", x.broadcast_left((huge, 2)), "too large");
    assert_err("pad_with_zeros", x.pad_with_zeros(1, huge, 1), "overflows");
    assert_err("chunk 0", x.chunk(0, 1), "must be positive");
    assert_err("flatten(1, 0)", x.flatten(1, 0), "comes after");
    assert_err(
        "full f16 70000",
        Tensor::<F16>::full(70000.0, 2, &dev()),
        "overflows",
    );
    assert_eq!(
        Tensor::<F16>::full(65504.0, 1, &dev())?.to_vec1::<f32>()?,
        [65504.0]
    );
    assert_err(
        "randn std -1",
        Tensor::<F32>::randn(0.0, -1.0, 2, &dev()),
        "std",
    );
    assert_err(
        "rand 1..0",
        Tensor::<F32>::rand(1.0, 0.0, 2, &dev()),
        "lo <= up",
    );
    // A bound past f16's range drew infinities (353 of 1000 for `rand(0, 1e5)`), where
    // PyTorch's `uniform_` refuses; `full(-0.0)` was +0.0, where PyTorch's keeps the sign.
    assert_err(
        "rand f16 0..1e5",
        Tensor::<F16>::rand(0.0, 1e5, 1000, &dev()),
        "up = 1e5 is out of bounds for F16",
    );
    assert_err(
        "rand bf16 -1e39..0",
        Tensor::<BF16>::rand(-1e39, 0.0, 2, &dev()),
        "lo = -1e39 is out of bounds for BF16",
    );
    let negative_zero = Tensor::<F16>::full(-0.0, 2, &dev())?.to_vec1::<f32>()?;
    assert!(negative_zero
        .iter()
        .all(|v| v.to_bits() == (-0.0f32).to_bits()));
    // The log of an empty sum, as PyTorch.
    let empty = Tensor::<F32>::zeros((2, 0), &dev())?;
    assert_eq!(
        empty.log_sum_exp(1)?.to_vec1::<f32>()?,
        [f32::NEG_INFINITY; 2]
    );
    Ok(())
}

/// Panics and silent results in the ops and layers: packed attention over heads of size 0
/// (`chunks_exact(0)`), a causal mask of `usize::MAX` past keys (an overflow), group norm on
/// integers (candle's `todo!`), layer norm on integers (zeros out) or on a scalar, a transposed
/// convolution whose output's byte count overflowed the size check itself, a checkpoint path
/// naming no file (a stray `.tmp` left behind).
#[test]
fn ops_and_layers_reject_empty_heads_integers_and_scalars() -> Result<()> {
    let qkv = Tensor::<F32>::zeros((1, 2, 3, 2, 0), &dev())?;
    let y = candle_amp::ops::scaled_dot_product_attention_packed(
        &qkv,
        &candle_amp::ops::Attention::default(),
    )?;
    assert_eq!(y.dims(), [1, 2, 2, 0]);
    assert_err(
        "causal_mask overflow",
        candle_amp::ops::causal_mask(1, usize::MAX, &dev()),
        "overflow",
    );
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let ints = candle_core::Tensor::ones((2, 2, 2), DType::U32, &dev())?;
    let gn = nn::group_norm(1, 2, 1e-5, vb.pp("gn"))?;
    assert_err(
        "group norm of u32",
        candle_nn::Module::forward(&gn, &ints),
        "`group_norm` of a U32 tensor: it computes in floating point",
    );
    let ln = nn::layer_norm(2, 1e-5, vb.pp("ln"))?;
    assert_err(
        "layer norm of u32",
        candle_nn::Module::forward(&ln, &ints),
        "`layer_norm` of a U32 tensor: it computes in floating point",
    );
    let scalar = Tensor::<F32>::new(1f32, &dev())?;
    assert_err(
        "layer norm of a scalar",
        ln.forward(&scalar),
        "a scalar has none",
    );
    let x = image::<F32>((1, 1, 5, 5))?;
    let k = image::<F32>((1, 1, 3, 3))?;
    assert_err(
        "conv_transpose2d stride usize::MAX / 2",
        x.conv_transpose2d(&k, 0, 0, usize::MAX / 2, 1),
        "too large to allocate",
    );
    let ct = nn::conv_transpose2d(
        1,
        1,
        3,
        candle_nn::ConvTranspose2dConfig::default(),
        vb.pp("ct"),
    )?;
    assert_err(
        "ConvTranspose2d of a rank-3 input",
        ct.forward(&image::<F32>((1, 1, 5, 5))?.squeeze(0)?),
        "ConvTranspose2d: the input must be (batch, channels, h, w)",
    );
    let opt = SGD::new(vars.all_vars(), 0.1)?;
    let scaler = candle_amp::GradScaler::new();
    assert_err(
        "checkpoint path \"\"",
        candle_amp::checkpoint::save("", &vars, &opt, &scaler, 1),
        "names no file",
    );
    assert!(!std::path::Path::new(".tmp").exists());
    let nowhere = std::env::temp_dir()
        .join("no-such-dir-of-candle-amp")
        .join("ckpt.safetensors");
    assert_err(
        "checkpoint in a missing directory",
        candle_amp::checkpoint::save(&nowhere, &vars, &opt, &scaler, 1),
        "does not exist",
    );
    // A directory, with or without a trailing separator or `.`: the error names the path given
    // (the message named the temporary file `dir.tmp`, or `dir/.tmp` was written).
    let dir = std::env::temp_dir().join(format!("candle-amp-ckpt-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let shown = dir.display().to_string();
    for (given, says) in [
        (shown.clone(), "is a directory"),
        (format!("{shown}/"), "names no file"),
        (format!("{shown}/."), "names no file"),
    ] {
        let r = candle_amp::checkpoint::save(&given, &vars, &opt, &scaler, 1);
        let err = r.expect_err(&given).to_string();
        assert!(err.contains(says) && err.contains(&shown), "{given}: {err}");
        assert!(!err.contains(".tmp"), "{given}: {err}");
    }
    assert_eq!(
        std::fs::read_dir(&dir)?.count(),
        0,
        "nothing left in the directory"
    );
    // A symbolic link stays one: the checkpoint is written to the file it names.
    #[cfg(unix)]
    {
        let (file, link) = (dir.join("real.safetensors"), dir.join("link.safetensors"));
        std::os::unix::fs::symlink("real.safetensors", &link)?;
        candle_amp::checkpoint::save(&link, &vars, &opt, &scaler, 1)?;
        assert!(std::fs::symlink_metadata(&link)?.file_type().is_symlink());
        assert!(
            std::fs::metadata(&file)?.len() > 0,
            "the link's file is written"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

// ---- The fourth sweep's findings. ----

/// `l1`'s gradient at a prediction equal to its target is 0 (PyTorch's `sign(0)`; candle's
/// `abs` gave 1); binary cross-entropy on logits keeps its tail (`log1p`: at x = 30, t = 1 the
/// loss is e^-30 = 9.4e-14, it was 0); softmax over an empty dimension is empty, as PyTorch's;
/// `pow` of two shapes names itself.
#[test]
fn losses_and_ops_at_their_edges() -> Result<()> {
    let x = Var::new(&[3f32, 1.0], &dev())?;
    let t = Tensor::<F32>::new(&[0f32, 1.0], &dev())?;
    let grads = candle_amp::loss::l1(&Tensor::<F32>::from_candle(x.as_tensor().clone())?, &t)?
        .into_candle()
        .backward()?;
    assert_eq!(
        grads.get(&x).expect("a gradient").to_vec1::<f32>()?,
        [0.5, 0.0]
    );
    let logit = Tensor::<F32>::new(&[30f32], &dev())?;
    let one = Tensor::<F32>::new(&[1f32], &dev())?;
    let bce =
        candle_amp::loss::binary_cross_entropy_with_logits(&logit, &one)?.to_scalar::<f32>()?;
    let want = (-30f64).exp() as f32;
    assert!((bce - want).abs() <= 1e-6 * want, "{bce} vs {want}");
    let empty = Tensor::<F32>::zeros((0, 3), &dev())?;
    assert_eq!(candle_amp::ops::softmax(&empty, 0)?.dims(), [0, 3]);
    assert_eq!(candle_amp::ops::log_softmax(&empty, 0)?.dims(), [0, 3]);
    let (a, b) = (
        Tensor::<F32>::ones(3, &dev())?,
        Tensor::<F32>::ones(2, &dev())?,
    );
    assert_err(
        "pow of two shapes",
        candle_amp::fp32::pow(&a, &b),
        "pow: the base [3]",
    );
    Ok(())
}

/// One optimizer stepped twice in one iteration applied both steps; PyTorch raises "step() has
/// already been called since the last update()". After `update()` it steps again.
#[test]
fn the_scaler_steps_each_optimizer_once_per_update() -> Result<()> {
    let w = Var::new(&[1f32, 2.0], &dev())?;
    let mut opt = SGD::new(vec![w.clone()], 1.0)?;
    let mut scaler = candle_amp::GradScaler::new();
    let loss = || w.as_tensor().sum_all();
    let grads = scaler.scale(&loss()?)?.backward()?;
    assert_eq!(
        scaler.step(&mut opt, grads)?,
        candle_amp::StepOutcome::Stepped
    );
    let again = scaler.scale(&loss()?)?.backward()?;
    assert_err(
        "a second step",
        scaler.step(&mut opt, again),
        "already stepped",
    );
    assert_eq!(w.as_tensor().to_vec1::<f32>()?, [0.0, 1.0]);
    scaler.update()?;
    let next = scaler.scale(&loss()?)?.backward()?;
    assert_eq!(
        scaler.step(&mut opt, next)?,
        candle_amp::StepOutcome::Stepped
    );
    Ok(())
}

// ---- The fifth sweep's findings. ----

#[autocast(fp16)]
fn divided_in_region(x: &Tensor<F32>, s: f64) -> Result<Tensor<F32>> {
    Ok((x / s)?)
}

/// `x / s` multiplied by `1 / s`, which overflows f32 for |s| below about 2.9e-39: `1e-39 /
/// 1e-39` was inf, `0 / 1e-39` NaN (PyTorch: 1 and 0); it is a quotient now, exact as PyTorch's
/// CPU division (`x / 3` was an ulp off for a third of the values). `x + 0.0` turns -0.0 into
/// +0.0 and `0.0 - x` of 0 is +0.0, as IEEE sums and PyTorch give; `x * s` keeps a zero's sign.
#[test]
fn scalar_division_is_a_quotient_and_zero_signs_follow_ieee() -> Result<()> {
    let tiny = 1e-39;
    let x = Tensor::<F32>::new(&[0f32, 1e-39, 1.0], &dev())?;
    assert_eq!((&x / tiny)?.to_vec1::<f32>()?, [0.0, 1.0, f32::INFINITY]);
    let in_region = divided_in_region(&x, tiny)?.to_vec1::<f32>()?;
    assert_eq!(in_region, [0.0, 1.0, f32::INFINITY]);
    let thirds: Vec<f32> = (1..2000).map(|i| i as f32 * 0.37).collect();
    let got = (&Tensor::<F32>::new(thirds.as_slice(), &dev())? / 3.0)?.to_vec1::<f32>()?;
    let want: Vec<f32> = thirds.iter().map(|v| v / 3.0).collect();
    assert_eq!(got, want);
    let bits = |t: Tensor<F32>| -> Result<Vec<u32>> {
        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    };
    let negative_zero = Tensor::<F32>::new(&[-0f32], &dev())?;
    assert_eq!(bits((&negative_zero + 0.0)?)?, [0f32.to_bits()]);
    assert_eq!(
        bits((0.0 - &Tensor::<F32>::new(&[0f32], &dev())?)?)?,
        [0f32.to_bits()]
    );
    assert_eq!(bits((&negative_zero * 2.0)?)?, [(-0f32).to_bits()]);
    Ok(())
}

// ---- The sixth sweep's findings. ----

#[autocast(fp16)]
fn rdiv_in_region(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    Ok((1e-39 / x)?)
}

#[autocast(fp16)]
fn int_pow_in_region(x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
    x.pow(x)
}

/// `pow`'s gradient at a zero base was NaN (`relu(h)^2` made every gradient NaN), its values
/// off at signed zeros, `(-1)^inf` and `(-2)^31`, and integer operands in a region panicked
/// (candle's `todo!`); `s / x` was `s * (1 / x)` (`1e-39 / 1e-39` was inf).
#[test]
fn pow_and_scalar_quotients_as_pytorch() -> Result<()> {
    let base = Var::new(&[0f32, 3.0, 0.0, -2.0], &dev())?;
    let exponent = Tensor::<F32>::new(&[2f32, 2.0, 0.5, 3.0], &dev())?;
    let x = Tensor::<F32>::from_candle(base.as_tensor().clone())?;
    let grads = candle_amp::fp32::pow(&x, &exponent)?
        .into_candle()
        .sum_all()?
        .backward()?;
    let dx = grads.get(&base).expect("a gradient").to_vec1::<f32>()?;
    // 2 * 0, 2 * 3, 0.5 * 0^-0.5 = inf, 3 * (-2)^2 = 12: PyTorch's.
    assert_eq!(dx, [0.0, 6.0, f32::INFINITY, 12.0]);
    let signed = Tensor::<F32>::new(&[-0f32, -0.0, -1.0, -2.0], &dev())?;
    let powers = Tensor::<F32>::new(&[-1f32, 3.0, f32::INFINITY, 31.0], &dev())?;
    let got = candle_amp::fp32::pow(&signed, &powers)?.to_vec1::<f32>()?;
    assert!(got[0].is_infinite() && got[0].is_sign_negative(), "{got:?}");
    assert!(got[1] == 0.0 && got[1].is_sign_negative(), "{got:?}");
    assert_eq!(got[2..], [1.0, -2_147_483_648.0]);
    let ints = candle_core::Tensor::new(&[2u32, 3], &dev())?;
    assert_err(
        "pow of u32 in a region",
        int_pow_in_region(&ints),
        "`pow` of a U32 tensor: it computes in floating point",
    );
    let tiny = Tensor::<F32>::new(&[1e-39f32, 2e-39], &dev())?;
    assert_eq!((1e-39 / &tiny)?.to_vec1::<f32>()?, [1.0, 0.5]);
    assert_eq!(rdiv_in_region(&tiny)?.to_vec1::<f32>()?, [1.0, 0.5]);
    let values: Vec<f32> = (1..2000).map(|i| i as f32 * 0.37).collect();
    let got = (3.0 / &Tensor::<F32>::new(values.as_slice(), &dev())?)?.to_vec1::<f32>()?;
    let want: Vec<f32> = values.iter().map(|v| 3.0 / v).collect();
    assert_eq!(got, want);
    Ok(())
}

// ---- The seventh sweep's findings: gradients and values at edge inputs. ----

/// `(value, gradient)` of `f` at `x`, summed if not a scalar, as f32 vectors.
fn value_and_grad(
    x: &[f32],
    f: impl Fn(&Tensor<F32>) -> Result<Tensor<F32>>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let v = Var::new(x, &dev())?;
    let y = f(&Tensor::<F32>::from_candle(v.as_tensor().clone())?)?.into_candle();
    let grads = y.sum_all()?.backward()?;
    let g = grads.get(&v).expect("a gradient").flatten_all()?;
    Ok((y.flatten_all()?.to_vec1()?, g.to_vec1()?))
}

/// Equal, NaN matching NaN (and -0.0 matching 0.0).
fn same(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got.iter().zip(want).all(|(g, w)| {
            (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits() || g.abs() + w.abs() == 0.0
        })
}

/// A kink case: what, input, the typed op, its region case, PyTorch's values and gradient.
type Kink<'a> = (
    &'a str,
    &'a [f32],
    fn(&Tensor<F32>) -> Result<Tensor<F32>>,
    usize,
    &'a [f32],
    &'a [f32],
);

/// A cross-entropy case: what, logits, their shape, targets, options, PyTorch's loss and
/// gradient.
type CrossEntropyCase<'a> = (
    &'a str,
    &'a [f32],
    (usize, usize),
    Vec<i64>,
    candle_amp::loss::CrossEntropy,
    f32,
    &'a [f32],
);

/// Equal within f32 rounding of PyTorch's printed values, NaN matching NaN.
fn close(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got.iter().zip(want).all(|(g, w)| {
            (g.is_nan() && w.is_nan())
                || g.to_bits() == w.to_bits()
                || (g - w).abs() <= 1e-6 * w.abs().max(1.0)
        })
}

#[autocast(bf16)]
fn kinks_in_region(x: &Tensor<F32>, which: usize) -> Result<Tensor<F32>> {
    match which {
        0 => x.abs(),
        1 => x.clamp(-1.0, 1.0),
        2 => x.powf(0.0),
        _ => x.cumsum(0),
    }
}

/// PyTorch's gradients at kinks (torch 2.15, f32), typed and in a region: `abs` is 0 at 0,
/// -0.0 and NaN (candle's gives ±1); `clamp` passes nothing at its bounds (candle halves it
/// there) and keeps NaN; `powf(0)` has gradient 0 (candle's `0 * x^-1` is NaN at 0 and NaN);
/// `cumsum` lets an infinity or NaN reach only the sums after it (candle's made the earlier
/// ones NaN).
#[test]
fn kinks_have_pytorch_s_gradients() -> Result<()> {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let cases: [Kink; 4] = [
        (
            "abs",
            &[0.0, -0.0, nan, -1.0, 2.0],
            |x| x.abs(),
            0,
            &[0.0, 0.0, nan, 1.0, 2.0],
            &[0.0, 0.0, 0.0, -1.0, 1.0],
        ),
        (
            "clamp(-1, 1)",
            &[-1.0, 1.0, 0.0, -2.0, 2.0, nan],
            |x| x.clamp(-1.0, 1.0),
            1,
            &[-1.0, 1.0, 0.0, -1.0, 1.0, nan],
            &[0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        ),
        (
            "powf(0)",
            &[0.0, -0.0, 1e-40, nan, 2.0],
            |x| x.powf(0.0),
            2,
            &[1.0; 5],
            &[0.0; 5],
        ),
        (
            "cumsum",
            &[1.0, inf, 2.0, nan, 3.0],
            |x| x.cumsum(0),
            3,
            &[1.0, inf, inf, nan, nan],
            &[5.0, 4.0, 3.0, 2.0, 1.0],
        ),
    ];
    for (what, x, typed, which, value, grad) in cases {
        for (how, (y, g)) in [
            ("typed", value_and_grad(x, typed)?),
            ("region", value_and_grad(x, |x| kinks_in_region(x, which))?),
        ] {
            assert!(same(&y, value), "{what} {how}: {y:?} vs {value:?}");
            assert!(same(&g, grad), "{what} {how} gradient: {g:?} vs {grad:?}");
        }
    }
    // `min > max` gives `max` everywhere and no gradient, as PyTorch's.
    let (y, g) = value_and_grad(&[-1.0, 1.0, 0.0, 3.0], |x| x.clamp(2.0, 1.0))?;
    assert!(same(&y, &[1.0; 4]) && same(&g, &[0.0; 4]), "{y:?} {g:?}");
    Ok(())
}

/// `cross_entropy_with` at `-inf` logits, against PyTorch's values and gradients (torch 2.15):
/// it was NaN wherever a logit was `-inf` (its zero weights and zero smoothing multiplied the
/// `-inf`), and an ignored row of `-inf` logits gave NaN gradients.
#[test]
fn cross_entropy_at_infinite_logits_is_pytorch_s() -> Result<()> {
    use candle_amp::loss::{self, CrossEntropy};
    let inf = f32::INFINITY;
    let logits = [-inf, 0.0, 1.0, 0.0, -inf, 1.0, 1.0, 2.0, 3.0];
    let padded = [
        0.0, 1.0, 2.0, -inf, 0.0, 1.0, -inf, -inf, -inf, 1.0, 2.0, 3.0,
    ];
    let weighted = [0.0, -inf, 2.0, 1.0, 0.0, 1.0];
    let cases: [CrossEntropyCase; 3] = [
        (
            "default",
            &logits,
            (3, 3),
            vec![2, 2, 0],
            CrossEntropy::default(),
            1.011_376_5,
            &[
                0.0,
                0.089_647_14,
                -0.089_647_14,
                0.089_647_14,
                0.0,
                -0.089_647_14,
                -0.303_323_15,
                0.081_576_17,
                0.221_747,
            ],
        ),
        (
            "ignored rows holding -inf",
            &padded,
            (4, 3),
            vec![2, -100, -100, 1],
            CrossEntropy {
                ignore_index: Some(-100),
                ..Default::default()
            },
            0.907_605_9,
            &[
                0.045_015_29,
                0.122_364_25,
                -0.167_379_5,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.045_015_29,
                -0.377_635_75,
                0.332_620_5,
            ],
        ),
        (
            "a class of weight 0 at -inf",
            &weighted,
            (2, 3),
            vec![2, 0],
            CrossEntropy {
                weight: Some(candle_core::Tensor::new(&[1f32, 0.0, 2.0], &dev())?),
                ..Default::default()
            },
            0.371_950_3,
            &[
                0.079_468_61,
                0.0,
                -0.079_468_65,
                -0.192_560_4,
                0.051_787_47,
                0.140_772_94,
            ],
        ),
    ];
    for (what, x, shape, target, options, loss_want, grad_want) in cases {
        let target = candle_core::Tensor::new(target.as_slice(), &dev())?;
        let (y, g) = value_and_grad(x, |x| {
            loss::cross_entropy_with(&x.reshape(shape)?, &target, &options)
        })?;
        assert!(close(&y, &[loss_want]), "cross_entropy {what}: {y:?}");
        assert!(close(&g, grad_want), "cross_entropy {what} gradient: {g:?}");
    }
    // With label smoothing a -inf logit makes the loss inf, as PyTorch's.
    let smoothing = CrossEntropy {
        label_smoothing: 0.1,
        ..Default::default()
    };
    let target = candle_core::Tensor::new(&[2i64, 2, 0], &dev())?;
    let (y, _) = value_and_grad(&logits, |x| {
        loss::cross_entropy_with(&x.reshape((3, 3))?, &target, &smoothing)
    })?;
    assert!(close(&y, &[inf]), "{y:?}");
    Ok(())
}

/// The loss and the input's and target's gradients of `loss(x, t)`, one element each.
fn loss_and_grads(
    x: f32,
    t: f32,
    loss: impl Fn(&Tensor<F32>, &Tensor<F32>) -> Result<Tensor<F32>>,
) -> Result<[f32; 3]> {
    let (vx, vt) = (Var::new(&[x], &dev())?, Var::new(&[t], &dev())?);
    let typed = |v: &Var| Tensor::<F32>::from_candle(v.as_tensor().clone());
    let y = loss(&typed(&vx)?, &typed(&vt)?)?.into_candle();
    let grads = y.backward()?;
    let grad = |v: &Var| -> Result<f32> { Ok(grads.get(v).expect("a gradient").to_vec1()?[0]) };
    Ok([y.to_scalar::<f32>()?, grad(&vx)?, grad(&vt)?])
}

/// `smooth_l1` at an infinite difference: inf, and PyTorch's gradients `±1/n` (they were NaN:
/// the quadratic branch's zero gradient met `2 * inf`); `binary_cross_entropy_with_logits` at
/// infinite logits: the loss's limits (it was NaN at `(inf, 0)`, `(inf, 1)` and `(-inf, 0)`),
/// PyTorch's values and gradients elsewhere (torch 2.15, which is NaN at three of the four
/// infinite cases).
#[test]
fn smooth_l1_and_bce_at_infinities() -> Result<()> {
    use candle_amp::loss;
    let inf = f32::INFINITY;
    let x = Var::new(&[inf, 0.5], &dev())?;
    let t = Var::new(&[0f32, 0.0], &dev())?;
    let typed = |v: &Var| Tensor::<F32>::from_candle(v.as_tensor().clone());
    let y = loss::smooth_l1(&typed(&x)?, &typed(&t)?, 1.0)?.into_candle();
    let grads = y.backward()?;
    assert!(close(&[y.to_scalar::<f32>()?], &[inf]));
    assert!(close(
        &grads.get(&x).unwrap().to_vec1::<f32>()?,
        &[0.5, 0.25]
    ));
    assert!(close(
        &grads.get(&t).unwrap().to_vec1::<f32>()?,
        &[-0.5, -0.25]
    ));
    // (logit, target, loss, d logit, d target)
    let cases: [[f32; 5]; 9] = [
        [inf, 0.0, inf, 1.0, -inf],
        [inf, 1.0, 0.0, 0.0, -inf],
        [-inf, 1.0, inf, -1.0, inf],
        [-inf, 0.0, 0.0, 0.0, inf],
        [0.0, 0.0, std::f32::consts::LN_2, 0.5, 0.0],
        [0.0, 1.0, std::f32::consts::LN_2, -0.5, 0.0],
        [0.0, 0.3, std::f32::consts::LN_2, 0.2, 0.0],
        [2.0, 0.7, 0.726_928_06, 0.180_797_04, -2.0],
        [-3.0, 0.2, 0.648_587_2, -0.152_574_12, 3.0],
    ];
    for [x, t, want @ ..] in cases {
        let got = loss_and_grads(x, t, loss::binary_cross_entropy_with_logits)?;
        assert!(close(&got, &want), "bce({x}, {t}): {got:?} vs {want:?}");
    }
    Ok(())
}

// ---- The eighth sweep's findings: layers and attention against PyTorch. ----

/// A transposed convolution whose output padding is at least its stride (allowed with a larger
/// dilation) trained nowhere: candle's backward maps the output's gradient onto a larger input
/// (`shape mismatch in add`). Values and both gradients of `sum(y * r)`, `r` the output's
/// index / 10, against PyTorch's (torch 2.15), typed and through the layer.
#[test]
fn transposed_convs_with_output_padding_past_the_stride_train() -> Result<()> {
    // (padding, output_padding, stride, dilation, y, dx, dw)
    type Case<'a> = (usize, usize, usize, usize, &'a [f32], [f32; 4], [f32; 4]);
    let cases: [Case; 3] = [
        (
            0,
            1,
            1,
            2,
            &[
                1., 2., 2., 4., 0., 3., 4., 6., 8., 0., 3., 6., 4., 8., 0., 9., 12., 12., 16., 0.,
                0., 0., 0., 0., 0.,
            ],
            [8.2, 9.2, 13.2, 14.2],
            [4.1, 6.1, 14.1, 16.1],
        ),
        (
            1,
            2,
            1,
            3,
            &[
                4., 0., 6., 8., 0., 0., 0., 0., 0., 0., 6., 0., 4., 8., 0., 12., 0., 12., 16., 0.,
                0., 0., 0., 0., 0.,
            ],
            [4.8, 8.2, 7.2, 12.3],
            [0.0, 1.8, 8.0, 16.1],
        ),
        (2, 1, 1, 2, &[4.0], [0.0; 4], [0.0; 4]),
    ];
    for (padding, output_padding, stride, dilation, y_want, dx_want, dw_want) in cases {
        let what = format!("p {padding} op {output_padding} s {stride} d {dilation}");
        for layer in [false, true] {
            let x = Var::new(&[[[[1f32, 2.0], [3.0, 4.0]]]], &dev())?;
            let w = Var::new(&[[[[1f32, 2.0], [3.0, 4.0]]]], &dev())?;
            let typed = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
            let y = if layer {
                let config = nn::ConvTranspose2dConfig {
                    padding,
                    output_padding,
                    stride,
                    dilation,
                };
                nn::ConvTranspose2d::new(w.clone(), None, config)?.forward(&typed)?
            } else {
                let k = Tensor::<F32>::from_candle(w.as_tensor().clone())?;
                typed.conv_transpose2d(&k, padding, output_padding, stride, dilation)?
            };
            let y = y.into_candle();
            let r = (candle_core::Tensor::arange(0f32, y.elem_count() as f32, &dev())?
                .reshape(y.shape())?
                / 10.0)?;
            let grads = (&y * r)?.sum_all()?.backward()?;
            let flat = |t: &candle_core::Tensor| -> Result<Vec<f32>> { t.flatten_all()?.to_vec1() };
            let near = |got: &[f32], want: &[f32]| {
                got.len() == want.len()
                    && got
                        .iter()
                        .zip(want)
                        .all(|(g, w)| (g - w).abs() <= 1e-5 * w.abs().max(1.0))
            };
            let (gy, gx, gw) = (
                flat(&y)?,
                flat(grads.get(&x).expect("dx"))?,
                flat(grads.get(&w).expect("dw"))?,
            );
            assert!(near(&gy, y_want), "{what} layer {layer}: y {gy:?}");
            assert!(near(&gx, &dx_want), "{what} layer {layer}: dx {gx:?}");
            assert!(near(&gw, &dw_want), "{what} layer {layer}: dw {gw:?}");
        }
    }
    Ok(())
}

// ---- The tenth sweep's findings: the API's edges. ----

/// The scaler told optimizers apart by their address: a fresh SGD per parameter group in a loop
/// (the same stack slot each time) was refused as "already stepped", and one moved into a `Box`
/// between two steps stepped twice. candle-amp's optimizers now carry an identity of their own.
#[test]
fn the_scaler_tells_optimizers_apart_wherever_they_live() -> Result<()> {
    let (a, b) = (
        Var::ones(2, DType::F32, &dev())?,
        Var::ones(2, DType::F32, &dev())?,
    );
    let mut scaler = candle_amp::GradScaler::new();
    let loss = (a.as_tensor().sum_all()? + b.as_tensor().sum_all()?)?;
    for var in [&a, &b] {
        let mut opt = SGD::new(vec![var.clone()], 0.5)?;
        let outcome = scaler.step(&mut opt, scaler.scale(&loss)?.backward()?)?;
        assert_eq!(outcome, candle_amp::StepOutcome::Stepped);
    }
    assert_eq!(a.as_tensor().to_vec1::<f32>()?, [0.5, 0.5]);
    assert_eq!(b.as_tensor().to_vec1::<f32>()?, [0.5, 0.5]);
    scaler.update()?;
    let mut opt = SGD::new(vec![a.clone()], 0.5)?;
    let outcome = scaler.step(&mut opt, scaler.scale(&loss)?.backward()?)?;
    assert_eq!(outcome, candle_amp::StepOutcome::Stepped);
    let mut moved = Box::new(opt);
    assert_err(
        "the same optimizer, moved",
        scaler.step(moved.as_mut(), scaler.scale(&loss)?.backward()?),
        "already stepped",
    );
    assert_eq!(a.as_tensor().to_vec1::<f32>()?, [0.0, 0.0]);
    Ok(())
}

/// Edges of the typed API and of state, each against PyTorch: an inclusive index range to
/// `usize::MAX` panicked in candle; `chunk` of an empty dimension gave no chunk (PyTorch: as
/// many empty ones as asked); `clamp` skipped a NaN bound (PyTorch: all NaN); `rand(1, 1)`
/// failed in candle's generator (PyTorch's `uniform_(1, 1)`: ones); an optimizer given a
/// variable twice saved a checkpoint it could not load (now an error at once; `push` of a
/// held variable adds nothing); an unknown `scaler.*` entry in a checkpoint was accepted; the
/// builder's errors named `scale` for `init_scale` and `inf` for `max_scale(1e39)`.
#[test]
fn edges_of_tensors_optimizers_and_state() -> Result<()> {
    let x = Tensor::<F32>::new(&[[1f32, 2., 3.], [4., 5., 6.]], &dev())?;
    assert_err(
        "i(.., 0..=usize::MAX)",
        x.i((.., 0..=usize::MAX)),
        "index range past the end",
    );
    let empty = Tensor::<F32>::zeros((0, 3), &dev())?;
    let chunks = empty.chunk(2, 0)?;
    assert_eq!(chunks.len(), 2);
    assert!(chunks.iter().all(|c| c.dims() == [0, 3]));
    let y = Tensor::<F32>::new(&[1f32, 2., 3.], &dev())?;
    for (lo, hi) in [(f64::NAN, 2.0), (1.0, f64::NAN)] {
        let v = y.clamp(lo, hi)?.to_vec1::<f32>()?;
        assert!(v.iter().all(|v| v.is_nan()), "clamp({lo}, {hi}): {v:?}");
    }
    assert_eq!(
        Tensor::<F32>::rand(1.0, 1.0, 3, &dev())?.to_vec1::<f32>()?,
        [1.0; 3]
    );
    let w = Var::ones(2, DType::F32, &dev())?;
    assert_err(
        "AdamW given w twice",
        AdamW::new(vec![w.clone(), w.clone()], ParamsAdamW::default()),
        "given twice",
    );
    assert_err(
        "SGD given w twice",
        SGD::new(vec![w.clone(), w.clone()], 0.1),
        "given twice",
    );
    let mut sgd = SGD::new(vec![w.clone()], 0.1)?;
    sgd.push(&w);
    assert_eq!(sgd.into_inner().len(), 1);

    let vars = VarMap::new();
    let _ = nn::linear(
        2,
        1,
        VarBuilder::from_varmap(&vars, DType::F32, &dev()).pp("l"),
    )?;
    let mut opt = SGD::new(vars.all_vars(), 0.1)?;
    let mut scaler = candle_amp::GradScaler::new();
    let path = std::env::temp_dir().join(format!("candle-amp-extra-{}.st", std::process::id()));
    candle_amp::checkpoint::save(&path, &vars, &opt, &scaler, 3)?;
    let mut tensors = candle_core::safetensors::load(&path, &dev())?;
    tensors.insert(
        "scaler.unknown".into(),
        candle_core::Tensor::new(1f32, &dev())?,
    );
    candle_core::safetensors::save(&tensors, &path)?;
    assert_err(
        "an unknown scaler entry",
        candle_amp::checkpoint::load(&path, &vars, &mut opt, &mut scaler),
        "unexpected entry `scaler.unknown`",
    );
    std::fs::remove_file(&path)?;

    assert_err(
        "init_scale above max_scale",
        candle_amp::GradScaler::builder()
            .init_scale(1e6)
            .max_scale(1e3)
            .build(),
        "`init_scale`: must lie within",
    );
    let said = message(
        "max_scale(1e39)",
        candle_amp::GradScaler::builder().max_scale(1e39).build(),
    );
    assert!(
        said.contains("`max_scale`")
            && said.contains("got 1000000000000000000000000000000000000000"),
        "{said}"
    );
    Ok(())
}

/// The eleventh sweep's: `smooth_l1` with a beta whose `0.5 / beta` overflows f32 gave NaN
/// gradients (it is L1 there, as at beta = 0; PyTorch: `[1/3, -1/3, 1/3]`), and a class
/// weight that is a strided view was refused with candle's `index-select only supports
/// contiguous tensors` (PyTorch takes it: the loss of the same weight, contiguous).
#[test]
fn smooth_l1_at_a_tiny_beta_and_a_strided_class_weight() -> Result<()> {
    use candle_amp::loss::{self, CrossEntropy};
    use candle_core::IndexOp;
    let p = Var::new(&[0.5f32, -2.0, 3.0], &dev())?;
    let zeros = Tensor::<F32>::zeros(3, &dev())?;
    let typed = Tensor::<F32>::from_candle(p.as_tensor().clone())?;
    let y = loss::smooth_l1(&typed, &zeros, 1e-300)?.into_candle();
    let g = y
        .backward()?
        .get(&p)
        .expect("a gradient")
        .to_vec1::<f32>()?;
    let third = 1.0f32 / 3.0;
    assert_eq!(g, [third, -third, third]);
    let x = Tensor::<F32>::new(&[[1f32, 2.0, 0.5], [0.1, 0.2, 3.0]], &dev())?;
    let t = candle_core::Tensor::new(&[0u32, 2], &dev())?;
    let strided = candle_core::Tensor::new(&[1f32, 9., 2., 9., 3., 9.], &dev())?
        .reshape((3, 2))?
        .i((.., 0))?;
    let contiguous = candle_core::Tensor::new(&[1f32, 2.0, 3.0], &dev())?;
    let with = |w: candle_core::Tensor| -> Result<f32> {
        let options = CrossEntropy {
            weight: Some(w),
            ..Default::default()
        };
        loss::cross_entropy_with(&x, &t, &options)?
            .into_candle()
            .to_scalar::<f32>()
    };
    assert_eq!(with(strided)?.to_bits(), with(contiguous)?.to_bits());
    Ok(())
}

// ---- Degenerate shapes (sweep 13), each against PyTorch 2.15. ----

#[autocast(fp16)]
fn narrowed_in_region(x: &Tensor<F32>) -> Result<Tensor<F32>> {
    let column = x.narrow(1, 1, 1)?;
    let halves = x.chunk(2, 1)?;
    Ok((column.relu()?.sum_all()? + halves[1].sum_all()?)?)
}

/// An empty tensor narrowed at a non-zero offset (an empty last batch whose features are split)
/// panicked when read: candle keeps the offset into a storage of no element. PyTorch reads an
/// empty tensor, and the source gets a zero gradient.
#[test]
fn empty_views_at_an_offset_are_read_as_empty() -> Result<()> {
    let w = Var::zeros((0, 3), DType::F32, &dev())?;
    let x = Tensor::<F32>::from_candle(w.as_tensor().clone())?;
    let column = x.narrow(1, 1, 1)?;
    assert_eq!(column.dims(), [0, 1]);
    assert_eq!(column.relu()?.sum_all()?.to_scalar::<f32>()?.to_bits(), 0);
    assert_eq!(column.cast::<F16>()?.to_vec2::<half::f16>()?.len(), 0);
    let grads = column.sum_all()?.as_candle().backward()?;
    assert_eq!(grads.get(w.as_tensor()).expect("a gradient").dims(), [0, 3]);
    assert_eq!(x.i((.., 2))?.to_vec1::<f32>()?, Vec::<f32>::new());
    let chunks = Tensor::<F32>::zeros((0, 4), &dev())?.chunk(2, 1)?;
    assert_eq!(chunks[1].dims(), [0, 2]);
    assert_eq!(chunks[1].sum_all()?.to_scalar::<f32>()?.to_bits(), 0);
    assert_eq!(narrowed_in_region(&x)?.to_scalar::<f32>()?.to_bits(), 0);
    Ok(())
}

/// The typed `chunk` splits as PyTorch's: pieces of `ceil(n / chunks)`, fewer pieces when they
/// run out (`torch.zeros(n).chunk(c)`'s sizes); candle spread the remainder over the first.
#[test]
fn typed_chunk_splits_as_pytorch() -> Result<()> {
    for (n, chunks, sizes) in [
        (7, 3, vec![3, 3, 1]),
        (6, 4, vec![2, 2, 2]),
        (5, 4, vec![2, 2, 1]),
        (10, 4, vec![3, 3, 3, 1]),
        (2, 5, vec![1, 1]),
        (6, 3, vec![2, 2, 2]),
    ] {
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let x = Tensor::<F32>::new(values.as_slice(), &dev())?;
        let pieces = x.chunk(chunks, 0)?;
        let got: Vec<usize> = pieces.iter().map(|p| p.dims()[0]).collect();
        assert_eq!(got, sizes, "{n} in {chunks}");
        let joined: Vec<f32> = pieces
            .iter()
            .map(Tensor::to_vec1::<f32>)
            .collect::<Result<Vec<_>>>()?
            .concat();
        assert_eq!(joined, x.to_vec1::<f32>()?, "{n} in {chunks}: in order");
    }
    Ok(())
}

/// Maxima, minima and argmax over a non-empty dimension of an empty batch are as empty, as
/// PyTorch's (candle refused any empty tensor, "empty tensor for reduce"); over an empty
/// dimension an error, as PyTorch's "Expected reduction dim 1 to have non-zero size".
#[test]
fn extrema_of_an_empty_batch_are_empty() -> Result<()> {
    let x = Tensor::<F32>::zeros((0, 10), &dev())?;
    assert_eq!(x.max(1)?.dims(), [0]);
    assert_eq!(x.min_keepdim(1)?.dims(), [0, 1]);
    assert_eq!(x.argmax(1)?.dims(), [0]);
    assert_eq!(x.cast::<BF16>()?.max(1)?.dims(), [0]);
    let column = Tensor::<F32>::zeros((3, 0), &dev())?;
    assert_err(
        "max over an empty dim",
        column.max(1),
        "reduced dimension 1",
    );
    assert_err("argmax over an empty dim", column.argmax(1), "is empty");
    assert_err("max_all of nothing", column.max_all(), "is empty");
    Ok(())
}

/// Batch norm training on an input of no value per channel (an empty batch, an empty image)
/// returns it as it is and leaves the running statistics, as PyTorch's; it was an error saying
/// "more than one value" is needed. One value per channel is still an error, as PyTorch's.
/// `ConvBn2d` on an empty batch gives its conv's empty output.
#[test]
fn batch_norm_of_no_value_is_empty_and_leaves_the_statistics() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let bn = nn::batch_norm2d(2, 1e-5, vb.pp("bn"))?;
    for dims in [(0, 2, 3, 3), (2, 2, 0, 3)] {
        let x = Tensor::<F32>::zeros(dims, &dev())?;
        assert_eq!(bn.forward_train(&x)?.dims(), x.dims());
        assert_eq!(bn.forward_train(&x.cast::<F16>()?)?.dims(), x.dims());
    }
    assert_eq!(bn.running_mean().as_tensor().to_vec1::<f32>()?, [0.0, 0.0]);
    assert_eq!(bn.running_var().as_tensor().to_vec1::<f32>()?, [1.0, 1.0]);
    assert_err(
        "one value per channel",
        bn.forward_train(&Tensor::<F32>::zeros((1, 2, 1, 1), &dev())?),
        "more than one value per channel",
    );
    let conv = nn::conv2d(3, 2, 3, Conv2dConfig::default(), vb.pp("conv"))?;
    let cbn = nn::ConvBn2d::new(conv, nn::batch_norm2d(2, 1e-5, vb.pp("bn2"))?)?;
    let y = cbn.forward_t(&Tensor::<F32>::zeros((0, 3, 5, 5), &dev())?, true)?;
    assert_eq!(y.dims(), [0, 2, 3, 3]);
    Ok(())
}

/// `GroupNorm` on one sample whose groups hold one value each is an error, as PyTorch's
/// `F.group_norm` ("Expected more than 1 value per channel"); it returned the shift.
#[test]
fn group_norm_of_one_value_per_group_is_an_error() -> Result<()> {
    let vars = VarMap::new();
    let gn = nn::group_norm(
        4,
        4,
        1e-5,
        VarBuilder::from_varmap(&vars, DType::F32, &dev()),
    )?;
    let one = Tensor::<F32>::ones((1, 4, 1, 1), &dev())?;
    assert_err(
        "GroupNorm (1, 4, 1, 1)",
        gn.forward(&one),
        "one value per group",
    );
    // Two samples: PyTorch lets it through (each group's output is the shift), as here.
    let two = Tensor::<F32>::ones((2, 4, 1, 1), &dev())?;
    assert_eq!(gn.forward(&two)?.to_flat_vec::<f32>()?, [0.0; 8]);
    Ok(())
}

/// `nll` and `cross_entropy` of a transposed or broadcast view read it as PyTorch's do (the
/// values of the same data made contiguous, and a hand computation), where candle's gather
/// refused the view, naming itself.
#[test]
fn losses_read_views_of_their_inputs() -> Result<()> {
    let logp = Tensor::<F32>::new(&[[-0.1f32, -0.3], [-0.2, -0.4], [-0.5, -0.6]], &dev())?;
    let ids = candle_core::Tensor::new(&[1u32, 0], &dev())?;
    // logp.t() is (2, 3): rows [-0.1, -0.2, -0.5] and [-0.3, -0.4, -0.6]; nll = -(-0.2 - 0.3) / 2.
    let got = candle_amp::loss::nll(&logp.t()?, &ids)?.to_scalar::<f32>()?;
    assert!((got - 0.25).abs() < 1e-6, "{got}");
    let logits = Tensor::<F32>::new(&[[1f32, 2., 3.], [1., 0., -1.]], &dev())?;
    let one = candle_core::Tensor::new(&[2u32], &dev())?;
    let broadcast = one.broadcast_as(2)?;
    let want =
        candle_amp::loss::cross_entropy(&logits, &candle_core::Tensor::new(&[2u32, 2], &dev())?)?;
    let got = candle_amp::loss::cross_entropy(&logits, &broadcast)?;
    assert_eq!(
        got.to_scalar::<f32>()?.to_bits(),
        want.to_scalar::<f32>()?.to_bits()
    );
    Ok(())
}

/// A loss with a custom gradient (`binary_cross_entropy_with_logits`, `smooth_l1`) over an
/// empty batch gives the weight before it a zero gradient, as PyTorch's; candle's subtraction
/// returned its left operand for an empty result and dropped the gradient (a weight decay then
/// skipped the weight).
#[test]
fn an_empty_batch_still_reaches_the_weights() -> Result<()> {
    let w = Var::ones((3, 2), DType::F32, &dev())?;
    let wt = Tensor::<F32>::from_candle(w.as_tensor().clone())?;
    let h = Tensor::<F32>::zeros((0, 3), &dev())?.matmul(&wt)?;
    let target = Tensor::<F32>::zeros((0, 2), &dev())?;
    for (what, l) in [
        (
            "bce",
            candle_amp::loss::binary_cross_entropy_with_logits(&h, &target)?,
        ),
        ("smooth_l1", candle_amp::loss::smooth_l1(&h, &target, 1.0)?),
    ] {
        let grads = l.as_candle().backward()?;
        let g = grads.get(w.as_tensor()).expect(what);
        assert_eq!(g.to_vec2::<f32>()?, vec![vec![0.0; 2]; 3], "{what}");
    }
    Ok(())
}

/// Pools take one image `(c, h, w)` as PyTorch's do (an unbatched input: a batch of one); it
/// was candle's "unexpected rank", naming no op. Another rank names the op.
#[test]
fn pools_take_an_unbatched_image() -> Result<()> {
    let x = image::<F32>((1, 2, 4, 4))?;
    let one = x.squeeze(0)?;
    for (max, stride) in [(true, 2), (false, 2), (true, 1)] {
        let pool = |t: &Tensor<F32>| {
            if max {
                nn::MaxPool2d::with_stride(2, stride).forward(t)
            } else {
                nn::AvgPool2d::with_stride(2, stride).forward(t)
            }
        };
        let batched = pool(&x)?.squeeze(0)?.to_flat_vec::<f32>()?;
        assert_eq!(pool(&one)?.to_flat_vec::<f32>()?, batched, "max {max}");
    }
    assert_err(
        "max_pool2d of rank 2",
        nn::MaxPool2d::new(2).forward(&Tensor::<F32>::zeros((4, 4), &dev())?),
        "max_pool2d: the input is (batch, channels, h, w) or (channels, h, w)",
    );
    Ok(())
}

#[autocast(bf16)]
fn scaled_in_region(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    Ok(x.broadcast_mul(w)?.sum_all()?)
}

/// An empty product's right operand gets a zero gradient, as in PyTorch (`torch.zeros(0, 1) *
/// w` with `w` of `(1, 3)`: `w.grad` is zeros); candle's binary ops returned their left
/// operand for an empty result, and `w` got no gradient, typed and in a region.
#[test]
fn an_empty_product_still_reaches_both_operands() -> Result<()> {
    let w = Var::ones((1, 3), DType::F32, &dev())?;
    let wt = Tensor::<F32>::from_candle(w.as_tensor().clone())?;
    let x = Tensor::<F32>::zeros((0, 1), &dev())?;
    for (what, l) in [
        ("typed", x.broadcast_mul(&wt)?.sum_all()?),
        (
            "typed operator",
            (&x.broadcast_as((0, 3))? * &wt.broadcast_as((0, 3))?)?.sum_all()?,
        ),
        ("region", scaled_in_region(&x, &wt)?),
    ] {
        let grads = l.as_candle().backward()?;
        let g = grads.get(w.as_tensor()).expect(what);
        assert_eq!(g.to_vec2::<f32>()?, vec![vec![0.0; 3]], "{what}");
    }
    Ok(())
}

// ---- Indexing, broadcasting and joining (sweep 14), each against PyTorch 2.15. ----

/// `index_select` checks its ids' range: candle read a dtype's largest value (`u8` 255,
/// `u32::MAX`) as "no row" and gave zeros, so row 255 of a 256-row table was never selected
/// nor trained. A rank-0 id is one id, and a transposed view is read, as PyTorch's.
#[test]
fn index_select_takes_every_id_in_range_and_refuses_the_others() -> Result<()> {
    let values: Vec<f32> = (0..512).map(|i| i as f32).collect();
    let x = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(values, (256, 2), &dev())?)?;
    let row = |ids: candle_core::Tensor| x.index_select(&ids, 0);
    assert_eq!(
        row(candle_core::Tensor::new(&[255u8], &dev())?)?.to_vec2::<f32>()?,
        [[510.0, 511.0]]
    );
    for (what, ids) in [
        ("u32::MAX", candle_core::Tensor::new(&[u32::MAX], &dev())?),
        ("-1", candle_core::Tensor::new(&[-1i64], &dev())?),
        ("256", candle_core::Tensor::new(&[256u32], &dev())?),
    ] {
        assert_err(what, row(ids), "out of range for dimension 0 of size 256");
    }
    assert_eq!(row(candle_core::Tensor::new(3u32, &dev())?)?.dims(), [1, 2]);
    let t = x
        .t()?
        .index_select(&candle_core::Tensor::new(&[1u32, 1], &dev())?, 0)?;
    assert_eq!(t.dims(), [2, 256]);
    assert_eq!(t.to_vec2::<f32>()?[1][255].to_bits(), 511f32.to_bits());
    Ok(())
}

/// A half tensor's `index_select` sums the gradients of repeated ids in f32, as PyTorch's
/// (1000 repeats of id 0 in bf16: PyTorch's gradient 1000; candle's `index_add` in bf16 stopped
/// at 256).
#[test]
fn repeated_ids_sum_their_gradients_in_f32() -> Result<()> {
    let w = Var::ones((2, 1), DType::F32, &dev())?;
    let ids = candle_core::Tensor::new(vec![0u32; 1000].as_slice(), &dev())?;
    let y = Tensor::<F32>::from_candle(w.as_tensor().clone())?
        .cast::<BF16>()?
        .index_select(&ids, 0)?;
    let grads = candle_amp::fp32::sum_all(&y)?.as_candle().backward()?;
    assert_eq!(
        grads.get(w.as_tensor()).expect("w").to_vec2::<f32>()?,
        [[1000.0], [0.0]]
    );
    Ok(())
}

#[autocast(fp16)]
fn half_plus_scalar_tensor(
    x: &Tensor<F32>,
    w: &Tensor<F32>,
    s: &Tensor<F32>,
) -> Result<Tensor<F32>> {
    let h = x.matmul(w)?;
    let dtype = h.broadcast_add(s)?.dtype();
    assert_eq!(
        dtype,
        DType::F16,
        "a rank-0 f32 tensor does not promote a half one"
    );
    Ok(h.broadcast_add(s)?.sum_all()?)
}

/// In a region a rank-0 f32 tensor does not promote a dimensioned half one, as in PyTorch
/// (`half_tensor + torch.tensor(0.5)` is half); two dimensioned ones still promote.
#[test]
fn a_zero_dimensional_tensor_does_not_promote() -> Result<()> {
    let x = Tensor::<F32>::ones((2, 3), &dev())?;
    let w = Tensor::<F32>::ones((3, 2), &dev())?;
    let s = Tensor::<F32>::new(0.5f32, &dev())?;
    assert_eq!(
        half_plus_scalar_tensor(&x, &w, &s)?
            .to_scalar::<f32>()?
            .to_bits(),
        14f32.to_bits()
    );
    Ok(())
}

/// `broadcast_matmul` with both operands broadcast (`(2, 1, 3, 4) x (5, 4, 2)`), as candle's
/// and PyTorch's `matmul`: the typed f32 op failed on the two zero strides.
#[test]
fn broadcast_matmul_broadcasts_both_operands() -> Result<()> {
    let a = Tensor::<F32>::randn(0.0, 1.0, (2, 1, 3, 4), &dev())?;
    let b = Tensor::<F32>::randn(0.0, 1.0, (5, 4, 2), &dev())?;
    let got = a.broadcast_matmul(&b)?;
    let want = a.as_candle().broadcast_matmul(b.as_candle())?;
    assert_eq!(got.dims(), [2, 5, 3, 2]);
    assert_eq!(
        got.to_flat_vec::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}

/// Joining and indexing errors name the op the user called: `stack` of two shapes named `cat`,
/// `cat` of two ranks named no op, an index past the end named `narrow`.
#[test]
fn joining_and_indexing_errors_name_their_op() -> Result<()> {
    let (a, b) = (
        Tensor::<F32>::zeros(2, &dev())?,
        Tensor::<F32>::zeros(3, &dev())?,
    );
    assert_err(
        "stack",
        Tensor::stack(&[&a, &b], 0),
        "stack: the tensors must be of one shape: tensor 1 is [3], tensor 0 [2]",
    );
    let m = Tensor::<F32>::zeros((2, 3), &dev())?;
    assert_err(
        "cat",
        Tensor::cat(&[&m, &b], 0),
        "cat: the tensors must be of one rank",
    );
    assert_err(
        "i",
        m.i((.., 4)),
        "i: an index out of range of the dimensions [2, 3]",
    );
    Ok(())
}

// ---- Layer sizes no allocation can hold (sweep 17), as PyTorch's "can't allocate memory". ----

/// A layer whose parameter's size overflows (`usize::MAX / 2` inputs: candle's element count
/// panicked) or passes the address space is an error naming the parameter; so is one the
/// machine cannot map (4 TiB: the allocation aborted the process), checked where the kernel
/// refuses such a mapping (overcommit modes 0 and 2).
#[test]
fn layers_too_large_to_allocate_are_errors() {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev());
    let huge = usize::MAX / 2;
    assert_err(
        "linear(usize::MAX / 2, 4)",
        nn::linear(huge, 4, vb.pp("a")),
        "parameter `a.weight`: an output of shape",
    );
    assert_err(
        "embedding(usize::MAX / 2, 4)",
        nn::embedding(huge, 4, vb.pp("e")),
        "too large to allocate",
    );
    assert_err(
        "conv2d with 2^24 channels in and out",
        nn::conv2d(1 << 24, 1 << 24, 3, Conv2dConfig::default(), vb.pp("c")),
        "too large to allocate",
    );
    let refuses_overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
        .is_ok_and(|mode| matches!(mode.trim(), "0" | "2"));
    if refuses_overcommit {
        assert_err(
            "linear(1 << 20, 1 << 20)",
            nn::linear(1 << 20, 1 << 20, vb.pp("big")),
            "cannot allocate 4398046511104 bytes",
        );
    }
}

#[autocast(bf16)]
fn strided_pools(
    x: &candle_core::Tensor,
    kernel: usize,
    stride: usize,
) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
    let max = x.max_pool2d_with_stride(kernel, stride)?;
    let avg = x.avg_pool2d_with_stride(kernel, stride)?;
    Ok((max, avg))
}

/// candle's spellings of strided pooling, `max_pool2d_with_stride`/`avg_pool2d_with_stride`, are
/// candle-amp's pools in a region, as `max_pool2d`/`avg_pool2d` are: candle's own panicked on a
/// stride or max kernel of 0, returned a wrongly shaped tensor for an avg kernel of 0, and had
/// no backward for a stride other than the window (the ResNet stem's `(3, 2)`).
#[test]
fn strided_pools_in_a_region_are_checked_and_train() -> Result<()> {
    // A 3x3 image 0..9, windows of 2 every 1.
    let x = Var::from_vec((0..9).map(|v| v as f32).collect(), (1, 1, 3, 3), &dev())?;
    let (max, avg) = strided_pools(x.as_tensor(), 2, 1)?;
    assert_eq!(max.flatten_all()?.to_vec1::<f32>()?, [4.0, 5.0, 7.0, 8.0]);
    assert_eq!(avg.flatten_all()?.to_vec1::<f32>()?, [2.0, 3.0, 5.0, 6.0]);
    // By hand: each max is the window's bottom-right value (gradient 1 there); each input
    // gets a quarter per window holding it from the mean.
    let grads = (max.sum_all()? + avg.sum_all()?)?.backward()?;
    let want = [0.25, 0.5, 0.25, 0.5, 2.0, 1.5, 0.25, 1.5, 1.25];
    assert_eq!(
        grads
            .get(&x)
            .expect("a gradient")
            .flatten_all()?
            .to_vec1::<f32>()?,
        want
    );
    for (kernel, stride) in [(2, 0), (0, 1)] {
        let what = format!("kernel {kernel}, stride {stride}");
        let err = strided_pools(x.as_tensor(), kernel, stride)
            .expect_err(&what)
            .to_string();
        assert!(
            err.contains("pool2d") && err.contains("must be positive"),
            "{what}: {err}"
        );
    }
    Ok(())
}
