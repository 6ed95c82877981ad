// Op `mmq`: y = W x for 8..64 activation columns on the int8 tensor cores (mma.sync m16n8k32
// .s8), reading the QUANTIZED weights once per launch and never dequantizing them to memory:
// the prefill / batched-decode counterpart of gemvq.cu, for steps of 9-64 tokens and the
// grouped MoE tiles of moe_sort.cu. Compiled once per weight type: the host prepends
// `#define MQ_QT <type id>` and `#define MQ_SUF <suffix>` (kernels/src/ops.rs).
//
// Math. Activations are q8a (quantize.cu): per block of 32 values int8 codes q_x and a record
// {f32 dx; i16 sum of codes 0..15; i16 of 16..31}. For one 32-weight block of one row the
// integer dot product of weight codes and activation codes comes from the mma, then the same f32
// scaling per block as gemvq:
//   Q4_K/Q5_K sub-block j:  acc += (d*sc_j * dx) * isum - (dmin*m_j) * (dx * sum(q_x))
//   Q6_K group of 16:       acc += (d*sc * dx) * isum16   (codes q - 32 signed, see MqType)
//   Q8_0:                   acc += (d * dx) * isum
// Every integer sum is exact (|isum| < 2^20). It leaves the mma as 0x4B400000 + isum (the
// accumulator input is that constant), whose bits are the float 1.5 * 2^23 + isum exactly, so
// one FADD converts it (I2F is a quarter-rate instruction). The only approximation is the
// activation rounding, as for gemvq (kernels/src/gemvq.rs), plus f32 rounding of the scaling.
//
// Fragments (PTX ISA, mma.m16n8k32 with .s8; lane = 4 * g + t): A (16 x 32, row-major) a0 =
// row g, k 4t..4t+3 (byte i = k 4t+i), a1 = row g+8, same k, a2 = row g, k 16+4t..16+4t+3,
// a3 = row g+8, k 16+4t..; B (32 x 8) b0 = k 4t..4t+3 of column g, b1 = k 16+4t.. of column g;
// C/D (16 x 8 s32) c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1).
// A block's dot product is an integer sum, so the k order inside a block is free as long as A
// and B use the same one: here mma k-slots 4t..4t+3 hold block positions 8t..8t+3 and slots
// 16+4t..16+4t+3 positions 8t+4..8t+7. A lane then needs 8 CONSECUTIVE code bytes of each of
// its two rows per block (one 8-byte load straight from the weights: Q4_K's 32 code bytes of a
// sub-block pair serve two blocks, low and high nibbles) and 8 consecutive activation codes of
// its column (one 8-byte shared-memory load).
//
// Mapping. A block of 32 * nw threads (the host's plan, kernels/src/mmq.rs `mmq_plan`) holds
// nw / ks row tiles of 16 rows, each computed by ks warps that split K (ks = 1, 2, 4 or 8); a
// warp computes its 16 rows for all NC columns. K is walked in steps of MQ_STEP = 128: window w
// of the block is steps w*ks .. w*ks + ks - 1, warp kp of a tile takes step w*ks + kp. A
// window's data goes to shared memory by cp.async in a ring of MQ_STAGES stages (window w + 2
// and w + 3 are in flight while w is computed): the activations of all NC columns (codes and
// records, read by every warp) and each warp's own weight rows (each byte read once per
// launch), which the lanes then read into their A fragments. Partial sums
// of the ks warps of a tile meet in shared memory and are added in warp order: no float
// atomics, the same result on every run. Channels (grid.y, grid-strided) are independent
// matrix products as in gemvq (expert slab per channel, column maps, -1 = unused).

#define MQ_STEP 128
#define MQ_MAGIC_I 0x4B400000
#define MQ_MAGIC_F 12582912.0f

struct MqQ8A {
    const int8_t* qs;
    const float2* ds;
    long long rows;
};

// The kernel parameter (`MmqParams` in kernels/src/mmq.rs; no padding: 8-byte fields first).
struct Mmq {
    const uint8_t* w;
    const uint8_t* w2;  // GLU: the up matrix (same shape and type)
    long long nblk;     // decoder blocks of the whole tensor (the repacked layouts' regions)
    const int* ids;     // slab per channel (null: ch % n_slabs); -1 skips the channel
    const int* xidx;    // activation row of column j of channel ch (null: (ch/x_div)*ncols + j)
    MqQ8A x;
    float* y;
    const int* yidx;  // output row of (ch, j) (null: ch*ncols + j); -1: not written
    long long y_stride, y_rows;
    float* ws;  // k-slices' partial sums (kz > 1): [z][matrix][column][row], see mmq_reduce
    int nrows, K, n_slabs, count, ncols, x_div, ks, accum;
    int srow;  // shared-memory bytes per staged weight row (the host's `mmq_stage_row_bytes`,
               // checked against the type's SROW at entry)
    int kz;    // k-slices (grid.z): slice z takes windows z * wpz .. z * wpz + wpz - 1
    int wpz;
    int pad_;
};

// ---- the tensor-core product ------------------------------------------------------------------

// Signed 8-bit dot product of two words (4 lanes each).
DEV int mq_dot4(uint32_t a, uint32_t b) {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) s += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return s;
}

