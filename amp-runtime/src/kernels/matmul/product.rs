//! Products off the CPU as one op with their own backward: the [`Product`] framework, and
//! `Linear`'s product on f32 masters ([`MasterLinear`]).

use std::marker::PhantomData;

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor,
};

use crate::kernels::leaf_grads::{offer, wanted};

/// A product op whose forward is the backend's matmul on storages (no graph node but its own),
/// with an optional f32 bias added along dimension 1 of its output by the bias add's forward:
/// [`MasterLinear`] and the pointwise convolution off the CPU. [`Fused`] makes it a candle op
/// on `(x, w)` or `(x, w, bias)`.
pub(crate) trait Product: Send + Sync + 'static {
    const NAME: &'static str;
    const NAME_WITH_BIAS: &'static str;

    /// The product of `x` and `w` on any backend (CPU storages in the tests, CUDA in use).
    fn product<S: BackendStorage>(x: &S, lx: &Layout, w: &S, lw: &Layout) -> Result<(S, Shape)>;

    /// The gradients of `x` and `w` from the output's gradient `grad`.
    fn grads(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)>;

    /// The dimension of an output of rank `rank` that the bias runs along.
    fn bias_dim(rank: usize) -> usize;
}

/// The product `P` of `x` and `w` (contiguous), plus `bias` when given, as one graph node; the
/// bias's gradient is its per-channel f32 sums, offered to the scaler's collector.
pub(crate) fn fused<P: Product>(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match bias {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, Fused::<P>(PhantomData)),
        None => x.apply_op2(&w, Fused::<P>(PhantomData)),
    }
}

/// The candle op of a [`Product`].
struct Fused<P>(PhantomData<P>);

impl<P: Product> CustomOp2 for Fused<P> {
    fn name(&self) -> &'static str {
        P::NAME
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        P::product(x, lx, w, lw)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        P::product(x, lx, w, lw)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        P::grads(x, w, grad)
    }
}

impl<P: Product> CustomOp3 for Fused<P> {
    fn name(&self) -> &'static str {
        P::NAME_WITH_BIAS
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, shape) = P::product(x, lx, w, lw)?;
        let dim = P::bias_dim(shape.rank());
        crate::kernels::bias::BiasAdd { dim }.cpu_fwd(&y, &Layout::contiguous(&shape), b, lb)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (y, shape) = P::product(x, lx, w, lw)?;
        let dim = P::bias_dim(shape.rank());
        crate::kernels::bias::BiasAdd { dim }.cuda_fwd(&y, &Layout::contiguous(&shape), b, lb)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gx, gw) = P::grads(x, w, grad)?;
        let dim = P::bias_dim(grad.rank());
        let gb = offer(b, || {
            crate::kernels::bias::channel_sums(grad, dim, b.shape())
        })?;
        Ok((gx, gw, gb))
    }
}

/// `Linear` off the CPU as one op on `(x, w[, b])` with f32 masters `w` and `b`: the weight cast
/// to `x`'s dtype inside the forward (a storage, not a graph node), the backend's matmul on it,
/// then the bias add of [`crate::kernels::bias::bias_add`]. Composed of candle ops the cast, the
/// transpose and the bias add were graph nodes of the weight's or the output's size, each of
/// which candle's backward fills with a zero tensor plus an add (`GradStore::or_insert`). The
/// backward: `grad_x = grad * w` (the weight cast again), `grad_w = grad^T * x` in `x`'s dtype
/// (the BLAS accumulates in f32 and rounds once, as PyTorch's half weight gradient) widened to
/// f32, `grad_b` the per-channel sums in f32; the masters' gradients go to the gradient
/// scaler's collector ([`offer`]) past candle's accumulation.
pub(super) struct MasterLinear;

impl Product for MasterLinear {
    const NAME: &'static str = "amp-master-linear";
    const NAME_WITH_BIAS: &'static str = "amp-master-linear-bias";

    /// `x (..., in) * w^T` with `w` rounded to `x`'s dtype, `x` contiguous (read as its rows:
    /// no reshape nodes around the op).
    fn product<S: BackendStorage>(x: &S, lx: &Layout, w: &S, lw: &Layout) -> Result<(S, Shape)> {
        let (Some((&k, lead)), &[out, k_w]) = (lx.dims().split_last(), lw.dims()) else {
            candle_core::bail!("linear: {:?} by {:?}", lx.dims(), lw.dims())
        };
        if k != k_w {
            candle_core::bail!("linear: {k} inputs, weight for {k_w}")
        }
        let rows = lead.iter().product::<usize>();
        let lx = if lx.dims().len() == 2 {
            lx.clone()
        } else if lx.is_contiguous() {
            Layout::contiguous_with_offset((rows, k), lx.start_offset())
        } else {
            candle_core::bail!(
                "linear: a strided input of rank {} (reshape it first)",
                lead.len() + 1
            )
        };
        let cast;
        let (w, lw) = if w.dtype() == x.dtype() {
            (w, lw.clone())
        } else {
            cast = w.to_dtype(lw, x.dtype())?;
            (&cast, Layout::contiguous((out, k)))
        };
        let y = x.matmul(w, (1, rows, out, k), &lx, &lw.transpose(0, 1)?)?;
        Ok((y, Shape::from([lead, &[out]].concat())))
    }

    fn bias_dim(rank: usize) -> usize {
        rank - 1
    }

    fn grads(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let out = w.dim(0)?;
        let grad = grad.reshape(((), out))?;
        let grad_x = wanted(x, || {
            grad.matmul(&crate::kernels::convert::to_dtype(
                &w.detach(),
                grad.dtype(),
            )?)?
            .reshape(x.shape())
        })?;
        let x = x.reshape(((), w.dim(1)?))?;
        let grad_w = offer(w, || grad.t()?.matmul(&x)?.to_dtype(w.dtype()))?;
        Ok((grad_x, grad_w))
    }
}
