//! The geometry of one convolution: output sizes, im2col and col2im, and the GEMM drivers over
//! images.

use std::ops::Range;

use candle_core::Shape;

use super::Conv2dParams;
use crate::kernels::elem::Real;
use crate::kernels::gemm::{gemm, gemm_append, GemmElem, MatRef};
use crate::kernels::parallel;

/// Output rows shorter than this go through [`Geometry::taps`] in im2col and col2im.
const GATHER_BELOW: usize = 8;

/// A tap's entry in [`Geometry::taps`] where it reads the padding.
const PADDING: u32 = u32::MAX;

/// The geometry of one convolution.
#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    pub batch: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub out_h: usize,
    pub out_w: usize,
    pub p: Conv2dParams,
}

impl Geometry {
    pub(super) fn new(x: &[usize], k: &[usize], p: Conv2dParams) -> Self {
        let out = |size: usize, ks: usize| {
            (size + 2 * p.padding - p.dilation * (ks - 1) - 1) / p.stride + 1
        };
        Self {
            batch: x[0],
            c_in: x[1],
            h: x[2],
            w: x[3],
            c_out: k[0],
            kh: k[2],
            kw: k[3],
            out_h: out(x[2], k[2]),
            out_w: out(x[3], k[3]),
            p,
        }
    }

    /// The sizes cuDNN's descriptors take.
    #[cfg(feature = "cudnn")]
    pub(super) fn cudnn_shape(&self) -> crate::kernels::cuda::conv::ConvShape {
        crate::kernels::cuda::conv::ConvShape {
            x: [self.batch, self.c_in, self.h, self.w],
            w: [self.c_out, self.c_in_g(), self.kh, self.kw],
            y: [self.batch, self.c_out, self.out_h, self.out_w],
            padding: self.p.padding,
            stride: self.p.stride,
            dilation: self.p.dilation,
            groups: self.p.groups,
        }
    }

    /// The input's shape `(batch, c_in, h, w)` (its gradient's).
    pub(super) fn in_shape(&self) -> Shape {
        Shape::from((self.batch, self.c_in, self.h, self.w))
    }

    /// The kernel's shape `(c_out, c_in / groups, kh, kw)` (its gradient's).
    pub(super) fn kernel_shape(&self) -> Shape {
        Shape::from((self.c_out, self.c_in_g(), self.kh, self.kw))
    }

    pub(super) fn out_shape(&self) -> Shape {
        Shape::from((self.batch, self.c_out, self.out_h, self.out_w))
    }

