//! The pointwise (1x1) convolution off the CPU: one matrix product per image on the device's
//! BLAS, as one op with its own backward.

use candle_core::{Layout, Result, Shape, Tensor};

use crate::kernels::leaf_grads::{offer, wanted};

/// A pointwise conv off the CPU (and an f32 master `bias`, when given) as one op whose forward
/// is one matrix product `(c_out, c_in) x (c_in, h*w)` per image on the device's BLAS (the
/// weight shared by every image: a zero batch stride), then the bias add of
/// [`crate::kernels::bias::bias_add`]. candle's conv there goes through im2col, and its input
/// gradient through a direct transposed convolution. As one node of the graph it spares the
/// reshapes around a product and the separate bias add, each a full-size node that candle's
/// backward fills with a zero tensor plus an add.
/// The backward takes the images as one matrix for the weight gradient (a copy when there are
/// several), so that its sum over the batch is the BLAS's f32-accumulated one: a batched
/// product's gradient would sum the per-image gradients in the input's (half) precision.
pub(super) fn pointwise_product(x: &Tensor, k: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    crate::kernels::matmul::fused::<Pointwise>(x, k, bias)
}

/// The product of [`pointwise_product`].
struct Pointwise;

impl crate::kernels::matmul::Product for Pointwise {
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
    fn bias_dim(_rank: usize) -> usize {
        1
    }

    fn grads(x: &Tensor, k: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = wanted(x, || input_grad(x.dims(), k, dy))?;
        let dk = offer(k, || kernel_grad(x, dy))?;
        Ok((dx, dk))
    }
}

/// The input and kernel gradients of the pointwise conv of `x` by the f32 master `k` of a half
/// `x` (or a kernel of `x`'s dtype), as [`pointwise_product`] computes them with the kernel
/// rounded first: the kernel's gradient in `k`'s dtype.
pub(super) fn master_grads(
    x: &Tensor,
    k: &Tensor,
    dy: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let dx = wanted(x, || {
        input_grad(x.dims(), &super::ops::kernel_as_used(k, x.dtype())?, dy)
    })?;
    let dk = offer(k, || kernel_grad(x, dy)?.to_dtype(k.dtype()))?;
    Ok((dx, dk))
}

/// `k^T dy` per image, the input gradient of a pointwise conv of input dimensions `x_dims`.
fn input_grad(x_dims: &[usize], k: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let &[b, c_in, h, w] = x_dims else {
        candle_core::bail!("pointwise conv: input {x_dims:?}")
    };
    let kt = k.reshape((k.dim(0)?, c_in))?.t()?.contiguous()?;
    let per_image = if b == 1 {
        kt.unsqueeze(0)?
    } else {
        kt.broadcast_left(b)?
    };
    per_image
        .matmul(&dy.reshape((b, (), h * w))?)?
        .reshape((b, c_in, h, w))
}

/// `dy x^T` over every image, the kernel gradient of a pointwise conv, in `x`'s dtype: the images
/// side by side, so that one product sums the batch in f32.
fn kernel_grad(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let (b, c_in, h, w) = x.dims4()?;
    let c_out = dy.dim(1)?;
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
}
