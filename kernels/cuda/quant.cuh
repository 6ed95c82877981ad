// Block decoders for every ggml tensor type the GPU supports (spec-glm5-gguf.md §5).
// Shared by the dequantize and GEMV modules so both decode bit-identically.
//
// Unit of work: a 32-element "chunk". Every type's block holds a multiple of 32 elements
// (32, 64, 128 or 256), and the plain types F32/F16/BF16 are treated as blocks of 32.
// deq32<QT>(block, c, tables, y) writes elements [32c, 32c+32) of the block into y.
//
// Arithmetic: each value is formed exactly as the CPU reference forms it (scale products first,
// then times the quant, then minus the min term), in f32; the module is compiled with
// --fmad=false so no product is fused into an add and results match the oracle bit for bit.

// Lookup tables uploaded once per device from gguf::quant (never duplicated in kernel source).
struct QTables {
    const uint64_t* iq2xxs;  // 256 x 8 magnitudes (bytes)
    const uint64_t* iq2xs;   // 512 x 8
    const uint64_t* iq2s;    // 1024 x 8
    const uint32_t* iq3xxs;  // 256 x 4
    const uint32_t* iq3s;    // 512 x 4
    const uint64_t* iq1s;    // 2048 x 8 signed bytes in {-1, 0, 1}
    const int8_t* kvalues;   // IQ4_NL / IQ4_XS non-linear values, 16
    const int8_t* fp4;       // MXFP4 / NVFP4 E2M1 values (x2), 16
};

// ggml type ids (GgmlType::id()).
#define QT_F32 0
#define QT_F16 1
#define QT_Q4_0 2
#define QT_Q4_1 3
#define QT_Q5_0 6
#define QT_Q5_1 7
#define QT_Q8_0 8
#define QT_Q2_K 10
#define QT_Q3_K 11
#define QT_Q4_K 12
#define QT_Q5_K 13
#define QT_Q6_K 14
#define QT_IQ2_XXS 16
#define QT_IQ2_XS 17
#define QT_IQ3_XXS 18
#define QT_IQ1_S 19
#define QT_IQ4_NL 20
#define QT_IQ3_S 21
#define QT_IQ2_S 22
#define QT_IQ4_XS 23
#define QT_IQ1_M 29
#define QT_BF16 30
#define QT_TQ1_0 34
#define QT_TQ2_0 35
#define QT_MXFP4 39
#define QT_NVFP4 40
#define QT_Q1_0 41
#define QT_Q8_1 9
#define QT_Q8_K 15
#define QT_I8 24
#define QT_I16 25
#define QT_I32 26
#define QT_I64 27
#define QT_F64 28

// Elements (QB) and bytes (BB) of one block as the decoders see it.
template <int QT> struct QTraits;
#define QTRAITS(T, qb, bb)                  \
    template <> struct QTraits<T> {         \
        static constexpr int QB = qb;       \
        static constexpr int BB = bb;       \
    };
QTRAITS(QT_F32, 32, 128)
QTRAITS(QT_F16, 32, 64)
QTRAITS(QT_BF16, 32, 64)
QTRAITS(QT_Q4_0, 32, 18)
QTRAITS(QT_Q4_1, 32, 20)
QTRAITS(QT_Q5_0, 32, 22)
QTRAITS(QT_Q5_1, 32, 24)
QTRAITS(QT_Q8_0, 32, 34)
QTRAITS(QT_Q2_K, 256, 84)
QTRAITS(QT_Q3_K, 256, 110)
QTRAITS(QT_Q4_K, 256, 144)
QTRAITS(QT_Q5_K, 256, 176)
QTRAITS(QT_Q6_K, 256, 210)
QTRAITS(QT_IQ2_XXS, 256, 66)
QTRAITS(QT_IQ2_XS, 256, 74)
QTRAITS(QT_IQ3_XXS, 256, 98)
QTRAITS(QT_IQ1_S, 256, 50)
QTRAITS(QT_IQ4_NL, 32, 18)
QTRAITS(QT_IQ3_S, 256, 110)
QTRAITS(QT_IQ2_S, 256, 82)
QTRAITS(QT_IQ4_XS, 256, 136)
QTRAITS(QT_IQ1_M, 256, 56)
QTRAITS(QT_TQ1_0, 256, 54)
QTRAITS(QT_TQ2_0, 256, 66)
QTRAITS(QT_MXFP4, 32, 17)
QTRAITS(QT_NVFP4, 64, 36)
QTRAITS(QT_Q1_0, 128, 18)
QTRAITS(QT_Q8_1, 32, 36)
QTRAITS(QT_Q8_K, 256, 292)
QTRAITS(QT_I8, 32, 32)
QTRAITS(QT_I16, 32, 64)
QTRAITS(QT_I32, 32, 128)
QTRAITS(QT_I64, 32, 256)
QTRAITS(QT_F64, 32, 256)

