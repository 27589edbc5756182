//! `conv2d` as one op with its own backward, in f32, bf16 and f16: on CPU as GEMMs, on CUDA on
//! cuDNN (feature `cudnn`).
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
//! All three products run on [`crate::kernels::gemm`] with f32 accumulation (bf16 on `vdpbf16ps` where
//! the CPU has it). The autograd graph keeps only the operands in their own dtype. Images run in
//! parallel when each image's product is small, otherwise one at a time with the GEMM parallel.
//!
//! On CUDA with the `cudnn` feature the same op's forward and gradients are cuDNN's
//! (`kernels::cuda::conv`): one graph node per convolution, the f32 master kernel rounded to
//! the input's dtype inside it, the kernel gradient handed back in f32 (cuDNN computes it in
//! the input's dtype with f32 accumulation, then it is widened: PyTorch's result). f32
//! convolutions get TF32 as PyTorch's do (`torch.backends.cudnn.allow_tf32`). A pointwise
//! convolution in f16 or bf16 (and any pointwise one without `cudnn`) is a cuBLAS product per
//! image instead ([`pointwise_product`]): it reads the NCHW batch in place, where cuDNN's half
//! kernels transpose each operand to NHWC and back; its kernel gradient copies both operands
//! into one matrix each (so that one product sums the batch in f32).

mod geometry;
mod ops;
mod pointwise;
#[cfg(test)]
mod tests;

pub(crate) use ops::{f32_sums, input_and_kernel_grads};

use candle_core::{DType, Result, Tensor};

use ops::Conv2dOp;
#[cfg(feature = "cudnn")]
use ops::ConvTranspose2dOp;
use pointwise::pointwise_product;

/// Convolution hyper-parameters, as candle's `conv2d` takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Conv2dParams {
    pub padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
}

impl Conv2dParams {
    /// Rejects a stride, dilation or group count of 0, which candle divides by (a panic) or
    /// multiplies every tap's offset by (each output its own pixel times the kernel's sum).
    pub(crate) fn check(self, op: &str) -> Result<()> {
        for (name, value) in [
            ("stride", self.stride),
            ("dilation", self.dilation),
            ("groups", self.groups),
        ] {
            if value == 0 {
                candle_core::bail!("{op}: {name} must be positive, got 0")
            }
        }
        Ok(())
    }
}

/// Checks a convolution's operands against its parameters before candle sees them: `x` is
/// `(batch, c_in, spatial...)` and `k` `(c_out, c_in / groups, kernel...)` with one kernel size
/// per spatial dimension, none of them 0, the channels divisible by the groups, and the
/// dilated kernel no larger than the padded input (candle answers a larger kernel with sizes
/// that wrapped around, `usize::MAX`, and an empty kernel with zeros).
pub(crate) fn check_geometry(op: &str, x: &[usize], k: &[usize], p: Conv2dParams) -> Result<()> {
    p.check(op)?;
    let spatial = x.len().saturating_sub(2);
    if spatial == 0 || k.len() != x.len() {
        candle_core::bail!(
            "{op}: the input is (batch, channels, {spatial_names}) and the kernel (out channels, \
             in channels / groups, {spatial_names}), got {x:?} and {k:?}",
            spatial_names = if k.len() == 3 {
                "length"
            } else {
                "height, width"
            }
        )
    }
    let (c_in, c_out, c_in_g) = (x[1], k[0], k[1]);
    if c_in_g.checked_mul(p.groups) != Some(c_in) {
        candle_core::bail!(
            "{op}: the input has {c_in} channels, the kernel {c_in_g} per group x {} groups",
            p.groups
        )
    }
    if !c_out.is_multiple_of(p.groups) {
        candle_core::bail!(
            "{op}: {c_out} output channels do not split into {} groups",
            p.groups
        )
    }
    let mut out = vec![x[0], c_out];
    for (&size, &taps) in x[2..].iter().zip(&k[2..]) {
        if taps == 0 {
            candle_core::bail!("{op}: the kernel {k:?} has a side of size 0")
        }
        // In u128: a padding or dilation near `usize::MAX` must not overflow the check.
        let span = p.dilation as u128 * (taps as u128 - 1) + 1;
        let padded = size as u128 + 2 * p.padding as u128;
        if span > padded {
            candle_core::bail!(
                "{op}: the kernel spans {span} (size {taps}, dilation {}) along a side of the \
                 input of {size} padded by {} on each side: no output position",
                p.dilation,
                p.padding
            )
        }
        let side = (padded - span) / p.stride as u128 + 1;
        out.push(usize::try_from(side).unwrap_or(usize::MAX));
    }
    crate::kernels::layout::check_allocatable(op, &out)
}

