//! The emulator's own semantics, from small inline kernels checked against the CUDA
//! programming guide's definitions (written out here independently of runtime.cpp): every
//! shuffle kind at every width, votes, match, reductions, barriers with exited threads, atomics,
//! static / dynamic / template shared memory and its poisoning, and the misuse it must report.
//! Without a C++ compiler every test prints "skipped: no C++ compiler" and passes.

mod common;

use common::{compiler, say};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kernels_emu::{EmuError, Module};

/// The self-test kernels, after prelude.cuh (for DYN_SHARED, as production kernels use it).
const SRC: &str = r#"
// Every shuffle kind at `width`; lane values are distinct per warp.
extern "C" __global__ void shuffles(int width, int* out, double* out64) {
    const int t = threadIdx.x, lane = t & 31;
    const int v = 1000 * (t >> 5) + lane;
    int* o = out + t * 6;
    o[0] = __shfl_sync(0xffffffffu, v, (lane * 7 + 3) % 37, width);
    o[1] = __shfl_up_sync(0xffffffffu, v, 3, width);
    o[2] = __shfl_down_sync(0xffffffffu, v, 5, width);
    o[3] = __shfl_xor_sync(0xffffffffu, v, 5 & (width - 1), width);
    o[4] = __shfl_xor_sync(0xffffffffu, v, width - 1, width);
    o[5] = __float_as_int(__shfl_down_sync(0xffffffffu, 0.5f * (float)v, 1, width));
    out64[t] = __shfl_up_sync(0xffffffffu, 1e10 * (double)v + 0.25, 1, width);
}

extern "C" __global__ void votes(const int* pred, const int* key, unsigned* out) {
    const int t = threadIdx.x, lane = t & 31;
    const int p = pred[t];
    unsigned* o = out + t * 8;
    o[0] = __ballot_sync(0xffffffffu, p);
    o[1] = __any_sync(0xffffffffu, p);
    o[2] = __all_sync(0xffffffffu, p);
    o[3] = __match_any_sync(0xffffffffu, key[t]);
    o[4] = __match_any_sync(0xffffffffu, (long long)key[t] << 40);
    // Two half warps in different collectives at once.
    if (lane < 16) o[5] = __ballot_sync(0x0000ffffu, p);
    else o[5] = (unsigned)__shfl_xor_sync(0xffff0000u, key[t], 1);
    __syncwarp();
    o[6] = (unsigned)__reduce_add_sync(0xffffffffu, key[t]);
    o[7] = (unsigned)__reduce_max_sync(0xffffffffu, key[t] - 5);
}

// Threads t >= live exit at once: the barriers count them as arrived.
extern "C" __global__ void barriers(const int* x, int live, int* out) {
    __shared__ int s[256];
    const int t = threadIdx.x;
    if (t >= live) return;
    s[t] = x[t] * 3;
    __syncthreads();
    const int acc = s[(t + 1) % live];
    __syncthreads();
    s[t] = acc + 1;
    __syncthreads();
    int* o = out + 4 * t;
    o[0] = s[live - 1 - t];
    o[1] = __syncthreads_or(x[t] == 7);
    o[2] = __syncthreads_and(x[t] > 0);
    o[3] = __syncthreads_count(x[t] & 1);
}

extern "C" __global__ void atomics(int* g, unsigned* gu, float* gf, unsigned long long* g64,
                                   int* ticket) {
    __shared__ int cnt;
    if (threadIdx.x == 0) cnt = 0;
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    ticket[t] = atomicAdd(&cnt, 1);
    atomicAdd(&g[0], t);
    atomicMax(&g[1], t * 7 % 101);
    atomicMin(&g[2], -(t * 13 % 97));
    int old = g[3], seen;
    while ((seen = atomicCAS(&g[3], old, old + 2)) != old) old = seen;
    atomicExch(&g[4], 42);
    atomicSub(&g[5], 3);
    atomicOr(&gu[0], 1u << (t % 32));
    atomicAnd(&gu[1], ~(1u << (t % 29)));
    atomicXor(&gu[2], (unsigned)t);
    atomicAdd(gf, 0.5f);
    atomicAdd(g64, (unsigned long long)t << 33);
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&g[6], cnt);
}

