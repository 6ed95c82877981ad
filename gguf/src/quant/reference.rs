//! Scalar reference dequantizers: the oracle the fast paths are tested against. Written per
//! element from the formulas of spec §5 (element index → which bits, which scale), one block at
//! a time, with the float operations in gguf-py's order so results are bit-exact with it.
//! Keep these slow and obvious; speed belongs in `fast.rs`.

use super::blocks::*;
use super::floats::{bf16_to_f32, e8m0_to_f32_half, f16_to_f32, ue4m3_to_f32_half};
use super::tables::{tables, Tables};
use super::{array_chunks, check_lengths, QuantError};
use crate::GgmlType;

/// Dequantize `data` (whole blocks of `ty`) into `out`, block by block, on this thread.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(ty, data, out)?;
    dequantize_blocks(ty, data, out, tables()?);
    Ok(())
}

/// [`dequantize`] after the length check.
pub(crate) fn dequantize_blocks(ty: GgmlType, data: &[u8], out: &mut [f32], t: &Tables) {
    use GgmlType::*;
    match ty {
        F32 => plain::<4>(data, out, |b| f32::from_le_bytes(*b)),
        F16 => plain::<2>(data, out, |b| f16_to_f32(u16::from_le_bytes(*b))),
        BF16 => plain::<2>(data, out, |b| bf16_to_f32(u16::from_le_bytes(*b))),
        // Round to nearest even, as numpy's astype(float32).
        F64 => plain::<8>(data, out, |b| f64::from_le_bytes(*b) as f32),
        I8 => plain::<1>(data, out, |b| f32::from(b[0] as i8)),
        I16 => plain::<2>(data, out, |b| f32::from(i16::from_le_bytes(*b))),
        I32 => plain::<4>(data, out, |b| i32::from_le_bytes(*b) as f32),
        I64 => plain::<8>(data, out, |b| i64::from_le_bytes(*b) as f32),
        Q4_0 => each(data, out, q4_0),
        Q4_1 => each(data, out, q4_1),
        Q5_0 => each(data, out, q5_0),
        Q5_1 => each(data, out, q5_1),
        Q8_0 => each(data, out, q8_0),
        Q8_1 => each(data, out, q8_1),
        Q2_K => each(data, out, q2_k),
        Q3_K => each(data, out, q3_k),
        Q4_K => each(data, out, q4_k),
        Q5_K => each(data, out, q5_k),
        Q6_K => each(data, out, q6_k),
        Q8_K => each(data, out, q8_k),
        TQ1_0 => each(data, out, tq1_0),
        TQ2_0 => each(data, out, tq2_0),
        Q1_0 => each(data, out, q1_0),
        IQ2_XXS => each(data, out, |b, y| iq2_xxs(b, y, t)),
        IQ2_XS => each(data, out, |b, y| iq2_xs(b, y, t)),
        IQ2_S => each(data, out, |b, y| iq2_s(b, y, t)),
        IQ3_XXS => each(data, out, |b, y| iq3_xxs(b, y, t)),
        IQ3_S => each(data, out, |b, y| iq3_s(b, y, t)),
        IQ1_S => each(data, out, |b, y| iq1_s(b, y, t)),
        IQ1_M => each(data, out, |b, y| iq1_m(b, y, t)),
        IQ4_NL => each(data, out, |b, y| iq4_nl(b, y, t)),
        IQ4_XS => each(data, out, |b, y| iq4_xs(b, y, t)),
        MXFP4 => each(data, out, |b, y| mxfp4(b, y, t)),
        NVFP4 => each(data, out, |b, y| nvfp4(b, y, t)),
    }
}

fn plain<const N: usize>(data: &[u8], out: &mut [f32], f: impl Fn(&[u8; N]) -> f32) {
    for (b, y) in array_chunks::<N>(data).zip(out.iter_mut()) {
        *y = f(b);
    }
}

/// Runs `f` on every block; `y` is the block's `B::ELEMS` output values.
fn each<B: Block>(data: &[u8], out: &mut [f32], f: impl Fn(&B, &mut [f32])) {
    for (bytes, y) in data
        .chunks_exact(B::BYTES)
        .zip(out.chunks_exact_mut(B::ELEMS))
    {
        if let Some(b) = B::read(bytes) {
            f(&b, y);
        }
    }
}

