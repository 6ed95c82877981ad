// Op `allreduce`: one-shot all-reduce (sum) of f32 vectors over the ranks of a tensor-parallel
// group, through buffers every rank can read: peer-mapped GPUs, or several ranks on one GPU.
//
// Every rank launches this kernel on its own stream with the same grid. Block b of rank r:
//   1. e = ++counter[b]: a per-block epoch kept in the rank's own memory, so no launch argument
//      changes from one call to the next (the launch can be captured in a CUDA graph); e & 1
//      picks which half of the exchange buffer this call uses.
//   2. copies its chunk of the input into that half of rank r's buffer,
//   3. publishes flags[r][b] = e (32-bit, release at system scope: peers may be other GPUs),
//   4. waits until (int)(flags[q][b] - e) >= 0 for every rank q (acquire; the difference is
//      wrap-safe, so the epochs never need a reset),
//   5. sums its chunk over all ranks' buffers in rank order 0..N-1 (the order every backend
//      uses, so every rank gets the same bits and the CPU sum equals it) and writes the output.
// Two halves make reuse safe: a rank writes a half again at epoch e + 2 only after its epoch
// e + 1 wait saw every peer's e + 1 flag, and a peer publishes e + 1 only after its epoch e
// kernel (which read that half) has finished on its stream.
// Peer data is read with ld.global.cv (not cached in L1: the lines change between epochs).
// A wait longer than `timeout_ns` (a rank that never arrives) sets *error and returns.

DEV void st_release_sys(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
DEV unsigned int ld_acquire_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
DEV float ld_cv(const float* p) {
    float v;
    asm volatile("ld.global.cv.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
DEV unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// bufs[q]: rank q's exchange buffer (2 * cap floats); flags[q]: rank q's gridDim.x flags.
extern "C" __global__ void allreduce_oneshot_f32(const float* in, float* out, long long n,
                                                 float* const* bufs, unsigned int* const* flags,
                                                 unsigned int* counter, unsigned int* error,
                                                 int rank, int world, long long cap,
                                                 unsigned long long timeout_ns) {
    __shared__ unsigned int epoch_s;
    __shared__ int failed_s;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) {
        epoch_s = counter[b] + 1u;
        counter[b] = epoch_s;
        failed_s = 0;
    }
    __syncthreads();
    const unsigned int e = epoch_s;
    const long long half = (long long)(e & 1u) * cap;
    const long long per = (n + gridDim.x - 1) / gridDim.x;
    const long long lo = (long long)b * per;
    const long long hi = lo + per < n ? lo + per : n;
    float* mine = bufs[rank] + half;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = in[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        st_release_sys(flags[rank] + b, e);
    }
    if (threadIdx.x < world) {
        const unsigned int* f = flags[threadIdx.x] + b;
        const unsigned long long t0 = global_ns();
        while ((int)(ld_acquire_sys(f) - e) < 0) {
            if (global_ns() - t0 > timeout_ns) {
                atomicExch(error, 1u);
                failed_s = 1;
                break;
            }
        }
    }
    __syncthreads();
    if (failed_s) return;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float s = ld_cv(bufs[0] + half + i);
        for (int q = 1; q < world; ++q) s += ld_cv(bufs[q] + half + i);
        out[i] = s;
    }
}