// A shared variable of a function template (GCC keeps those out of named sections: emu.ld's
// business). Returns what t[i] held before this block wrote it, and a neighbour's value after.
template <int N>
DEV int tmpl_shared(int i, int& before) {
    __shared__ int t[N];
    before = t[i];
    __syncthreads();
    t[i] = 5 * i + (int)blockIdx.x;
    __syncthreads();
    return t[N - 1 - i];
}

// Static, dynamic (2 * blockDim floats) and template shared memory; per block, what was there
// before the first write (the poison, again in every block).
extern "C" __global__ void shmem(float* out, int* before, int* tout) {
    DYN_SHARED(float, dyn);
    __shared__ float st[128];
    __shared__ int flag;
    const int t = threadIdx.x, n = blockDim.x, b = blockIdx.x;
    if (t == 0) {
        before[4 * b] = flag;
        before[4 * b + 1] = __float_as_int(st[5]);
        before[4 * b + 2] = __float_as_int(dyn[2 * n - 1]);
    }
    __syncthreads();
    if (t == 0) flag = 17 + b;
    st[t] = 2.0f * (float)t;
    dyn[t] = (float)t + 0.25f;
    dyn[n + t] = -(float)t;
    __syncthreads();
    out[b * n + t] = st[n - 1 - t] + dyn[(t + 1) % n] + dyn[n + (t + 3) % n] + (float)flag;
    int tb;
    tout[2 * (b * n + t)] = tmpl_shared<128>(t, tb);
    tout[2 * (b * n + t) + 1] = tb;
    if (t == 0) before[4 * b + 3] = flag;
}

// One m16n8k32 and one m16n8k16 product, the fragments built with the PTX ISA's formulas
// (lane -> element) from A (16 x 32, row-major), B (32 x 8, stored as 8 columns of 32) and C
// (16 x 8); the shim's emulation inverts those formulas.
extern "C" __global__ void mma_s8(const signed char* A, const signed char* B, const int* C,
                                  int* D32, int* D16) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    unsigned a[4], b[2], a16[2], b16 = 0;
    int c[4], d[4];
    for (int j = 0; j < 4; ++j) {
        unsigned v = 0;
        for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e;
            const int row = (i < 4 || (i >= 8 && i < 12)) ? g : g + 8;
            const int col = t * 4 + (i & 3) + (i >= 8 ? 16 : 0);
            v |= (unsigned)(unsigned char)A[row * 32 + col] << (8 * e);
        }
        a[j] = v;
    }
    for (int j = 0; j < 2; ++j) {
        unsigned v = 0, w = 0;
        for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e;
            v |= (unsigned)(unsigned char)B[g * 32 + t * 4 + (i & 3) + (i >= 4 ? 16 : 0)] << (8 * e);
            w |= (unsigned)(unsigned char)A[(i < 4 ? g : g + 8) * 32 + t * 4 + (i & 3)] << (8 * e);
        }
        b[j] = v;
        a16[j] = w;
    }
    for (int e = 0; e < 4; ++e) b16 |= (unsigned)(unsigned char)B[g * 32 + t * 4 + e] << (8 * e);
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + (i & 1)];
    emu_mma_m16n8k32_s8(d, a, b, c);
    for (int i = 0; i < 4; ++i) D32[(g + 8 * (i / 2)) * 8 + 2 * t + (i & 1)] = d[i];
    emu_mma_m16n8k16_s8(d, a16, b16, c);
    for (int i = 0; i < 4; ++i) D16[(g + 8 * (i / 2)) * 8 + 2 * t + (i & 1)] = d[i];
}

// One m16n8k16 bf16 product (f32 accumulate), fragments from the PTX ISA's formulas for
// .bf16: a_i (i < 8, two per register, low half first) is row g for i in {0,1,4,5} else g + 8,
// column 2t + (i & 1) + 8 (i >= 4); b_i (i < 4) row 2t + (i & 1) + 8 (i >= 2), column g.
// A is 16 x 16 row-major, B 16 x 8 stored as 8 columns of 16, both bf16 bit patterns.
extern "C" __global__ void mma_bf16(const unsigned short* A, const unsigned short* B,
                                    const float* C, float* D) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    for (int i = 0; i < 8; ++i) {
        const int row = (i == 0 || i == 1 || i == 4 || i == 5) ? g : g + 8;
        const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
        a[i / 2] |= (unsigned)A[row * 16 + col] << (16 * (i & 1));
    }
    for (int i = 0; i < 4; ++i) {
        const int row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
        b[i / 2] |= (unsigned)B[g * 16 + row] << (16 * (i & 1));
    }
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + (i & 1)];
    emu_mma_m16n8k16_bf16(d, a, b, c);
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + (i & 1)] = d[i];
}

