//! `Linear` on CPU with f32 masters: the weight rounded to the input's dtype inside the op, the
//! bias added in the GEMM's output pass, and the three gradients.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result,
    Shape, Tensor, WithDType,
};

use std::sync::Mutex;

use crate::kernels::activation::{input_grad, Form};
use crate::kernels::elem::Real;
use crate::kernels::gemm::{gemm, gemm_append, GemmElem, MatRef};
use crate::kernels::leaf_grads::{offer, wanted};
use crate::kernels::parallel;

use super::HalfMatmul;

/// `x * w^T (+ b)` with f32 masters `w`, `b`: see [`linear`].
pub(super) struct HalfLinear;

impl HalfLinear {
    /// The product into rows prefilled with the bias (rounded to `T`), if any.
    fn run<T: GemmElem>(
        (x, lx): (&[T], &Layout),
        (w, lw): (&[f32], &Layout),
        bias: Option<(&[f32], &Layout)>,
    ) -> Vec<T> {
        let (rows, inner, a) = rows_of(x, lx);
        let out = lw.dims()[0];
        // The master, contiguous `(out, in)`, rounded to T as the GEMM packs it.
        let w = crate::kernels::layout::elements(w, lw);
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
        let b: Vec<T> = crate::kernels::layout::elements(b, lb)
            .iter()
            .map(|&v| T::put(v))
            .collect();
        let mut y = b.repeat(rows);
        gemm(rows, out, inner, a, wt, &mut y, true, true);
        y
    }

    /// `grad_x` in `x`'s dtype and the master's `grad_w` in f32, each only if wanted (and
    /// `grad_w` `None` when the scaler's backward takes it directly: `leaf_grads`).
    fn grads(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x2, grad) = (rows(x)?, rows(grad)?);
        let grad_x = wanted(x, || {
            grad.apply_op2_no_bwd(w, &ByMaster)?.reshape(x.shape())
        })?;
        let grad_w = offer(w, || {
            grad.t()?
                .apply_op2_no_bwd(&x2, &HalfMatmul(Some(DType::F32)))
        })?;
        Ok((grad_x, grad_w))
    }

    /// [`HalfLinear::grads`] and the bias's gradient, the column sums of `grad` in f32.
    fn grads_with_bias(
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gx, gw) = Self::grads(x, w, grad)?;
        let gb = offer(b, || rows(grad)?.apply_op1_no_bwd(&ColumnSums))?;
        Ok((gx, gw, gb))
    }

    /// The output's shape: `x`'s with the last dimension `out`.
    fn shape(lx: &Layout, out: usize) -> Shape {
        let mut dims = lx.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        Shape::from(dims)
    }
}

/// What a product op on f32 masters makes of its rows: [`HalfLinear`] keeps them,
/// [`HalfLinearAct`] activates them.
trait Epilogue {
    fn finish<T: GemmElem>(&self, y: Vec<T>, shape: &Shape) -> Result<CpuStorage>;
}

impl Epilogue for HalfLinear {
    fn finish<T: GemmElem>(&self, y: Vec<T>, _: &Shape) -> Result<CpuStorage> {
        Ok(WithDType::to_cpu_storage_owned(y))
    }
}

/// The forward of the ops on f32 masters: `x * w^T (+ b)` for a f16 or bf16 input and an f32
/// weight (and bias) on CPU, the rows handed to `epilogue`.
fn on_masters(
    epilogue: &impl Epilogue,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    bias: Option<(&CpuStorage, &Layout)>,
) -> Result<(CpuStorage, Shape)> {
    let shape = HalfLinear::shape(l1, l2.dims()[0]);
    let b = match bias {
        Some((CpuStorage::F32(b), lb)) => Some((b.as_slice(), lb)),
        Some((other, _)) => candle_core::bail!(
            "half linear kernel: expected an f32 bias, got {:?}",
            other.dtype()
        ),
        None => None,
    };
    let out = match (s1, s2) {
        (CpuStorage::BF16(x), CpuStorage::F32(w)) => {
            epilogue.finish(HalfLinear::run((x, l1), (w, l2), b), &shape)?
        }
        (CpuStorage::F16(x), CpuStorage::F32(w)) => {
            epilogue.finish(HalfLinear::run((x, l1), (w, l2), b), &shape)?
        }
        (a, b) => candle_core::bail!(
            "half linear kernel: expected a f16 or bf16 input and an f32 weight, got {:?} and {:?}",
            a.dtype(),
            b.dtype()
        ),
    };
    Ok((out, shape))
}

