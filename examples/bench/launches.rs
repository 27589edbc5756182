//! `bench`'s CUDA-only figure (a `--features cuda` build), the host's cost of launching:
//!
//! - `untracked_vs_tracked_step` (no target; null on CPU): the fp16 AMP training step of a
//!   1024-wide MLP on a batch of 256 (the recipe's layers; a step bound by the host's launches)
//!   on a device whose cudarc event tracking is off, over the same step on a device with it on
//!   (candle's default). With tracking on, cudarc records two events per buffer and makes each
//!   launch wait on its arguments' events, which code on one stream never needs; the examples
//!   turn it off (`examples/common/device.rs`).

use candle_amp::nn::loss;
use candle_amp::optim::{Optimizer, SGD};
use candle_amp::{Fp16Policy, GradScaler, Tensor, F32};
use candle_core::{DType, Device, DeviceLocation, Result};
use candle_nn::{VarBuilder, VarMap};

use super::fixtures::Mlp;
use super::{interleaved, Args, Samples};

/// The launch-bound step's width and batch.
const WIDTH: usize = 1024;
const BATCH: usize = 256;

/// Side 0: the step on an untracked device, side 1: on a tracked one, both on `dev`'s GPU;
/// `None` off CUDA.
pub fn measure_event_tracking(args: &Args, dev: &Device) -> Result<Option<Samples>> {
    let DeviceLocation::Cuda { gpu_id } = dev.location() else {
        return Ok(None);
    };
    let untracked = Device::new_cuda(gpu_id)?;
    // SAFETY: everything the step does on `untracked` runs on that device's one stream.
    unsafe { untracked.as_cuda_device()?.disable_event_tracking() };
    let tracked = Device::new_cuda(gpu_id)?;
    let (mut a, mut b) = (step_on(&untracked)?, step_on(&tracked)?);
    interleaved(
        &tracked,
        args.warmup,
        args.step_samples,
        &mut [&mut a, &mut b],
    )
    .map(Some)
}

/// One fp16 AMP step (MSE, a `GradScaler`, SGD) on `dev`, ending with `dev`'s sync (each side
/// has its own stream, which `interleaved`'s sync of one device does not cover).
fn step_on(dev: &Device) -> Result<impl FnMut() -> Result<()>> {
    let vars = VarMap::new();
    let mlp = Mlp::new(WIDTH, &VarBuilder::from_varmap(&vars, DType::F32, dev))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (BATCH, WIDTH), dev)?;
    let y = Tensor::<F32>::randn(0.0, 1.0, (BATCH, WIDTH), dev)?;
    let mut opt = SGD::new(vars.all_vars(), 1e-3)?;
    let mut scaler = GradScaler::builder().build()?;
    let dev = dev.clone();
    Ok(move || {
        let l = loss::mse(&mlp.forward_switch::<Fp16Policy>(&x, true)?, &y)?;
        let grads = scaler.scale(&l)?.backward()?;
        let _ = scaler.step(&mut opt, grads)?;
        scaler.update()?;
        dev.synchronize()
    })
}
