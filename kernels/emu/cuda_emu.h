// CPU emulation shim: force-included (`-include`) before a kernel module's full source, which
// is then compiled as C++17 by the host compiler with -DGGUFTOOL_EMU (kernels/emu/src/lib.rs).
// It supplies what NVRTC provides built in: qualifiers, built-in variables, vector types, warp
// collectives, barriers, atomics and the intrinsics the kernels use. The scheduler behind the
// collectives is runtime.cpp: the threads of a block are fibers on one OS thread, switched only
// inside the collectives and barriers, so execution is deterministic.
//
// Deliberately no system header: prelude.cuh typedefs int64_t as `long long`, glibc as `long`,
// and the two would clash (even <cmath> brings glibc's in). Only builtin types appear here, and
// the libm functions the kernels call are declared below. runtime.cpp, which needs system
// headers and none of the kernel-facing part, is compiled with GGUFTOOL_EMU_RUNTIME.

#ifndef GGUFTOOL_CUDA_EMU_H
#define GGUFTOOL_CUDA_EMU_H

// ---------------------------------------------------------------------------------------------
// Vector types (CUDA's alignments: 16-byte loads through int4/uint4/float4 stay aligned)

#define EMU_VEC2(T, N, A)                                                                         \
    struct __attribute__((aligned(A))) N##2 { T x, y; };                                          \
    inline N##2 make_##N##2(T x, T y) { N##2 v; v.x = x; v.y = y; return v; }
#define EMU_VEC3(T, N)                                                                            \
    struct N##3 { T x, y, z; };                                                                   \
    inline N##3 make_##N##3(T x, T y, T z) { N##3 v; v.x = x; v.y = y; v.z = z; return v; }
#define EMU_VEC4(T, N, A)                                                                         \
    struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };                                    \
    inline N##4 make_##N##4(T x, T y, T z, T w) {                                                 \
        N##4 v; v.x = x; v.y = y; v.z = z; v.w = w; return v;                                     \
    }
#define EMU_VEC(T, N, A2, A4) EMU_VEC2(T, N, A2) EMU_VEC3(T, N) EMU_VEC4(T, N, A4)
EMU_VEC(signed char, char, 2, 4)
EMU_VEC(unsigned char, uchar, 2, 4)
EMU_VEC(short, short, 4, 8)
EMU_VEC(unsigned short, ushort, 4, 8)
EMU_VEC(int, int, 8, 16)
EMU_VEC(unsigned int, uint, 8, 16)
EMU_VEC(float, float, 8, 16)
EMU_VEC(long long, longlong, 16, 16)
EMU_VEC(unsigned long long, ulonglong, 16, 16)
EMU_VEC(double, double, 16, 16)
#undef EMU_VEC
#undef EMU_VEC2
#undef EMU_VEC3
#undef EMU_VEC4

struct dim3 {
    unsigned int x, y, z;
};

// Set by the scheduler on every switch to a thread (runtime.cpp).
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

// ---------------------------------------------------------------------------------------------
// Barriers and warp collectives (runtime.cpp). Every one of these is a call the compiler cannot
// see into: values another fiber wrote to shared or global memory are re-read after it.

enum EmuWarpOp {
    EMU_SHFL_IDX,
    EMU_SHFL_UP,
    EMU_SHFL_DOWN,
    EMU_SHFL_XOR,
    EMU_BALLOT,
    EMU_ANY,
    EMU_ALL,
    EMU_MATCH_ANY,
    EMU_SYNCWARP,
    EMU_REDUCE_ADD,
    EMU_REDUCE_MIN,
    EMU_REDUCE_MAX,
    EMU_REDUCE_AND,
    EMU_REDUCE_OR,
    EMU_REDUCE_XOR,
    EMU_ALLGATHER,
};
enum EmuBarrier { EMU_BAR_SYNC, EMU_BAR_OR, EMU_BAR_AND, EMU_BAR_COUNT };

// A warp collective: `value` holds `size` bytes (zero-extended), `arg` the lane / offset of a
// shuffle, `width` its segment width. Returns this lane's result.
extern "C" unsigned long long emu_warp_op(int op, unsigned mask, unsigned long long value,
                                          int arg, int width, int size);
extern "C" int emu_barrier(int kind, int pred);
// Every lane of `mask` passes `bytes` bytes at `in` and receives all of them at `out` (lane j's
// at out + j * bytes; lanes outside the mask leave theirs untouched).
extern "C" void emu_warp_allgather(unsigned mask, const void* in, int bytes, void* out);
// Switches to the next runnable thread (a spin-wait that sleeps lets the others progress).
extern "C" void emu_yield();

