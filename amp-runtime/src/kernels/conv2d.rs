//! `conv2d` on CPU in bf16: candle fails with "unsupported dtype BF16 for op matmul". Here it
//! runs as a custom op that widens the bf16 operands to f32 inside the kernel, convolves with
//! f32 accumulation (what a bf16 tensor core does too), and rounds the result to bf16. Because
//! the widening happens inside the op, the autograd graph keeps only the bf16 operands, not
//! f32 copies; the backward is candle's conv2d backward formula, computed the same way.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

/// Convolution hyper-parameters, as candle's `conv2d` takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Conv2dParams {
    pub padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// `conv2d` that also works for bf16 on CPU.
pub(crate) fn conv2d(x: &Tensor, k: &Tensor, p: Conv2dParams) -> Result<Tensor> {
    if x.dtype() == DType::BF16 && x.device().is_cpu() {
        x.apply_op2(k, CpuBf16Conv2d(p))
    } else {
        x.conv2d(k, p.padding, p.stride, p.dilation, p.groups)
    }
}

/// bf16 conv2d on CPU computed in f32 (see the module docs).
struct CpuBf16Conv2d(Conv2dParams);

/// A strided bf16 CPU operand as a contiguous f32 tensor.
fn widen(storage: &CpuStorage, layout: &Layout) -> Result<Tensor> {
    let src: &[bf16] = storage.as_slice()?;
    let data: Vec<f32> = match layout.contiguous_offsets() {
        Some((start, end)) => src[start..end].par_iter().map(|v| v.to_f32()).collect(),
        None => strided_to_f32(src, layout),
    };
    Tensor::from_vec(data, layout.shape(), &Device::Cpu)
}

/// Gathers a non-contiguous view element by element, in row-major order of its shape.
fn strided_to_f32(src: &[bf16], layout: &Layout) -> Vec<f32> {
    super::strided_offsets(layout)
        .map(|offset| src[offset].to_f32())
        .collect()
}

impl CustomOp2 for CpuBf16Conv2d {
    fn name(&self) -> &'static str {
        "cpu-bf16-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let Conv2dParams {
            padding,
            stride,
            dilation,
            groups,
        } = self.0;
        let y = widen(s1, l1)?.conv2d(&widen(s2, l2)?, padding, stride, dilation, groups)?;
        let shape = y.shape().clone();
        let y: Vec<f32> = y.flatten_all()?.to_vec1()?;
        let y: Vec<bf16> = y.par_iter().map(|&v| bf16::from_f32(v)).collect();
        Ok((CpuStorage::BF16(y), shape))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        kernel: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let Conv2dParams {
            padding,
            stride,
            dilation,
            groups,
        } = self.0;
        let (x, k, g) = (
            arg.to_dtype(DType::F32)?,
            kernel.to_dtype(DType::F32)?,
            grad.to_dtype(DType::F32)?,
        );
        // Grouped convolution is independent per group: x's channels, k's output channels and
        // the gradient's channels split into `groups` matching chunks.
        let (xs, ks, gs) = (
            x.chunk(groups, 1)?,
            k.chunk(groups, 0)?,
            g.chunk(groups, 1)?,
        );
        let mut grad_x = Vec::with_capacity(groups);
        let mut grad_k = Vec::with_capacity(groups);
        for ((x, k), g) in xs.iter().zip(&ks).zip(&gs) {
            let (gx, gk) = conv2d_backward(x, k, g, padding, stride, dilation)?;
            grad_x.push(gx);
            grad_k.push(gk);
        }
        let grad_x = Tensor::cat(&grad_x, 1)?.to_dtype(arg.dtype())?;
        let grad_k = Tensor::cat(&grad_k, 0)?.to_dtype(kernel.dtype())?;
        Ok((Some(grad_x), Some(grad_k)))
    }
}

/// Gradients of a single-group conv2d, the formula of candle's own backward pass.
fn conv2d_backward(
    x: &Tensor,
    k: &Tensor,
    g: &Tensor,
    padding: usize,
    stride: usize,
    dilation: usize,
) -> Result<(Tensor, Tensor)> {
    let (_, _, k_h, k_w) = k.dims4()?;
    // conv_transpose2d's output height is (g_h - 1) * stride - 2 * padding
    // + dilation * (k_h - 1) + out_padding + 1; out_padding recovers the rows that the forward
    // stride skipped.
    let out_size = (g.dim(2)? - 1) * stride + dilation * (k_h - 1) + 1 - 2 * padding;
    let out_padding = x.dim(2)? - out_size;
    let grad_x = g.conv_transpose2d(k, padding, out_padding, stride, dilation)?;
    let grad_k = x
        .transpose(0, 1)?
        .conv2d(&g.transpose(0, 1)?, padding, dilation, stride, 1)?
        .transpose(0, 1)?;
    let grad_k = grad_k.narrow(2, 0, k_h)?.narrow(3, 0, k_w)?;
    Ok((grad_x, grad_k))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar()
    }

    /// Forward and both gradients of the bf16 path against candle's f32 conv2d on the same
    /// (bf16-representable) values, for strided, padded, dilated and grouped shapes.
    #[test]
    fn bf16_conv2d_matches_f32_reference() -> Result<()> {
        let dev = Device::Cpu;
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
            let x = Tensor::randn(0f32, 1., (2, c_in, 9, 9), &dev)?.to_dtype(DType::BF16)?;
            let k = Tensor::randn(0f32, 1., (c_out, c_in / p.groups, 3, 3), &dev)?
                .to_dtype(DType::BF16)?;
            let xv = candle_core::Var::from_tensor(&x)?;
            let kv = candle_core::Var::from_tensor(&k)?;
            let y = conv2d(&xv, &kv, p)?;
            assert_eq!(y.dtype(), DType::BF16);
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

            let x32 = candle_core::Var::from_tensor(&x.to_dtype(DType::F32)?)?;
            let k32 = candle_core::Var::from_tensor(&k.to_dtype(DType::F32)?)?;
            let y32 = x32.conv2d(&k32, p.padding, p.stride, p.dilation, p.groups)?;
            // The f32 reference squares its own f32 output; the bf16 path squares its rounded
            // output, so gradients agree to bf16 rounding of y (relative 2^-8).
            let grads32 = y32.sqr()?.sum_all()?.backward()?;

            let scale =
                |t: &Tensor| -> Result<f32> { t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
            assert!(
                max_abs_diff(&y, &y32)? <= 2e-2 * scale(&y32)?,
                "{p:?} forward"
            );
            let (gx, gx32) = (grads.get(&xv).unwrap(), grads32.get(&x32).unwrap());
            assert_eq!(gx.dtype(), DType::BF16);
            assert!(
                max_abs_diff(gx, gx32)? <= 2e-2 * scale(gx32)?,
                "{p:?} grad x"
            );
            let (gk, gk32) = (grads.get(&kv).unwrap(), grads32.get(&k32).unwrap());
            assert!(
                max_abs_diff(gk, gk32)? <= 2e-2 * scale(gk32)?,
                "{p:?} grad k"
            );
        }
        Ok(())
    }
}
