// Op `dequant`: ggml blocks -> f32 (or bf16) values, for `verify --gpu`, embedding rows and as the
// first half of dequantize + cuBLAS GEMM for prefill. One thread per 32-element chunk; n is the
// element count, starting at block g0 of the tensor `m` (GGUF or repacked layout, quant.cuh).
// Only plain types can end in a partial chunk (decoded element by element). Grid-stride over the
// chunks, so any n fits the grid.

template <int QT>
DEV bool chunk_values(const WMat& m, long long g0, long long q, long long n, const QTables& t,
                      float (&y)[32]) {
    constexpr int NC = QTraits<QT>::QB / 32;
    if ((q + 1) * 32 <= n) {
        dec_chunk<QT>(m, g0 + q / NC, (int)(q % NC), t, y);
        return true;
    }
    const uint8_t* src = m.base + g0 * QTraits<QT>::BB;
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = q * 32 + i < n ? plain_elem<QT>(src, q * 32 + i) : 0.0f;
    return false;
}

template <int QT>
DEV void dequant_impl(WMat m, long long g0, float* __restrict__ dst, long long n, const QTables& t) {
    const long long chunks = (n + 31) / 32;
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < chunks;
         q += (long long)gridDim.x * blockDim.x) {
        float y[32];
        if (chunk_values<QT>(m, g0, q, n, t, y)) {
            float4* o = (float4*)(dst + q * 32);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i)
                if (q * 32 + i < n) dst[q * 32 + i] = y[i];
        }
    }
}

template <int QT>
DEV void dequant_bf16_impl(WMat m, long long g0, uint16_t* __restrict__ dst, long long n,
                           const QTables& t) {
    const long long chunks = (n + 31) / 32;
    for (long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x; q < chunks;
         q += (long long)gridDim.x * blockDim.x) {
        float y[32];
        if (chunk_values<QT>(m, g0, q, n, t, y)) {
            uint4* o = (uint4*)(dst + q * 32);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint32_t w[4];
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    w[k] = (uint32_t)f32_to_bf16(y[8 * i + 2 * k]) |
                           ((uint32_t)f32_to_bf16(y[8 * i + 2 * k + 1]) << 16);
                o[i] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i)
                if (q * 32 + i < n) dst[q * 32 + i] = f32_to_bf16(y[i]);
        }
    }
}

// Rows `ids[r]` of a [nrows, K] matrix -> dst[r, K] (token embedding lookup), K a multiple of 32.
// Grid (chunks per row, min(nids, 65535)), rows grid-strided over y. An id outside [0, nrows)
// yields a NaN row instead of reading out of bounds.
template <int QT>
DEV void get_rows_impl(WMat m, long long nrows, const int* __restrict__ ids, long long nids,
                       float* __restrict__ dst, int K, const QTables& t) {
    constexpr int NC = QTraits<QT>::QB / 32;
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= K / 32) return;
    const long long bpr = K / QTraits<QT>::QB;
    for (long long r = blockIdx.y; r < nids; r += gridDim.y) {
        const long long id = ids[r];
        float4* o = (float4*)(dst + r * K + (long long)q * 32);
        if (id < 0 || id >= nrows) {
            const float nan = __int_as_float(0x7fc00000);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = make_float4(nan, nan, nan, nan);
            continue;
        }
        float y[32];
        dec_chunk<QT>(m, id * bpr + q / NC, q % NC, t, y);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
    }
}

#define DEQ_KERNELS(QT, name)                                                                        \
    extern "C" __global__ void dequant_##name(WMat m, long long g0, float* dst, long long n,          \
                                              QTables t) { pdl_entry();                             \
        dequant_impl<QT>(m, g0, dst, n, t);                                                         \
    }                                                                                               \
    extern "C" __global__ void dequant_bf16_##name(WMat m, long long g0, uint16_t* dst, long long n, \
                                                   QTables t) { pdl_entry();                        \
        dequant_bf16_impl<QT>(m, g0, dst, n, t);                                                    \
    }                                                                                               \
    extern "C" __global__ void get_rows_##name(WMat m, long long nrows, const int* ids,             \
                                               long long nids, float* dst, int K, QTables t) { pdl_entry(); \
        get_rows_impl<QT>(m, nrows, ids, nids, dst, K, t);                                          \
    }
FOR_EACH_QTYPE(DEQ_KERNELS)
FOR_EACH_RTYPE(DEQ_KERNELS)
