//! The convolution's custom ops: the forward with bias, and the three gradients. Their CUDA
//! forwards (feature `cudnn`; the bias op's excepted, the bias going through the bias op there)
//! are cuDNN's.

use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::geometry::Geometry;
use super::Conv2dParams;
#[cfg(feature = "cudnn")]
use crate::kernels::cuda::conv as cudnn;
use crate::kernels::elem::with_floats;
use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::{offer, wanted};
use crate::kernels::parallel;
#[cfg(feature = "cudnn")]
use candle_core::{backend::BackendStorage, CudaStorage};

/// The conv op with its backward (see the module docs).
pub(super) struct Conv2dOp(pub Conv2dParams);

/// The 2-D transposed convolution on cuDNN (its forward is the conv's input gradient, cuDNN's
/// "backward data"), with its backward: the input gradient is the conv's forward of the output
/// gradient, the kernel gradient the conv's kernel gradient with the roles of input and output
/// gradient swapped. CUDA only (feature `cudnn`): on CPU candle's transposed conv runs.
#[cfg(feature = "cudnn")]
pub(super) struct ConvTranspose2dOp {
    pub conv: Conv2dParams,
    pub output_padding: usize,
}

/// `s` (contiguous, `layout`) in the dtype of `like`, with its layout: itself, or an f32
/// master rounded to the half dtype of `like` (contiguous from 0).
fn in_dtype_of<'a>(
    s: &'a CpuStorage,
    layout: &Layout,
    like: &CpuStorage,
) -> Result<(std::borrow::Cow<'a, CpuStorage>, Layout)> {
    use crate::kernels::convert::convert_slice;
    use std::borrow::Cow;
    let fresh = || Layout::contiguous(layout.shape());
    Ok(match (s, like) {
        (CpuStorage::F32(w), CpuStorage::BF16(_)) => (
            Cow::Owned(CpuStorage::BF16(convert_slice(
                crate::kernels::layout::contiguous(w, layout, "conv2d")?,
            ))),
            fresh(),
        ),
        (CpuStorage::F32(w), CpuStorage::F16(_)) => (
            Cow::Owned(CpuStorage::F16(convert_slice(
                crate::kernels::layout::contiguous(w, layout, "conv2d")?,
            ))),
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
            Some((s, l)) => Some(crate::kernels::layout::contiguous(
                s.as_slice()?,
                l,
                "conv2d",
            )?),
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
        kernel_as_used(k, x.dtype())?.apply_op2_no_bwd(&grad, &GradInput(geo))
    })?;
    let grad_k = offer(k, || x.apply_op2_no_bwd(&grad, &GradWeight(geo, k.dtype())))?;
    Ok((grad_x, grad_k))
}

/// The kernel `k` as the forward used it, outside the graph: itself, or an f32 master rounded to
/// the input's `dtype` (an input gradient is taken with the rounded kernel).
pub(super) fn kernel_as_used(k: &Tensor, dtype: DType) -> Result<Tensor> {
    if k.dtype() == dtype {
        Ok(k.detach())
    } else if k.device().is_cpu() {
        k.apply_op1_no_bwd(&crate::kernels::convert::Convert(dtype))
    } else {
        k.detach().to_dtype(dtype)
    }
}

impl CustomOp2 for Conv2dOp {
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

    #[cfg(feature = "cudnn")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let geo = Geometry::new(l1.dims(), l2.dims(), self.0);
        let y = in_dtype((s2, l2), s1.dtype(), |w| {
            cudnn::forward((s1, l1), w, &geo.cudnn_shape())
        })?;
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

/// `f` of the CUDA storage `(s, l)` in `dtype`: itself, or converted (an f32 master kernel
/// rounded to the input's half dtype, as the CPU's `in_dtype_of`).
#[cfg(feature = "cudnn")]
fn in_dtype<R>(
    (s, l): (&CudaStorage, &Layout),
    dtype: DType,
    f: impl FnOnce((&CudaStorage, &Layout)) -> Result<R>,
) -> Result<R> {
    if s.dtype() == dtype {
        return f((s, l));
    }
    f((&s.to_dtype(l, dtype)?, &Layout::contiguous(l.shape())))
}

impl CustomOp3 for Conv2dOp {
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
        Ok((gx, geo.in_shape()))
    }

    #[cfg(feature = "cudnn")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let geo = self.0;
        let gx = cudnn::backward_data((s1, l1), (s2, l2), &geo.cudnn_shape())?;
        Ok((gx, geo.in_shape()))
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
        let shape = geo.kernel_shape();
        Ok((stored(sums, self.1), shape))
    }

    #[cfg(feature = "cudnn")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let geo = self.0;
        let shape = geo.kernel_shape();
        let gw = cudnn::backward_filter((s1, l1), (s2, l2), &geo.cudnn_shape())?;
        // cuDNN's sums in the input's dtype, widened for an f32 master.
        let gw = if gw.dtype() == self.1 {
            gw
        } else {
            gw.to_dtype(&Layout::contiguous(&shape), self.1)?
        };
        Ok((gw, shape))
    }
}

#[cfg(feature = "cudnn")]
impl ConvTranspose2dOp {
    /// The geometry of the convolution this op transposes: its input is this op's output
    /// (`y_dims`), its output this op's input.
    fn geometry(&self, y_dims: &[usize], k: &[usize]) -> Geometry {
        Geometry::new(y_dims, k, self.conv)
    }
}

#[cfg(feature = "cudnn")]
impl CustomOp2 for ConvTranspose2dOp {
    fn name(&self) -> &'static str {
        "amp-conv-transpose2d"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-conv-transpose2d runs on CUDA only (cuDNN)")
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = super::transpose_out_dims(l1.dims(), l2.dims(), self.conv, self.output_padding);
        let geo = self.geometry(&y, l2.dims());
        let out = in_dtype((s2, l2), s1.dtype(), |w| {
            cudnn::backward_data(w, (s1, l1), &geo.cudnn_shape())
        })?;
        Ok((out, Shape::from(&y)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let geo = self.geometry(res.dims(), k.dims());
        let grad = grad.contiguous()?;
        let grad_x = wanted(x, || {
            grad.apply_op2_no_bwd(&kernel_as_used(k, x.dtype())?, &Conv2dOp(self.conv))
        })?;
        let grad_k = offer(k, || grad.apply_op2_no_bwd(x, &GradWeight(geo, k.dtype())))?;
        Ok((grad_x, grad_k))
    }
}
