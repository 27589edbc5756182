//! 2-D max and average pooling on CPU with any window, stride and padding, forward and
//! backward.
//!
//! candle's `max_pool2d` has no backward when the stride differs from the window (ResNet's 3x3
//! stride-2 stem pool) and no padding. The max pool pools `(batch, channels, h, w)` in its
//! input's dtype, padding with -inf as PyTorch does; its backward sends each output's gradient
//! to the first position holding the window's maximum (PyTorch's choice too), summing where
//! windows overlap.
//!
//! candle's `avg_pool2d` has no backward either unless stride = window, and on half inputs it
//! sums in the half type (a rounding per addition) and multiplies by `1 / area` rounded to it
//! (1/9 -> 0.111328125 in bf16: every 3x3 average 0.2% high, its gradient too). The average
//! pool here sums each window in f32, divides by the window's area (zero padding counted, as
//! PyTorch's default `count_include_pad=True`) and rounds once, as PyTorch's CPU kernel does;
//! its backward spreads each output's gradient evenly over the window, in f32.
//!
//! On CUDA the max pool is the same op (`kernels::cuda::pool`: one thread per output, the
//! gradient added in f32 and rounded once). Elsewhere, and for the average pool off the CPU,
//! the pools are compositions of candle ops with the same semantics ([`max_pool2d_composed`],
//! [`avg_pool2d_composed`]): every window tap gathered by `index_select`, then the argmax
//! gathered or the f32 sum divided; they cost a copy of the output per tap, and train at any
//! stride and padding.

use crate::kernels::elem::{cpu_float, cuda_float, with_floats};
use std::ops::Range;

use crate::kernels::parallel;

use crate::kernels::elem::Real;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

/// Window `(h, w)`, stride `(h, w)` and padding (both sides of both dimensions) of a max pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pool2d {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: usize,
}

impl Pool2d {
    /// Windows of `kernel` side by side: stride = window, no padding (`max_pool2d(k)`).
    pub fn tiling(kernel: (usize, usize)) -> Self {
        Self::strided(kernel, kernel)
    }

    /// Windows of `kernel` every `stride`, no padding (`max_pool2d_with_stride(k, s)`).
    pub fn strided(kernel: (usize, usize), stride: (usize, usize)) -> Self {
        Self {
            kernel,
            stride,
            padding: 0,
        }
    }

    fn out(&self, (h, w): (usize, usize)) -> (usize, usize) {
        (
            (h + 2 * self.padding - self.kernel.0) / self.stride.0 + 1,
            (w + 2 * self.padding - self.kernel.1) / self.stride.1 + 1,
        )
    }

    /// Whether every window holds a value of a non-empty `(h, w)` plane: window and stride
    /// positive, the padded plane (which must fit a `usize`) at least a window wide.
    fn fits(&self, (h, w): (usize, usize)) -> bool {
        let padded = |n: usize| {
            n.checked_add(self.padding.checked_mul(2)?)
                .filter(|_| n > 0)
        };
        self.kernel.0 > 0
            && self.kernel.1 > 0
            && self.stride.0 > 0
            && self.stride.1 > 0
            && padded(h).is_some_and(|p| p >= self.kernel.0)
            && padded(w).is_some_and(|p| p >= self.kernel.1)
    }

    /// The input rows (or columns) of output `o` along a dimension of `n`: the in-bounds part
    /// of its window, `o * stride - padding` and the `kernel - 1` after it.
    fn span(o: usize, stride: usize, kernel: usize, padding: usize, n: usize) -> Range<usize> {
        let start = (o * stride).saturating_sub(padding);
        let end = (o * stride + kernel).saturating_sub(padding).min(n);
        start..end.max(start)
    }

    /// The windows of a `(h, w)` plane.
    fn windows(&self, (h, w): (usize, usize)) -> Windows {
        let (oh, ow) = self.out((h, w));
        let (k, s, pad) = (self.kernel, self.stride, self.padding);
        let cols: Vec<Range<usize>> = (0..ow).map(|o| Self::span(o, s.1, k.1, pad, w)).collect();
        // Clipping shortens the windows of a prefix and a suffix of the output columns only.
        let whole = |c: &Range<usize>| c.len() == k.1;
        let inner = match cols.iter().position(whole) {
            Some(first) => first..cols.iter().rposition(whole).map_or(first, |last| last + 1),
            None => 0..0,
        };
        Windows {
            rows: (0..oh).map(|o| Self::span(o, s.0, k.0, pad, h)).collect(),
            cols,
            inner,
            w,
            kw: k.1,
            stride: s.1,
        }
    }
}

