// The CUDA half of kernels::layer_norm: layer norm over the last dimension of an f32, f16 or
// bf16 array (dt 0, 1, 2; see half.cuh), read widened to f32, with f32 scale and shift, the
// output in f32; and its backward, the input's gradient per row and the scale's and shift's
// summed down the rows, all f32. The arithmetic is the CPU op's: the mean, then the biased
// variance of the centred values, `rstd = 1 / sqrt(var + eps)`; backward `g = dy * w`,
// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dw = sum dy * xhat`, `db = sum dy`.
// One block (a multiple of 32 threads) per row, reductions through warp shuffles and one
// shared slot per warp. With `rms` the same op is RMS norm: the mean taken as 0 (no centring)
// and no mean(g) term in dx. Compiled at run time by NVRTC after half.cuh.

// Row `at..at + n`'s mean (0 with `rms`) and 1 / sqrt(var + eps), in every thread.
__device__ __forceinline__ void amp_ln_moments(
    const void* x, unsigned long long at, unsigned long long n, int dt, float eps, int rms,
    float* slots, float* mean, float* rstd)
{
    float s = 0.0f;
    for (unsigned long long i = threadIdx.x; i < n && !rms; i += blockDim.x) {
        s += amp_get(x, at + i, dt);
    }
    const float m = rms ? 0.0f : amp_block_reduce(s, 0, slots) / (float)n;
    float q = 0.0f;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        const float c = amp_get(x, at + i, dt) - m;
        q += c * c;
    }
    *mean = m;
    const float var = amp_block_reduce(q, 0, slots) / (float)n;
    // A row of finite values whose variance overflows f32 (deviations near 3e38, from bf16
    // activations): 1 / sqrt(inf) would be 0 and every output the shift, finite and unseen by
    // the gradient scaler. NaN instead, as PyTorch gives (the CPU op takes such a row's moments
    // in f64).
    *rstd = var > 3.4028235e38f ? __int_as_float(0x7fc00000) : 1.0f / sqrtf(var + eps);
}

// y = (x - mean) * rstd * w + b per row.
extern "C" __global__ void amp_layer_norm(
    const void* x, const float* w, const float* b, float* y, int dt, float eps, int rms,
    unsigned long long rows, unsigned long long n)
{
    __shared__ float slots[32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned long long at = r * n;
        float mean, rstd;
        amp_ln_moments(x, at, n, dt, eps, rms, slots, &mean, &rstd);
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            y[at + i] = (amp_get(x, at + i, dt) - mean) * rstd * w[i] + b[i];
        }
    }
}

// dx per row into out[0 .. rows * n], and each row's mean and rstd into stats[2r], stats[2r+1].
extern "C" __global__ void amp_layer_norm_grad_rows(
    const void* x, const float* w, const float* dy, float* out, float* stats, int dt, float eps,
    int rms, unsigned long long rows, unsigned long long n)
{
    __shared__ float slots[32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned long long at = r * n;
        float mean, rstd;
        amp_ln_moments(x, at, n, dt, eps, rms, slots, &mean, &rstd);
        float sg = 0.0f, sgx = 0.0f;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float g = dy[at + i] * w[i];
            sg += g;
            sgx += g * (amp_get(x, at + i, dt) - mean) * rstd;
        }
        const float sum_g = amp_block_reduce(sg, 0, slots);
        const float mean_g = rms ? 0.0f : sum_g / (float)n;
        const float mean_gx = amp_block_reduce(sgx, 0, slots) / (float)n;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float xhat = (amp_get(x, at + i, dt) - mean) * rstd;
            out[at + i] = rstd * (dy[at + i] * w[i] - mean_g - xhat * mean_gx);
        }
        if (threadIdx.x == 0) {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }
}

// dw[j] = sum over rows of dy * xhat, db[j] = sum over rows of dy: one thread per column
// (adjacent threads read adjacent columns of a row), rows in order.
extern "C" __global__ void amp_layer_norm_grad_cols(
    const void* x, const float* dy, const float* stats, float* dw, float* db, int dt,
    unsigned long long rows, unsigned long long n)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long j = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; j < n;
         j += stride) {
        float sw = 0.0f, sb = 0.0f;
        for (unsigned long long r = 0; r < rows; ++r) {
            const float d = dy[r * n + j];
            sw += d * (amp_get(x, r * n + j, dt) - stats[2 * r]) * stats[2 * r + 1];
            sb += d;
        }
        dw[j] = sw;
        db[j] = sb;
    }
}
