//! AVX-512 packing of bf16 operands, and of f32 masters rounded to bf16 as they are read, into
//! units of two consecutive `k` (the `vdpbf16ps` and AMX kernels), 16 lanes x 16 units at a
//! time.
//!
//! A unit of bf16 is the 32 bits of two consecutive `k` of one lane. Where a lane's run along
//! `k` is contiguous in memory, 16 of its units are one 64-byte load; where the lanes at each
//! `k` are contiguous, the units of 16 lanes at one `k` pair are two 32-byte loads interleaved.
//! A panel wants one of two orders, `[unit][lane]` (B panels, and A panels of the `vdpbf16ps`
//! kernel) or `[lane][unit]` within blocks of 16 units (A panels of the AMX kernel), and when
//! the source gives the other one, a 16 x 16 transpose of 32-bit elements turns it round.
//! The scalar packing of [`super::pack::pack`] does what is left: partial groups of lanes or units
//! and the tails.

use std::arch::x86_64::{
    __m512i, __mmask16, _mm256_loadu_si256, _mm512_castsi256_si512, _mm512_cvtepu16_epi32,
    _mm512_inserti64x4, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_storeu_epi32,
    _mm512_maskz_loadu_ps, _mm512_or_si512, _mm512_setzero_si512, _mm512_shuffle_i32x4,
    _mm512_slli_epi32, _mm512_storeu_si512, _mm512_unpackhi_epi32, _mm512_unpackhi_epi64,
    _mm512_unpacklo_epi32, _mm512_unpacklo_epi64,
};

use super::pack::Lanes;
use super::x86::Avx512;
use super::{GemmElem, MatRef};
use crate::kernels::elem::as_f32;
use crate::kernels::simd::{f32_to_bf16, f32_to_bf16_lanes};

/// Lanes and units per step.
const G: usize = 16;

/// [`pack`] for a bf16 view, or an f32 one rounded to bf16 as it is read (a master weight):
/// the bf16 kernels' `Kernel::pack_fast`. `(0, 0)` for other element types.
pub(super) fn pack_units<S: GemmElem>(
    _cpu: Avx512,
    v: MatRef<S>,
    lanes: Lanes,
    whole: usize,
    out: &mut [u32],
) -> (usize, usize) {
    // SAFETY: `_cpu` proves avx512f.
    unsafe {
        if let Some(bits) = S::bf16_slice(v.data) {
            pack_any(v.with_data(bits), lanes, whole, out)
        } else if let Some(values) = as_f32(v.data) {
            pack_any(v.with_data(values), lanes, whole, out)
        } else {
            (0, 0)
        }
    }
}

/// [`pack`], or for a panel of fewer than 16 lanes [`pack_few_lanes`].
///
/// # Safety
/// avx512f exists.
#[target_feature(enable = "avx512f")]
unsafe fn pack_any<E: Source>(
    v: MatRef<E>,
    lanes: Lanes,
    whole: usize,
    out: &mut [u32],
) -> (usize, usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if lanes.count < G {
            pack_few_lanes(v, lanes, whole, out)
        } else {
            pack(v, lanes, whole, out)
        }
    }
}