fn sign(bit: u32) -> f32 {
    if bit & 1 != 0 {
        -1.0
    } else {
        1.0
    }
}

/// Q4_0/IQ4_NL nibble order over 32 elements: low nibbles first, then high nibbles.
fn nibble32(qs: &[u8; 16], e: usize) -> u8 {
    if e < 16 {
        qs[e] & 0xf
    } else {
        qs[e - 16] >> 4
    }
}

fn q4_0(b: &BlockQ4_0, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * (i32::from(nibble32(&b.qs, e)) - 8) as f32;
    }
}

fn q4_1(b: &BlockQ4_1, y: &mut [f32]) {
    let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(nibble32(&b.qs, e)) + m;
    }
}

fn q5(qs: &[u8; 16], qh: &[u8; 4], e: usize) -> u8 {
    let high = (u32::from_le_bytes(*qh) >> e) & 1;
    nibble32(qs, e) | (high as u8) << 4
}

fn q5_0(b: &BlockQ5_0, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * (i32::from(q5(&b.qs, &b.qh, e)) - 16) as f32;
    }
}

fn q5_1(b: &BlockQ5_1, y: &mut [f32]) {
    let (d, m) = (f16_to_f32(b.d), f16_to_f32(b.m));
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(q5(&b.qs, &b.qh, e)) + m;
    }
}

fn q8_0(b: &BlockQ8_0, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(b.qs[e]);
    }
}

fn q8_1(b: &BlockQ8_1, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(b.qs[e]);
    }
}

/// 2-bit field of element e in the K-quant `qs` layout: 128-element halves, each 32 bytes
/// holding four 32-element rows at bit offsets 0, 2, 4, 6.
fn crumb(qs: &[u8; 64], e: usize) -> u8 {
    let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
    (qs[32 * h + l] >> (2 * j)) & 3
}

fn q2_k(b: &BlockQ2K, y: &mut [f32]) {
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for (e, y) in y.iter_mut().enumerate() {
        let s = b.scales[e / 16];
        let dl = d * f32::from(s & 0xf);
        let ml = dmin * f32::from(s >> 4);
        *y = dl * f32::from(crumb(&b.qs, e)) - ml;
    }
}

fn q3_k(b: &BlockQ3K, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let s = e / 16;
        let low4 = (b.scales[s % 8] >> (4 * (s / 8))) & 0xf;
        let hi2 = (b.scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        let sc = i32::from(low4 | hi2 << 4) - 32;
        let high = (b.hmask[e % 32] >> (e / 32)) & 1;
        let q = i32::from(crumb(&b.qs, e)) - if high == 1 { 0 } else { 4 };
        *y = (d * sc as f32) * q as f32;
    }
}

