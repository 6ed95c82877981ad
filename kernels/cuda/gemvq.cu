// Op `gemvq`: y = W x for decode and small batches with quantized activations and integer dot
// products (dp4a), the fast path for the weight types GLM-5 files use. Compiled once per weight
// type: the host prepends `#define GQ_QT <type id>` and `#define GQ_SUF <suffix>`.
//
// Activations (quantize.cu, "q8a"): per row of K values, int8 codes q = round(x / d) with
// d = max|x| / 127 per block of 32, plus the integer sums of the block's two halves of 16 codes
// (one 8-byte record per block: d, then the two sums as int16). A weight block's
// contribution is formed in integers and scaled once:
//   Q4_K/Q5_K sub-block j:  d8 * (d*sc_j * sum(q_w q_x) - dmin*m_j * sum(q_x))
//   Q6_K group of 16:       d8 * d*sc * (sum(q_w q_x) - 32 * sum(q_x))
//   Q8_0 / IQ4_*:           d8 * d_w * sum(v_w q_x)
//   Q4_0/Q5_0:              d8 * d_w * (sum(q_w q_x) - 8|16 * sum(q_x)); Q4_1/Q5_1 add m * d8 * sum(q_x)
// Every integer sum is exact (|sum| < 2^17), so the only approximation is the activation
// rounding (|x - d q| <= d/2): see kernels/src/gemvq.rs for the error bound.
//
// Mapping (as gemv.cu): 128 threads = 4 warps; a warp splits into 32/lpr groups of lpr lanes
// (lpr = largest power of two <= 32 dividing the row's K / TW tasks, so every lane has work
// at K = 192 .. 16384; TW = task_w<NC>(), the host's `QType::task_weights`); a group owns one
// output row; lane l takes the tasks l, l + lpr, ... of that row, each 32 weights in 16-byte
// loads (one-column Q4_K / Q6_K launches: 64) (GGUF blocks for Q4_K/Q5_K/IQ4_XS, the repacked layout
// for the types whose blocks are not 16-byte aligned). Up to NC activation columns share every weight
// load. Partial sums reduce over the group in a fixed order: bitwise reproducible.
//
// Modes: plain (optionally accumulating, y += W x: a second branch's output added onto the
// first's in the epilogue, no add launch); GLU (y = silu(W x) * (W2 x), gate and up of an FFN in
// one pass); combine (channel = token: y = sum_k cw[t,k] * W_{ids[t,k]} x_{t*topk + k}, the
// expert down projection and weighted sum of a MoE layer, in fixed slot order, no atomics).

struct Q8A {
    const int8_t* qs;
    const float2* ds;
    long long rows;
};

struct GemvQ {
    const uint8_t* w;
    const uint8_t* w2;
    long long nblk;
    int nrows, K, n_slabs, lpr;
    int count, ncols;
    const int* ids;
    const int* xidx;
    int x_div, ctopk;
    Q8A x;
    float* y;
    const int* yidx;
    long long y_stride, y_rows;
    const float* cw;
    int ksplit;
    int accum;  // plain mode: y += W x (the output's old value read first)
    // A MoE layer's shared expert riding along (null: none): GLU mode, the last channel takes
    // ws / ws2 (one slab, ws_nblk blocks) instead of an id's expert; combine mode, each channel
    // adds one more slot after its routed ones: ws times x row count * ctopk + ch, weight 1.
    const uint8_t* ws;
    const uint8_t* ws2;
    long long ws_nblk;
    // Row segments of a plain one-column launch over one input (nseg = 1: none): rows from
    // seg_row[i - 1] on read matrix seg_w[i - 1] (seg_nblk[i - 1] blocks) and write seg_y[i - 1]
    // from its row 0; the rows before seg_row[0] are w's into y. Several small products of one
    // activation (a layer's q_a, kv_a and indexer keys) then share a launch's waves.
    int nseg;
    int seg_row[2];
    const uint8_t* seg_w[2];
    float* seg_y[2];
    long long seg_nblk[2];
};

// The segment holding row `r` (rows past the end: the last one): its matrix, block count,
// output and first row. Constant indices only (a dynamically indexed parameter array would be
// copied to local memory).
struct Seg {
    const uint8_t* w;
    long long nblk;
    float* y;
    int row0;
};
DEV Seg row_seg(const GemvQ& p, int r) {
    Seg s = {p.w, p.nblk, p.y, 0};
#pragma unroll
    for (int i = 0; i < 2; ++i)
        if (i + 1 < p.nseg && r >= p.seg_row[i]) s = Seg{p.seg_w[i], p.seg_nblk[i], p.seg_y[i], p.seg_row[i]};
    return s;
}