/// Packs a panel of fewer than 16 lanes (the 12-row A panels of the `vdpbf16ps` kernel) in
/// `[unit][lane]` order. Where each lane's run along `k` is contiguous (a row-major A), each
/// 16-unit block is loaded one lane per vector with the missing lanes zero, transposed, and
/// stored masked to the panel's lanes; where the lanes at each `k` are contiguous (a
/// transposed A: `grad^T` of a weight's gradient, `P^T` in attention), each unit row is two
/// partial loads combined, stored masked. Returns the lanes and units covered, as [`pack`];
/// `(0, 0)` for other layouts, which the scalar packing takes.
///
/// # Safety
/// avx512f exists.
#[target_feature(enable = "avx512f")]
unsafe fn pack_few_lanes<E: Source>(
    v: MatRef<E>,
    lanes: Lanes,
    whole: usize,
    out: &mut [u32],
) -> (usize, usize) {
    let count = lanes.count;
    if count == 0 || count >= G || whole == 0 || lanes.block != 1 {
        return (0, 0);
    }
    let keep: __mmask16 = (1u16 << count) - 1;
    let base = v.offset + lanes.first * v.rs;
    let src = v.data.as_ptr();
    let dst = out.as_mut_ptr();
    assert!(
        lanes.at(whole - 1, count - 1) < out.len(),
        "pack: panel too small"
    );
    if v.cs == 1 {
        let ud = whole / G * G;
        if ud == 0 {
            return (0, 0);
        }
        // The last element read is in bounds.
        assert!(
            base + (count - 1) * v.rs + 2 * ud <= v.data.len(),
            "pack: view outside its data"
        );
        for u0 in (0..ud).step_by(G) {
            let mut rows = [_mm512_setzero_si512(); G];
            for (i, row) in rows.iter_mut().take(count).enumerate() {
                // SAFETY: lane i's 32 values from unit u0 end at most at the checked last
                // element.
                *row = unsafe { E::units(src.add(base + i * v.rs + 2 * u0)) };
            }
            transpose(&mut rows);
            for (j, row) in rows.iter().enumerate() {
                // SAFETY: unit u0 + j's `count` lanes lie inside `out` (checked above); the
                // mask writes those alone.
                unsafe {
                    _mm512_mask_storeu_epi32(dst.add(lanes.at(u0 + j, 0)).cast(), keep, *row);
                }
            }
        }
        (count, ud)
    } else if v.rs == 1 {
        // The last element read is in bounds.
        assert!(
            base + (2 * whole - 1) * v.cs + count <= v.data.len(),
            "pack: view outside its data"
        );
        for u in 0..whole {
            let lo = base + 2 * u * v.cs;
            // SAFETY: rows 2u and 2u + 1 hold `count` lanes from `base` (checked above); unit
            // u's `count` lanes lie inside `out`, and the mask writes those alone.
            unsafe {
                let units = _mm512_or_si512(
                    E::few_lanes(src.add(lo), count),
                    _mm512_slli_epi32::<16>(E::few_lanes(src.add(lo + v.cs), count)),
                );
                _mm512_mask_storeu_epi32(dst.add(lanes.at(u, 0)).cast(), keep, units);
            }
        }
        (count, whole)
    } else {
        (0, 0)
    }
}

/// [`super::Kernel::walk_fast`] for a view of bf16 bits or of f32 values (rounded to bf16),
/// into panels `nr` lanes wide (a multiple of 16); `0` for other element types.
#[allow(clippy::too_many_arguments)]
pub(super) fn walk_units<S: GemmElem>(
    _cpu: Avx512,
    v: MatRef<S>,
    first: usize,
    count: usize,
    whole: usize,
    units: usize,
    nr: usize,
    out: &mut [u32],
) -> usize {
    let panels = Panels { units, nr };
    // SAFETY: `_cpu` proves avx512f.
    unsafe {
        if let Some(bits) = S::bf16_slice(v.data) {
            walk(v.with_data(bits), first, count, whole, panels, out)
        } else if let Some(values) = as_f32(v.data) {
            walk(v.with_data(values), first, count, whole, panels, out)
        } else {
            0
        }
    }
}

/// B micro-panels of `units` units of `nr` lanes each.
#[derive(Clone, Copy)]
struct Panels {
    units: usize,
    nr: usize,
}

impl Panels {
    /// Where unit `u` of lane `l` (from the first panel's first lane) goes.
    fn at(self, u: usize, l: usize) -> usize {
        (l / self.nr) * self.units * self.nr + u * self.nr + l % self.nr
    }
}

