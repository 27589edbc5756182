//! AVX-512 conversions between f32 and the 16-bit float formats, rounding exactly as `half`
//! does (to nearest, ties to even; a NaN stays a quiet NaN with its sign), so that vector and
//! scalar paths give the same bits.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::{
    __m256i, __m512, __m512i, _mm256_loadu_si256, _mm256_storeu_si256, _mm512_add_epi32,
    _mm512_and_si512, _mm512_castps_si512, _mm512_castsi512_ps, _mm512_cmp_ps_mask,
    _mm512_cvtepi32_epi16, _mm512_cvtepu16_epi32, _mm512_cvtph_ps, _mm512_cvtps_ph,
    _mm512_mask_mov_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_slli_epi32,
    _mm512_srli_epi32, _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
};

/// 16 f32 rounded to bf16 bits.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn f32_to_bf16(v: __m512) -> __m256i {
    _mm512_cvtepi32_epi16(f32_to_bf16_lanes(v))
}

/// 16 f32 rounded to bf16 bits, each in the low half of its 32-bit lane (the high half zero).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn f32_to_bf16_lanes(v: __m512) -> __m512i {
    let bits = _mm512_castps_si512(v);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
    _mm512_mask_mov_epi32(rounded, nan, quiet)
}

/// 16 bf16 bits widened to f32 (exact).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn bf16_to_f32(h: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// Loads 16 bf16 (`bf16`) or f16 values at `src` as f32.
///
/// # Safety
/// `src` addresses 16 readable `u16`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn load16(src: *const u16, bf16: bool) -> __m512 {
    // SAFETY: the caller's 16 values.
    let h = unsafe { _mm256_loadu_si256(src.cast()) };
    if bf16 {
        bf16_to_f32(h)
    } else {
        _mm512_cvtph_ps(h)
    }
}

/// Stores 16 f32 as bf16 (`bf16`) or f16 at `dst`.
///
/// # Safety
/// `dst` addresses 16 writable `u16`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn store16(dst: *mut u16, v: __m512, bf16: bool) {
    let h = if bf16 {
        f32_to_bf16(v)
    } else {
        _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)
    };
    // SAFETY: the caller's 16 slots.
    unsafe { _mm256_storeu_si256(dst.cast(), h) };
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;

    /// Every rounding case against `half`: ties, carries into the exponent, overflow to inf,
    /// subnormals, infinities, NaN of both signs.
    #[test]
    fn vector_conversions_round_exactly_as_half_does() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            65504.0,
            65520.0,
            1e-8,
            -3e-39,
            1e-45,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            3.0e38,
            // Ties at bf16's precision: 1 + 2^-8 rounds down to even, 1 + 3 * 2^-8 up.
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
        ];
        values.extend((0..4000).map(|i| f32::from_bits(0x3F80_0000u32.wrapping_add(i * 0x1_0001))));
        values.extend((0..4000).map(|i| f32::from_bits(0x0000_8000u32.wrapping_mul(i + 1))));
        while !values.len().is_multiple_of(16) {
            values.push(2.0);
        }
        for chunk in values.chunks(16) {
            let mut b = [0u16; 16];
            let mut h = [0u16; 16];
            // SAFETY: avx512f checked above; arrays of 16.
            unsafe {
                let v = std::arch::x86_64::_mm512_loadu_ps(chunk.as_ptr());
                store16(b.as_mut_ptr(), v, true);
                store16(h.as_mut_ptr(), v, false);
            }
            for (i, &x) in chunk.iter().enumerate() {
                assert_eq!(
                    b[i],
                    bf16::from_f32(x).to_bits(),
                    "bf16 of {x:e} ({:#x})",
                    x.to_bits()
                );
                assert_eq!(
                    h[i],
                    f16::from_f32(x).to_bits(),
                    "f16 of {x:e} ({:#x})",
                    x.to_bits()
                );
                // SAFETY: as above.
                let (wb, wh) = unsafe { (load16(b.as_ptr(), true), load16(h.as_ptr(), false)) };
                let (mut ob, mut oh) = ([0f32; 16], [0f32; 16]);
                // SAFETY: arrays of 16.
                unsafe {
                    std::arch::x86_64::_mm512_storeu_ps(ob.as_mut_ptr(), wb);
                    std::arch::x86_64::_mm512_storeu_ps(oh.as_mut_ptr(), wh);
                }
                let want_b = bf16::from_bits(b[i]).to_f32();
                let want_h = f16::from_bits(h[i]).to_f32();
                assert!(ob[i].to_bits() == want_b.to_bits() || (ob[i].is_nan() && want_b.is_nan()));
                assert!(oh[i].to_bits() == want_h.to_bits() || (oh[i].is_nan() && want_h.is_nan()));
            }
        }
    }
}
