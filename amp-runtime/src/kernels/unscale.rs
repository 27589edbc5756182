//! The fused gradient pass behind `GradScaler`: multiply every gradient by `inv_scale` in place
//! and record which gradients held a non-finite value (PyTorch's
//! `_amp_foreach_non_finite_check_and_unscale_`).
//!
//! [`unscale_in_place`] is the one entry point, whatever the device. On CPU it is one pass over
//! all gradients at once: the gradients' storages are borrowed together and their elements are
//! cut into chunks that the kernels' thread pool (`parallel`) processes, so a model with many small tensors
//! costs one parallel pass, not one candle op (and one host sync) per tensor. With the `cuda`
//! feature, CUDA gradients go through one kernel launch per dtype and device
//! (`kernels::cuda::unscale`), a strided one copied contiguous first; anything else takes the
//! per-tensor candle-ops path ([`naive_unscale`]).
//!
//! The check looks at each value *as written*, after scaling and rounding to the gradient's
//! dtype. PyTorch's kernel checks the value before scaling, which misses what the multiplication
//! itself produces: with an infinite `inv_scale` (a scale below 2^-128, reachable by backoff)
//! a zero gradient becomes NaN, and with `inv_scale > 1` a finite f16 gradient can overflow;
//! either would reach the optimizer as a finite step. Every non-finite input is still caught
//! (inf or NaN times a finite, nonzero `inv_scale` stays non-finite, and the scaler keeps the
//! scale a normal positive f32).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{CpuStorage, DType, Device, Layout, Result, Tensor};
use half::{bf16, f16};

use crate::kernels::borrow::{with_borrowed, Borrowed};
use crate::kernels::layout::{is_non_overlapping, strided_offsets};
use crate::kernels::parallel;

/// Elements per parallel work item: large enough to amortise scheduling, small enough to spread
/// one big gradient over every core.
const CHUNK: usize = 1 << 15;

/// How many storages are borrowed at once. Each borrowed storage is one nested `inplace_op1`
/// call, so this bounds the recursion depth; larger gradient sets take several passes.
const BATCH: usize = 128;

/// Multiplies every gradient by `inv_scale` in place and reports, per gradient, whether it held
/// a non-finite value (inf or NaN) before the multiplication.
///
/// Gradients are floating point (f32, f64, f16, bf16; half-precision values are scaled in f32
/// and rounded back, as PyTorch does). A gradient whose layout repeats elements (a broadcast) or
/// that shares its storage with an earlier gradient is first replaced by a private copy, so no
/// element is scaled twice; every other gradient is updated in its own storage, and so are
/// clones of it.
pub fn unscale_in_place(grads: &mut [Tensor], inv_scale: f32) -> Result<Vec<bool>> {
    let mut found = vec![false; grads.len()];
    let (cpu, other): (Vec<usize>, Vec<usize>) =
        (0..grads.len()).partition(|&i| grads[i].device().is_cpu());
    fused_batches(grads, &cpu, &mut found, |batch| {
        cpu_unscale(batch, inv_scale)
    })?;
    #[cfg(feature = "cuda")]
    let other = {
        // CUDA gradients, one device at a time, through the CUDA kernel; a strided one is
        // replaced by a contiguous copy first (the per-tensor path would read each back to
        // the host: a sync per gradient).
        let (cuda, other): (Vec<usize>, Vec<usize>) = other
            .into_iter()
            .partition(|&i| grads[i].device().is_cuda());
        for &i in &cuda {
            if !grads[i].is_contiguous() {
                grads[i] = grads[i].contiguous()?;
            }
        }
        let mut devices: Vec<candle_core::DeviceLocation> = Vec::new();
        for &i in &cuda {
            if !devices.contains(&grads[i].device().location()) {
                devices.push(grads[i].device().location());
            }
        }
        for location in devices {
            let on_device: Vec<usize> = cuda
                .iter()
                .copied()
                .filter(|&i| grads[i].device().location() == location)
                .collect();
            fused_batches(grads, &on_device, &mut found, |batch| {
                crate::kernels::cuda::unscale::unscale(batch, inv_scale)
            })?;
        }
        other
    };
    for i in other {
        let (scaled, flag) = naive_unscale_one(&grads[i], inv_scale)?;
        grads[i] = scaled;
        found[i] = flag;
    }
    Ok(found)
}

