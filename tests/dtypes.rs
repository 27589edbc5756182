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
        assert_eq!(g[0][255].to_bits(), (-0.498_046_875f32).to_bits(), "{what}");
        assert_eq!(g[1][0].to_bits(), (-0.498_046_875f32).to_bits(), "{what}");
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