// D = A B + C with the fragments of mma.m16n8k32.s8 (layout above), computed with warp shuffles:
// every lane fetches row g's and row g+8's A words and column 2t's and 2t+1's B words from the
// lanes holding them. The CPU emulator runs this in place of the instruction, and the GPU test
// `mma_s8_selftest` checks both against each other and a CPU product. All 32 lanes must call it.
DEV void mma_s8_16832_shfl(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                           const int (&c)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int s[4] = {c[0], c[1], c[2], c[3]};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        // Lane 4g+q holds row g (a0: k 4q.., a2: k 16+4q..) and row g+8 (a1, a3).
        const int la = 4 * g + q, l0 = 8 * t + q, l1 = 8 * t + 4 + q;
        const uint32_t r0 = __shfl_sync(0xffffffffu, a[0], la), r8 = __shfl_sync(0xffffffffu, a[1], la);
        const uint32_t r0h = __shfl_sync(0xffffffffu, a[2], la), r8h = __shfl_sync(0xffffffffu, a[3], la);
        // Lane 4n+q holds column n (b0: k 4q.., b1: k 16+4q..); n = 2t is lane 8t+q, 2t+1 is 8t+4+q.
        const uint32_t c0 = __shfl_sync(0xffffffffu, b[0], l0), c0h = __shfl_sync(0xffffffffu, b[1], l0);
        const uint32_t c1 = __shfl_sync(0xffffffffu, b[0], l1), c1h = __shfl_sync(0xffffffffu, b[1], l1);
        s[0] += mq_dot4(r0, c0) + mq_dot4(r0h, c0h);
        s[1] += mq_dot4(r0, c1) + mq_dot4(r0h, c1h);
        s[2] += mq_dot4(r8, c0) + mq_dot4(r8h, c0h);
        s[3] += mq_dot4(r8, c1) + mq_dot4(r8h, c1h);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = s[i];
}

// The product the kernels use: the instruction on the device, the shuffles under the emulator.
DEV void mma_s8_16832(int (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const int (&c)[4]) {
#ifdef GGUFTOOL_EMU
    mma_s8_16832_shfl(d, a, b, c);
#else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
#endif
}

// global -> shared without registers: 16 bytes (L2 only: the activations are re-read by other
// blocks, not by this one), and 8 / 4 bytes for the pieces of weight rows smaller than that.
// Every load of the main loop goes this way: a load into registers would share its scoreboard
// with every other outstanding one (ptxas gave the weight prefetch and the records one), so
// its first use waited for all of them and no prefetch survived. cp.async groups complete in
// order: wait_group N waits for all but the N most recent. The emulator copies at once (the
// same thing to a reader that waits) and checks the alignment the instruction requires.
#ifdef GGUFTOOL_EMU
DEV void mq_cp_check(const void* dst, const void* src, unsigned n) {
    if (((unsigned long long)dst | (unsigned long long)src) & (n - 1)) __builtin_trap();
}
#endif
DEV void mq_cp16(void* dst, const void* src) {
#ifdef GGUFTOOL_EMU
    mq_cp_check(dst, src, 16);
    *(uint4*)dst = *(const uint4*)src;
#else
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src) : "memory");
#endif
}
DEV void mq_cp8(void* dst, const void* src) {
#ifdef GGUFTOOL_EMU
    mq_cp_check(dst, src, 8);
    *(uint2*)dst = *(const uint2*)src;
#else
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(sa), "l"(src) : "memory");
#endif
}
DEV void mq_cp4(void* dst, const void* src) {
#ifdef GGUFTOOL_EMU
    mq_cp_check(dst, src, 4);
    *(uint32_t*)dst = *(const uint32_t*)src;
#else
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sa), "l"(src) : "memory");
#endif
}
DEV void mq_cp_commit() {
#ifndef GGUFTOOL_EMU
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N> DEV void mq_cp_wait_group() {
#ifndef GGUFTOOL_EMU
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
DEV void mq_cp_wait() {
#ifndef GGUFTOOL_EMU
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// ---- weight types -----------------------------------------------------------------------------

// The A operands of one 32-k block (a "chunk") for the lane's rows g and g+8: NA mma operands
// (Q6_K: 2, one per group of 16) and each one's row scales, plus the rows' min terms (Q4_K, Q5_K).
// a[o][0] / a[o][2]: row g's words (positions 8t..8t+3 / 8t+4..8t+7); a[o][1] / a[o][3]: row g+8's.
template <int NA> struct MqChunk {
    uint32_t a[NA][4];
    float s[NA][2];
    float m[2];
};

// Per type: a 128-k step of one row is staged in shared memory as SROW bytes (`src16` = the
// source of 16-byte piece q < N16, which lands at 16q; `small` copies the pieces below 16 bytes,
// one lane per row; rb = index of the row's first decoder block, s = step). `Frag` = the words
// a lane reads of its rows g and g+8 (`load`, from the staged rows r0 / r1); `prep` forms what
// the step's chunks share; `chunk` forms chunk i (0..3) of the step. A lane reads 8 bytes (or
// its quarter of a row's scales: the four lanes of a row share them through shuffles instead
// of each holding all of them). prep and chunk shuffle: the whole warp calls them.
template <int QT> struct MqType;

// Byte i of w (unsigned, or signed for mq_s8f) as an exact float: one PRMT builds the float
// 2^23 + byte (bytes {byte, 0, 0, 0x4B}; u2f_small's trick) and one FADD removes 2^23.
DEV float mq_u8f(uint32_t w, int i) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | i)) - 8388608.0f;
}
DEV float mq_s8f(uint32_t w, int i) {
    return __uint_as_float(__byte_perm(w ^ 0x80808080u, 0x4B000000u, 0x7440u | i)) - 8388736.0f;
}

DEV uint32_t mq_row_word(uint32_t v, int q) {
    return __shfl_sync(0xffffffffu, v, (threadIdx.x & 28) | q);
}

