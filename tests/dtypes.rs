//! Tensors outside the f32/f16/bf16 family, as PyTorch treats them under autocast: integer ids
//! select every row their dtype can name, f64 values are never cast (autocast leaves them
//! alone), and an integer tensor given to an op that computes in floating point is an error
//! naming the cast, never a value of candle's integer arithmetic. Each expectation is
//! PyTorch 2.15's (the snippet is in each test's doc) or a hand computation.

use candle_amp::{autocast, loss, Tensor, F32};
use candle_core::{DType, Device, Result, Var};
use candle_nn::{VarBuilder, VarMap};

fn dev() -> Device {
    Device::Cpu
}

fn ids_u8(ids: &[u8]) -> Result<candle_core::Tensor> {
    candle_core::Tensor::new(ids, &dev())
}

// ---- Integer ids: a u8 255 is an id (candle's gathering kernels read it as "no row"). ----

#[autocast(bf16)]
fn cross_entropy_in_region(x: &Tensor<F32>, target: &candle_core::Tensor) -> Result<Tensor<F32>> {
    loss::cross_entropy(x, target)
}

#[autocast(bf16)]
fn candle_nll_in_region(
    logp: &candle_core::Tensor,
    target: &candle_core::Tensor,
) -> Result<candle_core::Tensor> {
    candle_nn::loss::nll(logp, target)
}

/// Class 255 of a `u8` target is a class: `F.cross_entropy(torch.zeros(2, 256),
/// torch.tensor([255, 0]))` is `ln 256` = 5.5452 and the gradient at `[0, 255]` is
/// `(1/256 - 1) / 2` = -0.498046875; candle's gather gave that row 0 and no gradient (2.7726).
/// Typed, in a region, and candle-nn's `nll` in a region.
#[test]
fn a_u8_class_id_255_is_a_class() -> Result<()> {
    let x = Var::zeros((2, 256), DType::F32, &dev())?;
    let typed = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
    let target = ids_u8(&[255, 0])?;
    let ln256 = 256f32.ln();
    for (what, l) in [
        ("typed", loss::cross_entropy(&typed, &target)?),
        ("region", cross_entropy_in_region(&typed, &target)?),
    ] {
        let v = l.as_candle().to_scalar::<f32>()?;
        assert!((v - ln256).abs() < 1e-6, "{what}: {v}, PyTorch {ln256}");
        let g = l.as_candle().backward()?;
        let g = g
            .get(x.as_tensor())
            .expect("the logits' gradient")
            .to_vec2::<f32>()?;
        assert_eq!(g[0][255].to_bits(), (-0.498_046_88_f32).to_bits(), "{what}");
        assert_eq!(g[1][0].to_bits(), (-0.498_046_88_f32).to_bits(), "{what}");
    }
    // log-probabilities -j/100 at class j: the mean of 2.55 and 0.
    let logp: Vec<f32> = (0..2 * 256).map(|i| -((i % 256) as f32) / 100.0).collect();
    let logp = candle_core::Tensor::from_vec(logp, (2, 256), &dev())?;
    let typed = Tensor::<F32>::from_candle(logp.clone())?;
    for (what, v) in [
        (
            "typed",
            loss::nll(&typed, &target)?.as_candle().to_scalar::<f32>()?,
        ),
        (
            "candle-nn in a region",
            candle_nll_in_region(&logp, &target)?.to_scalar::<f32>()?,
        ),
    ] {
        assert!((v - 1.275).abs() < 1e-6, "{what}: {v}, PyTorch 1.275");
    }
    Ok(())
}

#[autocast(bf16)]
fn candle_embedding_in_region(
    e: &candle_nn::Embedding,
    ids: &candle_core::Tensor,
) -> Result<Tensor<F32>> {
    e.forward(ids)
}

