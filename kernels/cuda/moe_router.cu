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
    // Repeated arg-max; a chosen expert drops out by becoming NaN (never wins).
    for (int k = 0; k < top_k; ++k) {
        float v = t < E ? c : NEG_INF;
        int i = t < E ? t : 0x7fffffff;
        block_argmax(v, i, sv, si);
        if (i == 0x7fffffff) i = 0;  // fewer candidates than top_k: repeat expert 0 (weight below)
        if (t == i) c = __int_as_float(0x7fc00000);
        if (t == 0) chosen[k] = i;
        __syncthreads();
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