/// Walks B's rows two at a time (the pair of `k` a unit holds) and packs 16 lanes per step:
/// the whole panels of lanes `first..first + count`, for units `0..whole`. Returns the lanes
/// packed; `0` unless the lanes at each `k` are contiguous.
///
/// # Safety
/// avx512f exists.
#[target_feature(enable = "avx512f")]
unsafe fn walk<E: Source>(
    v: MatRef<E>,
    first: usize,
    count: usize,
    whole: usize,
    panels: Panels,
    out: &mut [u32],
) -> usize {
    assert!(panels.nr.is_multiple_of(G), "walk: panels of {}", panels.nr);
    let done = count / panels.nr * panels.nr;
    if done == 0 || whole == 0 || v.rs != 1 {
        return 0;
    }
    let base = v.offset + first;
    // The last element read and the last unit written are in bounds.
    assert!(
        base + (2 * whole - 1) * v.cs + done <= v.data.len(),
        "walk: view outside its data"
    );
    assert!(
        panels.at(whole - 1, done - 1) < out.len(),
        "walk: panels too small"
    );
    let src = v.data.as_ptr();
    let dst = out.as_mut_ptr();
    for u in 0..whole {
        let lo = base + 2 * u * v.cs;
        for l in (0..done).step_by(G) {
            // SAFETY: rows 2u and 2u + 1 hold lanes up to `done` (checked above); the 16
            // units written lie in one panel row (nr is a multiple of 16) inside `out`.
            unsafe {
                let units = _mm512_or_si512(
                    E::lanes(src.add(lo + l)),
                    _mm512_slli_epi32::<16>(E::lanes(src.add(lo + v.cs + l))),
                );
                _mm512_storeu_si512(dst.add(panels.at(u, l)).cast(), units);
            }
        }
    }
    done
}

/// An element type [`pack`] reads: bf16 bits as they are, or f32 rounded to bf16.
trait Source: Copy {
    /// The 32 values from `p` as bf16 bits, in order: 16 units of one lane.
    ///
    /// # Safety
    /// `p` addresses 32 readable values; avx512f exists.
    unsafe fn units(p: *const Self) -> __m512i;

    /// The 16 values from `p` as bf16 bits, one in the low half of each 32-bit lane.
    ///
    /// # Safety
    /// As [`Source::units`], for 16 values.
    unsafe fn lanes(p: *const Self) -> __m512i;

    /// As [`Source::lanes`] for the first `count` (< 16) values from `p`, the others 0.
    ///
    /// # Safety
    /// `p` addresses `count` readable values; avx512f exists.
    unsafe fn few_lanes(p: *const Self, count: usize) -> __m512i;
}

impl Source for u16 {
    #[inline]
    unsafe fn units(p: *const u16) -> __m512i {
        // SAFETY: forwarded from the caller.
        unsafe { _mm512_loadu_si512(p.cast()) }
    }

    #[inline]
    unsafe fn lanes(p: *const u16) -> __m512i {
        // SAFETY: forwarded from the caller.
        unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())) }
    }

    #[inline]
    unsafe fn few_lanes(p: *const u16, count: usize) -> __m512i {
        let mut run = [0u16; G];
        // SAFETY: forwarded from the caller; `count < 16` fits `run`.
        unsafe {
            std::ptr::copy_nonoverlapping(p, run.as_mut_ptr(), count);
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(run.as_ptr().cast()))
        }
    }
}

impl Source for f32 {
    #[inline]
    unsafe fn units(p: *const f32) -> __m512i {
        // SAFETY: forwarded from the caller.
        unsafe {
            let lo = f32_to_bf16(_mm512_loadu_ps(p));
            let hi = f32_to_bf16(_mm512_loadu_ps(p.add(G)));
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
        }
    }

    #[inline]
    unsafe fn lanes(p: *const f32) -> __m512i {
        // SAFETY: forwarded from the caller.
        unsafe { f32_to_bf16_lanes(_mm512_loadu_ps(p)) }
    }

    #[inline]
    unsafe fn few_lanes(p: *const f32, count: usize) -> __m512i {
        let keep: __mmask16 = (1u16 << count) - 1;
        // SAFETY: forwarded from the caller; the masked-off values are not read.
        unsafe { f32_to_bf16_lanes(_mm512_maskz_loadu_ps(keep, p)) }
    }
}