/// 6-bit scale and min of sub-block j (0..8) from the 12 packed bytes of Q4_K/Q5_K.
fn scale_min_k4(j: usize, s: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn q4_k(b: &BlockQ4K, y: &mut [f32]) {
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for (e, y) in y.iter_mut().enumerate() {
        let j = e / 32;
        let (sc, m) = scale_min_k4(j, &b.scales);
        let q = (b.qs[32 * (j / 2) + e % 32] >> (4 * (j % 2))) & 0xf;
        *y = (d * f32::from(sc)) * f32::from(q) - dmin * f32::from(m);
    }
}

fn q5_k(b: &BlockQ5K, y: &mut [f32]) {
    let (d, dmin) = (f16_to_f32(b.d), f16_to_f32(b.dmin));
    for (e, y) in y.iter_mut().enumerate() {
        let j = e / 32;
        let (sc, m) = scale_min_k4(j, &b.scales);
        let low = (b.qs[32 * (j / 2) + e % 32] >> (4 * (j % 2))) & 0xf;
        let q = low | ((b.qh[e % 32] >> j) & 1) << 4;
        *y = (d * f32::from(sc)) * f32::from(q) - dmin * f32::from(m);
    }
}

fn q6_k(b: &BlockQ6K, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let (h, r) = (e / 128, e % 128);
        let lo = (b.ql[64 * h + r % 64] >> (4 * (r / 64))) & 0xf;
        let hi = (b.qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        let q = i32::from(lo | hi << 4) - 32;
        *y = (d * f32::from(b.scales[e / 16])) * q as f32;
    }
}

fn q8_k(b: &BlockQ8K, y: &mut [f32]) {
    for (e, y) in y.iter_mut().enumerate() {
        *y = b.d * f32::from(b.qs[e]);
    }
}

fn tq1_0(b: &BlockTq1_0, y: &mut [f32]) {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let (byte, k) = match e {
            0..160 => (b.qs[e % 32], e / 32),
            160..240 => (b.qs[32 + (e - 160) % 16], (e - 160) / 16),
            _ => (b.qh[(e - 240) % 4], (e - 240) / 4),
        };
        // Bytes store ceil(v * 256 / 243): multiplying by 3^k (mod 256) brings digit k to the
        // top, and * 3 >> 8 reads it off.
        let t = (u16::from(byte.wrapping_mul(POW3[k])) * 3) >> 8;
        *y = d * (i32::from(t) - 1) as f32;
    }
}

fn tq2_0(b: &BlockTq2_0, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let (h, k, j) = (e / 128, (e % 128) / 32, e % 32);
        let q = (b.qs[32 * h + j] >> (2 * k)) & 3;
        *y = d * (i32::from(q) - 1) as f32;
    }
}

fn q1_0(b: &BlockQ1_0, y: &mut [f32]) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        *y = if (b.qs[e / 8] >> (e % 8)) & 1 == 1 {
            d
        } else {
            -d
        };
    }
}

fn mxfp4(b: &BlockMxfp4, y: &mut [f32], t: &Tables) {
    let d = e8m0_to_f32_half(b.e);
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(t.kvalues_mxfp4[usize::from(nibble32(&b.qs, e))]);
    }
}

fn nvfp4(b: &BlockNvfp4, y: &mut [f32], t: &Tables) {
    for (e, y) in y.iter_mut().enumerate() {
        let (s, i) = (e / 16, e % 16);
        let q = if i < 8 {
            b.qs[8 * s + i] & 0xf
        } else {
            b.qs[8 * s + i - 8] >> 4
        };
        *y = ue4m3_to_f32_half(b.d[s]) * f32::from(t.kvalues_mxfp4[usize::from(q)]);
    }
}

/// `d * (0.5 + s) * 0.25`, the IQ2 group scale.
fn iq2_db(d: f32, s: u32) -> f32 {
    d * (0.5 + s as f32) * 0.25
}

fn iq2_xxs(b: &BlockIq2Xxs, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let g = e / 32;
        let aux0 = u32::from(b.qs[4 * g]) | u32::from(b.qs[4 * g + 1]) << 16;
        let aux1 = u32::from(b.qs[4 * g + 2]) | u32::from(b.qs[4 * g + 3]) << 16;
        let k = (e % 32) / 8;
        let idx = ((aux0 >> (8 * k)) & 0xff) as usize;
        let signs = t.ksigns[((aux1 >> (7 * k)) & 127) as usize];
        let db = iq2_db(d, aux1 >> 28);
        let i = e % 8;
        *y = db * f32::from(t.iq2xxs[idx][i]) * sign(u32::from(signs >> i));
    }
}

/// 4-bit scale per 16 elements: low nibble of `scales[e/32]` for the first 16, high for the rest.
fn nibble_scale16(scales: &[u8; 8], e: usize) -> u32 {
    let s = e / 16;
    u32::from((scales[s / 2] >> (4 * (s % 2))) & 0xf)
}

fn iq2_xs(b: &BlockIq2Xs, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let q = b.qs[e / 8];
        let idx = usize::from(q & 511);
        let signs = t.ksigns[usize::from(q >> 9)];
        let db = iq2_db(d, nibble_scale16(&b.scales, e));
        let i = e % 8;
        *y = db * f32::from(t.iq2xs[idx][i]) * sign(u32::from(signs >> i));
    }
}

