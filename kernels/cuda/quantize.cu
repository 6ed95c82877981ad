// Op `quantize`: f32 activations -> q8a (the input format of gemvq.cu). Per block of 32 values:
//   d = max|x| / 127,  q = round(x / d) (half away from zero; 0 when d = 0),
// the codes as int8 and one 8-byte record {f32 d; i16 sum of codes 0..15; i16 sum of 16..31}.
// Rows of K (a multiple of 32) values, `x_stride` apart; outputs dense: qs[r*K + k],
// ds[r*K/32 + b].
// One warp per block of 32 (lane = element), grid-stride over all blocks. The division is the
// correctly rounded IEEE one (no fast math), so a CPU emulation reproduces every code exactly.
// A block holding NaN or an infinity gets d = NaN (codes 0).

extern "C" __global__ void quantize_q8a(const float* __restrict__ x, long long x_stride,
                                        long long rows, int K, int8_t* __restrict__ qs,
                                        float2* __restrict__ ds) {
    pdl_entry();
    const int lane = threadIdx.x & 31;
    const long long nb = K >> 5;
    const long long total = rows * nb;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < total;
         b += warps) {
        const long long r = b / nb, c = b % nb;
        q8a_store_block(x[r * x_stride + c * 32 + lane], r * K + c * 32 + lane, qs, ds);
    }
}
