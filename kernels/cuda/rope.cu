// Op `rope`: interleaved (GPT-J / ggml NORM) rotary embedding on the rope dims only (spec §1.4).
// Pair j = (x[off+2j], x[off+2j+1]) of every head of token s is rotated by pos[s] * inv_freq[j].
// style 0: interleaved, rotated in place; 1: interleaved, written in the HF layout (all rotated
// even components, then all odd ones; identical dot products); 2: NeoX pairs (x[j], x[j+n_rot/2]). Layout: token s, head h starts at
// x + s*tok_stride + h*head_stride. inv_freq comes from the host (same f32 formula as the CPU).
// One block per (head, token), thread j owns pair j (blockDim >= n_rot/2, checked by the host).
// The rotated values go to y with its own layout (y == x: in place), so a rotation can land
// straight in the tensor that consumes it (the absorbed MLA queries' rope columns) with the
// in-place rotation's arithmetic.

// No __restrict__: y may be x.
extern "C" __global__ void rope_f32(const float* x, long long x_tok_stride, long long x_head_stride,
                                    int x_off, float* y, long long y_tok_stride,
                                    long long y_head_stride, int y_off, int n_rot,
                                    const int* __restrict__ pos, const float* __restrict__ inv_freq,
                                    int style, long long tokens) {
    pdl_entry();
    const int half = n_rot >> 1;
    const int j = threadIdx.x;
    const int h = blockIdx.x;
    const bool active = j < half;
    // Tokens grid-stride over grid.y (limited to 65535; the bound is uniform per block, so the
    // barrier below is reached by every thread). Different tokens never share elements.
    for (long long s = blockIdx.y; s < tokens; s += gridDim.y) {
        const float* p = x + s * x_tok_stride + (long long)h * x_head_stride + x_off;
        float* q = y + s * y_tok_stride + (long long)h * y_head_stride + y_off;
        float o1 = 0.0f, o2 = 0.0f;
        if (active) {
            int i1, i2;
            rope_pair(style, j, half, i1, i2);
            rope_rotate(p[i1], p[i2], (float)pos[s] * inv_freq[j], o1, o2);
        }
        // Every pair is read before any is overwritten (in place, the de-interleaved write
        // crosses pairs).
        __syncthreads();
        if (active) {
            if (style == 1) {
                q[j] = o1;
                q[half + j] = o2;
            } else {
                int i1, i2;
                rope_pair(style, j, half, i1, i2);
                q[i1] = o1;
                q[i2] = o2;
            }
        }
    }
}
