// Op `moe_sort`: group a batch's (token, slot) pairs by expert for the grouped expert GEMVs of
// prefill and batched decode (one pass over each selected expert's weights for all its tokens,
// instead of one per pair). Pair p = t * K + k routes token t to expert ids[p] (-1 = none).
// Three launches, every result deterministic (integer counts, ordered scans, no atomics):
//   moe_count   grid E:  counts[e] = pairs routed to e;
//   moe_plan    1 block: offsets (exclusive scan); each expert's tiles, in expert order, in one
//                        of two tile sets (below); every map entry and unused tile set to -1;
//   moe_scatter grid E:  expert e's pairs in pair order take sorted positions off[e] + r and
//                        fill the maps of its tiles: tok[c] = token, pos[c] = sorted position,
//                        pair[c] = p, for column c = tile * W + (r % W) of its set (width W).
// Two sets, because no one tile width suits every expert of a step (measured 2026-12-06, H100,
// grouped gate+up of 64 tokens on the tensor cores): an expert chosen by most tokens of a prompt
// wants wide tiles (its weights read once per W tokens: 252 us at W = 64 against 398 us at 8),
// an expert with a token or two wants the narrow kernel (1,926 us over 256 such experts at W = 8
// against 3,473 us at 64: the wide kernel holds fewer warps per SM). The narrow set S takes the
// experts with at most S.width pairs (one tile each) and, when there is no wide set
// (B.max_tiles == 0), every expert in as many tiles as it needs; the wide set B the rest.
// The host sizes both for the worst case (kernels/src/moe.rs), so nothing about the routing is
// read back; each set is one launch per matrix.

// One tile set (`MoeTiles` in kernels/src/moe.rs; no padding: pointers first).
struct MoeTiles {
    int* tile_expert;  // [max_tiles]: expert of the tile, -1 unused
    int* tok;          // [max_tiles * width]: token of column c, -1 unused
    int* pos;          // sorted position of column c
    int* pair;         // pair index of column c
    int max_tiles, width;
};

extern "C" __global__ void moe_count(const int* __restrict__ ids, int n, int* __restrict__ counts) {
    pdl_entry();
    __shared__ float scratch[32];
    const int e = blockIdx.x;
    float c = 0.0f;
    for (int p = threadIdx.x; p < n; p += blockDim.x) c += ids[p] == e ? 1.0f : 0.0f;
    // Exact: n < 2^24 (checked by the host).
    c = block_sum(c, scratch);
    if (threadIdx.x == 0) counts[e] = (int)c;
}

extern "C" __global__ void moe_plan(const int* __restrict__ counts, int E, MoeTiles S, MoeTiles B,
                                    int* __restrict__ offsets, int* __restrict__ tile_base) {
    pdl_entry();
    for (int c = threadIdx.x; c < S.max_tiles * S.width; c += blockDim.x) {
        S.tok[c] = -1;
        S.pos[c] = -1;
        S.pair[c] = -1;
    }
    for (int c = threadIdx.x; c < B.max_tiles * B.width; c += blockDim.x) {
        B.tok[c] = -1;
        B.pos[c] = -1;
        B.pair[c] = -1;
    }
    for (int t = threadIdx.x; t < S.max_tiles; t += blockDim.x) S.tile_expert[t] = -1;
    for (int t = threadIdx.x; t < B.max_tiles; t += blockDim.x) B.tile_expert[t] = -1;
    __syncthreads();
    if (threadIdx.x == 0) {
        int off = 0, ts = 0, tb = 0;
        for (int e = 0; e < E; ++e) {
            offsets[e] = off;
            const int c = counts[e];
            if (B.max_tiles > 0 && c > S.width) {
                // Wide: tile_base = -(first tile + 1).
                tile_base[e] = -(tb + 1);
                const int nt = (c + B.width - 1) / B.width;
                for (int i = 0; i < nt && tb + i < B.max_tiles; ++i) B.tile_expert[tb + i] = e;
                tb += nt;
            } else {
                tile_base[e] = ts;
                const int nt = (c + S.width - 1) / S.width;
                for (int i = 0; i < nt && ts + i < S.max_tiles; ++i) S.tile_expert[ts + i] = e;
                ts += nt;
            }
            off += c;
        }
    }
}

extern "C" __global__ void moe_scatter(const int* __restrict__ ids, int n, int K,
                                       const int* __restrict__ offsets,
                                       const int* __restrict__ tile_base, MoeTiles S, MoeTiles B) {
    pdl_entry();
    __shared__ int warp_tot[32];
    const int e = blockIdx.x;
    const int tb = tile_base[e];
    const MoeTiles T = tb >= 0 ? S : B;
    const int t0 = tb >= 0 ? tb : -tb - 1;
    int seen = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int p = base + threadIdx.x;
        const int mine = p < n && ids[p] == e;
        int tot;
        const int r = seen + block_excl_scan(mine, warp_tot, tot);
        if (mine) {
            const int tile = t0 + r / T.width;
            if (tile < T.max_tiles) {
                const int c = tile * T.width + r % T.width;
                T.tok[c] = p / K;
                T.pos[c] = offsets[e] + r;
                T.pair[c] = p;
            }
        }
        seen += tot;
    }
}