// Little-endian loads. Blocks are only 1- or 2-byte aligned for most types, so wider values are
// assembled from 16-bit (or byte) loads unless the type's block size keeps them aligned.
// Weight bytes are read once per launch: the ldw* loads mark their L1 lines evict-first
// (ld.global.nc.L1::evict_first, sm_70+) so the streamed weights do not push out the activation
// vector that every row re-reads from L1, while neighbouring loads of one sector still hit L1.
// (L1::evict_first was measured slower for the types read in 2- and 4-byte pieces: every piece
// then went to L2; H200, 2026-11-30.) The CPU emulator (kernels/emu, GGUFTOOL_EMU) reads the
// same bytes with plain loads.
#ifdef GGUFTOOL_EMU
DEV uint4 ldw4(const void* p) { return *(const uint4*)p; }
DEV uint2 ldw2(const void* p) { return *(const uint2*)p; }
DEV uint32_t ldw32(const void* p) { return *(const uint32_t*)p; }
DEV uint32_t ld_u16(const uint8_t* p) { return *(const uint16_t*)p; }  // 2-byte aligned callers only
#else
DEV uint4 ldw4(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::evict_first.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
DEV uint2 ldw2(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::evict_first.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
DEV uint32_t ldw32(const void* p) {
    uint32_t v;
    asm("ld.global.nc.L1::evict_first.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
DEV uint32_t ld_u16(const uint8_t* p) {  // 2-byte aligned callers only
    unsigned short v;
    asm("ld.global.nc.L1::evict_first.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
#endif
DEV uint32_t ld_u8(const uint8_t* p) { return p[0]; }
DEV uint32_t ld_u16_any(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }
DEV uint32_t ld_u32_a2(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }
DEV uint32_t ld_u32_any(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
DEV float ld_f16(const uint8_t* p) { return f16_to_f32((uint16_t)ld_u16(p)); }
DEV float ld_f16_any(const uint8_t* p) { return f16_to_f32((uint16_t)ld_u16_any(p)); }

DEV int8_t grid_byte(uint64_t g, int k) { return (int8_t)((g >> (8 * k)) & 0xFF); }
// Sign pattern of the IQ2/IQ3 "ksigns" table: 7 stored bits plus an even-parity 8th bit.
DEV uint32_t ksigns(uint32_t i) { return i | ((__popc(i) & 1u) << 7); }

template <int QT>
DEV void deq32(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]);

template <>
DEV void deq32<QT_F32>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint4 v = ldw4(b + 16 * i);
        y[4 * i] = __uint_as_float(v.x); y[4 * i + 1] = __uint_as_float(v.y);
        y[4 * i + 2] = __uint_as_float(v.z); y[4 * i + 3] = __uint_as_float(v.w);
    }
}
template <>
DEV void deq32<QT_F16>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 v = ldw4(b + 16 * i);
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            y[8 * i + 2 * k] = f16_to_f32((uint16_t)(w[k] & 0xFFFF));
            y[8 * i + 2 * k + 1] = f16_to_f32((uint16_t)(w[k] >> 16));
        }
    }
}
template <>
DEV void deq32<QT_BF16>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 v = ldw4(b + 16 * i);
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            y[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
            y[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    }
}

// Q4_0 {f16 d; u8 qs[16]}: element j low nibble of qs[j], element j+16 high nibble.
template <>
DEV void deq32<QT_Q4_0>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint32_t w = ld_u16(b + 2 + 2 * i);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            uint32_t q = (w >> (8 * k)) & 0xFF;
            y[2 * i + k] = i2f_small((int)(q & 0xF) - 8, 8) * d;
            y[2 * i + k + 16] = i2f_small((int)(q >> 4) - 8, 8) * d;
        }
    }
}
// Q4_1 {f16 d; f16 m; u8 qs[16]}: x = d*q + m.
template <>
DEV void deq32<QT_Q4_1>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b), m = ld_f16(b + 2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t w = ldw32(b + 4 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            uint32_t q = (w >> (8 * k)) & 0xFF;
            y[4 * i + k] = d * u2f_small(q & 0xF) + m;
            y[4 * i + k + 16] = d * u2f_small(q >> 4) + m;
        }
    }
}
// Q5_0 {f16 d; u8 qh[4]; u8 qs[16]}: 5th bit of element e is bit e of qh; x = d*(q-16).
template <>
DEV void deq32<QT_Q5_0>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t qh = ld_u32_a2(b + 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint32_t w = ld_u16(b + 6 + 2 * i);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int j = 2 * i + k;
            uint32_t q = (w >> (8 * k)) & 0xFF;
            uint32_t lo = (q & 0xF) | (((qh >> j) & 1) << 4);
            uint32_t hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = i2f_small((int)lo - 16, 16) * d;
            y[j + 16] = i2f_small((int)hi - 16, 16) * d;
        }
    }
}
// Q5_1 {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: x = d*q + m.
template <>
DEV void deq32<QT_Q5_1>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b), m = ld_f16(b + 2);
    const uint32_t qh = ldw32(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t w = ldw32(b + 8 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int j = 4 * i + k;
            uint32_t q = (w >> (8 * k)) & 0xFF;
            uint32_t lo = (q & 0xF) | (((qh >> j) & 1) << 4);
            uint32_t hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * u2f_small(lo) + m;
            y[j + 16] = d * u2f_small(hi) + m;
        }
    }
}
// Q8_0 {f16 d; i8 qs[32]}.
template <>
DEV void deq32<QT_Q8_0>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        uint32_t w = ld_u16(b + 2 + 2 * i);
        y[2 * i] = i2f_small((int)(int8_t)(w & 0xFF), 128) * d;
        y[2 * i + 1] = i2f_small((int)(int8_t)(w >> 8), 128) * d;
    }
}
// Q1_0 (128 per block) {f16 d; u8 qs[16]}: bit e set -> +d, else -d.
template <>
DEV void deq32<QT_Q1_0>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t bits = ld_u32_a2(b + 2 + 4 * c);
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = ((bits >> i) & 1) ? d : -d;
}
// Q2_K {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}. Chunk c: half h = c/4, shift 2*(c%4).
template <>
DEV void deq32<QT_Q2_K>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
    const int h = c >> 2, sh = 2 * (c & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint32_t sc = b[2 * c + half];
        const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t w = ldw32(b + 16 + 32 * h + 16 * half + 4 * i);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                uint32_t q = (w >> (8 * k + sh)) & 3;
                y[16 * half + 4 * i + k] = dl * (float)q - ml;
            }
        }
    }
}
// Q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}.
template <>
DEV void deq32<QT_Q3_K>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b + 108);
    const int h = c >> 2, sh = 2 * (c & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * c + half;
        const uint32_t low4 = (b[96 + (s & 7)] >> (4 * (s >> 3))) & 0xF;
        const uint32_t hi2 = (b[96 + 8 + (s & 3)] >> (2 * (s >> 2))) & 3;
        const float dl = d * (float)((int)(low4 | (hi2 << 4)) - 32);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int l = 16 * half + 2 * i;
            uint32_t w = ld_u16(b + 32 + 32 * h + l);
            uint32_t hm = ld_u16(b + l);
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                int q = (int)((w >> (8 * k + sh)) & 3);
                uint32_t hb = (hm >> (8 * k + c)) & 1;
                y[l + k] = dl * (float)(q - (hb ? 0 : 4));
            }
        }
    }
}
// Q4_K/Q5_K header (16 bytes, 16-aligned): d, dmin and the 6-bit scale/min of sub-block j,
// decoded without branches from one vector load. Layout (spec §5.2), s = scales[12]:
// j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 0xF) | ((s[j-4] >> 6) << 4),
// m = (s[j+4] >> 4) | ((s[j] >> 6) << 4). With jj = j & 3 every byte needed is byte jj of one of
// the three scale words: for j < 4, s[j] in word 0 and s[j+4] in word 1; for j >= 4, s[j-4],
// s[j] and s[j+4] in words 0, 1 and 2.
DEV void k_scales(const uint4& h, int j, float& d1, float& m1) {
    const float d = f16_to_f32((uint16_t)(h.x & 0xFFFF)), dmin = f16_to_f32((uint16_t)(h.x >> 16));
    const int sh = 8 * (j & 3);
    const uint32_t ba = (h.y >> sh) & 0xFF, bb = (h.z >> sh) & 0xFF, bc = (h.w >> sh) & 0xFF;
    const uint32_t sc = j < 4 ? (ba & 63) : ((bc & 0xF) | ((ba >> 6) << 4));
    const uint32_t m = j < 4 ? (bb & 63) : ((bc >> 4) | ((bb >> 6) << 4));
    d1 = d * u2f_small(sc);
    m1 = dmin * u2f_small(m);
}
DEV void k_header(const uint8_t* __restrict__ b, int j, float& d1, float& m1) {
    k_scales(ldw4(b), j, d1, m1);
}

// Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]} (144 B: blocks stay 16-byte aligned).
template <>
DEV void deq32<QT_Q4_K>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    float d1, m1;
    k_header(b, c, d1, m1);
    const uint8_t* qs = b + 16 + 32 * (c >> 1);
    const int sh = 4 * (c & 1);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        uint4 v = ldw4(qs + 16 * i);
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            uint32_t q = (w[k >> 2] >> (8 * (k & 3) + sh)) & 0xF;
            y[16 * i + k] = d1 * u2f_small(q) - m1;
        }
    }
}
// Q5_K {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} (176 B, 16-byte aligned).
template <>
DEV void deq32<QT_Q5_K>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    float d1, m1;
    k_header(b, c, d1, m1);
    const uint8_t* qs = b + 48 + 32 * (c >> 1);
    const int sh = 4 * (c & 1);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        uint4 v = ldw4(qs + 16 * i);
        uint4 hv = ldw4(b + 16 + 16 * i);
        uint32_t w[4] = {v.x, v.y, v.z, v.w};
        uint32_t hw[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            uint32_t q = (w[k >> 2] >> (8 * (k & 3) + sh)) & 0xF;
            q |= ((hw[k >> 2] >> (8 * (k & 3) + c)) & 1) << 4;
            y[16 * i + k] = d1 * u2f_small(q) - m1;
        }
    }
}
// Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}. Chunk c: half h = c/4, r = 32*(c%4) + i.
template <>
DEV void deq32<QT_Q6_K>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b + 208);
    const int h = c >> 2, r0 = 32 * (c & 3);
    const uint8_t* ql = b + 64 * h + (r0 & 63);
    const uint8_t* qh = b + 128 + 32 * h;
    const int lsh = 4 * (r0 >> 6), hsh = 2 * (r0 >> 5);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float dl = d * (float)(int8_t)b[192 + 2 * c + half];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int l = 16 * half + 2 * i;
            uint32_t lw = ld_u16(ql + l);
            uint32_t hw = ld_u16(qh + l);
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                int lo = (int)((lw >> (8 * k + lsh)) & 0xF);
                int hi = (int)((hw >> (8 * k + hsh)) & 3);
                y[l + k] = dl * i2f_small((lo | (hi << 4)) - 32, 32);
            }
        }
    }
}
// IQ4_NL {f16 d; u8 qs[16]}: Q4_0 nibble order through the non-linear table.
template <>
DEV void deq32<QT_IQ4_NL>(const uint8_t* __restrict__ b, int, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint32_t w = ld_u16(b + 2 + 2 * i);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            uint32_t q = (w >> (8 * k)) & 0xFF;
            y[2 * i + k] = d * (float)t.kvalues[q & 0xF];
            y[2 * i + k + 16] = d * (float)t.kvalues[q >> 4];
        }
    }
}
// IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} (136 B: 8-byte aligned).
template <>
DEV void deq32<QT_IQ4_XS>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t sh = ld_u16(b + 2);
    const uint32_t ls = ((b[4 + (c >> 1)] >> (4 * (c & 1))) & 0xF) | (((sh >> (2 * c)) & 3) << 4);
    const float dl = d * (float)((int)ls - 32);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        uint2 v = ldw2(b + 8 + 16 * c + 8 * i);
        uint32_t w[2] = {v.x, v.y};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            uint32_t q = (w[k >> 2] >> (8 * (k & 3))) & 0xFF;
            y[8 * i + k] = dl * (float)t.kvalues[q & 0xF];
            y[8 * i + k + 16] = dl * (float)t.kvalues[q >> 4];
        }
    }
}
// IQ2_XXS {f16 d; u16 qs[32]}: chunk c = (u32 aux0, u32 aux1) at 2 + 8c.
template <>
DEV void deq32<QT_IQ2_XXS>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t aux0 = ld_u32_a2(b + 2 + 8 * c), aux1 = ld_u32_a2(b + 6 + 8 * c);
    const float db = d * (0.5f + (float)(aux1 >> 28)) * 0.25f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const uint64_t g = t.iq2xxs[(aux0 >> (8 * l)) & 0xFF];
        const uint32_t signs = ksigns((aux1 >> (7 * l)) & 127);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float v = db * (float)(uint8_t)grid_byte(g, k);
            y[8 * l + k] = ((signs >> k) & 1) ? -v : v;
        }
    }
}
// IQ2_XS {f16 d; u16 qs[32]; u8 scales[8]}: u16 = 9-bit grid index | 7-bit sign index.
template <>
DEV void deq32<QT_IQ2_XS>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t sc = b[66 + c];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const float db = d * (0.5f + (float)((sc >> (4 * (l >> 1))) & 0xF)) * 0.25f;
        const uint32_t q = ld_u16(b + 2 + 8 * c + 2 * l);
        const uint64_t g = t.iq2xs[q & 511];
        const uint32_t signs = ksigns(q >> 9);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float v = db * (float)(uint8_t)grid_byte(g, k);
            y[8 * l + k] = ((signs >> k) & 1) ? -v : v;
        }
    }
}
// IQ2_S {f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]}: 10-bit grid index, explicit signs.
template <>
DEV void deq32<QT_IQ2_S>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t sc = b[74 + c];
    const uint32_t qh = b[66 + c];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const float db = d * (0.5f + (float)((sc >> (4 * (l >> 1))) & 0xF)) * 0.25f;
        const uint32_t idx = (uint32_t)b[2 + 4 * c + l] | (((qh >> (2 * l)) & 3) << 8);
        const uint64_t g = t.iq2s[idx];
        const uint32_t signs = b[34 + 4 * c + l];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float v = db * (float)(uint8_t)grid_byte(g, k);
            y[8 * l + k] = ((signs >> k) & 1) ? -v : v;
        }
    }
}
// IQ3_XXS {f16 d; u8 qs[64]; u32 scales_signs[8]}: 8-bit grid indices of 4 values.
template <>
DEV void deq32<QT_IQ3_XXS>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t aux = ld_u32_a2(b + 66 + 4 * c);
    const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const uint32_t signs = ksigns((aux >> (7 * l)) & 127);
        const uint32_t g1 = t.iq3xxs[b[2 + 8 * c + 2 * l]];
        const uint32_t g2 = t.iq3xxs[b[2 + 8 * c + 2 * l + 1]];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float v1 = db * (float)((g1 >> (8 * k)) & 0xFF);
            float v2 = db * (float)((g2 >> (8 * k)) & 0xFF);
            y[8 * l + k] = ((signs >> k) & 1) ? -v1 : v1;
            y[8 * l + 4 + k] = ((signs >> (k + 4)) & 1) ? -v2 : v2;
        }
    }
}
// IQ3_S {f16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}: 9-bit grid indices, db = d*(1+2s).
template <>
DEV void deq32<QT_IQ3_S>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t s = (b[106 + (c >> 1)] >> (4 * (c & 1))) & 0xF;
    const float db = d * (float)(1 + 2 * (int)s);
    const uint32_t qh = b[66 + c];
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const uint32_t signs = b[74 + 4 * c + l];
        const uint32_t i1 = (uint32_t)b[2 + 8 * c + 2 * l] | (((qh >> (2 * l)) & 1) << 8);
        const uint32_t i2 = (uint32_t)b[2 + 8 * c + 2 * l + 1] | (((qh >> (2 * l + 1)) & 1) << 8);
        const uint32_t g1 = t.iq3s[i1], g2 = t.iq3s[i2];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float v1 = db * (float)((g1 >> (8 * k)) & 0xFF);
            float v2 = db * (float)((g2 >> (8 * k)) & 0xFF);
            y[8 * l + k] = ((signs >> k) & 1) ? -v1 : v1;
            y[8 * l + 4 + k] = ((signs >> (k + 4)) & 1) ? -v2 : v2;
        }
    }
}
// IQ1_S {f16 d; u8 qs[32]; u16 qh[8]}: 11-bit indices into a {-1,0,1} grid plus a +-1/8 shift.
template <>
DEV void deq32<QT_IQ1_S>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const float d = ld_f16(b);
    const uint32_t qh = ld_u16(b + 34 + 2 * c);
    const float dl = d * (float)(2 * (int)((qh >> 12) & 7) + 1);
    const float delta = (qh & 0x8000) ? -0.125f : 0.125f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const uint32_t idx = (uint32_t)b[2 + 4 * c + l] | (((qh >> (3 * l)) & 7) << 8);
        const uint64_t g = t.iq1s[idx];