/// `conv2d` with candle's semantics plus an optional per-channel `bias` `(c_out)` of the
/// kernel's dtype; on CPU as GEMMs with the bias added before the one rounding of each output
/// (see the module docs), elsewhere candle's conv (a matrix product for a pointwise conv) and
/// [`crate::kernels::bias::add_bias`] (the bias's gradient summed in f32). The kernel and bias may
/// be f32 masters of a half `x`: they are rounded to `x`'s dtype inside the op (the cast a
/// region inserts, bit for bit) and get f32 gradients, never rounded to half; no half copy of
/// the weight joins the autograd graph.
pub(crate) fn conv2d(
    x: &Tensor,
    k: &Tensor,
    bias: Option<&Tensor>,
    p: Conv2dParams,
) -> Result<Tensor> {
    check_geometry("conv2d", x.dims(), k.dims(), p)?;
    if on_cudnn(x, k, p) {
        // The op's CUDA forward and gradients are cuDNN's; the bias is the bias op's (its
        // gradient summed in f32).
        let y = x.contiguous()?.apply_op2(&k.contiguous()?, Conv2dOp(p))?;
        return match bias {
            Some(b) => crate::kernels::bias::add_bias(&y, b, 1),
            None => Ok(y),
        };
    }
    let bias_fits =
        bias.is_none_or(|b| b.dims() == [k.dim(0).unwrap_or(0)] && b.dtype() == k.dtype());
    if handles(x, k, p) && bias_fits {
        let (x, k) = (x.contiguous()?, k.contiguous()?);
        match bias {
            Some(b) => x.apply_op3(&k, &b.contiguous()?, Conv2dOp(p)),
            None => x.apply_op2(&k, Conv2dOp(p)),
        }
    } else {
        let k = crate::kernels::convert::to_dtype(k, x.dtype())?;
        // The pointwise op runs on CPU and CUDA (its forward is the backend's matmul); it adds
        // an f32 bias of an f32, f16 or bf16 output itself.
        if pointwise(x, &k, p) && (x.device().is_cpu() || x.device().is_cuda()) {
            return match bias {
                Some(b) if !crate::kernels::bias::bias_supported(x, b) => {
                    crate::kernels::bias::add_bias(&pointwise_product(x, &k, None)?, b, 1)
                }
                _ => pointwise_product(x, &k, bias),
            };
        }
        let y = x.conv2d(&k, p.padding, p.stride, p.dilation, p.groups)?;
        match bias {
            Some(b) => crate::kernels::bias::add_bias(&y, b, 1),
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
    check_geometry("conv1d", x.dims(), k.dims(), p)?;
    let x = if p.padding > 0 {
        x.pad_with_zeros(2, p.padding, p.padding)?
    } else {
        x.clone()
    };
    let flat = Conv2dParams { padding: 0, ..p };
    conv2d(&x.unsqueeze(2)?, &k.unsqueeze(2)?, bias, flat)?.squeeze(2)
}

/// Transposed-convolution hyper-parameters, as candle's `conv_transpose1d`/`conv_transpose2d`
/// take them (`groups` for the 1-D one only, as in candle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TransposeParams {
    pub padding: usize,
    pub output_padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// candle's `conv_transpose1d` (an `x` of rank 3) or `conv_transpose2d` (rank 4), its geometry
/// checked first ([`check_transpose`]), half operands computed in f32 and rounded once:
/// candle's CPU kernel adds each tap into an output in the operands' dtype (bf16: 289 taps of
/// ones summed to 256), where autocast's lower-precision ops accumulate in f32. An f32 `x`
/// runs as it is.
pub(crate) fn conv_transpose(x: &Tensor, k: &Tensor, t: TransposeParams) -> Result<Tensor> {
    check_transpose(x.dims(), k.dims(), t)?;
    // cuDNN: the transposed conv is the conv's input gradient, of an output padding smaller
    // than the stride (a larger one, possible with a larger dilation, makes a conv input the
    // conv does not map back onto `x`'s size).
    #[cfg(feature = "cudnn")]
    if x.device().is_cuda() && x.rank() == 4 && dtypes_fit(x, k) && t.output_padding < t.stride {
        let conv = Conv2dParams {
            padding: t.padding,
            stride: t.stride,
            dilation: t.dilation,
            groups: t.groups,
        };
        let op = ConvTranspose2dOp {
            conv,
            output_padding: t.output_padding,
        };
        return x.contiguous()?.apply_op2(&k.contiguous()?, op);
    }
    let run = |x: &Tensor, k: &Tensor| {
        if x.rank() == 3 {
            x.conv_transpose1d(
                k,
                t.padding,
                t.output_padding,
                t.stride,
                t.dilation,
                t.groups,
            )
        } else if t.output_padding >= t.stride {
            uncropped_transpose2d(x, k, t)
        } else {
            x.conv_transpose2d(k, t.padding, t.output_padding, t.stride, t.dilation)
        }
    };
    if x.dtype() == DType::F32 && k.dtype() == DType::F32 {
        return run(x, k);
    }
    let y = run(
        &crate::kernels::convert::to_dtype(x, DType::F32)?,
        &crate::kernels::convert::to_dtype(k, DType::F32)?,
    )?;
    crate::kernels::convert::to_dtype(&y, x.dtype())
}

/// A 2-D transposed convolution whose output padding is at least its stride (possible with a
/// larger dilation), composed so that it trains: candle's backward takes the input's gradient
/// as a convolution of the output's, which maps an output padded by `stride` or more onto a
/// larger input than `x` (an `add` shape mismatch). Here the convolution runs without padding,
/// and the output is its rows and columns from `padding` on, `output_padding - padding` zero
/// rows and columns added where the output padding reaches past them: the same values, and
/// gradients through candle's `narrow` and `pad`.
fn uncropped_transpose2d(x: &Tensor, k: &Tensor, t: TransposeParams) -> Result<Tensor> {
    let full = x.conv_transpose2d(k, 0, 0, t.stride, t.dilation)?;
    let mut y = full;
    for dim in [2, 3] {
        let whole = y.dim(dim)?;
        let wanted = whole + t.output_padding - 2 * t.padding;
        let kept = wanted.min(whole.saturating_sub(t.padding));
        y = if kept == 0 {
            y.narrow(dim, 0, 0)?.pad_with_zeros(dim, 0, wanted)?
        } else {
            y.narrow(dim, t.padding, kept)?
                .pad_with_zeros(dim, 0, wanted - kept)?
        };
    }
    Ok(y)
}

/// The output sizes of a 2-D transposed convolution of `x` by `k` (checked by
/// [`check_transpose`]): `(batch, c_out, (h - 1) * stride - 2 * padding + dilation * (kh - 1) +
/// output_padding + 1, ..)`, the kernel `(c_in, c_out / groups, kh, kw)`.
#[cfg(feature = "cudnn")]
fn transpose_out_dims(
    x: &[usize],
    k: &[usize],
    p: Conv2dParams,
    output_padding: usize,
) -> [usize; 4] {
    let side = |size: usize, taps: usize| {
        (size - 1) * p.stride + p.dilation * (taps - 1) + output_padding + 1 - 2 * p.padding
    };
    [x[0], k[1] * p.groups, side(x[2], k[2]), side(x[3], k[3])]
}

/// Checks a transposed convolution's operands against its parameters, as PyTorch does: `x` is
/// `(batch, c_in, spatial...)` and `k` `(c_in, c_out / groups, kernel...)`; stride, dilation and
/// groups positive (candle divides by them); `output_padding` smaller than the stride or the
/// dilation; every output size at least 1 (candle's would wrap around).
pub(crate) fn check_transpose(x: &[usize], k: &[usize], t: TransposeParams) -> Result<()> {
    let op = if x.len() == 3 {
        "conv_transpose1d"
    } else {
        "conv_transpose2d"
    };
    Conv2dParams {
        padding: t.padding,
        stride: t.stride,
        dilation: t.dilation,
        groups: t.groups,
    }
    .check(op)?;
    if !matches!(x.len(), 3 | 4) || k.len() != x.len() {
        candle_core::bail!(
            "{op}: the input is (batch, channels, spatial...) and the kernel (in channels, out \
             channels / groups, kernel...) of the same rank, 3 or 4, got {x:?} and {k:?}"
        )
    }
    if x.len() == 4 && t.groups != 1 {
        candle_core::bail!("{op}: groups must be 1 (candle's conv_transpose2d has none)")
    }
    if x[1] != k[0] || !k[0].is_multiple_of(t.groups) {
        candle_core::bail!(
            "{op}: the input has {} channels, the kernel {} input channels in {} groups",
            x[1],
            k[0],
            t.groups
        )
    }
    if t.output_padding >= t.stride.max(t.dilation) {
        candle_core::bail!(
            "{op}: output_padding {} must be smaller than the stride ({}) or the dilation ({})",
            t.output_padding,
            t.stride,
            t.dilation
        )
    }
    let mut out = vec![x[0], k[1].saturating_mul(t.groups)];
    for (&size, &taps) in x[2..].iter().zip(&k[2..]) {
        if taps == 0 || size == 0 {
            candle_core::bail!("{op}: a side of size 0 in {x:?} or {k:?}")
        }
        // In u128: a stride, dilation or padding near `usize::MAX` must not overflow the check.
        let full = (size as u128 - 1) * t.stride as u128
            + t.dilation as u128 * (taps as u128 - 1)
            + t.output_padding as u128
            + 1;
        let padding = 2 * t.padding as u128;
        if full <= padding {
            candle_core::bail!(
                "{op}: padding {} on each side leaves no output of the {full} positions a side \
                 of {size} makes",
                t.padding
            )
        }
        out.push(usize::try_from(full - padding).unwrap_or(usize::MAX));
    }
    crate::kernels::layout::check_allocatable(op, &out)
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

/// Whether the op takes these dtypes: one float dtype, or an f32 master kernel of a half `x`.
fn dtypes_fit(x: &Tensor, k: &Tensor) -> bool {
    let masters = k.dtype() == DType::F32 && matches!(x.dtype(), DType::F16 | DType::BF16);
    matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && (x.dtype() == k.dtype() || masters)
}

/// Whether [`conv2d`] runs on cuDNN (feature `cudnn`): a CUDA `x` of rank 4, except a half
/// pointwise convolution. That one is a cuBLAS product per image ([`pointwise_product`]), which
/// reads the NCHW batch in place; cuDNN's half kernels take NHWC and transpose every operand
/// there and back (on an H100 the sine net's fp16 step took twice as long on cuDNN, while its
/// f32 step was faster there, on TF32: `docs/performance-log.md`).
fn on_cudnn(x: &Tensor, k: &Tensor, p: Conv2dParams) -> bool {
    cfg!(feature = "cudnn")
        && x.device().is_cuda()
        && x.rank() == 4
        && dtypes_fit(x, k)
        && (x.dtype() == DType::F32 || !pointwise(x, k, p))
}

/// Whether [`conv2d`] runs this convolution as one op of this crate on a CUDA `x`, whose
/// gradients [`conv2d_grads`] computes: on cuDNN, or a pointwise product.
pub(crate) fn one_op_on_cuda(x: &Tensor, k: &Tensor, p: Conv2dParams) -> bool {
    x.device().is_cuda() && dtypes_fit(x, k) && (on_cudnn(x, k, p) || pointwise(x, k, p))
}

/// The input and kernel gradients of `conv2d(x, k)` without a bias (`k` an f32 master of a half
/// `x`, or of `x`'s dtype) for the output gradient `dy`, as the conv's op computes them on
/// `x`'s device: on CPU and cuDNN [`input_and_kernel_grads`], for a pointwise conv elsewhere
/// the product's. For an op that runs the conv's forward itself (`batch_norm::after_conv_op`).
pub(crate) fn conv2d_grads(
    x: &Tensor,
    k: &Tensor,
    p: Conv2dParams,
    dy: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    if !x.device().is_cpu() && !on_cudnn(x, k, p) && pointwise(x, k, p) {
        pointwise::master_grads(x, k, dy)
    } else {
        input_and_kernel_grads(x, k, p, dy)
    }
}

/// Whether [`conv2d`] takes its own path on CPU: one float dtype, shapes candle accepts.
pub(crate) fn handles(x: &Tensor, k: &Tensor, p: Conv2dParams) -> bool {
    let (&[_, c_in, h, w], &[c_out, c_in_g, kh, kw]) = (x.dims(), k.dims()) else {
        return false;
    };
    x.device().is_cpu()
        && dtypes_fit(x, k)
        && p.groups > 0
        && p.stride > 0
        && p.dilation > 0
        && c_in == c_in_g * p.groups
        && c_out % p.groups == 0
        && h + 2 * p.padding > p.dilation * (kh - 1)
        && w + 2 * p.padding > p.dilation * (kw - 1)
}
