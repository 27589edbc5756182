//! Embedding lookup on CPU as one op whose backward writes the table's gradient once.
//!
//! candle's `index_select` backward stores the table's gradient as `zeros_like(table)` and then
//! `index_add` into it, which copies the whole zero table before adding the rows: two passes
//! over a table that can hold tens of millions of values (GPT-2's is 38.6M), per step. This op
//! writes the zero table once and adds the rows into it in place, in the ids' order (as
//! candle's `index_add` does, so the sums are the same to the bit), and hands the result to the
//! scaler's backward directly when one is running (`leaf_grads`).

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor,
};

/// The rows `ids` (integers, flattened) of `table` `(vocab, hidden)`: this op for an f32 table
/// on CPU, [`index_select`] otherwise.
pub(crate) fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    check_ids("embedding", ids)?;
    let ids = ids.flatten_all()?;
    if table.device().is_cpu() && table.dtype() == DType::F32 && table.rank() == 2 {
        table.apply_op2(&ids, Lookup)
    } else {
        index_select(table, &ids, 0)
    }
}

/// Ids must be integers: candle's `index_select` on float ids names the wrong operand's dtype
/// in its error ("unsupported dtype F32 for op index-select" for f16 ids).
pub(crate) fn check_ids(op: &str, ids: &Tensor) -> Result<()> {
    if matches!(ids.dtype(), DType::U8 | DType::U32 | DType::I64) {
        Ok(())
    } else {
        candle_core::bail!(
            "{op}: the ids must be integers (u8, u32 or i64), got {:?}; ids select rows and are \
             never cast",
            ids.dtype()
        )
    }
}

/// `x.index_select(ids, dim)` as PyTorch's: the ids checked ([`check_ids`]; on the CPU each one
/// in `0..size`: candle reads a dtype's largest value, `u8` 255 or `u32::MAX`, as "no row" and
/// gives zeros, and a negative `i64` as a huge index), a rank-0 id taken as one, `x`
/// made contiguous (candle's CPU kernel refuses a view), and a half `x` that tracks a gradient
/// selected through f32, so that the gradients of repeated ids are summed in f32 (candle's
/// `index_add` in bf16 stops counting at 256 ones), then rounded once.
pub(crate) fn index_select(x: &Tensor, ids: &Tensor, dim: usize) -> Result<Tensor> {
    check_ids("index_select", ids)?;
    let size = x.dim(dim)?;
    if let Some(id) = id_outside(ids, size)? {
        candle_core::bail!(
            "index_select: id {id} is out of range for dimension {dim} of size {size} of {:?}",
            x.dims()
        )
    }
    let ids = candle_ids(ids)?;
    let ids = if ids.rank() == 0 {
        ids.unsqueeze(0)?
    } else {
        ids
    };
    let x = x.contiguous()?;
    if matches!(x.dtype(), DType::F16 | DType::BF16) && x.track_op() {
        x.to_dtype(DType::F32)?
            .index_select(&ids, dim)?
            .to_dtype(x.dtype())
    } else {
        x.index_select(&ids, dim)
    }
}

/// Integer ids as candle's gathering kernels (`index_select`, `gather`, `embedding`) read them
/// right: `u8` ids widened to `u32`, since those kernels take a dtype's largest value for a
/// "no row" marker and give zeros for it, and 255 is a valid `u8` id (a byte-level model's last
/// class). `u32::MAX` and negative `i64` ids are never valid rows; [`id_outside`] finds them.
pub(crate) fn candle_ids(ids: &Tensor) -> Result<Tensor> {
    if ids.dtype() == DType::U8 {
        ids.to_dtype(DType::U32)
    } else {
        Ok(ids.clone())
    }
}

/// The first of the integer `ids` outside `0..size`, read where the ids are on the CPU; on a
/// GPU that read would stop the step, and there the ids go to the op as they are (`None`).
pub(crate) fn id_outside(ids: &Tensor, size: usize) -> Result<Option<i64>> {
    if !ids.device().is_cpu() {
        return Ok(None);
    }
    Ok(ids
        .to_dtype(DType::I64)?
        .flatten_all()?
        .to_vec1::<i64>()?
        .into_iter()
        .find(|&id| usize::try_from(id).map_or(true, |id| id >= size)))
}

struct Lookup;

