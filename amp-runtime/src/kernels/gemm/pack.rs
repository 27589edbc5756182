//! Packing: the operands' lanes (rows of A, columns of B) copied into the micro-panels the
//! kernels read, rounded to the product's type on the way.

use std::ops::Range;

use super::{rounded, same_type, GemmElem, Kernel, MatRef};

/// Packs `count` lanes from `first` into consecutive `NR`-lane micro-panels of B, each of
/// `units` units, those past `kc` zero (`out` holds them all). When the lanes at each `k` are
/// contiguous (a row-major B, or the f32 master of one), every panel is filled in one walk
/// along B's rows, which reads memory in order: a panel at a time would stride across all `k`
/// rows for every 32 lanes, a page apart for a 1024-wide f32 weight. The kernel's vector path
/// ([`Kernel::walk_fast`]) walks the whole panels; a master operand without one goes a panel
/// at a time through [`pack`], whose vector path rounds 16 values at once: rounding them one
/// by one in the walk cost more than the walk saves.
pub(super) fn pack_panels<S: GemmElem, T: GemmElem, K: Kernel>(
    kernel: K,
    v: MatRef<S>,
    first: usize,
    count: usize,
    kc: usize,
    units: usize,
    out: &mut [K::Unit],
) {
    let panel = units * K::NR;
    let whole = kc / K::KSTEP;
    let walk = v.rs == 1 && v.cs != 1 && kc.is_multiple_of(K::KSTEP);
    let done = if walk {
        kernel.walk_fast(v, first, count, whole, units, out)
    } else {
        0
    };
    if !walk || (done == 0 && !same_type::<S, T>()) {
        for (p, out) in out.chunks_mut(panel).enumerate() {
            let l0 = p * K::NR;
            let lanes = Lanes {
                first: first + l0,
                count: K::NR.min(count - l0),
                width: K::NR,
                block: 1,
            };
            pack::<S, T, K>(kernel, v, lanes, kc, units, out);
        }
        return;
    }
    debug_assert!(done.is_multiple_of(K::NR), "walk_fast: {done} lanes");
    let base = v.offset + first;
    let first_panel = done / K::NR;
    for u in 0..whole {
        let k0 = u * K::KSTEP;
        let lo = &v.data[base + k0 * v.cs..][done..count];
        let hi = &v.data[base + (k0 + K::KSTEP - 1) * v.cs..][done..count];
        for (p, (lo, hi)) in lo.chunks(K::NR).zip(hi.chunks(K::NR)).enumerate() {
            let dst = &mut out[(first_panel + p) * panel + u * K::NR..][..lo.len()];
            for ((unit, &x), &y) in dst.iter_mut().zip(lo).zip(hi) {
                *unit = K::unit::<T>(rounded(x), rounded(y));
            }
        }
    }
    for p in out.chunks_mut(panel) {
        p[whole * K::NR..].fill(K::Unit::default());
    }
}

/// Which lanes a micro-panel holds and how they are laid out (see [`Kernel::A_BLOCK`]).
#[derive(Clone, Copy)]
pub(super) struct Lanes {
    /// The first lane (row of `v`).
    pub first: usize,
    /// Lanes present; those up to `width` are left as they are (see [`super::scratch::Scratch`]).
    pub count: usize,
    /// Lanes of the panel.
    pub width: usize,
    /// Units per block.
    pub block: usize,
}

impl Lanes {
    /// Where unit `u` of lane `l` goes.
    #[inline]
    pub fn at(&self, u: usize, l: usize) -> usize {
        (u / self.block) * self.width * self.block + l * self.block + u % self.block
    }
}

/// Packs the lanes `lanes` describes (rows of `v`, which is A or B transposed) over the inner
/// dimension `0..kc` into `out`, a panel of `units` units per lane, its values rounded from
/// `S` to the product's type `T`; the units past `kc` are zero.
pub(super) fn pack<S: GemmElem, T: GemmElem, K: Kernel>(
    kernel: K,
    v: MatRef<S>,
    lanes: Lanes,
    kc: usize,
    units: usize,
    out: &mut [K::Unit],
) {
    let (count, width) = (lanes.count, lanes.width);
    let base = v.offset + lanes.first * v.rs;
    let whole = kc / K::KSTEP;
    // A unit's last value: past `kc` (an odd tail of bf16 pairs) it is zero.
    let zero = T::put(0.0);
    let value = |l: usize, kk: usize| -> T {
        if kk < kc {
            rounded(v.data[base + l * v.rs + kk * v.cs])
        } else {
            zero
        }
    };
    // The units `units` of the lanes `lanes_of` (of `count`), element by element.
    let scalar = |out: &mut [K::Unit], lanes_of: Range<usize>, units_of: Range<usize>| {
        if v.cs == 1 {
            // Each lane's run along k is contiguous.
            for l in lanes_of {
                let run = &v.data[base + l * v.rs..][..whole * K::KSTEP];
                let run = &run[units_of.start * K::KSTEP..units_of.end * K::KSTEP];
                for (u, values) in units_of.clone().zip(run.chunks_exact(K::KSTEP)) {
                    out[lanes.at(u, l)] =
                        K::unit::<T>(rounded(values[0]), rounded(values[K::KSTEP - 1]));
                }
            }
        } else if v.rs == 1 && lanes.block == 1 {
            // The lanes at each k are contiguous.
            for u in units_of {
                let k0 = u * K::KSTEP;
                let lo = &v.data[base + k0 * v.cs..][lanes_of.clone()];
                let hi = &v.data[base + (k0 + K::KSTEP - 1) * v.cs..][lanes_of.clone()];
                let dst = &mut out[u * width..][lanes_of.clone()];
                for ((unit, &x), &y) in dst.iter_mut().zip(lo).zip(hi) {
                    *unit = K::unit::<T>(rounded(x), rounded(y));
                }
            }
        } else {
            for l in lanes_of {
                for u in units_of.clone() {
                    let k0 = u * K::KSTEP;
                    out[lanes.at(u, l)] = K::unit(value(l, k0), value(l, k0 + K::KSTEP - 1));
                }
            }
        }
    };
    // The kernel's vector path packs a rectangle of whole groups; the rest is scalar.
    let (done_lanes, done_units) = kernel.pack_fast(v, lanes, whole, out);
    scalar(out, 0..count, done_units..whole);
    scalar(out, done_lanes..count, 0..done_units);
    let k0 = whole * K::KSTEP;
    for l in 0..count {
        if k0 < kc {
            out[lanes.at(whole, l)] = K::unit(value(l, k0), value(l, k0 + K::KSTEP - 1));
        }
        for u in kc.div_ceil(K::KSTEP)..units {
            out[lanes.at(u, l)] = K::Unit::default();
        }
    }
}
