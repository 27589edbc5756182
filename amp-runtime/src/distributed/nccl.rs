//! NCCL through cudarc (candle's `nccl` feature): one process per GPU, as candle's
//! multi-process llama example runs it. Rank 0 makes a unique id
//! ([`NcclCollective::unique_id`]) and hands its bytes to the other processes out of band (a
//! file, an environment variable); each process then joins with its rank and its device.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor,
};

use super::{Collective, ReduceOp};

/// One rank of an NCCL communicator, on one CUDA device.
pub struct NcclCollective {
    comm: Mutex<SendComm>,
    device: Device,
    rank: usize,
    world_size: usize,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// The communicator, used by one call at a time (under [`NcclCollective`]'s lock).
struct SendComm(Comm);

// SAFETY: NCCL lets a communicator be used from any thread as long as calls on it do not run
// concurrently; every use is under the `Mutex` of the one `NcclCollective` that owns it, and
// its stream belongs to the CUDA context cudarc binds on each call.
unsafe impl Send for SendComm {}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL {what}: {e:?}"))
}

impl NcclCollective {
    /// A new communicator id, on rank 0: pass its bytes to every rank's [`new`](Self::new).
    pub fn unique_id() -> Result<Vec<u8>> {
        let id = Id::new().map_err(|e| nccl_error("id", e))?;
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    }

    /// Joins the communicator `id` (from [`unique_id`](Self::unique_id)) as `rank` of
    /// `world_size`, on the CUDA device `device`; every rank must call it (NCCL waits for all).
    pub fn new(device: &Device, rank: usize, world_size: usize, id: &[u8]) -> Result<Self> {
        if rank >= world_size {
            candle_core::bail!("NcclCollective: rank {rank} is not below world size {world_size}");
        }
        let bytes: [u8; 128] = id.try_into().map_err(|_| {
            candle_core::Error::Msg(format!(
                "NcclCollective: an id is 128 bytes (from NcclCollective::unique_id), got {}",
                id.len()
            ))
        })?;
        let stream = device.as_cuda_device()?.cuda_stream();
        let id = Id::uninit(bytes.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(stream, rank, world_size, id)
            .map_err(|e| nccl_error("communicator", e))?;
        Ok(Self {
            comm: Mutex::new(SendComm(comm)),
            device: device.clone(),
            rank,
            world_size,
        })
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let on_gpu = t.to_device(&self.device)?.contiguous()?;
        let out = on_gpu.apply_op1_no_bwd(&AllReduce { of: self, op })?;
        out.to_device(t.device())
    }
}

/// The all-reduce as an op on the tensor's CUDA storage.
struct AllReduce<'a> {
    of: &'a NcclCollective,
    op: ReduceOp,
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "amp-nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the NCCL all-reduce runs on CUDA tensors")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let comm = self
            .of
            .comm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let op = match self.op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Max => NcclOp::Max,
        };
        let dev = s.device().clone();
        let (start, n) = (l.start_offset(), l.shape().elem_count());
        macro_rules! reduce {
            ($t:ty) => {{
                let src = s.as_cuda_slice::<$t>()?.slice(start..start + n);
                // SAFETY: NCCL writes all `n` values before any read of `dst`.
                let mut dst = unsafe { dev.alloc::<$t>(n) }?;
                comm.0
                    .all_reduce(&src, &mut dst, &op)
                    .map_err(|e| nccl_error("all-reduce", e))?;
                CudaStorage::wrap_cuda_slice(dst, dev.clone())
            }};
        }
        let out = match s.dtype() {
            DType::F32 => reduce!(f32),
            DType::F64 => reduce!(f64),
            DType::F16 => reduce!(half::f16),
            DType::BF16 => reduce!(half::bf16),
            other => candle_core::bail!("the NCCL all-reduce takes float tensors, got {other:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}
