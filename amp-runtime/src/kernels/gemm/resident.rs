//! Small bf16 products whose B is packed once and used many times, and whose A is read where it
//! lies: attention's per-head products, on the `vdpbf16ps` micro-kernel.
//!
//! Attention multiplies each head's keys and values with every block of a few dozen query rows.
//! [`super::gemm`] packs both operands of every product, and at those sizes the packing took
//! longer than the products (a third of the op's time on a Zen 4 core, the products a fifth).
//! Here a B (a head's keys or values, either way round) is packed once per head into the
//! kernel's panels ([`PackedB`]), and an A is read in place as units, two consecutive bf16
//! along `k` in 32 bits ([`UnitRows`]): a row-major bf16 matrix already is one, and so is a
//! transposed f32 matrix written as pairs of its rows ([`Bf16Products::row_pairs`]); the kernel
//! broadcasts each unit straight from where it is. Products and rounding are the packed GEMM's,
//! unit for unit in the same order: the results are the same bits.

use std::mem::MaybeUninit;

use half::bf16;

use super::{GemmElem, MatRef};

/// The bf16 products on `vdpbf16ps`: a value of this type proves the CPU runs them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bf16Products(Token);

#[cfg(target_arch = "x86_64")]
type Token = super::x86::Avx512Bf16;
/// No CPU of another architecture runs them: the type has no value.
#[cfg(not(target_arch = "x86_64"))]
type Token = std::convert::Infallible;

/// A `k x n` B in the bf16 kernel's panels: `n.div_ceil(NR)` panels of `k.div_ceil(2)` units of
/// `NR` lanes (zero past `k` and past `n`).
#[derive(Debug, Default)]
pub(crate) struct PackedB {
    panels: Vec<u32>,
    units: usize,
    n: usize,
}

/// An `m x 2 units` bf16 A read in place: unit `u` of row `i` is the element at `offset + i * rs
/// + u * step` and the one after it (the first in the unit's low half).
#[derive(Clone, Copy, Debug)]
pub(crate) struct UnitRows<'a> {
    pub data: &'a [u16],
    pub offset: usize,
    pub rs: usize,
    pub step: usize,
    pub units: usize,
}

impl<'a> UnitRows<'a> {
    /// `rows x 2 units` bf16 values, row-major at row stride `rs`, from `offset`.
    pub fn rows(data: &'a [u16], offset: usize, rs: usize, units: usize) -> Self {
        Self {
            data,
            offset,
            rs,
            step: 2,
            units,
        }
    }

    /// Rows of `cols` values as [`rows_as_units`] writes them.
    pub fn of_rows(units: &'a [u32], cols: usize) -> Self {
        let per_row = cols.div_ceil(2);
        Self::rows(as_halves(units), 0, 2 * per_row, per_row)
    }

    /// Units stored unit-major, `lanes` rows of them per unit (as [`Bf16Products::row_pairs`]
    /// writes them).
    pub fn lanes(units: &'a [u32], lanes: usize) -> Self {
        Self {
            data: as_halves(units),
            offset: 0,
            rs: 2,
            step: 2 * lanes,
            units: units.len() / lanes.max(1),
        }
    }
}

/// A u32 slice as its 16-bit halves, the low one first.
fn as_halves(units: &[u32]) -> &[u16] {
    // SAFETY: a u32 is two u16, aligned at least as strictly; little-endian x86 stores the low
    // half first (no other CPU makes a `Bf16Products`).
    unsafe { std::slice::from_raw_parts(units.as_ptr().cast::<u16>(), 2 * units.len()) }
}

/// `x` rounded to bf16 and paired as a unit, `first` in the low half (the GEMM's packing).
#[inline]
fn unit(first: f32, last: f32) -> u32 {
    u32::from(bf16::from_f32(first).to_bits()) | (u32::from(bf16::from_f32(last).to_bits()) << 16)
}

/// `x` (`rows x cols`, row-major f32) rounded to bf16 and written as rows of units, each row
/// padded with a zero to a whole unit: `x` as an A ([`UnitRows::rows`]).
pub(crate) fn rows_as_units(x: &[f32], rows: usize, cols: usize) -> Vec<u32> {
    let per_row = cols.div_ceil(2);
    let mut out = vec![0u32; rows * per_row];
    for (dst, src) in out
        .chunks_exact_mut(per_row.max(1))
        .zip(x.chunks_exact(cols.max(1)))
    {
        let halves = &mut as_halves_mut(dst)[..cols];
        crate::kernels::elem::convert_block(src, bf16_slice_mut(halves));
    }
    out
}

