// Shared by candle-amp's CUDA kernels (prepended to each source before NVRTC compiles it).
// The sources include no headers: half and bfloat16 values travel as 16-bit integers and are
// converted here, f16 by the PTX conversions, bf16 by bit arithmetic (round to nearest even).
// Also here: the block-wide reduction of the row-per-block kernels (softmax, layer norm,
// attention).

#define AMP_NEG_INF __int_as_float(0xff800000)

// The block's sum (op 0) or maximum (op 1) of `v`, in every thread: warp shuffles, then one
// shared slot per warp (`slots`, 32 floats; the block a multiple of 32 threads).
__device__ __forceinline__ float amp_block_reduce(float v, int op, float* slots) {
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

__device__ __forceinline__ float amp_load(const unsigned short* p, bool bf) {
    unsigned short bits = *p;
    if (bf) {
        return __uint_as_float(((unsigned int)bits) << 16);
    }
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
}

__device__ __forceinline__ void amp_store(unsigned short* p, float v, bool bf) {
    unsigned short bits;
    if (bf) {
        unsigned int u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            bits = (unsigned short)((u >> 16) | 0x40u); // NaN stays a (quiet) NaN
        } else {
            u += 0x7fffu + ((u >> 16) & 1u);           // round to nearest, ties to even
            bits = (unsigned short)(u >> 16);
        }
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    }
    *p = bits;
}

// An element of an f32 (dt 0), f16 (dt 1) or bf16 (dt 2) array, as f32; `dt` is uniform
// across a launch, so the branch costs nothing.
__device__ __forceinline__ float amp_get(const void* p, unsigned long long i, int dt) {
    if (dt == 0) {
        return ((const float*)p)[i];
    }
    return amp_load((const unsigned short*)p + i, dt == 2);
}

// Stores `v` rounded once to the array's dtype.
__device__ __forceinline__ void amp_put(void* p, unsigned long long i, float v, int dt) {
    if (dt == 0) {
        ((float*)p)[i] = v;
    } else {
        amp_store((unsigned short*)p + i, v, dt == 2);
    }
}

// `v` rounded to the dtype of a dt array and read back as f32 (itself for f32).
__device__ __forceinline__ float amp_round(float v, int dt) {
    if (dt == 0) {
        return v;
    }
    unsigned short bits;
    amp_store(&bits, v, dt == 2);
    return amp_load(&bits, dt == 2);
}

// W consecutive values of a dt array from element i on, as f32, in one load where W > 1: W = 4
// for f32 (a float4) and 8 for f16 and bf16 (16 bytes); `i` a multiple of W and the array 16-byte
// aligned (the caller's check). W = 1: one value of any dtype.
template <int W>
__device__ __forceinline__ void amp_get_w(const void* p, unsigned long long i, int dt, float* out) {
    if (W == 1) {
        out[0] = amp_get(p, i, dt);
    } else if (W == 4) {
        const float4 v = *((const float4*)((const float*)p + i));
        out[0] = v.x;
        out[1] = v.y;
        out[2] = v.z;
        out[3] = v.w;
    } else {
        const uint4 raw = *((const uint4*)((const unsigned short*)p + i));
        const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const unsigned short h = (unsigned short)(words[k >> 1] >> (16 * (k & 1)));
            out[k] = amp_load(&h, dt == 2);
        }
    }
}

// Stores W values rounded to the array's dtype from element i on, as amp_get_w reads them.
template <int W>
__device__ __forceinline__ void amp_put_w(void* p, unsigned long long i, const float* v, int dt) {
    if (W == 1) {
        amp_put(p, i, v[0], dt);
    } else if (W == 4) {
        *((float4*)((float*)p + i)) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        unsigned short h[W];
#pragma unroll
        for (int k = 0; k < W; ++k) {
            amp_store(&h[k], v[k], dt == 2);
        }
        unsigned int words[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            words[k] = (unsigned int)h[2 * k] | ((unsigned int)h[2 * k + 1] << 16);
        }
        *((uint4*)((unsigned short*)p + i)) = make_uint4(words[0], words[1], words[2], words[3]);
    }
}