/// candle-nn's `Embedding` called in a region looks rows up as candle-amp's does: a `u8` id 255
/// is row 255 (`nn.Embedding(256, 2)(torch.tensor([255]))`), an id past the table is an error
/// (PyTorch's `IndexError`), where candle's lookup gave zeros for both; the ids' shape is kept.
#[test]
fn candle_embedding_in_a_region_reads_every_id() -> Result<()> {
    let table: Vec<f32> = (0..512).map(|i| i as f32).collect();
    let table = candle_core::Tensor::from_vec(table, (256, 2), &dev())?;
    let e = candle_nn::Embedding::new(table, 2);
    let y = candle_embedding_in_region(&e, &candle_core::Tensor::new(&[[255u8, 1]], &dev())?)?;
    assert_eq!(y.dims(), [1, 2, 2]);
    assert_eq!(
        y.as_candle().to_vec3::<f32>()?,
        [[[510.0, 511.0], [2.0, 3.0]]]
    );
    let small = VarMap::new();
    let e = candle_nn::embedding(4, 2, VarBuilder::from_varmap(&small, DType::F32, &dev()))?;
    for ids in [
        candle_core::Tensor::new(&[u32::MAX], &dev())?,
        candle_core::Tensor::new(&[4u32], &dev())?,
        candle_core::Tensor::new(&[-1i64], &dev())?,
    ] {
        let err = candle_embedding_in_region(&e, &ids).expect_err("an id past the table");
        assert!(
            err.to_string().contains("outside the vocabulary of 4"),
            "{err}"
        );
    }
    Ok(())
}

// ---- f64: autocast never casts it (PyTorch's `is_autocast_eligible`); ops run on it in f64. ----

type Candle = candle_core::Tensor;

fn f64s(values: &[f64]) -> Result<Candle> {
    Candle::new(values, &dev())?.unsqueeze(0)
}

#[autocast(bf16)]
fn softmax_in_region(a: &Candle) -> Result<Candle> {
    candle_nn::ops::softmax_last_dim(a)
}

#[autocast(bf16)]
fn log_softmax_in_region(a: &Candle) -> Result<Candle> {
    candle_nn::ops::log_softmax(a, 1)
}

#[autocast(bf16)]
fn layer_norm_in_region(a: &Candle, w: &Candle, b: &Candle) -> Result<Candle> {
    candle_nn::ops::layer_norm(a, w, b, 1e-5)
}

#[autocast(bf16)]
fn cross_entropy_f64_in_region(a: &Candle, t: &Candle) -> Result<Candle> {
    candle_nn::loss::cross_entropy(a, t)
}

#[autocast(bf16)]
fn mse_in_region(a: &Candle, t: &Candle) -> Result<Candle> {
    candle_nn::loss::mse(a, t)
}

#[autocast(bf16)]
fn add_in_region(a: &Candle, b: &Candle) -> Result<Candle> {
    a.broadcast_add(b)
}

fn values(t: &Candle) -> Result<Vec<f64>> {
    assert_eq!(t.dtype(), DType::F64, "an f64 input keeps its dtype");
    t.flatten_all()?.to_vec1::<f64>()
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= tol, "{what}: {got:?}, PyTorch {want:?}");
    }
}

/// The fp32-class ops on f64 values run in f64, as under `torch.autocast("cpu",
/// dtype=torch.bfloat16)` (PyTorch 2.15's values below); before, their fused f32 kernels read
/// the f64 input and answered in f32, where 1e-9 apart is no difference: a softmax of
/// `[0, 1e-9]` gave exactly `[0.5, 0.5]` and an mse of 1e-10 apart gave 0.
#[test]
fn fp32_class_ops_keep_f64() -> Result<()> {
    let x = f64s(&[0.0, 1e-9])?;
    close(
        "softmax",
        &values(&softmax_in_region(&x)?)?,
        &[0.499_999_999_750_000_03, 0.500_000_000_25],
        1e-16,
    );
    close(
        "log_softmax",
        &values(&log_softmax_in_region(&x)?)?,
        &[-0.693_147_181_059_945_2, -0.693_147_180_059_945_2],
        1e-15,
    );
    let row = f64s(&[1.0, 1.0 + 1e-9, 1.0 - 1e-9, 1.0])?;
    let (w, b) = (
        Candle::ones(4, DType::F64, &dev())?,
        Candle::zeros(4, DType::F64, &dev())?,
    );
    close(
        "layer_norm",
        &values(&layer_norm_in_region(&row, &w, &b)?)?,
        // candle-nn's `layer_norm` takes its eps as an f32: PyTorch's with
        // `eps=float(np.float32(1e-5))`.
        &[
            0.0,
            3.162_277_961_759_257_4e-7,
            -3.162_277_610_675_906_3e-7,
            0.0,
        ],
        1e-15,
    );
    let target = Candle::new(&[1u32], &dev())?;
    close(
        "cross_entropy",
        &values(&cross_entropy_f64_in_region(&x, &target)?)?,
        &[0.693_147_180_059_945_2],
        1e-15,
    );
    let (p, t) = (f64s(&[1.0])?, f64s(&[1.0 + 1e-10])?);
    close(
        "mse",
        &values(&mse_in_region(&p, &t)?)?,
        &[1.000_000_165_480_748_8e-20],
        1e-30,
    );
    Ok(())
}

