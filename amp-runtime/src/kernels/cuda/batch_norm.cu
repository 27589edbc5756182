// The CUDA half of kernels::batch_norm: per-channel sums, the per-channel statistics and
// gradient constants, the per-channel affine pass and the bias add over (n, c, hw) tensors of
// f32, f16 or bf16 (dt 0, 1, 2; see half.cuh), all arithmetic on values in f32.
// Compiled at run time by NVRTC after half.cuh.

// Per-channel sums. Grid (channels, splits), AMP_BN_THREADS threads: block (c, s) takes the
// s-th of `splits` equal ranges of channel c's n * hw values, read in groups of `width` values
// (one 16-byte load each where the rows and arrays allow: amp_get_w in half.cuh). Each thread
// sums its values in f32, the block adds the threads' sums in f64 and adds its total to the f64
// outputs (zeroed by the caller). Modes:
//   0: out0[c] = sum(x)
//   1: out0[c] = sum((x - center[c])^2)
//   2: out0[c] = sum(dy), out1[c] = sum(dy * (x - center[c]) * scale[c])
// AMP_BN_THREADS, the threads per block, is defined by the Rust side (kernels::cuda::batch_norm).
//
// A forward's ReLU, for the backward's kernels (mode 2 of the sums, the input gradient's affine
// pass): with `relu_scale` not null, dy counts only where the forward's output was positive, that
// output recomputed as the forward computed it, amp_relu_kept below (no pass over the output
// and no masked copy of dy).
// Whether the forward's output at a value `v` of x, amp_bn_apply's (v - center) * (scale * mul)
// + shift through its ReLU and rounded to dt, is positive (a NaN output is not).
__device__ __forceinline__ bool amp_relu_kept(float v, float center, float scale_mul, float shift,
                                              int dt) {
    return amp_round(__fmaf_rn(v - center, scale_mul, shift), dt) > 0.0f;
}