impl Bf16Products {
    /// The products, where the GEMM's bf16 kernel is `vdpbf16ps` (AVX512-BF16 without AMX: Zen
    /// 4). Where the GEMM runs on AMX tiles (Sapphire Rapids and later) it keeps them: Intel
    /// cores issue `vdpbf16ps` at half the rate of Zen 4's, and the trade of packing against
    /// the tiles' speed there has not been measured.
    pub(crate) fn detect() -> Option<Self> {
        match super::isa() {
            #[cfg(target_arch = "x86_64")]
            super::Isa::Avx512Bf16(cpu) => Some(Self(cpu)),
            _ => None,
        }
    }

    /// `x` (`rows x cols`, row-major f32) transposed, rounded to bf16 and written unit-major,
    /// each unit a pair of consecutive rows of `x` (the last paired with zeros when `rows` is
    /// odd): `x^T` as an A ([`UnitRows::lanes`] of `cols` lanes).
    pub(crate) fn row_pairs(self, x: &[f32], rows: usize, cols: usize) -> Vec<u32> {
        let units = rows.div_ceil(2);
        let mut out = Vec::with_capacity(units * cols);
        let zeros = vec![0f32; cols];
        for p in 0..units {
            let first = &x[2 * p * cols..][..cols];
            let last = x
                .get((2 * p + 1) * cols..(2 * p + 2) * cols)
                .unwrap_or(&zeros);
            self.pair(
                first,
                last,
                &mut out.spare_capacity_mut()[p * cols..][..cols],
            );
        }
        // SAFETY: `pair` wrote each unit's `cols` lanes.
        unsafe { out.set_len(units * cols) };
        out
    }

