// The CUDA half of kernels::attention's fused op: the step between its two cuBLAS products.
// The scores `s` are `rows` rows of `tk` values in dtype dts (0 f32, 1 f16, 2 bf16; see
// half.cuh: f32 from the half products' f32 output), row r holding query i = r % tq of head
// n = r / tq (heads in (batch, head) order); `out` is written in dtype dt.
// Each score is widened to f32, scaled, given the f32 additive mask (element
// `(n / heads) * m0 + (n % heads) * m1 + i * m2 + j * m3`, strides 0 where it broadcasts; no
// mask when `mask` is null) and hidden (-inf) where `causal` and j > i + tk - tq. Then, one block
// (a multiple of 32 threads) per row, reduced in f32 through warp shuffles:
//   grad 0: p = softmax(row) into `out`, in dt;
//   grad 1: the scores' gradient scale * p * (dp - sum(p * dp)) into `out`, in dt, from the
//           probabilities' gradient `dp` (dts), p recomputed in f32.
// A row with a NaN is NaN; a row that sees no key (every value -inf) is 0 and has gradient 0;
// a hidden key's probability is exactly 0. The CPU op's semantics. Compiled at run time by
// NVRTC after half.cuh.

extern "C" __global__ void amp_attention_probs(
    const void* s, const float* mask, const void* dp, void* out, int dts, int dt, int grad,
    float scale,
    int causal, unsigned long long rows, unsigned long long tq, unsigned long long tk,
    unsigned long long heads, unsigned long long m0, unsigned long long m1,
    unsigned long long m2, unsigned long long m3)
{
    __shared__ float slots[32];
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned long long at = r * tk, i = r % tq, n = r / tq;
        const float* mrow = mask ? mask + (n / heads) * m0 + (n % heads) * m1 + i * m2 : 0;
        // Keys j >= seen are hidden by the causal mask.
        const long long last = (long long)i + (long long)tk - (long long)tq;
        const unsigned long long seen =
            !causal ? tk : last < 0 ? 0ull : min(tk, (unsigned long long)last + 1ull);
        #define AMP_SCORE(j) \
            ((j) < seen ? amp_get(s, at + (j), dts) * scale + (mrow ? mrow[(j) * m3] : 0.0f) \
                        : AMP_NEG_INF)
        float m = AMP_NEG_INF, nan = 0.0f;
        for (unsigned long long j = threadIdx.x; j < tk; j += blockDim.x) {
            const float v = AMP_SCORE(j);
            m = fmaxf(m, v);
            nan = isnan(v) ? 1.0f : nan;
        }
        m = amp_block_reduce(m, 1, slots);
        nan = amp_block_reduce(nan, 1, slots);
        if (nan > 0.0f || m == AMP_NEG_INF) {
            const float fill = nan > 0.0f ? __int_as_float(0x7fc00000) : 0.0f;
            for (unsigned long long j = threadIdx.x; j < tk; j += blockDim.x) {
                amp_put(out, at + j, fill, dt);
            }
            continue;
        }
        float sum = 0.0f;
        for (unsigned long long j = threadIdx.x; j < tk; j += blockDim.x) {
            sum += expf(AMP_SCORE(j) - m);
        }
        sum = amp_block_reduce(sum, 0, slots);
        const float inv = 1.0f / sum;
        if (!grad) {
            for (unsigned long long j = threadIdx.x; j < tk; j += blockDim.x) {
                amp_put(out, at + j, expf(AMP_SCORE(j) - m) * inv, dt);
            }
            continue;
        }
        float dot = 0.0f;
        for (unsigned long long j = threadIdx.x; j < tk; j += blockDim.x) {
            dot += expf(AMP_SCORE(j) - m) * inv * amp_get(dp, at + j, dts);
        }
        dot = amp_block_reduce(dot, 0, slots);
        for (unsigned long long j = threadIdx.x; j < tk; j += blockDim.x) {
            const float p = expf(AMP_SCORE(j) - m) * inv;
            amp_put(out, at + j, scale * p * (amp_get(dp, at + j, dts) - dot), dt);
        }
        #undef AMP_SCORE
    }
}
