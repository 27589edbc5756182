// The CUDA half of GradScaler's fused pass (PyTorch's _amp_foreach_non_finite_check_and_unscale_):
// every gradient of one dtype is multiplied by inv_scale in place, in ONE launch, and each
// gradient holding an inf or NaN after the multiplication (as stored) sets its flag in `found`.
//
// Compiled at run time by NVRTC (no CUDA toolkit needed to build the crate) after half.cuh,
// which converts half and bfloat16 values (they travel as 16-bit integers).
//
// Launch: one block per chunk. The host builds the chunk table: chunk c covers elements
// [chunk_start[c], min(chunk_start[c] + chunk, lens[t])) of gradient t = chunk_tensor[c], whose
// first element is at address ptrs[t]; flag_index[t] is t's slot in `found`.

#define AMP_CHUNK_PROLOGUE                                                   \
    const unsigned int c = blockIdx.x;                                       \
    const unsigned int t = chunk_tensor[c];                                  \
    const unsigned long long start = chunk_start[c];                         \
    const unsigned long long stop =                                          \
        start + chunk < lens[t] ? start + chunk : lens[t];                   \
    bool bad = false;

#define AMP_CHUNK_EPILOGUE                                                   \
    if (__syncthreads_or(bad) && threadIdx.x == 0) {                         \
        found[flag_index[t]] = 1u;                                           \
    }

#define AMP_UNSCALE_ARGS                                                     \
    const unsigned long long* ptrs, const unsigned long long* lens,         \
    const unsigned int* flag_index, const unsigned int* chunk_tensor,        \
    const unsigned long long* chunk_start, unsigned int chunk,               \
    float inv_scale, unsigned int* found

// f32 and f64 in place; the f64 kernel multiplies by the widened f32 inv_scale, as on CPU.
#define AMP_UNSCALE_FLOAT(NAME, T)                                           \
extern "C" __global__ void NAME(AMP_UNSCALE_ARGS) {                          \
    AMP_CHUNK_PROLOGUE                                                       \
    T* x = (T*)ptrs[t];                                                      \
    for (unsigned long long i = start + threadIdx.x; i < stop; i += blockDim.x) { \
        T v = x[i] * (T)inv_scale;                                           \
        x[i] = v;                                                            \
        bad |= !isfinite(v);                                                 \
    }                                                                        \
    AMP_CHUNK_EPILOGUE                                                       \
}

AMP_UNSCALE_FLOAT(amp_unscale_f32, float)
AMP_UNSCALE_FLOAT(amp_unscale_f64, double)

// f16 and bf16: computed in f32, rounded once.
#define AMP_UNSCALE_HALF(NAME, BF)                                           \
extern "C" __global__ void NAME(AMP_UNSCALE_ARGS) {                          \
    AMP_CHUNK_PROLOGUE                                                       \
    unsigned short* x = (unsigned short*)ptrs[t];                            \
    for (unsigned long long i = start + threadIdx.x; i < stop; i += blockDim.x) { \
        amp_store(x + i, amp_load(x + i, BF) * inv_scale, BF);               \
        bad |= !isfinite(amp_load(x + i, BF));                               \
    }                                                                        \
    AMP_CHUNK_EPILOGUE                                                       \
}

AMP_UNSCALE_HALF(amp_unscale_f16, false)
AMP_UNSCALE_HALF(amp_unscale_bf16, true)
