//! Switches of the libraries behind the kernels, named as PyTorch's `torch.backends`.

/// cuDNN (feature `cudnn`), behind the convolutions on CUDA.
#[cfg(feature = "cudnn")]
pub mod cudnn {
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Whether f32 convolutions may run on TF32 tensor cores.
    static ALLOW_TF32: AtomicBool = AtomicBool::new(true);

    /// Lets f32 convolutions on cuDNN use TF32 tensor cores (10-bit mantissa products, f32
    /// sums: `true`, the default, as PyTorch's `torch.backends.cudnn.allow_tf32`) or keeps them
    /// to f32 arithmetic (`false`). Half and bfloat16 convolutions always run on tensor cores
    /// with f32 accumulation.
    pub fn set_allow_tf32(allow: bool) {
        ALLOW_TF32.store(allow, Ordering::Relaxed);
    }

    /// Whether f32 convolutions may use TF32 (see [`set_allow_tf32`]).
    pub fn allow_tf32() -> bool {
        ALLOW_TF32.load(Ordering::Relaxed)
    }
}
