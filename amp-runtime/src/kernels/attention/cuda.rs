//! The attention on CUDA as one op with its own backward: the two products on cuBLAS with f32
//! accumulation (the scores through `products_nt_f32`, the rest through candle's batched matmul
//! on storages), the scale, the mask, the causal mask and the softmax between them in one
//! kernel (`cuda/attention.cu`), and in the backward the scores
//! recomputed, the probabilities' gradient turned into the scores' by the same kernel, and four
//! more products. One graph node per call where the composition is a dozen, each with a
//! `(b, h, t_q, t_k)` buffer and candle's zero-and-add in the backward.
//!
//! Grouped-query heads need no repeat: query heads `i * group .. (i + 1) * group` share
//! key/value head `i`, so the queries of one key/value head are `group * t_q` consecutive rows
//! of the contiguous `(b, h, t_q, d)` query, one batch of the products; the keys' gradient sums
//! over the group in the product itself. For half operands the first product writes the
//! scores in f32 (cuBLAS with an f32 output; candle's matmul would round them to half, as
//! autocast's written-out attention does), as the CPU op keeps them, and the backward's
//! probabilities' gradient likewise; the probabilities are rounded once, by the kernel, for
//! the second product. Dropout runs composed (see the module).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape,
    Storage, Tensor,
};

use super::{Geometry, Mask};
use crate::kernels::cuda::attention::{probs, products_nt_f32, MaskView, Rows};
use crate::kernels::leaf_grads::offer;

/// `softmax(q k^T * scale + mask) v` on CUDA tensors of f32, f16 or bf16, causal as asked.
pub(super) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (mask, scale, causal): (Option<&Tensor>, f64, bool),
    g: Geometry,
) -> Result<Tensor> {
    q.apply_op3(k, v, Cuda::new(mask, scale, causal, g, q.dtype())?)
}

/// [`attention`] over a packed `(b, t, 3, h, d)` projection, writing `(b, t, h, d)`.
pub(super) fn packed(
    qkv: &Tensor,
    (mask, scale, causal): (Option<&Tensor>, f64, bool),
    g: Geometry,
) -> Result<Tensor> {
    qkv.apply_op1(Packed(Cuda::new(mask, scale, causal, g, qkv.dtype())?))
}

/// One call's attention on CUDA: geometry, scale, causal flag, the operands' dtype, and the mask
/// as f32 additions (a `u8` mask as 0 or `-inf`) in the mask's own shape, with the strides that
/// broadcast it.
#[derive(Clone)]
struct Cuda {
    g: Geometry,
    rows: Rows,
    dtype: DType,
    mask: Option<(Tensor, [usize; 4])>,
}

impl Cuda {
    fn new(
        mask: Option<&Tensor>,
        scale: f64,
        causal: bool,
        g: Geometry,
        dtype: DType,
    ) -> Result<Self> {
        let mask = match mask {
            None => None,
            Some(m) => {
                let values = if m.dtype() == DType::U8 {
                    let zeros = Tensor::zeros(m.shape(), DType::F32, m.device())?;
                    let hidden = Tensor::full(f32::NEG_INFINITY, m.shape(), m.device())?;
                    m.where_cond(&zeros, &hidden)?
                } else {
                    m.to_dtype(DType::F32)?.contiguous()?
                };
                Some((values.detach(), Mask::strides(m.dims(), g)))
            }
        };
        #[allow(clippy::cast_possible_truncation)] // the kernel scales in f32
        let scale = scale as f32;
        Ok(Self {
            g,
            rows: Rows {
                tq: g.tq,
                tk: g.tk,
                heads: g.h,
                scale,
                causal,
            },
            dtype,
            mask,
        })
    }

    /// `a (batches, m, k) * b (batches, n, k)^T` for contiguous `a`, `b` from `a0`, `b0`: f32
    /// for half operands (the scores, the probabilities' gradient), else in their dtype.
    fn products_nt(
        (a, a0): (&CudaStorage, usize),
        (b, b0): (&CudaStorage, usize),
        (batches, m, n, k): (usize, usize, usize, usize),
    ) -> Result<CudaStorage> {
        if a.dtype() == DType::F32 {
            let la = Layout::contiguous_with_offset((batches, m, k), a0);
            let lbt = Layout::contiguous_with_offset((batches, n, k), b0).transpose(1, 2)?;
            a.matmul(b, (batches, m, n, k), &la, &lbt)
        } else {
            products_nt_f32((a, a0), (b, b0), (batches, m, n, k))
        }
    }

