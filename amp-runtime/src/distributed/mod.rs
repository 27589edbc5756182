//! Data-parallel training: PyTorch's `DistributedDataParallel` gradient averaging and the
//! `GradScaler`'s agreement on skipped steps, over a [`Collective`].
//!
//! Each rank (a thread, or a process per GPU) holds a replica of the model, computes the
//! gradients of its own part of the batch, and before the optimizer step replaces them by
//! their mean over the ranks: [`DataParallel::all_reduce`] (`ScaledGrads::all_reduce`,
//! `UnscaledGrads::all_reduce` call it), in buckets of about 25 MiB as DDP's `bucket_cap_mb`,
//! in the gradients' dtype or one you pick (`reduce_dtype`, as DDP's fp16/bf16 compression
//! hooks). With a collective given to the [`GradScaler`](crate::GradScaler)
//! (`GradScaler::builder().collective(..)`), each rank's found-inf is reduced by max, so that
//! every rank skips or steps together, as PyTorch's scaler does under DDP.
//!
//! Implementations:
//! - [`ThreadGroup`]: ranks as threads of one process (any device; the reduction on the host in
//!   f64, in rank order, so every rank gets the same bits). For tests and CPU training.
//! - `NcclCollective` (feature `nccl`): NCCL through cudarc, one process per GPU as candle's
//!   multi-process example runs it.
//!
//! Every rank must reduce the same gradients in the same order (the same model, the same
//! parameters used): the reduction first compares each rank's count of tensors and values,
//! and a mismatch is an error on every rank rather than a wrong sum. Start the replicas from
//! the same weights: [`DataParallel::broadcast`] copies rank 0's into every rank (DDP does it
//! at construction).

mod threads;

#[cfg(feature = "nccl")]
mod nccl;

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, Var};

#[cfg(feature = "nccl")]
pub use nccl::NcclCollective;
pub use threads::{ThreadCollective, ThreadGroup};

/// How a collective combines the ranks' values, element by element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// A group of ranks that combine tensors: each rank calls the same collectives in the same
/// order with tensors of one shape and dtype, and each gets the result.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn world_size(&self) -> usize;
    /// `op` over every rank's `t`, element by element, in `t`'s dtype and on its device.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
}

/// Gradient averaging over a [`Collective`], bucketed (see the module's documentation).
#[derive(Clone, Debug)]
pub struct DataParallel {
    collective: Arc<dyn Collective>,
    bucket_bytes: usize,
    reduce_dtype: Option<DType>,
}

impl DataParallel {
    /// Averaging over `collective` in buckets of 25 MiB (DDP's default `bucket_cap_mb`), in the
    /// gradients' own dtype.
    pub fn new(collective: Arc<dyn Collective>) -> Self {
        Self {
            collective,
            bucket_bytes: 25 << 20,
            reduce_dtype: None,
        }
    }

    /// The most bytes (in the reduction's dtype) one all-reduce carries; a gradient larger than
    /// that goes alone. Must be at least 1.
    pub fn bucket_bytes(mut self, bytes: usize) -> Result<Self> {
        if bytes == 0 {
            candle_core::bail!("DataParallel::bucket_bytes must be at least 1");
        }
        self.bucket_bytes = bytes;
        Ok(self)
    }