#ifdef GGUFTOOL_EMU
// The CPU emulator's (kernels/emu): c + the four signed byte products, wrapping as the
// instruction does.
DEV int dp4a(int a, int b, int c) {
    uint32_t s = (uint32_t)c;
    for (int i = 0; i < 4; ++i) s += (uint32_t)((int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i)));
    return (int)s;
}
// prmt.b32's default mode: result byte i is byte (sel >> 4i) & 7 of the pair {b:a} (a = bytes
// 0..3), or that byte's sign replicated (0x00 / 0xFF) when bit 3 of the nibble is set.
DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    const uint64_t ba = (uint64_t)a | ((uint64_t)b << 32);
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) {
        const uint32_t n = (sel >> (4 * i)) & 0xFu;
        uint32_t v = (uint32_t)(ba >> (8 * (n & 7u))) & 0xFFu;
        if (n & 8u) v = (v & 0x80u) ? 0xFFu : 0u;
        r |= v << (8 * i);
    }
    return r;
}
#else
DEV int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
#endif
DEV int4 ldx4(const int8_t* p) { return *(const int4*)p; }
DEV int dot16(const uint32_t (&w)[4], const int4& x) {
    int s = dp4a((int)w[0], x.x, 0);
    s = dp4a((int)w[1], x.y, s);
    s = dp4a((int)w[2], x.z, s);
    return dp4a((int)w[3], x.w, s);
}
// 4-bit codes -> int8 through a 16-entry table T (4 words): the 8 nibbles of w (byte k holds
// element k in its low and element k+16 in its high nibble) become lo = T[low nibbles],
// hi = T[high nibbles], one byte per element. prmt selects with the low 3 bits of each
// selector nibble (bit 3 would replicate the sign), so the two 8-entry halves are selected
// separately and merged by bit 3.
DEV void lut4(uint32_t w, const uint32_t (&T)[4], uint32_t& lo, uint32_t& hi) {
    const uint32_t s0 = w & 0x7777u, s1 = (w >> 16) & 0x7777u;
    const uint32_t v01 = prmt(prmt(T[0], T[1], s0), prmt(T[2], T[3], s0), 0x3210u | ((w & 0x8888u) >> 1));
    const uint32_t v23 =
        prmt(prmt(T[0], T[1], s1), prmt(T[2], T[3], s1), 0x3210u | (((w >> 16) & 0x8888u) >> 1));
    lo = prmt(v01, v23, 0x6420u);
    hi = prmt(v01, v23, 0x7531u);
}
// Bits 0..3 of v to bit 0 of bytes 0..3 (the four partial products never share a bit).
DEV uint32_t spread4(uint32_t v) { return ((v & 0xFu) * 0x00204081u) & 0x01010101u; }

// Activation column j: its codes and per-block (d, sums) records.
struct XCol {
    const int8_t* q;
    const float2* ds;
};
DEV XCol xcol(const Q8A& x, int row, int K) {
    XCol c;
    c.q = x.qs + (long long)row * K;
    c.ds = x.ds + (long long)row * (K >> 5);
    return c;
}
// The sum of the 16 codes of half h of a block record.
DEV int half_sum(const float2& ds, int h) {
    const int v = __float_as_int(ds.y);
    return h ? (v >> 16) : (int)(short)(v & 0xFFFF);
}
DEV int block_sum16(const float2& ds) {
    const int v = __float_as_int(ds.y);
    return (v >> 16) + (int)(short)(v & 0xFFFF);
}

// Weights per task of an NC-column launch: 32, but GQ_TW1 (the host's define: 64 for Q4_K and
// Q6_K) in one-column launches.
template <int NC> DEV constexpr int task_w() { return NC == 1 ? GQ_TW1 : 32; }

// One task = task_w<NC>() weights of one row: `gb` = index of the row's first block, t = task
// in the row.
template <int QT> struct Task;