    /// The kernel on contiguous scores `s` (with the probabilities' gradient `dp`: the scores'
    /// gradient), in the operands' dtype.
    fn probs(
        &self,
        s: (&CudaStorage, &Layout),
        dp: Option<(&CudaStorage, &Layout)>,
    ) -> Result<CudaStorage> {
        let Some((mask, strides)) = &self.mask else {
            return probs(s, dp, None, self.rows, self.dtype);
        };
        let (storage, layout) = mask.storage_and_layout();
        let Storage::Cuda(storage) = &*storage else {
            candle_core::bail!("scaled_dot_product_attention: the mask is not on the GPU")
        };
        let view = MaskView {
            storage,
            start: layout.start_offset(),
            strides: *strides,
        };
        probs(s, dp, Some(&view), self.rows, self.dtype)
    }

    /// The output `(b, h, t_q, d_v)`, contiguous, from the three operands' storages.
    fn forward(
        &self,
        (q, lq): (&CudaStorage, &Layout),
        (k, lk): (&CudaStorage, &Layout),
        (v, lv): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape)> {
        let g = self.g;
        let (batches, m) = (g.b * g.hk, g.group() * g.tq);
        let copies = [dense_copy(q, lq)?, dense_copy(k, lk)?, dense_copy(v, lv)?];
        let (q, q0) = dense(q, lq, copies[0].as_ref());
        let (k, k0) = dense(k, lk, copies[1].as_ref());
        let (v, v0) = dense(v, lv, copies[2].as_ref());
        let scores = Self::products_nt((q, q0), (k, k0), (batches, m, g.tk, g.d))?;
        let ls = Layout::contiguous((batches, m, g.tk));
        let p = self.probs((&scores, &ls), None)?;
        let lv = Layout::contiguous_with_offset((batches, g.tk, g.dv), v0);
        let out = p.matmul(v, (batches, m, g.dv, g.tk), &ls, &lv)?;
        Ok((out, Shape::from((g.b, g.h, g.tq, g.dv))))
    }

    /// The gradients of `q`, `k`, `v` (each of its operand's shape) from the output's.
    fn backward(&self, q: &Tensor, k: &Tensor, v: &Tensor, dout: &Tensor) -> Result<[Tensor; 3]> {
        let g = self.g;
        let (batches, m) = (g.b * g.hk, g.group() * g.tq);
        let q3 = q.contiguous()?.reshape((batches, m, g.d))?;
        let k3 = k.contiguous()?.reshape((batches, g.tk, g.d))?;
        let v3 = v.contiguous()?.reshape((batches, g.tk, g.dv))?;
        let d3 = dout.contiguous()?.reshape((batches, m, g.dv))?;
        let scores = q3.apply_op2_no_bwd(&k3, &ProductsNt)?;
        let p = scores.apply_op1_no_bwd(&Probs(self.clone()))?;
        let dp = d3.apply_op2_no_bwd(&v3, &ProductsNt)?;
        let ds = scores.apply_op2_no_bwd(&dp, &Probs(self.clone()))?;
        Ok([
            ds.matmul(&k3)?.reshape(q.shape())?,
            ds.t()?.matmul(&q3)?.reshape(k.shape())?,
            p.t()?.matmul(&d3)?.reshape(v.shape())?,
        ])
    }
}

/// A contiguous copy of a storage whose layout is strided; `None` where it is contiguous.
fn dense_copy(s: &CudaStorage, l: &Layout) -> Result<Option<CudaStorage>> {
    if l.is_contiguous() {
        return Ok(None);
    }
    // SAFETY: `copy_strided_src` writes every element of the fresh storage.
    let mut out = unsafe { s.device().alloc_uninit(l.shape(), s.dtype()) }?;
    s.copy_strided_src(&mut out, 0, l)?;
    Ok(Some(out))
}

