// The CUDA half of kernels::binary's widening sum: out = x + sign * y over n elements, x and y
// of dtypes dtx and dty (0 f32, 1 f16, 2 bf16; see half.cuh), each widened to f32, the sum
// written in f32 (a promote-class sum of an f32 and a half operand, neither cast first).
// Compiled at run time by NVRTC after half.cuh.

extern "C" __global__ void amp_widening_sum(
    const void* x, int dtx, const void* y, int dty, float* out, float sign, unsigned long long n)
{
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = amp_get(x, i, dtx) + sign * amp_get(y, i, dty);
    }
}