/// A promoting op with an f64 operand runs in f64: `f64 [1] + f32 [1e-12]` is
/// 1.000000000001 (the f32 rounding of 1e-12 added in f64), where candle refused the mixed
/// dtypes ("dtype mismatch in add").
#[test]
fn promotion_with_f64_gives_f64() -> Result<()> {
    let sum = add_in_region(&f64s(&[1.0])?, &Candle::new(&[1e-12f32], &dev())?)?;
    close(
        "f64 + f32",
        &values(&sum)?,
        &[1.0 + f64::from(1e-12f32)],
        0.0,
    );
    let sum = add_in_region(&f64s(&[1.0])?, &Candle::new(&[half::bf16::ONE], &dev())?)?;
    close("f64 + bf16", &values(&sum)?, &[2.0], 0.0);
    Ok(())
}

// ---- Integer tensors given to floating-point math, and integer sums. ----

#[autocast(bf16)]
fn exp_in_region(a: &Candle) -> Result<Candle> {
    a.exp()
}

#[autocast(bf16)]
fn sqrt_in_region(a: &Candle) -> Result<Candle> {
    a.sqrt()
}

#[autocast(bf16)]
fn gelu_in_region(a: &Candle) -> Result<Candle> {
    a.gelu()
}

#[autocast(bf16)]
fn silu_in_region(a: &Candle) -> Result<Candle> {
    candle_nn::ops::silu(a)
}

#[autocast(bf16)]
fn mean_in_region(a: &Candle) -> Result<Candle> {
    a.mean_all()
}

#[autocast(bf16)]
fn scale_in_region(a: &Candle) -> Result<Candle> {
    (a * 0.5)? + 1.0
}

#[autocast(bf16)]
fn sum_in_region(a: &Candle) -> Result<Candle> {
    a.sum_all()
}

#[autocast(bf16)]
fn cumsum_in_region(a: &Candle) -> Result<Candle> {
    a.cumsum(0)
}

/// Floating-point math on an integer tensor is an error that names the op and the cast:
/// candle's integer kernels panicked (`exp` of `u8`, `sqrt` of `u32`: a `todo!`) or gave
/// integer nonsense (`gelu(1)` 0, `[1, 2] * 0.5 + 1` = `[1, 1]`, the mean of `[1, 2]` 0), where
/// PyTorch promotes to float (or, for `mean`, refuses).
#[test]
fn floating_point_math_on_integers_is_an_error_naming_the_cast() -> Result<()> {
    let bytes = Candle::new(&[1u8, 2], &dev())?;
    let words = Candle::new(&[1u32, 2], &dev())?;
    let longs = Candle::new(&[1i64, 2], &dev())?;
    let cases: [(&str, Result<Candle>); 6] = [
        ("exp", exp_in_region(&bytes)),
        ("sqrt", sqrt_in_region(&words)),
        ("gelu", gelu_in_region(&bytes)),
        ("silu", silu_in_region(&longs)),
        ("mean_all", mean_in_region(&words)),
        ("affine", scale_in_region(&bytes)),
    ];
    for (op, r) in cases {
        let err = r.map(|t| format!("{t}")).expect_err(op).to_string();
        assert!(
            err.contains(&format!("`{op}`")) && err.contains("to_dtype(DType::F32)"),
            "{op}: {err}"
        );
    }
    Ok(())
}

