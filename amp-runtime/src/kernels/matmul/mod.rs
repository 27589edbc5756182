//! `matmul` of half-precision tensors on CPU through [`crate::kernels::gemm`], forward and both
//! gradients.
//!
//! candle's CPU matmul fails on bf16 in some builds and otherwise widens half operands to f32
//! around a generic GEMM, at f32 speed. Here a bf16 matmul runs on AMX tiles or `vdpbf16ps` where
//! the CPU has them, and an f16 one converts to f32 while packing (f16 arithmetic has no x86 hardware path).
//! The op keeps only its half operands for the backward pass, whose two products,
//! `grad_a = grad * b^T` and `grad_b = a^T * grad`, are this same op on transposed views
//! (strides swapped, nothing copied).

mod linear;
mod product;
#[cfg(test)]
mod tests;

pub(crate) use product::{fused, Product};

use linear::{HalfLinear, HalfLinearAct};
use product::MasterLinear;

use std::mem::MaybeUninit;

use crate::kernels::elem::Real;
use crate::kernels::gemm::{gemm_uninit, GemmElem, MatRef};
use crate::kernels::leaf_grads::wanted;
use crate::kernels::parallel;
use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor,
};

/// Below this many multiply-adds per matrix, a batch of matmuls runs one matrix per task
/// rather than splitting each matrix over the pool.
const SMALL_GEMM: usize = 1 << 18;

/// `a.matmul(b)` with candle's semantics (equal batch dimensions, `(.., m, k) x (.., k, n)`),
/// through this crate's GEMM for bf16 and f16 on CPU and candle's matmul otherwise. Shapes
/// candle would reject go to candle too, for its error message.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if handles(a, b) {
        a.apply_op2(b, HalfMatmul(None))
    } else {
        a.matmul(b)
    }
}

/// `a.broadcast_matmul(b)`: the batch dimensions broadcast to a common shape, then [`matmul`].
///
/// A broadcast operand's gradient is the sum of its per-batch gradients, which candle's
/// backward of a broadcast view adds up in the operand's dtype (in half for half operands). So a
/// right operand without batch (a weight shared by every matrix of `a`) is one product on `a`'s
/// rows flattened, its gradient one GEMM's f32-accumulated sum; any other broadcast half
/// operand that tracks is broadcast in f32 and rounded back (exactly), a copy, so that its
/// gradient is summed in f32. Operands that do not track are broadcast as views.
pub(crate) fn broadcast_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (da, db) = (a.dims(), b.dims());
    if da.len() < 2 || db.len() < 2 {
        return a.broadcast_matmul(b);
    }
    let (ba, bb) = (&da[..da.len() - 2], &db[..db.len() - 2]);
    let batch = Shape::from(ba).broadcast_shape_binary_op(&Shape::from(bb), "broadcast_matmul")?;
    let (m, k, n) = (da[da.len() - 2], da[da.len() - 1], db[db.len() - 1]);
    let shared = bb.iter().all(|&d| d == 1) && a.elem_count() == batch.elem_count() * m * k;
    if shared && db[db.len() - 2] == k && batch.elem_count() > 1 {
        let y = matmul(
            &a.reshape((batch.elem_count() * m, k))?,
            &b.reshape((k, n))?,
        )?;
        return y.reshape([batch.dims(), &[m, n]].concat());
    }
    let spread = |t: &Tensor, tail: &[usize]| -> Result<Option<Tensor>> {
        let dims = [batch.dims(), tail].concat();
        if dims == t.dims() {
            Ok(None)
        } else {
            super::spread(t, &Shape::from(dims)).map(Some)
        }
    };
    // As candle's `broadcast_matmul`: when both operands are spread, their zero strides may sit
    // in different batch dimensions, which no single batch stride of the matmul describes, so
    // both are made contiguous; one spread operand is read as it is.
    match (
        spread(a, &da[da.len() - 2..])?,
        spread(b, &db[db.len() - 2..])?,
    ) {
        (Some(a), Some(b)) => matmul(&a.contiguous()?, &b.contiguous()?),
        (a2, b2) => matmul(a2.as_ref().unwrap_or(a), b2.as_ref().unwrap_or(b)),
    }
}