/// `(rows, in)` of an input `(..., in)`: a view (rank 2, or contiguous).
fn rows(t: &Tensor) -> Result<Tensor> {
    if t.rank() == 2 {
        Ok(t.clone())
    } else {
        t.flatten_to(t.rank().saturating_sub(2))
    }
}

/// An input `(..., in)` read as `(rows, in)`: the row count, `in` and the matrix. A rank-2
/// layout may be strided; a higher rank is contiguous (`linear` sends no other here).
fn rows_of<'a, T>(x: &'a [T], lx: &Layout) -> (usize, usize, MatRef<'a, T>) {
    let dims = lx.dims();
    let inner = dims.last().copied().unwrap_or(1);
    let rows = dims[..dims.len().saturating_sub(1)].iter().product();
    let a = if dims.len() == 2 {
        MatRef::from_layout(x, lx)
    } else {
        MatRef::row_major(x, lx.start_offset(), inner)
    };
    (rows, inner, a)
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
        on_masters(self, (s1, l1), (s2, l2), None)
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
        on_masters(self, (s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Self::grads_with_bias(x, w, b, grad)
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
            let g = crate::kernels::layout::elements(g, l);
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

/// `act(x * w^T (+ b))` with f32 masters, the activation applied to the product's rounded
/// values in f32 and rounded once more (what the two ops give, bit for bit), as one graph node:
/// the pre-activation is kept for the backward (as the activation's own node would keep it),
/// whose first pass is the activation's gradient and the rest [`HalfLinear`]'s.
pub(super) struct HalfLinearAct {
    form: Form,
    pre: Mutex<Option<Tensor>>,
}

impl HalfLinearAct {
    pub(super) fn new(form: Form) -> Self {
        Self {
            form,
            pre: Mutex::new(None),
        }
    }

    /// The activation of the product `z` (rows of `x`'s shape), keeping `z`.
    fn activate<T: GemmElem>(&self, z: Vec<T>, shape: &Shape) -> Result<CpuStorage> {
        let a = self.form.values(&z);
        let z = Tensor::from_vec(z, shape, &candle_core::Device::Cpu)?;
        *self
            .pre
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(z);
        Ok(WithDType::to_cpu_storage_owned(a))
    }

    /// The gradient of the pre-activation from the output's.
    fn pre_grad(&self, grad: &Tensor) -> Result<Tensor> {
        let pre = self
            .pre
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let Some(z) = pre else {
            candle_core::bail!("linear + activation: the backward ran before the forward")
        };
        input_grad(&z, grad, self.form)
    }
}

impl Epilogue for HalfLinearAct {
    fn finish<T: GemmElem>(&self, y: Vec<T>, shape: &Shape) -> Result<CpuStorage> {
        self.activate(y, shape)
    }
}

impl CustomOp2 for HalfLinearAct {
    fn name(&self) -> &'static str {
        "amp-half-linear-act"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        on_masters(self, (s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        HalfLinear::grads(x, w, &self.pre_grad(grad)?)
    }
}

impl CustomOp3 for HalfLinearAct {
    fn name(&self) -> &'static str {
        "amp-half-linear-bias-act"
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
        on_masters(self, (s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        HalfLinear::grads_with_bias(x, w, b, &self.pre_grad(grad)?)
    }
}