#pragma unroll
        for (int k = 0; k < 8; ++k) y[8 * l + k] = dl * ((float)grid_byte(g, k) + delta);
    }
}
// IQ1_M {u8 qs[32]; u8 qh[16]; u8 scales[8]}: the f16 scale is spread over the top nibbles of scales.
template <>
DEV void deq32<QT_IQ1_M>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
    const uint32_t s0 = ld_u16(b + 48), s1 = ld_u16(b + 50), s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
    const uint32_t dbits = (s0 >> 12) | ((s1 >> 12) << 4) | ((s2 >> 12) << 8) | ((s3 >> 12) << 12);
    const float d = f16_to_f32((uint16_t)dbits);
    const uint32_t sw = ld_u16(b + 48 + 2 * (c >> 1));
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const int sub16 = 2 * c + (l >> 1);  // 16-element sub-block
        const uint32_t s = (sw >> (3 * (sub16 & 3))) & 7;
        const float dl = d * (float)(2 * (int)s + 1);
        const uint32_t nib = (b[32 + 2 * c + (l >> 1)] >> (4 * (l & 1))) & 0xF;
        const uint32_t idx = (uint32_t)b[4 * c + l] | ((nib & 7) << 8);
        const float delta = (nib & 8) ? -0.125f : 0.125f;
        const uint64_t g = t.iq1s[idx];