// The sums' body over groups of W values (see amp_get_w): `count` and `per_split` count groups.
template <int W>
__device__ __forceinline__ void amp_bn_sums_w(
    const void* x, const void* dy, int dt, int mode,
    unsigned int channels, unsigned long long hw, unsigned long long count,
    unsigned long long per_split,
    const float* center, const float* scale,
    const float* relu_scale, const float* relu_mul, const float* relu_shift,
    double* out0, double* out1)
{
    const unsigned int c = blockIdx.x;
    const unsigned long long begin = (unsigned long long)blockIdx.y * per_split;
    const unsigned long long end = begin + per_split < count ? begin + per_split : count;
    const float m = mode == 0 ? 0.0f : center[c];
    const float s = mode == 2 ? scale[c] : 0.0f;
    const float rs = relu_scale ? relu_scale[c] * relu_mul[c] : 0.0f;
    const float rt = relu_scale ? relu_shift[c] : 0.0f;
    float a = 0.0f, b = 0.0f;
    // The j-th group of the channel starts at (n, r) = (j * W / hw, j * W % hw): divided once,
    // then carried forward (a 64-bit division per value had made this pass several times slower
    // than the bandwidth allows), with a 32-bit division on a wrap where hw fits.
    unsigned long long j = begin + threadIdx.x;
    unsigned long long n = j * W / hw;
    unsigned long long r = j * W - n * hw;
    const bool narrow = hw < 0xffff0000ull;
    for (; j < end; j += AMP_BN_THREADS) {
        const unsigned long long at = (n * channels + c) * hw + r;
        r += AMP_BN_THREADS * W;
        if (r >= hw) {
            const unsigned long long q = narrow ? (unsigned int)r / (unsigned int)hw : r / hw;
            n += q;
            r -= q * hw;
        }
        float xs[W];
        amp_get_w<W>(x, at, dt, xs);
        if (mode == 0) {
#pragma unroll
            for (int k = 0; k < W; ++k) {
                a += xs[k];
            }
        } else if (mode == 1) {
#pragma unroll
            for (int k = 0; k < W; ++k) {
                a += (xs[k] - m) * (xs[k] - m);
            }
        } else {
            float gs[W];
            amp_get_w<W>(dy, at, dt, gs);
#pragma unroll
            for (int k = 0; k < W; ++k) {
                float g = gs[k];
                if (relu_scale && !amp_relu_kept(xs[k], m, rs, rt, dt)) {
                    g = 0.0f;
                }
                a += g;
                b += g * (xs[k] - m) * s;
            }
        }
    }
    __shared__ double sa[AMP_BN_THREADS];
    __shared__ double sb[AMP_BN_THREADS];
    sa[threadIdx.x] = a;
    sb[threadIdx.x] = b;
    __syncthreads();
    for (unsigned int half = AMP_BN_THREADS / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            sa[threadIdx.x] += sa[threadIdx.x + half];
            sb[threadIdx.x] += sb[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(out0 + c, sa[0]);
        if (mode == 2) {
            atomicAdd(out1 + c, sb[0]);
        }
    }
}

// `width`: values per load, 1, or 4 (f32) or 8 (f16, bf16) where every channel row's length
// hw is a multiple of it and x and dy are 16-byte aligned; `count` and `per_split` count groups
// of `width` values.
extern "C" __global__ void amp_bn_sums(
    const void* x, const void* dy, int dt, int mode, int width,
    unsigned int channels, unsigned long long hw, unsigned long long count,
    unsigned long long per_split,
    const float* center, const float* scale,
    const float* relu_scale, const float* relu_mul, const float* relu_shift,
    double* out0, double* out1)
{
    if (width == 8) {
        amp_bn_sums_w<8>(x, dy, dt, mode, channels, hw, count, per_split, center, scale,
                         relu_scale, relu_mul, relu_shift, out0, out1);
    } else if (width == 4) {
        amp_bn_sums_w<4>(x, dy, dt, mode, channels, hw, count, per_split, center, scale,
                         relu_scale, relu_mul, relu_shift, out0, out1);
    } else {
        amp_bn_sums_w<1>(x, dy, dt, mode, channels, hw, count, per_split, center, scale,
                         relu_scale, relu_mul, relu_shift, out0, out1);
    }
}

// The per-channel statistics of a training forward, one thread per channel, in two stages around
// the second sums pass (kernels::batch_norm's BatchStats; the CPU op's f64 arithmetic, each
// operation rounded as there: no contraction into fused multiply-adds). `out` is (4, channels)
// f32: the mean, the inverse standard deviation, the new running mean and running variance.
//   stage 0: mean = sum[c] / count, kept in mean64[c]; out[0][c] = (float)mean (the centre of the
//            second pass).
//   stage 1: var = squares[c] / count - ((double)out[0][c] - mean)^2, 0 where negative (a NaN
//            stays NaN); out[1][c] = (float)(1 / sqrt(var + eps)); out[2][c] and out[3][c]: the
//            running mean and unbiased variance moved by `momentum`, in f32 as candle's ops on
//            the CPU move them. `bias` (null: none) is added to the mean the running mean moves
//            towards, in f64: the bias of a conv whose biasless output was normalised.
extern "C" __global__ void amp_bn_stats(
    int stage, unsigned int channels, double count, double eps, double momentum,
    const double* sum, double* mean64, const double* squares,
    const float* running_mean, const float* running_var, const float* bias, float* out)
{
    const unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) {
        return;
    }
    if (stage == 0) {
        const double mean = __ddiv_rn(sum[c], count);
        mean64[c] = mean;
        out[c] = (float)mean;
        return;
    }
    const double mean = mean64[c];
    const double shift = __dsub_rn((double)out[c], mean);
    double var = __dsub_rn(__ddiv_rn(squares[c], count), __dmul_rn(shift, shift));
    if (var < 0.0) {
        var = 0.0;
    }
    out[channels + c] = (float)__ddiv_rn(1.0, sqrt(__dadd_rn(var, eps)));
    const float keep = (float)__dsub_rn(1.0, momentum);
    const float moved = (float)momentum;
    const float unbiased = (float)__ddiv_rn(__dmul_rn(var, count), __dsub_rn(count, 1.0));
    const float towards = bias ? (float)__dadd_rn(mean, (double)bias[c]) : out[c];
    out[2 * channels + c] = __fadd_rn(__fmul_rn(running_mean[c], keep), __fmul_rn(towards, moved));
    out[3 * channels + c] = __fadd_rn(__fmul_rn(running_var[c], keep), __fmul_rn(unbiased, moved));
}

// The input gradient's per-channel constants from the gradient sums (f64 (2, channels): sum(dy),
// sum(dy * xhat)), one thread per channel: k = weight * invstd and, with the batch's statistics
// (`train`), p = -k * u * sum(dy * xhat) / count and q = -k * sum(dy) / count, u = invstd (or 1
// with `unit`: sums taken over values already normalised); otherwise p = q = 0. `out` is (6,
// channels) f32: k, p, q, 0, then the two sums (the weight's and the bias's gradients).
extern "C" __global__ void amp_bn_grad_consts(
    unsigned int channels, double count, int train, int unit,
    const double* sums, const float* weight, const float* invstd, float* out)
{
    const unsigned int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) {
        return;
    }
    const double s = (double)invstd[c];
    const double k = __dmul_rn((double)weight[c], s);
    double p = 0.0, q = 0.0;
    if (train) {
        p = __ddiv_rn(__dmul_rn(__dmul_rn(-k, unit ? 1.0 : s), sums[channels + c]), count);
        q = __ddiv_rn(__dmul_rn(-k, sums[c]), count);
    }
    out[c] = (float)k;
    out[channels + c] = (float)p;
    out[2 * channels + c] = (float)q;
    out[3 * channels + c] = 0.0f;
    out[4 * channels + c] = (float)sums[channels + c];
    out[5 * channels + c] = (float)sums[c];
}