// Q4_K/Q5_K header {f16 d; f16 dmin; u8 scales[12]}, lane t holding word t of it: d, dmin and
// the 6-bit scales / mins of the half hh's 4 sub-blocks, one byte each (k_scales' layout).
struct MqKPrep {
    float d[2], dm[2];
    uint32_t sc[2], m[2];
};
DEV void mq_kprep(const uint32_t (&h)[2], int hh, MqKPrep& P) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint32_t w0 = mq_row_word(h[r], 0), w1 = mq_row_word(h[r], 1), w2 = mq_row_word(h[r], 2),
                       w3 = mq_row_word(h[r], 3);
        P.d[r] = f16_to_f32((uint16_t)(w0 & 0xFFFF));
        P.dm[r] = f16_to_f32((uint16_t)(w0 >> 16));
        P.sc[r] = hh ? ((w3 & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u)) : (w1 & 0x3F3F3F3Fu);
        P.m[r] = hh ? (((w3 >> 4) & 0x0F0F0F0Fu) | ((w2 >> 2) & 0x30303030u)) : (w2 & 0x3F3F3F3Fu);
    }
}
// Sub-block 4hh + i's d * sc and dmin * m (k_scales' products, bit for bit).
DEV void mq_kscale(const MqKPrep& P, int r, int i, float& ds, float& dm) {
    ds = P.d[r] * mq_u8f(P.sc[r], i);
    dm = P.dm[r] * mq_u8f(P.m[r], i);
}

// Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: byte l of pair p = qs[32p + l] holds
// element l of sub-block 2p (low nibble) and of 2p+1 (high). Step s = half s&1 of superblock s/2
// = pairs 2hh, 2hh+1; chunk i = sub-block 4hh + i = pair i/2, nibble i&1.
// Staged row: the header, then the half's 64 code bytes; 96 bytes apart, which puts the 8-byte
// code loads of a half-warp's four rows on distinct banks.
template <> struct MqType<QT_Q4_K> {
    static constexpr int NA = 1, MIN = 1, SROW = 96, N16 = 5;
    struct Frag {
        uint32_t h[2];
        uint2 q[2][2];
    };
    typedef MqKPrep Prep;
    static DEV const uint8_t* src16(const uint8_t* W, long long, long long rb, int s, int q) {
        const uint8_t* blk = W + (rb + (s >> 1)) * 144;
        return q == 0 ? blk : blk + 64 * (s & 1) + 16 * q;
    }
    static DEV void small(uint8_t*, const uint8_t*, long long, long long, int) {}
    static DEV void load(Frag& f, const uint8_t* const (&row)[2], const long long (&)[2], int, int t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            f.h[r] = *(const uint32_t*)(row[r] + 4 * t);
            f.q[r][0] = *(const uint2*)(row[r] + 16 + 8 * t);
            f.q[r][1] = *(const uint2*)(row[r] + 48 + 8 * t);
        }
    }
    static DEV void prep(const Frag& f, int s, int, Prep& P) { mq_kprep(f.h, s & 1, P); }
    static DEV void chunk(const Frag& f, const Prep& P, int, int i, int, MqChunk<1>& c) {
        const int sh = 4 * (i & 1);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint2 q = f.q[r][i >> 1];
            c.a[0][r] = (q.x >> sh) & 0x0F0F0F0Fu;
            c.a[0][2 + r] = (q.y >> sh) & 0x0F0F0F0Fu;
            mq_kscale(P, r, i, c.s[0][r], c.m[r]);
        }
    }
};

// Q5_K {header as Q4_K; u8 qh[32]; u8 qs[128]}: Q4_K's nibbles plus bit j of qh[l] as bit 4
// of element l of sub-block j.
template <> struct MqType<QT_Q5_K> {
    static constexpr int NA = 1, MIN = 1;
    struct Frag {
        uint32_t h[2];
        uint2 q[2][2];
        uint2 qh[2];
    };
    typedef MqKPrep Prep;
    // Staged row: the header, qh (all 32 bytes), the half's 64 code bytes.
    static constexpr int SROW = 112, N16 = 7;
    static DEV const uint8_t* src16(const uint8_t* W, long long, long long rb, int s, int q) {
        const uint8_t* blk = W + (rb + (s >> 1)) * 176;
        return q < 3 ? blk + 16 * q : blk + 64 * (s & 1) + 16 * q;
    }
    static DEV void small(uint8_t*, const uint8_t*, long long, long long, int) {}
    static DEV void load(Frag& f, const uint8_t* const (&row)[2], const long long (&)[2], int, int t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            f.h[r] = *(const uint32_t*)(row[r] + 4 * t);
            f.qh[r] = *(const uint2*)(row[r] + 16 + 8 * t);
            f.q[r][0] = *(const uint2*)(row[r] + 48 + 8 * t);
            f.q[r][1] = *(const uint2*)(row[r] + 80 + 8 * t);
        }
    }
    static DEV void prep(const Frag& f, int s, int, Prep& P) { mq_kprep(f.h, s & 1, P); }
    static DEV void chunk(const Frag& f, const Prep& P, int s, int i, int, MqChunk<1>& c) {
        const int sh = 4 * (i & 1), j = 4 * (s & 1) + i;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint2 q = f.q[r][i >> 1], h = f.qh[r];
            c.a[0][r] = ((q.x >> sh) & 0x0F0F0F0Fu) | (((h.x >> j) & 0x01010101u) << 4);
            c.a[0][2 + r] = ((q.y >> sh) & 0x0F0F0F0Fu) | (((h.y >> j) & 0x01010101u) << 4);
            mq_kscale(P, r, i, c.s[0][r], c.m[r]);
        }
    }
};

// Codes q in 0..63 per byte -> q - 32 as int8 per byte: flipping bit 5 gives q - 32 for q >= 32
// and q + 32 for q < 32, which needs bits 6 and 7 set as well (q + 32 - 64).
DEV uint32_t mq_q6_signed(uint32_t q) {
    const uint32_t f = q ^ 0x20202020u;
    return f | ((f & 0x20202020u) * 6u);
}

