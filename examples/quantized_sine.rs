//! The main job: the ROCm blog's 2-D quantized-sine experiment (DESIGN section 7).
//!
//! The full experiment (f32 and AMP training side by side, timing, peak memory, plots, `--json`)
//! needs the GradScaler and lands with the "seed experiments" issue. Until then this program
//! builds the experiment's data and model with today's typed layers and runs one forward pass in
//! f32 and one with the convolutions in f16 (batch norm in f32 inside), reporting how far apart
//! they are, so that the README command does real work from day one.

use candle_amp::nn::{self, loss};
use candle_amp::{Precision, Tensor, F16, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use std::f64::consts::PI;

/// Inputs: the (2, H, W) grid of coordinates in [0, 1]; target: cos(2 pi 4x) + cos(2 pi 2y)
/// digitised into 4 levels and standardised to [0, 1].
fn data(size: usize, dev: &Device) -> Result<(Tensor<F32>, Tensor<F32>)> {
    let coord = |i: usize| i as f64 / (size - 1) as f64;
    let mut grid = Vec::with_capacity(2 * size * size);
    for channel in 0..2 {
        for row in 0..size {
            for col in 0..size {
                grid.push(coord(if channel == 0 { col } else { row }) as f32);
            }
        }
    }
    let mut target = Vec::with_capacity(size * size);
    for row in 0..size {
        for col in 0..size {
            let v = (2.0 * PI * 4.0 * coord(col)).cos() + (2.0 * PI * 2.0 * coord(row)).cos();
            // v in [-2, 2] -> level 0..=3 -> standardised to [0, 1].
            let level = ((v + 2.0) / 4.0 * 4.0).floor().clamp(0.0, 3.0);
            target.push((level / 3.0) as f32);
        }
    }
    Ok((
        Tensor::from_vec(grid, (1, 2, size, size), dev)?,
        Tensor::from_vec(target, (1, 1, size, size), dev)?,
    ))
}

/// Conv(2, h) + BN + ReLU, two hidden Conv(h, h) + BN + ReLU, Conv(h, 1): all 1x1 convolutions.
struct Model {
    convs: Vec<nn::Conv2d>,
    norms: Vec<nn::BatchNorm2d>,
}

impl Model {
    fn new(hidden: usize, vb: &VarBuilder) -> Result<Self> {
        let cfg = nn::Conv2dConfig::default();
        let widths = [2, hidden, hidden, hidden, 1];
        let convs = (0..4)
            .map(|i| nn::conv2d(widths[i], widths[i + 1], 1, cfg, vb.pp(format!("conv{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norms = (0..3)
            .map(|i| nn::batch_norm2d(hidden, 1e-5, vb.pp(format!("bn{i}"))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { convs, norms })
    }

    fn forward<P: Precision>(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let mut h = x.cast::<P>()?;
        for (conv, norm) in self.convs.iter().zip(&self.norms) {
            h = norm.forward_train(&conv.forward(&h)?)?.relu()?;
        }
        self.convs[3].forward(&h)?.cast::<F32>()
    }
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let (size, hidden) = (64, 64);
    let (x, target) = data(size, &dev)?;
    let vars = VarMap::new();
    let model = Model::new(hidden, &VarBuilder::from_varmap(&vars, DType::F32, &dev))?;

    let y32 = model.forward::<F32>(&x)?;
    let y16 = model.forward::<F16>(&x)?;
    let loss32 = loss::mse(&y32, &target)?.to_scalar::<f32>()?;
    let loss16 = loss::mse(&y16, &target)?.to_scalar::<f32>()?;
    let gap = loss::l1(&y16, &y32)?.to_scalar::<f32>()?;
    println!("quantized_sine (preview): {size}x{size} grid, hidden width {hidden}");
    println!("  initial MSE, f32 forward:           {loss32:.6}");
    println!("  initial MSE, f16 convs + f32 BN:    {loss16:.6}");
    println!("  mean |f16 - f32| output difference: {gap:.2e}");
    println!("Training f32 vs AMP with GradScaler, timings, memory and plots: coming with the");
    println!("seed-experiments issue (see README, Roadmap).");
    Ok(())
}