fn iq2_s(b: &BlockIq2S, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let g = e / 8;
        let idx = usize::from(b.qs[g]) | usize::from((b.qh[g / 4] >> (2 * (g % 4))) & 3) << 8;
        let db = iq2_db(d, nibble_scale16(&b.scales, e));
        let i = e % 8;
        *y = db * f32::from(t.iq2s[idx][i]) * sign(u32::from(b.signs[g] >> i));
    }
}

fn iq3_xxs(b: &BlockIq3Xxs, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let g = e / 32;
        let ss = &b.scales_signs;
        let aux = u32::from_le_bytes([ss[4 * g], ss[4 * g + 1], ss[4 * g + 2], ss[4 * g + 3]]);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        let k = (e % 32) / 8;
        let signs = t.ksigns[((aux >> (7 * k)) & 127) as usize];
        let idx = usize::from(b.qs[e / 4]);
        *y = db * f32::from(t.iq3xxs[idx][e % 4]) * sign(u32::from(signs >> (e % 8)));
    }
}

fn iq3_s(b: &BlockIq3S, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let g = e / 4;
        let idx = usize::from(b.qs[g]) | usize::from((b.qh[g / 8] >> (g % 8)) & 1) << 8;
        let s = e / 32;
        let sc = (b.scales[s / 2] >> (4 * (s % 2))) & 0xf;
        let db = d * f32::from(1 + 2 * sc);
        *y = db * f32::from(t.iq3s[idx][e % 4]) * sign(u32::from(b.signs[e / 8] >> (e % 8)));
    }
}

const IQ1_DELTA: f32 = 0.125;

fn iq1_s(b: &BlockIq1S, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let i = e / 32;
        let qh = b.qh[i];
        let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
        let delta = if qh & 0x8000 != 0 {
            -IQ1_DELTA
        } else {
            IQ1_DELTA
        };
        let k = (e % 32) / 8;
        let idx = usize::from(b.qs[4 * i + k]) | usize::from((qh >> (3 * k)) & 7) << 8;
        *y = dl * (f32::from(t.iq1s[idx][e % 8]) + delta);
    }
}

fn iq1_m(b: &BlockIq1M, y: &mut [f32], t: &Tables) {
    let sc: [u16; 4] =
        std::array::from_fn(|i| u16::from_le_bytes([b.scales[2 * i], b.scales[2 * i + 1]]));
    let d =
        f16_to_f32((sc[0] >> 12) | (sc[1] >> 12) << 4 | (sc[2] >> 12) << 8 | (sc[3] >> 12) << 12);
    for (e, y) in y.iter_mut().enumerate() {
        let s = e / 16;
        let sub = (sc[s / 4] >> (3 * (s % 4))) & 7;
        let dl = d * f32::from(2 * sub + 1);
        let g = e / 8;
        let entry = (b.qh[g / 2] >> (4 * (g % 2))) & 0xf;
        let idx = usize::from(b.qs[g]) | usize::from(entry & 7) << 8;
        let delta = if entry & 8 != 0 {
            -IQ1_DELTA
        } else {
            IQ1_DELTA
        };
        *y = dl * (f32::from(t.iq1s[idx][e % 8]) + delta);
    }
}

fn iq4_nl(b: &BlockIq4Nl, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        *y = d * f32::from(t.kvalues_iq4nl[usize::from(nibble32(&b.qs, e))]);
    }
}

fn iq4_xs(b: &BlockIq4Xs, y: &mut [f32], t: &Tables) {
    let d = f16_to_f32(b.d);
    for (e, y) in y.iter_mut().enumerate() {
        let j = e / 32;
        let ls = ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xf)
            | (((b.scales_h >> (2 * j)) & 3) as u8) << 4;
        let dl = d * (i32::from(ls) - 32) as f32;
        let i = e % 32;
        let q = if i < 16 {
            b.qs[16 * j + i] & 0xf
        } else {
            b.qs[16 * j + i - 16] >> 4
        };
        *y = dl * f32::from(t.kvalues_iq4nl[usize::from(q)]);
    }
}