/// Packs the whole groups of 16 lanes and 16 units of a view of bf16 bits or of f32 values
/// (rounded to bf16) into `out` laid out as `lanes` says, and returns how many lanes and units that covered (a
/// rectangle from the first lane and unit); `(0, 0)` when neither of `v`'s strides is 1.
///
/// # Safety
/// avx512f exists.
#[target_feature(enable = "avx512f")]
unsafe fn pack<E: Source>(
    v: MatRef<E>,
    lanes: Lanes,
    whole: usize,
    out: &mut [u32],
) -> (usize, usize) {
    let (ld, ud) = (lanes.count / G * G, whole / G * G);
    if ld == 0 || ud == 0 || (v.cs != 1 && v.rs != 1) {
        return (0, 0);
    }
    let base = v.offset + lanes.first * v.rs;
    // The last element the rectangle reads, and the last unit it writes, are in bounds.
    let last_in = base + (ld - 1) * v.rs + (2 * ud - 1) * v.cs;
    assert!(last_in < v.data.len(), "pack: view outside its data");
    assert!(
        lanes.at(ud - 1, ld - 1) < out.len(),
        "pack: panel too small"
    );
    // `by_lane`: the source gives rows[i] as lane l0 + i's 16 units; otherwise rows[j] as unit
    // u0 + j of the 16 lanes. The panel wants the first order in blocks of 16 units (AMX's A),
    // the second for `[unit][lane]`.
    let by_lane = v.cs == 1;
    // Another block would put a row's 16 units outside the checked rectangle.
    assert!(
        lanes.block == 1 || lanes.block == G,
        "pack: block of {}",
        lanes.block
    );
    let want_by_lane = lanes.block == G;
    let src = v.data.as_ptr();
    let dst = out.as_mut_ptr();
    for l0 in (0..ld).step_by(G) {
        for u0 in (0..ud).step_by(G) {
            let mut rows = [_mm512_setzero_si512(); G];
            for (i, row) in rows.iter_mut().enumerate() {
                // SAFETY: every element read is at most `last_in` (checked above).
                *row = unsafe {
                    if by_lane {
                        E::units(src.add(base + (l0 + i) * v.rs + 2 * u0))
                    } else {
                        let at = base + l0 + 2 * (u0 + i) * v.cs;
                        let (lo, hi) = (E::lanes(src.add(at)), E::lanes(src.add(at + v.cs)));
                        _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
                    }
                };
            }
            if by_lane != want_by_lane {
                transpose(&mut rows);
            }
            for (i, row) in rows.iter().enumerate() {
                // `[lane][unit]` blocks: row i is lane l0 + i, 16 consecutive units; `[unit]
                // [lane]`: row i is unit u0 + i, 16 consecutive lanes.
                let at = if want_by_lane {
                    lanes.at(u0, l0 + i)
                } else {
                    lanes.at(u0 + i, l0)
                };
                // SAFETY: the 16 units from `at` are inside the rectangle (checked above).
                unsafe { _mm512_storeu_si512(dst.add(at).cast(), *row) };
            }
        }
    }
    (ld, ud)
}

/// Transposes a 16 x 16 matrix of 32-bit elements held one row per vector.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose(r: &mut [__m512i; G]) {
    // Pairs of rows interleaved by 32 bits, then by 64 bits: 4 x 4 blocks transposed within
    // each 128-bit lane.
    let mut t = [_mm512_unpacklo_epi32(r[0], r[1]); G];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for q in 0..4 {
        let b = 4 * q;
        r[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        r[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        r[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        r[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    // Then the 128-bit lanes: 4 x 4 blocks of them transposed.
    for q in 0..4 {
        let (a, b) = (q, q + 4);
        t[q] = _mm512_shuffle_i32x4::<0x88>(r[a], r[b]);
        t[q + 4] = _mm512_shuffle_i32x4::<0xdd>(r[a], r[b]);
        let (a, b) = (q + 8, q + 12);
        t[q + 8] = _mm512_shuffle_i32x4::<0x88>(r[a], r[b]);
        t[q + 12] = _mm512_shuffle_i32x4::<0xdd>(r[a], r[b]);
    }
    for q in 0..8 {
        r[q] = _mm512_shuffle_i32x4::<0x88>(t[q], t[q + 8]);
        r[q + 8] = _mm512_shuffle_i32x4::<0xdd>(t[q], t[q + 8]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_turns_rows_into_columns() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let m: Vec<u32> = (0..256).collect();
        let mut rows = [[0u32; G]; G];
        // SAFETY: avx512f exists (checked above); each row holds 16 u32.
        unsafe {
            let mut v: [__m512i; G] =
                std::array::from_fn(|i| _mm512_loadu_si512(m[i * G..].as_ptr().cast()));
            transpose(&mut v);
            for (row, v) in rows.iter_mut().zip(&v) {
                _mm512_storeu_si512(row.as_mut_ptr().cast(), *v);
            }
        }
        for i in 0..G {
            for j in 0..G {
                assert_eq!(rows[i][j], m[j * G + i], "({i}, {j})");
            }
        }
    }
}
