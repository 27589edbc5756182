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
//! Every rank must reduce the gradients of the same parameters: the same model, built by the
//! same code (the gradients are listed in the order the model's constructor made its
//! parameters, as DDP lists `model.parameters()`, whatever order each rank's forward used them
//! in), the same parameters used. The reduction first compares each rank's count of tensors and values and
//! a fingerprint of their shapes and dtypes, and a mismatch is an error on every rank rather
//! than a wrong sum. Each gradient is divided by the world size before the sum (in f32, as
//! DDP's default hook does), so half gradients whose mean fits their range do not overflow. Start the replicas from
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
            // Each gradient divided by the world size before the sum, as PyTorch DDP's default
            // hook does: the division in f32 (f64 for f64 gradients), rounded once to the wire's
            // dtype, so that half gradients whose mean fits their range never overflow in the
            // sum (two ranks' f16 40000s made an infinite sum, then an infinite mean).
            let flat = bucket
                .iter()
                .map(|g| {
                    let wide = g.flatten_all()?.to_dtype(crate::kernels::wide(g.dtype()))?;
                    (wide / world as f64)?.to_dtype(dtype)
                })
                .collect::<Result<Vec<_>>>()?;
            let mean = self
                .collective
                .all_reduce(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)?;
            let mut offset = 0;
            for g in bucket.iter_mut() {
                let n = g.elem_count();
                *g = mean
                    .narrow(0, offset, n)?
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
            if !v.dtype().is_float() {
                v.set(&self.broadcast_integers(v.as_tensor())?)?;
                continue;
            }
            let mine = if self.collective.rank() == 0 {
                v.as_tensor().clone()
            } else {
                // -0.0, so that the sum is rank 0's value to the bit (x + -0.0 is x for every
                // x, -0.0 included; + 0.0 would turn rank 0's -0.0 into 0.0).
                v.as_tensor().zeros_like()?.neg()?
            };
            v.set(&self.collective.all_reduce(&mine, ReduceOp::Sum)?)?;
        }
        Ok(())
    }

    /// Rank 0's integer tensor on every rank, exactly: sent as two sums of 32-bit halves, each
    /// exact in the f64 a collective may reduce in (`ThreadGroup` does; 2^53 + 1 became 2^53).
    fn broadcast_integers(&self, t: &Tensor) -> Result<Tensor> {
        let values: Vec<i64> = if self.collective.rank() == 0 {
            t.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?
        } else {
            vec![0; t.elem_count()]
        };
        let (hi, lo): (Vec<f64>, Vec<f64>) = values
            .iter()
            .map(|&x| ((x >> 32) as f64, (x & 0xffff_ffff) as f64))
            .unzip();
        let sum = |half: Vec<f64>| -> Result<Vec<f64>> {
            let half = Tensor::from_vec(half, t.elem_count(), t.device())?;
            self.collective.all_reduce(&half, ReduceOp::Sum)?.to_vec1()
        };
        let joined: Vec<i64> = sum(hi)?
            .iter()
            .zip(sum(lo)?)
            .map(|(&hi, lo)| ((hi as i64) << 32) | lo as i64)
            .collect();
        Tensor::from_vec(joined, t.shape(), t.device())?.to_dtype(t.dtype())
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

    /// Every rank passes the same list of tensors: as many, of the same shapes and dtypes in
    /// the same order. A mismatch (a parameter without a gradient on one rank, another model,
    /// two parameters' shapes swapped) is an error on every rank, never a sum of unrelated
    /// values: the ranks compare the count, the total of values and a fingerprint of the
    /// shapes and dtypes (FNV-1a, sent as two exact 32-bit halves), PyTorch DDP's check of the
    /// parameters' shapes across ranks.
    fn check_same_gradients(&self, grads: &[Tensor]) -> Result<()> {
        let count = grads.len() as f64;
        // `+ 0.0`: the empty sum of f64 is -0.0, which a message would print as "-0".
        let values = grads.iter().map(|g| g.elem_count() as f64).sum::<f64>() + 0.0;
        // The reduction's settings too: ranks that bucket or send differently would reduce
        // different bytes (replicas drifting apart) or call different collectives.
        let settings = format!("{} {:?}", self.bucket_bytes, self.reduce_dtype);
        let print = fingerprint(grads, &settings);
        let (lo, hi) = (f64::from(print as u32), f64::from((print >> 32) as u32));
        let mine = Tensor::new(
            &[count, values, lo, hi, -count, -values, -lo, -hi],
            &candle_core::Device::Cpu,
        )?;
        let seen = self
            .collective
            .all_reduce(&mine, ReduceOp::Max)?
            .to_vec1::<f64>()?;
        let (max, min) = (&seen[..4], &seen[4..]);
        // Counts and 32-bit halves: integers an f64 holds exactly.
        #[allow(clippy::float_cmp)]
        let differ = max.iter().zip(min).any(|(a, b)| *a != -b);
        if differ {
            let dims: Vec<_> = grads
                .iter()
                .map(|g| format!("{:?} {:?}", g.dims(), g.dtype()))
                .collect();
            candle_core::bail!(
                "rank {}: the ranks reduce different gradients ({count} tensors of {values} \
                 values here, of shapes and dtypes {dims:?}, with bucket_bytes {} and \
                 reduce_dtype {:?}; between {} and {} tensors, {} and {} values across ranks, \
                 or other shapes, dtypes or settings): every rank must compute gradients of \
                 the same parameters, in the same order, under the same DataParallel settings",
                self.collective.rank(),
                self.bucket_bytes,
                self.reduce_dtype,
                -min[0],
                max[0],
                -min[1],
                max[1]
            );
        }
        Ok(())
    }
}

/// FNV-1a over each tensor's rank, dims and dtype, in order, then `settings`.
fn fingerprint(tensors: &[Tensor], settings: &str) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |v: u64| {
        for byte in v.to_le_bytes() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for t in tensors {
        eat(t.rank() as u64);
        t.dims().iter().for_each(|&d| eat(d as u64));
        t.dtype().as_str().bytes().for_each(|b| eat(u64::from(b)));
    }
    settings.bytes().for_each(|b| eat(u64::from(b)));
    hash
}

/// Whether any rank saw a non-finite gradient: `found` reduced by max over `collective`.
pub(crate) fn any_rank(collective: &dyn Collective, found: bool) -> Result<bool> {
    let mine = Tensor::new(&[f32::from(u8::from(found))], &candle_core::Device::Cpu)?;
    let any = collective
        .all_reduce(&mine, ReduceOp::Max)?
        .to_vec1::<f32>()?;
    Ok(any[0] > 0.0)
}
