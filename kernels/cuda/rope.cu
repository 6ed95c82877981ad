// Op `rope`: interleaved (GPT-J / ggml NORM) rotary embedding on the rope dims only (spec §1.4),
// and (rope_q8_f32, at the end) the same rotation fused with the q8a quantization of the columns
// before the rope dims.
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

// The absorbed MLA queries' two consumers of the q_b output in one launch (both read only x and
// write disjoint outputs, so the per-head GEMV that follows needs one launch before it, not two):
// the q8a codes and records of the first `nope` columns of every (token, head) group, exactly as
// quantize.cu's quantize_q8a writes them for rows = tokens * heads (row s * heads + h, dense
// outputs qs[row * nope + k], ds[row * nope / 32 + b]) through the same q8a_store_block, and the
// rotation of rope_f32 from the x layout into the y layout with the same helpers, so both are
// bitwise what the two launches give.
// One block per (head, token), heads = gridDim.x; tokens grid-strided over grid.y as rope_f32.
// Warps [0, q_warps) quantize blocks of 32 (lane = element; a warp takes blocks w, w + q_warps,
// ...), the warps after them rotate pairs (thread = pair, striding by their thread count): at
// decode (nope 192, 32 pairs) 6 quantizing warps and 1 rotating warp run side by side, so the
// sincosf latency overlaps the quantization instead of following it. Warp roles and loop bounds
// are warp-uniform (q8a_store_block shuffles over the full warp). No barrier: x is only read,
// and qs / ds / y share no element with it (kernels/src/rope.rs `rope_q8_to`).
extern "C" __global__ void rope_q8_f32(const float* __restrict__ x, long long x_tok_stride,
                                       long long x_head_stride, int x_off, int nope, int q_warps,
                                       int8_t* __restrict__ qs, float2* __restrict__ ds,
                                       float* __restrict__ y, long long y_tok_stride,
                                       long long y_head_stride, int y_off, int n_rot,
                                       const int* __restrict__ pos,
                                       const float* __restrict__ inv_freq, int style,
                                       long long tokens) {
    pdl_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x;
    const int nb = nope >> 5, half = n_rot >> 1;
    const int rt = (int)blockDim.x - (q_warps << 5);
    for (long long s = blockIdx.y; s < tokens; s += gridDim.y) {
        const float* p = x + s * x_tok_stride + (long long)h * x_head_stride;
        if (warp < q_warps) {
            // quantize_q8a's row r and element index r * K + c * 32 + lane.
            const long long r = s * (long long)gridDim.x + h;
            for (int c = warp; c < nb; c += q_warps)
                q8a_store_block(p[c * 32 + lane], r * nope + c * 32 + lane, qs, ds);
        } else {
            const float* pr = p + x_off;
            float* q = y + s * y_tok_stride + (long long)h * y_head_stride + y_off;
            for (int j = (int)threadIdx.x - (q_warps << 5); j < half; j += rt) {
                int i1, i2;
                rope_pair(style, j, half, i1, i2);
                float o1, o2;
                rope_rotate(pr[i1], pr[i2], (float)pos[s] * inv_freq[j], o1, o2);
                if (style == 1) {
                    q[j] = o1;
                    q[half + j] = o2;
                } else {
                    q[i1] = o1;
                    q[i2] = o2;
                }
            }
        }
    }
}
