//! Fast dequantizers: the same arithmetic as `reference.rs` (so results are bit-identical),
//! restructured so the compiler vectorises it — fixed-size block arrays (no bounds checks),
//! per-sub-block scales hoisted out of straight 16/32-element loops, and the whole row loop
//! compiled a second time for AVX2, picked at run time. No fused multiply-add and no
//! reassociation happen in either build, which is what keeps the two bit-identical.
//!
//! Types that do not appear in the models we target fall back to the reference block code.

use super::floats::{bf16_to_f32, e8m0_to_f32_half, f16_le, f16_to_f32_fast};
use super::tables::Tables;
use super::{array_chunks, array_chunks_mut, reference};
use crate::GgmlType;

/// Dequantize whole blocks of `ty` (lengths already checked) on this thread.
pub(crate) fn dequantize_row(ty: GgmlType, data: &[u8], out: &mut [f32], t: &Tables) {
    with_kernel!(ty, row_dispatch(ty, data, out, t));
}

fn row_dispatch<K: Kernel>(ty: GgmlType, data: &[u8], out: &mut [f32], t: &Tables) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the running CPU supports AVX2, checked just above.
        unsafe { row_avx2::<K>(ty, data, out, t) };
        return;
    }
    K::row::<false>(ty, data, out, t);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_avx2<K: Kernel>(ty: GgmlType, data: &[u8], out: &mut [f32], t: &Tables) {
    K::row::<true>(ty, data, out, t);
}

/// One type's row dequantizer as a type, so that every caller (plain and AVX2 row loops, the
/// fused statistics) gets a small monomorphised copy the optimiser inlines whole — one big
/// function over all types would exceed the inliner's budget and stay scalar.
pub(crate) trait Kernel {
    /// `AVX2` may only be true in code that runs after the CPU was checked for AVX2: it enables
    /// the few loops written with intrinsics because the compiler does not vectorise them.
    fn row<const AVX2: bool>(ty: GgmlType, data: &[u8], out: &mut [f32], t: &Tables);
}

macro_rules! kernels {
    ($($name:ident: |$ty:pat_param, $data:ident, $out:ident, $t:pat_param| $body:expr;)*) => {$(
        pub(crate) struct $name;
        impl Kernel for $name {
            #[inline(always)]
            fn row<const AVX2: bool>($ty: GgmlType, $data: &[u8], $out: &mut [f32], $t: &Tables) {
                $body
            }
        }
    )*};
}

/// Loop over `N`-byte blocks and their `QK` output values, calling the block function directly
/// (a function passed as a value may not be inlined).
macro_rules! each_block {
    ($data:expr, $out:expr, $n:literal, $qk:literal, |$b:ident, $y:ident| $body:expr) => {
        for ($b, $y) in array_chunks::<$n>($data).zip(array_chunks_mut::<$qk>($out)) {
            $body;
        }
    };
}

kernels! {
    KF32: |_, d, o, _| plain::<4, 8>(d, o, f32::from_le_bytes);
    KF16: |_, d, o, _| plain::<2, 16>(d, o, |b| f16_to_f32_fast(u16::from_le_bytes(b)));
    KBf16: |_, d, o, _| plain::<2, 16>(d, o, |b| bf16_to_f32(u16::from_le_bytes(b)));
    KQ4_0: |_, d, o, _| each_block!(d, o, 18, 32, |b, y| q4_0(b, y));
    KQ5_0: |_, d, o, _| each_block!(d, o, 22, 32, |b, y| q5_0(b, y));
    KQ8_0: |_, d, o, _| each_block!(d, o, 34, 32, |b, y| q8_0(b, y));
    KQ2K: |_, d, o, _| each_block!(d, o, 84, 256, |b, y| q2_k(b, y));
    KQ3K: |_, d, o, _| each_block!(d, o, 110, 256, |b, y| q3_k(b, y));
    KQ4K: |_, d, o, _| each_block!(d, o, 144, 256, |b, y| q4_k(b, y));
    KQ5K: |_, d, o, _| each_block!(d, o, 176, 256, |b, y| q5_k(b, y));
    KQ6K: |_, d, o, _| each_block!(d, o, 210, 256, |b, y| q6_k(b, y));
    KIq4Nl: |_, d, o, t| each_block!(d, o, 18, 32, |b, y| iq4_nl::<AVX2>(b, y, &t.kvalues_iq4nl));
    KIq4Xs: |_, d, o, t| each_block!(d, o, 136, 256, |b, y| iq4_xs::<AVX2>(b, y, &t.kvalues_iq4nl));
    KMxfp4: |_, d, o, t| each_block!(d, o, 17, 32, |b, y| mxfp4::<AVX2>(b, y, &t.kvalues_mxfp4));
    // Types without a tuned loop: the reference block code.
    KRef: |ty, d, o, t| reference::dequantize_blocks(ty, d, o, t);
}