/// Runs a fused pass over `grads[indices]`, `BATCH` storages at a time, after making their
/// storages exclusive; writes each gradient's flag into `found`.
fn fused_batches(
    grads: &mut [Tensor],
    indices: &[usize],
    found: &mut [bool],
    mut pass: impl FnMut(&[Tensor]) -> Result<Vec<bool>>,
) -> Result<()> {
    if indices.is_empty() {
        return Ok(());
    }
    make_exclusive(grads, indices)?;
    let tensors: Vec<Tensor> = indices.iter().map(|&i| grads[i].clone()).collect();
    for (batch, indices) in tensors.chunks(BATCH).zip(indices.chunks(BATCH)) {
        for (&i, flag) in indices.iter().zip(pass(batch)?) {
            found[i] = flag;
        }
    }
    Ok(())
}

/// The same result built from candle ops, one gradient at a time: a finiteness probe (`g - g`
/// is zero exactly when every element is finite), a read back to the host, and a multiply into
/// a new tensor. This is what a loop over `GradStore` without the fused kernel costs; it is kept
/// as the reference for tests and the benchmark, and as the path for devices without a kernel.
pub fn naive_unscale(grads: &mut [Tensor], inv_scale: f32) -> Result<Vec<bool>> {
    grads
        .iter_mut()
        .map(|g| {
            let (scaled, found) = naive_unscale_one(g, inv_scale)?;
            *g = scaled;
            Ok(found)
        })
        .collect()
}

fn naive_unscale_one(g: &Tensor, inv_scale: f32) -> Result<(Tensor, bool)> {
    check_float(g.dtype())?;
    let scaled = match g.dtype() {
        DType::F64 => g.broadcast_mul(&Tensor::new(f64::from(inv_scale), g.device())?)?,
        dtype => g
            .to_dtype(DType::F32)?
            .broadcast_mul(&Tensor::new(inv_scale, g.device())?)?
            .to_dtype(dtype)?,
    };
    // x - x is 0 for finite x, NaN for inf and NaN.
    let probe = scaled
        .sub(&scaled)?
        .sum_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    Ok((scaled, probe != 0.0))
}

fn check_float(dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(()),
        other => Err(not_float(other)),
    }
}

fn not_float(dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "gradient unscale: gradients must be f32, f64, f16 or bf16, got {dtype:?}"
    ))
}

/// Replaces, among `grads[indices]`, every gradient that repeats elements or shares a storage
/// with an earlier one by a private copy.
fn make_exclusive(grads: &mut [Tensor], indices: &[usize]) -> Result<()> {
    let mut seen = HashSet::new();
    for &i in indices {
        check_float(grads[i].dtype())?;
        if !is_non_overlapping(grads[i].layout()) {
            grads[i] = grads[i].contiguous()?;
        }
        if !seen.insert(storage_address(&grads[i])) {
            grads[i] = grads[i].copy()?;
            seen.insert(storage_address(&grads[i]));
        }
    }
    Ok(())
}

/// The address of a tensor's storage: equal for tensors that share their data.
fn storage_address(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref(&*storage) as usize
}

/// A gradient's storage, borrowed mutably for the duration of a pass.
struct View {
    data: ViewData,
    layout: Layout,
}

/// Base pointer and length of a storage's element vector. Stored as addresses so that views can
/// cross into the pool's threads; every task touches a disjoint set of elements (see `cpu_unscale`).
#[derive(Clone, Copy)]
enum ViewData {
    F32(usize, usize),
    F64(usize, usize),
    F16(usize, usize),
    BF16(usize, usize),
}

impl ViewData {
    fn new(storage: &mut CpuStorage) -> Result<Self> {
        Ok(match storage {
            CpuStorage::F32(v) => Self::F32(v.as_mut_ptr() as usize, v.len()),
            CpuStorage::F64(v) => Self::F64(v.as_mut_ptr() as usize, v.len()),
            CpuStorage::F16(v) => Self::F16(v.as_mut_ptr() as usize, v.len()),
            CpuStorage::BF16(v) => Self::BF16(v.as_mut_ptr() as usize, v.len()),
            other => {
                return Err(not_float(candle_core::backend::BackendStorage::dtype(
                    other,
                )))
            }
        })
    }
}

impl Borrowed for View {
    fn cpu(
        storage: &mut CpuStorage,
        layout: &Layout,
        then: &mut dyn FnMut(Self) -> Result<()>,
    ) -> Result<()> {
        let data = ViewData::new(storage)?;
        then(View {
            data,
            layout: layout.clone(),
        })
    }
}