// Q6_K repacked (quant.cuh): ql[128] + qh[64] at 192g, scales[16] at 192n + 16g, d at 208n + 2g.
// Step s = half hh = s&1 of superblock s/2: chunk i covers elements 32i.. of the half, low
// nibbles of ql[64hh + 32(i&1) + l] shifted by 4(i>>1), high bits qh[32hh + l] >> 2i. Its two
// groups of 16 (scales 8hh + 2i and + 1: lane t loads chunk t's pair) are positions 0..15 =
// lanes t < 2 and 16..31 = t >= 2, so operand 0 is the codes of lanes t < 2 (zeros elsewhere)
// and operand 1 the others': two mmas of the same B give the two group sums. The -32 offset is
// applied to the codes (signed A).
template <> struct MqType<QT_Q6_K_R> {
    static constexpr int NA = 2, MIN = 0;
    struct Frag {
        uint2 ql[2][2];
        uint2 qh[2];
        uint32_t sc[2], d[2];
    };
    struct Prep {
        float d[2];
    };
    // Staged row: the half's 64 ql bytes, its 32 qh bytes, its 8 scale bytes at 96, and at 104
    // the aligned 4-byte word holding d (its half: the block index's parity).
    static constexpr int SROW = 112, N16 = 6;
    static DEV const uint8_t* src16(const uint8_t* W, long long, long long rb, int s, int q) {
        const uint8_t* b = W + (rb + (s >> 1)) * 192;
        return q < 4 ? b + 64 * (s & 1) + 16 * q : b + 128 + 32 * (s & 1) + 16 * (q - 4);
    }
    static DEV void small(uint8_t* row, const uint8_t* W, long long nblk, long long rb, int s) {
        const long long g = rb + (s >> 1);
        mq_cp8(row + 96, W + nblk * 192 + g * 16 + 8 * (s & 1));
        mq_cp4(row + 104, W + ((nblk * 208 + 2 * g) & ~3LL));
    }
    static DEV void load(Frag& f, const uint8_t* const (&row)[2], const long long (&rb)[2], int s, int t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            f.ql[r][0] = *(const uint2*)(row[r] + 8 * t);
            f.ql[r][1] = *(const uint2*)(row[r] + 32 + 8 * t);
            f.qh[r] = *(const uint2*)(row[r] + 64 + 8 * t);
            f.sc[r] = *(const uint16_t*)(row[r] + 96 + 2 * t);
            f.d[r] = *(const uint16_t*)(row[r] + 104 + 2 * ((rb[r] + (s >> 1)) & 1));
        }
    }
    static DEV void prep(const Frag& f, int, int, Prep& P) {
#pragma unroll
        for (int r = 0; r < 2; ++r) P.d[r] = f16_to_f32((uint16_t)f.d[r]);
    }
    static DEV void chunk(const Frag& f, const Prep& P, int, int i, int t, MqChunk<2>& c) {
        const int ns = 4 * (i >> 1), hs = 2 * i;
        const bool lo = t < 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint2 l = f.ql[r][i & 1], h = f.qh[r];
            const uint32_t x = mq_q6_signed(((l.x >> ns) & 0x0F0F0F0Fu) | (((h.x >> hs) & 0x03030303u) << 4));
            const uint32_t y = mq_q6_signed(((l.y >> ns) & 0x0F0F0F0Fu) | (((h.y >> hs) & 0x03030303u) << 4));
            c.a[0][r] = lo ? x : 0u;
            c.a[0][2 + r] = lo ? y : 0u;
            c.a[1][r] = lo ? 0u : x;
            c.a[1][2 + r] = lo ? 0u : y;
            const uint32_t sw = mq_row_word(f.sc[r], i);
            c.s[0][r] = P.d[r] * mq_s8f(sw, 0);
            c.s[1][r] = P.d[r] * mq_s8f(sw, 1);
            c.m[r] = 0.0f;
        }
    }
};

// Q8_0 repacked: qs[32] at 32g, d at 32n + 2g. Step s = blocks 4s .. 4s+3 of the row; lane t
// loads block 4s + t's d.
template <> struct MqType<QT_Q8_0_R> {
    static constexpr int NA = 1, MIN = 0;
    // The codes stay in shared memory until their chunk (the rows' addresses here): a GLU
    // launch holding both matrices' 4 chunks in registers spilled.
    struct Frag {
        const uint8_t* row;  // row g; row g + 8 is 8 * SROW further
        uint32_t d[2];
    };
    struct Prep {};
    // Staged row: the step's 4 blocks of codes, then their 4 d (8 bytes: g0 is a multiple of 4).
    static constexpr int SROW = 144, N16 = 8;
    static DEV const uint8_t* src16(const uint8_t* W, long long, long long rb, int s, int q) {
        return W + 32 * (rb + 4 * s) + 16 * q;
    }
    static DEV void small(uint8_t* row, const uint8_t* W, long long nblk, long long rb, int s) {
        mq_cp8(row + 128, W + 32 * nblk + 2 * (rb + 4 * s));
    }
    static DEV void load(Frag& f, const uint8_t* const (&row)[2], const long long (&)[2], int, int t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) f.d[r] = *(const uint16_t*)(row[r] + 128 + 2 * t);
        f.row = row[0];
    }
    static DEV void prep(const Frag&, int, int, Prep&) {}
    static DEV void chunk(const Frag& f, const Prep&, int, int i, int t, MqChunk<1>& c) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint2 q = *(const uint2*)(f.row + 8 * SROW * r + 32 * i + 8 * t);
            c.a[0][r] = q.x;
            c.a[0][2 + r] = q.y;
            c.s[0][r] = f16_to_f32((uint16_t)mq_row_word(f.d[r], i));
            c.m[r] = 0.0f;
        }
    }
};

// ---- the kernel -------------------------------------------------------------------------------

// Stages in flight: window w + 2 is copied while window w is computed (MQ_STAGES - 1 windows
// issued ahead, the oldest two waited for). kernels/src/mmq.rs `MMQ_STAGES` sizes the buffers.
#define MQ_STAGES 4
#ifdef GGUFTOOL_EMU
#define MQ_TRAP() __builtin_trap()
#else
#define MQ_TRAP() __trap()
#endif

