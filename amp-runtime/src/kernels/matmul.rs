//! `matmul` of half-precision tensors on CPU through [`super::gemm`], forward and both
//! gradients.
//!
//! candle's CPU matmul fails on bf16 in some builds and otherwise widens half operands to f32
//! around a generic GEMM, at f32 speed. Here a bf16 matmul runs on AMX tiles or `vdpbf16ps` where
//! the CPU has them, and an f16 one converts to f32 while packing (f16 arithmetic has no x86 hardware path).
//! The op keeps only its half operands for the backward pass, whose two products,
//! `grad_a = grad * b^T` and `grad_b = a^T * grad`, are this same op on transposed views
//! (strides swapped, nothing copied).

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use super::gemm::{gemm, gemm_append, gemm_uninit, GemmElem, MatRef};
use super::leaf_grads::{offer, wanted};
use super::{parallel, Real};
use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result,
    Shape, Tensor,
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
    let with = |t: &Tensor, tail: &[usize]| -> Result<Tensor> {
        let dims = [batch.dims(), tail].concat();
        if dims == t.dims() {
            Ok(t.clone())
        } else {
            super::spread(t, &Shape::from(dims))
        }
    };
    matmul(
        &with(a, &da[da.len() - 2..])?,
        &with(b, &db[db.len() - 2..])?,
    )
}

/// A linear layer on a 2-D input: `x (rows, in) * w (out, in)^T + b (out)`, with `w` and `b`
/// the layer's f32 masters. For a half `x` on CPU, one op: the master is rounded to `x`'s dtype
/// inside it (the cast an autocast region would insert, bit for bit) as the GEMM packs it, so
/// no half copy of the weight is made, here or for `grad_x`; the bias is added before
/// the output's one rounding, and the backward returns the masters' gradients in f32 straight
/// from the f32 accumulators: `grad_w = grad^T * x` and `grad_b` the column sums of `grad`,
/// never rounded to half (PyTorch rounds them to half, then widens), with `grad_x = grad * w`.
/// No half copy of the weight joins the autograd graph, so candle's backward does not allocate
/// and add a half gradient for one. On CUDA, for f32, f16 and bf16 inputs, one op as well
/// ([`MasterLinear`]). Elsewhere: the weight cast to `x`'s dtype, candle's matmul and
/// [`super::add_bias`] (the bias's gradient summed in f32).
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let masters = w.dtype() == DType::F32 && b.is_none_or(|b| b.dtype() == DType::F32);
    let shapes = match (x.dims(), w.dims()) {
        (&[_, k], &[out, k_w]) => k == k_w && b.is_none_or(|b| b.dims() == [out]),
        _ => false,
    };
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    if x.device().is_cpu() && half && masters && shapes {
        match b {
            Some(b) => x.apply_op3(w, b, HalfLinear),
            None => x.apply_op2(w, HalfLinear),
        }
    } else if x.device().is_cuda() && (half || x.dtype() == DType::F32) && masters && shapes {
        fused::<MasterLinear>(x, w, b)
    } else {
        let y = x.matmul(&super::to_dtype(w, x.dtype())?.t()?)?;
        match b {
            Some(b) => super::add_bias(&y, b, y.rank().saturating_sub(1)),
            None => Ok(y),
        }
    }
}

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
        super::batch_norm::BiasAdd { dim: 1 }.cpu_fwd(&y, &Layout::contiguous(&shape), b, lb)
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
        super::batch_norm::BiasAdd { dim: 1 }.cuda_fwd(&y, &Layout::contiguous(&shape), b, lb)
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
        let gb = offer(b, || super::batch_norm::channel_sums(grad, 1, b.shape()))?;
        Ok((gx, gw, gb))
    }
}