/// Where each window of a plane lies: its in-bounds rows (per output row) and columns (per
/// output column), and the run of output columns whose windows lie wholly inside the plane.
struct Windows {
    rows: Vec<Range<usize>>,
    cols: Vec<Range<usize>>,
    inner: Range<usize>,
    /// The plane's width, the window's, and the stride along them.
    w: usize,
    kw: usize,
    stride: usize,
}

/// `best` of a window wholly in the padding (which [`check`] rules out; kept total).
const NO_VALUE: usize = usize::MAX;

impl Windows {
    /// The first maximum of each window of output row `oy` (as [`argmax`]): `best[ox]` its
    /// offset in `plane`, or [`NO_VALUE`]; `top` is scratch of the row's length.
    fn row_argmax(&self, plane: &[f32], oy: usize, best: &mut [usize], top: &mut [f32]) {
        let (w, rows) = (self.w, &self.rows[oy]);
        let tiled = match (self.stride == self.kw && !rows.is_empty(), self.kw) {
            (true, 2) => self.tiled_argmax::<2>(plane, rows, best, top),
            (true, 3) => self.tiled_argmax::<3>(plane, rows, best, top),
            _ => 0..0,
        };
        for (ox, cols) in self.cols.iter().enumerate() {
            if !tiled.contains(&ox) {
                best[ox] = argmax(plane, w, rows, cols).unwrap_or(NO_VALUE);
            }
        }
    }

    /// [`Self::row_argmax`] of the inner columns (returned) when the windows tile the row
    /// (`stride` = window width = `K`) and `rows` is not empty: all of them advance together,
    /// one window position at a time, so that the compiler vectorises across windows (one
    /// window at a time, the comparisons are one dependent chain).
    fn tiled_argmax<const K: usize>(
        &self,
        plane: &[f32],
        rows: &Range<usize>,
        best: &mut [usize],
        top: &mut [f32],
    ) -> Range<usize> {
        let n = self.inner.len();
        if n == 0 {
            return 0..0;
        }
        let x0 = self.cols[self.inner.start].start;
        let (best, top) = (&mut best[self.inner.clone()], &mut top[..n]);
        for y in rows.clone() {
            let start = y * self.w + x0;
            let (windows, _) = plane[start..][..n * K].as_chunks::<K>();
            let first = y == rows.start;
            for (i, ((b, t), win)) in best.iter_mut().zip(top.iter_mut()).zip(windows).enumerate() {
                let at = start + i * K;
                let (mut b_, mut t_) = if first { (at, win[0]) } else { (*b, *t) };
                for (kx, &v) in win.iter().enumerate().skip(usize::from(first)) {
                    let better = (v > t_) | (v.is_nan() & !t_.is_nan());
                    b_ = if better { at + kx } else { b_ };
                    t_ = if better { v } else { t_ };
                }
                *b = b_;
                *t = t_;
            }
        }
        self.inner.clone()
    }
}

/// The offset in `plane` (rows of `w`) of the first maximum of the window `rows x cols`; NaN
/// wins, as in PyTorch (it propagates). `None` for a window wholly in the padding.
#[inline]
fn argmax(plane: &[f32], w: usize, rows: &Range<usize>, cols: &Range<usize>) -> Option<usize> {
    if rows.is_empty() || cols.is_empty() {
        return None;
    }
    let mut best = rows.start * w + cols.start;
    let mut top = plane[best];
    for y in rows.clone() {
        let row = &plane[y * w..][..cols.end];
        for x in cols.clone() {
            // Branch-free selects: which element of a window is largest is data, and a branch
            // on it was mispredicted about half the time.
            let v = row[x];
            let better = (v > top) | (v.is_nan() & !top.is_nan());
            best = if better { y * w + x } else { best };
            top = if better { v } else { top };
        }
    }
    Some(best)
}

/// Plane `c` of `x` (`len` values) as f32: the values themselves for f32, widened 16 at a time
/// into `buf` for the half types (one conversion per value, not one per window it falls in).
fn plane_f32<'a, T: Real>(x: &'a [T], c: usize, len: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
    let plane = &x[c * len..][..len];
    if let Some(values) = crate::kernels::elem::as_f32(plane) {
        return values;
    }
    buf.resize(len, 0.0);
    T::widen(plane, buf);
    buf
}