// Shared memory. A stage (one window of ks steps) holds: per column `mq_stride(WK)` code bytes
// (the window's WK codes + 32: column starts then fall 32 bytes apart modulo 128, so the 8-byte
// B loads of a half-warp, 4 columns x 4 lanes, hit 32 distinct banks); the columns' raw q8a
// records, column-major (WB per column); every warp's 16 staged weight rows (the type's SROW bytes
// each; GLU: then the up matrix's). After MQ_STAGES stages, two buffers of converted records,
// one float2 per (block, column) {dx, dx * sum of the block's codes} (the second only for the
// types with a min), for windows of even and odd index.
DEV int mq_stride(int WK) { return WK + 32; }

// Scale and accumulate one chunk's products for one column group: acc[u] is output u of the
// lane (c0..c3 order), dx / mx of its columns 2t and 2t+1.
template <int QT>
DEV void mq_apply(const MqChunk<MqType<QT>::NA>& c, const uint32_t (&b)[2], const float (&dx)[2],
                  const float (&mx)[2], float (&acc)[4]) {
    const int cin[4] = {MQ_MAGIC_I, MQ_MAGIC_I, MQ_MAGIC_I, MQ_MAGIC_I};
#pragma unroll
    for (int o = 0; o < MqType<QT>::NA; ++o) {
        int d[4];
        mma_s8_16832(d, c.a[o], b, cin);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float f = __int_as_float(d[u]) - MQ_MAGIC_F;  // exact: |isum| < 2^22
            acc[u] = fmaf(c.s[o][u >> 1] * dx[u & 1], f, acc[u]);
        }
    }
    if (MqType<QT>::MIN) {
#pragma unroll
        for (int u = 0; u < 4; ++u) acc[u] = fmaf(-c.m[u >> 1], mx[u & 1], acc[u]);
    }
}

// One warp step: 4 chunks of 32 k, each against the live column groups (ncg) of the window
// buffer (`codes`, `rec`); kp = the step's place in the window. Column groups are taken MQ_G at
// a time with no branch inside a group: their shared-memory loads are issued together and their
// mmas are independent, so the compiler overlaps them (one group at a time, behind a uniform
// skip per 8 columns, left each mma waiting on its own loads and each scaling on its mma: a
// serial chain of ~100 cycles per 8 columns). A dead column inside a live group is computed
// and never written: its records are zero, so stale codes add 0 * finite.
template <int NC> __host__ __device__ constexpr int mq_group() { return NC / 8 < 4 ? NC / 8 : 4; }
template <int QT, int NC, bool GLU>
DEV void mq_step(const typename MqType<QT>::Frag& f1, const typename MqType<QT>::Frag& f2, int s,
                 const uint8_t* __restrict__ codes, const float2* __restrict__ rec, int S, int kp,
                 int ncg, float (&acc)[NC / 8][4], float (&acc2)[NC / 8][4]) {
    using T = MqType<QT>;
    constexpr int NG = NC / 8, G = mq_group<NC>();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    typename T::Prep P1, P2;
    T::prep(f1, s, t, P1);
    if (GLU) T::prep(f2, s, t, P2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int bw = 4 * kp + i;
        MqChunk<T::NA> c1, c2;
        T::chunk(f1, P1, s, i, t, c1);
        if (GLU) T::chunk(f2, P2, s, i, t, c2);
#pragma unroll
        for (int g0 = 0; g0 < NG; g0 += G) {
            if (g0 >= ncg) break;  // uniform: no live column from here on
            uint32_t b[G][2];
            float dx[G][2], mx[G][2];
#pragma unroll
            for (int j = 0; j < G; ++j) {
                const int cg = g0 + j;
                const uint2 bq = *(const uint2*)(codes + (cg * 8 + g) * S + bw * 32 + 8 * t);
                b[j][0] = bq.x;
                b[j][1] = bq.y;
                const float4 xr = *(const float4*)(rec + bw * NC + cg * 8 + 2 * t);
                dx[j][0] = xr.x;
                dx[j][1] = xr.z;
                mx[j][0] = xr.y;
                mx[j][1] = xr.w;
            }
#pragma unroll
            for (int j = 0; j < G; ++j) {
                mq_apply<QT>(c1, b[j], dx[j], mx[j], acc[g0 + j]);
                if (GLU) mq_apply<QT>(c2, b[j], dx[j], mx[j], acc2[g0 + j]);
            }
        }
    }
}

// The activation codes of window w (k0 .. k0 + WK) of the live column groups into `buf`:
// 16-byte pieces, `lgp` = log2(pieces per column). Dead columns and k past K are not copied
// (nothing reads them: a dead column's records are zero, so its stale codes add 0 * finite).
template <int NC>
DEV void mq_stage_codes(const Mmq& p, const int* s_xr, uint8_t* buf, int S, long long k0, int lgp,
                        int ncg) {
    const int total = (ncg * 8) << lgp;
    for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        const int c = idx >> lgp, q = idx & ((1 << lgp) - 1);
        const int xr = s_xr[c];
        const long long k = k0 + 16 * q;
        if (xr >= 0 && k < p.K) mq_cp16(buf + c * S + 16 * q, p.x.qs + (long long)xr * p.K + k);
    }
}

// The raw records of window blocks kb0 .. kb0 + WB of the live columns into `raw` (column c at
// c * WB): 16-byte pieces of two records (WB is even, a row's records 16-byte aligned).
template <int NC>
DEV void mq_stage_recs(const Mmq& p, const int* s_xr, float2* raw, long long kb0, int WB, int ncg) {
    const long long nb = p.K >> 5;
    const int half = WB >> 1, total = ncg * 8 * half;
    for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        const int c = idx / half, q = idx - c * half;
        const int xr = s_xr[c];
        const long long b = kb0 + 2 * q;
        if (xr >= 0 && b < nb) mq_cp16(raw + c * WB + 2 * q, p.x.ds + (long long)xr * nb + b);
    }
}