/// A linear layer: `x (..., in) * w (out, in)^T + b (out)` over the last dimension, with `w`
/// and `b` the layer's f32 masters. For a half `x` on CPU, one op: the master is rounded to
/// `x`'s dtype inside it (the cast an autocast region would insert, bit for bit) as the GEMM
/// packs it, so no half copy of the weight is made, here or for `grad_x`; the bias is added
/// before the output's one rounding, and the backward returns the masters' gradients in f32
/// straight from the f32 accumulators: `grad_w = grad^T * x` and `grad_b` the column sums of
/// `grad`, never rounded to half (PyTorch rounds them to half, then widens), with `grad_x =
/// grad * w`. No half copy of the weight joins the autograd graph, so candle's backward does not
/// allocate and add a half gradient for one. A contiguous input of any rank is read in place as
/// its rows (no reshape nodes, whose backward would each cost a zero tensor and an add of the
/// activation's size). On CUDA, for f32, f16 and bf16 inputs, one op as well ([`MasterLinear`]),
/// reading a contiguous input of any rank as its rows too. Elsewhere: the weight cast to `x`'s
/// dtype, candle's matmul and [`crate::kernels::bias::add_bias`] (the bias's gradient summed in
/// f32). Those paths, and a strided input of rank above 2, take the input flattened to
/// `(rows, in)` and reshape back.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    check_linear(x, w, b)?;
    if half_on_masters_in_place(x, w, b) {
        return match b {
            Some(b) => x.apply_op3(w, b, HalfLinear),
            None => x.apply_op2(w, HalfLinear),
        };
    }
    let masters = w.dtype() == DType::F32 && b.is_none_or(|b| b.dtype() == DType::F32);
    let shapes = w.rank() == 2;
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    let rows_in_place = x.rank() == 2 || (x.rank() > 2 && x.is_contiguous());
    if x.device().is_cuda()
        && (half || x.dtype() == DType::F32)
        && masters
        && shapes
        && rows_in_place
    {
        return fused::<MasterLinear>(x, w, b);
    }
    if x.rank() != 2 {
        let Some((&k, lead)) = x.dims().split_last() else {
            candle_core::bail!("Linear: expected an input of rank >= 1, got a scalar")
        };
        let mut out = lead.to_vec();
        out.push(w.dim(0)?);
        return linear(&x.reshape((lead.iter().product::<usize>(), k))?, w, b)?.reshape(out);
    }
    let y = x.matmul(&crate::kernels::convert::to_dtype(w, x.dtype())?.t()?)?;
    match b {
        Some(b) => crate::kernels::bias::add_bias(&y, b, y.rank().saturating_sub(1)),
        None => Ok(y),
    }
}

/// `act(linear(x, w, b))`, `act` one of the activations' forms: on CPU with a half input and
/// f32 masters one op ([`HalfLinearAct`]: the activation applied to the product's rounded
/// values, the pre-activation kept for the backward), bit for bit the two ops; elsewhere the
/// two ops.
pub(crate) fn linear_act(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    act: crate::kernels::activation::Form,
) -> Result<Tensor> {
    check_linear(x, w, b)?;
    if half_on_masters_in_place(x, w, b) {
        return match b {
            Some(b) => x.apply_op3(w, b, HalfLinearAct::new(act)),
            None => x.apply_op2(w, HalfLinearAct::new(act)),
        };
    }
    crate::kernels::activation::apply(&linear(x, w, b)?, act)
}