#pragma unroll
        for (int k = 0; k < 8; ++k) y[8 * l + k] = dl * ((float)grid_byte(g, k) + delta);
    }
}
// TQ1_0 {u8 qs[48]; u8 qh[4]; f16 d}: base-3 digits, 5 per byte.
DEV int tq1_digit(uint32_t byte, int k) {
    const uint32_t pw[5] = {1, 3, 9, 27, 81};
    uint32_t v = (byte * pw[k]) & 0xFF;
    return (int)((v * 3) >> 8) - 1;
}
template <>
DEV void deq32<QT_TQ1_0>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b + 52);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int e = 32 * c + i;
        uint32_t byte;
        int k;
        if (e < 160) {
            k = e >> 5;
            byte = b[e & 31];
        } else if (e < 240) {
            k = (e - 160) >> 4;
            byte = b[32 + ((e - 160) & 15)];
        } else {
            k = (e - 240) >> 2;
            byte = b[48 + ((e - 240) & 3)];
        }
        y[i] = (float)tq1_digit(byte, k) * d;
    }
}
// TQ2_0 {u8 qs[64]; f16 d}: e = 128h + 32k + j <-> (qs[32h + j] >> 2k) & 3; x = d*(q-1).
template <>
DEV void deq32<QT_TQ2_0>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b + 64);
    const int h = c >> 2, sh = 2 * (c & 3);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        uint32_t w = ld_u16(b + 32 * h + 2 * i);
        y[2 * i] = (float)((int)((w >> sh) & 3) - 1) * d;
        y[2 * i + 1] = (float)((int)((w >> (8 + sh)) & 3) - 1) * d;
    }
}
// MXFP4 {u8 e (E8M0); u8 qs[16]}: d = 2^(e-128) as the spec builds it from bits.
template <>
DEV void deq32<QT_MXFP4>(const uint8_t* __restrict__ b, int, const QTables& t, float (&y)[32]) {
    const uint32_t e = b[0];
    const float d = e < 2 ? __uint_as_float(0x00200000u << e) : __uint_as_float((e - 1) << 23);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const uint32_t q = b[1 + j];
        y[j] = d * (float)t.fp4[q & 0xF];
        y[j + 16] = d * (float)t.fp4[q >> 4];
    }
}
// NVFP4 (64 per block) {u8 d[4] (UE4M3 per 16); u8 qs[32]}.
DEV float ue4m3(uint32_t b) {
    if (b == 0 || b == 0x7F) return 0.0f;
    const uint32_t ex = (b >> 3) & 0xF, man = b & 7;
    float v;
    if (ex == 0) v = (float)man * __uint_as_float((127u - 9u) << 23);
    else v = (1.0f + (float)man * 0.125f) * __uint_as_float((127u + ex - 7u) << 23);
    return v * 0.5f;
}
template <>
DEV void deq32<QT_NVFP4>(const uint8_t* __restrict__ b, int c, const QTables& t, float (&y)[32]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int s = 2 * c + half;
        const float d = ue4m3(b[s]);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint32_t q = b[4 + 8 * s + j];
            y[16 * half + j] = d * (float)t.fp4[q & 0xF];
            y[16 * half + 8 + j] = d * (float)t.fp4[q >> 4];
        }
    }
}