// Q4_K. A 32-weight task loads the 16-byte header for 16 bytes of codes; a 64-weight task (the
// two 32-element sub-blocks that share 32 code bytes, low and high nibbles) decodes the header
// once for 32 code bytes and reads each activation block record once. A one-column launch is
// bound by the per-task work at a fixed number of tasks per lane, not by bytes (H200,
// 2026-12-02: Q4_K, Q6_K and Q8_0 GEMVs of one shape all took ~30 us while their bytes differ
// 2x), so it takes 64; launches of several columns amortize the decode over their columns and
// keep 32 (twice the tasks to spread over lanes, fewer registers: pp8 measured slower with 64).
template <> struct Task<QT_Q4_K> {
    template <int NC>
    static DEV void run(const uint8_t* W, long long, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&)[4], float (&acc)[NC]) {
        static_assert(task_w<NC>() == 32 || task_w<NC>() == 64, "Q4_K tasks are 32 or 64 weights");
        if constexpr (task_w<NC>() == 32) {
            const int sb = t >> 3, c = (t & 7) >> 1, h = t & 1;
            const uint8_t* blk = W + (gb + sb) * 144;
            const uint4 hd = ldw4(blk), q = ldw4(blk + 16 + 32 * c + 16 * h);
            float d0, m0, d1, m1;
            k_scales(hd, 2 * c, d0, m0);
            k_scales(hd, 2 * c + 1, d1, m1);
            const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
            uint32_t lo[4], hi[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                lo[k] = qw[k] & 0x0F0F0F0Fu;
                hi[k] = (qw[k] >> 4) & 0x0F0F0F0Fu;
            }
            const int k0 = sb * 256 + 64 * c + 16 * h;
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (j >= nc) break;
                const int a = dot16(lo, ldx4(x[j].q + k0)), b = dot16(hi, ldx4(x[j].q + k0 + 32));
                const float2 da = x[j].ds[k0 >> 5], db = x[j].ds[(k0 >> 5) + 1];
                acc[j] += da.x * (d0 * (float)a - m0 * (float)half_sum(da, h)) +
                          db.x * (d1 * (float)b - m1 * (float)half_sum(db, h));
            }
        } else {
            const int sb = t >> 2, c = t & 3;
            const uint8_t* blk = W + (gb + sb) * 144;
            // Every load of the task first, so all of them are in flight together.
            const uint4 hd = ldw4(blk), q0 = ldw4(blk + 16 + 32 * c), q1 = ldw4(blk + 32 + 32 * c);
            float d0, m0, d1, m1;
            k_scales(hd, 2 * c, d0, m0);
            k_scales(hd, 2 * c + 1, d1, m1);
            const uint32_t wa[4] = {q0.x, q0.y, q0.z, q0.w}, wb[4] = {q1.x, q1.y, q1.z, q1.w};
            uint32_t la[4], ha[4], lb[4], hb[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                la[k] = wa[k] & 0x0F0F0F0Fu;
                ha[k] = (wa[k] >> 4) & 0x0F0F0F0Fu;
                lb[k] = wb[k] & 0x0F0F0F0Fu;
                hb[k] = (wb[k] >> 4) & 0x0F0F0F0Fu;
            }
            // Elements k0 .. k0 + 31 are the low nibbles of the 32 bytes, k0 + 32 .. k0 + 63
            // the high ones: activation blocks k0/32 and k0/32 + 1, whole.
            const int k0 = sb * 256 + 64 * c;
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (j >= nc) break;
                const int8_t* xq = x[j].q + k0;
                const int a = dot16(lb, ldx4(xq + 16)) + dot16(la, ldx4(xq));
                const int b = dot16(hb, ldx4(xq + 48)) + dot16(ha, ldx4(xq + 32));
                const float2 da = x[j].ds[k0 >> 5], db = x[j].ds[(k0 >> 5) + 1];
                acc[j] += da.x * (d0 * (float)a - m0 * (float)block_sum16(da)) +
                          db.x * (d1 * (float)b - m1 * (float)block_sum16(db));
            }
        }
    }
};

template <> struct Task<QT_Q5_K> {
    template <int NC>
    static DEV void run(const uint8_t* W, long long, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&)[4], float (&acc)[NC]) {
        const int sb = t >> 3, c = (t & 7) >> 1, h = t & 1;
        const uint8_t* blk = W + (gb + sb) * 176;
        const uint4 hd = ldw4(blk), q = ldw4(blk + 48 + 32 * c + 16 * h), qh = ldw4(blk + 16 + 16 * h);
        float d0, m0, d1, m1;
        k_scales(hd, 2 * c, d0, m0);
        k_scales(hd, 2 * c + 1, d1, m1);
        const uint32_t qw[4] = {q.x, q.y, q.z, q.w}, hw[4] = {qh.x, qh.y, qh.z, qh.w};
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            lo[k] = (qw[k] & 0x0F0F0F0Fu) | (((hw[k] >> (2 * c)) & 0x01010101u) << 4);
            hi[k] = ((qw[k] >> 4) & 0x0F0F0F0Fu) | (((hw[k] >> (2 * c + 1)) & 0x01010101u) << 4);
        }
        const int k0 = sb * 256 + 64 * c + 16 * h;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j >= nc) break;
            const int a = dot16(lo, ldx4(x[j].q + k0)), b = dot16(hi, ldx4(x[j].q + k0 + 32));
            const float2 da = x[j].ds[k0 >> 5], db = x[j].ds[(k0 >> 5) + 1];
            acc[j] += da.x * (d0 * (float)a - m0 * (float)half_sum(da, h)) +
                      db.x * (d1 * (float)b - m1 * (float)half_sum(db, h));
        }
    }
};

