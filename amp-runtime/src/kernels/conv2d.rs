//! `conv2d` on CPU as GEMMs, in f32, bf16 and f16, forward and both gradients.
//!
//! candle's CPU conv2d fails on bf16 ("unsupported dtype BF16 for op matmul"), and its backward
//! computes the input gradient with a direct `conv_transpose2d` loop (a scalar dot product per
//! output, slow in every dtype and 20x the f32 time in f16). Here, per image and group, with
//! `K = c_in / groups * kh * kw` and `P = out_h * out_w`:
//!
//! - forward: `y (c_out, P) = w (c_out, K) * col (K, P)`, where `col` is the im2col matrix of
//!   the image; a 1x1, stride-1, unpadded conv needs no im2col: the image is `col`;
//! - input gradient: `grad_col (K, P) = w^T * grad_y`, scattered back by col2im (again nothing
//!   for a 1x1 conv);
//! - weight gradient: `grad_w (c_out, K) = sum over images of grad_y * col^T`, accumulated in
//!   f32 and rounded once.
//!
//! All three products run on [`super::gemm`] with f32 accumulation (bf16 on `vdpbf16ps` where
//! the CPU has it). The autograd graph keeps only the operands in their own dtype. Images run in
//! parallel when each image's product is small, otherwise one at a time with the GEMM parallel.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};
use std::ops::Range;

use super::gemm::{gemm, gemm_append, GemmElem, MatRef};
use super::leaf_grads::{offer, wanted};
use super::{parallel, Real};

/// Output rows shorter than this go through [`Geometry::taps`] in im2col and col2im.
const GATHER_BELOW: usize = 8;

/// A tap's entry in [`Geometry::taps`] where it reads the padding.
const PADDING: u32 = u32::MAX;

/// Convolution hyper-parameters, as candle's `conv2d` takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Conv2dParams {
    pub padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// `conv2d` with candle's semantics plus an optional per-channel `bias` `(c_out)` of the
/// kernel's dtype; on CPU as GEMMs with the bias added before the one rounding of each output
/// (see the module docs), elsewhere candle's conv (a matrix product for a pointwise conv) and
/// [`super::add_bias`] (the bias's gradient summed in f32). The kernel and bias may
/// be f32 masters of a half `x`: they are rounded to `x`'s dtype inside the op (the cast a
/// region inserts, bit for bit) and get f32 gradients, never rounded to half; no half copy of
/// the weight joins the autograd graph.
pub(crate) fn conv2d(
    x: &Tensor,
    k: &Tensor,
    bias: Option<&Tensor>,
    p: Conv2dParams,
) -> Result<Tensor> {
    let bias_fits =
        bias.is_none_or(|b| b.dims() == [k.dim(0).unwrap_or(0)] && b.dtype() == k.dtype());
    if handles(x, k, p) && bias_fits {
        let (x, k) = (x.contiguous()?, k.contiguous()?);
        match bias {
            Some(b) => x.apply_op3(&k, &b.contiguous()?, GemmConv2d(p)),
            None => x.apply_op2(&k, GemmConv2d(p)),
        }
    } else {
        let k = super::to_dtype(k, x.dtype())?;
        // The pointwise op runs on CPU and CUDA (its forward is the backend's matmul); it adds
        // an f32 bias of an f32, f16 or bf16 output itself.
        if pointwise(x, &k, p) && (x.device().is_cpu() || x.device().is_cuda()) {
            return match bias {
                Some(b) if !super::batch_norm::bias_supported(x, b) => {
                    super::add_bias(&pointwise_product(x, &k, None)?, b, 1)
                }
                _ => pointwise_product(x, &k, bias),
            };
        }
        let y = x.conv2d(&k, p.padding, p.stride, p.dilation, p.groups)?;
        match bias {
            Some(b) => super::add_bias(&y, b, 1),
            None => Ok(y),
        }
    }
}

