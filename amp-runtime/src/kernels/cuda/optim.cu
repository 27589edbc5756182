// The CUDA half of kernels::optim: the optimizers' updates in place, one parameter per launch,
// over f32, f16 or bf16 parameters (dt 0, 1, 2; see half.cuh) and f32 moments. Arithmetic in
// f32, each product, sum, quotient and square root rounded as the CPU pass rounds it (explicit
// __f*_rn: no contraction into fused multiply-adds), so a parameter ends bit for bit where the
// CPU pass puts it; a half parameter is rounded once. Compiled at run time by NVRTC after
// half.cuh.

// SGD: w = w - g * lr.
extern "C" __global__ void amp_sgd(void* w, const void* g, int dt, unsigned long long n, float lr)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        amp_put(w, i, __fsub_rn(amp_get(w, i, dt), __fmul_rn(amp_get(g, i, dt), lr)), dt);
    }
}

// AdamW's moments, `mv` the (2, n) f32 m then v: m = m * beta1 + g * (1 - beta1),
// v = v * beta2 + (g * g) * (1 - beta2).
extern "C" __global__ void amp_adamw_moments(
    float* mv, const void* g, int dt, unsigned long long n,
    float beta1, float one_minus_beta1, float beta2, float one_minus_beta2)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float gv = amp_get(g, i, dt);
        mv[i] = __fadd_rn(__fmul_rn(mv[i], beta1), __fmul_rn(gv, one_minus_beta1));
        mv[n + i] = __fadd_rn(__fmul_rn(mv[n + i], beta2),
                              __fmul_rn(__fmul_rn(gv, gv), one_minus_beta2));
    }
}

// AdamW's step from the moments: w = w * decay - lr * (m * scale_m) / (sqrt(v * scale_v) + eps).
extern "C" __global__ void amp_adamw_apply(
    void* w, const float* mv, int dt, unsigned long long n,
    float lr, float decay, float scale_m, float scale_v, float eps)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float step = __fdiv_rn(__fmul_rn(mv[i], scale_m),
                                     __fadd_rn(__fsqrt_rn(__fmul_rn(mv[n + i], scale_v)), eps));
        amp_put(w, i, __fsub_rn(__fmul_rn(amp_get(w, i, dt), decay), __fmul_rn(step, lr)), dt);
    }
}
