// Max pooling over (planes, h, w) values of dtype dt (0 f32, 1 f16, 2 bf16; see half.cuh), as
// the CPU op (kernels::pool) pools: each window clipped to the plane (the padding is -inf, never
// a maximum), its first maximum in row-major order taken, a NaN winning (the first NaN). One
// thread per output in a grid-stride loop.
// Compiled at run time by NVRTC after half.cuh.

// The geometry: planes (batch * channels) of h x w values pooled to oh x ow by kh x kw windows at
// strides (sh, sw), padded by `pad` on every side.
struct AmpPool {
    unsigned long long planes;
    unsigned int h, w, oh, ow, kh, kw, sh, sw, pad;
};

#define AMP_POOL_ARGS unsigned long long planes, unsigned int h, unsigned int w, \
    unsigned int oh, unsigned int ow, unsigned int kh, unsigned int kw, unsigned int sh, \
    unsigned int sw, unsigned int pad
#define AMP_POOL_MAKE AmpPool p = {planes, h, w, oh, ow, kh, kw, sh, sw, pad}

// The offset of output i's plane in the input.
__device__ unsigned long long amp_pool_plane(AmpPool p, unsigned long long i)
{
    return i / ((unsigned long long)p.oh * p.ow) * p.h * p.w;
}

// The offset within its plane (at `base`) of output i's window maximum; -1 for a window wholly
// in the padding (the caller's checks leave none).
__device__ long long amp_pool_argmax(const void* x, int dt, unsigned long long base,
                                     AmpPool p, unsigned long long i)
{
    const unsigned int r = (unsigned int)(i % ((unsigned long long)p.oh * p.ow));
    const unsigned int oy = r / p.ow, ox = r % p.ow;
    const int y0 = (int)(oy * p.sh) - (int)p.pad;
    const int x0 = (int)(ox * p.sw) - (int)p.pad;
    long long best = -1;
    float top = 0.0f;
    for (int y = y0 < 0 ? 0 : y0; y < y0 + (int)p.kh && y < (int)p.h; ++y) {
        for (int xx = x0 < 0 ? 0 : x0; xx < x0 + (int)p.kw && xx < (int)p.w; ++xx) {
            const long long at = (long long)y * p.w + xx;
            const float v = amp_get(x, base + at, dt);
            if (best < 0 || v > top || (v != v && top == top)) {
                best = at;
                top = v;
            }
        }
    }
    return best;
}

// y = the value at each window's maximum, copied to the bit.
extern "C" __global__ void amp_max_pool(const void* x, void* y, int dt, AMP_POOL_ARGS)
{
    AMP_POOL_MAKE;
    const unsigned long long outputs = p.planes * p.oh * p.ow;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < outputs; i += stride) {
        const unsigned long long base = amp_pool_plane(p, i);
        const long long at = amp_pool_argmax(x, dt, base, p, i);
        if (dt == 0) {
            ((float*)y)[i] = at < 0 ? __int_as_float(0xff800000) : ((const float*)x)[base + at];
        } else {
            // -inf in f16 is 0xfc00, in bf16 0xff80.
            const unsigned short minus_inf = dt == 1 ? 0xfc00 : 0xff80;
            ((unsigned short*)y)[i] =
                at < 0 ? minus_inf : ((const unsigned short*)x)[base + at];
        }
    }
}

// grad (f32, zeroed by the caller) += dy at each window's maximum: where windows overlap the
// gradients add in f32 (atomically), rounded once to dt by the caller.
extern "C" __global__ void amp_max_pool_grad(const void* x, const void* dy, float* grad, int dt,
                                             AMP_POOL_ARGS)
{
    AMP_POOL_MAKE;
    const unsigned long long outputs = p.planes * p.oh * p.ow;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < outputs; i += stride) {
        const unsigned long long base = amp_pool_plane(p, i);
        const long long at = amp_pool_argmax(x, dt, base, p, i);
        if (at >= 0) {
            atomicAdd(grad + base + at, amp_get(dy, i, dt));
        }
    }
}