// Q6_K repacked: task p of a superblock covers, in half hh = p/4, the 16 elements r = 16*pp + i
// (low nibbles of ql[64hh + 16pp + i], high bits at shift 2*(pp/2)) and r = 64 + 16*pp + i (high
// nibbles, shift 4 more), pp = p % 4; each group of 16 has one scale. A 64-weight task (one-column
// launches, as Q4_K's) takes pp = m and m + 2 of a half: they share their 16 bytes of high bits,
// the 8 scale bytes of the half and d, so 3 vector loads serve 64 weights instead of 4.
template <> struct Task<QT_Q6_K_R> {
    template <int NC>
    static DEV void run(const uint8_t* W, long long nblk, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&)[4], float (&acc)[NC]) {
        static_assert(task_w<NC>() == 32 || task_w<NC>() == 64, "Q6_K tasks are 32 or 64 weights");
        if constexpr (task_w<NC>() == 32) {
            const int sb = t >> 3, hh = (t & 7) >> 2, pp = t & 3;
            const long long g = gb + sb;
            const uint8_t* b = W + g * 192;
            const uint4 ql = ldw4(b + 64 * hh + 16 * pp), qh = ldw4(b + 128 + 32 * hh + 16 * (pp & 1));
            const int sa = 2 * (pp >> 1), sbb = sa + 4;
            const uint32_t lw[4] = {ql.x, ql.y, ql.z, ql.w}, hw[4] = {qh.x, qh.y, qh.z, qh.w};
            uint32_t qa[4], qb[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                qa[k] = (lw[k] & 0x0F0F0F0Fu) | (((hw[k] >> sa) & 0x03030303u) << 4);
                qb[k] = ((lw[k] >> 4) & 0x0F0F0F0Fu) | (((hw[k] >> sbb) & 0x03030303u) << 4);
            }
            const uint8_t* scp = W + nblk * 192 + g * 16 + 8 * hh + pp;
            const float d = rp_f16(W + nblk * 208 + 2 * g);
            const float sca = d * (float)(int8_t)scp[0], scb = d * (float)(int8_t)scp[4];
            const int k0 = sb * 256 + 128 * hh + 16 * pp, k1 = k0 + 64;
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (j >= nc) break;
                const float2 da = x[j].ds[k0 >> 5], db = x[j].ds[k1 >> 5];
                const int a = dot16(qa, ldx4(x[j].q + k0)) - 32 * half_sum(da, pp & 1);
                const int bb = dot16(qb, ldx4(x[j].q + k1)) - 32 * half_sum(db, pp & 1);
                acc[j] += sca * da.x * (float)a + scb * db.x * (float)bb;
            }
        } else {
            const int sb = t >> 2, hh = (t & 3) >> 1, m = t & 1;
            const long long g = gb + sb;
            const uint8_t* b = W + g * 192;
            // Every load of the task first, so all of them are in flight together.
            const uint4 l0 = ldw4(b + 64 * hh + 16 * m), l1 = ldw4(b + 64 * hh + 16 * m + 32);
            const uint4 qh = ldw4(b + 128 + 32 * hh + 16 * m);
            const uint2 sc = ldw2(W + nblk * 192 + g * 16 + 8 * hh);  // s[pp] in .x, s[pp + 4] in .y
            const float d = rp_f16(W + nblk * 208 + 2 * g);
            const uint32_t hw[4] = {qh.x, qh.y, qh.z, qh.w};
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int pp = m + 2 * u, sa = 2 * u, sbb = sa + 4;
                const uint4 ql = u ? l1 : l0;
                const uint32_t lw[4] = {ql.x, ql.y, ql.z, ql.w};
                uint32_t qa[4], qb[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    qa[k] = (lw[k] & 0x0F0F0F0Fu) | (((hw[k] >> sa) & 0x03030303u) << 4);
                    qb[k] = ((lw[k] >> 4) & 0x0F0F0F0Fu) | (((hw[k] >> sbb) & 0x03030303u) << 4);
                }
                const float sca = d * (float)(int8_t)((sc.x >> (8 * pp)) & 0xFFu);
                const float scb = d * (float)(int8_t)((sc.y >> (8 * pp)) & 0xFFu);
                const int k0 = sb * 256 + 128 * hh + 16 * pp, k1 = k0 + 64;
#pragma unroll
                for (int j = 0; j < NC; ++j) {
                    if (j >= nc) break;
                    const float2 da = x[j].ds[k0 >> 5], db = x[j].ds[k1 >> 5];
                    const int a = dot16(qa, ldx4(x[j].q + k0)) - 32 * half_sum(da, m);
                    const int bb = dot16(qb, ldx4(x[j].q + k1)) - 32 * half_sum(db, m);
                    acc[j] += sca * da.x * (float)a + scb * db.x * (float)bb;
                }
            }
        }
    }
};

