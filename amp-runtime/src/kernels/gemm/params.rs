//! The GEMM's blocking parameters and the micro-kernels chosen for this CPU.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use super::{amx::AmxBf16, x86::Avx512, x86::Avx512Bf16};

/// The most units of the inner dimension packed per pass: a B micro-panel of 2048 x 32 units
/// (256 KiB) stays in L2. Longer products (weight gradients, whose `k` is batch x pixels)
/// run in passes accumulated in f32.
pub(super) const MAX_UNITS: usize = 2048;
/// Bytes of packed A per task, to stay within L2 next to the B micro-panel.
pub(super) const A_BLOCK_BYTES: usize = 512 << 10;
/// Bytes of packed B per column slice.
pub(super) const B_SLICE_BYTES: usize = 4 << 20;
/// B micro-panels a task packs at a time when the threads split B's columns: 4 x 32 columns
/// of bf16 pairs at k = 1024 is 256 KiB, which stays in L2 beside A's block, while one panel
/// at a time would read B in short strided runs (64 bytes of each row).
pub(super) const COLUMN_PANELS: usize = 4;
/// B micro-panels packed per task.
pub(super) const PACK_TASK_PANELS: usize = 8;
/// Bytes per cache line, the alignment of packed panels.
pub(super) const CACHE_LINE: usize = 64;

/// The micro-kernels this CPU can run, each x86 variant holding the token that proves its
/// features (see [`super::Kernel`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX512-BF16 with AMX-BF16 tiles (Sapphire Rapids and later), the OS granting them:
    /// `tdpbf16ps` for bf16, FMA for the rest.
    #[cfg(target_arch = "x86_64")]
    Amx(AmxBf16),
    /// AVX-512F with AVX512-BF16: `vdpbf16ps` for bf16, FMA for the rest.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16(Avx512Bf16),
    /// AVX-512F: FMA for every type (bf16 converted to f32 while packing).
    #[cfg(target_arch = "x86_64")]
    Avx512(Avx512),
    /// Plain Rust.
    Portable,
}

/// The kernels chosen for this process (detected once). `CANDLE_AMP_PORTABLE_GEMM=1` forces the
/// portable kernel and `CANDLE_AMP_NO_AMX=1` the AVX-512 ones (on/off values as
/// `CANDLE_AMP_CHECK_FINITE`'s): how the paths a CPU without those features takes are tested
/// on one that has them.
pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(detect)
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::env::switch("CANDLE_AMP_PORTABLE_GEMM") == Some(true) {
            return Isa::Portable;
        }
        if let Some(cpu) = Avx512Bf16::detect() {
            if crate::env::switch("CANDLE_AMP_NO_AMX") != Some(true) {
                if let Some(tiles) = AmxBf16::detect(cpu) {
                    return Isa::Amx(tiles);
                }
            }
            return Isa::Avx512Bf16(cpu);
        }
        if let Some(cpu) = Avx512::detect() {
            return Isa::Avx512(cpu);
        }
    }
    Isa::Portable
}