// ldmatrix x4 / x2 / x1 and x4.trans from four 8 x 8 matrices of 16-bit elements (M, dense),
// staged in shared memory with 32-byte row pitch; lane l points at row l % 8 of matrix l / 8.
extern "C" __global__ void ldmatrix(const unsigned short* M, unsigned* out) {
    __shared__ __align__(16) unsigned short sm[4 * 8 * 16];
    for (int i = threadIdx.x; i < 4 * 64; i += 32) sm[(i / 8) * 16 + i % 8] = M[i];
    __syncwarp();
    const int lane = threadIdx.x;
    unsigned r4[4], r2[2], r1[1], t4[4];
    emu_ldmatrix(r4, sm + lane * 16);
    emu_ldmatrix(r2, sm + lane * 16);
    emu_ldmatrix(r1, sm + lane * 16);
    emu_ldmatrix(t4, sm + lane * 16, true);
    unsigned* o = out + lane * 11;
    for (int m = 0; m < 4; ++m) o[m] = r4[m];
    for (int m = 0; m < 2; ++m) o[4 + m] = r2[m];
    o[6] = r1[0];
    for (int m = 0; m < 4; ++m) o[7 + m] = t4[m];
}

// prelude.cuh's host f16 -> f32 conversion for every bit pattern.
extern "C" __global__ void f16_all(float* out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < 65536; i += gridDim.x * blockDim.x)
        out[i] = f16_to_f32((uint16_t)i);
}

// Misuse the emulator must report.
extern "C" __global__ void divergent(int* out) {
    const int lane = threadIdx.x & 31;
    if (lane & 1) out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, lane, 2);
    else out[threadIdx.x] = (int)__ballot_sync(0xffffffffu, 1);
}
extern "C" __global__ void exited_lane(int* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
extern "C" __global__ void deadlock(int* out) {
    if (threadIdx.x == 0) __syncthreads();
    else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}
extern "C" __global__ void outside_mask(int* out) {
    if (threadIdx.x < 2) out[threadIdx.x] = __shfl_sync(0x3u, 5, 2);
}
extern "C" __global__ void not_in_mask(int* out) {
    out[threadIdx.x] = __shfl_sync(0xfffffffeu, 5, 1);
}
extern "C" __global__ void mixed_barriers(int* out) {
    if (threadIdx.x < 32) __syncthreads();
    else out[0] = __syncthreads_or(1);
}
extern "C" __global__ void missing_lane(int* out) {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 20);
}
// Legal on sm_70+: lanes that exited (and the missing lanes of a partial last warp) take no
// part in a full-mask collective.
extern "C" __global__ void exited_votes(unsigned* out) {
    const int t = threadIdx.x, lane = t & 31;
    if (lane == 3 || t == 30) return;
    unsigned* o = out + 4 * t;
    o[0] = __ballot_sync(0xffffffffu, 1);
    o[1] = __all_sync(0xffffffffu, lane != 7) + 2 * __all_sync(0xffffffffu, lane != 3);
    __syncwarp();
    o[2] = (unsigned)__reduce_add_sync(0xffffffffu, lane);
    o[3] = (unsigned)__shfl_sync(0xffffffffu, t, 0);
}
extern "C" __global__ void oob_dyn(float* out) {
    DYN_SHARED(float, d);
    d[threadIdx.x * 1024] = 1.0f;
    out[threadIdx.x] = d[0];
}
"#;

fn module() -> &'static Module {
    static M: OnceLock<Module> = OnceLock::new();
    M.get_or_init(|| {
        let src = format!("{}\n{SRC}", include_str!("../../cuda/prelude.cuh"));
        match Module::from_source("emu_selftest", &src) {
            Ok(m) => m,
            Err(e) => panic!("{e}"),
        }
    })
}

/// The value lane `src` of the warp holding thread `t` had in `shuffles`.
fn lane_value(t: usize, src: usize) -> i32 {
    1000 * (t / 32) as i32 + src as i32
}