    pub(super) fn c_in_g(&self) -> usize {
        self.c_in / self.p.groups
    }
    pub(super) fn c_out_g(&self) -> usize {
        self.c_out / self.p.groups
    }
    /// Rows of the im2col matrix of one group: `c_in_g * kh * kw`.
    pub(super) fn col_rows(&self) -> usize {
        self.c_in_g() * self.kh * self.kw
    }
    /// Output pixels per image.
    pub(super) fn pixels(&self) -> usize {
        self.out_h * self.out_w
    }
    pub(super) fn image_in(&self) -> usize {
        self.c_in * self.h * self.w
    }
    pub(super) fn image_out(&self) -> usize {
        self.c_out * self.pixels()
    }
    /// A 1x1, stride-1, unpadded conv: the image itself is the im2col matrix.
    pub(super) fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.p.stride == 1 && self.p.padding == 0
    }
    /// Images per GEMM: enough that each product has at least `MIN_COLUMNS` columns (late
    /// ResNet stages have 1-16 pixels an image; one image per GEMM would repack the weight for
    /// a handful of columns), few enough that the chunk's im2col and gradient buffers stay small.
    pub(super) fn chunk(&self) -> usize {
        const MIN_COLUMNS: usize = 512;
        MIN_COLUMNS
            .div_ceil(self.pixels().max(1))
            .clamp(1, self.batch.max(1))
    }

    /// The im2col matrix of group `g` for `images`: `(col_rows, n)` with `n = images * pixels`,
    /// image `b`'s columns at `(b - images.start) * pixels`. Rows are filled in parallel.
    pub(super) fn columns<T: Copy + Send + Sync>(
        &self,
        x: &[T],
        g: usize,
        images: Range<usize>,
        zero: T,
    ) -> Vec<T> {
        let (pw, n) = (self.pixels(), images.len() * self.pixels());
        let mut col = vec![zero; self.col_rows() * n];
        let plane = self.h * self.w;
        let per_channel = self.kh * self.kw;
        let taps = self.taps();
        parallel::for_each_chunk_mut(&mut col, per_channel * n.max(1), |c, rows| {
            for (k, row) in rows.chunks_mut(n.max(1)).enumerate() {
                let (i, j) = (k / self.kw, k % self.kw);
                for (slot, b) in images.clone().enumerate() {
                    let src = &x[b * self.image_in() + (g * self.c_in_g() + c) * plane..][..plane];
                    let dst = &mut row[slot * pw..][..pw];
                    match &taps {
                        Some(taps) => {
                            for (d, &at) in dst.iter_mut().zip(&taps[k * pw..][..pw]) {
                                *d = if at == PADDING {
                                    zero
                                } else {
                                    src[at as usize]
                                };
                            }
                        }
                        None => self.im2col_row(src, (i, j), zero, dst),
                    }
                }
            }
        });
        col
    }

    /// One im2col row of one image: kernel tap `(i, j)` over every output pixel.
    pub(super) fn im2col_row<T: Copy>(
        &self,
        src: &[T],
        (i, j): (usize, usize),
        zero: T,
        dst: &mut [T],
    ) {
        let (ow, stride) = (self.out_w, self.p.stride);
        let (cols, first) = self.inside_columns(j);
        for oy in 0..self.out_h {
            let out = &mut dst[oy * ow..][..ow];
            let Some(iy) = self.source(oy, i) else {
                out.fill(zero);
                continue;
            };
            let line = &src[iy * self.w..][..self.w];
            out[..cols.start].fill(zero);
            out[cols.end..].fill(zero);
            let inside = &mut out[cols.clone()];
            if stride == 1 {
                inside.copy_from_slice(&line[first..][..inside.len()]);
            } else {
                for (k, d) in inside.iter_mut().enumerate() {
                    *d = line[first + k * stride];
                }
            }
        }
    }

    /// Adds the im2col-shaped gradient `col` (`(col_rows, n)`, image `slot`'s columns at
    /// `slot * pixels`) of group `g` into `image`'s f32 gradient.
    /// `taps`: [`Self::taps`], scattered through when given.
    pub(super) fn col2im(
        &self,
        col: &[f32],
        n: usize,
        slot: usize,
        g: usize,
        image: &mut [f32],
        taps: Option<&[u32]>,
    ) {
        let (pw, ow, stride) = (self.pixels(), self.out_w, self.p.stride);
        let plane = self.h * self.w;
        for c in 0..self.c_in_g() {
            let dst = &mut image[(g * self.c_in_g() + c) * plane..][..plane];
            for i in 0..self.kh {
                for j in 0..self.kw {
                    let row = &col[((c * self.kh + i) * self.kw + j) * n + slot * pw..][..pw];
                    if let Some(taps) = taps {
                        let taps = &taps[(i * self.kw + j) * pw..][..pw];
                        for (&at, &v) in taps.iter().zip(row) {
                            if at != PADDING {
                                dst[at as usize] += v;
                            }
                        }
                        continue;
                    }
                    let (cols, first) = self.inside_columns(j);
                    for oy in 0..self.out_h {
                        let Some(iy) = self.source(oy, i) else {
                            continue;
                        };
                        let line = &mut dst[iy * self.w..][..self.w];
                        let inside = &row[oy * ow..][cols.clone()];
                        if stride == 1 {
                            for (d, &v) in line[first..][..inside.len()].iter_mut().zip(inside) {
                                *d += v;
                            }
                        } else {
                            for (k, &v) in inside.iter().enumerate() {
                                line[first + k * stride] += v;
                            }
                        }
                    }
                }
            }
        }
    }

    /// The output columns whose kernel column `j` reads inside the image (`ox * stride + j *
    /// dilation - padding` in `0..w`), and the image column the first of them reads (0 when
    /// there are none).
    pub(super) fn inside_columns(&self, j: usize) -> (Range<usize>, usize) {
        let (stride, pad) = (self.p.stride, self.p.padding);
        let shift = j * self.p.dilation;
        let lo = pad.saturating_sub(shift).div_ceil(stride);
        let hi = (self.w + pad)
            .saturating_sub(shift)
            .div_ceil(stride)
            .min(self.out_w);
        let lo = lo.min(hi);
        let first = if lo < hi {
            lo * stride + shift - pad
        } else {
            0
        };
        (lo..hi, first)
    }

    /// The input row that kernel row `i` reads for output row `oy`, if inside the image.
    #[inline]
    pub(super) fn source(&self, oy: usize, i: usize) -> Option<usize> {
        (oy * self.p.stride + i * self.p.dilation)
            .checked_sub(self.p.padding)
            .filter(|&y| y < self.h)
    }

    /// For images whose output rows are short (under [`GATHER_BELOW`] pixels), the plane offset
    /// each kernel tap `(i, j)` reads for each output pixel, tap by tap (`(i * kw + j) *
    /// pixels + p`), [`PADDING`] where it reads the padding: im2col and col2im then gather and
    /// scatter through it, where copying each output row's in-image run would spend more on
    /// range arithmetic and copy calls than on the few elements (a ResNet's late stages on small
    /// images: 1-4 pixels a row). `None` for longer rows: there copying the runs is faster.
    pub(super) fn taps(&self) -> Option<Vec<u32>> {
        if self.out_w >= GATHER_BELOW || self.h * self.w >= PADDING as usize {
            return None;
        }
        let mut taps = Vec::with_capacity(self.kh * self.kw * self.pixels());
        for i in 0..self.kh {
            for j in 0..self.kw {
                let (cols, first) = self.inside_columns(j);
                for oy in 0..self.out_h {
                    let iy = self.source(oy, i);
                    taps.extend((0..self.out_w).map(|ox| match iy {
                        #[allow(clippy::cast_possible_truncation)] // below PADDING, checked
                        Some(iy) if cols.contains(&ox) => {
                            (iy * self.w + first + (ox - cols.start) * self.p.stride) as u32
                        }
                        _ => PADDING,
                    }));
                }
            }
        }
        Some(taps)
    }

    /// Group `g`'s rows of `images` of an output-shaped tensor (`grad_y`), side by side:
    /// `(c_out_g, n)`.
    pub(super) fn gather_out<T: Copy>(&self, y: &[T], g: usize, images: Range<usize>) -> Vec<T> {
        let (pw, cog) = (self.pixels(), self.c_out_g());
        let mut out = Vec::with_capacity(cog * images.len() * pw);
        for co in 0..cog {
            for b in images.clone() {
                out.extend_from_slice(&y[b * self.image_out() + (g * cog + co) * pw..][..pw]);
            }
        }
        out
    }

    /// [`Self::gather_out`] as a view: for one image, its own rows (nothing copied).
    pub(super) fn out_view<'a, T: Copy>(
        &self,
        y: &'a [T],
        g: usize,
        images: Range<usize>,
        buf: &'a mut Vec<T>,
    ) -> MatRef<'a, T> {
        let n = images.len() * self.pixels();
        if images.len() == 1 {
            let offset = images.start * self.image_out() + g * self.c_out_g() * n;
            return MatRef::row_major(y, offset, n);
        }
        *buf = self.gather_out(y, g, images);
        MatRef::row_major(&buf[..], 0, n)
    }

    /// Group `g`'s weight `(c_out_g, col_rows)`, a view of the contiguous kernel.
    pub(super) fn weight<'a, T>(&self, w: &'a [T], g: usize) -> MatRef<'a, T> {
        let rows = self.col_rows();
        MatRef::row_major(w, g * self.c_out_g() * rows, rows)
    }

    /// The im2col matrix of group `g` for `images` as a view: the image itself for a 1x1,
    /// stride-1, unpadded conv of one image (nothing copied), else [`Self::columns`] in `buf`.
    pub(super) fn column_view<'a, T: Copy + Send + Sync>(
        &self,
        x: &'a [T],
        g: usize,
        images: Range<usize>,
        buf: &'a mut Vec<T>,
        zero: T,
    ) -> MatRef<'a, T> {
        let n = images.len() * self.pixels();
        if self.pointwise() && images.len() == 1 {
            let offset = images.start * self.image_in() + g * self.col_rows() * n;
            return MatRef::row_major(x, offset, n);
        }
        *buf = self.columns(x, g, images, zero);
        MatRef::row_major(&buf[..], 0, n)
    }

    /// `y = conv(x, w) + bias`, `(batch, c_out, out_h, out_w)` in `T`.
    pub(super) fn forward<T: GemmElem>(&self, x: &[T], w: &[T], bias: Option<&[T]>) -> Vec<T> {
        self.forward_as(x, w, bias)
    }

    /// [`Self::forward`] with the f32 sums stored in `O` (`f32`: not rounded at all).
    ///
    /// `y` is built in order, never zero-filled first: a chunk of one image is its groups'
    /// output rows one after the other, which the GEMM writes (onto the bias, where there is
    /// one); a chunk of several images goes through a buffer and is scattered.
    pub(super) fn forward_as<T: GemmElem, O: Real + Send + Sync>(
        &self,
        x: &[T],
        w: &[T],
        bias: Option<&[T]>,
    ) -> Vec<O> {
        let zero = T::put(0.0);
        let (rows, pw, cog) = (self.col_rows(), self.pixels(), self.c_out_g());
        let mut y: Vec<O> = Vec::with_capacity(self.batch * self.image_out());
        for start in (0..self.batch).step_by(self.chunk()) {
            let images = start..(start + self.chunk()).min(self.batch);
            let n = images.len() * pw;
            let single = images.len() == 1;
            let chunk_start = y.len();
            if !single {
                y.resize(chunk_start + images.len() * self.image_out(), O::put(0.0));
            }
            for g in 0..self.p.groups {
                let mut buf = Vec::new();
                let cm = self.column_view(x, g, images.clone(), &mut buf, zero);
                let wg = self.weight(w, g);
                let bias = bias.map(|b| &b[g * cog..][..cog]);
                if single {
                    // This group's output rows of the image, next in `y`.
                    let rows_start = y.len();
                    if let Some(bias) = bias {
                        // Each row starts at its channel's bias, the product accumulated onto
                        // it in f32: one rounding.
                        y.extend(
                            bias.iter()
                                .flat_map(|b| std::iter::repeat_n(O::put(b.get()), n)),
                        );
                        gemm(cog, n, rows, wg, cm, &mut y[rows_start..], true, true);
                    } else {
                        gemm_append(&mut y, (cog, n, rows), wg, cm, true);
                    }
                    continue;
                }
                let mut scratch = vec![O::put(0.0); cog * n];
                if let Some(bias) = bias {
                    for (row, &b) in scratch.chunks_mut(n.max(1)).zip(bias) {
                        row.fill(O::put(b.get()));
                    }
                }
                gemm(cog, n, rows, wg, cm, &mut scratch, bias.is_some(), true);
                for (co, row) in scratch.chunks(n.max(1)).enumerate() {
                    for slot in 0..images.len() {
                        y[chunk_start + slot * self.image_out() + (g * cog + co) * pw..][..pw]
                            .copy_from_slice(&row[slot * pw..][..pw]);
                    }
                }
            }
        }
        y
    }

    /// The input gradient `w^T * grad_y` through col2im, in `T`. For a 1x1, stride-1 conv of
    /// one image per chunk, the product is the gradient: the GEMM writes it straight into the
    /// output (rounded once), not zero-filled first.
    pub(super) fn grad_input<T: GemmElem>(&self, w: &[T], gy: &[T]) -> Vec<T> {
        let (rows, pw, cog) = (self.col_rows(), self.pixels(), self.c_out_g());
        let mut gx: Vec<T> = Vec::with_capacity(self.batch * self.image_in());
        let taps = self.taps();
        for start in (0..self.batch).step_by(self.chunk()) {
            let images = start..(start + self.chunk()).min(self.batch);
            let n = images.len() * pw;
            let direct = self.pointwise() && images.len() == 1;
            let mut sums = if direct {
                Vec::new()
            } else {
                vec![0f32; images.len() * self.image_in()]
            };
            for g in 0..self.p.groups {
                let mut grad_buf = Vec::new();
                let gm = self.out_view(gy, g, images.clone(), &mut grad_buf);
                // w_g^T: (rows, c_out_g), a transposed view of the (c_out_g, rows) block.
                let wt = MatRef {
                    rs: 1,
                    cs: rows,
                    ..self.weight(w, g)
                };
                if direct {
                    // This group's rows of the image's gradient, next in `gx`.
                    gemm_append(&mut gx, (rows, n, cog), wt, gm, true);
                    continue;
                }
                let mut col = vec![0f32; rows * n];
                gemm(rows, n, cog, wt, gm, &mut col, false, true);
                parallel::for_each_chunk_mut(&mut sums, self.image_in(), |slot, image| {
                    self.col2im(&col, n, slot, g, image, taps.as_deref());
                });
            }
            if !direct {
                let chunk_start = gx.len();
                gx.resize(chunk_start + sums.len(), T::put(0.0));
                crate::kernels::convert::convert_into(&sums, &mut gx[chunk_start..]);
            }
        }
        gx
    }

    /// The weight gradient `sum over images of grad_y * col^T`, accumulated in f32 over the
    /// whole batch (rounded once by the caller, or kept for an f32 master).
    pub(super) fn grad_weight<T: GemmElem>(&self, x: &[T], gy: &[T]) -> Vec<f32> {
        let (rows, pw, cog) = (self.col_rows(), self.pixels(), self.c_out_g());
        let zero = T::put(0.0);
        let mut sums = vec![0f32; self.c_out * rows];
        for (chunk, start) in (0..self.batch).step_by(self.chunk()).enumerate() {
            let images = start..(start + self.chunk()).min(self.batch);
            let n = images.len() * pw;
            for g in 0..self.p.groups {
                let mut grad_buf = Vec::new();
                let gm = self.out_view(gy, g, images.clone(), &mut grad_buf);
                let mut buf = Vec::new();
                let cm = self.column_view(x, g, images.clone(), &mut buf, zero);
                // col^T: (n, rows).
                let ct = MatRef {
                    rs: cm.cs,
                    cs: cm.rs,
                    ..cm
                };
                let acc = &mut sums[g * cog * rows..][..cog * rows];
                gemm(cog, rows, n, gm, ct, acc, chunk > 0, true);
            }
        }
        sums
    }
}