/// `with_kernel!(ty, f(args..))` calls `f::<K>(args..)` with the [`Kernel`] of `ty`.
macro_rules! with_kernel {
    ($ty:expr, $f:ident ( $($arg:expr),* $(,)? )) => {{
        use $crate::quant::fast::*;
        use $crate::GgmlType as T;
        match $ty {
            T::F32 => $f::<KF32>($($arg),*),
            T::F16 => $f::<KF16>($($arg),*),
            T::BF16 => $f::<KBf16>($($arg),*),
            T::Q4_0 => $f::<KQ4_0>($($arg),*),
            T::Q5_0 => $f::<KQ5_0>($($arg),*),
            T::Q8_0 => $f::<KQ8_0>($($arg),*),
            T::Q2_K => $f::<KQ2K>($($arg),*),
            T::Q3_K => $f::<KQ3K>($($arg),*),
            T::Q4_K => $f::<KQ4K>($($arg),*),
            T::Q5_K => $f::<KQ5K>($($arg),*),
            T::Q6_K => $f::<KQ6K>($($arg),*),
            T::IQ4_NL => $f::<KIq4Nl>($($arg),*),
            T::IQ4_XS => $f::<KIq4Xs>($($arg),*),
            T::MXFP4 => $f::<KMxfp4>($($arg),*),
            _ => $f::<KRef>($($arg),*),
        }
    }};
}
pub(crate) use with_kernel;

/// Element-wise types, `W` elements of `S` bytes per step so the loop body is fixed-width.
#[inline(always)]
fn plain<const S: usize, const W: usize>(data: &[u8], out: &mut [f32], f: impl Fn([u8; S]) -> f32) {
    let mut data_chunks = data.chunks_exact(S * W);
    let mut out_chunks = out.chunks_exact_mut(W);
    for (b, y) in (&mut data_chunks).zip(&mut out_chunks) {
        for (v, y) in b.chunks_exact(S).zip(y.iter_mut()) {
            let mut a = [0u8; S];
            a.copy_from_slice(v);
            *y = f(a);
        }
    }
    let tail = data_chunks.remainder();
    for (v, y) in array_chunks::<S>(tail).zip(out_chunks.into_remainder()) {
        *y = f(*v);
    }
}

#[inline(always)]
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_le(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for l in 0..16 {
        let q = b[2 + l];
        lo[l] = d * (i32::from(q & 0xf) - 8) as f32;
        hi[l] = d * (i32::from(q >> 4) - 8) as f32;
    }
}

#[inline(always)]
fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_le(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let (lo, hi) = y.split_at_mut(16);
    for l in 0..16 {
        let q = b[6 + l];
        let q0 = u32::from(q & 0xf) | ((qh >> l) & 1) << 4;
        let q1 = u32::from(q >> 4) | ((qh >> (l + 16)) & 1) << 4;
        lo[l] = d * (q0 as i32 - 16) as f32;
        hi[l] = d * (q1 as i32 - 16) as f32;
    }
}

#[inline(always)]
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_le(b, 0);
    for l in 0..32 {
        y[l] = d * f32::from(b[2 + l] as i8);
    }
}

#[inline(always)]
fn q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let d = f16_le(b, 80);
    let dmin = f16_le(b, 82);
    for h in 0..2 {
        for j in 0..4 {
            for half in 0..2 {
                let s = b[8 * h + 2 * j + half];
                let dl = d * f32::from(s & 0xf);
                let ml = dmin * f32::from(s >> 4);
                let base = 128 * h + 32 * j + 16 * half;
                for l in 0..16 {
                    let q = (b[16 + 32 * h + 16 * half + l] >> (2 * j)) & 3;
                    y[base + l] = dl * f32::from(q) - ml;
                }
            }
        }
    }
}

#[inline(always)]
fn q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let d = f16_le(b, 108);
    let sc = &b[96..108];
    for h in 0..2 {
        for j in 0..4 {
            for half in 0..2 {
                let s = 8 * h + 2 * j + half;
                let low4 = (sc[s % 8] >> (4 * (s / 8))) & 0xf;
                let hi2 = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
                let dl = d * (i32::from(low4 | hi2 << 4) - 32) as f32;
                let base = 128 * h + 32 * j + 16 * half;
                for l in 0..16 {
                    let ll = 16 * half + l;
                    let low = i32::from((b[32 + 32 * h + ll] >> (2 * j)) & 3);
                    let high = (b[ll] >> (4 * h + j)) & 1;
                    let q = low - 4 + 4 * i32::from(high);
                    y[base + l] = dl * q as f32;
                }
            }
        }
    }
}

/// Scales and mins of the 8 sub-blocks of Q4_K/Q5_K from their 12 packed bytes.
#[inline(always)]
fn scales_mins_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

#[inline(always)]
fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_le(b, 0);
    let dmin = f16_le(b, 2);
    let (sc, m) = scales_mins_k4(&b[4..16]);
    for c in 0..4 {
        let a0 = d * f32::from(sc[2 * c]);
        let m0 = dmin * f32::from(m[2 * c]);
        let a1 = d * f32::from(sc[2 * c + 1]);
        let m1 = dmin * f32::from(m[2 * c + 1]);
        let qs = &b[16 + 32 * c..48 + 32 * c];
        let (lo, hi) = y[64 * c..64 * c + 64].split_at_mut(32);
        for l in 0..32 {
            lo[l] = a0 * f32::from(qs[l] & 0xf) - m0;
            hi[l] = a1 * f32::from(qs[l] >> 4) - m1;
        }
    }
}