// The per-channel affine pass, rounded once to dt:
//   out = (x - center[c]) * (scale[c] * mul[c]) + shift[c] (+ k[c] * dy), through a ReLU if `relu`
// `mul`, `dy` and `k` may be null (mul then 1, no dy term). The forward is center = mean,
// scale = invstd, mul = weight, shift = bias; the input gradient center = mean, scale = p,
// shift = q, k * dy (kernels::batch_norm's InputGrad), dy masked by the forward's ReLU where
// `relu_scale` is not null (see amp_relu_kept). A grid-stride loop over the `total` values in
// groups of W (a row of hw values holds whole groups), each group's channel from its row: the
// rows of a late layer's small feature maps (4x4: 16 values) share blocks, where a block per
// row had left all but a few of its threads idle. The channel index takes a 32-bit division
// where the tensor allows.
template <int W>
__device__ __forceinline__ void amp_bn_apply_w(
    const void* x, const void* dy, void* out, int dt,
    unsigned int channels, unsigned long long hw, unsigned long long total,
    const float* center, const float* scale, const float* mul, const float* shift,
    const float* k, int relu,
    const float* relu_scale, const float* relu_mul, const float* relu_shift)
{
    const unsigned long long groups = total / W;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const bool narrow = total <= 0xffffffffull;
    for (unsigned long long j = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         j < groups; j += stride) {
        const unsigned long long at = j * W;
        const unsigned int c = narrow
            ? ((unsigned int)at / (unsigned int)hw) % channels
            : (unsigned int)((at / hw) % channels);
        const float m = center[c];
        const float s = mul ? scale[c] * mul[c] : scale[c];
        const float t = shift[c];
        const float kc = k ? k[c] : 0.0f;
        const float rs = relu_scale ? relu_scale[c] * relu_mul[c] : 0.0f;
        const float rt = relu_scale ? relu_shift[c] : 0.0f;
        float xs[W], vs[W], gs[W];
        amp_get_w<W>(x, at, dt, xs);
        if (dy) {
            amp_get_w<W>(dy, at, dt, gs);
        }
#pragma unroll
        for (int q = 0; q < W; ++q) {
            float v = __fmaf_rn(xs[q] - m, s, t);
            if (dy) {
                float g = gs[q];
                if (relu_scale && !amp_relu_kept(xs[q], m, rs, rt, dt)) {
                    g = 0.0f;
                }
                v = kc * g + v;
            }
            // `v < 0` is false for NaN, which passes through (ReLU keeps NaN).
            if (relu && v < 0.0f) {
                v = 0.0f;
            }
            vs[q] = v;
        }
        amp_put_w<W>(out, at, vs, dt);
    }
}

// `width` as for amp_bn_sums (x, dy and out 16-byte aligned, hw a multiple of it).
extern "C" __global__ void amp_bn_apply(
    const void* x, const void* dy, void* out, int dt, int width,
    unsigned int channels, unsigned long long hw, unsigned long long total,
    const float* center, const float* scale, const float* mul, const float* shift,
    const float* k, int relu,
    const float* relu_scale, const float* relu_mul, const float* relu_shift)
{
    if (width == 8) {
        amp_bn_apply_w<8>(x, dy, out, dt, channels, hw, total, center, scale, mul, shift, k, relu,
                          relu_scale, relu_mul, relu_shift);
    } else if (width == 4) {
        amp_bn_apply_w<4>(x, dy, out, dt, channels, hw, total, center, scale, mul, shift, k, relu,
                          relu_scale, relu_mul, relu_shift);
    } else {
        amp_bn_apply_w<1>(x, dy, out, dt, channels, hw, total, center, scale, mul, shift, k, relu,
                          relu_scale, relu_mul, relu_shift);
    }
}

// The bias add: out = y + bias[c], the f32 bias rounded to dt first (the cast autocast gives
// a lower-precision op's bias), the sum computed in f32 and rounded once to dt, over
// (n, channels, inner) values, one thread per value in a grid-stride loop. The channel index
// takes a 32-bit division where the tensor allows (a 64-bit one costs several times more).
extern "C" __global__ void amp_bias_add(
    const void* y, void* out, int dt, const float* bias,
    unsigned int channels, unsigned long long inner, unsigned long long total)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const bool narrow = total <= 0xffffffffull;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < total; i += stride) {
        const unsigned int c = narrow
            ? ((unsigned int)i / (unsigned int)inner) % channels
            : (unsigned int)((i / inner) % channels);
        amp_put(out, i, amp_get(y, i, dt) + amp_round(bias[c], dt), dt);
    }
}