/// An input whose width is not the weight's, or a bias not of its outputs, is an error naming
/// both (candle would name its own `matmul`).
fn check_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<()> {
    if let (Some(&k), &[out, k_w]) = (x.dims().last(), w.dims()) {
        if k != k_w || b.is_some_and(|b| b.dims() != [out]) {
            candle_core::bail!(
                "Linear: the input {:?} has {k} features, the weight {:?} takes {k_w} (in_features) \
                 and makes {out}{}",
                x.dims(),
                w.dims(),
                b.map(|b| format!(", the bias has shape {:?}", b.dims())).unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// Whether the CPU op on f32 masters takes `x`: f16 or bf16 on CPU, its rows readable in place
/// (rank 2, or contiguous), an f32 weight `(out, in)` and bias `(out)`.
fn half_on_masters_in_place(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> bool {
    let masters = w.dtype() == DType::F32 && b.is_none_or(|b| b.dtype() == DType::F32);
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    let rows_in_place = x.rank() == 2 || (x.rank() > 2 && x.is_contiguous());
    x.device().is_cpu() && half && masters && w.rank() == 2 && rows_in_place
}

/// Whether [`matmul`] takes its own path for these operands.
fn handles(a: &Tensor, b: &Tensor) -> bool {
    let (da, db) = (a.dims(), b.dims());
    let rank = da.len();
    a.device().is_cpu()
        && matches!(a.dtype(), DType::BF16 | DType::F16)
        && a.dtype() == b.dtype()
        && rank >= 2
        && db.len() == rank
        && da[..rank - 2] == db[..rank - 2]
        && da[rank - 1] == db[rank - 2]
}

/// The product of two half tensors, in their dtype, or in f32 with `Some(DType::F32)` (a
/// gradient for an f32 master).
struct HalfMatmul(Option<DType>);

/// The geometry of a batched matmul read off its two layouts.
struct Batched {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    /// Start offset of each batch item, in A and in B.
    a_starts: Vec<usize>,
    b_starts: Vec<usize>,
    /// Row and column strides of A and of B.
    a_strides: (usize, usize),
    b_strides: (usize, usize),
}

impl Batched {
    fn new(la: &Layout, lb: &Layout) -> Self {
        let (da, db) = (la.dims(), lb.dims());
        let rank = da.len();
        let starts = |l: &Layout| -> Vec<usize> {
            let batch_dims = &l.dims()[..rank - 2];
            let strides = &l.stride()[..rank - 2];
            let count: usize = batch_dims.iter().product();
            (0..count)
                .map(|mut idx| {
                    let mut off = l.start_offset();
                    for (d, s) in batch_dims.iter().zip(strides).rev() {
                        off += (idx % d) * s;
                        idx /= d;
                    }
                    off
                })
                .collect()
        };
        let rc = |l: &Layout| (l.stride()[rank - 2], l.stride()[rank - 1]);
        Self {
            batch: da[..rank - 2].iter().product(),
            m: da[rank - 2],
            k: da[rank - 1],
            n: db[rank - 1],
            a_starts: starts(la),
            b_starts: starts(lb),
            a_strides: rc(la),
            b_strides: rc(lb),
        }
    }

    fn out_shape(&self, la: &Layout) -> Shape {
        let mut dims = la.dims().to_vec();
        let rank = dims.len();
        dims[rank - 1] = self.n;
        Shape::from(dims)
    }

    /// Every product into a contiguous `(batch, m, n)` output of `T`.
    fn run<T: GemmElem, O: Real + Send + Sync>(&self, a: &[T], b: &[T]) -> Vec<O> {
        let (m, n, k) = (self.m, self.n, self.k);
        let size = m * n;
        if size == 0 {
            return Vec::new();
        }
        let one = |i: usize, out: &mut [MaybeUninit<O>], parallel: bool| {
            let a = MatRef {
                data: a,
                offset: self.a_starts[i],
                rs: self.a_strides.0,
                cs: self.a_strides.1,
            };
            let b = MatRef {
                data: b,
                offset: self.b_starts[i],
                rs: self.b_strides.0,
                cs: self.b_strides.1,
            };
            gemm_uninit((m, n, k), a, b, out, parallel);
        };
        // SAFETY: every product writes all of its block.
        unsafe {
            written(self.batch * size, |blocks| {
                if self.batch > 1 && m * n * k < SMALL_GEMM {
                    parallel::for_each_chunk_mut(blocks, size, |i, o| one(i, o, false));
                } else {
                    for (i, o) in blocks.chunks_mut(size).enumerate() {
                        one(i, o, true);
                    }
                }
            })
        }
    }
}

/// A vector of `len` elements that `fill` writes, never zero-filled first.
///
/// # Safety
/// `fill` writes every one of the `len` elements it is given.
unsafe fn written<O>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<O>])) -> Vec<O> {
    let mut out = Vec::with_capacity(len);
    fill(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: the caller's `fill` initialised all `len` elements.
    unsafe { out.set_len(len) };
    out
}

impl CustomOp2 for HalfMatmul {
    fn name(&self) -> &'static str {
        "amp-half-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let geometry = Batched::new(l1, l2);
        let out = match (s1, s2) {
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => match self.0 {
                Some(DType::F32) => CpuStorage::F32(geometry.run(a, b)),
                _ => CpuStorage::BF16(geometry.run(a, b)),
            },
            (CpuStorage::F16(a), CpuStorage::F16(b)) => match self.0 {
                Some(DType::F32) => CpuStorage::F32(geometry.run(a, b)),
                _ => CpuStorage::F16(geometry.run(a, b)),
            },
            _ => candle_core::bail!(
                "half matmul kernel: expected two f16 or two bf16 operands, got {:?} and {:?}",
                s1.dtype(),
                s2.dtype()
            ),
        };
        Ok((out, geometry.out_shape(l1)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_a = wanted(a, || matmul(grad, &b.t()?))?;
        let grad_b = wanted(b, || matmul(&a.t()?, grad))?;
        Ok((grad_a, grad_b))
    }
}