#[test]
fn shuffles_of_every_kind_and_width() {
    if !compiler("shuffles_of_every_kind_and_width") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(i32, *mut i32, *mut f64);
    let f: F = unsafe { m.entry("shuffles") }.unwrap();
    let n = 64usize;
    for width in [1usize, 2, 4, 8, 16, 32] {
        let mut out = vec![i32::MIN; n * 6];
        let mut out64 = vec![f64::NAN; n];
        let (op, o64) = (out.as_mut_ptr(), out64.as_mut_ptr());
        m.launch("shuffles", [1, 1, 1], [n as u32, 1, 1], 0, &|| unsafe {
            f(width as i32, op, o64)
        })
        .unwrap();
        for t in 0..n {
            let lane = t % 32;
            let base = lane / width * width;
            let pos = lane - base;
            // The programming guide: a source outside the segment wraps (idx) or leaves the
            // lane's own value (up/down); xor masks below the width stay inside it.
            let idx = base + ((lane * 7 + 3) % 37) % width;
            let up = if pos >= 3 { lane - 3 } else { lane };
            let down = if pos + 5 < width { lane + 5 } else { lane };
            let down1 = if pos + 1 < width { lane + 1 } else { lane };
            let up1 = if pos >= 1 { lane - 1 } else { lane };
            let want = [
                lane_value(t, idx),
                lane_value(t, up),
                lane_value(t, down),
                lane_value(t, lane ^ (5 & (width - 1))),
                lane_value(t, lane ^ (width - 1)),
                (0.5 * lane_value(t, down1) as f32).to_bits() as i32,
            ];
            assert_eq!(&out[t * 6..t * 6 + 6], &want, "width {width}, thread {t}");
            assert_eq!(
                out64[t],
                1e10 * f64::from(lane_value(t, up1)) + 0.25,
                "64-bit value, width {width}, thread {t}"
            );
        }
    }
}

#[test]
fn votes_match_and_reductions() {
    if !compiler("votes_match_and_reductions") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*const i32, *const i32, *mut u32);
    let f: F = unsafe { m.entry("votes") }.unwrap();
    let n = 96usize;
    // Warp 0 mixed, warp 1 all true, warp 2 all false; keys from 4 values.
    let pred: Vec<i32> = (0..n)
        .map(|t| match t / 32 {
            0 => i32::from(t % 3 == 0) * (t as i32 + 1),
            1 => 1,
            _ => 0,
        })
        .collect();
    let key: Vec<i32> = (0..n).map(|t| ((t * 5 + t / 7) % 4) as i32).collect();
    let mut out = vec![0xdead_beefu32; n * 8];
    let (pp, kp, op) = (pred.as_ptr(), key.as_ptr(), out.as_mut_ptr());
    m.launch("votes", [1, 1, 1], [n as u32, 1, 1], 0, &|| unsafe {
        f(pp, kp, op)
    })
    .unwrap();
    for w in 0..3 {
        let lanes = w * 32..w * 32 + 32;
        let ballot = lanes
            .clone()
            .filter(|&t| pred[t] != 0)
            .fold(0u32, |b, t| b | 1 << (t % 32));
        for t in lanes.clone() {
            let lane = t % 32;
            let matching = lanes
                .clone()
                .filter(|&u| key[u] == key[t])
                .fold(0u32, |b, u| b | 1 << (u % 32));
            let half = if lane < 16 {
                ballot & 0xffff
            } else {
                key[w * 32 + (lane ^ 1)] as u32
            };
            let sum: i32 = lanes.clone().map(|u| key[u]).sum();
            let max = lanes.clone().map(|u| key[u] - 5).max().unwrap();
            let want = [
                ballot,
                u32::from(ballot != 0),
                u32::from(ballot == u32::MAX),
                matching,
                matching,
                half,
                sum as u32,
                max as u32,
            ];
            assert_eq!(&out[t * 8..t * 8 + 8], &want, "thread {t}");
        }
    }
}