// Raw records -> {dx, dx * sum} for the kernel's loop (entry b * NC + c), zero for dead
// columns and blocks past K.
template <int QT, int NC>
DEV void mq_convert_recs(const Mmq& p, const int* s_xr, const float2* raw, float2* rec, long long kb0,
                         int WB) {
    const long long nb = p.K >> 5;
    for (int idx = threadIdx.x; idx < NC * WB; idx += blockDim.x) {
        const int c = idx & (NC - 1), b = idx / NC;
        float2 v = make_float2(0.0f, 0.0f);
        if (s_xr[c] >= 0 && kb0 + b < nb) {
            const float2 r = raw[c * WB + b];
            v.x = r.x;
            if (MqType<QT>::MIN) {
                const int u = __float_as_int(r.y);
                v.y = r.x * (float)((u >> 16) + (int)(short)(u & 0xFFFF));
            }
        }
        rec[idx] = v;
    }
}

// One warp's weight rows of step s into `dst` (16 rows of the type's SROW bytes), rows row0 ..
// row0 + 15 of slab e; rows past the matrix repeat its last row.
template <int QT>
DEV void mq_stage_weights(const Mmq& p, const uint8_t* W, long long e, int row0, long long bpr, int s,
                          uint8_t* dst) {
    using T = MqType<QT>;
    const int lane = threadIdx.x & 31;
    for (int idx = lane; idx < 16 * T::N16; idx += 32) {
        const int r = idx / T::N16, q = idx - r * T::N16;
        const long long rb = (e * p.nrows + min(row0 + r, p.nrows - 1)) * bpr;
        mq_cp16(dst + r * T::SROW + 16 * q, T::src16(W, p.nblk, rb, s, q));
    }
    if (lane < 16) {
        const long long rb = (e * p.nrows + min(row0 + lane, p.nrows - 1)) * bpr;
        T::small(dst + lane * T::SROW, W, p.nblk, rb, s);
    }
}

DEV float mq_silu(float g) { return g / (1.0f + expf(-g)); }