/// Whether `p` pools a `(h, w)` plane: the window fits the padded plane, and the padding is at
/// most half the window (PyTorch's rule too: a wider one leaves windows of nothing but padding).
fn check(op: &str, p: Pool2d, (h, w): (usize, usize)) -> Result<()> {
    if h == 0 || w == 0 {
        candle_core::bail!("{op}: the input's {h}x{w} planes are empty: no window has a value");
    }
    if [p.kernel.0, p.kernel.1, p.stride.0, p.stride.1].contains(&0) {
        candle_core::bail!(
            "{op}: the window {:?} and the stride {:?} must be positive, as PyTorch's",
            p.kernel,
            p.stride
        );
    }
    if !p.fits((h, w)) {
        candle_core::bail!(
            "{op}: a {:?} window with stride {:?} does not fit a {h}x{w} input padded by {}",
            p.kernel,
            p.stride,
            p.padding
        );
    }
    if 2 * p.padding > p.kernel.0.min(p.kernel.1) {
        candle_core::bail!(
            "{op}: padding {} is more than half the {:?} window",
            p.padding,
            p.kernel
        );
    }
    Ok(())
}

/// Max pooling of `x`: this op on CPU and (feature `cuda`) CUDA, float dtypes;
/// [`max_pool2d_composed`] elsewhere.
pub(crate) fn max_pool2d(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    batched("max_pool2d", x, |x| max_pool2d_batch(x, p))
}

/// `pool` of a batch `(n, c, h, w)`, or of one image `(c, h, w)` as a batch of one, as
/// PyTorch's pools take an unbatched input; another rank is an error naming the op.
pub(crate) fn batched(
    op: &str,
    x: &Tensor,
    pool: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    match x.rank() {
        4 => pool(x),
        3 => pool(&x.unsqueeze(0)?)?.squeeze(0),
        _ => candle_core::bail!(
            "{op}: the input is (batch, channels, h, w) or (channels, h, w), got {:?}",
            x.dims()
        ),
    }
}

fn max_pool2d_batch(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    check("max_pool2d", p, (h, w))?;
    if cpu_float(x) || cuda_float(x) {
        x.contiguous()?.apply_op1(MaxPool(p))
    } else {
        max_pool2d_composed(x, p)
    }
}

/// Average pooling of `x`: this op on CPU (float dtypes), [`avg_pool2d_composed`] elsewhere.
pub(crate) fn avg_pool2d(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    batched("avg_pool2d", x, |x| avg_pool2d_batch(x, p))
}

fn avg_pool2d_batch(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    check("avg_pool2d", p, (h, w))?;
    if cpu_float(x) {
        x.contiguous()?.apply_op1(AvgPool(p))
    } else {
        avg_pool2d_composed(x, p)
    }
}

/// Every window of `x` padded by `fill`, as `(taps, n, c, oh, ow)`: tap `ky * kw + kx` holds each
/// window's element at `(ky, kx)`. Made of candle ops with a backward on every device (padding
/// by concatenation, one `index_select` of rows and one of columns per tap), so the pools below
/// train off the CPU at any stride and padding, where candle's own pools cannot (no padding;
/// a backward only for stride = window).
fn window_taps(x: &Tensor, p: Pool2d, fill: f32) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    let (oh, ow) = p.out((h, w));
    let pad = p.padding;
    let mut padded = x.clone();
    if pad > 0 {
        let dev = x.device();
        let side = Tensor::full(fill, (n, c, h, pad), dev)?.to_dtype(x.dtype())?;
        padded = Tensor::cat(&[&side, &padded, &side], 3)?;
        let band = Tensor::full(fill, (n, c, pad, w + 2 * pad), dev)?.to_dtype(x.dtype())?;
        padded = Tensor::cat(&[&band, &padded, &band], 2)?;
    }
    let positions = |first: usize, count: usize, stride: usize| {
        let at: Vec<u32> = (0..count)
            .map(|o| u32::try_from(first + o * stride))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| candle_core::Error::Msg("pool: an index past u32".into()))?;
        Tensor::from_vec(at, count, x.device())
    };
    let (kh, kw) = p.kernel;
    let mut taps = Vec::with_capacity(kh * kw);
    for ky in 0..kh {
        let rows = padded.index_select(&positions(ky, oh, p.stride.0)?, 2)?;
        for kx in 0..kw {
            taps.push(rows.index_select(&positions(kx, ow, p.stride.1)?, 3)?);
        }
    }
    Tensor::stack(&taps, 0)
}