#[test]
fn barriers_count_exited_threads_as_arrived() {
    if !compiler("barriers_count_exited_threads_as_arrived") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*const i32, i32, *mut i32);
    let f: F = unsafe { m.entry("barriers") }.unwrap();
    let n = 256usize;
    // 200 live threads: warp 6 partly exits, warp 7 entirely.
    for (live, seven) in [(200usize, false), (200, true), (256, true)] {
        let mut x: Vec<i32> = (0..n).map(|t| (t * 37 % 11) as i32 + 1).collect();
        for v in x.iter_mut() {
            if *v == 7 {
                *v = 8;
            }
        }
        if seven {
            x[live / 2] = 7;
        }
        x[3] = if live == 256 { 0 } else { x[3] };
        let mut out = vec![i32::MIN; 4 * n];
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        m.launch("barriers", [1, 1, 1], [n as u32, 1, 1], 0, &|| unsafe {
            f(xp, live as i32, op)
        })
        .unwrap();
        let xs = &x[..live];
        let any7 = i32::from(xs.contains(&7));
        let all_pos = i32::from(xs.iter().all(|&v| v > 0));
        let odd = xs.iter().filter(|&&v| v & 1 != 0).count() as i32;
        for t in 0..n {
            let o = &out[4 * t..4 * t + 4];
            if t >= live {
                assert_eq!(o, &[i32::MIN; 4], "exited thread {t} wrote");
                continue;
            }
            // s[u] = x[(u + 1) % live] * 3 + 1 after the second round.
            let u = live - 1 - t;
            let want = [x[(u + 1) % live] * 3 + 1, any7, all_pos, odd];
            assert_eq!(o, &want, "live {live}, thread {t}");
        }
    }
}

#[test]
fn atomics_read_modify_write() {
    if !compiler("atomics_read_modify_write") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*mut i32, *mut u32, *mut f32, *mut u64, *mut i32);
    let f: F = unsafe { m.entry("atomics") }.unwrap();
    let (blocks, bs) = (3usize, 128usize);
    let total = blocks * bs;
    let mut g = vec![0i32, i32::MIN, i32::MAX, 0, 0, 100, 0];
    let mut gu = vec![0u32, u32::MAX, 0];
    let mut gf = 0f32;
    let mut g64 = 0u64;
    let mut ticket = vec![-1i32; total];
    let (gp, gup, gfp, g64p, tp) = (
        g.as_mut_ptr(),
        gu.as_mut_ptr(),
        &mut gf as *mut f32,
        &mut g64 as *mut u64,
        ticket.as_mut_ptr(),
    );
    m.launch(
        "atomics",
        [blocks as u32, 1, 1],
        [bs as u32, 1, 1],
        0,
        &|| unsafe { f(gp, gup, gfp, g64p, tp) },
    )
    .unwrap();
    let ts = 0..total;
    assert_eq!(g[0], ts.clone().sum::<usize>() as i32);
    assert_eq!(
        g[1],
        ts.clone().map(|t| (t * 7 % 101) as i32).max().unwrap()
    );
    assert_eq!(
        g[2],
        ts.clone().map(|t| -((t * 13 % 97) as i32)).min().unwrap()
    );
    assert_eq!(g[3], 2 * total as i32, "CAS loop");
    assert_eq!(g[4], 42);
    assert_eq!(g[5], 100 - 3 * total as i32);
    assert_eq!(g[6], total as i32, "each block's counter reached its size");
    assert_eq!(gu[0], u32::MAX);
    assert_eq!(gu[1], !((1u32 << 29) - 1));
    assert_eq!(gu[2], ts.clone().fold(0u32, |a, t| a ^ t as u32));
    assert_eq!(gf, 0.5 * total as f32);
    assert_eq!(g64, ts.clone().map(|t| (t as u64) << 33).sum::<u64>());
    for b in 0..blocks {
        let mut tk: Vec<i32> = ticket[b * bs..(b + 1) * bs].to_vec();
        tk.sort();
        assert_eq!(tk, (0..bs as i32).collect::<Vec<_>>(), "block {b}: tickets");
    }
}