// MODE 0: plain (p.accum: y += W x, the old value read first); 1: GLU, silu(W x) * (W2 x).
// SL: a k-slice of a sliced launch (grid.z = p.kz slices of p.wpz windows; one channel, no ids):
// the raw sums go to p.ws for mmq_reduce. Separate instantiations: the unsliced kernels sit at
// their register limit, and the slice bounds and the second epilogue made them spill.
template <int QT, int NC, int MODE, bool SL>
DEV void mmq_impl(const Mmq& p) {
    using T = MqType<QT>;
    constexpr bool GLU = MODE == 1;
    constexpr int NM = GLU ? 2 : 1;
    DYN_SHARED(uint4, mq_smem16);  // uint4: the buffers' 16-byte loads and cp.async stay aligned
    uint8_t* const mq_smem = (uint8_t*)mq_smem16;
    __shared__ int s_xr[NC], s_yr[NC];
    pdl_entry();
    if (p.srow != T::SROW) MQ_TRAP();  // the host's plan and this layout disagree
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int KS = p.ks, rt = warp / KS, kp = warp - rt * KS;
    const int row0 = (blockIdx.x * (nw / KS) + rt) * 16;
    const int nsteps = p.K / MQ_STEP, nwin_all = (nsteps + KS - 1) / KS;
    // This block's k-slice: windows wb .. nwin - 1 (all of them without slices).
    const int wb = SL ? min(nwin_all, (int)blockIdx.z * p.wpz) : 0;
    const int nwin = SL ? min(nwin_all, wb + p.wpz) : nwin_all;
    const int WK = KS * MQ_STEP, WB = WK >> 5, S = mq_stride(WK);
    const int lgp = __ffs(WK >> 4) - 1;  // WK / 16 is a power of two
    constexpr int wrows = 16 * T::SROW;  // one warp's staged rows of one matrix
    const int codes_b = NC * S, raw_b = NC * WB * 8;
    const int stage_b = codes_b + raw_b + nw * NM * wrows;
    float2* const conv = (float2*)(mq_smem + MQ_STAGES * stage_b);  // [2][WB * NC]
    const long long bpr = p.K / QTraits<QT>::QB;
    const float nan = __int_as_float(0x7fc00000);
    for (long long ch = blockIdx.y; ch < p.count; ch += gridDim.y) {
        const long long e = p.ids ? (long long)p.ids[ch] : ch % p.n_slabs;
        if (p.ids && e == -1) continue;  // unused tile (uniform): nothing written
        const bool bad = e < 0 || e >= p.n_slabs;
        if (tid < NC) {
            int xr = -1, yr = -1;
            if (tid < p.ncols) {
                const long long xv =
                    p.xidx ? (long long)p.xidx[ch * p.ncols + tid] : (ch / p.x_div) * p.ncols + tid;
                const long long yv = p.yidx ? (long long)p.yidx[ch * p.ncols + tid] : ch * p.ncols + tid;
                // A column is computed and written only with both an input and an output row.
                if (xv >= 0 && xv < p.x.rows && yv >= 0 && yv < p.y_rows) {
                    xr = (int)xv;
                    yr = (int)yv;
                }
            }
            s_xr[tid] = xr;
            s_yr[tid] = yr;
        }
        __syncthreads();
        int ncg = 0;
        for (int j = 0; j < NC; ++j)
            if (s_yr[j] >= 0) ncg = (j >> 3) + 1;
        float acc[NC / 8][4], acc2[NC / 8][4];
#pragma unroll
        for (int cg = 0; cg < NC / 8; ++cg)
#pragma unroll
            for (int u = 0; u < 4; ++u) acc[cg][u] = acc2[cg][u] = 0.0f;
        if (!bad && ncg > 0) {  // uniform
            // Window j's stage: codes, raw records, and each warp its own step's weight rows.
            const auto issue = [&](int j) {
                if (j < nwin) {
                    uint8_t* st = mq_smem + (j % MQ_STAGES) * stage_b;
                    mq_stage_codes<NC>(p, s_xr, st, S, (long long)j * WK, lgp, ncg);
                    mq_stage_recs<NC>(p, s_xr, (float2*)(st + codes_b), (long long)j * WB, WB, ncg);
                    const int sj = j * KS + kp;
                    if (sj < nsteps) {
                        uint8_t* wd = st + codes_b + raw_b + warp * NM * wrows;
                        mq_stage_weights<QT>(p, p.w, e, row0, bpr, sj, wd);
                        if (GLU) mq_stage_weights<QT>(p, p.w2, e, row0, bpr, sj, wd + wrows);
                    }
                }
                mq_cp_commit();  // empty past the last window: the group count stays uniform
            };
            const auto convert = [&](int j) {
                if (j < nwin)
                    mq_convert_recs<QT, NC>(p, s_xr, (const float2*)(mq_smem + (j % MQ_STAGES) * stage_b + codes_b),
                                            conv + (j & 1) * (WB * NC), (long long)j * WB, WB);
            };
#pragma unroll 1
            for (int j = wb; j < wb + MQ_STAGES - 1; ++j) issue(j);
            mq_cp_wait_group<MQ_STAGES - 3>();  // windows 0 and 1 here
            __syncthreads();
            convert(wb);
            convert(wb + 1);
            __syncthreads();
#pragma unroll 1
            for (int w = wb; w < nwin; ++w) {
                issue(w + MQ_STAGES - 1);  // into the buffer window w - 1 left
                const int s = w * KS + kp;
                if (s < nsteps) {
                    const uint8_t* st = mq_smem + (w % MQ_STAGES) * stage_b;
                    const uint8_t* wr = st + codes_b + raw_b + warp * NM * wrows;
                    const long long rb[2] = {(e * p.nrows + min(row0 + g, p.nrows - 1)) * bpr,
                                             (e * p.nrows + min(row0 + g + 8, p.nrows - 1)) * bpr};
                    const uint8_t* const r1[2] = {wr + g * T::SROW, wr + (g + 8) * T::SROW};
                    typename T::Frag f1, f2;
                    T::load(f1, r1, rb, s, t);
                    if (GLU) {
                        const uint8_t* const r2[2] = {r1[0] + wrows, r1[1] + wrows};
                        T::load(f2, r2, rb, s, t);
                    }
                    mq_step<QT, NC, GLU>(f1, f2, s, st, conv + (w & 1) * (WB * NC), S, kp, ncg, acc, acc2);
                }
                // Window w + 2 complete and visible; every warp is done with window w's buffers.
                mq_cp_wait_group<MQ_STAGES - 3>();
                __syncthreads();
                convert(w + 2);  // into the buffer window w left; read from window w + 2 on
            }
            mq_cp_wait();  // nothing in flight (only empty groups remain) before reuse
            __syncthreads();
        }
        // The ks warps of a tile: partials through shared memory (free after the loop's last
        // barrier), summed by warp kp = 0 in warp order.
        if (KS > 1) {
            constexpr int NV = NC / 2;
            float* red = (float*)mq_smem;
#pragma unroll
            for (int cg = 0; cg < NC / 8; ++cg)
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    red[((warp * NM) * NV + cg * 4 + u) * 32 + lane] = acc[cg][u];
                    if (GLU) red[((warp * NM + 1) * NV + cg * 4 + u) * 32 + lane] = acc2[cg][u];
                }
            __syncthreads();
            if (kp == 0)
                for (int q = 1; q < KS; ++q)
#pragma unroll
                    for (int cg = 0; cg < NC / 8; ++cg)
#pragma unroll
                        for (int u = 0; u < 4; ++u) {
                            acc[cg][u] += red[(((warp + q) * NM) * NV + cg * 4 + u) * 32 + lane];
                            if (GLU) acc2[cg][u] += red[(((warp + q) * NM + 1) * NV + cg * 4 + u) * 32 + lane];
                        }
        }
        if (SL && kp == 0) {
            // A k-slice's raw sums (channel 0 only: the host slices single-channel launches
            // without ids); mmq_reduce adds the slices in order and finishes the outputs. 32-bit
            // offsets: the host slices only launches whose ncols * nrows * (1 + GLU) fits
            // (kernels/src/mmq.rs `mmq_sliceable`).
            const int plane = p.ncols * p.nrows;
            float* const wz = p.ws + (long long)blockIdx.z * (NM * plane);
#pragma unroll
            for (int cg = 0; cg < NC / 8; ++cg)
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int r = row0 + g + 8 * (u >> 1), j = cg * 8 + 2 * t + (u & 1);
                    if (s_yr[j] < 0 || r >= p.nrows) continue;  // s_yr is -1 past ncols
                    wz[j * p.nrows + r] = acc[cg][u];
                    if (GLU) wz[plane + j * p.nrows + r] = acc2[cg][u];
                }
        } else if (!SL && kp == 0) {
#pragma unroll
            for (int cg = 0; cg < NC / 8; ++cg)
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int r = row0 + g + 8 * (u >> 1), yr = s_yr[cg * 8 + 2 * t + (u & 1)];
                    if (yr < 0 || r >= p.nrows) continue;
                    float v = acc[cg][u];
                    if (GLU) v = mq_silu(v) * acc2[cg][u];
                    if (bad) v = nan;
                    float* yp = p.y + (long long)yr * p.y_stride + r;
                    // One thread owns each output: no atomics; __fadd_rn keeps the add out of any
                    // contraction (the add kernel's rounding, as gemvq).
                    *yp = !GLU && p.accum ? __fadd_rn(*yp, v) : v;
                }
        }
        __syncthreads();  // s_xr / s_yr and the buffers are rewritten for the next channel
    }
}

