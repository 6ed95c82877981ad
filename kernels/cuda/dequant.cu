// Op `dequant`: ggml blocks -> f32 (or bf16) values, for `verify --gpu`, embedding rows and as the
// first half of dequantize + cuBLAS GEMM for prefill. One thread per 32-element chunk; n is the
// total element count (only plain types can end in a partial chunk, decoded element by element).

template <int QT>
DEV bool chunk_values(const uint8_t* __restrict__ src, long long q, long long n, const QTables& t,
                      float (&y)[32]) {
    constexpr int NC = QTraits<QT>::QB / 32, BB = QTraits<QT>::BB;
    if ((q + 1) * 32 <= n) {
        deq32<QT>(src + (q / NC) * BB, (int)(q % NC), t, y);
        return true;
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) y[i] = q * 32 + i < n ? plain_elem<QT>(src, q * 32 + i) : 0.0f;
    return false;
}

template <int QT>
DEV void dequant_impl(const uint8_t* __restrict__ src, float* __restrict__ dst, long long n,
                      const QTables& t) {
    const long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (q * 32 >= n) return;
    float y[32];
    if (chunk_values<QT>(src, q, n, t, y)) {
        float4* o = (float4*)(dst + q * 32);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (q * 32 + i < n) dst[q * 32 + i] = y[i];
    }
}

template <int QT>
DEV void dequant_bf16_impl(const uint8_t* __restrict__ src, uint16_t* __restrict__ dst, long long n,
                           const QTables& t) {
    const long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (q * 32 >= n) return;
    float y[32];
    if (chunk_values<QT>(src, q, n, t, y)) {
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

// Rows `ids[r]` of a [nrows, K] matrix -> dst[r, K] (token embedding lookup), K a multiple of 32.
// Grid (chunks per row, nids). An id outside [0, nrows) yields a NaN row instead of reading out
// of bounds.
template <int QT>
DEV void get_rows_impl(const uint8_t* __restrict__ src, long long row_bytes, long long nrows,
                       const int* __restrict__ ids, float* __restrict__ dst, int K, const QTables& t) {
    constexpr int NC = QTraits<QT>::QB / 32, BB = QTraits<QT>::BB;
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y;
    if (q >= K / 32) return;
    const long long id = ids[r];
    float4* o = (float4*)(dst + (long long)r * K + (long long)q * 32);
    if (id < 0 || id >= nrows) {
        const float nan = __int_as_float(0x7fc00000);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = make_float4(nan, nan, nan, nan);
        return;
    }
    float y[32];
    deq32<QT>(src + id * row_bytes + (long long)(q / NC) * BB, q % NC, t, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
}

#define DEQ_KERNELS(QT, name)                                                                        \
    extern "C" __global__ void dequant_##name(const uint8_t* src, float* dst, long long n,           \
                                              QTables t) {                                          \
        dequant_impl<QT>(src, dst, n, t);                                                           \
    }                                                                                               \
    extern "C" __global__ void dequant_bf16_##name(const uint8_t* src, uint16_t* dst, long long n,   \
                                                   QTables t) {                                     \
        dequant_bf16_impl<QT>(src, dst, n, t);                                                      \
    }                                                                                               \
    extern "C" __global__ void get_rows_##name(const uint8_t* src, long long row_bytes,              \
                                               long long nrows, const int* ids, float* dst, int K,  \
                                               QTables t) {                                         \
        get_rows_impl<QT>(src, row_bytes, nrows, ids, dst, K, t);                                   \
    }
FOR_EACH_QTYPE(DEQ_KERNELS)