template <> struct Task<QT_Q8_0_R> {
    template <int NC>
    static DEV void run(const uint8_t* W, long long nblk, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&)[4], float (&acc)[NC]) {
        const long long g = gb + t;
        const uint4 a = ldw4(W + 32 * g), b = ldw4(W + 32 * g + 16);
        const float d = rp_f16(W + 32 * nblk + 2 * g);
        const uint32_t wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
        const int k0 = 32 * t;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j >= nc) break;
            const int s = dot16(wa, ldx4(x[j].q + k0)) + dot16(wb, ldx4(x[j].q + k0 + 16));
            acc[j] += d * x[j].ds[t].x * (float)s;
        }
    }
};

// The 32-weight legacy blocks (repacked): low nibbles are elements 0..15, high 16..31.
// OFF: the code offset (8 for Q4_0, 16 for Q5_0; 0 with a min); MIN: the block has a min m.
template <int QT, int OFF, bool FIVE, bool MIN>
struct Legacy {
    template <int NC>
    static DEV void run(const uint8_t* W, long long nblk, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&)[4], float (&acc)[NC]) {
        const long long g = gb + t;
        const uint4 q = ldw4(W + 16 * g);
        const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
        uint32_t lo[4], hi[4];
        uint32_t qh = 0;
        if (FIVE) qh = ldw32(W + 16 * nblk + 4 * g);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            lo[k] = qw[k] & 0x0F0F0F0Fu;
            hi[k] = (qw[k] >> 4) & 0x0F0F0F0Fu;
            if (FIVE) {
                lo[k] |= spread4(qh >> (4 * k)) << 4;
                hi[k] |= spread4(qh >> (16 + 4 * k)) << 4;
            }
        }
        const long long dofs = (FIVE ? 20 : 16) * nblk;
        const float d = rp_f16(W + dofs + 2 * g);
        const float m = MIN ? rp_f16(W + dofs + 2 * nblk + 2 * g) : 0.0f;
        const int k0 = 32 * t;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j >= nc) break;
            const float2 ds = x[j].ds[t];
            const int sum = block_sum16(ds);
            const int s = dot16(lo, ldx4(x[j].q + k0)) + dot16(hi, ldx4(x[j].q + k0 + 16));
            if (MIN)
                acc[j] += ds.x * (d * (float)s + m * (float)sum);
            else
                acc[j] += d * ds.x * (float)(s - OFF * sum);
        }
    }
};
template <> struct Task<QT_Q4_0_R> : Legacy<QT_Q4_0_R, 8, false, false> {};
template <> struct Task<QT_Q4_1_R> : Legacy<QT_Q4_1_R, 0, false, true> {};
template <> struct Task<QT_Q5_0_R> : Legacy<QT_Q5_0_R, 16, true, false> {};
template <> struct Task<QT_Q5_1_R> : Legacy<QT_Q5_1_R, 0, true, true> {};

template <> struct Task<QT_IQ4_NL_R> {
    template <int NC>
    static DEV void run(const uint8_t* W, long long nblk, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&T)[4], float (&acc)[NC]) {
        const long long g = gb + t;
        const uint4 q = ldw4(W + 16 * g);
        const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) lut4(qw[k], T, lo[k], hi[k]);
        const float d = rp_f16(W + 16 * nblk + 2 * g);
        const int k0 = 32 * t;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j >= nc) break;
            const int s = dot16(lo, ldx4(x[j].q + k0)) + dot16(hi, ldx4(x[j].q + k0 + 16));
            acc[j] += d * x[j].ds[t].x * (float)s;
        }
    }
};

// IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} (136 B, 8-byte aligned): sub-block j
// of 32 in Q4_0 nibble order with the 6-bit scale ls, dl = d * (ls - 32).
template <> struct Task<QT_IQ4_XS> {
    template <int NC>
    static DEV void run(const uint8_t* W, long long, long long gb, int t, const XCol (&x)[NC],
                        int nc, const uint32_t (&T)[4], float (&acc)[NC]) {
        const int sb = t >> 3, j8 = t & 7;
        const uint8_t* blk = W + (gb + sb) * 136;
        const uint2 h = ldw2(blk);
        const uint2 qa = ldw2(blk + 8 + 16 * j8), qb = ldw2(blk + 16 + 16 * j8);
        const float d = f16_to_f32((uint16_t)(h.x & 0xFFFF));
        const uint32_t sh = h.x >> 16;
        const uint32_t sl = (h.y >> (8 * (j8 >> 1))) & 0xFF;
        const uint32_t ls = ((sl >> (4 * (j8 & 1))) & 0xF) | (((sh >> (2 * j8)) & 3) << 4);
        const float dl = d * (float)((int)ls - 32);
        const uint32_t qw[4] = {qa.x, qa.y, qb.x, qb.y};
        uint32_t lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) lut4(qw[k], T, lo[k], hi[k]);
        const int k0 = sb * 256 + 32 * j8;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j >= nc) break;
            const int s = dot16(lo, ldx4(x[j].q + k0)) + dot16(hi, ldx4(x[j].q + k0 + 16));
            acc[j] += dl * x[j].ds[k0 >> 5].x * (float)s;
        }
    }
};