#define MQ_CAT2(a, b) a##b
#define MQ_CAT(a, b) MQ_CAT2(a, b)
// Registers (tests/compile.rs checks that none spills): the 8-32-column plain kernels and the
// 8-column GLU (the grouped MoE gate + up) ask for 2 resident blocks per SM (<= 128
// registers), the wide ones for 1 (they hold 32-64 accumulators per matrix). The sliced ones
// (`s`: dense products cut into k-slices) carry the slice bounds and their own epilogue, which
// made the 8-column GLU and the 32-column plain kernels spill at 128: 2 blocks per SM for the
// 8-16-column plain ones only. kernels/src/mmq.rs `blocks_by_registers` plans with these.
#define MQ_KERNEL(name, NC, MODE, SL, MINB)                                                     \
    extern "C" __global__ void __launch_bounds__(256, MINB) MQ_CAT(name, MQ_SUF)(Mmq p) {      \
        mmq_impl<MQ_QT, NC, MODE, SL>(p);                                                      \
    }
MQ_KERNEL(mmq8_, 8, 0, false, 2)
MQ_KERNEL(mmq16_, 16, 0, false, 2)
MQ_KERNEL(mmq32_, 32, 0, false, 2)
MQ_KERNEL(mmq64_, 64, 0, false, 1)
MQ_KERNEL(mmq_glu8_, 8, 1, false, 2)
MQ_KERNEL(mmq_glu16_, 16, 1, false, 1)
MQ_KERNEL(mmq_glu32_, 32, 1, false, 1)
MQ_KERNEL(mmq_glu64_, 64, 1, false, 1)
MQ_KERNEL(mmq8s_, 8, 0, true, 2)
MQ_KERNEL(mmq16s_, 16, 0, true, 2)
MQ_KERNEL(mmq32s_, 32, 0, true, 1)
MQ_KERNEL(mmq64s_, 64, 0, true, 1)
MQ_KERNEL(mmq_glu8s_, 8, 1, true, 1)
MQ_KERNEL(mmq_glu16s_, 16, 1, true, 1)
MQ_KERNEL(mmq_glu32s_, 32, 1, true, 1)
MQ_KERNEL(mmq_glu64s_, 64, 1, true, 1)

// The k-slices of a sliced launch (p.kz > 1, one channel, no ids) summed in slice order, then
// finished as the unsliced kernel finishes an output: GLU (p.w2 set) silu(gate) * up, accumulate
// one f32 addition onto the old value. Columns without an input or output row are skipped as
// the product kernel skips them. One thread per (column, row), grid-strided.
extern "C" __global__ void __launch_bounds__(256) MQ_CAT(mmq_reduce_, MQ_SUF)(Mmq p) {
    pdl_entry();
    const bool glu = p.w2 != nullptr;
    const long long n = (long long)p.ncols * p.nrows, mat = n, slice = glu ? 2 * n : n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i / p.nrows), r = (int)(i - (long long)j * p.nrows);
        const long long xv = p.xidx ? (long long)p.xidx[j] : j;
        const long long yv = p.yidx ? (long long)p.yidx[j] : j;
        if (xv < 0 || xv >= p.x.rows || yv < 0 || yv >= p.y_rows) continue;
        float v = 0.0f, u = 0.0f;
        for (int z = 0; z < p.kz; ++z) {
            v = __fadd_rn(v, p.ws[z * slice + i]);
            if (glu) u = __fadd_rn(u, p.ws[z * slice + mat + i]);
        }
        if (glu) v = mq_silu(v) * u;
        float* yp = p.y + yv * p.y_stride + r;
        *yp = !glu && p.accum ? __fadd_rn(*yp, v) : v;
    }
}

// One m16n8k32 product by the instruction and by the shuffle emulation, for the GPU test that
// pins the fragment layout. Under the CPU emulator the "instruction" is the emulator's own model
// of it (kernels/emu/cuda_emu.h, written from the PTX ISA independently of the shuffle version).
// One warp. A: 16 x 32 row-major, B: column n's 32 codes at B + 32n, C / D: 16 x 8 row-major.
extern "C" __global__ void mma_s8_selftest(const int8_t* __restrict__ A, const int8_t* __restrict__ B,
                                           const int* __restrict__ C, int* __restrict__ d_mma,
                                           int* __restrict__ d_shfl) {
    pdl_entry();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const auto word = [](const int8_t* p) {
        return (uint32_t)(uint8_t)p[0] | ((uint32_t)(uint8_t)p[1] << 8) | ((uint32_t)(uint8_t)p[2] << 16) |
               ((uint32_t)(uint8_t)p[3] << 24);
    };
    const uint32_t a[4] = {word(A + g * 32 + 4 * t), word(A + (g + 8) * 32 + 4 * t),
                           word(A + g * 32 + 16 + 4 * t), word(A + (g + 8) * 32 + 16 + 4 * t)};
    const uint32_t b[2] = {word(B + g * 32 + 4 * t), word(B + g * 32 + 16 + 4 * t)};
    const int c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
    int d[4];
#ifdef GGUFTOOL_EMU
    emu_mma_m16n8k32_s8(d, a, b, c);
#else
    mma_s8_16832(d, a, b, c);
#endif
    const int at[4] = {g * 8 + 2 * t, g * 8 + 2 * t + 1, (g + 8) * 8 + 2 * t, (g + 8) * 8 + 2 * t + 1};
#pragma unroll
    for (int i = 0; i < 4; ++i) d_mma[at[i]] = d[i];
    mma_s8_16832_shfl(d, a, b, c);
#pragma unroll
    for (int i = 0; i < 4; ++i) d_shfl[at[i]] = d[i];
}
