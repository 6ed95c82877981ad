// Op `moe_router`: GLM-5 / DeepSeek-V3 routing (spec §1.10), one block per token, one thread per
// expert (E <= 1024).
//   s = sigmoid(logit) (gating 0) or softmax over the experts (gating 1);
//   c = s + bias (bias only steers the selection);
//   group-limited: keep the topk_group groups with the largest sum of their top-2 c, others -inf;
//   ids = top_k of c (descending, ties to the lower expert id); w = s[ids];
//   if norm: w /= (sum(w) + 1e-20); w *= scale.

extern "C" __global__ void moe_router_f32(const float* __restrict__ logits, long long stride, int E,
                                          const float* __restrict__ bias, int n_group, int topk_group,
                                          int top_k, int norm, float scale, int* __restrict__ ids,
                                          float* __restrict__ weights, int gating) {
    pdl_entry();
    __shared__ float s_sig[1024];
    __shared__ float s_choice[1024];
    __shared__ float s_group[64];
    __shared__ int keep_group[64];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int chosen[64];
    __shared__ float s_cand[1024];  // per warp its top min(top_k, 32): at most 32 x 32
    __shared__ int s_cand_i[1024];
    const int t = threadIdx.x;
    const long long n = blockIdx.x;
    float c = NEG_INF;
    const float l = t < E ? logits[n * stride + t] : NEG_INF;
    float s = 0.0f;
    if (gating == 1) {
        const float mx = block_max(l, sv);
        const float e = t < E ? expf(l - mx) : 0.0f;
        const float z = block_sum(e, sv);
        s = e / z;
    } else {
        s = 1.0f / (1.0f + expf(-l));
    }
    if (t < E) {
        s_sig[t] = s;
        c = s + (bias ? bias[t] : 0.0f);
        s_choice[t] = c;
    }
    __syncthreads();
    if (n_group > 1 && topk_group < n_group) {
        const int gsz = E / n_group;
        if (t < n_group) {
            float m1 = NEG_INF, m2 = NEG_INF;
            for (int e = t * gsz; e < (t + 1) * gsz; ++e) {
                const float v = s_choice[e];
                if (v > m1) {
                    m2 = m1;
                    m1 = v;
                } else if (v > m2) {
                    m2 = v;
                }
            }
            s_group[t] = gsz >= 2 ? m1 + m2 : m1;
            keep_group[t] = 0;
        }
        __syncthreads();
        for (int k = 0; k < topk_group; ++k) {
            float v = (t < n_group && !keep_group[t]) ? s_group[t] : NEG_INF;
            int i = (t < n_group && !keep_group[t]) ? t : 0x7fffffff;
            block_argmax(v, i, sv, si);
            if (t == 0 && i != 0x7fffffff) keep_group[i] = 1;
            __syncthreads();
        }
        if (t < E && !keep_group[t / gsz]) c = NEG_INF;
    }
    // Top-k in two phases with two barriers in all (a repeated block arg-max paid three barriers
    // a pick: 8.1 us a token on H100). Each warp picks its own top min(top_k, 32) by repeated
    // warp arg-max, then warp 0 picks the block's top_k from those candidates the same way.
    // argmax_takes is a total order and each of the block's top_k is within its warp's top
    // min(top_k, 32), so the picks are the one-phase loop's, in its order; the edge cases too:
    // a pick drops out by becoming NaN (never wins over a number; NaNs repeat the lowest id
    // once only they are left), padding threads (id INT_MAX, -inf) never drop out and map to
    // expert 0.
    {
        const int lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5;
        const int kc = min(top_k, 32);
        const float qnan = __int_as_float(0x7fc00000);
        float v = t < E ? c : NEG_INF;
        const int me = t < E ? t : 0x7fffffff;
        for (int k = 0; k < kc; ++k) {
            float bv = v;
            int bi = me;
            warp_argmax(bv, bi);
            if (lane == 0) {
                s_cand[warp * kc + k] = bv;
                s_cand_i[warp * kc + k] = bi;
            }
            if (t < E && bi == me) v = qnan;
        }
        __syncthreads();
        if (warp == 0) {
            const int nc = nw * kc;
            for (int k = 0; k < top_k; ++k) {
                // A lane without candidates holds (NaN, INT_MAX), which loses to every one.
                float bv = qnan;
                int bi = 0x7fffffff, bs = -1;
                for (int j = lane; j < nc; j += 32) {
                    const float cv = s_cand[j];
                    const int ci = s_cand_i[j];
                    if (argmax_takes(bv, bi, cv, ci)) {
                        bv = cv;
                        bi = ci;
                        bs = j;
                    }
                }
                float wv = bv;
                int wi = bi;
                warp_argmax(wv, wi);
                // The winner's slot drops out (several slots of one id are NaN repeats: any).
                if (bs >= 0 && bi == wi && wi != 0x7fffffff) s_cand[bs] = qnan;
                __syncwarp();
                if (lane == 0) chosen[k] = wi == 0x7fffffff ? 0 : wi;
            }
        }
    }
    if (t == 0) {
        float sum = 0.0f;
        for (int k = 0; k < top_k; ++k) sum += s_sig[chosen[k]];
        for (int k = 0; k < top_k; ++k) {
            float w = s_sig[chosen[k]];
            if (norm) w = w / (sum + 1e-20f);
            weights[n * top_k + k] = w * scale;
            ids[n * top_k + k] = chosen[k];
        }
    }
}

// Expert parallelism: ids re-based to this rank's experts first .. first + count (others -1),
// in place, so the rank's MoE launches skip what other ranks compute without the ids visiting
// the host. Negative ids (empty slots) stay -1.
extern "C" __global__ void moe_local_ids(int* ids, long long n, int first, int count) {
    pdl_entry();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int e = ids[i];
        ids[i] = (e >= first && e - first < count) ? e - first : -1;
    }
}