#[test]
fn shared_memory_static_dynamic_template_and_poison() {
    if !compiler("shared_memory_static_dynamic_template_and_poison") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*mut f32, *mut i32, *mut i32);
    let f: F = unsafe { m.entry("shmem") }.unwrap();
    let (blocks, n) = (3usize, 128usize);
    let mut out = vec![f32::NAN; blocks * n];
    let mut before = vec![0i32; 4 * blocks];
    let mut tout = vec![i32::MIN; 2 * blocks * n];
    let (op, bp, tp) = (out.as_mut_ptr(), before.as_mut_ptr(), tout.as_mut_ptr());
    m.launch(
        "shmem",
        [blocks as u32, 1, 1],
        [n as u32, 1, 1],
        2 * n * 4,
        &|| unsafe { f(op, bp, tp) },
    )
    .unwrap();
    for b in 0..blocks {
        // Every block starts from poison (0xFF bytes), not from the previous block's values.
        assert_eq!(&before[4 * b..4 * b + 3], &[-1, -1, -1], "block {b}");
        assert_eq!(before[4 * b + 3], 17 + b as i32);
        for t in 0..n {
            let want = 2.0 * (n - 1 - t) as f32
                + ((t + 1) % n) as f32
                + 0.25
                + -(((t + 3) % n) as f32)
                + (17 + b) as f32;
            assert_eq!(out[b * n + t], want, "block {b} thread {t}");
            let i = 2 * (b * n + t);
            assert_eq!(
                &tout[i..i + 2],
                &[5 * (n - 1 - t) as i32 + b as i32, -1],
                "template shared, block {b} thread {t}"
            );
        }
    }
}

#[test]
fn mma_s8_and_ldmatrix_follow_the_ptx_fragment_layouts() {
    if !compiler("mma_s8_and_ldmatrix_follow_the_ptx_fragment_layouts") {
        return;
    }
    let m = module();
    type Mma = unsafe extern "C" fn(*const i8, *const i8, *const i32, *mut i32, *mut i32);
    let f: Mma = unsafe { m.entry("mma_s8") }.unwrap();
    // Deterministic values over the whole int8 range; C near the i32 limits (the sums wrap).
    let a: Vec<i8> = (0..16 * 32)
        .map(|i| ((i * 37 + 11) % 256) as u8 as i8)
        .collect();
    let b: Vec<i8> = (0..8 * 32)
        .map(|i| ((i * 101 + 3) % 256) as u8 as i8)
        .collect();
    let mut c: Vec<i32> = (0..16 * 8).map(|i| i * 1000 - 64_000).collect();
    c[0] = i32::MAX - 5;
    c[9] = i32::MIN + 3;
    let mut d32 = vec![0i32; 128];
    let mut d16 = vec![0i32; 128];
    let (ap, bp, cp, d32p, d16p) = (
        a.as_ptr(),
        b.as_ptr(),
        c.as_ptr(),
        d32.as_mut_ptr(),
        d16.as_mut_ptr(),
    );
    m.launch("mma_s8", [1, 1, 1], [32, 1, 1], 0, &|| unsafe {
        f(ap, bp, cp, d32p, d16p)
    })
    .unwrap();
    for r in 0..16 {
        for n in 0..8 {
            let dot = |kb: usize| -> i32 {
                (0..kb)
                    .map(|k| i32::from(a[r * 32 + k]) * i32::from(b[n * 32 + k]))
                    .sum()
            };
            let cv = c[r * 8 + n];
            assert_eq!(d32[r * 8 + n], cv.wrapping_add(dot(32)), "k32 ({r}, {n})");
            assert_eq!(d16[r * 8 + n], cv.wrapping_add(dot(16)), "k16 ({r}, {n})");
        }
    }

    type Ld = unsafe extern "C" fn(*const u16, *mut u32);
    let f: Ld = unsafe { m.entry("ldmatrix") }.unwrap();
    let mat: Vec<u16> = (0..256).map(|i| (i * 257 + 1) as u16).collect();
    let mut out = vec![0u32; 32 * 11];
    let (mp, op) = (mat.as_ptr(), out.as_mut_ptr());
    m.launch("ldmatrix", [1, 1, 1], [32, 1, 1], 0, &|| unsafe {
        f(mp, op)
    })
    .unwrap();
    let el = |m: usize, r: usize, c: usize| u32::from(mat[m * 64 + r * 8 + c]);
    for l in 0..32 {
        let (q, c) = (l / 4, 2 * (l % 4));
        let fr = |m: usize| el(m, q, c) | el(m, q, c + 1) << 16;
        let tr = |m: usize| el(m, c, q) | el(m, c + 1, q) << 16;
        let want = [
            fr(0),
            fr(1),
            fr(2),
            fr(3),
            fr(0),
            fr(1),
            fr(0),
            tr(0),
            tr(1),
            tr(2),
            tr(3),
        ];
        assert_eq!(&out[l * 11..l * 11 + 11], &want, "lane {l}");
    }
}

