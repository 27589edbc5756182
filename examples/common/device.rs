//! `--device` for every example (included by `common` and, alone, by `bench`).

use candle_core::Device;

/// `--device` as a clap value parser: `cpu`, `cuda` (device 0) or `cuda:N`; anything else, or a
/// CUDA device in a build without the `cuda` feature, is an error message clap prints (exit
/// code 2).
pub fn parse_device(name: &str) -> std::result::Result<Device, String> {
    let ordinal = match name {
        "cpu" => return Ok(Device::Cpu),
        "cuda" | "gpu" => 0,
        _ => name
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| format!("unknown device `{name}`: use `cpu`, `cuda` or `cuda:N`"))?,
    };
    if !cfg!(feature = "cuda") {
        return Err(format!(
            "`{name}` needs a CUDA build: `cargo run --release --features cuda --example ...` \
             (README, section CUDA)"
        ));
    }
    let dev =
        Device::new_cuda(ordinal).map_err(|e| format!("cannot open CUDA device {ordinal}: {e}"))?;
    #[cfg(feature = "cuda")]
    untracked(&dev)?;
    Ok(dev)
}

/// Turns off cudarc's event tracking on a CUDA `dev` (candle leaves it on): with it, every
/// buffer carries two CUDA events and every launch waits on its arguments' ones, host work that
/// only code using several streams needs (`bench`'s `untracked_vs_tracked_step` measures it).
#[cfg(feature = "cuda")]
fn untracked(dev: &Device) -> std::result::Result<(), String> {
    let cuda = dev.as_cuda_device().map_err(|e| e.to_string())?;
    // SAFETY: the examples run everything on the device's one stream (candle's kernels,
    // cuBLAS, cuDNN and candle-amp's kernels all launch on it).
    unsafe { cuda.disable_event_tracking() };
    Ok(())
}