    /// `out[j] = unit(first[j], last[j])`.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::unused_self)] // the receiver is the proof
    fn pair(self, first: &[f32], last: &[f32], out: &mut [MaybeUninit<u32>]) {
        // SAFETY: `self.0` proves avx512f.
        unsafe { pair_avx512(first, last, out) }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn pair(self, _: &[f32], _: &[f32], _: &mut [MaybeUninit<u32>]) {
        match self.0 {}
    }

    /// `b` (`k x n`, its values rounded to bf16) packed.
    pub(crate) fn pack<S: GemmElem>(self, b: MatRef<S>, (k, n): (usize, usize)) -> PackedB {
        let units = k.div_ceil(2);
        let mut panels = vec![0u32; n.div_ceil(NR) * units * NR];
        if units > 0 && n > 0 {
            // B viewed as n lanes along k, as the GEMM packs it.
            let lanes = MatRef {
                rs: b.cs,
                cs: b.rs,
                ..b
            };
            self.pack_panels(lanes, (k, n, units), &mut panels);
        }
        PackedB { panels, units, n }
    }

    #[cfg(target_arch = "x86_64")]
    fn pack_panels<S: GemmElem>(
        self,
        lanes: MatRef<S>,
        (k, n, units): (usize, usize, usize),
        out: &mut [u32],
    ) {
        super::pack::pack_panels::<S, bf16, super::x86::Bf16Kernel>(
            super::x86::Bf16Kernel(self.0),
            lanes,
            0,
            n,
            k,
            units,
            out,
        );
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn pack_panels<S: GemmElem>(self, _: MatRef<S>, _: (usize, usize, usize), _: &mut [u32]) {
        match self.0 {}
    }

    /// `a * b` over `a.units` units and the first `n` columns of `b`, `m x n` row-major f32.
    pub(crate) fn product(self, (m, n): (usize, usize), a: UnitRows, b: &PackedB) -> Vec<f32> {
        let mut c = Vec::with_capacity(m * n);
        self.run((m, n), a, b, &mut c.spare_capacity_mut()[..m * n], n, false);
        // SAFETY: without `accumulate`, `run` writes every element of the `m x n` block.
        unsafe { c.set_len(m * n) };
        c
    }

    /// `c += a * b`, `c` `m x n` row-major f32 at row stride `ldc` (see [`Self::product`]).
    pub(crate) fn add_product(
        self,
        (m, n): (usize, usize),
        a: UnitRows,
        b: &PackedB,
        c: &mut [f32],
        ldc: usize,
    ) {
        // SAFETY: `MaybeUninit<f32>` has f32's layout, and `run` writes only values.
        let c = unsafe { &mut *(std::ptr::from_mut(c) as *mut [MaybeUninit<f32>]) };
        self.run((m, n), a, b, c, ldc, true);
    }

    /// `c = a * b`, or `c += a * b` with `accumulate` (`c` then initialised).
    fn run(
        self,
        (m, n): (usize, usize),
        a: UnitRows,
        b: &PackedB,
        c: &mut [MaybeUninit<f32>],
        ldc: usize,
        accumulate: bool,
    ) {
        assert!(
            n <= b.n && a.units <= b.units,
            "resident product: {n} columns of {}, {} units of {}",
            b.n,
            a.units,
            b.units
        );
        if m == 0 || n == 0 {
            return;
        }
        let last_unit = a.units.checked_sub(1).map_or(0, |u| u * a.step + 2);
        assert!(
            a.offset + (m - 1) * a.rs + last_unit <= a.data.len() && (m - 1) * ldc + n <= c.len(),
            "resident product: operands outside their data"
        );
        for (jp, col) in (0..n).step_by(NR).enumerate() {
            let panel = &b.panels[jp * b.units * NR..][..b.units * NR];
            for row in (0..m).step_by(MR) {
                let tile = Tile {
                    a: &a.data[a.offset + row * a.rs..],
                    rs: a.rs,
                    step: a.step,
                    rows: MR.min(m - row),
                    cols: NR.min(n - col),
                };
                self.tile(
                    a.units,
                    tile,
                    panel,
                    &mut c[row * ldc + col..],
                    ldc,
                    accumulate,
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::unused_self)] // the receiver is the proof
    fn tile(
        self,
        units: usize,
        a: Tile,
        panel: &[u32],
        c: &mut [MaybeUninit<f32>],
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: `self.0` proves avx512f and avx512bf16; `run` checked that the tile's rows
        // hold `units` units, that the panel holds them, and that C holds the tile.
        unsafe {
            super::x86::bf16_tile_in_place(
                units,
                (a.a.as_ptr(), a.rs, a.step, a.rows),
                panel.as_ptr(),
                c.as_mut_ptr().cast(),
                ldc,
                a.cols,
                accumulate,
            );
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn tile(self, _: usize, _: Tile, _: &[u32], _: &mut [MaybeUninit<f32>], _: usize, _: bool) {
        match self.0 {}
    }
}

/// Rows of one tile of A, from its first, and the tile's size.
struct Tile<'a> {
    a: &'a [u16],
    rs: usize,
    step: usize,
    rows: usize,
    cols: usize,
}

/// A u32 slice as its 16-bit halves, mutable (see [`as_halves`]).
fn as_halves_mut(units: &mut [u32]) -> &mut [u16] {
    // SAFETY: as `as_halves`.
    unsafe { std::slice::from_raw_parts_mut(units.as_mut_ptr().cast::<u16>(), 2 * units.len()) }
}

/// bf16 bits as bf16 values.
fn bf16_slice_mut(bits: &mut [u16]) -> &mut [bf16] {
    // SAFETY: bf16 is a transparent u16.
    unsafe { std::slice::from_raw_parts_mut(bits.as_mut_ptr().cast::<bf16>(), bits.len()) }
}

/// [`Bf16Products::pair`], 16 lanes at a time.
///
/// # Safety
/// The CPU has AVX-512F; `first`, `last` and `out` are equally long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pair_avx512(first: &[f32], last: &[f32], out: &mut [MaybeUninit<u32>]) {
    use std::arch::x86_64::{
        _mm512_loadu_ps, _mm512_or_si512, _mm512_slli_epi32, _mm512_storeu_si512,
    };

    use crate::kernels::simd::f32_to_bf16_lanes;

    let n = out.len();
    assert!(first.len() == n && last.len() == n, "pair: lengths differ");
    let whole = n / 16 * 16;
    for j in (0..whole).step_by(16) {
        // SAFETY: lanes `j..j + 16` lie in all three (`whole <= n`).
        unsafe {
            let lo = f32_to_bf16_lanes(_mm512_loadu_ps(first.as_ptr().add(j)));
            let hi = f32_to_bf16_lanes(_mm512_loadu_ps(last.as_ptr().add(j)));
            let units = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
            _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), units);
        }
    }
    for ((o, &a), &b) in out[whole..]
        .iter_mut()
        .zip(&first[whole..])
        .zip(&last[whole..])
    {
        o.write(unit(a, b));
    }
}

/// The bf16 kernel's tile: `MR` rows and `NR` columns.
#[cfg(target_arch = "x86_64")]
use super::x86::{MR, NR};
/// Never used: no value of [`Bf16Products`] exists on another architecture.
#[cfg(not(target_arch = "x86_64"))]
const MR: usize = 1;
#[cfg(not(target_arch = "x86_64"))]
const NR: usize = 1;