/// `u8` sums as PyTorch's: in `i64`, so 300 `u8` ones sum to 300 (candle's `u8` sum wraps to
/// 44, or panics in a debug build), and so does their running sum. A `u32` sum (a mask's count
/// of tokens) keeps candle's `u32`, which ported candle code expects.
#[test]
fn u8_sums_are_taken_in_i64() -> Result<()> {
    let ones = Candle::ones(300, DType::U8, &dev())?;
    let sum = sum_in_region(&ones)?;
    assert_eq!((sum.dtype(), sum.to_scalar::<i64>()?), (DType::I64, 300));
    let running = cumsum_in_region(&ones)?.to_vec1::<i64>()?;
    assert_eq!((running[0], running[299]), (1, 300));
    let words = Candle::new(&[70_000u32, 1], &dev())?;
    let sum = sum_in_region(&words)?;
    assert_eq!((sum.dtype(), sum.to_scalar::<u32>()?), (DType::U32, 70_001));
    Ok(())
}

#[autocast(bf16)]
fn cat_in_region(a: &Candle, b: &Candle) -> Result<Candle> {
    candle_core::Tensor::cat(&[a, b], 0)
}

#[autocast(bf16)]
fn maximum_in_region(a: &Candle, b: &Candle) -> Result<Candle> {
    a.broadcast_maximum(b)
}

/// A promoting op given an integer and a float tensor says what to cast, where candle's error
/// ("dtype mismatch in cat, lhs: U8, rhs: F32") named neither the rule nor a fix (PyTorch
/// promotes the integer tensor: `torch.cat([u8 1, f32 2])` is `[1., 2.]`).
#[test]
fn promotion_of_an_integer_tensor_names_the_cast() -> Result<()> {
    let (bytes, floats) = (Candle::new(&[1u8], &dev())?, Candle::new(&[2f32], &dev())?);
    for (op, r) in [
        ("cat", cat_in_region(&bytes, &floats)),
        ("broadcast_maximum", maximum_in_region(&bytes, &floats)),
    ] {
        let err = r.map(|t| format!("{t}")).expect_err(op).to_string();
        assert!(
            err.contains(&format!("`{op}` mixes a U8 tensor with a F32 one"))
                && err.contains(".to_dtype(DType::F32)"),
            "{op}: {err}"
        );
    }
    Ok(())
}

#[autocast(bf16)]
fn rope_and_linear_in_region(
    x: &Candle,
    cos: &Candle,
    sin: &Candle,
    linear: &candle_nn::Linear,
) -> Result<(Candle, Candle)> {
    let r = candle_nn::rotary_emb::rope(x, cos, sin)?;
    Ok((r, linear.forward(x)?))
}

/// A region never casts an f64 tensor, also inside the ops that read tables or a bias beside
/// it: candle-nn's `rope` rounded its f64 cos/sin tables to f32, and candle-nn's `Linear` its
/// f64 bias (errors of 4e-8 and 1e-8). Both are now candle's own f64 results to the bit.
#[test]
fn rope_tables_and_linear_bias_stay_f64() -> Result<()> {
    use candle_nn::Module;
    // Values whose f32 rounding is visible in f64: thirds.
    let thirds = |n: usize, shape: &[usize]| -> Result<Candle> {
        #[allow(clippy::cast_precision_loss)]
        let v: Vec<f64> = (0..n).map(|i| (i as f64 + 1.0) / 3.0 - 1.0).collect();
        Candle::from_vec(v, shape, &dev())
    };
    let x = thirds(16, &[1, 1, 4, 4])?;
    let (cos, sin) = (thirds(8, &[4, 2])?.cos()?, thirds(8, &[4, 2])?.sin()?);
    let linear = candle_nn::Linear::new(thirds(12, &[3, 4])?, Some(thirds(3, &[3])?));
    let (r, y) = rope_and_linear_in_region(&x, &cos, &sin, &linear)?;
    let bits =
        |t: &Candle| -> Result<Vec<u64>> { Ok(values(t)?.iter().map(|v| v.to_bits()).collect()) };
    assert_eq!(r.dtype(), DType::F64);
    assert_eq!(
        bits(&r)?,
        bits(&candle_nn::rotary_emb::rope(&x, &cos, &sin)?)?
    );
    assert_eq!(y.dtype(), DType::F64);
    assert_eq!(bits(&y)?, bits(&linear.forward(&x)?)?);
    Ok(())
}
