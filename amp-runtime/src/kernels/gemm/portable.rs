//! The portable micro-kernel and the scalar tile store every kernel falls back to.

use super::{GemmElem, Kernel};
use crate::kernels::elem::Real;

/// Plain-Rust f32 kernel (4 x 16): whatever the compiler vectorises for the target.
#[derive(Clone, Copy, Debug)]
pub(super) struct F32Kernel;

const MR: usize = 4;
const NR: usize = 16;

impl Kernel for F32Kernel {
    type Unit = f32;
    const MR: usize = MR;
    const NR: usize = NR;
    const KSTEP: usize = 1;

    #[inline]
    fn unit<T: GemmElem>(first: T, _last: T) -> f32 {
        first.get()
    }

    unsafe fn tile<O: Real>(
        self,
        units: usize,
        a: *const f32,
        b: *const f32,
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller passes panels of `units` units.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a, units * MR),
                std::slice::from_raw_parts(b, units * NR),
            )
        };
        let mut acc = [0f32; MR * NR];
        for (ar, br) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
            for i in 0..MR {
                for j in 0..NR {
                    acc[i * NR + j] += ar[i] * br[j];
                }
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { store_tile(&acc, NR, c, ldc, rows, cols, accumulate) };
    }
}

/// Stores the first `rows x cols` of a row-major tile of width `nr` into `c`, rounded to `O`.
///
/// # Safety
/// As [`Kernel::tile`]'s `c`.
#[inline]
pub(super) unsafe fn store_tile<O: Real>(
    tile: &[f32],
    nr: usize,
    c: *mut O,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    for i in 0..rows {
        for j in 0..cols {
            let v = tile[i * nr + j];
            // SAFETY: (i, j) is inside the caller's rows x cols window, initialised when
            // accumulating.
            unsafe {
                let dst = c.add(i * ldc + j);
                dst.write(O::put(if accumulate { dst.read().get() + v } else { v }));
            }
        }
    }
}