/// The storage to read `s`'s values from in row-major order, and its start: `s` itself where
/// its layout is contiguous, else `copy` (made by [`dense_copy`]).
fn dense<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    copy: Option<&'a CudaStorage>,
) -> (&'a CudaStorage, usize) {
    match copy {
        Some(c) => (c, 0),
        None => (s, l.start_offset()),
    }
}

/// The error of a CPU call of a CUDA-only op.
fn not_on_cpu() -> candle_core::Error {
    candle_core::Error::Msg("scaled_dot_product_attention: the CUDA op got CPU tensors".into())
}

impl CustomOp3 for Cuda {
    fn name(&self) -> &'static str {
        "amp-scaled-dot-product-attention-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(not_on_cpu())
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        lq: &Layout,
        k: &CudaStorage,
        lk: &Layout,
        v: &CudaStorage,
        lv: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.forward((q, lq), (k, lk), (v, lv))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dq, dk, dv] = self.backward(q, k, v, grad)?;
        Ok((
            offer(q, || Ok(dq))?,
            offer(k, || Ok(dk))?,
            offer(v, || Ok(dv))?,
        ))
    }
}

/// The op over a packed `(b, t, 3, h, d)` projection: its parts read as `(b, h, t, d)` views
/// (copied contiguous for cuBLAS), the output written `(b, t, h, d)`, the gradient one
/// `(b, t, 3, h, d)` tensor.
struct Packed(Cuda);

impl CustomOp1 for Packed {
    fn name(&self) -> &'static str {
        "amp-scaled-dot-product-attention-packed-cuda"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(not_on_cpu())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let g = self.0.g;
        let st = l.stride();
        let part = |i: usize| {
            Layout::new(
                Shape::from((g.b, g.h, g.tq, g.d)),
                vec![st[0], st[3], st[1], st[4]],
                l.start_offset() + i * st[2],
            )
        };
        let (out, _) = self
            .0
            .forward((s, &part(0)), (s, &part(1)), (s, &part(2)))?;
        // (b, h, t, d) -> (b, t, h, d).
        let heads_major = Layout::contiguous((g.b, g.h, g.tq, g.dv)).transpose(1, 2)?;
        let tokens_major = dense_copy(&out, &heads_major)?.unwrap_or(out);
        Ok((tokens_major, Shape::from((g.b, g.tq, g.h, g.dv))))
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        offer(qkv, || {
            let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
            let grads = self
                .0
                .backward(&part(0)?, &part(1)?, &part(2)?, &grad.transpose(1, 2)?)?;
            let tokens_major = grads
                .iter()
                .map(|d| d.transpose(1, 2))
                .collect::<Result<Vec<_>>>()?;
            Tensor::stack(&tokens_major, 2)
        })
    }
}

/// The kernel as a candle op without a backward: on the scores, their probabilities; on the
/// scores and the probabilities' gradient, the scores' gradient.
struct Probs(Cuda);

impl CustomOp1 for Probs {
    fn name(&self) -> &'static str {
        "amp-attention-probs"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Err(not_on_cpu())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        Ok((self.0.probs((s, l), None)?, l.shape().clone()))
    }
}

impl CustomOp2 for Probs {
    fn name(&self) -> &'static str {
        "amp-attention-probs-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(not_on_cpu())
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        ls: &Layout,
        dp: &CudaStorage,
        ldp: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Ok((self.0.probs((s, ls), Some((dp, ldp)))?, ls.shape().clone()))
    }
}

/// [`Cuda::products_nt`] as a candle op without a backward, on contiguous `(batches, m, k)` and
/// `(batches, n, k)` tensors.
struct ProductsNt;

impl CustomOp2 for ProductsNt {
    fn name(&self) -> &'static str {
        "amp-attention-products-nt"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Err(not_on_cpu())
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        la: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (&[batches, m, k], &[batches_b, n, k_b]) = (la.dims(), lb.dims()) else {
            candle_core::bail!("attention products: {:?} by {:?}", la.dims(), lb.dims())
        };
        if batches != batches_b || k != k_b || !la.is_contiguous() || !lb.is_contiguous() {
            candle_core::bail!("attention products: {:?} by {:?}", la.dims(), lb.dims())
        }
        let out = Cuda::products_nt(
            (a, la.start_offset()),
            (b, lb.start_offset()),
            (batches, m, n, k),
        )?;
        Ok((out, Shape::from((batches, m, n))))
    }
}