/// One parallel pass over a batch of CPU gradients with distinct, non-overlapping storages.
fn cpu_unscale(tensors: &[Tensor], inv_scale: f32) -> Result<Vec<bool>> {
    debug_assert!(tensors.iter().all(|t| matches!(t.device(), Device::Cpu)));
    let flags: Vec<AtomicBool> = tensors.iter().map(|_| AtomicBool::new(false)).collect();
    let mut body = |views: &[View]| -> Result<()> {
        let tasks = tasks(views);
        parallel::for_each_index(tasks.len(), |i| {
            let task = &tasks[i];
            // SAFETY: `views` are write-locked storages of distinct allocations (`make_exclusive`),
            // and the tasks of one view cover disjoint element ranges (contiguous chunks) or the
            // whole view (strided, with non-overlapping strides). Nothing else can access the
            // storages while the locks are held.
            let found = unsafe { task.run(&views[task.view], inv_scale) };
            if found {
                flags[task.view].store(true, Ordering::Relaxed);
            }
        });
        Ok(())
    };
    with_borrowed(tensors, &mut body)?;
    Ok(flags.into_iter().map(AtomicBool::into_inner).collect())
}

/// A unit of parallel work: a contiguous element range of one view, or a whole strided view.
struct Task {
    view: usize,
    range: Option<(usize, usize)>,
}

fn tasks(views: &[View]) -> Vec<Task> {
    let mut tasks = Vec::new();
    for (view, v) in views.iter().enumerate() {
        match v.layout.contiguous_offsets() {
            Some((start, end)) => {
                let mut lo = start;
                while lo < end {
                    let hi = (lo + CHUNK).min(end);
                    tasks.push(Task {
                        view,
                        range: Some((lo, hi)),
                    });
                    lo = hi;
                }
            }
            None => tasks.push(Task { view, range: None }),
        }
    }
    tasks
}

impl Task {
    /// Scales this task's elements; returns whether one was non-finite.
    ///
    /// # Safety
    /// The caller guarantees exclusive access to the elements this task covers.
    unsafe fn run(&self, view: &View, inv_scale: f32) -> bool {
        match view.data {
            // SAFETY: the view holds a storage of f32 elements at `ptr`; the caller's exclusivity.
            ViewData::F32(ptr, len) => unsafe {
                self.run_typed(ptr as *mut f32, len, &view.layout, inv_scale)
            },
            // SAFETY: the view holds a storage of f64 elements at `ptr`; the caller's exclusivity.
            ViewData::F64(ptr, len) => unsafe {
                self.run_typed(ptr as *mut f64, len, &view.layout, inv_scale)
            },
            // SAFETY: the view holds a storage of f16 elements at `ptr`; the caller's exclusivity.
            ViewData::F16(ptr, len) => unsafe {
                self.run_typed(ptr as *mut f16, len, &view.layout, inv_scale)
            },
            // SAFETY: the view holds a storage of bf16 elements at `ptr`; the caller's exclusivity.
            ViewData::BF16(ptr, len) => unsafe {
                self.run_typed(ptr as *mut bf16, len, &view.layout, inv_scale)
            },
        }
    }

    /// # Safety
    /// As [`Task::run`]; `ptr` and `len` describe the storage's element vector.
    unsafe fn run_typed<T: Element>(
        &self,
        ptr: *mut T,
        len: usize,
        layout: &Layout,
        inv_scale: f32,
    ) -> bool {
        let mut found = false;
        if let Some((lo, hi)) = self.range {
            assert!(lo <= hi && hi <= len, "unscale: chunk {lo}..{hi} of {len}");
            // SAFETY: `lo..hi` lies within the storage and belongs to this task alone.
            let xs = unsafe { std::slice::from_raw_parts_mut(ptr.add(lo), hi - lo) };
            for x in xs {
                found |= x.unscale(inv_scale);
            }
        } else {
            for offset in strided_offsets(layout) {
                assert!(offset < len, "unscale: offset {offset} of {len}");
                // SAFETY: the offset lies within the storage; non-overlapping strides make
                // each offset visited once, by this task alone.
                found |= unsafe { (*ptr.add(offset)).unscale(inv_scale) };
            }
        }
        found
    }
}

/// A gradient element type: scale in place, report whether the value written is non-finite.
trait Element: Copy {
    fn unscale(&mut self, inv_scale: f32) -> bool;
}

impl Element for f32 {
    #[inline]
    fn unscale(&mut self, inv_scale: f32) -> bool {
        *self *= inv_scale;
        // Exponent all ones: inf or NaN. A bit test vectorises where `is_finite` may not.
        self.to_bits() & 0x7f80_0000 == 0x7f80_0000
    }
}

impl Element for f64 {
    #[inline]
    fn unscale(&mut self, inv_scale: f32) -> bool {
        *self *= f64::from(inv_scale);
        self.to_bits() & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
    }
}

impl Element for f16 {
    #[inline]
    fn unscale(&mut self, inv_scale: f32) -> bool {
        *self = f16::from_f32(self.to_f32() * inv_scale);
        !self.is_finite()
    }
}

impl Element for bf16 {
    #[inline]
    fn unscale(&mut self, inv_scale: f32) -> bool {
        *self = bf16::from_f32(self.to_f32() * inv_scale);
        !self.is_finite()
    }
}