#ifndef GGUFTOOL_EMU_RUNTIME

// ---------------------------------------------------------------------------------------------
// Qualifiers

// Entry points are the only symbols a module exports (it is compiled with -fvisibility=hidden).
#define __global__ __attribute__((visibility("default")))
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static
// Blocks run one at a time, so a function-local static is the block's shared variable. The
// module's link gathers the kernel object's zero-initialized function-local statics (sections
// .bss._ZZ*, from -fdata-sections: exactly the __shared__ variables, template instantiations
// included) into one section whose bytes the runtime poisons at each block start (0xFF: NaN as a
// float, -1 as an integer), so a read before the first write shows. `used` keeps the compiler
// from assuming that only the declaring function can touch the variable: other fibers of the
// block write it inside the (opaque) barrier calls.
#define __shared__ static __attribute__((used))

// On the device: `extern __shared__ T name[]`; here the emulator's per-launch dynamic buffer
// (prelude.cuh's DYN_SHARED uses it under GGUFTOOL_EMU).
extern "C" void* emu_dynamic_shared();

constexpr int warpSize = 32;

template <class T>
inline unsigned long long emu_raw(T v) {
    static_assert(sizeof(T) <= 8, "warp collectives take values of at most 8 bytes");
    unsigned long long r = 0;
    __builtin_memcpy(&r, &v, sizeof(T));
    return r;
}
template <class T>
inline T emu_unraw(unsigned long long r) {
    T v;
    __builtin_memcpy(&v, &r, sizeof(T));
    return v;
}

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return emu_unraw<T>(emu_warp_op(EMU_SHFL_IDX, mask, emu_raw(v), src, width, sizeof(T)));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return emu_unraw<T>(emu_warp_op(EMU_SHFL_UP, mask, emu_raw(v), (int)delta, width, sizeof(T)));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return emu_unraw<T>(emu_warp_op(EMU_SHFL_DOWN, mask, emu_raw(v), (int)delta, width, sizeof(T)));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return emu_unraw<T>(emu_warp_op(EMU_SHFL_XOR, mask, emu_raw(v), lane_mask, width, sizeof(T)));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)emu_warp_op(EMU_BALLOT, mask, pred != 0, 0, 32, 4);
}
inline int __any_sync(unsigned mask, int pred) {
    return (int)emu_warp_op(EMU_ANY, mask, pred != 0, 0, 32, 4);
}
inline int __all_sync(unsigned mask, int pred) {
    return (int)emu_warp_op(EMU_ALL, mask, pred != 0, 0, 32, 4);
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) {
    return (unsigned)emu_warp_op(EMU_MATCH_ANY, mask, emu_raw(v), 0, 32, sizeof(T));
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu_warp_op(EMU_SYNCWARP, mask, 0, 0, 32, 4); }
// sm_80 integer reductions: the unsigned forms reduce as unsigned, the int forms as int.
#define EMU_REDUCE(name, op, T)                                                                   \
    inline T name(unsigned mask, T v) {                                                           \
        return (T)emu_warp_op(op, mask, (unsigned long long)(unsigned)v, (T)-1 < 0, 32, 4);       \
    }
EMU_REDUCE(__reduce_add_sync, EMU_REDUCE_ADD, unsigned)
EMU_REDUCE(__reduce_add_sync, EMU_REDUCE_ADD, int)
EMU_REDUCE(__reduce_min_sync, EMU_REDUCE_MIN, unsigned)
EMU_REDUCE(__reduce_min_sync, EMU_REDUCE_MIN, int)
EMU_REDUCE(__reduce_max_sync, EMU_REDUCE_MAX, unsigned)
EMU_REDUCE(__reduce_max_sync, EMU_REDUCE_MAX, int)
EMU_REDUCE(__reduce_and_sync, EMU_REDUCE_AND, unsigned)
EMU_REDUCE(__reduce_or_sync, EMU_REDUCE_OR, unsigned)
EMU_REDUCE(__reduce_xor_sync, EMU_REDUCE_XOR, unsigned)
#undef EMU_REDUCE

inline void __syncthreads() { emu_barrier(EMU_BAR_SYNC, 0); }
inline int __syncthreads_or(int pred) { return emu_barrier(EMU_BAR_OR, pred != 0); }
inline int __syncthreads_and(int pred) { return emu_barrier(EMU_BAR_AND, pred != 0); }
inline int __syncthreads_count(int pred) { return emu_barrier(EMU_BAR_COUNT, pred != 0); }

// One OS thread and no preemption: memory is sequentially consistent already.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned) { emu_yield(); }

