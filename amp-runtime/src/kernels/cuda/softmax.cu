// The CUDA half of kernels::softmax: softmax and log-softmax over the last dimension of an
// f32, f16 or bf16 array (dt 0, 1, 2; see half.cuh), read widened to f32 and written in f32,
// and their backward into the input's dtype. One block (a multiple of 32 threads) per row
// (grid-stride over rows); each row's maximum and sums reduced in f32 through warp shuffles
// and one shared slot per warp. The arithmetic is the CPU op's: `exp(x - max) / sum`, or
// `x - max - log(sum)`; a row with a NaN is NaN (fmaxf skips it, x - max does not); a row of
// -inf only is NaN, as on CPU. Compiled at run time by NVRTC after half.cuh.

#define AMP_NEG_INF __int_as_float(0xff800000)

// The block's sum (op 0) or maximum (op 1) of `v`, in every thread.
__device__ __forceinline__ float amp_sm_reduce(float v, int op, float* slots) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, offset);
        v = op == 0 ? v + o : fmaxf(v, o);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads(); // the slots' previous use is over
    if (lane == 0) {
        slots[warp] = v;
    }
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? slots[lane] : (op == 0 ? 0.0f : AMP_NEG_INF);
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, offset);
        v = op == 0 ? v + o : fmaxf(v, o);
    }
    return v;
}

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
        m = amp_sm_reduce(m, 1, slots);
        float s = 0.0f;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            s += expf(amp_get(x, at + i, dt) - m);
        }
        s = amp_sm_reduce(s, 0, slots);
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
        s = amp_sm_reduce(s, 0, slots);
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            const float g = log ? dy[at + i] - expf(y[at + i]) * s : y[at + i] * (dy[at + i] - s);
            amp_put(dx, at + i, g, dt);
        }
    }
}
