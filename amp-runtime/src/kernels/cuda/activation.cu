// The CUDA half of kernels::activation: GELU (tanh and erf forms), SiLU and ReLU and their
// gradients over f32, f16 or bf16 arrays (dt 0, 1, 2; see half.cuh). Each value is widened to
// f32, the activation or its slope computed in f32 and rounded once, as on CPU and in
// PyTorch's kernels; the formulas are the CPU ones (no cancellation in the tails), with CUDA's
// expf and erfcf. Compiled at run time by NVRTC after half.cuh.
//
// form: 0 GELU (tanh approximation), 1 GELU (erf), 2 SiLU, 3 ReLU (NaN kept).

#define AMP_SQRT_2_OVER_PI 0.7978845608f
#define AMP_INV_SQRT_2PI 0.3989422804f
#define AMP_CUBIC 0.044715f

// (1 + tanh u, 1 - tanh u), each without cancellation.
__device__ __forceinline__ void amp_tanh_sides(float u, float* plus, float* minus) {
    const float e = expf(-2.0f * fabsf(u));
    const float d = 1.0f / (1.0f + e);
    const float large = 2.0f * d, small = 2.0f * e * d;
    *plus = u < 0.0f ? small : large;
    *minus = u < 0.0f ? large : small;
}

// The standard normal CDF, 0.5 erfc(-x / sqrt 2): relative accuracy in the negative tail.
__device__ __forceinline__ float amp_normal_cdf(float x) {
    return 0.5f * erfcf(-x * 0.7071067812f);
}

__device__ __forceinline__ float amp_act_value(float x, int form) {
    if (form == 0) {
        float plus, minus;
        amp_tanh_sides(AMP_SQRT_2_OVER_PI * x * (1.0f + AMP_CUBIC * x * x), &plus, &minus);
        return 0.5f * x * plus;
    } else if (form == 1) {
        return x * amp_normal_cdf(x);
    } else if (form == 2) {
        return x / (1.0f + expf(-x));
    }
    return x < 0.0f ? 0.0f : x; // NaN is not < 0: it passes through
}

// grad * f'(x).
__device__ __forceinline__ float amp_act_grad(float x, float g, int form) {
    if (form == 0) {
        float plus, minus;
        amp_tanh_sides(AMP_SQRT_2_OVER_PI * x * (1.0f + AMP_CUBIC * x * x), &plus, &minus);
        const float du = AMP_SQRT_2_OVER_PI * (1.0f + 3.0f * AMP_CUBIC * x * x);
        return g * (0.5f * plus + 0.5f * x * plus * minus * du);
    } else if (form == 1) {
        return g * (amp_normal_cdf(x) + x * AMP_INV_SQRT_2PI * expf(-0.5f * x * x));
    } else if (form == 2) {
        // sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x), each from its own exp (the CPU op's).
        const float s = 1.0f / (1.0f + expf(-x));
        const float one_minus_s = 1.0f / (1.0f + expf(x));
        return g * s * (1.0f + x * one_minus_s);
    }
    return x <= 0.0f ? 0.0f : g; // NaN passes the gradient, as PyTorch's
}

// out[i] = f(x[i]), or, with dy, out[i] = dy[i] * f'(x[i]); one thread per value in a
// grid-stride loop.
extern "C" __global__ void amp_activation(
    const void* x, const void* dy, void* out, int dt, int form, unsigned long long n)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        const float v = amp_get(x, i, dt);
        const float r = dy ? amp_act_grad(v, amp_get(dy, i, dt), form) : amp_act_value(v, form);
        amp_put(out, i, r, dt);
    }
}
