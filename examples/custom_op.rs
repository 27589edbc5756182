//! A user op in an autocast region: `#[custom_fwd]` (runs under the caller's policy),
//! `#[custom_fwd(cast_inputs = f32)]` (inputs cast to f32, autocast off inside), and a candle
//! `CustomOp1` whose backward is `#[custom_bwd]` (gradients in the forward's dtypes).
//!
//! Run: `cargo run --release --example custom_op`

use candle_amp::nn::{self, loss};
use candle_amp::{autocast, custom_bwd, custom_fwd, Tensor, F32};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape};
use candle_nn::{VarBuilder, VarMap};

/// `y = x * sigmoid(x W)`: a gated projection that runs in the caller's precision.
struct Gate {
    w: Tensor<F32>,
}

#[custom_fwd]
impl Gate {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(x.mul(&x.matmul(&self.w)?.sigmoid()?)?)
    }
}

/// Log-sum-exp over a dimension, always from f32 inputs whatever the caller runs in.
struct LogSumExp {
    dim: usize,
}

#[custom_fwd(cast_inputs = f32)]
impl LogSumExp {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        x.log_sum_exp(self.dim)
    }
}

/// `y = x * |x|` as a hand-written kernel; its backward `2 |x| g` is computed in f32 and handed
/// back in the input's dtype by `#[custom_bwd]`.
struct SignedSquare;

impl CustomOp1 for SignedSquare {
    fn name(&self) -> &'static str {
        "signed-square"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("signed-square: contiguous input expected")
        };
        let out = match storage {
            CpuStorage::F32(v) => {
                CpuStorage::F32(v[start..end].iter().map(|x| x * x.abs()).collect())
            }
            CpuStorage::F16(v) => CpuStorage::F16(
                v[start..end]
                    .iter()
                    .map(|x| half::f16::from_f32(x.to_f32() * x.to_f32().abs()))
                    .collect(),
            ),
            _ => candle_core::bail!("signed-square: a float input expected"),
        };
        Ok((out, layout.shape().clone()))
    }

    #[custom_bwd]
    fn bwd(
        &self,
        arg: &candle_core::Tensor,
        _res: &candle_core::Tensor,
        grad_res: &candle_core::Tensor,
    ) -> Result<Option<candle_core::Tensor>> {
        let x = arg.to_dtype(DType::F32)?;
        Ok(Some(((x.abs()? * 2.0)? * grad_res.to_dtype(DType::F32)?)?))
    }
}

struct Model {
    fc: nn::Linear,
    gate: Gate,
}

#[autocast(fp16)]
impl Model {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.gate.forward(&self.fc.forward(&x)?)?; // f16, the caller's policy
                                                           // A raw candle custom op on the f16 values (a region's values are candle tensors): its
                                                           // backward hands f16 gradients back.
        let h = h.apply_op1(SignedSquare)?;
        Ok(LogSumExp { dim: 1 }.forward(&h)?) // f32 inside, whatever came in
    }
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let model = Model {
        fc: nn::linear(8, 8, vb.pp("fc"))?,
        gate: Gate {
            w: Tensor::randn(0.0, 0.3, (8, 8), &dev)?,
        },
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (4, 8), &dev)?;
    let y = model.forward(&x)?;
    let l = loss::mse(&y, &Tensor::zeros(4, &dev)?)?;
    let grads = l.as_candle().backward()?;
    println!(
        "output {:?} {:?}, loss {:.4}",
        y.dtype(),
        y.dims(),
        l.to_scalar::<f32>()?
    );
    for var in vars.all_vars() {
        let g = grads.get(&var).expect("every master weight learns");
        println!("gradient {:?} {:?}", g.dtype(), g.dims());
    }
    Ok(())
}
