//! The AVX-512 micro-kernels (x86-64): bf16 pairs on `vdpbf16ps` and f32 on FMA, 12 x 32 tiles,
//! and the feature tokens that prove the CPU runs them.

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, _mm512_add_ps, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_loadu_si512, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
};

use candle_core::DType;

use super::pack::Lanes;
use super::portable::store_tile;
use super::{GemmElem, Kernel, MatRef};
use crate::kernels::elem::Real;

/// Proof that this CPU has AVX-512F: made only by [`Avx512::detect`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// The token, when the CPU has AVX-512F.
    pub(crate) fn detect() -> Option<Self> {
        is_x86_feature_detected!("avx512f").then_some(Self(()))
    }
}

/// Proof that this CPU has AVX-512F and AVX512-BF16: made only by [`Avx512Bf16::detect`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx512Bf16(());

impl Avx512Bf16 {
    /// The token, when the CPU has AVX-512F and AVX512-BF16.
    pub(crate) fn detect() -> Option<Self> {
        (is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"))
            .then_some(Self(()))
    }

    /// AVX-512F, which this implies.
    #[allow(clippy::unused_self)] // the receiver is the proof
    pub(crate) fn avx512(self) -> Avx512 {
        Avx512(())
    }
}

/// Rows and columns of a tile: 12 x 32 = 24 zmm accumulators, two B vectors and one A
/// broadcast in flight, within the 32 registers of AVX-512.
pub(super) const MR: usize = 12;
pub(super) const NR: usize = 32;

/// bf16 x bf16 -> f32 with `vdpbf16ps`; a unit is a pair of consecutive `k`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Bf16Kernel(pub Avx512Bf16);

/// f32 FMA; a unit is one `k`.
#[derive(Clone, Copy, Debug)]
pub(super) struct F32Kernel(pub Avx512);

impl Kernel for Bf16Kernel {
    type Unit = u32;
    const MR: usize = MR;
    const NR: usize = NR;
    const KSTEP: usize = 2;

    #[inline]
    fn unit<T: GemmElem>(first: T, last: T) -> u32 {
        super::bf16_pair(first, last)
    }

    fn pack_fast<T: GemmElem>(
        self,
        v: MatRef<T>,
        lanes: Lanes,
        whole: usize,
        out: &mut [u32],
    ) -> (usize, usize) {
        super::pack_bf16::pack_units(self.0.avx512(), v, lanes, whole, out)
    }

    fn walk_fast<T: GemmElem>(
        self,
        v: MatRef<T>,
        first: usize,
        count: usize,
        whole: usize,
        units: usize,
        out: &mut [u32],
    ) -> usize {
        super::pack_bf16::walk_units(self.0.avx512(), v, first, count, whole, units, NR, out)
    }

    unsafe fn tile<O: Real>(
        self,
        units: usize,
        a: *const u32,
        b: *const u32,
        c: *mut O,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        // SAFETY: `self.0` proves avx512f and avx512bf16; the pointers are the caller's.
        unsafe { bf16_tile(units, a, b, c, ldc, rows, cols, accumulate) }
    }
}

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
        // SAFETY: `self.0` proves avx512f; the pointers are the caller's.
        unsafe { f32_tile(units, a, b, c, ldc, rows, cols, accumulate) }
    }
}