    /// Communicates the gradients in `dtype` (f32, f16 or bf16) and casts the mean back to
    /// each gradient's dtype: PyTorch's `fp16_compress_hook`/`bf16_compress_hook` with a half
    /// dtype, half the bytes on the wire and the sum rounded to it.
    pub fn reduce_dtype(mut self, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            candle_core::bail!(
                "DataParallel::reduce_dtype must be f32, f16 or bf16, got {dtype:?}"
            );
        }
        self.reduce_dtype = Some(dtype);
        Ok(self)
    }

    /// The collective the averaging runs on (for the scaler's builder).
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.collective
    }

    /// Replaces each of `grads` by its mean over the ranks (same shape and dtype); the ranks
    /// must pass the same gradients in the same order.
    pub fn all_reduce(&self, grads: &mut [Tensor]) -> Result<()> {
        if let Some(g) = grads.iter().find(|g| !g.dtype().is_float()) {
            candle_core::bail!(
                "DataParallel::all_reduce averages float gradients, got a {:?} tensor {:?}",
                g.dtype(),
                g.dims()
            );
        }
        self.check_same_gradients(grads)?;
        let world = self.collective.world_size();
        let mut start = 0;
        while start < grads.len() {
            let end = self.bucket_end(grads, start);
            let bucket = &mut grads[start..end];
            let dtype = self.reduce_dtype.unwrap_or(bucket[0].dtype());
            let flat = bucket
                .iter()
                .map(|g| g.flatten_all()?.to_dtype(dtype))
                .collect::<Result<Vec<_>>>()?;
            let summed = self
                .collective
                .all_reduce(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)?;
            let mut offset = 0;
            for g in bucket.iter_mut() {
                let n = g.elem_count();
                // The mean in f32 (f64 for f64 gradients), rounded once to the gradient's dtype.
                let wide = crate::kernels::wide(g.dtype());
                let part = summed.narrow(0, offset, n)?.to_dtype(wide)?;
                *g = (part / world as f64)?
                    .to_dtype(g.dtype())?
                    .reshape(g.shape())?;
                offset += n;
            }
            start = end;
        }
        Ok(())
    }

    /// Sets every variable to rank 0's value (DDP's broadcast of the parameters at
    /// construction), so that the replicas start from the same weights.
    pub fn broadcast(&self, vars: &[Var]) -> Result<()> {
        let values: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        self.check_same_gradients(&values)?;
        for v in vars {
            let mine = if self.collective.rank() == 0 {
                v.as_tensor().clone()
            } else {
                v.as_tensor().zeros_like()?
            };
            v.set(&self.collective.all_reduce(&mine, ReduceOp::Sum)?)?;
        }
        Ok(())
    }

    /// The end of the bucket that starts at `start`: gradients of one dtype, at most
    /// `bucket_bytes` in the reduction's dtype (at least one gradient).
    fn bucket_end(&self, grads: &[Tensor], start: usize) -> usize {
        let dtype = grads[start].dtype();
        let size = |g: &Tensor| g.elem_count() * self.reduce_dtype.unwrap_or(dtype).size_in_bytes();
        let mut bytes = size(&grads[start]);
        let mut end = start + 1;
        while end < grads.len()
            && grads[end].dtype() == dtype
            && bytes + size(&grads[end]) <= self.bucket_bytes
        {
            bytes += size(&grads[end]);
            end += 1;
        }
        end
    }

    /// Every rank passes as many tensors of as many values: a mismatch (a parameter without a
    /// gradient on one rank, another model) is an error on every rank, never a sum of
    /// unrelated values.
    fn check_same_gradients(&self, grads: &[Tensor]) -> Result<()> {
        let count = grads.len() as f64;
        let values = grads.iter().map(|g| g.elem_count() as f64).sum::<f64>();
        let mine = Tensor::new(&[count, values, -count, -values], &candle_core::Device::Cpu)?;
        let seen = self
            .collective
            .all_reduce(&mine, ReduceOp::Max)?
            .to_vec1::<f64>()?;
        let (max, min) = ((seen[0], seen[1]), (-seen[2], -seen[3]));
        if max != min {
            candle_core::bail!(
                "rank {}: the ranks reduce different gradients ({count} tensors of {values} \
                 values here; between {} and {} tensors, {} and {} values across ranks): every \
                 rank must compute gradients of the same parameters",
                self.collective.rank(),
                min.0,
                max.0,
                min.1,
                max.1
            );
        }
        Ok(())
    }
}

/// Whether any rank saw a non-finite gradient: `found` reduced by max over `collective`.
pub(crate) fn any_rank(collective: &dyn Collective, found: bool) -> Result<bool> {
    let mine = Tensor::new(&[f32::from(u8::from(found))], &candle_core::Device::Cpu)?;
    let any = collective
        .all_reduce(&mine, ReduceOp::Max)?
        .to_vec1::<f32>()?;
    Ok(any[0] > 0.0)
}