/// `conv1d` as the 2-D convolution of height 1 ([`conv2d`]; the padding applied to the length
/// first, a copy), with the same master and bias handling. candle's own `conv1d` computes its
/// input gradient with its `conv_transpose1d`, which adds each kernel tap into an output in the
/// input's dtype: under bf16 a gradient summed over 300 taps of ones came to 256. On CPU the
/// GEMM kernel's input gradient (a GEMM, then col2im in f32) rounds once.
pub(crate) fn conv1d(
    x: &Tensor,
    k: &Tensor,
    bias: Option<&Tensor>,
    p: Conv2dParams,
) -> Result<Tensor> {
    let x = if p.padding > 0 {
        x.pad_with_zeros(2, p.padding, p.padding)?
    } else {
        x.clone()
    };
    let flat = Conv2dParams { padding: 0, ..p };
    conv2d(&x.unsqueeze(2)?, &k.unsqueeze(2)?, bias, flat)?.squeeze(2)
}

/// A transposed convolution (`f`, candle's) of half operands computed in f32 and rounded once:
/// candle's CPU kernel adds each tap into an output in the operands' dtype (bf16: 289 taps of
/// ones summed to 256), where autocast's lower-precision ops accumulate in f32. An f32 `x`
/// runs as it is.
pub(crate) fn widened_transpose(
    x: &Tensor,
    k: &Tensor,
    f: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if x.dtype() == DType::F32 && k.dtype() == DType::F32 {
        return f(x, k);
    }
    let y = f(
        &super::to_dtype(x, DType::F32)?,
        &super::to_dtype(k, DType::F32)?,
    )?;
    super::to_dtype(&y, x.dtype())
}

/// Whether the convolution is a matrix product per image: a 1x1 kernel at stride 1, no padding,
/// dilation or groups (a pointwise conv, the whole of `quantized_sine`'s net).
fn pointwise(x: &Tensor, k: &Tensor, p: Conv2dParams) -> bool {
    let simple = p
        == Conv2dParams {
            padding: 0,
            stride: 1,
            dilation: 1,
            groups: 1,
        };
    simple && x.rank() == 4 && matches!(k.dims(), &[_, c_in, 1, 1] if x.dim(1).ok() == Some(c_in))
}

/// A pointwise conv off the CPU (and an f32 master `bias`, when given) as one op whose forward
/// is one matrix product `(c_out, c_in) x (c_in, h*w)` per image on the device's BLAS (the
/// weight shared by every image: a zero batch stride), then the bias add of
/// [`super::batch_norm::bias_add`]. candle's conv there goes through im2col, and its input
/// gradient through a direct transposed convolution: on an H200, `quantized_sine --size 512
/// --hidden 256` took 165 ms a step in f32 against PyTorch's 5.9. As one node of the graph it
/// spares the reshapes around a product and the separate bias add, each a full-size node that
/// candle's backward fills with a zero tensor plus an add (half of that step's GPU time).
/// The backward takes the images as one matrix for the weight gradient (a copy when there are
/// several), so that its sum over the batch is the BLAS's f32-accumulated one: a batched
/// product's gradient would sum the per-image gradients in the input's (half) precision.
fn pointwise_product(x: &Tensor, k: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    super::matmul::fused::<Pointwise>(x, k, bias)
}

/// The product of [`pointwise_product`].
struct Pointwise;

impl super::matmul::Product for Pointwise {
    const NAME: &'static str = "amp-pointwise-conv";
    const NAME_WITH_BIAS: &'static str = "amp-pointwise-conv-bias";

    /// `k (c_out, c_in) x x[i] (c_in, h*w)` for every image `i`, on any backend's matmul.
    fn product<S: candle_core::backend::BackendStorage>(
        x: &S,
        lx: &Layout,
        k: &S,
        lk: &Layout,
    ) -> Result<(S, Shape)> {
        let (&[b, c_in, h, w], &[c_out, c_in_k, 1, 1]) = (lx.dims(), lk.dims()) else {
            candle_core::bail!("pointwise conv: {:?} by {:?}", lx.dims(), lk.dims())
        };
        let (Some((x0, _)), Some((k0, _))) = (lx.contiguous_offsets(), lk.contiguous_offsets())
        else {
            candle_core::bail!("pointwise conv: operands must be contiguous")
        };
        if c_in_k != c_in {
            candle_core::bail!("pointwise conv: {c_in} input channels, kernel for {c_in_k}")
        }
        let lhs =
            Layout::contiguous_with_offset((c_out, c_in), k0).broadcast_as((b, c_out, c_in))?;
        let rhs = Layout::contiguous_with_offset((b, c_in, h * w), x0);
        let y = k.matmul(x, (b, c_out, h * w, c_in), &lhs, &rhs)?;
        Ok((y, Shape::from((b, c_out, h, w))))
    }