/// `Linear` off the CPU as one op on `(x, w[, b])` with f32 masters `w` and `b`: the weight cast
/// to `x`'s dtype inside the forward (a storage, not a graph node), the backend's matmul on it,
/// then the bias add of [`super::batch_norm::bias_add`]. Composed of candle ops the cast, the
/// transpose and the bias add were graph nodes of the weight's or the output's size, each of
/// which candle's backward fills with a zero tensor plus an add (`GradStore::or_insert`). The
/// backward: `grad_x = grad * w` (the weight cast again), `grad_w = grad^T * x` in `x`'s dtype
/// (the BLAS accumulates in f32 and rounds once, as PyTorch's half weight gradient) widened to
/// f32, `grad_b` the per-channel sums in f32; the masters' gradients go to the gradient
/// scaler's collector ([`offer`]) past candle's accumulation.
struct MasterLinear;

impl Product for MasterLinear {
    const NAME: &'static str = "amp-master-linear";
    const NAME_WITH_BIAS: &'static str = "amp-master-linear-bias";

    /// `x (rows, in) * w^T` with `w` rounded to `x`'s dtype.
    fn product<S: BackendStorage>(x: &S, lx: &Layout, w: &S, lw: &Layout) -> Result<(S, Shape)> {
        let (&[rows, k], &[out, k_w]) = (lx.dims(), lw.dims()) else {
            candle_core::bail!("linear: {:?} by {:?}", lx.dims(), lw.dims())
        };
        if k != k_w {
            candle_core::bail!("linear: {k} inputs, weight for {k_w}")
        }
        let cast;
        let (w, lw) = if w.dtype() == x.dtype() {
            (w, lw.clone())
        } else {
            cast = w.to_dtype(lw, x.dtype())?;
            (&cast, Layout::contiguous((out, k)))
        };
        let y = x.matmul(w, (1, rows, out, k), lx, &lw.transpose(0, 1)?)?;
        Ok((y, Shape::from((rows, out))))
    }

    fn grads(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_x = wanted(x, || {
            grad.matmul(&super::to_dtype(&w.detach(), grad.dtype())?)
        })?;
        let grad_w = offer(w, || grad.t()?.matmul(x)?.to_dtype(w.dtype()))?;
        Ok((grad_x, grad_w))
    }
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

/// `x * w^T (+ b)` with f32 masters `w`, `b`: see [`linear`].
struct HalfLinear;

impl HalfLinear {
    /// The product into rows prefilled with the bias (rounded to `T`), if any.
    fn run<T: GemmElem>(
        (x, lx): (&[T], &Layout),
        (w, lw): (&[f32], &Layout),
        bias: Option<(&[f32], &Layout)>,
    ) -> Vec<T> {
        let (rows, inner) = (lx.dims()[0], lx.dims()[1]);
        let out = lw.dims()[0];
        // The master, contiguous `(out, in)`, rounded to T as the GEMM packs it.
        let w = super::elements(w, lw);
        let a = MatRef::from_layout(x, lx);
        // w^T: element (i, j) of the (in, out) view is w[j, i].
        let wt = MatRef {
            data: &w,
            offset: 0,
            rs: 1,
            cs: inner,
        };
        let Some((b, lb)) = bias else {
            let mut y = Vec::new();
            gemm_append(&mut y, (rows, out, inner), a, wt, true);
            return y;
        };
        let b: Vec<T> = super::elements(b, lb).iter().map(|&v| T::put(v)).collect();
        let mut y = b.repeat(rows);
        gemm(rows, out, inner, a, wt, &mut y, true, true);
        y
    }