// Q8_1 {f16 d; f16 s; i8 qs[32]} (36 B, 4-byte aligned): x = d*q (s is only for dot products).
template <>
DEV void deq32<QT_Q8_1>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
    const float d = ld_f16(b);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint32_t w = ldw32(b + 4 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; ++k) y[4 * i + k] = d * (float)(int8_t)((w >> (8 * k)) & 0xFF);
    }
}
// Q8_K {f32 d; i8 qs[256]; i16 bsums[16]} (292 B, 4-byte aligned).
template <>
DEV void deq32<QT_Q8_K>(const uint8_t* __restrict__ b, int c, const QTables&, float (&y)[32]) {
    const float d = *(const float*)b;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        uint32_t w = ldw32(b + 4 + 32 * c + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; ++k) y[4 * i + k] = d * (float)(int8_t)((w >> (8 * k)) & 0xFF);
    }
}
// Plain integer and f64 tensors: converted with round-to-nearest-even like Rust's `as f32`.
template <>
DEV void deq32<QT_I8>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = (float)(int8_t)b[i];
}
template <>
DEV void deq32<QT_I16>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = (float)((const int16_t*)b)[i];
}
template <>
DEV void deq32<QT_I32>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = (float)((const int32_t*)b)[i];
}
template <>
DEV void deq32<QT_I64>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = (float)((const int64_t*)b)[i];
}
template <>
DEV void deq32<QT_F64>(const uint8_t* __restrict__ b, int, const QTables&, float (&y)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = (float)((const double*)b)[i];
}

// Element i of a plain (block size 1) tensor, for the partial last chunk of such tensors.
template <int QT> DEV float plain_elem(const uint8_t* __restrict__ base, long long i) {
    switch (QT) {
        case QT_F32: return ((const float*)base)[i];
        case QT_F16: return f16_to_f32(((const uint16_t*)base)[i]);
        case QT_BF16: return bf16_to_f32(((const uint16_t*)base)[i]);
        case QT_I8: return (float)((const int8_t*)base)[i];
        case QT_I16: return (float)((const int16_t*)base)[i];
        case QT_I32: return (float)((const int32_t*)base)[i];
        case QT_I64: return (float)((const int64_t*)base)[i];
        case QT_F64: return (float)((const double*)base)[i];
        default: return __int_as_float(0x7fc00000);
    }
}