#[inline(always)]
fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_le(b, 0);
    let dmin = f16_le(b, 2);
    let (sc, m) = scales_mins_k4(&b[4..16]);
    let qh = &b[16..48];
    for c in 0..4 {
        let a0 = d * f32::from(sc[2 * c]);
        let m0 = dmin * f32::from(m[2 * c]);
        let a1 = d * f32::from(sc[2 * c + 1]);
        let m1 = dmin * f32::from(m[2 * c + 1]);
        let qs = &b[48 + 32 * c..80 + 32 * c];
        let (lo, hi) = y[64 * c..64 * c + 64].split_at_mut(32);
        for l in 0..32 {
            let h0 = ((qh[l] >> (2 * c)) & 1) << 4;
            let h1 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
            lo[l] = a0 * f32::from((qs[l] & 0xf) | h0) - m0;
            hi[l] = a1 * f32::from((qs[l] >> 4) | h1) - m1;
        }
    }
}

#[inline(always)]
fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_le(b, 208);
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..160 + 32 * h];
        let sc = &b[192 + 8 * h..200 + 8 * h];
        let out = &mut y[128 * h..128 * h + 128];
        for half in 0..2 {
            let dl: [f32; 4] = std::array::from_fn(|k| d * f32::from(sc[2 * k + half] as i8));
            for l in 16 * half..16 * half + 16 {
                let q1 = i32::from((ql[l] & 0xf) | (qh[l] & 3) << 4) - 32;
                let q2 = i32::from((ql[l + 32] & 0xf) | ((qh[l] >> 2) & 3) << 4) - 32;
                let q3 = i32::from((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                let q4 = i32::from((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                out[l] = dl[0] * q1 as f32;
                out[l + 32] = dl[1] * q2 as f32;
                out[l + 64] = dl[2] * q3 as f32;
                out[l + 96] = dl[3] * q4 as f32;
            }
        }
    }
}

/// `y[e] = d * kv[q_e]` for 32 nibble indices in Q4_0 order (low nibbles are elements 0..16).
#[inline(always)]
fn lookup32<const AVX2: bool>(qs: &[u8; 16], d: f32, kv: &[i8; 16], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        if let Some(y) = y.first_chunk_mut::<32>() {
            // SAFETY: AVX2 is only true after the CPU check (see `Kernel::row`).
            unsafe { lookup32_avx2(qs, d, kv, y) };
            return;
        }
    }
    let table: [f32; 16] = std::array::from_fn(|i| d * f32::from(kv[i]));
    let (lo, hi) = y.split_at_mut(16);
    for l in 0..16 {
        lo[l] = table[usize::from(qs[l] & 0xf)];
        hi[l] = table[usize::from(qs[l] >> 4)];
    }
}

/// [`lookup32`]'s table lookup as one byte shuffle per 16 values; then the same `d * kv` in f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lookup32_avx2(qs: &[u8; 16], d: f32, kv: &[i8; 16], y: &mut [f32; 32]) {
    use std::arch::x86_64::*;
    // SAFETY: 16-byte unaligned loads from 16-byte arrays, 32-byte stores into 8-f32 chunks of a
    // 32-f32 array.
    unsafe {
        let table = _mm_loadu_si128(kv.as_ptr().cast());
        let q = _mm_loadu_si128(qs.as_ptr().cast());
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
        let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(q), mask));
        let dv = _mm256_set1_ps(d);
        let p = y.as_mut_ptr();
        for (i, v) in [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)]
            .into_iter()
            .enumerate()
        {
            let x = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
            _mm256_storeu_ps(p.add(8 * i), x);
        }
    }
}

#[inline(always)]
fn iq4_nl<const AVX2: bool>(b: &[u8; 18], y: &mut [f32; 32], kv: &[i8; 16]) {
    if let Some(qs) = b.last_chunk::<16>() {
        lookup32::<AVX2>(qs, f16_le(b, 0), kv, y);
    }
}

#[inline(always)]
fn mxfp4<const AVX2: bool>(b: &[u8; 17], y: &mut [f32; 32], kv: &[i8; 16]) {
    if let Some(qs) = b.last_chunk::<16>() {
        lookup32::<AVX2>(qs, e8m0_to_f32_half(b[0]), kv, y);
    }
}

#[inline(always)]
fn iq4_xs<const AVX2: bool>(b: &[u8; 136], y: &mut [f32; 256], kv: &[i8; 16]) {
    let d = f16_le(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let subs = array_chunks::<16>(&b[8..]).zip(y.chunks_exact_mut(32));
    for (j, (qs, y)) in subs.enumerate() {
        let low = (b[4 + j / 2] >> (4 * (j % 2))) & 0xf;
        let ls = low | (((scales_h >> (2 * j)) & 3) as u8) << 4;
        let dl = d * (i32::from(ls) - 32) as f32;
        lookup32::<AVX2>(qs, dl, kv, y);
    }
}
