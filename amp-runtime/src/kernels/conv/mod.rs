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
//! All three products run on [`crate::kernels::gemm`] with f32 accumulation (bf16 on `vdpbf16ps` where
//! the CPU has it). The autograd graph keeps only the operands in their own dtype. Images run in
//! parallel when each image's product is small, otherwise one at a time with the GEMM parallel.

mod geometry;
mod ops;
mod pointwise;
#[cfg(test)]
mod tests;

pub(crate) use ops::{f32_sums, input_and_kernel_grads};

use candle_core::{DType, Result, Tensor};

use ops::GemmConv2d;
use pointwise::pointwise_product;

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
    let bias_fits =
        bias.is_none_or(|b| b.dims() == [k.dim(0).unwrap_or(0)] && b.dtype() == k.dtype());
    if handles(x, k, p) && bias_fits {
        let (x, k) = (x.contiguous()?, k.contiguous()?);
        match bias {
            Some(b) => x.apply_op3(&k, &b.contiguous()?, GemmConv2d(p)),
            None => x.apply_op2(&k, GemmConv2d(p)),
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
        &crate::kernels::convert::to_dtype(x, DType::F32)?,
        &crate::kernels::convert::to_dtype(k, DType::F32)?,
    )?;
    crate::kernels::convert::to_dtype(&y, x.dtype())
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