// ---------------------------------------------------------------------------------------------
// Warp-wide matrix instructions (tensor cores) for the host alternatives of their inline
// assembly, with the operands exactly as the PTX instruction takes them. Every lane of the warp
// must call (they are .sync.aligned). Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16
// with integer type" / "mma.m16n8k32" and "ldmatrix": groupID g = lane >> 2, t = lane % 4.

inline unsigned emu_lane() { return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u; }

// mma.sync.aligned.m16n8k{16,32}.row.col.s32.s8.s8.s32 d, a, b, c (KB = 16 or 32, no .satfinite:
// the s32 sums wrap). A (16 x KB, row) element (r, k) is byte k % 4 of lane (r % 8) * 4 + (k % 16) / 4's
// register (r / 8) + 2 * (k / 16); B (KB x 8, col) element (k, n) byte k % 4 of lane n * 4 + (k % 16) / 4's
// register k / 16; C / D (16 x 8) element i of a lane is (g + 8 * (i / 2), 2 * t + i % 2).
template <int KB>
inline void emu_mma_s8(int (&d)[4], const unsigned* a, const unsigned* b, const int (&c)[4]) {
    static_assert(KB == 16 || KB == 32, "m16n8k16 or m16n8k32");
    struct Frag {
        unsigned a[KB / 8], b[KB / 16];
    } mine, all[32];
    for (int i = 0; i < KB / 8; ++i) mine.a[i] = a[i];
    for (int i = 0; i < KB / 16; ++i) mine.b[i] = b[i];
    emu_warp_allgather(0xffffffffu, &mine, (int)sizeof(Frag), all);
    const unsigned lane = emu_lane(), g = lane >> 2, t = lane & 3u;
    for (int i = 0; i < 4; ++i) {
        const unsigned r = g + 8u * (unsigned)(i / 2), n = 2u * t + (unsigned)(i % 2);
        unsigned acc = (unsigned)c[i];
        for (unsigned k = 0; k < (unsigned)KB; ++k) {
            const Frag& fa = all[(r % 8) * 4 + (k % 16) / 4];
            const Frag& fb = all[n * 4 + (k % 16) / 4];
            const int av = (signed char)(fa.a[r / 8 + 2 * (k / 16)] >> (8 * (k % 4)));
            const int bv = (signed char)(fb.b[k / 16] >> (8 * (k % 4)));
            acc += (unsigned)(av * bv);
        }
        d[i] = (int)acc;
    }
}
inline void emu_mma_m16n8k32_s8(int (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                const int (&c)[4]) {
    emu_mma_s8<32>(d, a, b, c);
}
inline void emu_mma_m16n8k16_s8(int (&d)[4], const unsigned (&a)[2], unsigned b, const int (&c)[4]) {
    emu_mma_s8<16>(d, a, &b, c);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, c. A (16 x 16, row) element (r, k)
// is half k % 2 (low first) of lane (r % 8) * 4 + (k % 8) / 2's register (r / 8) + 2 * (k / 8); B
// (16 x 8, col) element (k, n) half k % 2 of lane n * 4 + (k % 8) / 2's register k / 8; C / D as
// for the integer forms. Products of bf16 values are exact in f32; the hardware's order and
// rounding of the f32 sum are not specified: here the 16 products and c are summed in f64 and
// rounded once (the callers' tolerances cover any order with up to 17 f32 roundings). `c` may
// alias `d`.
inline void emu_mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                  const float (&c)[4]) {
    struct Frag {
        unsigned a[4], b[2];
    } mine, all[32];
    for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
    for (int i = 0; i < 2; ++i) mine.b[i] = b[i];
    emu_warp_allgather(0xffffffffu, &mine, (int)sizeof(Frag), all);
    const unsigned lane = emu_lane(), g = lane >> 2, t = lane & 3u;
    auto bf = [](unsigned w, unsigned half) {
        const unsigned bits = (half ? (w >> 16) : (w & 0xFFFFu)) << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        return (double)f;
    };
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const unsigned r = g + 8u * (unsigned)(i / 2), n = 2u * t + (unsigned)(i % 2);
        double acc = (double)c[i];
        for (unsigned k = 0; k < 16u; ++k) {
            const Frag& fa = all[(r % 8) * 4 + (k % 8) / 2];
            const Frag& fb = all[n * 4 + (k % 8) / 2];
            acc += bf(fa.a[r / 8 + 2 * (k / 8)], k % 2) * bf(fb.b[k / 8], k % 2);
        }
        out[i] = (float)acc;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ldmatrix.sync.aligned.m8n8.x{N}{.trans}.shared.b16 r, [row]: lanes 8m .. 8m + 7 give the
// addresses of rows 0..7 of matrix m (16 bytes each); r[m] of lane l receives row l / 4, elements
// 2 (l % 4) and 2 (l % 4) + 1 (low half first), or with .trans the transposed matrix's. Each
// lane reads its own row when it arrives, as the loads of any other instruction.
template <int N>
inline void emu_ldmatrix(unsigned (&r)[N], const void* row, bool trans = false) {
    static_assert(N == 1 || N == 2 || N == 4, "x1, x2 or x4");
    struct Row {
        unsigned short e[8];
    } mine = {}, all[32];
    const unsigned lane = emu_lane();
    if (lane < 8u * N) __builtin_memcpy(&mine, row, sizeof mine);
    emu_warp_allgather(0xffffffffu, &mine, (int)sizeof(Row), all);
    const unsigned q = lane / 4, c = 2 * (lane % 4);
    for (int m = 0; m < N; ++m) {
        const Row* mat = all + 8 * m;
        const unsigned lo = trans ? mat[c].e[q] : mat[q].e[c];
        const unsigned hi = trans ? mat[c + 1].e[q] : mat[q].e[c + 1];
        r[m] = lo | (hi << 16);
    }
}

// ---------------------------------------------------------------------------------------------
// Atomics: no other thread runs between the read and the write.

template <class T>
struct emu_same {
    typedef T type;
};
#define EMU_ATOMIC(name, expr)                                                                    \
    template <class T>                                                                            \
    inline T name(T* p, typename emu_same<T>::type v) {                                           \
        const T old = *p;                                                                         \
        *p = (expr);                                                                              \
        return old;                                                                               \
    }
EMU_ATOMIC(atomicAdd, old + v)
EMU_ATOMIC(atomicSub, old - v)
EMU_ATOMIC(atomicExch, v)
EMU_ATOMIC(atomicMin, v < old ? v : old)
EMU_ATOMIC(atomicMax, v > old ? v : old)
EMU_ATOMIC(atomicAnd, old & v)
EMU_ATOMIC(atomicOr, old | v)
EMU_ATOMIC(atomicXor, old ^ v)
#undef EMU_ATOMIC
template <class T>
inline T atomicCAS(T* p, typename emu_same<T>::type cmp, typename emu_same<T>::type v) {
    const T old = *p;
    if (old == cmp) *p = v;
    return old;
}
inline unsigned atomicInc(unsigned* p, unsigned lim) {
    const unsigned old = *p;
    *p = old >= lim ? 0u : old + 1u;
    return old;
}
inline unsigned atomicDec(unsigned* p, unsigned lim) {
    const unsigned old = *p;
    *p = (old == 0u || old > lim) ? lim : old - 1u;
    return old;
}

// ---------------------------------------------------------------------------------------------
// Loads with cache hints: plain loads

template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------------------------
// Bit casts and integer intrinsics

inline float __int_as_float(int v) { return emu_unraw<float>((unsigned)v); }
inline float __uint_as_float(unsigned v) { return emu_unraw<float>(v); }
inline int __float_as_int(float v) { return (int)(unsigned)emu_raw(v); }
inline unsigned __float_as_uint(float v) { return (unsigned)emu_raw(v); }
inline double __longlong_as_double(long long v) { return emu_unraw<double>((unsigned long long)v); }
inline long long __double_as_longlong(double v) { return (long long)emu_raw(v); }

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __clzll(long long v) { return v == 0 ? 64 : __builtin_clzll((unsigned long long)v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline unsigned __brev(unsigned v) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
    return r;
}
// PTX prmt.b32 default mode: byte i of the result is byte (s >> 4i) & 7 of {y, x} (x = bytes
// 0..3), replicated sign when bit 3 of that selector nibble is set.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long xy = (unsigned long long)x | ((unsigned long long)y << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 0xFu;
        unsigned b = (unsigned)(xy >> (8 * (sel & 7u))) & 0xFFu;
        if (sel & 8u) b = (b & 0x80u) ? 0xFFu : 0u;
        r |= b << (8 * i);
    }
    return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    const unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)((v << (s & 31u)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    const unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> (s & 31u));
}
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
inline int __mul24(int a, int b) { return (int)((unsigned)((a << 8) >> 8) * (unsigned)((b << 8) >> 8)); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
// dp4a.s32.s32 / dp4a.u32.u32: four byte products summed onto c, wrapping like the hardware.
inline int __dp4a(int a, int b, int c) {
    unsigned s = (unsigned)c;
    for (int i = 0; i < 4; ++i)
        s += (unsigned)((int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i)));
    return (int)s;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; ++i) c += ((a >> (8 * i)) & 0xFFu) * ((b >> (8 * i)) & 0xFFu);
    return c;
}

