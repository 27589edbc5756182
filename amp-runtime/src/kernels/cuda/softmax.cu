// The CUDA half of kernels::softmax: softmax and log-softmax over the last dimension of an
// f32, f16 or bf16 array (dt 0, 1, 2; see half.cuh), read widened to f32 and written in f32,
// and their backward into the input's dtype. One block (a multiple of 32 threads) per row
// (grid-stride over rows); each row's maximum and sums reduced in f32 through warp shuffles
// and one shared slot per warp. The arithmetic is the CPU op's: `exp(x - max) / sum`, or
// `x - max - log(sum)`; a row with a NaN is NaN (fmaxf skips it, x - max does not); a row of
// -inf only is NaN, as on CPU. Compiled at run time by NVRTC after half.cuh.

// y[r, :] = softmax(x[r, :]) (log-softmax with `log`), `rows` rows of `n`.
extern "C" __global__ void amp_softmax(
    const void* x, float* y, int dt, int log, unsigned long long rows, unsigned long long n)
{
    __shared__ float slots[32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned long long at = r * n;
        float m = AMP_NEG_INF;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            m = fmaxf(m, amp_get(x, at + i, dt));
        }
        m = amp_block_reduce(m, 1, slots);
        float s = 0.0f;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            s += expf(amp_get(x, at + i, dt) - m);
        }
        s = amp_block_reduce(s, 0, slots);
        const float log_s = logf(s);
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = amp_get(x, at + i, dt) - m;
            y[at + i] = log ? v - log_s : expf(v) / s;
        }
    }
}

// The gradient of x from y (the forward's output) and dy, both f32, into dx in dt:
// softmax `y * (dy - sum(dy * y))`, log-softmax `dy - exp(y) * sum(dy)`.
extern "C" __global__ void amp_softmax_grad(
    const float* y, const float* dy, void* dx, int dt, int log, unsigned long long rows,
    unsigned long long n)
{
    __shared__ float slots[32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned long long at = r * n;
        float s = 0.0f;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            s += log ? dy[at + i] : dy[at + i] * y[at + i];
        }
        s = amp_block_reduce(s, 0, slots);
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float g = log ? dy[at + i] - expf(y[at + i]) * s : y[at + i] * (dy[at + i] - s);
            amp_put(dx, at + i, g, dt);
        }
    }
}
