//! `conv2d` on CPU in bf16 and f16. candle fails on bf16 ("unsupported dtype BF16 for op
//! matmul") and, in f16, its backward's `conv_transpose2d` takes a slow direct path (20x the f32
//! time on a 32x32 CNN). Here a half conv runs as a custom op that widens the operands to f32
//! inside the kernel, convolves with f32 accumulation (what a tensor core does too), and rounds
//! the result to the input's dtype. Because the widening happens inside the op, the autograd
//! graph keeps only the half operands, not f32 copies; the backward is candle's conv2d backward
//! formula, computed the same way.

use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::Real;

/// Convolution hyper-parameters, as candle's `conv2d` takes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Conv2dParams {
    pub padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// `conv2d` that also works for bf16 on CPU, and runs f16 on CPU through f32.
pub(crate) fn conv2d(x: &Tensor, k: &Tensor, p: Conv2dParams) -> Result<Tensor> {
    if matches!(x.dtype(), DType::BF16 | DType::F16) && x.device().is_cpu() {
        x.apply_op2(k, CpuHalfConv2d(p))
    } else {
        x.conv2d(k, p.padding, p.stride, p.dilation, p.groups)
    }
}

/// Half-precision conv2d on CPU computed in f32 (see the module docs).
struct CpuHalfConv2d(Conv2dParams);

/// A strided half-precision CPU operand as a contiguous f32 tensor.
fn widen(storage: &CpuStorage, layout: &Layout) -> Result<Tensor> {
    match storage {
        CpuStorage::BF16(src) => widen_typed(src, layout),
        CpuStorage::F16(src) => widen_typed(src, layout),
        other => candle_core::bail!(
            "half conv2d kernel: expected f16 or bf16, got {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    }
}

fn widen_typed<T: Real>(src: &[T], layout: &Layout) -> Result<Tensor> {
    let data: Vec<f32> = match layout.contiguous_offsets() {
        Some((start, end)) => src[start..end].par_iter().map(|v| v.get()).collect(),
        // Gathers a non-contiguous view element by element, in row-major order of its shape.
        None => super::strided_offsets(layout)
            .map(|offset| src[offset].get())
            .collect(),
    };
    Tensor::from_vec(data, layout.shape(), &Device::Cpu)
}

/// An f32 result rounded to the dtype of the half operand `like`.
fn narrow_to(y: &[f32], like: &CpuStorage) -> CpuStorage {
    fn round<T: Real>(y: &[f32]) -> Vec<T> {
        y.par_iter().map(|&v| T::put(v)).collect()
    }
    match like {
        CpuStorage::F16(_) => CpuStorage::F16(round(y)),
        _ => CpuStorage::BF16(round(y)),
    }
}

impl CustomOp2 for CpuHalfConv2d {
    fn name(&self) -> &'static str {
        "cpu-half-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = self.0;
        let y =
            widen(s1, l1)?.conv2d(&widen(s2, l2)?, p.padding, p.stride, p.dilation, p.groups)?;
        let shape = y.shape().clone();
        let y: Vec<f32> = y.flatten_all()?.to_vec1()?;
        Ok((narrow_to(&y, s1), shape))
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

    /// Forward and both gradients of the bf16 and f16 paths against candle's f32 conv2d on the
    /// same (half-representable) values, for strided, padded, dilated and grouped shapes.
    #[test]
    fn half_conv2d_matches_f32_reference() -> Result<()> {
        // bf16 rounds to 2^-8 relative, f16 to 2^-11.
        for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
            half_conv2d_case(dtype, tol)?;
        }
        Ok(())
    }

    fn half_conv2d_case(dtype: DType, tol: f32) -> Result<()> {
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
            let x = Tensor::randn(0f32, 1., (2, c_in, 9, 9), &dev)?.to_dtype(dtype)?;
            let k =
                Tensor::randn(0f32, 1., (c_out, c_in / p.groups, 3, 3), &dev)?.to_dtype(dtype)?;
            let xv = candle_core::Var::from_tensor(&x)?;
            let kv = candle_core::Var::from_tensor(&k)?;
            let y = conv2d(&xv, &kv, p)?;
            assert_eq!(y.dtype(), dtype);
            let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

            let x32 = candle_core::Var::from_tensor(&x.to_dtype(DType::F32)?)?;
            let k32 = candle_core::Var::from_tensor(&k.to_dtype(DType::F32)?)?;
            let y32 = x32.conv2d(&k32, p.padding, p.stride, p.dilation, p.groups)?;
            // The f32 reference squares its own f32 output; the half path squares its rounded
            // output, so gradients agree to the rounding of y.
            let grads32 = y32.sqr()?.sum_all()?.backward()?;

            let scale =
                |t: &Tensor| -> Result<f32> { t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
            assert!(
                max_abs_diff(&y, &y32)? <= tol * scale(&y32)?,
                "{dtype:?} {p:?} forward"
            );
            let (gx, gx32) = (grads.get(&xv).unwrap(), grads32.get(&x32).unwrap());
            assert_eq!(gx.dtype(), dtype);
            assert!(
                max_abs_diff(gx, gx32)? <= tol * scale(gx32)?,
                "{dtype:?} {p:?} grad x"
            );
            let (gk, gk32) = (grads.get(&kv).unwrap(), grads32.get(&k32).unwrap());
            assert!(
                max_abs_diff(gk, gk32)? <= tol * scale(gk32)?,
                "{dtype:?} {p:?} grad k"
            );
        }
        Ok(())
    }
}