// ---- Repacked layouts (kernels/src/repack.rs) -------------------------------------------------
// Types whose GGUF blocks are not 16-byte aligned are stored on the device as a lossless
// permutation of the same bytes: per tensor of `nblk` blocks, one region per field, block g's
// field at region + g * field_size. Quant bytes then sit on 16-byte boundaries (one vector load
// per 32 weights). Type ids 100 + the GGUF id; QB/BB are the GGUF block's elements and bytes.
#define QT_R 100
#define QT_Q4_0_R (QT_R + QT_Q4_0)
#define QT_Q4_1_R (QT_R + QT_Q4_1)
#define QT_Q5_0_R (QT_R + QT_Q5_0)
#define QT_Q5_1_R (QT_R + QT_Q5_1)
#define QT_Q8_0_R (QT_R + QT_Q8_0)
#define QT_Q6_K_R (QT_R + QT_Q6_K)
#define QT_IQ4_NL_R (QT_R + QT_IQ4_NL)
QTRAITS(QT_Q4_0_R, 32, 18)
QTRAITS(QT_Q4_1_R, 32, 20)
QTRAITS(QT_Q5_0_R, 32, 22)
QTRAITS(QT_Q5_1_R, 32, 24)
QTRAITS(QT_Q8_0_R, 32, 34)
QTRAITS(QT_Q6_K_R, 256, 210)
QTRAITS(QT_IQ4_NL_R, 32, 18)

// A weight tensor on the device: GGUF blocks back to back, or a repacked tensor of nblk blocks.
struct WMat {
    const uint8_t* base;
    long long nblk;
};

DEV uint4 ld16(const uint8_t* p) { return ldw4(p); }
DEV float rp_f16(const uint8_t* p) { return f16_to_f32((uint16_t)ld_u16(p)); }

// Elements [32c, 32c + 32) of block g (c < QB/32) of a tensor, in either layout. The values are
// formed exactly as deq32<> forms them for the GGUF block (same products, same order).
template <int QT>
DEV void dec_chunk(const WMat& m, long long g, int c, const QTables& t, float (&y)[32]) {
    deq32<QT>(m.base + g * QTraits<QT>::BB, c, t, y);
}

// Q4_0_R: qs[16] at 16g, d at 16n + 2g.
template <>
DEV void dec_chunk<QT_Q4_0_R>(const WMat& m, long long g, int, const QTables&, float (&y)[32]) {
    const uint4 v = ld16(m.base + 16 * g);
    const float d = rp_f16(m.base + 16 * m.nblk + 2 * g);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const uint32_t q = (w[k >> 2] >> (8 * (k & 3))) & 0xFF;
        y[k] = i2f_small((int)(q & 0xF) - 8, 8) * d;
        y[k + 16] = i2f_small((int)(q >> 4) - 8, 8) * d;
    }
}
// Q4_1_R: qs[16] at 16g, d at 16n + 2g, m at 18n + 2g.
template <>
DEV void dec_chunk<QT_Q4_1_R>(const WMat& m, long long g, int, const QTables&, float (&y)[32]) {
    const uint4 v = ld16(m.base + 16 * g);
    const float d = rp_f16(m.base + 16 * m.nblk + 2 * g), mn = rp_f16(m.base + 18 * m.nblk + 2 * g);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const uint32_t q = (w[k >> 2] >> (8 * (k & 3))) & 0xFF;
        y[k] = d * u2f_small(q & 0xF) + mn;
        y[k + 16] = d * u2f_small(q >> 4) + mn;
    }
}
// Q5_0_R: qs[16] at 16g, qh (u32) at 16n + 4g, d at 20n + 2g.
template <>
DEV void dec_chunk<QT_Q5_0_R>(const WMat& m, long long g, int, const QTables&, float (&y)[32]) {
    const uint4 v = ld16(m.base + 16 * g);
    const uint32_t qh = ldw32(m.base + 16 * m.nblk + 4 * g);
    const float d = rp_f16(m.base + 20 * m.nblk + 2 * g);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const uint32_t q = (w[k >> 2] >> (8 * (k & 3))) & 0xFF;
        const uint32_t lo = (q & 0xF) | (((qh >> k) & 1) << 4);
        const uint32_t hi = (q >> 4) | (((qh >> (k + 16)) & 1) << 4);
        y[k] = i2f_small((int)lo - 16, 16) * d;
        y[k + 16] = i2f_small((int)hi - 16, 16) * d;
    }
}
// Q5_1_R: qs[16] at 16g, qh at 16n + 4g, d at 20n + 2g, m at 22n + 2g.
template <>
DEV void dec_chunk<QT_Q5_1_R>(const WMat& m, long long g, int, const QTables&, float (&y)[32]) {
    const uint4 v = ld16(m.base + 16 * g);
    const uint32_t qh = ldw32(m.base + 16 * m.nblk + 4 * g);
    const float d = rp_f16(m.base + 20 * m.nblk + 2 * g), mn = rp_f16(m.base + 22 * m.nblk + 2 * g);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const uint32_t q = (w[k >> 2] >> (8 * (k & 3))) & 0xFF;
        const uint32_t lo = (q & 0xF) | (((qh >> k) & 1) << 4);
        const uint32_t hi = (q >> 4) | (((qh >> (k + 16)) & 1) << 4);
        y[k] = d * u2f_small(lo) + mn;
        y[k + 16] = d * u2f_small(hi) + mn;
    }
}
// Q8_0_R: qs[32] at 32g, d at 32n + 2g.
template <>
DEV void dec_chunk<QT_Q8_0_R>(const WMat& m, long long g, int, const QTables&, float (&y)[32]) {
    const float d = rp_f16(m.base + 32 * m.nblk + 2 * g);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const uint4 v = ld16(m.base + 32 * g + 16 * i);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 16; ++k)
            y[16 * i + k] = i2f_small((int)(int8_t)((w[k >> 2] >> (8 * (k & 3))) & 0xFF), 128) * d;
    }
}
// IQ4_NL_R: qs[16] at 16g, d at 16n + 2g.
template <>
DEV void dec_chunk<QT_IQ4_NL_R>(const WMat& m, long long g, int, const QTables& t, float (&y)[32]) {
    const uint4 v = ld16(m.base + 16 * g);
    const float d = rp_f16(m.base + 16 * m.nblk + 2 * g);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        const uint32_t q = (w[k >> 2] >> (8 * (k & 3))) & 0xFF;
        y[k] = d * (float)t.kvalues[q & 0xF];
        y[k + 16] = d * (float)t.kvalues[q >> 4];
    }
}
// Q6_K_R: ql[128] + qh[64] at 192g, scales[16] at 192n + 16g, d at 208n + 2g.
// Chunk c: half h = c/4, r0 = 32*(c%4): ql[64h + (r0 & 63) ...] >> 4*(r0/64), qh[32h ...] >> 2*(r0/32).
template <>
DEV void dec_chunk<QT_Q6_K_R>(const WMat& m, long long g, int c, const QTables&, float (&y)[32]) {
    const uint8_t* b = m.base + 192 * g;
    const float d = rp_f16(m.base + 208 * m.nblk + 2 * g);
    const int8_t* sc = (const int8_t*)(m.base + 192 * m.nblk + 16 * g);
    const int h = c >> 2, r0 = 32 * (c & 3);
    const int lsh = 4 * (r0 >> 6), hsh = 2 * (r0 >> 5);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float dl = d * (float)sc[2 * c + half];
        const uint4 lv = ld16(b + 64 * h + (r0 & 63) + 16 * half);
        const uint4 hv = ld16(b + 128 + 32 * h + 16 * half);
        const uint32_t lw[4] = {lv.x, lv.y, lv.z, lv.w};
        const uint32_t hw[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const int lo = (int)((lw[k >> 2] >> (8 * (k & 3) + lsh)) & 0xF);
            const int hi = (int)((hw[k >> 2] >> (8 * (k & 3) + hsh)) & 3);
            y[16 * half + k] = dl * i2f_small((lo | (hi << 4)) - 32, 32);
        }
    }
}