/// Max pooling from candle ops (off the CPU): each window's maximum gathered at its argmax, so
/// its gradient goes to that one element, as in PyTorch (candle's own backward gives each tied
/// maximum the gradient times the number of ties over the window's area); a window holding a
/// NaN gives NaN, as in PyTorch. Padding is `-inf`. The windows are taken from an f32 copy, so
/// that where windows overlap the gradients add in f32 and are rounded once, as on CPU (the
/// values themselves pass through unchanged).
pub(crate) fn max_pool2d_composed(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    let taps = window_taps(
        &x.to_dtype(crate::kernels::elem::wide(x.dtype()))?,
        p,
        f32::NEG_INFINITY,
    )?;
    let at = taps.argmax_keepdim(0)?;
    let top = taps.gather(&at, 0)?.squeeze(0)?;
    let nan = taps.ne(&taps)?.max_keepdim(0)?.squeeze(0)?;
    let nans = Tensor::full(f32::NAN, top.shape(), x.device())?.to_dtype(top.dtype())?;
    nan.where_cond(&nans, &top)?.to_dtype(x.dtype())
}

/// Average pooling from candle ops (off the CPU): each window summed in f32 (f64 for f64) and
/// divided by its area (padding counted, as zeros), rounded once to `x`'s dtype, as this
/// module's CPU op does.
pub(crate) fn avg_pool2d_composed(x: &Tensor, p: Pool2d) -> Result<Tensor> {
    let taps = window_taps(&x.to_dtype(crate::kernels::elem::wide(x.dtype()))?, p, 0.0)?;
    let area = (p.kernel.0 * p.kernel.1) as f64;
    (taps.sum(0)? / area)?.to_dtype(x.dtype())
}

struct MaxPool(Pool2d);

fn planes(l: &Layout) -> (usize, usize, usize) {
    let d = l.dims();
    (d[0] * d[1], d[2], d[3])
}

impl MaxPool {
    fn forward<T: Real + Send + Sync>(&self, x: &[T], l: &Layout) -> Vec<T> {
        let p = self.0;
        let (n, h, w) = planes(l);
        let (oh, ow) = p.out((h, w));
        let windows = p.windows((h, w));
        parallel::filled(n * oh * ow, oh * ow, |c, out| {
            let mut buf = Vec::new();
            let plane = plane_f32(x, c, h * w, &mut buf);
            let source = &x[c * h * w..][..h * w];
            let (mut best, mut top) = (vec![0; ow], vec![0f32; ow]);
            for (oy, out) in out.chunks_exact_mut(ow).enumerate() {
                windows.row_argmax(plane, oy, &mut best, &mut top);
                for (o, &at) in out.iter_mut().zip(&best) {
                    // The maximum's own value, to the bit (a NaN keeps its payload).
                    *o = if at == NO_VALUE {
                        T::put(f32::NEG_INFINITY)
                    } else {
                        source[at]
                    };
                }
            }
        })
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "amp-max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = self.0;
        let d = l.dims();
        let out = with_floats!("max pool", s, l, |x| WithDType::to_cpu_storage_owned(
            self.forward(x, l)
        ));
        let (oh, ow) = p.out((d[2], d[3]));
        Ok((out, Shape::from((d[0], d[1], oh, ow))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = cuda_shape(self.0, l);
        let y = crate::kernels::cuda::pool::max_pool(s, l, &shape)?;
        Ok((
            y,
            Shape::from((l.dims()[0], l.dims()[1], shape.oh, shape.ow)),
        ))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(
            &grad.contiguous()?,
            &MaxPoolGrad(self.0),
        )?))
    }
}

/// The geometry of `p` over the `(n, c, h, w)` input of layout `l`, as the CUDA kernels take it.
#[cfg(feature = "cuda")]
fn cuda_shape(p: Pool2d, l: &Layout) -> crate::kernels::cuda::pool::PoolShape {
    let (planes, h, w) = planes(l);
    let (oh, ow) = p.out((h, w));
    crate::kernels::cuda::pool::PoolShape {
        planes,
        h,
        w,
        oh,
        ow,
        kernel: p.kernel,
        stride: p.stride,
        padding: p.padding,
    }
}

/// `(x, grad_y) -> grad_x`.
struct MaxPoolGrad(Pool2d);

