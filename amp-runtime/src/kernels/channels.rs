//! Per-channel passes over `(outer, channels, inner)` tensors, shared by batch norm and the bias
//! add: the geometry, the per-channel affine pass and the per-channel sums (f32 within runs,
//! f64 across them).

use candle_core::{Layout, Result};

use crate::kernels::elem::Real;
use crate::kernels::parallel;
use crate::kernels::widen::{lane_sums2, map_widened, map_widened2, widened};

/// `(n, c, h * w)` of a 4-d layout; for the bias add, `(outer, channels, inner)` around any
/// one dimension.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub n: usize,
    pub c: usize,
    pub hw: usize,
}

impl Geometry {
    /// The `(n, c, h * w)` of a 4-d layout.
    pub(crate) fn of(layout: &Layout) -> Result<Self> {
        match layout.dims() {
            &[n, c, h, w] => Ok(Self { n, c, hw: h * w }),
            dims => candle_core::bail!("batch norm kernel: expected 4 dims, got {dims:?}"),
        }
    }

    /// The channels along dimension `dim` of `dims`, the dimensions before it as `n` and
    /// after it as `hw`.
    pub(crate) fn along(dims: &[usize], dim: usize) -> Result<Self> {
        let Some(&c) = dims.get(dim) else {
            candle_core::bail!("bias add: dimension {dim} of a rank-{} tensor", dims.len())
        };
        Ok(Self {
            n: dims[..dim].iter().product(),
            c,
            hw: dims[dim + 1..].iter().product(),
        })
    }

    /// Values per channel.
    pub(crate) fn count(self) -> usize {
        self.n * self.hw
    }

    /// The contiguous `(n, c)` rows of channel `c`.
    pub(crate) fn rows<T>(self, xs: &[T], c: usize) -> impl Iterator<Item = &[T]> {
        (0..self.n).map(move |n| &xs[(n * self.c + c) * self.hw..][..self.hw])
    }
}

/// The sum of `f(x)` over channel `c` of `xs`.
pub(crate) fn channel_sum<T: Real>(xs: &[T], g: Geometry, c: usize, f: impl Fn(f32) -> f32) -> f64 {
    let mut total = 0f64;
    for row in g.rows(xs, c) {
        widened(row, |x| {
            total += lane_sums2(x, x, |x, _| (f(x), 0.0)).0;
        });
    }
    total
}

/// [`channel_sum`] of `x` for every channel where the channels are innermost (`hw == 1`: a
/// `Linear`'s bias): the columns of `xs` seen as `(n, c)` rows, each value widened and added to
/// its column's f64 sum in row order, so the same bits as `channel_sum`, which took each
/// channel's values one call at a time (a sixth of a `Linear`'s f32 fwd+bwd at `(8, 128, 768)`);
/// blocks of columns in parallel.
pub(crate) fn column_sums<T: Real>(xs: &[T], g: Geometry) -> Vec<f64> {
    const COLUMNS: usize = 256;
    debug_assert_eq!(g.hw, 1, "column_sums: channels innermost");
    let mut sums = vec![0f64; g.c];
    parallel::for_each_chunk_mut(&mut sums, COLUMNS, |i, sums| {
        let (first, mut wide) = (i * COLUMNS, [0f32; COLUMNS]);
        let wide = &mut wide[..sums.len()];
        for row in xs.chunks_exact(g.c) {
            T::widen(&row[first..first + sums.len()], wide);
            for (s, &x) in sums.iter_mut().zip(wide.iter()) {
                *s += f64::from(x);
            }
        }
    });
    sums
}

/// Per-channel `(x - center) * scale + shift`: the elementwise pass shared by the forward and
/// the input gradient, row by row.
pub(crate) struct Affine<'a> {
    pub center: &'a [f32],
    pub scale: &'a [f32],
    pub shift: &'a [f32],
}

impl Affine<'_> {
    /// `out = x * scale + shift (+ k * dy)` per channel, rounded to `T`.
    pub(crate) fn apply<T: Real>(
        &self,
        xs: &[T],
        extra: Option<(&[T], &[f32])>,
        g: Geometry,
    ) -> Vec<T> {
        parallel::filled(xs.len(), g.hw.max(1), |row, out| {
            let c = row % g.c;
            let (center, scale, shift) = (self.center[c], self.scale[c], self.shift[c]);
            let xs = &xs[row * g.hw..][..g.hw];
            match extra {
                None => map_widened(xs, out, |xs, out| {
                    for (o, x) in out.iter_mut().zip(xs) {
                        *o = (x - center) * scale + shift;
                    }
                }),
                Some((dys, k)) => {
                    let (dys, k) = (&dys[row * g.hw..][..g.hw], k[c]);
                    map_widened2(xs, dys, out, |xs, dys, out| {
                        for ((o, x), dy) in out.iter_mut().zip(xs).zip(dys) {
                            *o = k * dy + (x - center) * scale + shift;
                        }
                    });
                }
            }
        })
    }
}

/// `values` rounded to `T` and widened back (the identity for f32); `_like` only names `T`.
pub(crate) fn rounded_like<T: Real>(_like: &[T], values: &[f32]) -> Vec<f32> {
    values.iter().map(|&v| T::put(v).get()).collect()
}