DEV float group_sum(float v, int lpr) {
    for (int o = lpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
DEV float silu(float g) { return g / (1.0f + expf(-g)); }

// Sum of the KS warps' partial results of a block's row groups, in warp order (fixed: bitwise
// reproducible); `red` holds one value per (warp, group), warps base .. base + ks - 1 share a
// row group. Returns the sum on the warp with wk == 0 (the others' value is unused). Every
// thread of the block must call it.
DEV float ksplit_sum(float v, float* red, int warp, int base, int wk, int ks, int grp, int gl) {
    if (gl == 0) red[warp * 32 + grp] = v;
    __syncthreads();
    float s = 0.0f;
    if (wk == 0)
        for (int w = 0; w < ks; ++w) s += red[(base + w) * 32 + grp];
    __syncthreads();  // `red` is reused by the next channel
    return s;
}

// MODE 0 plain, 1 GLU, 2 combine. One-column launches may split a row group's tasks (combine:
// its expert slots) over KS = p.ksplit warps of the block (1, 2 or 4, the host's choice against
// the tail of the last wave: a launch of 1.3 waves runs its last 0.3 at a quarter of the speed).
// R > 1: a lane group owns R consecutive rows and each of its lanes runs the same task of all
// R, so the activation codes and records a task loads for its NC columns serve R rows (the
// loads are identical and nothing is stored in between: the compiler keeps them). With one row
// per group the NC-column kernels were bound by those loads, not by the weights (8 columns:
// 4.6x the one-column time per weight pass, H200). One column too: a lane's 64 activation bytes
// of a 64-weight task are 4 16-byte loads 64 bytes apart across the warp, each touching 16
// cache lines (L1 wavefronts) for 512 bytes, so a Q4_K task's activation loads cost ~2.5x the
// wavefronts of its weight loads; R rows divide them by R. Each row's sums are the same
// products in the same order as with R = 1: bitwise the one-row kernels.
template <int QT, int NC, int MODE, int R = 1>
DEV void gemvq_impl(const GemvQ& p, const QTables& tb) {
    static_assert(R == 1 || R == 2 || R == 4, "1, 2 or 4 rows per lane group");
    __shared__ float red[2][4 * 32];
    pdl_entry();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int lpr = p.lpr, groups = 32 / lpr;
    const int KS = NC == 1 ? p.ksplit : 1;
    const int wk = warp % KS;
    const int gl = lane & (lpr - 1), grp = lane / lpr;
    const int row = ((blockIdx.x * (4 / KS) + warp / KS) * groups + grp) * R;
    const int rr = min(row, p.nrows - 1);
    const int nt = p.K / task_w<NC>();  // tasks per row (the host's lanes-per-row divides it)
    const long long bpr = p.K / QTraits<QT>::QB;
    const float nan = __int_as_float(0x7fc00000);
    uint32_t T[4] = {0, 0, 0, 0};
    if (QT == QT_IQ4_NL_R || QT == QT_IQ4_XS) {
        const uint4 v = *(const uint4*)tb.kvalues;
        T[0] = v.x;
        T[1] = v.y;
        T[2] = v.z;
        T[3] = v.w;
    }
    for (long long ch = blockIdx.y; ch < p.count; ch += gridDim.y) {
        if (MODE == 2) {
            // Rows past the end repeat the last row (results discarded).
            int rrow[R];
            float acc[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                rrow[r] = r == 0 ? rr : min(row + r, p.nrows - 1);
                acc[r] = 0.0f;
            }
            const int slots = p.ctopk + (p.ws ? 1 : 0);
            for (int k = wk; k < slots; k += KS) {
                if (k == p.ctopk) {  // the shared expert (uniform across the warp)
                    const long long xrow = p.count * p.ctopk + ch;
                    if (xrow >= p.x.rows) {
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r] = nan;
                        continue;
                    }
                    XCol xc[1] = {xcol(p.x, (int)xrow, p.K)};
                    float a[R][1];
#pragma unroll
                    for (int r = 0; r < R; ++r) a[r][0] = 0.0f;
                    for (int t = gl; t < nt; t += lpr)
#pragma unroll
                        for (int r = 0; r < R; ++r)
                            Task<QT>::template run<1>(p.ws, p.ws_nblk, (long long)rrow[r] * bpr, t, xc, 1, T, a[r]);
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] += a[r][0];
                    continue;
                }
                const long long slot = ch * p.ctopk + k;
                const int e = p.ids[slot];
                if (e < 0) continue;  // empty slot (uniform across the warp)
                if (e >= p.n_slabs || slot >= p.x.rows) {
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r] = nan;
                    continue;
                }
                XCol xc[1] = {xcol(p.x, (int)slot, p.K)};
                float a[R][1];
                long long gb[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    a[r][0] = 0.0f;
                    gb[r] = ((long long)e * p.nrows + rrow[r]) * bpr;
                }
                for (int t = gl; t < nt; t += lpr)
#pragma unroll
                    for (int r = 0; r < R; ++r) Task<QT>::template run<1>(p.w, p.nblk, gb[r], t, xc, 1, T, a[r]);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] += p.cw[slot] * a[r][0];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float v = group_sum(acc[r], lpr);
                if (KS > 1) v = ksplit_sum(v, red[0], warp, warp - wk, wk, KS, grp, gl);
                if (wk == 0 && gl == 0 && row + r < p.nrows && ch < p.y_rows) p.y[ch * p.y_stride + row + r] = v;
            }
            continue;
        }
        // The shared expert's channel (GLU with ws set: the last one) reads no id.
        const bool shared = MODE == 1 && p.ws && ch == p.count - 1;
        const long long e = shared ? 0 : p.ids ? (long long)p.ids[ch] : ch % p.n_slabs;
        if (p.ids && !shared && e == -1) continue;  // empty channel (padding tile of a grouped launch)
        const bool bad = e < 0 || e >= p.n_slabs;
        const uint8_t* W1 = shared ? p.ws : p.w;
        const uint8_t* W2 = shared ? p.ws2 : p.w2;
        long long nblk = shared ? p.ws_nblk : p.nblk;
        // Row segments (one channel, no ids: e == 0): this lane group's matrix and row in it.
        int row0 = 0;
        if (MODE == 0 && NC == 1 && p.nseg > 1) {
            const Seg sg = row_seg(p, min(row, p.nrows - 1));
            W1 = sg.w;
            nblk = sg.nblk;
            row0 = sg.row0;
        }
        int xr[NC];
        XCol xc[NC];
        int nc = 0;
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            xr[j] = -1;
            if (j < p.ncols)
                xr[j] = p.xidx ? p.xidx[ch * p.ncols + j] : (int)((ch / p.x_div) * p.ncols + j);
            // Columns are packed: the first invalid one ends the channel's columns.
            if (xr[j] >= 0 && xr[j] < p.x.rows && nc == j) nc = j + 1;
            xc[j] = xcol(p.x, xr[j] >= 0 && xr[j] < p.x.rows ? xr[j] : 0, p.K);
        }
        float acc[R][NC], acc2[R][NC];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NC; ++j) acc[r][j] = acc2[r][j] = 0.0f;
        // One column with several rows or matrices: a channel without its input row computes
        // nothing (nothing is written), and the tasks see the column count as the constant 1:
        // with `nc` each row's task (and the GLU's up matrix) kept its own `j < nc` branch around
        // the activation loads, and the compiler loaded them again for each (PTX: 4 rows, 4
        // times the loads). The one-row plain kernel keeps `nc`: its code is unchanged (with the
        // constant, ptxas spilled its Q6_K task pair at the 56 registers of 9 blocks per SM).
        constexpr bool shared_x = NC == 1 && (R > 1 || MODE == 1);
        if (!bad && (!shared_x || nc > 0)) {
            const int ncols = shared_x ? 1 : nc;
            // Rows past the end repeat the last row (results discarded): no branch in the loop.
            long long gb[R];
#pragma unroll
            for (int r = 0; r < R; ++r) gb[r] = (e * p.nrows + min(row + r, p.nrows - 1) - row0) * bpr;
            const int step = lpr * KS;
            // One task of every row (and matrix): with 4 one-column rows that is already 4 tasks'
            // weight loads in flight, and unrolling would double the registers holding them.
            auto tasks = [&](int t) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    Task<QT>::template run<NC>(W1, nblk, gb[r], t, xc, ncols, T, acc[r]);
                    if (MODE == 1) Task<QT>::template run<NC>(W2, nblk, gb[r], t, xc, ncols, T, acc2[r]);
                }
            };
            if constexpr (NC == 1 && R * (MODE == 1 ? 2 : 1) >= 4) {
#pragma unroll 1
                for (int t = wk * lpr + gl; t < nt; t += step) tasks(t);
            } else {
#pragma unroll 2
                for (int t = wk * lpr + gl; t < nt; t += step) tasks(t);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NC; ++j) {
            if (j >= nc) break;
            float v = group_sum(acc[r][j], lpr), v2 = MODE == 1 ? group_sum(acc2[r][j], lpr) : 0.0f;
            if (KS > 1) {
                v = ksplit_sum(v, red[0], warp, warp - wk, wk, KS, grp, gl);
                if (MODE == 1) v2 = ksplit_sum(v2, red[1], warp, warp - wk, wk, KS, grp, gl);
            }
            if (MODE == 1) v = silu(v) * v2;
            if (bad) v = nan;
            const long long yr = p.yidx ? (long long)p.yidx[ch * p.ncols + j] : ch * p.ncols + j;
            if (wk == 0 && gl == 0 && row + r < p.nrows && yr >= 0 && yr < p.y_rows) {
                // One thread owns each output: the read-modify-write needs no atomics, and the
                // single f32 add is the add kernel's (bitwise `y + W x`). __fadd_rn: a plain `+`
                // was contracted with the product that ends v (Q6_K's d * sum) into one fma,
                // one rounding fewer than the separate GEMV and add (H200: not bitwise).
                float* yp = p.y + yr * p.y_stride + row + r;
                // The host keeps segment boundaries at multiples of R: a group's rows share one.
                if (MODE == 0 && NC == 1 && p.nseg > 1) yp = row_seg(p, row).y + (row + r - row0);
                *yp = MODE == 0 && p.accum ? __fadd_rn(*yp, v) : v;
            }
        }
    }
}