    /// `grad_x` in `x`'s dtype and the master's `grad_w` in f32, each only if wanted (and
    /// `grad_w` `None` when the scaler's backward takes it directly: `leaf_grads`).
    fn grads(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_x = wanted(x, || grad.apply_op2_no_bwd(w, &ByMaster))?;
        let grad_w = offer(w, || {
            grad.t()?.apply_op2_no_bwd(x, &HalfMatmul(Some(DType::F32)))
        })?;
        Ok((grad_x, grad_w))
    }
}

/// `grad (rows, out) * w (out, in)` in `grad`'s half dtype, `w` an f32 master rounded to that
/// dtype as the GEMM packs it: `Linear`'s input gradient, without a half copy of the weight.
struct ByMaster;

impl CustomOp2 for ByMaster {
    fn name(&self) -> &'static str {
        "amp-half-by-master"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn product<T: GemmElem>(g: &[T], lg: &Layout, w: &[f32], lw: &Layout) -> Vec<T> {
            let (rows, k, n) = (lg.dims()[0], lg.dims()[1], lw.dims()[1]);
            let (a, b) = (MatRef::from_layout(g, lg), MatRef::from_layout(w, lw));
            let mut y = Vec::new();
            gemm_append(&mut y, (rows, n, k), a, b, true);
            y
        }
        let y = match (s1, s2) {
            (CpuStorage::BF16(g), CpuStorage::F32(w)) => CpuStorage::BF16(product(g, l1, w, l2)),
            (CpuStorage::F16(g), CpuStorage::F32(w)) => CpuStorage::F16(product(g, l1, w, l2)),
            (a, b) => candle_core::bail!(
                "half-by-master kernel: expected a f16 or bf16 gradient and an f32 weight, got {:?} and {:?}",
                a.dtype(),
                b.dtype()
            ),
        };
        Ok((y, Shape::from((l1.dims()[0], l2.dims()[1]))))
    }
}

impl CustomOp2 for HalfLinear {
    fn name(&self) -> &'static str {
        "amp-half-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = match (s1, s2) {
            (CpuStorage::BF16(x), CpuStorage::F32(w)) => {
                CpuStorage::BF16(Self::run((x, l1), (w, l2), None))
            }
            (CpuStorage::F16(x), CpuStorage::F32(w)) => {
                CpuStorage::F16(Self::run((x, l1), (w, l2), None))
            }
            (a, b) => candle_core::bail!(
                "half linear kernel: expected a f16 or bf16 input and an f32 weight, got {:?} and {:?}",
                a.dtype(),
                b.dtype()
            ),
        };
        Ok((y, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Self::grads(x, w, grad)
    }
}