#[test]
fn mma_bf16_follows_the_ptx_fragment_layout() {
    if !compiler("mma_bf16_follows_the_ptx_fragment_layout") {
        return;
    }
    let m = module();
    type Mma = unsafe extern "C" fn(*const u16, *const u16, *const f32, *mut f32);
    let f: Mma = unsafe { m.entry("mma_bf16") }.unwrap();
    // Small integers times powers of two: every product and sum is exact in f32, so the
    // emulation must equal the CPU product exactly whatever its summation order.
    let val = |i: usize, m: usize| ((i * m + 7) % 15) as f32 - 7.0;
    let a: Vec<f32> = (0..256).map(|i| val(i, 37) * 0.5).collect();
    let b: Vec<f32> = (0..128).map(|i| val(i, 101) * 0.25).collect();
    let c: Vec<f32> = (0..128).map(|i| i as f32 - 60.0).collect();
    let bits = |v: &[f32]| -> Vec<u16> { v.iter().map(|x| (x.to_bits() >> 16) as u16).collect() };
    let (ab, bb) = (bits(&a), bits(&b));
    let mut d = vec![f32::NAN; 128];
    let (ap, bp, cp, dp) = (ab.as_ptr(), bb.as_ptr(), c.as_ptr(), d.as_mut_ptr());
    m.launch("mma_bf16", [1, 1, 1], [32, 1, 1], 0, &|| unsafe {
        f(ap, bp, cp, dp)
    })
    .unwrap();
    for r in 0..16 {
        for n in 0..8 {
            let dot: f32 = (0..16).map(|k| a[r * 16 + k] * b[n * 16 + k]).sum();
            assert_eq!(d[r * 8 + n], c[r * 8 + n] + dot, "({r}, {n})");
        }
    }
}

#[test]
fn exited_and_missing_lanes_take_no_part() {
    if !compiler("exited_and_missing_lanes_take_no_part") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*mut u32);
    let f: F = unsafe { m.entry("exited_votes") }.unwrap();
    let n = 48usize;
    let mut out = vec![0xdead_beefu32; 4 * n];
    let op = out.as_mut_ptr();
    m.launch("exited_votes", [1, 1, 1], [n as u32, 1, 1], 0, &|| unsafe {
        f(op)
    })
    .unwrap();
    for t in 0..n {
        let (w, lane) = (t / 32, t % 32);
        let o = &out[4 * t..4 * t + 4];
        if lane == 3 || t == 30 {
            assert_eq!(o, &[0xdead_beef; 4], "exited thread {t} wrote");
            continue;
        }
        let active: u32 = (0..32)
            .filter(|&l| w * 32 + l < n && l != 3 && w * 32 + l != 30)
            .fold(0, |b, l| b | 1 << l);
        let sum: u32 = (0..32).filter(|&l| active >> l & 1 == 1).sum();
        // all(lane != 7) fails on lane 7; all(lane != 3) holds: lane 3 exited.
        let want = [active, 2, sum, 32 * w as u32];
        assert_eq!(o, &want, "thread {t}");
    }
}

#[test]
fn f16_to_f32_alternative_is_exact_for_every_half() {
    if !compiler("f16_to_f32_alternative_is_exact_for_every_half") {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*mut f32);
    let f: F = unsafe { m.entry("f16_all") }.unwrap();
    let mut out = vec![0f32; 65536];
    let op = out.as_mut_ptr();
    m.launch("f16_all", [8, 1, 1], [256, 1, 1], 0, &|| unsafe { f(op) })
        .unwrap();
    // Subnormals, infinities and NaN (payload kept, quiet bit set) as the `half` crate has them.
    for (h, v) in out.iter().enumerate() {
        let want = half::f16::from_bits(h as u16).to_f32();
        assert_eq!(v.to_bits(), want.to_bits(), "f16 bits {h:#06x}");
    }
}

/// A launch that must fail with a message containing every one of `needles`.
fn expect_error(entry: &str, block: u32, needles: &[&str]) {
    let m = module();
    type F = unsafe extern "C" fn(*mut i32);
    let f: F = unsafe { m.entry(entry) }.unwrap();
    let mut out = vec![0i32; 64];
    let op = out.as_mut_ptr();
    match m.launch(entry, [2, 1, 1], [block, 1, 1], 0, &|| unsafe { f(op) }) {
        Err(EmuError::Launch(msg)) => {
            say(&format!("{entry}: {msg}"));
            for n in needles {
                assert!(msg.contains(n), "{entry}: {n:?} not in {msg:?}");
            }
        }
        other => panic!("{entry}: expected a launch error, got {other:?}"),
    }
}