    /// The input and weight gradients from the output gradient `dy`.
    fn grads(x: &Tensor, k: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (b, c_in, h, w) = x.dims4()?;
        let c_out = k.dim(0)?;
        let k2 = k.reshape((c_out, c_in))?;
        let dy3 = dy.reshape((b, c_out, h * w))?;
        let dx = wanted(x, || {
            let kt = k2.t()?.contiguous()?;
            let per_image = if b == 1 {
                kt.unsqueeze(0)?
            } else {
                kt.broadcast_left(b)?
            };
            per_image.matmul(&dy3)?.reshape((b, c_in, h, w))
        })?;
        let dk = offer(k, || {
            // The images side by side: one product sums the batch in f32.
            let columns = |t: &Tensor, c: usize| -> Result<Tensor> {
                if b == 1 {
                    t.reshape((c, h * w))
                } else {
                    t.reshape((b, c, h * w))?
                        .transpose(0, 1)?
                        .contiguous()?
                        .reshape((c, b * h * w))
                }
            };
            columns(dy, c_out)?
                .matmul(&columns(x, c_in)?.t()?)?
                .reshape((c_out, c_in, 1, 1))
        })?;
        Ok((dx, dk))
    }
}

/// Whether [`conv2d`] takes its own path: CPU, one float dtype, shapes candle accepts.
pub(crate) fn handles(x: &Tensor, k: &Tensor, p: Conv2dParams) -> bool {
    let (&[_, c_in, h, w], &[c_out, c_in_g, kh, kw]) = (x.dims(), k.dims()) else {
        return false;
    };
    let masters = k.dtype() == DType::F32 && matches!(x.dtype(), DType::F16 | DType::BF16);
    x.device().is_cpu()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && (x.dtype() == k.dtype() || masters)
        && p.groups > 0
        && p.stride > 0
        && p.dilation > 0
        && c_in == c_in_g * p.groups
        && c_out % p.groups == 0
        && h + 2 * p.padding > p.dilation * (kh - 1)
        && w + 2 * p.padding > p.dilation * (kw - 1)
}

/// The geometry of one convolution.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    batch: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kh: usize,
    kw: usize,
    out_h: usize,
    out_w: usize,
    p: Conv2dParams,
}

impl Geometry {
    fn new(x: &[usize], k: &[usize], p: Conv2dParams) -> Self {
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

    fn out_shape(&self) -> Shape {
        Shape::from((self.batch, self.c_out, self.out_h, self.out_w))
    }

    fn c_in_g(&self) -> usize {
        self.c_in / self.p.groups
    }
    fn c_out_g(&self) -> usize {
        self.c_out / self.p.groups
    }
    /// Rows of the im2col matrix of one group: `c_in_g * kh * kw`.
    fn col_rows(&self) -> usize {
        self.c_in_g() * self.kh * self.kw
    }
    /// Output pixels per image.
    fn pixels(&self) -> usize {
        self.out_h * self.out_w
    }
    fn image_in(&self) -> usize {
        self.c_in * self.h * self.w
    }
    fn image_out(&self) -> usize {
        self.c_out * self.pixels()
    }
    /// A 1x1, stride-1, unpadded conv: the image itself is the im2col matrix.
    fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.p.stride == 1 && self.p.padding == 0
    }
    /// Images per GEMM: enough that each product has at least `MIN_COLUMNS` columns (late
    /// ResNet stages have 1-16 pixels an image; one image per GEMM would repack the weight for
    /// a handful of columns), few enough that the chunk's im2col and gradient buffers stay small.
    fn chunk(&self) -> usize {
        const MIN_COLUMNS: usize = 512;
        MIN_COLUMNS
            .div_ceil(self.pixels().max(1))
            .clamp(1, self.batch.max(1))
    }