/// The ids as row numbers, checked against the vocabulary.
fn rows(ids: &CpuStorage, l: &Layout, vocab: usize) -> Result<Vec<usize>> {
    fn checked<T: Copy + TryInto<usize>>(v: &[T], l: &Layout, vocab: usize) -> Result<Vec<usize>> {
        crate::kernels::layout::elements(v, l)
            .iter()
            .map(|&x| match x.try_into() {
                Ok(r) if r < vocab => Ok(r),
                _ => candle_core::bail!("embedding: an id is outside the vocabulary of {vocab}"),
            })
            .collect()
    }
    match ids {
        CpuStorage::U8(v) => checked(v, l, vocab),
        CpuStorage::U32(v) => checked(v, l, vocab),
        CpuStorage::I64(v) => checked(v, l, vocab),
        other => candle_core::bail!("embedding: ids must be integers, got {:?}", other.dtype()),
    }
}

fn f32_table<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => crate::kernels::layout::contiguous(v, l, "embedding"),
        other => candle_core::bail!("embedding: table must be f32, got {:?}", other.dtype()),
    }
}

impl CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "amp-embedding"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (vocab, hidden) = (l1.dims()[0], l1.dims()[1]);
        let table = f32_table(s1, l1)?;
        let rows = rows(s2, l2, vocab)?;
        let mut out = Vec::with_capacity(rows.len() * hidden);
        for r in &rows {
            out.extend_from_slice(&table[r * hidden..][..hidden]);
        }
        Ok((CpuStorage::F32(out), Shape::from((rows.len(), hidden))))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_table = crate::kernels::leaf_grads::offer(table, || {
            grad.apply_op2_no_bwd(ids, &Scatter(table.dims2()?.0))
        })?;
        Ok((grad_table, None))
    }
}

/// `grad (n, hidden), ids (n) -> (vocab, hidden)`: row `ids[i]` gets `grad[i]` added, in order.
struct Scatter(usize);

impl CustomOp2 for Scatter {
    fn name(&self) -> &'static str {
        "amp-embedding-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (vocab, hidden) = (self.0, l1.dims()[1]);
        let grad = match s1 {
            CpuStorage::F32(v) => crate::kernels::layout::elements(v, l1),
            other => candle_core::bail!("embedding grad: expected f32, got {:?}", other.dtype()),
        };
        let rows = rows(s2, l2, vocab)?;
        let mut table = vec![0f32; vocab * hidden];
        for (i, &r) in rows.iter().enumerate() {
            let dst = &mut table[r * hidden..][..hidden];
            for (d, &g) in dst.iter_mut().zip(&grad[i * hidden..][..hidden]) {
                *d += g;
            }
        }
        Ok((CpuStorage::F32(table), Shape::from((vocab, hidden))))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// The lookup and the table's gradient equal candle's `index_select` and its backward to the
    /// bit, with repeated ids, for every integer dtype; a bad id is an error.
    #[test]
    fn matches_index_select_and_its_gradient() -> Result<()> {
        let dev = Device::Cpu;
        let values: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let table = Var::from_vec(values, (10, 5), &dev)?;
        let weights = Tensor::new(&[0.3f32, -1.7, 2.5, 0.1, 1e-3, 7.0], &dev)?.reshape((6, 1))?;
        for dtype in [DType::U8, DType::U32, DType::I64] {
            let ids = Tensor::new(&[3u32, 7, 3, 0, 9, 3], &dev)?.to_dtype(dtype)?;
            let ours = embedding(&table, &ids)?;
            let theirs = table.index_select(&ids, 0)?;
            assert_eq!(ours.to_vec2::<f32>()?, theirs.to_vec2::<f32>()?);
            let g_ours = ours.broadcast_mul(&weights)?.sum_all()?.backward()?;
            let g_theirs = theirs.broadcast_mul(&weights)?.sum_all()?.backward()?;
            let bits = |g: &candle_core::backprop::GradStore| -> Result<Vec<u32>> {
                Ok(g.get(&table)
                    .expect("a gradient")
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect())
            };
            assert_eq!(bits(&g_ours)?, bits(&g_theirs)?, "{dtype:?}");
        }
        let bad = Tensor::new(&[10u32], &dev)?;
        assert!(embedding(&table, &bad).is_err());
        Ok(())
    }
}
