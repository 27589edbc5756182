//! The CUDA side of the attention op: its products of half operands with an f32 output
//! ([`products_nt_f32`], cuBLAS), and the launch of the probabilities step (`attention.cu`):
//! from the scores of the first product to the probabilities the second reads, or, in the
//! backward, from the scores and the probabilities' gradient to the scores' gradient. One block
//! per row.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result::gemm_strided_batched_ex, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

use super::{address, alloc, block_per_row, code, out_address, Module};

/// The attention kernel (`attention.cu`).
pub(crate) static ATTENTION: Module =
    Module::new("candle_amp_attention", include_str!("attention.cu"), &[]);

/// The f32 additive mask of one call: its storage, and the element offset and four strides
/// (0 where it broadcasts) of its `(b, h, t_q, t_k)` view.
pub(crate) struct MaskView<'a> {
    pub storage: &'a CudaStorage,
    pub start: usize,
    pub strides: [usize; 4],
}

/// What the kernel computes and the geometry of its rows: `rows = b * h * tq` rows of `tk`
/// scores, query `r % tq` of head `r / tq`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub tq: usize,
    pub tk: usize,
    pub heads: usize,
    pub scale: f32,
    pub causal: bool,
}

/// `a (batches, m, k) * b (batches, n, k)^T` as f32 `(batches, m, n)`, for f16 or bf16 `a` and
/// `b` of one dtype, contiguous from element `a0` and `b0`: cuBLAS with f32 accumulation and an
/// f32 output, so the attention's scores are never rounded to half (candle's matmul writes the
/// operands' dtype).
pub(crate) fn products_nt_f32(
    (a, a0): (&CudaStorage, usize),
    (b, b0): (&CudaStorage, usize),
    (batches, m, n, k): (usize, usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = &a.device;
    let mut out = alloc(dev, DType::F32, batches * m * n)?;
    if batches * m * n == 0 {
        return Ok(out);
    }
    let ty = match (a.dtype(), b.dtype()) {
        (DType::F16, DType::F16) => sys::cudaDataType_t::CUDA_R_16F,
        (DType::BF16, DType::BF16) => sys::cudaDataType_t::CUDA_R_16BF,
        (x, y) => {
            candle_core::bail!("attention products: f16 or bf16 of one dtype, got {x:?}, {y:?}")
        }
    };
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| {
            candle_core::Error::Msg(format!("attention products: {v} is too large for cuBLAS"))
        })
    };
    let (mi, ni, ki, bi) = (int(m)?, int(n)?, int(k)?, int(batches)?);
    let stream = dev.cuda_stream();
    let (ap, _a_guard) = address(
        a,
        &Layout::contiguous_with_offset(batches * m * k, a0),
        &stream,
    )?;
    let (bp, _b_guard) = address(
        b,
        &Layout::contiguous_with_offset(batches * n * k, b0),
        &stream,
    )?;
    let (cp, out_guard) = out_address(&mut out, &stream);
    let blas = dev.cublas_handle();
    let (alpha, beta) = (1f32, 0f32);
    // Row-major C = A B^T is column-major C^T = B^T^T A^T: cuBLAS's (m, n, k) = (n, m, k), its
    // first operand `b` transposed (ld k), its second `a` as it is (ld k), C with ld n.
    // SAFETY: `bp`, `ap` and `cp` address `batches * n * k`, `batches * m * k` (of dtype `ty`)
    // and `batches * m * n` f32 values (freshly allocated), each held for the call, which runs
    // on the device's stream (the handle's); alpha and beta are f32, as COMPUTE_32F takes them.
    unsafe {
        gemm_strided_batched_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            std::ptr::from_ref(&alpha).cast(),
            bp as *const std::ffi::c_void,
            ty,
            ki,
            (n * k) as i64,
            ap as *const std::ffi::c_void,
            ty,
            ki,
            (m * k) as i64,
            std::ptr::from_ref(&beta).cast(),
            cp as *mut std::ffi::c_void,
            sys::cudaDataType_t::CUDA_R_32F,
            ni,
            (m * n) as i64,
            bi,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("attention products: cuBLAS {e:?}")))?;
    drop(out_guard);
    Ok(out)
}

/// The probabilities of contiguous scores `s` (`dp` absent), or the scores' gradient from the
/// probabilities' gradient `dp` (contiguous, of `s`'s dtype and shape), in `dtype`.
pub(crate) fn probs(
    (s, ls): (&CudaStorage, &Layout),
    dp: Option<(&CudaStorage, &Layout)>,
    mask: Option<&MaskView>,
    g: Rows,
    dtype: DType,
) -> Result<CudaStorage> {
    let dev = &s.device;
    let n = ls.shape().elem_count();
    let mut out = alloc(dev, dtype, n)?;
    let rows = n.checked_div(g.tk).unwrap_or(0) as u64;
    if rows == 0 {
        return Ok(out);
    }
    let stream = dev.cuda_stream();
    let (dts, dt) = (code(s.dtype())?, code(dtype)?);
    let (sp, _s_guard) = address(s, ls, &stream)?;
    let (dpp, _dp_guard) = super::address_like(dp, s, ls, &stream)?;
    let grad = i32::from(dp.is_some());
    let (mp, _m_guard, [m0, m1, m2, m3]) = match mask {
        Some(m) => {
            let Ok(slice) = m.storage.as_cuda_slice::<f32>() else {
                candle_core::bail!("attention kernel: the mask must be f32")
            };
            let (base, guard) = slice.device_ptr(&stream);
            let p = base + (m.start * std::mem::size_of::<f32>()) as u64;
            (p, Some(guard), m.strides.map(|s| s as u64))
        }
        None => (0, None, [0; 4]),
    };
    let (outp, out_guard) = out_address(&mut out, &stream);
    let (scale, causal) = (g.scale, i32::from(g.causal));
    let (tq, tk, heads) = (g.tq as u64, g.tk as u64, g.heads as u64);
    let func =
        dev.get_or_load_custom_func("amp_attention_probs", ATTENTION.name, ATTENTION.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&sp);
    builder.arg(&mp);
    builder.arg(&dpp);
    builder.arg(&outp);
    builder.arg(&dts);
    builder.arg(&dt);
    builder.arg(&grad);
    builder.arg(&scale);
    builder.arg(&causal);
    builder.arg(&rows);
    builder.arg(&tq);
    builder.arg(&tk);
    builder.arg(&heads);
    builder.arg(&m0);
    builder.arg(&m1);
    builder.arg(&m2);
    builder.arg(&m3);
    // Threads: the row's length rounded up to whole warps, at most 256.
    let threads = u32::try_from(g.tk.div_ceil(32).clamp(1, 8) * 32).expect("at most 256");
    // SAFETY: the arguments match `amp_attention_probs`; `sp` (and `dpp` when `grad`) address
    // `rows * tk` values of dtype `dts`, `outp` as many of `dt` (freshly allocated), `mp` (when not 0)
    // the mask's view whose strides the caller took from its layout; each held for the launch.
    unsafe { builder.launch(block_per_row(rows, threads)) }.w()?;
    drop(out_guard);
    Ok(out)
}