    /// The im2col matrix of group `g` for `images`: `(col_rows, n)` with `n = images * pixels`,
    /// image `b`'s columns at `(b - images.start) * pixels`. Rows are filled in parallel.
    fn columns<T: Copy + Send + Sync>(
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
    fn im2col_row<T: Copy>(&self, src: &[T], (i, j): (usize, usize), zero: T, dst: &mut [T]) {
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
    fn col2im(
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
    fn inside_columns(&self, j: usize) -> (Range<usize>, usize) {
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
    fn source(&self, oy: usize, i: usize) -> Option<usize> {
        (oy * self.p.stride + i * self.p.dilation)
            .checked_sub(self.p.padding)
            .filter(|&y| y < self.h)
    }

    /// For images whose output rows are short (under [`GATHER_BELOW`] pixels), the plane offset
    /// each kernel tap `(i, j)` reads for each output pixel, tap by tap (`(i * kw + j) *
    /// pixels + p`), [`PADDING`] where it reads the padding: im2col and col2im then gather and
    /// scatter through it, where copying each output row's in-image run would spend more on
    /// range arithmetic and copy calls than on the few elements (a ResNet's late stages on small
    /// images: 1-4 pixels a row). `None` for longer rows: there the runs are faster (gathering
    /// rows of 8, 16 or 32 measured slower).
    fn taps(&self) -> Option<Vec<u32>> {
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
    fn gather_out<T: Copy>(&self, y: &[T], g: usize, images: Range<usize>) -> Vec<T> {
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
    fn out_view<'a, T: Copy>(
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
    fn weight<'a, T>(&self, w: &'a [T], g: usize) -> MatRef<'a, T> {
        let rows = self.col_rows();
        MatRef::row_major(w, g * self.c_out_g() * rows, rows)
    }

    /// The im2col matrix of group `g` for `images` as a view: the image itself for a 1x1,
    /// stride-1, unpadded conv of one image (nothing copied), else [`Self::columns`] in `buf`.
    fn column_view<'a, T: Copy + Send + Sync>(
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
    fn forward<T: GemmElem>(&self, x: &[T], w: &[T], bias: Option<&[T]>) -> Vec<T> {
        self.forward_as(x, w, bias)
    }

    /// [`Self::forward`] with the f32 sums stored in `O` (`f32`: not rounded at all).
    ///
    /// `y` is built in order, never zero-filled first: a chunk of one image is its groups'
    /// output rows one after the other, which the GEMM writes (onto the bias, where there is
    /// one); a chunk of several images goes through a buffer and is scattered.
    fn forward_as<T: GemmElem, O: Real + Send + Sync>(
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
    fn grad_input<T: GemmElem>(&self, w: &[T], gy: &[T]) -> Vec<T> {
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
                super::convert::convert_into(&sums, &mut gx[chunk_start..]);
            }
        }
        gx
    }

    /// The weight gradient `sum over images of grad_y * col^T`, accumulated in f32 over the
    /// whole batch (rounded once by the caller, or kept for an f32 master).
    fn grad_weight<T: GemmElem>(&self, x: &[T], gy: &[T]) -> Vec<f32> {
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

/// The conv op with its backward (see the module docs).
struct GemmConv2d(Conv2dParams);

/// `s` (contiguous, `layout`) in the dtype of `like`, with its layout: itself, or an f32
/// master rounded to the half dtype of `like` (contiguous from 0).
fn in_dtype_of<'a>(
    s: &'a CpuStorage,
    layout: &Layout,
    like: &CpuStorage,
) -> Result<(std::borrow::Cow<'a, CpuStorage>, Layout)> {
    use super::convert::convert_slice;
    use std::borrow::Cow;
    let fresh = || Layout::contiguous(layout.shape());
    Ok(match (s, like) {
        (CpuStorage::F32(w), CpuStorage::BF16(_)) => (
            Cow::Owned(CpuStorage::BF16(convert_slice(super::contiguous(
                w, layout, "conv2d",
            )?))),
            fresh(),
        ),
        (CpuStorage::F32(w), CpuStorage::F16(_)) => (
            Cow::Owned(CpuStorage::F16(convert_slice(super::contiguous(
                w, layout, "conv2d",
            )?))),
            fresh(),
        ),
        _ => (Cow::Borrowed(s), layout.clone()),
    })
}

/// Sums `f32` stored in `dtype` (an f32 master's gradient stays f32).
fn stored(sums: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(sums.into_iter().map(half::bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(sums.into_iter().map(half::f16::from_f32).collect()),
        _ => CpuStorage::F32(sums),
    }
}

/// The conv's forward on storages of one float dtype (the kernel and bias already in `x`'s).
fn forward_storage(
    geo: &Geometry,
    (x, lx): (&CpuStorage, &Layout),
    (w, lw): (&CpuStorage, &Layout),
    bias: Option<(&CpuStorage, &Layout)>,
) -> Result<CpuStorage> {
    Ok(with_floats!("conv2d", x, lx, w, lw, |x, w| {
        let b = match bias {
            Some((s, l)) => Some(super::contiguous(s.as_slice()?, l, "conv2d")?),
            None => None,
        };
        WithDType::to_cpu_storage_owned(geo.forward(x, w, b))
    }))
}

/// The convolution of `x` by `k` (an f32 master of a half `x` rounded to `x`'s dtype, as the
/// op does), without a bias, left in f32: the GEMM's sums before the rounding that [`conv2d`]
/// gives them, for an op that normalises them first (`batch_norm::after_conv`, which folds the
/// conv's bias into its centre).
pub(crate) fn f32_sums(
    (x, lx): (&CpuStorage, &Layout),
    (k, lk): (&CpuStorage, &Layout),
    p: Conv2dParams,
) -> Result<(Vec<f32>, Shape)> {
    let geo = Geometry::new(lx.dims(), lk.dims(), p);
    let (k, lk) = in_dtype_of(k, lk, x)?;
    let sums = with_floats!("conv2d", x, lx, k.as_ref(), &lk, |x, w| {
        geo.forward_as::<_, f32>(x, w, None)
    });
    Ok((sums, geo.out_shape()))
}

/// The input and kernel gradients of the convolution of `x` by `k` for the output gradient
/// `grad` (in `x`'s dtype), as the op's backward computes them (each only if wanted; a
/// variable kernel's offered to the scaler's collector).
pub(crate) fn input_and_kernel_grads(
    x: &Tensor,
    k: &Tensor,
    p: Conv2dParams,
    grad: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let geo = Geometry::new(x.dims(), k.dims(), p);
    let grad = grad.contiguous()?;
    let grad_x = wanted(x, || {
        // An f32 master kernel: the input gradient uses it rounded as the forward did.
        let k_used = if k.dtype() == x.dtype() {
            k.clone()
        } else {
            k.apply_op1_no_bwd(&super::convert::Convert(x.dtype()))?
        };
        k_used.apply_op2_no_bwd(&grad, &GradInput(geo))
    })?;
    let grad_k = offer(k, || x.apply_op2_no_bwd(&grad, &GradWeight(geo, k.dtype())))?;
    Ok((grad_x, grad_k))
}

impl CustomOp2 for GemmConv2d {
    fn name(&self) -> &'static str {
        "amp-gemm-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = Geometry::new(l1.dims(), l2.dims(), self.0);
        let (w, l2) = in_dtype_of(s2, l2, s1)?;
        let y = forward_storage(&geo, (s1, l1), (&w, &l2), None)?;
        Ok((y, geo.out_shape()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        input_and_kernel_grads(x, k, self.0, grad)
    }
}

impl CustomOp3 for GemmConv2d {
    fn name(&self) -> &'static str {
        "amp-gemm-conv2d-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = Geometry::new(l1.dims(), l2.dims(), self.0);
        let ((w, l2), (b, l3)) = (in_dtype_of(s2, l2, s1)?, in_dtype_of(s3, l3, s1)?);
        let y = forward_storage(&geo, (s1, l1), (&w, &l2), Some((&b, &l3)))?;
        Ok((y, geo.out_shape()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (grad_x, grad_k) = CustomOp2::bwd(self, x, k, res, grad)?;
        let grad_b = offer(bias, || {
            grad.contiguous()?.apply_op1_no_bwd(&GradBias(k.dtype()))
        })?;
        Ok((grad_x, grad_k, grad_b))
    }
}

/// `grad_y (batch, c_out, h, w) -> grad_bias (c_out)`: per-channel sums in f32, stored in the
/// bias's dtype (rounded once, or f32 for an f32 master).
struct GradBias(DType);

impl CustomOp1 for GradBias {
    fn name(&self) -> &'static str {
        "amp-conv2d-grad-bias"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        fn sums<T: Real + Send + Sync>(g: &[T], batch: usize, channels: usize) -> Vec<f32> {
            let plane = g.len() / (batch * channels).max(1);
            parallel::map_indices(channels, |c| {
                (0..batch)
                    .map(|b| {
                        g[(b * channels + c) * plane..][..plane]
                            .iter()
                            .map(|v| v.get())
                            .sum::<f32>()
                    })
                    .sum()
            })
        }
        let (batch, channels) = (l.dims()[0], l.dims()[1]);
        let sums = with_floats!("conv2d bias gradient", s, l, |g| sums(g, batch, channels));
        Ok((stored(sums, self.0), Shape::from(channels)))
    }
}

/// `(kernel, grad_y) -> grad_x`.
struct GradInput(Geometry);

impl CustomOp2 for GradInput {
    fn name(&self) -> &'static str {
        "amp-gemm-conv2d-grad-input"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = self.0;
        let gx = with_floats!("conv2d input gradient", s1, l1, s2, l2, |w, g| {
            WithDType::to_cpu_storage_owned(geo.grad_input(w, g))
        });
        Ok((gx, Shape::from((geo.batch, geo.c_in, geo.h, geo.w))))
    }
}

/// `(x, grad_y) -> grad_kernel`, stored in the kernel's dtype (f32 for an f32 master).
struct GradWeight(Geometry, DType);

impl CustomOp2 for GradWeight {
    fn name(&self) -> &'static str {
        "amp-gemm-conv2d-grad-weight"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geo = self.0;
        let sums = with_floats!("conv2d weight gradient", s1, l1, s2, l2, |x, g| {
            geo.grad_weight(x, g)
        });
        let shape = Shape::from((geo.c_out, geo.c_in_g(), geo.kh, geo.kw));
        Ok((stored(sums, self.1), shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    use crate::kernels::max_abs_diff;

    /// Forward and both gradients of every dtype against candle's f32 conv2d on the same
    /// (half-representable) values, for 1x1, strided, padded, dilated and grouped shapes.
    #[test]
    fn gemm_conv2d_matches_candles_f32_conv2d() -> Result<()> {
        // bf16 rounds to 2^-8 relative, f16 to 2^-11; f32 differs only in summation order.
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
            conv_cases(dtype, tol)?;
        }
        Ok(())
    }

    fn conv_cases(dtype: DType, tol: f32) -> Result<()> {
        let pointwise = Conv2dParams {
            padding: 0,
            stride: 1,
            dilation: 1,
            groups: 1,
        };
        for (p, (c_in, c_out), ks) in [
            (pointwise, (5, 7), 1),
            (
                Conv2dParams {
                    stride: 2,
                    ..pointwise
                },
                (3, 4),
                1,
            ),
            // ResNet's stem: 7x7, stride 2, padding 3.
            (
                Conv2dParams {
                    padding: 3,
                    stride: 2,
                    ..pointwise
                },
                (2, 3),
                7,
            ),
        ] {
            conv_case(dtype, tol, p, c_in, c_out, ks)?;
        }
        for (p, (c_in, c_out)) in [
            (
                Conv2dParams {
                    padding: 1,
                    stride: 1,
                    dilation: 1,
                    groups: 1,
                },
                (3, 4),
            ),
            (
                Conv2dParams {
                    padding: 0,
                    stride: 2,
                    dilation: 1,
                    groups: 1,
                },
                (3, 5),
            ),
            (
                Conv2dParams {
                    padding: 1,
                    stride: 2,
                    dilation: 1,
                    groups: 1,
                },
                (3, 4),
            ),
            (
                Conv2dParams {
                    padding: 2,
                    stride: 1,
                    dilation: 2,
                    groups: 1,
                },
                (2, 3),
            ),
            (
                Conv2dParams {
                    padding: 1,
                    stride: 1,
                    dilation: 1,
                    groups: 2,
                },
                (4, 6),
            ),
        ] {
            conv_case(dtype, tol, p, c_in, c_out, 3)?;
        }
        // 40 images of 4x4 (16 pixels): several images per GEMM, in two chunks.
        let padded = Conv2dParams {
            padding: 1,
            ..pointwise
        };
        conv_case_sized(dtype, tol, padded, (3, 5, 3), (40, 4))?;
        // A 1x1 image under a dilated 3x3 kernel padded by 2: kernel columns whose every output
        // reads padding only (their run of inside columns is empty).
        let dilated = Conv2dParams {
            padding: 2,
            dilation: 2,
            ..pointwise
        };
        conv_case_sized(dtype, tol, dilated, (1, 1, 3), (1, 1))?;
        Ok(())
    }

    /// One shape, without and with a bias (the bias gradient checked too).
    fn conv_case(
        dtype: DType,
        tol: f32,
        p: Conv2dParams,
        c_in: usize,
        c_out: usize,
        ks: usize,
    ) -> Result<()> {
        conv_case_sized(dtype, tol, p, (c_in, c_out, ks), (3, 9))
    }

    /// `batch` images of `side x side`.
    fn conv_case_sized(
        dtype: DType,
        tol: f32,
        p: Conv2dParams,
        (c_in, c_out, ks): (usize, usize, usize),
        (batch, side): (usize, usize),
    ) -> Result<()> {
        let dev = Device::Cpu;
        let var = |t: &Tensor| candle_core::Var::from_tensor(t);
        let x = Tensor::randn(0f32, 1., (batch, c_in, side, side), &dev)?.to_dtype(dtype)?;
        let k = Tensor::randn(0f32, 1., (c_out, c_in / p.groups, ks, ks), &dev)?.to_dtype(dtype)?;
        let b = Tensor::randn(0f32, 1., c_out, &dev)?.to_dtype(dtype)?;
        let scale =
            |t: &Tensor| -> Result<f32> { t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
        for with_bias in [false, true] {
            let (xv, kv, bv) = (var(&x)?, var(&k)?, var(&b)?);
            let y = conv2d(&xv, &kv, with_bias.then_some(bv.as_tensor()), p)?;
            assert_eq!(y.dtype(), dtype);
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

            let up = |t: &Tensor| var(&t.to_dtype(DType::F32)?);
            let (x32, k32, b32) = (up(&x)?, up(&k)?, up(&b)?);
            let mut y32 = x32.conv2d(&k32, p.padding, p.stride, p.dilation, p.groups)?;
            if with_bias {
                y32 = y32.broadcast_add(&b32.reshape((1, (), 1, 1))?)?;
            }
            // The f32 reference squares its own f32 output; the half path squares its rounded
            // output, so gradients agree to the rounding of y.
            let grads32 = y32.sqr()?.sum_all()?.backward()?;
            let what = format!("{dtype:?} {p:?} bias={with_bias}");
            assert!(
                max_abs_diff(&y, &y32)? <= tol * scale(&y32)?,
                "{what} forward"
            );
            let mut pairs = vec![("x", &xv, &x32), ("k", &kv, &k32)];
            if with_bias {
                pairs.push(("bias", &bv, &b32));
            }
            for (name, v, v32) in pairs {
                let (g, g32) = (grads.get(v).unwrap(), grads32.get(v32).unwrap());
                assert_eq!(g.dtype(), dtype, "{what} grad {name}");
                assert!(
                    max_abs_diff(g, g32)? <= tol * scale(g32)?,
                    "{what} grad {name}"
                );
            }
        }
        Ok(())
    }

    /// A half input with f32 master kernel and bias: the forward equals the conv of the masters
    /// rounded to half, the input gradient is half, the masters' gradients are f32 and match the
    /// f32 reference on the rounded values.
    #[test]
    #[allow(clippy::float_cmp)] // the same rounded operands, the same kernel: bit for bit
    fn f32_masters_round_inside_and_get_f32_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let p = Conv2dParams {
            padding: 1,
            stride: 2,
            dilation: 1,
            groups: 1,
        };
        for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
            let x = candle_core::Var::from_tensor(
                &Tensor::randn(0f32, 1., (3, 4, 7, 7), &dev)?.to_dtype(dtype)?,
            )?;
            let k = candle_core::Var::randn(0f32, 1., (5, 4, 3, 3), &dev)?;
            let b = candle_core::Var::randn(0f32, 1., 5, &dev)?;
            let y = conv2d(&x, &k, Some(&b), p)?;
            assert_eq!(y.dtype(), dtype);
            let rounded = conv2d(&x, &k.to_dtype(dtype)?, Some(&b.to_dtype(dtype)?), p)?;
            assert_eq!(
                max_abs_diff(&y, &rounded)?,
                0.0,
                "{dtype:?}: the cast a region inserts"
            );
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
            let up = |t: &Tensor| {
                candle_core::Var::from_tensor(&t.to_dtype(dtype)?.to_dtype(DType::F32)?)
            };
            let (x32, k32, b32) = (up(&x)?, up(&k)?, up(&b)?);
            let y32 = x32
                .conv2d(&k32, p.padding, p.stride, p.dilation, p.groups)?
                .broadcast_add(&b32.reshape((1, (), 1, 1))?)?;
            let grads32 = y32.sqr()?.sum_all()?.backward()?;
            let scale =
                |t: &Tensor| -> Result<f32> { t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
            assert_eq!(grads.get(&x).unwrap().dtype(), dtype);
            for (v, v32, name) in [(&k, &k32, "kernel"), (&b, &b32, "bias")] {
                let (g, g32) = (grads.get(v).unwrap(), grads32.get(v32).unwrap());
                assert_eq!(g.dtype(), DType::F32, "{name}: an f32 master's gradient");
                assert!(
                    max_abs_diff(g, g32)? <= tol * scale(g32)?,
                    "{dtype:?} {name}"
                );
            }
        }
        Ok(())
    }

    /// The pointwise op (the off-CPU path of a 1x1 conv) against candle's conv2d and a
    /// broadcast bias add, values and every gradient, in f32 on CPU where both run.
    #[test]
    fn a_pointwise_product_is_the_1x1_convolution() -> Result<()> {
        let dev = Device::Cpu;
        let p = Conv2dParams {
            padding: 0,
            stride: 1,
            dilation: 1,
            groups: 1,
        };
        let worst = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
        };
        for batch in [1, 3] {
            let x = Var::randn(0f32, 1.0, (batch, 5, 4, 6), &dev)?;
            let k = Var::randn(0f32, 1.0, (7, 5, 1, 1), &dev)?;
            assert!(pointwise(&x, &k, p));
            assert!(!pointwise(&x, &k, Conv2dParams { stride: 2, ..p }));
            let bias = Var::randn(0f32, 1.0, 7, &dev)?;
            let ours = pointwise_product(&x, &k, Some(&bias))?;
            let theirs = x
                .conv2d(&k, 0, 1, 1, 1)?
                .broadcast_add(&bias.reshape((1, 7, 1, 1))?)?;
            let w = Tensor::randn(0f32, 1.0, theirs.shape(), &dev)?;
            let grads = |y: &Tensor| (y * &w)?.sum_all()?.backward();
            let (g_ours, g_theirs) = (grads(&ours)?, grads(&theirs)?);
            assert!(worst(&ours, &theirs)? < 1e-5, "batch {batch}");
            let no_bias = pointwise_product(&x, &k, None)?;
            assert!(
                worst(&no_bias, &x.conv2d(&k, 0, 1, 1, 1)?)? < 1e-5,
                "batch {batch}"
            );
            for v in [&x, &k, &bias] {
                let (a, b) = (g_ours.get(v).unwrap(), g_theirs.get(v).unwrap());
                assert_eq!(a.dims(), v.dims());
                assert!(worst(a, b)? < 1e-4, "batch {batch}");
            }
        }
        Ok(())
    }

    /// The weight gradient of a pointwise conv sums over the batch in f32, rounded once: 300
    /// images of ones give exactly 300 in bf16, where a sum in bf16 sticks at 256 (256 + 1
    /// rounds back to 256).
    #[test]
    fn a_pointwise_weight_gradient_sums_the_batch_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::ones((300, 1, 1, 1), DType::BF16, &dev)?;
        let k = Var::ones((1, 1, 1, 1), DType::BF16, &dev)?;
        let grads = pointwise_product(&x, &k, None)?.sum_all()?.backward()?;
        let g = grads.get(&k).expect("a gradient").to_dtype(DType::F32)?;
        assert_eq!(g.flatten_all()?.to_vec1::<f32>()?, [300.0]);
        // So does the f32 bias's, with the bias in the op.
        let bias = Var::zeros(1, DType::F32, &dev)?;
        let y = pointwise_product(&x, &k, Some(&bias))?;
        assert_eq!(y.dtype(), DType::BF16);
        let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(&bias).expect("a gradient");
        assert_eq!(g.to_vec1::<f32>()?, [300.0]);
        Ok(())
    }
}
