//! Widened passes: half values read as f32 a block at a time on the stack, computed on in f32,
//! and rounded once on the way out; the element-wise kernels' reading and writing sides.

use crate::kernels::elem::{as_f32, as_f32_mut, Real};
use crate::kernels::parallel;

/// Elements per block of a widened pass: f32 scratch on the stack, in L1.
pub(crate) const BLOCK: usize = 512;

/// Calls `f` on consecutive runs of `a` and `b` (equal lengths, each of any element type) as
/// f32: the slices themselves when both are f32, blocks widened on the stack otherwise. The
/// elementwise kernels' reading side.
pub(crate) fn widened2<T: Real, U: Real>(a: &[T], b: &[U], mut f: impl FnMut(&[f32], &[f32])) {
    if let (Some(a), Some(b)) = (as_f32(a), as_f32(b)) {
        return f(a, b);
    }
    let (mut wa, mut wb) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (a, b) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        let (wa, wb) = (&mut wa[..a.len()], &mut wb[..a.len()]);
        T::widen(a, wa);
        U::widen(b, wb);
        f(wa, wb);
    }
}

/// Calls `f` on consecutive runs of `xs` as f32 (see [`widened2`]).
pub(crate) fn widened<T: Real>(xs: &[T], mut f: impl FnMut(&[f32])) {
    widened2(xs, xs, |x, _| f(x));
}

/// Elements summed in f32 before a partial sum joins the f64 total.
const RUN: usize = 256;

/// The sums of both values of `f(x, y)` over `x` and `y` (equal lengths): sixteen f32 lanes
/// over each run of [`RUN`] elements (so the compiler vectorises), the runs added in f64.
pub(crate) fn lane_sums2(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> (f32, f32)) -> (f64, f64) {
    let (mut ta, mut tb) = (0f64, 0f64);
    for (x, y) in x.chunks(RUN).zip(y.chunks(RUN)) {
        let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
        let mut add = |lanes: &[f32], ys: &[f32]| {
            for (l, (&x, &y)) in lanes.iter().zip(ys).enumerate() {
                let (u, v) = f(x, y);
                a[l] += u;
                b[l] += v;
            }
        };
        let (xs, ys) = (x.chunks_exact(16), y.chunks_exact(16));
        let (xr, yr) = (xs.remainder(), ys.remainder());
        for (x, y) in xs.zip(ys) {
            add(x, y);
        }
        add(xr, yr);
        ta += f64::from(a.iter().sum::<f32>());
        tb += f64::from(b.iter().sum::<f32>());
    }
    (ta, tb)
}

/// Elements per parallel chunk of [`zip_map`].
const ZIP_CHUNK: usize = 1 << 14;

/// `f` over zipped chunks of `a` and `b`, widened to f32, into a new vector, in parallel: the
/// pass of the one-input element-wise ops and their backwards (`zip_map(x, x, ..)` for one).
pub(crate) fn zip_map<T: Real + Send + Sync>(
    a: &[T],
    b: &[T],
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Vec<T> {
    parallel::filled(a.len(), ZIP_CHUNK, |i, o| {
        let (a, b) = (
            &a[i * ZIP_CHUNK..][..o.len()],
            &b[i * ZIP_CHUNK..][..o.len()],
        );
        map_widened2(a, b, o, |a, b, o| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = f(a, b);
            }
        });
    })
}

/// `out = f(a, b)` elementwise over equal lengths, computed on f32 runs and rounded once to
/// `T`: the elementwise kernels' writing side.
pub(crate) fn map_widened2<T: Real>(
    a: &[T],
    b: &[T],
    out: &mut [T],
    f: impl Fn(&[f32], &[f32], &mut [f32]),
) {
    if let (Some(a), Some(b), Some(o)) = (as_f32(a), as_f32(b), as_f32_mut(out)) {
        return f(a, b, o);
    }
    let mut wo = [0f32; BLOCK];
    let mut start = 0;
    widened2(a, b, |a, b| {
        let wo = &mut wo[..a.len()];
        f(a, b, wo);
        T::narrow(wo, &mut out[start..start + a.len()]);
        start += a.len();
    });
}

/// `out = f(xs)` elementwise (see [`map_widened2`]).
pub(crate) fn map_widened<T: Real>(xs: &[T], out: &mut [T], f: impl Fn(&[f32], &mut [f32])) {
    map_widened2(xs, xs, out, |x, _, o| f(x, o));
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use crate::kernels::widen::lane_sums2;

    use crate::kernels::widen::map_widened2;

    use crate::kernels::widen::widened;

    use crate::kernels::elem::Real;
    use crate::kernels::widen::BLOCK;

    /// The widened passes give what per-element `get`/`put` give, bit for bit, over lengths
    /// that end inside a vector, on a vector edge and across blocks.
    fn widened_passes_match_scalar<T: Real + std::fmt::Debug>() {
        for len in [0, 5, 16, 31, BLOCK, BLOCK + 1, 2 * BLOCK + 37] {
            let a: Vec<T> = (0..len)
                .map(|i| T::put((i as f32 * 0.37).sin() * 300.0))
                .collect();
            let b: Vec<T> = (0..len)
                .map(|i| T::put((i as f32 * 0.11).cos() - 0.5))
                .collect();
            let f = |x: f32, y: f32| x * y + 1.0 / 3.0;
            let mut out = vec![T::put(0.0); len];
            map_widened2(&a, &b, &mut out, |a, b, o| {
                for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            });
            let want: Vec<T> = a
                .iter()
                .zip(&b)
                .map(|(x, y)| T::put(f(x.get(), y.get())))
                .collect();
            assert_eq!(out, want, "{:?} len {len}", T::DTYPE);
            let mut seen = Vec::new();
            widened(&a, |x| seen.extend_from_slice(x));
            assert_eq!(seen, a.iter().map(|x| x.get()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn widened_passes_match_scalar_conversions() {
        widened_passes_match_scalar::<f32>();
        widened_passes_match_scalar::<bf16>();
        widened_passes_match_scalar::<f16>();
    }

    /// The f32 lane sums of long runs stay within f32 rounding of the exact (f64) sums.
    #[test]
    fn lane_sums_track_f64_sums() {
        let x: Vec<f32> = (0..100_003)
            .map(|i| (i as f32 * 0.013).sin() + 0.25)
            .collect();
        let y: Vec<f32> = (0..100_003).map(|i| (i as f32 * 0.007).cos()).collect();
        let (a, b) = lane_sums2(&x, &y, |x, y| (x, x * y));
        let exact_a: f64 = x.iter().map(|&v| f64::from(v)).sum();
        let exact_b: f64 = x.iter().zip(&y).map(|(&u, &v)| f64::from(u * v)).sum();
        let scale: f64 = x.iter().map(|&v| f64::from(v.abs())).sum();
        assert!((a - exact_a).abs() < 1e-6 * scale, "{a} vs {exact_a}");
        assert!((b - exact_b).abs() < 1e-6 * scale, "{b} vs {exact_b}");
    }
}
