// Op `silu_mul`: out = silu(gate) * up with silu(g) = g / (1 + exp(-g)) (SwiGLU, spec §1.9).
// Rows of n values; gate/up/out rows at their own strides so fused gate|up outputs need no copy.

extern "C" __global__ void silu_mul_f32(const float* __restrict__ g, long long g_stride,
                                        const float* __restrict__ u, long long u_stride,
                                        float* __restrict__ out, long long o_stride, int n,
                                        long long rows) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    // Rows grid-stride over grid.y (limited to 65535).
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const float gv = g[r * g_stride + i];
        out[r * o_stride + i] = gv / (1.0f + expf(-gv)) * u[r * u_stride + i];
    }
}