impl MaxPoolGrad {
    fn run<T: Real + Send + Sync>(&self, x: &[T], lx: &Layout, g: &[T]) -> Vec<T> {
        let p = self.0;
        let (n, h, w) = planes(lx);
        let (oh, ow) = p.out((h, w));
        let windows = p.windows((h, w));
        parallel::filled(n * h * w, h * w, |c, out| {
            let mut buf = Vec::new();
            let plane = plane_f32(x, c, h * w, &mut buf);
            let mut grads = vec![0f32; oh * ow];
            T::widen(&g[c * oh * ow..][..oh * ow], &mut grads);
            let mut acc = vec![0f32; h * w];
            let (mut best, mut top) = (vec![0; ow], vec![0f32; ow]);
            for (oy, grads) in grads.chunks_exact(ow).enumerate() {
                windows.row_argmax(plane, oy, &mut best, &mut top);
                for (&at, &g) in best.iter().zip(grads) {
                    if at != NO_VALUE {
                        acc[at] += g;
                    }
                }
            }
            T::narrow(&acc, out);
        })
    }
}

impl CustomOp2 for MaxPoolGrad {
    fn name(&self) -> &'static str {
        "amp-max-pool2d-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = with_floats!("max pool grad", s1, l1, s2, l2, |x, g| {
            WithDType::to_cpu_storage_owned(self.run(x, l1, g))
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = cuda_shape(self.0, l1);
        let grad = crate::kernels::cuda::pool::max_pool_grad((s1, l1), (s2, l2), &shape)?;
        Ok((grad, l1.shape().clone()))
    }
}

/// The average pool's op: `x -> y`.
struct AvgPool(Pool2d);

impl AvgPool {
    fn forward<T: Real + Send + Sync>(&self, x: &[T], l: &Layout) -> Vec<T> {
        let p = self.0;
        let (n, h, w) = planes(l);
        let (oh, ow) = p.out((h, w));
        let windows = p.windows((h, w));
        let area = (p.kernel.0 * p.kernel.1) as f32;
        parallel::filled(n * oh * ow, oh * ow, |c, out| {
            let mut buf = Vec::new();
            let plane = plane_f32(x, c, h * w, &mut buf);
            let mut means = vec![0f32; ow];
            for (rows, out) in windows.rows.iter().zip(out.chunks_exact_mut(ow)) {
                for (mean, cols) in means.iter_mut().zip(&windows.cols) {
                    let sum: f32 = rows
                        .clone()
                        .map(|y| plane[y * w..][cols.clone()].iter().sum::<f32>())
                        .sum();
                    *mean = sum / area;
                }
                T::narrow(&means, out);
            }
        })
    }
}

impl CustomOp1 for AvgPool {
    fn name(&self) -> &'static str {
        "amp-avg-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l.dims();
        let out = with_floats!("avg pool", s, l, |x| WithDType::to_cpu_storage_owned(
            self.forward(x, l)
        ));
        let (oh, ow) = self.0.out((d[2], d[3]));
        Ok((out, Shape::from((d[0], d[1], oh, ow))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (h, w) = (arg.dim(2)?, arg.dim(3)?);
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&AvgPoolGrad {
            pool: self.0,
            input: (h, w),
        })?))
    }
}

/// `grad_y -> grad_x` of the average pool of a `input`-sized plane: each output's gradient
/// divided by the window's area and added over the window's in-bounds positions, in f32.
struct AvgPoolGrad {
    pool: Pool2d,
    input: (usize, usize),
}

impl AvgPoolGrad {
    fn run<T: Real + Send + Sync>(&self, g: &[T], l: &Layout) -> Vec<T> {
        let p = self.pool;
        let (h, w) = self.input;
        let d = l.dims();
        let (n, oh, ow) = (d[0] * d[1], d[2], d[3]);
        let windows = p.windows((h, w));
        let area = (p.kernel.0 * p.kernel.1) as f32;
        parallel::filled(n * h * w, h * w, |c, out| {
            let mut grads = vec![0f32; oh * ow];
            T::widen(&g[c * oh * ow..][..oh * ow], &mut grads);
            let mut acc = vec![0f32; h * w];
            for (rows, grads) in windows.rows.iter().zip(grads.chunks_exact(ow)) {
                for (&g, cols) in grads.iter().zip(&windows.cols) {
                    let share = g / area;
                    for y in rows.clone() {
                        for a in &mut acc[y * w..][cols.clone()] {
                            *a += share;
                        }
                    }
                }
            }
            T::narrow(&acc, out);
        })
    }
}

impl CustomOp1 for AvgPoolGrad {
    fn name(&self) -> &'static str {
        "amp-avg-pool2d-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l.dims();
        let out = with_floats!("avg pool grad", s, l, |g| WithDType::to_cpu_storage_owned(
            self.run(g, l)
        ));
        Ok((out, Shape::from((d[0], d[1], self.input.0, self.input.1))))
    }
}

#[cfg(test)]
mod tests;