/// Stores the accumulators: straight into C for a full tile, through a buffer otherwise.
///
/// # Safety
/// The CPU has AVX-512F; `c` as [`Kernel::tile`]'s.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store<O: Real, const R: usize>(
    acc: &[[__m512; 2]; R],
    c: *mut O,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let full = rows == R && cols == NR;
    if full && O::DTYPE == DType::F32 {
        let c = c.cast::<f32>();
        for (i, row) in acc.iter().enumerate() {
            for (h, v) in row.iter().enumerate() {
                // SAFETY: a full tile: rows R and columns NR are all inside C.
                unsafe {
                    let dst = c.add(i * ldc + h * 16);
                    let v = if accumulate {
                        _mm512_add_ps(*v, _mm512_loadu_ps(dst))
                    } else {
                        *v
                    };
                    _mm512_storeu_ps(dst, v);
                }
            }
        }
    } else if full && matches!(O::DTYPE, DType::BF16 | DType::F16) {
        // 16-bit elements: widen what is there when accumulating, round once, store.
        let c = c.cast::<u16>();
        let bf16 = O::DTYPE == DType::BF16;
        for (i, row) in acc.iter().enumerate() {
            for (h, v) in row.iter().enumerate() {
                // SAFETY: a full tile: rows R and columns NR are all inside C.
                unsafe {
                    let dst = c.add(i * ldc + h * 16);
                    let v = if accumulate {
                        _mm512_add_ps(*v, crate::kernels::simd::load16(dst, bf16))
                    } else {
                        *v
                    };
                    crate::kernels::simd::store16(dst, v, bf16);
                }
            }
        }
    } else {
        let mut tile = [[0f32; NR]; R];
        for (row, acc) in tile.iter_mut().zip(acc) {
            for (h, v) in acc.iter().enumerate() {
                // SAFETY: the row holds NR floats.
                unsafe { _mm512_storeu_ps(row.as_mut_ptr().add(h * 16), *v) };
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { store_tile(tile.as_flattened(), NR, c, ldc, rows, cols, accumulate) };
    }
}

/// The bf16 tile (see [`Kernel::tile`]).
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; the pointers as [`Kernel::tile`]'s.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn bf16_tile<O: Real>(
    units: usize,
    a: *const u32,
    b: *const u32,
    c: *mut O,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    // SAFETY: the A panel holds `units` units of MR lanes; the rest is the caller's.
    let acc = unsafe { bf16_sums(units, b, |i, u| *a.add(u * MR + i) as i32) };
    // SAFETY: forwarded from the caller.
    unsafe { store(&acc, c, ldc, rows, cols, accumulate) };
}

/// The accumulators of a bf16 tile: `units` units of the B panel `b` (`units * NR`) times
/// those `a(i, u)` gives for row `i` and unit `u`, summed in f32 by `vdpbf16ps`.
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; `b` holds `units * NR` units; `a` may be called for
/// every row below `MR` and unit below `units`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_sums(
    units: usize,
    b: *const u32,
    a: impl Fn(usize, usize) -> i32,
) -> [[__m512; 2]; MR] {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for u in 0..units {
        // SAFETY: the panel holds `units` units of NR lanes.
        unsafe {
            let b0: __m512bh =
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(u * NR).cast()));
            let b1: __m512bh = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                b.add(u * NR + 16).cast(),
            ));
            for (i, row) in acc.iter_mut().enumerate() {
                let av: __m512bh =
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(a(i, u)));
                row[0] = _mm512_dpbf16_ps(row[0], av, b0);
                row[1] = _mm512_dpbf16_ps(row[1], av, b1);
            }
        }
    }
    acc
}

/// The bf16 tile with A read in place (see [`super::resident`]): `a` is `(first row, row
/// stride, unit step, rows)`, unit `u` of row `i` the 32 bits at element `i * rs + u * step`;
/// rows past `rows` are never read (they repeat the last, and are not stored).
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; the `rows` rows hold `units` units each; `b` holds
/// `units * NR` units; `c` addresses `rows` rows of `cols` writable f32 at stride `ldc`.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn bf16_tile_in_place(
    units: usize,
    (a, rs, step, rows): (*const u16, usize, usize, usize),
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    accumulate: bool,
) {
    let mut starts = [a; MR];
    for (i, start) in starts.iter_mut().enumerate() {
        // SAFETY: row `min(i, rows - 1)` is one of the caller's rows.
        *start = unsafe { a.add(i.min(rows - 1) * rs) };
    }
    // SAFETY: each row holds `units` units; the rest is the caller's.
    let acc = unsafe {
        bf16_sums(units, b, |i, u| {
            starts[i].add(u * step).cast::<i32>().read_unaligned()
        })
    };
    // SAFETY: forwarded from the caller.
    unsafe { store(&acc, c, ldc, rows, cols, accumulate) };
}

/// The f32 tile (see [`Kernel::tile`]).
///
/// # Safety
/// The CPU has AVX-512F; the pointers as [`Kernel::tile`]'s.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn f32_tile<O: Real>(
    units: usize,
    a: *const f32,
    b: *const f32,
    c: *mut O,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for u in 0..units {
        // SAFETY: the panels hold `units` units of NR (B) and MR (A) floats.
        unsafe {
            let b0 = _mm512_loadu_ps(b.add(u * NR));
            let b1 = _mm512_loadu_ps(b.add(u * NR + 16));
            let ar = a.add(u * MR);
            for (i, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*ar.add(i));
                row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                row[1] = _mm512_fmadd_ps(av, b1, row[1]);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { store(&acc, c, ldc, rows, cols, accumulate) };
}