#[test]
fn misuse_is_reported_with_kernel_block_and_thread() {
    if !compiler("misuse_is_reported_with_kernel_block_and_thread") {
        return;
    }
    expect_error(
        "divergent",
        32,
        &[
            "kernel `divergent`, block (0,0,0)",
            "divergent warp collective",
            "__ballot_sync",
            "__shfl_xor_sync",
        ],
    );
    expect_error(
        "exited_lane",
        32,
        &[
            "thread (4,0,0)",
            "__shfl_xor_sync (mask 0xffffffff) reads lane 5, which has exited",
        ],
    );
    expect_error(
        "deadlock",
        64,
        &[
            "deadlock",
            "thread 0: __syncthreads",
            "threads 1-31: __shfl_sync (mask 0xffffffff)",
            "threads 32-63: exited",
        ],
    );
    expect_error(
        "outside_mask",
        32,
        &[
            "__shfl_sync (mask 0x00000003) reads lane 2",
            "thread (0,0,0)",
        ],
    );
    expect_error(
        "not_in_mask",
        32,
        &["thread (0,0,0)", "does not name the calling lane"],
    );
    expect_error(
        "mixed_barriers",
        64,
        &["__syncthreads_or meets __syncthreads", "thread (32,0,0)"],
    );
    expect_error(
        "missing_lane",
        48,
        &["thread (32,0,0)", "reads lane 20, which does not exist"],
    );
    // Configurations the hardware refuses.
    let m = module();
    for (grid, block) in [([1, 1, 1], [2048, 1, 1]), ([1, 70_000, 1], [32, 1, 1])] {
        let r = m.launch("divergent", grid, block, 0, &|| {});
        assert!(
            matches!(&r, Err(EmuError::Launch(msg)) if msg.contains("kernel `divergent`")),
            "{grid:?} x {block:?}: {r:?}"
        );
    }
    assert!(matches!(
        m.launch("no_such_kernel", [1, 1, 1], [1, 1, 1], 0, &|| {}),
        Err(EmuError::Symbol { .. })
    ));
}

#[test]
fn a_panic_in_the_body_is_resumed_after_the_launch() {
    if !compiler("a_panic_in_the_body_is_resumed_after_the_launch") {
        return;
    }
    let m = module();
    let calls = std::cell::Cell::new(0);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        m.launch("barriers", [1, 1, 1], [64, 1, 1], 0, &|| {
            calls.set(calls.get() + 1);
            if calls.get() == 5 {
                panic!("a panic in the body");
            }
        })
    }));
    let payload = r.expect_err("the body's panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"a panic in the body"));
    // Every thread's body was still called (the others return at once), and the module works.
    assert_eq!(calls.get(), 5);
    m.launch("barriers", [1, 1, 1], [64, 1, 1], 0, &|| {})
        .unwrap();
}

const CHILD: &str = "KERNELS_EMU_SELFTEST_CHILD";

/// Run by `a_fault_names_the_kernel_and_thread` in a child process: an access past the dynamic
/// shared memory, which kills the process.
#[test]
#[ignore = "run in a child process by a_fault_names_the_kernel_and_thread"]
fn child_oob_dyn() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let m = module();
    type F = unsafe extern "C" fn(*mut f32);
    let f: F = unsafe { m.entry("oob_dyn") }.unwrap();
    let mut out = vec![0f32; 32];
    let op = out.as_mut_ptr();
    let _ = m.launch("oob_dyn", [1, 1, 1], [32, 1, 1], 64, &|| unsafe { f(op) });
}

#[test]
fn a_fault_names_the_kernel_and_thread() {
    if !compiler("a_fault_names_the_kernel_and_thread") {
        return;
    }
    module();
    // Through a shell that turns core dumps off: the child dies of SIGSEGV on purpose, and a
    // core file would land in the crate directory where core_pattern is plain `core`.
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -c 0; exec \"$0\" \"$@\""])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_oob_dyn",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A fault that failed to end the process would hang it: give up after a minute.
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the faulting child did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "the child survived a fault: {err}");
    assert!(
        err.contains(
            "emu: kernel `oob_dyn`, block (0,0,0), thread (1,0,0) (warp 0 lane 1): access past \
             the end of the dynamic shared memory"
        ),
        "{err}"
    );
}