impl CustomOp3 for HalfLinear {
    fn name(&self) -> &'static str {
        "amp-half-linear-bias"
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
        let y = match (s1, s2, s3) {
            (CpuStorage::BF16(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::BF16(Self::run((x, l1), (w, l2), Some((b, l3))))
            }
            (CpuStorage::F16(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::F16(Self::run((x, l1), (w, l2), Some((b, l3))))
            }
            (a, b, c) => candle_core::bail!(
                "half linear kernel: expected a f16 or bf16 input and f32 weight and bias, got {:?}, {:?} \
                 and {:?}",
                a.dtype(),
                b.dtype(),
                c.dtype()
            ),
        };
        Ok((y, Shape::from((l1.dims()[0], l2.dims()[0]))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gx, gw) = Self::grads(x, w, grad)?;
        let gb = offer(b, || grad.apply_op1_no_bwd(&ColumnSums))?;
        Ok((gx, gw, gb))
    }
}

/// `(rows, cols) -> (cols)` in f32: sums down each column (the bias gradient of an f32 master).
struct ColumnSums;

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "amp-column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        // Blocks of rows summed in parallel, each into its own row of f32 sums (reading the
        // gradient row by row, as it lies in memory), then the blocks' rows added.
        fn sums<T: Real + Send + Sync>(g: &[T], l: &Layout) -> Vec<f32> {
            let (rows, cols) = (l.dims()[0], l.dims()[1]);
            let g = super::elements(g, l);
            let block = (rows.div_ceil(parallel::threads()).max(16) * cols).max(1);
            let partials = parallel::map_indices(g.len().div_ceil(block), |i| {
                let mut acc = vec![0f32; cols];
                for row in g[i * block..][..block.min(g.len() - i * block)].chunks(cols.max(1)) {
                    acc.iter_mut().zip(row).for_each(|(a, v)| *a += v.get());
                }
                acc
            });
            // Added in block order: the same sums at every run.
            let mut total = vec![0f32; cols];
            for acc in partials {
                total.iter_mut().zip(&acc).for_each(|(x, y)| *x += y);
            }
            total
        }
        let out = match s {
            CpuStorage::BF16(g) => CpuStorage::F32(sums(g, l)),
            CpuStorage::F16(g) => CpuStorage::F32(sums(g, l)),
            CpuStorage::F32(g) => CpuStorage::F32(sums(g, l)),
            other => candle_core::bail!("column sums: unexpected dtype {:?}", other.dtype()),
        };
        Ok((out, Shape::from(l.dims()[1])))
    }
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

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let diff = (a.to_dtype(DType::F32)? - b)?
            .abs()?
            .flatten_all()?
            .max(0)?;
        let scale = b.abs()?.flatten_all()?.max(0)?;
        Ok(diff.to_scalar::<f32>()? / scale.to_scalar::<f32>()?.max(1e-30))
    }

    /// The off-CPU `Linear` op (run here on CPU, where its forward is candle's matmul on
    /// storages) against the candle composition: the master cast to the input's dtype, `x *
    /// w^T + b` with the bias rounded to that dtype, and all three gradients (the weight's
    /// rounded to that dtype once, then widened; the bias's summed in f32), in f32 and bf16.
    #[test]
    fn the_master_linear_op_is_the_composition() -> Result<()> {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 8e-3)] {
            for bias in [true, false] {
                let x =
                    Var::from_tensor(&Tensor::randn(0f32, 1., (37, 19), &dev)?.to_dtype(dtype)?)?;
                let w = Var::randn(0f32, 1., (11, 19), &dev)?;
                let b = Var::randn(0f32, 1., 11, &dev)?;
                let ours = fused::<MasterLinear>(&x, &w, bias.then_some(b.as_tensor()))?;
                assert_eq!((ours.dtype(), ours.dims()), (dtype, &[37, 11][..]));
                let product = x.matmul(&w.to_dtype(dtype)?.t()?)?;
                let theirs = if bias {
                    product.broadcast_add(&b.to_dtype(dtype)?)?
                } else {
                    product
                };
                assert!(
                    max_rel_diff(&ours, &theirs.to_dtype(DType::F32)?)? <= tol,
                    "{dtype:?}"
                );
                let r = Tensor::randn(0f32, 1., (37, 11), &dev)?;
                let loss = |y: &Tensor| (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward();
                let (g_ours, g_theirs) = (loss(&ours)?, loss(&theirs)?);
                let vars: Vec<&Var> = if bias { vec![&x, &w, &b] } else { vec![&x, &w] };
                for v in vars {
                    let (a, e) = (
                        g_ours.get(v).expect("ours"),
                        g_theirs.get(v).expect("theirs"),
                    );
                    assert_eq!((a.dtype(), a.dims()), (v.dtype(), v.dims()));
                    // candle's own bias gradient is summed in bf16: compare with room for it.
                    let tol = if v.dims() == [11] { 4.0 * tol } else { tol };
                    assert!(
                        max_rel_diff(a, &e.to_dtype(DType::F32)?)? <= tol,
                        "{dtype:?} {:?}",
                        v.dims()
                    );
                }
            }
        }
        Ok(())
    }

    /// Forward and both gradients against candle's f32 matmul on the same rounded values,
    /// batched, transposed and broadcast.
    #[test]
    fn half_matmul_and_its_gradients_match_f32() -> Result<()> {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            for (a_dims, b_dims, transpose_b) in [
                (vec![7, 17], vec![17, 5], false),
                (vec![3, 33, 70], vec![3, 70, 40], false),
                (vec![2, 3, 9, 16], vec![2, 3, 11, 16], true),
            ] {
                let a = Tensor::randn(0f32, 1., a_dims.as_slice(), &dev)?.to_dtype(dtype)?;
                let b = Tensor::randn(0f32, 1., b_dims.as_slice(), &dev)?.to_dtype(dtype)?;
                let (av, bv) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
                let b_op = if transpose_b {
                    bv.t()?
                } else {
                    bv.as_tensor().clone()
                };
                let y = matmul(&av, &b_op)?;
                assert_eq!(y.dtype(), dtype);
                let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

                let (a32, b32) = (
                    Var::from_tensor(&a.to_dtype(DType::F32)?)?,
                    Var::from_tensor(&b.to_dtype(DType::F32)?)?,
                );
                let b32_op = if transpose_b {
                    b32.t()?
                } else {
                    b32.as_tensor().clone()
                };
                let y32 = a32.matmul(&b32_op)?;
                let grads32 = y32.sqr()?.sum_all()?.backward()?;
                assert!(
                    max_rel_diff(&y, &y32)? <= tol,
                    "{dtype:?} {a_dims:?} forward"
                );
                let ga = grads.get(&av).unwrap();
                assert_eq!(ga.dtype(), dtype);
                assert!(
                    max_rel_diff(ga, grads32.get(&a32).unwrap())? <= 3.0 * tol,
                    "{dtype:?} {a_dims:?} grad a"
                );
                assert!(
                    max_rel_diff(grads.get(&bv).unwrap(), grads32.get(&b32).unwrap())? <= 3.0 * tol,
                    "{dtype:?} {a_dims:?} grad b"
                );
            }
        }
        Ok(())
    }

    /// Operands that track nothing (the data, a frozen bias) get no gradient from a half
    /// `Linear`, nor from the loss on its output (the target), where candle's own matmul and
    /// composition give each one; the weight's gradient is the same, to the bit, as when the
    /// input is a variable too.
    #[test]
    fn operands_that_track_nothing_get_no_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1., (37, 70), &dev)?.to_dtype(DType::BF16)?;
        let target = Tensor::randn(0f32, 1., (37, 19), &dev)?;
        let w = Var::randn(0f32, 1., (19, 70), &dev)?;
        let frozen_bias = Tensor::randn(0f32, 1., 19, &dev)?;
        let grads_from = |x: &Tensor| -> Result<candle_core::backprop::GradStore> {
            let y = linear(x, &w, Some(&frozen_bias))?.to_dtype(DType::F32)?;
            crate::kernels::mse::mse(&y, &target)?
                .expect("an f32 pair on CPU")
                .backward()
        };
        let grads = grads_from(&x)?;
        assert!(grads.get(&x).is_none(), "the data");
        assert!(grads.get(&frozen_bias).is_none(), "a frozen bias");
        assert!(grads.get(&target).is_none(), "the target");
        let xv = Var::from_tensor(&x)?;
        let with_x = grads_from(xv.as_tensor())?;
        assert!(with_x.get(&xv).is_some(), "a variable input gets one");
        let (gw, gw_with_x) = (grads.get(&w).unwrap(), with_x.get(&w).unwrap());
        assert_eq!(gw.to_vec2::<f32>()?, gw_with_x.to_vec2::<f32>()?);
        // candle's own ops compute and store one for an untracked operand.
        let y = x.to_dtype(DType::F32)?.matmul(&w.t()?)?;
        let grads = (y - &target)?.sqr()?.mean_all()?.backward()?;
        assert!(grads.get(&target).is_some());
        Ok(())
    }

    /// The fused linear on f32 masters (with and without bias, contiguous and transposed
    /// input) against the composition PyTorch's autocast runs (masters cast to half, half
    /// matmul, half bias add), in f32 on the same rounded values: the output and every
    /// gradient, the masters' gradients in f32.
    #[test]
    fn half_linear_on_f32_masters_matches_the_composition() -> Result<()> {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F16, 2e-3)] {
            for (with_bias, transposed) in [(false, false), (true, false), (true, true)] {
                let x = Tensor::randn(0f32, 1., (37, 70), &dev)?.to_dtype(dtype)?;
                let w = Var::randn(0f32, 1., (19, 70), &dev)?;
                let b = Var::randn(0f32, 1., 19, &dev)?;
                // A transposed input: the (37, 70) view of a (70, 37) tensor.
                let xin = if transposed {
                    Var::from_tensor(&x.t()?.contiguous()?)?
                } else {
                    Var::from_tensor(&x)?
                };
                let x_op = if transposed {
                    xin.t()?
                } else {
                    xin.as_tensor().clone()
                };
                let y = linear(&x_op, &w, with_bias.then_some(b.as_tensor()))?;
                assert_eq!(y.dtype(), dtype);
                let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

                // The reference: f32 math on the half-rounded values.
                let x32 = Var::from_tensor(&x.to_dtype(DType::F32)?)?;
                let w32 = Var::from_tensor(&w.to_dtype(dtype)?.to_dtype(DType::F32)?)?;
                let b32 = Var::from_tensor(&b.to_dtype(dtype)?.to_dtype(DType::F32)?)?;
                let mut y32 = x32.matmul(&w32.t()?)?;
                if with_bias {
                    y32 = y32.broadcast_add(&b32)?;
                }
                let grads32 = y32.sqr()?.sum_all()?.backward()?;
                let what = format!("{dtype:?} bias={with_bias} transposed={transposed}");
                assert!(max_rel_diff(&y, &y32)? <= tol, "{what} forward");
                let gx = grads.get(&xin).unwrap();
                let gx = if transposed { gx.t()? } else { gx.clone() };
                assert_eq!(gx.dtype(), dtype);
                let close = |g: &Tensor, g32: &Tensor| -> Result<bool> {
                    Ok(max_rel_diff(g, g32)? <= 3.0 * tol)
                };
                assert!(close(&gx, grads32.get(&x32).unwrap())?, "{what} grad x");
                let gw = grads.get(&w).unwrap();
                assert_eq!(
                    gw.dtype(),
                    DType::F32,
                    "{what}: the master's gradient is f32"
                );
                assert!(close(gw, grads32.get(&w32).unwrap())?, "{what} grad w");
                if with_bias {
                    let gb = grads.get(&b).unwrap();
                    assert_eq!(gb.dtype(), DType::F32);
                    assert!(close(gb, grads32.get(&b32).unwrap())?, "{what} grad b");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn shapes_candle_rejects_get_candles_error() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((2, 3), DType::BF16, &dev).unwrap();
        let b = Tensor::zeros((4, 5), DType::BF16, &dev).unwrap();
        let err = matmul(&a, &b).unwrap_err().to_string();
        assert!(err.contains("shape mismatch"), "{err}");
    }

    /// A broadcast operand of `broadcast_matmul` gets its gradient summed over the batch in f32:
    /// 300 matrices of bf16 ones give 300 (summed in bf16, as candle's backward of a broadcast
    /// view does, they stick at 256), for a shared right operand and a broadcast left one.
    #[test]
    fn a_broadcast_operand_gets_its_gradient_summed_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        let ones = |shape: &[usize]| Tensor::ones(shape, DType::BF16, &dev);
        let grad_of = |y: &Tensor, v: &candle_core::Var| -> Result<Vec<f32>> {
            let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
            let g = grads.get(v).expect("a gradient").to_dtype(DType::F32)?;
            g.flatten_all()?.to_vec1()
        };
        let w = candle_core::Var::from_tensor(&ones(&[1, 2])?)?;
        let y = broadcast_matmul(&ones(&[300, 1, 1])?, &w)?;
        assert_eq!(y.dims(), [300, 1, 2]);
        assert_eq!(grad_of(&y, &w)?, [300.0, 300.0]);
        let v = candle_core::Var::from_tensor(&ones(&[1, 2])?)?;
        let y = broadcast_matmul(&v, &ones(&[300, 2, 1])?)?;
        assert_eq!(y.dims(), [300, 1, 1]);
        assert_eq!(grad_of(&y, &v)?, [300.0, 300.0]);
        Ok(())
    }
}