template <class A, class B>
struct emu_common {
    typedef decltype(true ? A() : B()) type;
};
template <class A, class B>
inline typename emu_common<A, B>::type min(A a, B b) {
    typedef typename emu_common<A, B>::type C;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B>
inline typename emu_common<A, B>::type max(A a, B b) {
    typedef typename emu_common<A, B>::type C;
    return (C)a > (C)b ? (C)a : (C)b;
}
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Floating point. The kernels are compiled without fast math (--prec-div/--prec-sqrt, no ftz),
// so + - * / and sqrt are the IEEE operations on both sides; the module is built with
// -ffp-contract=off, so no product is fused here (the GPU may fuse them: docs/GPU.md). The
// transcendental functions are glibc's, within a few ulps of CUDA's, not equal to them.

// libm, declared here (no system header, see the top) with CUDA's float / double overloads.
#define EMU_LIBM1(F)                                                                              \
    extern "C" float F##f(float);                                                                 \
    extern "C" double F(double);                                                                  \
    inline float F(float x) { return F##f(x); }
#define EMU_LIBM2(F)                                                                              \
    extern "C" float F##f(float, float);                                                          \
    extern "C" double F(double, double);                                                          \
    inline float F(float x, float y) { return F##f(x, y); }
EMU_LIBM1(fabs)
EMU_LIBM1(sqrt)
EMU_LIBM1(cbrt)
EMU_LIBM1(exp)
EMU_LIBM1(exp2)
EMU_LIBM1(expm1)
EMU_LIBM1(log)
EMU_LIBM1(log2)
EMU_LIBM1(log10)
EMU_LIBM1(log1p)
EMU_LIBM1(sin)
EMU_LIBM1(cos)
EMU_LIBM1(tan)
EMU_LIBM1(asin)
EMU_LIBM1(acos)
EMU_LIBM1(atan)
EMU_LIBM1(sinh)
EMU_LIBM1(cosh)
EMU_LIBM1(tanh)
EMU_LIBM1(erf)
EMU_LIBM1(erfc)
EMU_LIBM1(round)
EMU_LIBM1(floor)
EMU_LIBM1(ceil)
EMU_LIBM1(trunc)
EMU_LIBM1(rint)
EMU_LIBM1(nearbyint)
EMU_LIBM2(fmax)
EMU_LIBM2(fmin)
EMU_LIBM2(pow)
EMU_LIBM2(fmod)
EMU_LIBM2(atan2)
EMU_LIBM2(copysign)
EMU_LIBM2(hypot)
#undef EMU_LIBM1
#undef EMU_LIBM2
extern "C" float fmaf(float, float, float);
extern "C" double fma(double, double, double);
inline float fma(float a, float b, float c) { return fmaf(a, b, c); }
extern "C" float ldexpf(float, int);
extern "C" double ldexp(double, int);
extern "C" void sincosf(float, float*, float*);
extern "C" void sincos(double, double*, double*);
extern "C" int abs(int);
extern "C" long long llabs(long long);
inline long long abs(long long v) { return llabs(v); }
inline float abs(float v) { return fabsf(v); }
inline bool isfinite(float v) { return __builtin_isfinite(v); }
inline bool isfinite(double v) { return __builtin_isfinite(v); }
inline bool isnan(float v) { return __builtin_isnan(v); }
inline bool isnan(double v) { return __builtin_isnan(v); }
inline bool isinf(float v) { return __builtin_isinf(v); }
inline bool isinf(double v) { return __builtin_isinf(v); }
inline bool signbit(float v) { return __builtin_signbit(v); }
inline bool signbit(double v) { return __builtin_signbit(v); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
// Approximate on the GPU; the correctly rounded value here.
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }
inline float __sinf(float a) { return sinf(a); }
inline float __cosf(float a) { return cosf(a); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __saturatef(float a) { return a != a ? 0.0f : a < 0.0f ? 0.0f : a > 1.0f ? 1.0f : a; }
inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
inline int __float2int_rz(float a) { return (int)a; }
inline int __float2int_rd(float a) { return (int)floorf(a); }
inline int __float2int_ru(float a) { return (int)ceilf(a); }
inline unsigned __float2uint_rn(float a) { return (unsigned)nearbyintf(a); }
inline float __int2float_rn(int a) { return (float)a; }
inline float __uint2float_rn(unsigned a) { return (float)a; }

extern "C" int printf(const char*, ...);

#endif  // GGUFTOOL_EMU_RUNTIME
#endif