// The repacked types, for instantiation macros.
#define FOR_EACH_RTYPE(X) \
    X(QT_Q4_0_R, q4_0_r) X(QT_Q4_1_R, q4_1_r) X(QT_Q5_0_R, q5_0_r) X(QT_Q5_1_R, q5_1_r) \
    X(QT_Q8_0_R, q8_0_r) X(QT_Q6_K_R, q6_k_r) X(QT_IQ4_NL_R, iq4_nl_r)

// Every GPU-supported type, for instantiation macros: X(QT, suffix).
#define FOR_EACH_QTYPE(X) \
    X(QT_F32, f32) X(QT_F16, f16) X(QT_BF16, bf16) X(QT_Q4_0, q4_0) X(QT_Q4_1, q4_1) X(QT_Q5_0, q5_0) \
    X(QT_Q5_1, q5_1) X(QT_Q8_0, q8_0) X(QT_Q2_K, q2_k) X(QT_Q3_K, q3_k) X(QT_Q4_K, q4_k) \
    X(QT_Q5_K, q5_k) X(QT_Q6_K, q6_k) X(QT_IQ2_XXS, iq2_xxs) X(QT_IQ2_XS, iq2_xs) \
    X(QT_IQ3_XXS, iq3_xxs) X(QT_IQ1_S, iq1_s) X(QT_IQ4_NL, iq4_nl) X(QT_IQ3_S, iq3_s) \
    X(QT_IQ2_S, iq2_s) X(QT_IQ4_XS, iq4_xs) X(QT_IQ1_M, iq1_m) X(QT_TQ1_0, tq1_0) \
    X(QT_TQ2_0, tq2_0) X(QT_MXFP4, mxfp4) X(QT_NVFP4, nvfp4) X(QT_Q1_0, q1_0) X(QT_Q8_1, q8_1) \
    X(QT_Q8_K, q8_k) X(QT_I8, i8) X(QT_I16, i16) X(QT_I32, i32) X(QT_I64, i64) X(QT_F64, f64)