#define GQ_CAT2(a, b) a##b
#define GQ_CAT(a, b) GQ_CAT2(a, b)
// One-column launches (decode) ask for resident blocks per SM (the last number: 9 blocks = <= 56
// registers, 8 = 64; tests/compile.rs checks that none spills; the GLU kernel spilled for Q6_K
// at 7 and keeps its registers): their speed is the memory parallelism of the warps an SM holds,
// and the 64-weight tasks' registers would otherwise cost blocks (Q6_K 73 registers: 6 per SM).
#define GQ_KERNEL(name, NC, MODE, MINB, R)                                                           \
    extern "C" __global__ void __launch_bounds__(128, MINB) GQ_CAT(name, GQ_SUF)(GemvQ p, QTables t) { \
        gemvq_impl<GQ_QT, NC, MODE, R>(p, t);                                                        \
    }
GQ_KERNEL(gemvq1_, 1, 0, 9, 1)
GQ_KERNEL(gemvq2_, 2, 0, 1, 1)
GQ_KERNEL(gemvq4_, 4, 0, 1, 1)
GQ_KERNEL(gemvq8_, 8, 0, 1, 1)
GQ_KERNEL(gemvq_glu1_, 1, 1, 1, 1)
GQ_KERNEL(gemvq_glu8_, 8, 1, 1, 1)
GQ_KERNEL(gemvq_comb_, 1, 2, 8, 1)
// One column, several rows per lane group (the host's `GGUFTOOL_GEMVQ1_ROWS`). sm_120's ptxas
// spilled a register of the Q6_K task at the sm_90 caps: one block per SM fewer there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define GQ_MINB(sm90, sm120) sm120
#else
#define GQ_MINB(sm90, sm120) sm90
#endif
GQ_KERNEL(gemvq1r2_, 1, 0, GQ_MINB(6, 4), 2)
GQ_KERNEL(gemvq1r4_, 1, 0, GQ_MINB(4, 3), 4)
GQ_KERNEL(gemvq_glu1r_, 1, 1, 1, 2)
GQ_KERNEL(gemvq_comb_r_, 1, 2, 4, 2)
// Several rows per lane group (the host's `GEMVQ_VARIANTS` rows field; `GGUFTOOL_GEMVQ_ROWS=1`
// keeps the one-row kernels above).
GQ_KERNEL(gemvq2r_, 2, 0, 1, 4)
GQ_KERNEL(gemvq4r_, 4, 0, 1, 4)
GQ_KERNEL(gemvq8r_, 8, 0, 1, 2)
GQ_KERNEL(gemvq_glu8r_, 8, 1, 1, 2)
