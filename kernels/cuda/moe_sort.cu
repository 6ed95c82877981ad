// Op `moe_sort`: group a batch's (token, slot) pairs by expert for the grouped expert GEMVs of
// prefill and batched decode (one pass over each selected expert's weights for all its tokens,
// instead of one per pair). Pair p = t * K + k routes token t to expert ids[p] (-1 = none).
// Three launches, every result deterministic (integer counts, ordered scans, no atomics):
//   moe_count   grid E:  counts[e] = pairs routed to e;
//   moe_plan    1 block: offsets (exclusive scan), tiles of TILE columns per expert in expert
//                        order (tile_expert[], -1 for unused tiles), every map entry set to -1;
//   moe_scatter grid E:  expert e's pairs in pair order take sorted positions off[e] + r and
//                        fill the maps of its tiles: tok[c] = token, pos[c] = sorted position,
//                        pair[c] = p, for column c = tile * TILE + (r % TILE).
// The host sizes everything for the worst case, max_tiles = ceil(n / TILE) + E, so nothing
// about the routing is read back.

#define MOE_TILE 8

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

extern "C" __global__ void moe_plan(const int* __restrict__ counts, int E, int max_tiles, int K,
                                    int* __restrict__ offsets, int* __restrict__ tile_base,
                                    int* __restrict__ tile_expert, int* __restrict__ tok,
                                    int* __restrict__ pos, int* __restrict__ pair) {
    pdl_entry();
    for (int c = threadIdx.x; c < max_tiles * MOE_TILE; c += blockDim.x) {
        tok[c] = -1;
        pos[c] = -1;
        pair[c] = -1;
    }
    for (int t = threadIdx.x; t < max_tiles; t += blockDim.x) tile_expert[t] = -1;
    __syncthreads();
    if (threadIdx.x == 0) {
        int off = 0, tb = 0;
        for (int e = 0; e < E; ++e) {
            offsets[e] = off;
            tile_base[e] = tb;
            const int nt = (counts[e] + MOE_TILE - 1) / MOE_TILE;
            for (int i = 0; i < nt && tb + i < max_tiles; ++i) tile_expert[tb + i] = e;
            off += counts[e];
            tb += nt;
        }
    }
}

extern "C" __global__ void moe_scatter(const int* __restrict__ ids, int n, int K,
                                       const int* __restrict__ offsets,
                                       const int* __restrict__ tile_base, int max_tiles,
                                       int* __restrict__ tok, int* __restrict__ pos,
                                       int* __restrict__ pair) {
    pdl_entry();
    __shared__ int warp_tot[32];
    const int e = blockIdx.x;
    int seen = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int p = base + threadIdx.x;
        const int mine = p < n && ids[p] == e;
        int tot;
        const int r = seen + block_excl_scan(mine, warp_tot, tot);
        if (mine) {
            const int tile = tile_base[e] + r / MOE_TILE;
            if (tile < max_tiles) {
                const int c = tile * MOE_TILE + r % MOE_TILE;
                tok[c] = p / K;
                pos[c] = offsets[e] + r;
                pair[c] = p;
            }
        }
        seen += tot;
    }
}
