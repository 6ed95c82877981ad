//! Scalar reference quantizers (the oracle for every faster path): f32 rows to ggml blocks with
//! llama.cpp's arithmetic, so `gguftool quantize` writes the same bytes as `llama-quantize`.
//!
//! Byte identity needs the same float operations in the same order as ggml-quants.c as built
//! in `ggml-base` (compiled without `-march=native`, so no fused multiply-add): every `a*b + c`
//! here is two roundings, every product chain is evaluated left to right as C does, integers
//! convert to f32 where C converts them, and C's narrowing casts (`(int8_t)`, `(uint8_t)`) are
//! spelled out. Never use `mul_add` here. The code is organised one block at a time and kept
//! obvious; speed belongs in [`super::quantize_fast`].
//!
//! Each type has its no-importance-matrix path (ggml's `quantize_row_*_ref`) and, where ggml
//! has one, the weighted path used with an importance matrix (`quantize_row_*_impl`).

// Index loops mirror ggml's so each line can be checked against the C it ports.
#![allow(clippy::needless_range_loop)]

use super::blocks::*;
use super::floats::f16_to_f32;
use super::tables::tables;
use super::QuantError;
use crate::{GgmlType, QK_K};

mod iq12;
use iq12::{iq1_m, iq1_s, iq1s_grid, iq2_s, iq2_xs, iq2s_grid, iq2xs_grid};

const GROUP_MAX_EPS: f32 = 1e-15;

/// Whether [`quantize_rows`] can produce `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
            | IQ3_S
            | IQ3_XXS
            | IQ2_XXS
            | IQ2_XS
            | IQ2_S
            | IQ1_S
            | IQ1_M
            | TQ1_0
            | TQ2_0
            | MXFP4
            | Q1_0
    )
}

/// Types ggml refuses to quantize without an importance matrix (`ggml_quantize_requires_imatrix`).
pub fn requires_imatrix(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::IQ2_XXS | GgmlType::IQ2_XS | GgmlType::IQ1_S)
}

/// Quantize `src` (whole rows of `n_per_row` values) to `ty` into `out` (exactly the rows'
/// bytes). `imatrix`, when given, holds `n_per_row` importance weights applied to every row (the
/// caller picks the expert's slice); types without a weighted path ignore it, as ggml does.
pub fn quantize_rows(
    ty: GgmlType,
    src: &[f32],
    n_per_row: usize,
    imatrix: Option<&[f32]>,
    out: &mut [u8],
) -> Result<(), QuantError> {
    check(ty, src, n_per_row, imatrix, out)?;
    if n_per_row == 0 {
        return Ok(());
    }
    let row_bytes = n_per_row / ty.block_size() * ty.type_size();
    for (x, y) in src
        .chunks_exact(n_per_row)
        .zip(out.chunks_exact_mut(row_bytes))
    {
        quantize_row(ty, x, imatrix, y)?;
    }
    Ok(())
}

pub(crate) fn check(
    ty: GgmlType,
    src: &[f32],
    n_per_row: usize,
    imatrix: Option<&[f32]>,
    out: &[u8],
) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::Unsupported {
            ty,
            what: "quantization",
        });
    }
    let bs = ty.block_size();
    if !n_per_row.is_multiple_of(bs)
        || (n_per_row == 0 && !src.is_empty())
        || !src.len().is_multiple_of(n_per_row.max(1))
    {
        return Err(QuantError::PartialRow {
            ty,
            len: n_per_row,
            block_size: bs,
        });
    }
    let expected = src.len() / bs * ty.type_size();
    if out.len() != expected {
        return Err(QuantError::OutputLength {
            ty,
            in_bytes: out.len(),
            expected,
            got: src.len(),
        });
    }
    if let Some(w) = imatrix {
        if w.len() != n_per_row {
            return Err(QuantError::ImatrixLength {
                ty,
                n_per_row,
                got: w.len(),
            });
        }
    }
    Ok(())
}

/// One row (lengths checked by the caller).
pub(crate) fn quantize_row(
    ty: GgmlType,
    x: &[f32],
    qw: Option<&[f32]>,
    y: &mut [u8],
) -> Result<(), QuantError> {
    use GgmlType::*;
    match ty {
        F32 => {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        F16 => {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(2)) {
                o.copy_from_slice(&fp32_to_fp16(*v).to_le_bytes());
            }
        }
        BF16 => {
            for (v, o) in x.iter().zip(y.chunks_exact_mut(2)) {
                o.copy_from_slice(&fp32_to_bf16(*v).to_le_bytes());
            }
        }
        Q4_0 => match qw {
            None => blocks(x, y, q4_0),
            Some(w) => weighted_legacy(x, w, y, q4_0_weighted),
        },
        Q4_1 => match qw {
            None => blocks(x, y, q4_1),
            Some(w) => weighted_legacy(x, w, y, q4_1_weighted),
        },
        Q5_0 => match qw {
            None => blocks(x, y, q5_0),
            Some(w) => weighted_legacy(x, w, y, q5_0_weighted),
        },
        Q5_1 => match qw {
            None => blocks(x, y, q5_1),
            Some(w) => weighted_legacy(x, w, y, q5_1_weighted),
        },
        Q8_0 => blocks(x, y, q8_0),
        Q1_0 => blocks(x, y, q1_0),
        MXFP4 => {
            let t = tables()?;
            blocks(x, y, |b| mxfp4(b, &t.kvalues_mxfp4))
        }
        TQ1_0 => blocks(x, y, tq1_0),
        TQ2_0 => blocks(x, y, tq2_0),
        Q2_K => match qw {
            None => blocks(x, y, q2_k),
            Some(w) => weighted_k(x, w, y, q2_k_weighted),
        },
        Q3_K => match qw {
            None => blocks(x, y, q3_k),
            Some(w) => weighted_k(x, w, y, |b, w| q3_k_weighted(b, Some(w))),
        },
        Q4_K => match qw {
            None => blocks(x, y, q4_k),
            Some(w) => weighted_k(x, w, y, |b, w| q4_k_weighted(b, Some(w))),
        },
        Q5_K => match qw {
            None => blocks(x, y, q5_k),
            Some(w) => weighted_k(x, w, y, |b, w| q5_k_weighted(b, Some(w))),
        },
        Q6_K => match qw {
            None => blocks(x, y, |b| q6_k(b, None)),
            Some(w) => weighted_k(x, w, y, |b, w| q6_k(b, Some(w))),
        },
        IQ4_NL => {
            let t = tables()?;
            let values = &t.kvalues_iq4nl;
            for (i, (xb, yb)) in x.chunks_exact(32).zip(y.chunks_exact_mut(18)).enumerate() {
                let w = qw.map(|w| &w[32 * i..32 * i + 32]);
                iq4_nl(xb, w, values).write(yb);
            }
        }
        IQ4_XS => {
            let values = &tables()?.kvalues_iq4nl;
            super_blocks(x, qw, y, |b, w| iq4_xs(b, w, values));
        }
        IQ2_XXS => {
            let g = iq2xxs_grid()?;
            weighted_k(x, needs_weights(ty, qw)?, y, |b, w| iq2_xxs(b, w, g));
        }
        IQ2_XS => {
            let g = iq2xs_grid()?;
            weighted_k(x, needs_weights(ty, qw)?, y, |b, w| iq2_xs(b, w, g));
        }
        IQ2_S => {
            let g = iq2s_grid()?;
            super_blocks(x, qw, y, |b, w| iq2_s(b, w, g));
        }
        IQ1_S => {
            let g = iq1s_grid()?;
            weighted_k(x, needs_weights(ty, qw)?, y, |b, w| iq1_s(b, w, g));
        }
        IQ1_M => {
            let g = iq1s_grid()?;
            super_blocks(x, qw, y, |b, w| iq1_m(b, w, g));
        }
        IQ3_XXS => {
            let g = iq3xxs_grid()?;
            super_blocks(x, qw, y, |b, w| iq3_xxs(b, w, g));
        }
        IQ3_S => {
            let g = iq3s_grid()?;
            super_blocks(x, qw, y, |b, w| iq3_s(b, w, g));
        }
        _ => {
            return Err(QuantError::Unsupported {
                ty,
                what: "quantization",
            })
        }
    }
    Ok(())
}

/// The importance weights of a type ggml cannot quantize without them.
fn needs_weights(ty: GgmlType, qw: Option<&[f32]>) -> Result<&[f32], QuantError> {
    qw.ok_or(QuantError::Unsupported {
        ty,
        what: "quantization without an importance matrix",
    })
}

/// Quantize every block of a row with `f`.
fn blocks<B: Block>(x: &[f32], y: &mut [u8], f: impl Fn(&[f32]) -> B) {
    for (xb, yb) in x.chunks_exact(B::ELEMS).zip(y.chunks_exact_mut(B::BYTES)) {
        f(xb).write(yb);
    }
}

/// The legacy 32-blocks' weighted path: `sigma2` over the whole row, then per block.
fn weighted_legacy<B: Block>(x: &[f32], qw: &[f32], y: &mut [u8], f: impl Fn(&[f32], &[f32]) -> B) {
    let mut sum_x2 = 0.0f32;
    for v in x {
        sum_x2 += v * v;
    }
    let sigma2 = sum_x2 / x.len() as f32;
    for ((xb, qb), yb) in x
        .chunks_exact(32)
        .zip(qw.chunks_exact(32))
        .zip(y.chunks_exact_mut(B::BYTES))
    {
        let mut weight = [0.0f32; 32];
        for j in 0..32 {
            weight[j] = qb[j] * (sigma2 + xb[j] * xb[j]).sqrt();
        }
        f(xb, &weight).write(yb);
    }
}

/// Every super-block of a row with its slice of the importance weights, if any.
fn super_blocks<B: Block>(
    x: &[f32],
    qw: Option<&[f32]>,
    y: &mut [u8],
    f: impl Fn(&[f32], Option<&[f32]>) -> B,
) {
    for (i, (xb, yb)) in x
        .chunks_exact(QK_K)
        .zip(y.chunks_exact_mut(B::BYTES))
        .enumerate()
    {
        f(xb, qw.map(|w| &w[QK_K * i..QK_K * i + QK_K])).write(yb);
    }
}

/// The K-quants' weighted path: per super-block with its slice of the importance weights.
fn weighted_k<B: Block>(x: &[f32], qw: &[f32], y: &mut [u8], f: impl Fn(&[f32], &[f32]) -> B) {
    for ((xb, qb), yb) in x
        .chunks_exact(QK_K)
        .zip(qw.chunks_exact(QK_K))
        .zip(y.chunks_exact_mut(B::BYTES))
    {
        f(xb, qb).write(yb);
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar helpers with C's semantics.

/// ggml's `nearest_int`: adding 1.5 * 2^23 rounds to nearest (ties to even) and the integer
/// sits in the low mantissa bits. Kept as the bit trick so out-of-range inputs give what ggml
/// gives too.
#[inline]
pub(crate) fn nearest_int(f: f32) -> i32 {
    let v = f + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// ggml's software `GGML_FP32_TO_FP16` (round to nearest even; NaN becomes 0x7e00).
pub(crate) fn fp32_to_fp16(f: f32) -> u16 {
    let scale_to_inf = f32::from_bits(0x7780_0000); // 2^112
    let scale_to_zero = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * scale_to_inf) * scale_to_zero;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let mut bias = shl1_w & 0xff00_0000;
    if bias < 0x7100_0000 {
        bias = 0x7100_0000;
    }
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let exp_bits = (bits >> 13) & 0x0000_7c00;
    let mantissa_bits = bits & 0x0000_0fff;
    let nonsign = exp_bits + mantissa_bits;
    ((sign >> 16)
        | if shl1_w > 0xff00_0000 {
            0x7e00
        } else {
            nonsign
        }) as u16
}

/// ggml's `GGML_FP32_TO_BF16`: round to nearest even, NaN forced quiet.
pub(crate) fn fp32_to_bf16(s: f32) -> u16 {
    let i = s.to_bits();
    if i & 0x7fff_ffff > 0x7f80_0000 {
        return ((i >> 16) | 64) as u16;
    }
    (i.wrapping_add(0x7fff + ((i >> 16) & 1)) >> 16) as u16
}

/// C's `(int8_t)f` on x86: truncate to i32 (cvttss2si; out of range gives i32::MIN) and keep
/// the low byte.
#[inline]
fn c_f32_to_i8(f: f32) -> i8 {
    let i = if !(-2_147_483_648.0..2_147_483_648.0).contains(&f) {
        i32::MIN
    } else {
        f as i32
    };
    i as i8
}

/// C's `(uint8_t)f` on x86 (same route as [`c_f32_to_i8`]).
#[inline]
fn c_f32_to_u8(f: f32) -> u8 {
    c_f32_to_i8(f) as u8
}

/// C's `lroundf` (half away from zero) for the ternary types.
#[inline]
fn lroundf(f: f32) -> i64 {
    f.round() as i64
}

fn h2f(h: u16) -> f32 {
    f16_to_f32(h)
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-element blocks.

/// Value of largest magnitude (the first one on ties), and its magnitude.
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn recip_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

fn q4_0(x: &[f32]) -> BlockQ4_0 {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = recip_or_zero(d);
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        let xi0 = c_f32_to_i8(x0 + 8.5).min(15) as u8;
        let xi1 = c_f32_to_i8(x1 + 8.5).min(15) as u8;
        qs[j] = xi0 | xi1 << 4;
    }
    BlockQ4_0 {
        d: fp32_to_fp16(d),
        qs,
    }
}

fn q4_1(x: &[f32]) -> BlockQ4_1 {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = recip_or_zero(d);
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let x0 = (x[j] - min) * id;
        let x1 = (x[16 + j] - min) * id;
        let xi0 = c_f32_to_i8(x0 + 0.5).min(15) as u8;
        let xi1 = c_f32_to_i8(x1 + 0.5).min(15) as u8;
        qs[j] = xi0 | xi1 << 4;
    }
    BlockQ4_1 {
        d: fp32_to_fp16(d),
        m: fp32_to_fp16(min),
        qs,
    }
}

/// Packs 32 five-bit quants: low nibbles in `qs` (element j low, j + 16 high), fifth bits in `qh`.
fn pack5(q: impl Fn(usize) -> u8) -> ([u8; 4], [u8; 16]) {
    let mut qs = [0u8; 16];
    let mut qh = 0u32;
    for j in 0..16 {
        let (xi0, xi1) = (q(j), q(j + 16));
        qs[j] = (xi0 & 0x0f) | (xi1 & 0x0f) << 4;
        qh |= u32::from((xi0 & 0x10) >> 4) << j;
        qh |= u32::from((xi1 & 0x10) >> 4) << (j + 16);
    }
    (qh.to_le_bytes(), qs)
}

fn q5_0(x: &[f32]) -> BlockQ5_0 {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = recip_or_zero(d);
    let (qh, qs) = pack5(|j| c_f32_to_i8(x[j] * id + 16.5).min(31) as u8);
    BlockQ5_0 {
        d: fp32_to_fp16(d),
        qh,
        qs,
    }
}

fn q5_1(x: &[f32]) -> BlockQ5_1 {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = recip_or_zero(d);
    let (qh, qs) = pack5(|j| c_f32_to_u8((x[j] - min) * id + 0.5));
    BlockQ5_1 {
        d: fp32_to_fp16(d),
        m: fp32_to_fp16(min),
        qh,
        qs,
    }
}

/// ggml's `MAX(a, b)` = `a > b ? a : b`.
fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

fn q8_0(x: &[f32]) -> BlockQ8_0 {
    let mut amax = 0.0f32;
    for &v in x {
        amax = c_max(amax, v.abs());
    }
    let d = amax / 127.0;
    let id = recip_or_zero(d);
    let mut qs = [0i8; 32];
    for (q, &v) in qs.iter_mut().zip(x) {
        // C assigns roundf's float to int8_t: the same truncating conversion.
        *q = c_f32_to_i8((v * id).round());
    }
    BlockQ8_0 {
        d: fp32_to_fp16(d),
        qs,
    }
}

fn q1_0(x: &[f32]) -> BlockQ1_0 {
    let mut sum_abs = 0.0f32;
    for v in x {
        sum_abs += v.abs();
    }
    let d = sum_abs / 128.0;
    let mut qs = [0u8; 16];
    for (j, &v) in x.iter().enumerate() {
        if v >= 0.0 {
            qs[j / 8] |= 1 << (j % 8);
        }
    }
    BlockQ1_0 {
        d: fp32_to_fp16(d),
        qs,
    }
}

/// Index of the doubled E2M1 value nearest to `x / e` (first on ties), as ggml searches it.
fn best_index_mxfp4(x: f32, e: f32, values: &[i8; 16]) -> u8 {
    let mut best = 0u8;
    let mut best_err = (f32::from(values[0]) * e - x).abs();
    for (i, &v) in values.iter().enumerate().skip(1) {
        let err = (f32::from(v) * e - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

fn mxfp4(x: &[f32], values: &[i8; 16]) -> BlockMxfp4 {
    let mut amax = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
        }
    }
    let e = if amax > 0.0 {
        // C: (uint8_t)(floorf(log2f(amax)) - 2 + 127), the int promoted to float first.
        c_f32_to_u8(amax.log2().floor() - 2.0 + 127.0)
    } else {
        0
    };
    let d = super::floats::e8m0_to_f32_half(e);
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let x0 = best_index_mxfp4(x[j], d, values);
        let x1 = best_index_mxfp4(x[16 + j], d, values);
        qs[j] = x0 | x1 << 4;
    }
    BlockMxfp4 { e, qs }
}

// ---------------------------------------------------------------------------------------------
// Ternary types.

fn tq_absmax(x: &[f32]) -> (f32, f32) {
    let mut amax = 0.0f32;
    for &v in x {
        amax = c_max(amax, v.abs());
    }
    (amax, recip_or_zero(amax))
}

/// Base-3 digits of `vals` (first is most significant) as ggml's ceil(q * 256 / 243) byte.
fn tq1_byte(trits: impl Iterator<Item = i64>, extra_shift: bool) -> u8 {
    let mut q = 0u8;
    for xi in trits {
        q = q.wrapping_mul(3).wrapping_add(xi as u8);
    }
    if extra_shift {
        q = q.wrapping_mul(3);
    }
    (u16::from(q) * 256).div_ceil(243) as u8
}

fn tq1_0(x: &[f32]) -> BlockTq1_0 {
    let (d, id) = tq_absmax(x);
    let t = |v: f32| lroundf(v * id) + 1;
    let mut qs = [0u8; 48];
    for m in 0..32 {
        qs[m] = tq1_byte((0..5).map(|n| t(x[m + n * 32])), false);
    }
    for m in 0..16 {
        qs[32 + m] = tq1_byte((0..5).map(|n| t(x[160 + m + n * 16])), false);
    }
    let mut qh = [0u8; 4];
    for (j, h) in qh.iter_mut().enumerate() {
        *h = tq1_byte((0..4).map(|m| t(x[240 + j + m * 4])), true);
    }
    BlockTq1_0 {
        qs,
        qh,
        d: fp32_to_fp16(d),
    }
}

fn tq2_0(x: &[f32]) -> BlockTq2_0 {
    let (d, id) = tq_absmax(x);
    let mut qs = [0u8; 64];
    for j in (0..64).step_by(32) {
        for m in 0..32 {
            let mut q = 0u8;
            for n in 0..4 {
                let xi = lroundf(x[4 * j + m + n * 32] * id) + 1;
                q = q.wrapping_add(((xi & 3) as u8) << (2 * n));
            }
            qs[j + m] = q;
        }
    }
    BlockTq2_0 {
        qs,
        d: fp32_to_fp16(d),
    }
}

// ---------------------------------------------------------------------------------------------
// K-quant scale searches (ggml's make_q*_quants), kept with their quirks.

/// `make_qx_quants`: symmetric quants in [-nmax, nmax) stored +nmax, scale refined by a
/// weighted least-squares search over 19 candidate inverse scales.
fn make_qx_quants(
    nmax: i32,
    x: &[f32],
    l_out: &mut [i8],
    rmse_type: i32,
    qw: Option<&[f32]>,
) -> f32 {
    let n = x.len();
    let (amax, max) = {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            let ax = v.abs();
            if ax > amax {
                amax = ax;
                max = v;
            }
        }
        (amax, max)
    };
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    if rmse_type == 0 {
        for i in 0..n {
            let l = nearest_int(iscale * x[i]);
            l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
        }
        return 1.0 / iscale;
    }
    let (rmse_type, return_early) = if rmse_type < 0 {
        (-rmse_type, true)
    } else {
        (rmse_type, false)
    };
    let weight = |i: usize| -> f32 {
        match qw {
            Some(w) => w[i],
            None => match rmse_type {
                1 => x[i] * x[i],
                2 => 1.0,
                3 => x[i].abs(),
                _ => x[i].abs().sqrt(),
            },
        }
    };
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = weight(i);
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    if return_early {
        return if suml2 > 0.0 {
            0.5 * (scale + 1.0 / iscale)
        } else {
            1.0 / iscale
        };
    }
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            let w = weight(i);
            let lf = l as f32;
            sumlx += w * x[i] * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants` with `do_rmse`: coordinate descent on the quants, weights x².
fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = l as i8;
        let w = x[i] * x[i];
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = f32::from(l_out[i]);
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(l_out[i]) {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for l in l_out[..n].iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `make_qkx2_quants` / `make_qkx3_quants`: asymmetric quants in [0, nmax] with a min, the
/// scale/min pair found by a weighted least-squares search over `nstep + 1` candidates.
/// Returns (scale, -min). `weights = None` means x² (qkx3's default).
#[allow(clippy::too_many_arguments)]
fn make_qkx_quants(
    nmax: i32,
    x: &[f32],
    weights: Option<&[f32]>,
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
    qkx3: bool,
) -> (f32, f32) {
    let n = x.len();
    let w = |i: usize| match weights {
        Some(w) => w[i],
        None => x[i] * x[i],
    };
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = w(0);
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let wi = w(i);
        sum_w += wi;
        sum_x += wi * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    // qkx2 tests max == min, qkx3 max <= min: the same after min was clamped to <= 0 unless NaN.
    let degenerate = if qkx3 { max <= min } else { max == min };
    if degenerate {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min));
        l_out[i] = l.clamp(0, nmax) as u8;
        let diff = scale * f32::from(l_out[i]) + min - x[i];
        let diff = if use_mad { diff.abs() } else { diff * diff };
        best_error += w(i) * diff;
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let wi = w(i);
            let lf = l as f32;
            sum_l += wi * lf;
            sum_l2 += wi * lf * lf;
            sum_xl += wi * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                let diff = if use_mad { diff.abs() } else { diff * diff };
                cur_error += w(i) * diff;
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `make_qp_quants`: non-negative quants of the sub-block scales in [0, nmax], weighted.
fn make_qp_quants(nmax: i32, x: &[f32], l_out: &mut [u8], qw: &[f32]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    for &v in x {
        max = c_max(max, v);
    }
    if max < GROUP_MAX_EPS {
        l_out[..n].fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for i in 0..n {
        l_out[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0.0f32;
    for i in 0..n {
        let diff = x[i] - scale * f32::from(l_out[i]);
        best_mse += qw[i] * diff * diff;
    }
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0.0f32;
        for i in 0..n {
            let l = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * l as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).min(nmax);
        l_out[i] = l as u8;
        let lf = l as f32;
        sumlx += qw[i] * x[i] * lf;
        suml2 += qw[i] * lf * lf;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = qw[i];
            let li = f32::from(l_out[i]);
            let mut slx = sumlx - w * x[i] * li;
            let mut sl2 = suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(l_out[i]) {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// 2-bit fields of 256 quants in the K-quant order (128-element halves, four rows of 32).
fn pack2(l: &[u8; QK_K]) -> [u8; 64] {
    let mut qs = [0u8; 64];
    for j in (0..QK_K).step_by(128) {
        for k in 0..32 {
            qs[j / 4 + k] = l[j + k] | l[j + k + 32] << 2 | l[j + k + 64] << 4 | l[j + k + 96] << 6;
        }
    }
    qs
}

// ---------------------------------------------------------------------------------------------
// Q2_K

fn q2_k(x: &[f32]) -> BlockQ2K {
    let mut l = [0u8; QK_K];
    let mut mins = [0.0f32; 16];
    let mut scales = [0.0f32; 16];
    let q4scale = 15.0f32;
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weights = [0.0f32; 16];
        for k in 0..16 {
            weights[k] = xs[k].abs();
        }
        let (s, m) = make_qkx_quants(
            3,
            xs,
            Some(&weights),
            &mut l[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let mut sc = [0u8; 16];
    let d = if max_scale > 0.0 {
        let iscale = q4scale / max_scale;
        for j in 0..16 {
            sc[j] = nearest_int(iscale * scales[j]) as u8;
        }
        fp32_to_fp16(max_scale / q4scale)
    } else {
        fp32_to_fp16(0.0)
    };
    let dmin = if max_min > 0.0 {
        let iscale = q4scale / max_min;
        for j in 0..16 {
            let v = nearest_int(iscale * mins[j]);
            sc[j] |= (v << 4) as u8;
        }
        fp32_to_fp16(max_min / q4scale)
    } else {
        fp32_to_fp16(0.0)
    };
    requantize_q2(x, &mut l, &sc, h2f(d), h2f(dmin));
    BlockQ2K {
        scales: sc,
        qs: pack2(&l),
        d,
        dmin,
    }
}

/// Quants again from the stored (rounded) scales and mins.
fn requantize_q2(x: &[f32], l: &mut [u8; QK_K], sc: &[u8; 16], dm: f32, mm: f32) {
    for j in 0..16 {
        let d = dm * f32::from(sc[j] & 0xf);
        if d == 0.0 {
            continue;
        }
        let m = mm * f32::from(sc[j] >> 4);
        for ii in 0..16 {
            let v = nearest_int((x[16 * j + ii] + m) / d).clamp(0, 3);
            l[16 * j + ii] = v as u8;
        }
    }
}

/// The K-quants' weighted scale/min search (`quantize_row_q{2,4,5}_K_impl`): per sub-block of
/// `SUB` values a least-squares search with the weights `weight(j, xs, out)` gives, then the
/// `NSUB` scales and mins themselves quantized to `[0, nscale]` by `make_qp_quants`, weighted by
/// each sub-block's weight sum. Returns the scale codes, min codes, and their two scales.
fn kx_weighted_search<const NSUB: usize, const SUB: usize>(
    x: &[f32],
    nmax: i32,
    nscale: i32,
    l: &mut [u8; QK_K],
    weight: impl Fn(usize, &[f32], &mut [f32; SUB]),
) -> ([u8; NSUB], [u8; NSUB], f32, f32) {
    let mut mins = [0.0f32; NSUB];
    let mut scales = [0.0f32; NSUB];
    let mut sw = [0.0f32; NSUB];
    for j in 0..NSUB {
        let xs = &x[SUB * j..SUB * j + SUB];
        let mut w = [0.0f32; SUB];
        weight(j, xs, &mut w);
        for v in w {
            sw[j] += v;
        }
        let (sc, m) = make_qkx_quants(
            nmax,
            xs,
            Some(&w),
            &mut l[SUB * j..SUB * j + SUB],
            -0.9,
            0.05,
            36,
            false,
            true,
        );
        scales[j] = sc;
        mins[j] = m;
    }
    let mut ls = [0u8; NSUB];
    let mut lm = [0u8; NSUB];
    let d = make_qp_quants(nscale, &scales, &mut ls, &sw);
    let m = make_qp_quants(nscale, &mins, &mut lm, &sw);
    (ls, lm, d, m)
}

fn sum_squares(x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for v in x {
        s += v * v;
    }
    s
}

fn q2_k_weighted(x: &[f32], qw: &[f32]) -> BlockQ2K {
    let mut l = [0u8; QK_K];
    let sigma2 = sum_squares(x) / QK_K as f32;
    let (ls, lm, dm, mm) = kx_weighted_search::<16, 16>(x, 3, 15, &mut l, |j, xs, w| {
        for k in 0..16 {
            w[k] = qw[16 * j + k] * (sigma2 + xs[k] * xs[k]).sqrt();
        }
    });
    let d = fp32_to_fp16(dm);
    let dmin = fp32_to_fp16(mm);
    let mut sc = [0u8; 16];
    for j in 0..16 {
        sc[j] = ls[j] | lm[j] << 4;
    }
    requantize_q2(x, &mut l, &sc, h2f(d), h2f(dmin));
    BlockQ2K {
        scales: sc,
        qs: pack2(&l),
        d,
        dmin,
    }
}

// ---------------------------------------------------------------------------------------------
// Q3_K

/// Stores 16 six-bit scales (already offset by 32) in Q3_K's 12-byte layout.
fn pack_q3_scales(l6: impl Fn(usize) -> i32) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..16 {
        let mut l = l6(j);
        if j < 8 {
            s[j] = (l & 0xf) as u8;
        } else {
            s[j - 8] |= ((l & 0xf) << 4) as u8;
        }
        l >>= 4;
        s[j % 4 + 8] |= (l << (2 * (j / 4))) as u8;
    }
    s
}

/// Quants from the stored scales, then the high bits split off into `hmask`.
fn finish_q3(x: &[f32], l: &mut [i8; QK_K], scales: [u8; 12], d16: u16) -> BlockQ3K {
    let dh = h2f(d16);
    for j in 0..16 {
        let low = if j < 8 {
            scales[j] & 0xf
        } else {
            scales[j - 8] >> 4
        };
        let sc = (low | ((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) as i8 - 32;
        let d = dh * f32::from(sc);
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let v = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
            l[16 * j + ii] = (v + 4) as i8;
        }
    }
    let mut hmask = [0u8; 32];
    let mut m = 0usize;
    let mut hm = 1u8;
    for j in 0..QK_K {
        if l[j] > 3 {
            hmask[m] |= hm;
            l[j] -= 4;
        }
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm = hm.wrapping_shl(1);
        }
    }
    let lu: [u8; QK_K] = std::array::from_fn(|i| l[i] as u8);
    BlockQ3K {
        hmask,
        qs: pack2(&lu),
        scales,
        d: d16,
    }
}

fn q3_k(x: &[f32]) -> BlockQ3K {
    let mut l = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        let scale = scales[j].abs();
        if scale > amax {
            amax = scale;
            max_scale = scales[j];
        }
    }
    let (packed, d) = if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        let packed = pack_q3_scales(|j| {
            // C: int8_t l = nearest_int(..); l = MAX(-32, MIN(31, l)) + 32;
            let v = nearest_int(iscale * scales[j]) as i8;
            i32::from(v).clamp(-32, 31) + 32
        });
        (packed, fp32_to_fp16(1.0 / iscale))
    } else {
        ([0u8; 12], fp32_to_fp16(0.0))
    };
    finish_q3(x, &mut l, packed, d)
}

fn q3_k_weighted(x: &[f32], qw: Option<&[f32]>) -> BlockQ3K {
    let mut l = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut sw = [0.0f32; 16];
    let mut sumx2 = 0.0f32;
    for v in x {
        sumx2 += v * v;
    }
    let sigma2 = 2.0 * sumx2 / QK_K as f32;
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weight = [0.0f32; 16];
        for k in 0..16 {
            weight[k] = match qw {
                Some(q) => q[16 * j + k] * (sigma2 + xs[k] * xs[k]).sqrt(),
                None => xs[k] * xs[k],
            };
        }
        let mut sumw = 0.0f32;
        for w in weight {
            sumw += w;
        }
        sw[j] = sumw;
        scales[j] = make_qx_quants(4, xs, &mut l[16 * j..16 * j + 16], 1, Some(&weight));
    }
    let mut ls = [0i8; 16];
    let d_block = make_qx_quants(32, &scales, &mut ls, 1, Some(&sw));
    let packed = pack_q3_scales(|j| i32::from(ls[j]));
    finish_q3(x, &mut l, packed, fp32_to_fp16(d_block))
}

// ---------------------------------------------------------------------------------------------
// Q4_K / Q5_K

/// 8 six-bit scales and mins in the 12-byte layout of Q4_K/Q5_K.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0xf) | (lm[j] & 0xf) << 4;
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

fn get_scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4,
            (q[j + 4] >> 4) | (q[j] >> 6) << 4,
        )
    }
}

/// Sub-block scales/mins of a Q4_K/Q5_K super-block without weights: per-32 `av_x + |x|`
/// weights, then the 6-bit codes scaled by the largest scale and min.
fn kx_scales_ref(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    l: &mut [u8; QK_K],
) -> ([u8; 12], u16, u16) {
    let mut mins = [0.0f32; 8];
    let mut scales = [0.0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0.0f32; 32];
        for k in 0..32 {
            weights[k] = av_x + xs[k].abs();
        }
        let (s, m) = make_qkx_quants(
            nmax,
            xs,
            Some(&weights),
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
            false,
        );
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    (
        pack_scale_min_k4(&ls, &lm),
        fp32_to_fp16(max_scale / 63.0),
        fp32_to_fp16(max_min / 63.0),
    )
}

/// The weighted scale search of Q4_K/Q5_K (`quantize_row_q4_K_impl`; also their default for
/// rows quantized with an importance matrix).
fn kx_scales_weighted(
    x: &[f32],
    qw: Option<&[f32]>,
    nmax: i32,
    l: &mut [u8; QK_K],
    clamp63: bool,
) -> ([u8; 12], u16, u16) {
    let sigma2 = 2.0 * sum_squares(x) / QK_K as f32;
    let av_x = sigma2.sqrt();
    let (mut ls, mut lm, d_block, m_block) =
        kx_weighted_search::<8, 32>(x, nmax, 63, l, |j, xs, w| {
            for k in 0..32 {
                w[k] = match qw {
                    Some(q) => q[32 * j + k] * (sigma2 + xs[k] * xs[k]).sqrt(),
                    None => av_x + xs[k].abs(),
                };
            }
        });
    if clamp63 {
        for j in 0..8 {
            ls[j] = ls[j].min(63);
            lm[j] = lm[j].min(63);
        }
    }
    (
        pack_scale_min_k4(&ls, &lm),
        fp32_to_fp16(d_block),
        fp32_to_fp16(m_block),
    )
}

/// Quants from the stored scales and mins (values in [0, nmax]).
fn requantize_kx(x: &[f32], l: &mut [u8; QK_K], scales: &[u8; 12], d: u16, dmin: u16, nmax: i32) {
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, scales);
        let d = h2f(d) * f32::from(sc);
        if d == 0.0 {
            continue;
        }
        let dm = h2f(dmin) * f32::from(m);
        for ii in 0..32 {
            let v = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            l[32 * j + ii] = v as u8;
        }
    }
}

fn pack_q4k(l: &[u8; QK_K]) -> [u8; 128] {
    let mut q = [0u8; 128];
    for (c, j) in (0..QK_K).step_by(64).enumerate() {
        for k in 0..32 {
            q[32 * c + k] = l[j + k] | l[j + k + 32] << 4;
        }
    }
    q
}

fn pack_q5k(l: &[u8; QK_K]) -> ([u8; 32], [u8; 128]) {
    let mut qh = [0u8; 32];
    let mut ql = [0u8; 128];
    let (mut m1, mut m2) = (1u8, 2u8);
    for (c, n) in (0..QK_K).step_by(64).enumerate() {
        for j in 0..32 {
            let mut l1 = l[n + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = l[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[32 * c + j] = l1 | l2 << 4;
        }
        m1 = m1.wrapping_shl(2);
        m2 = m2.wrapping_shl(2);
    }
    (qh, ql)
}

/// Quants from the stored scales, packed into a Q4_K block.
fn finish_q4k(x: &[f32], l: &mut [u8; QK_K], (scales, d, dmin): ([u8; 12], u16, u16)) -> BlockQ4K {
    requantize_kx(x, l, &scales, d, dmin, 15);
    BlockQ4K {
        d,
        dmin,
        scales,
        qs: pack_q4k(l),
    }
}

/// Quants from the stored scales, packed into a Q5_K block.
fn finish_q5k(x: &[f32], l: &mut [u8; QK_K], (scales, d, dmin): ([u8; 12], u16, u16)) -> BlockQ5K {
    requantize_kx(x, l, &scales, d, dmin, 31);
    let (qh, qs) = pack_q5k(l);
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
}

fn q4_k(x: &[f32]) -> BlockQ4K {
    let mut l = [0u8; QK_K];
    let sd = kx_scales_ref(x, 15, -1.0, 20, &mut l);
    finish_q4k(x, &mut l, sd)
}

fn q4_k_weighted(x: &[f32], qw: Option<&[f32]>) -> BlockQ4K {
    let mut l = [0u8; QK_K];
    let sd = kx_scales_weighted(x, qw, 15, &mut l, false);
    finish_q4k(x, &mut l, sd)
}

fn q5_k(x: &[f32]) -> BlockQ5K {
    let mut l = [0u8; QK_K];
    let sd = kx_scales_ref(x, 31, -0.5, 15, &mut l);
    finish_q5k(x, &mut l, sd)
}

fn q5_k_weighted(x: &[f32], qw: Option<&[f32]>) -> BlockQ5K {
    let mut l = [0u8; QK_K];
    let sd = kx_scales_weighted(x, qw, 31, &mut l, true);
    finish_q5k(x, &mut l, sd)
}

// ---------------------------------------------------------------------------------------------
// Q6_K

fn q6_k(x: &[f32], qw: Option<&[f32]>) -> BlockQ6K {
    let mut l = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for ib in 0..16 {
        let w = qw.map(|q| &q[16 * ib..16 * ib + 16]);
        let scale = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut l[16 * ib..16 * ib + 16],
            1,
            w,
        );
        scales[ib] = scale;
        let abs_scale = scale.abs();
        if abs_scale > max_abs_scale {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        return BlockQ6K {
            ql: [0; 128],
            qh: [0; 64],
            scales: [0; 16],
            d: fp32_to_fp16(0.0),
        };
    }
    let iscale = -128.0 / max_scale;
    let d16 = fp32_to_fp16(1.0 / iscale);
    let mut sc = [0i8; 16];
    for ib in 0..16 {
        sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    for j in 0..16 {
        let d = h2f(d16) * f32::from(sc[j]);
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let v = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            l[16 * j + ii] = (v + 32) as i8;
        }
    }
    let lu: [u8; QK_K] = std::array::from_fn(|i| l[i] as u8);
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (c, j) in (0..QK_K).step_by(128).enumerate() {
        for k in 0..32 {
            let q1 = lu[j + k] & 0xf;
            let q2 = lu[j + k + 32] & 0xf;
            let q3 = lu[j + k + 64] & 0xf;
            let q4 = lu[j + k + 96] & 0xf;
            ql[64 * c + k] = q1 | q3 << 4;
            ql[64 * c + k + 32] = q2 | q4 << 4;
            qh[32 * c + k] = lu[j + k] >> 4
                | (lu[j + k + 32] >> 4) << 2
                | (lu[j + k + 64] >> 4) << 4
                | (lu[j + k + 96] >> 4) << 6;
        }
    }
    BlockQ6K {
        ql,
        qh,
        scales: sc,
        d: d16,
    }
}

// ---------------------------------------------------------------------------------------------
// Weighted legacy blocks (with an importance matrix).

fn q4_0_weighted(xb: &[f32], weight: &[f32]) -> BlockQ4_0 {
    let mut l = [0i8; 32];
    let d = make_qx_quants(8, xb, &mut l, 1, Some(weight));
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = (l[j] | l[j + 16] << 4) as u8;
    }
    BlockQ4_0 {
        d: fp32_to_fp16(d),
        qs,
    }
}

fn q5_0_weighted(xb: &[f32], weight: &[f32]) -> BlockQ5_0 {
    let mut l = [0i8; 32];
    let d = make_qx_quants(16, xb, &mut l, 1, Some(weight));
    let (qh, qs) = pack5(|j| l[j] as u8);
    BlockQ5_0 {
        d: fp32_to_fp16(d),
        qh,
        qs,
    }
}

fn q4_1_weighted(xb: &[f32], weight: &[f32]) -> BlockQ4_1 {
    let mut l = [0u8; 32];
    let (d, min) = make_qkx_quants(15, xb, Some(weight), &mut l, -0.9, 0.05, 36, false, true);
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = l[j] | l[j + 16] << 4;
    }
    BlockQ4_1 {
        d: fp32_to_fp16(d),
        m: fp32_to_fp16(-min),
        qs,
    }
}

fn q5_1_weighted(xb: &[f32], weight: &[f32]) -> BlockQ5_1 {
    let mut l = [0u8; 32];
    let (d, min) = make_qkx_quants(31, xb, Some(weight), &mut l, -0.9, 0.05, 36, false, true);
    let (qh, qs) = pack5(|j| l[j]);
    BlockQ5_1 {
        d: fp32_to_fp16(d),
        m: fp32_to_fp16(-min),
        qh,
        qs,
    }
}

// ---------------------------------------------------------------------------------------------
// IQ4_NL / IQ4_XS (non-linear 4-bit values).

/// ggml's `best_index_int8`: binary search of the sorted table, ties to the lower index.
fn best_index_int8(values: &[i8; 16], x: f32) -> u8 {
    if x <= f32::from(values[0]) {
        return 0;
    }
    if x >= f32::from(values[15]) {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < f32::from(values[mav]) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - f32::from(values[mu - 1]) < f32::from(values[mu]) - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// The scale search of one 32-element block (`quantize_row_iq4_nl_impl`'s inner loop): returns
/// the block scale (0 for an all-zero block) with the quants in `lb`.
fn iq4_block_scale(xb: &[f32], weight: &[f32], values: &[i8; 16], ntry: i32, lb: &mut [u8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in xb {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let v0 = f32::from(values[0]);
    let mut d = if ntry > 0 { -max / v0 } else { max / v0 };
    let mut id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for j in 0..xb.len() {
        let al = id * xb[j];
        let l = best_index_int8(values, al);
        lb[j] = l;
        let q = f32::from(values[usize::from(l)]);
        let w = weight[j];
        sumqx += w * q * xb[j];
        sumq2 += w * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -ntry..=ntry {
        id = (itry + i32::from(values[0])) as f32 / max;
        sumqx = 0.0;
        sumq2 = 0.0;
        for j in 0..xb.len() {
            let al = id * xb[j];
            let l = best_index_int8(values, al);
            let q = f32::from(values[usize::from(l)]);
            let w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Per-element weights of the IQ4 search: `qw * sqrt(sigma2 + x²)` with an importance
/// matrix, else x².
fn iq4_weights(xb: &[f32], qw: Option<&[f32]>, sigma2: f32, out: &mut [f32]) {
    for j in 0..xb.len() {
        out[j] = match qw {
            Some(q) => q[j] * (sigma2 + xb[j] * xb[j]).sqrt(),
            None => xb[j] * xb[j],
        };
    }
}

fn iq4_sigma2(x: &[f32]) -> f32 {
    let mut sigma2 = 0.0f32;
    for v in x {
        sigma2 += v * v;
    }
    sigma2 * (2.0 / x.len() as f32)
}

fn pack_nibbles32(l: &[u8], q4: &mut [u8]) {
    for i in 0..l.len() / 32 {
        for j in 0..16 {
            q4[16 * i + j] = l[32 * i + j] | l[32 * i + 16 + j] << 4;
        }
    }
}

/// IQ4_NL. ggml's row quantizer (`quantize_iq4_nl`) runs the search with ntry = 7 with or
/// without an importance matrix; only its `_ref` entry point uses -1.
fn iq4_nl(x: &[f32], qw: Option<&[f32]>, values: &[i8; 16]) -> BlockIq4Nl {
    let ntry = 7;
    let sigma2 = iq4_sigma2(x);
    let mut weight = [0.0f32; 32];
    iq4_weights(x, qw, sigma2, &mut weight);
    let mut l = [0u8; 32];
    let scale = iq4_block_scale(x, &weight, values, ntry, &mut l);
    let d = fp32_to_fp16(scale);
    if ntry > 0 {
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for j in 0..32 {
            l[j] = best_index_int8(values, id * x[j]);
        }
    }
    let mut qs = [0u8; 16];
    pack_nibbles32(&l, &mut qs);
    BlockIq4Nl { d, qs }
}

fn iq4_xs(x: &[f32], qw: Option<&[f32]>, values: &[i8; 16]) -> BlockIq4Xs {
    let ntry = 7;
    let sigma2 = iq4_sigma2(x);
    let mut l = [0u8; QK_K];
    let mut scales = [0.0f32; 8];
    let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let mut weight = [0.0f32; 32];
        iq4_weights(
            xb,
            qw.map(|q| &q[32 * ib..32 * ib + 32]),
            sigma2,
            &mut weight,
        );
        let d = iq4_block_scale(xb, &weight, values, ntry, &mut l[32 * ib..32 * ib + 32]);
        scales[ib] = d;
        let abs_d = d.abs();
        if abs_d > amax_scale {
            amax_scale = abs_d;
            max_scale = d;
        }
    }
    let d = -max_scale / 32.0;
    let dh = fp32_to_fp16(d);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    let mut scales_l = [0u8; 4];
    for ib in 0..8 {
        let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
        let dl = d * ls as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        for j in 0..32 {
            l[32 * ib + j] = best_index_int8(values, idl * x[32 * ib + j]);
        }
        let lv = (ls + 32) as u8;
        let (l_l, l_h) = (lv & 0xf, lv >> 4);
        if ib % 2 == 0 {
            scales_l[ib / 2] = l_l;
        } else {
            scales_l[ib / 2] |= l_l << 4;
        }
        scales_h |= u16::from(l_h) << (2 * (ib % 8));
    }
    let mut qs = [0u8; 128];
    pack_nibbles32(&l, &mut qs);
    BlockIq4Xs {
        d: dh,
        scales_h,
        scales_l,
        qs,
    }
}

// ---------------------------------------------------------------------------------------------
// IQ3_S: 4-value groups snapped to a 512-point grid of odd magnitudes 1..15.

/// A codebook grid with ggml's search structures (`iq3xs_init_impl`, `iq2xs_init_impl`): the
/// points as odd magnitudes `2l + 1` in groups of `N`, a map from the code of any `N`
/// magnitudes (`BITS` bits each) to its grid index, and for codes off the grid the candidate
/// points of the `nwant` nearest distance levels, nearest first (ties by index).
struct Grid<const N: usize, const BITS: usize> {
    points: Vec<[u8; N]>,
    map: Vec<i32>,
    /// For an off-grid code `u`: `neighbours[-map[u] - 1..]` starts with the count.
    neighbours: Vec<u16>,
}

/// IQ3 grids: 4 magnitudes of 3 bits.
type Iq3Grid = Grid<4, 3>;
/// IQ2 grids: 8 magnitudes of 2 bits.
type Iq2Grid = Grid<8, 2>;

impl<const N: usize, const BITS: usize> Grid<N, BITS> {
    /// `map_size` codes are searched, as ggml's `kmap_size` says (for IQ2 it stops just past
    /// the codes whose fields are all at most 2).
    fn build(points: Vec<[u8; N]>, nwant: usize, map_size: usize) -> Self {
        let mask = (1usize << BITS) - 1;
        let mut map = vec![-1i32; map_size];
        for (i, p) in points.iter().enumerate() {
            let mut index = 0usize;
            for (k, &v) in p.iter().enumerate() {
                index |= usize::from((v - 1) / 2) << (BITS * k);
            }
            map[index] = i as i32;
        }
        let mut neighbours = Vec::new();
        let mut dist2: Vec<(i32, usize)> = Vec::with_capacity(points.len());
        for u in 0..map_size {
            if map[u] >= 0 {
                continue;
            }
            let pos: [i32; N] = std::array::from_fn(|k| 2 * ((u >> (BITS * k)) & mask) as i32 + 1);
            dist2.clear();
            for (j, p) in points.iter().enumerate() {
                let d2: i32 = (0..N).map(|k| (i32::from(p[k]) - pos[k]).pow(2)).sum();
                dist2.push((d2, j));
            }
            dist2.sort_unstable();
            map[u] = -(neighbours.len() as i32 + 1);
            let start = neighbours.len();
            neighbours.push(0);
            let (mut d2, mut nhave, mut n) = (dist2[0].0, 1, 0u16);
            for &(d, j) in &dist2 {
                if d > d2 {
                    if nhave == nwant {
                        break;
                    }
                    d2 = d;
                    nhave += 1;
                }
                neighbours.push(j as u16);
                n += 1;
            }
            neighbours[start] = n;
        }
        Grid {
            points,
            map,
            neighbours,
        }
    }

    /// Points from a dequantization table whose byte values are the levels of the magnitude
    /// codes (`levels[l]`).
    fn from_levels(
        rows: &[[u8; N]],
        levels: &[u8],
        nwant: usize,
        map_size: usize,
    ) -> Result<Self, String> {
        let mut points = Vec::with_capacity(rows.len());
        for r in rows {
            let mut p = [0u8; N];
            for (o, v) in p.iter_mut().zip(r) {
                let l = levels
                    .iter()
                    .position(|x| x == v)
                    .ok_or_else(|| format!("grid value {v} is not a level"))?;
                *o = 2 * l as u8 + 1;
            }
            points.push(p);
        }
        Ok(Self::build(points, nwant, map_size))
    }

    fn code(l: &[i8]) -> usize {
        let mut u = 0usize;
        for (i, &v) in l.iter().enumerate().take(N) {
            u |= (v as u8 as usize) << (BITS * i);
        }
        u
    }

    /// `iq{2,3}_find_best_neighbour`: the candidate minimising the weighted squared error at
    /// `scale` (first on ties); writes its magnitude codes to `l`.
    fn best_neighbour(
        &self,
        u: usize,
        xval: &[f32],
        weight: &[f32],
        scale: f32,
        l: &mut [i8],
    ) -> usize {
        let start = (-self.map[u] - 1) as usize;
        let n = usize::from(self.neighbours[start]);
        let mut best_d2 = f32::MAX;
        let mut best = usize::from(self.neighbours[start + 1]);
        for &j in &self.neighbours[start + 1..start + 1 + n] {
            let pg = &self.points[usize::from(j)];
            let mut d2 = 0.0f32;
            for i in 0..N {
                let q = f32::from(pg[i]);
                let diff = scale * q - xval[i];
                d2 += weight[i] * diff * diff;
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = usize::from(j);
            }
        }
        for i in 0..N {
            l[i] = ((self.points[best][i] - 1) / 2) as i8;
        }
        best
    }
}

/// IQ3_S's 512-point grid (its table already holds the odd magnitudes).
fn iq3s_grid() -> Result<&'static Iq3Grid, QuantError> {
    static CELL: std::sync::OnceLock<Iq3Grid> = std::sync::OnceLock::new();
    let t = tables()?;
    Ok(CELL.get_or_init(|| Iq3Grid::build(t.iq3s.to_vec(), 3, 4096)))
}

/// IQ3_XXS's 256-point grid: its table holds the dequantized levels 4, 12, ..., 52, 62, the
/// k-th of which is magnitude code k (odd magnitude 2k + 1).
fn iq3xxs_grid() -> Result<&'static Iq3Grid, QuantError> {
    static CELL: std::sync::OnceLock<Result<Iq3Grid, String>> = std::sync::OnceLock::new();
    let t = tables()?;
    CELL.get_or_init(|| {
        Iq3Grid::from_levels(&t.iq3xxs[..], &[4, 12, 20, 28, 36, 44, 52, 62], 2, 4096)
    })
    .as_ref()
    .map_err(|e| QuantError::Tables(e.clone()))
}

/// Per-element weights of a 32-element IQ3 sub-block and their square roots (the neighbour
/// search's weights).
fn iq3_weights(xb: &[f32], qw: Option<&[f32]>, sigma2: f32) -> ([f32; 32], [f32; 32]) {
    let mut weight = [0.0f32; 32];
    for i in 0..32 {
        weight[i] = match qw {
            Some(q) => q[i] * (sigma2 + xb[i] * xb[i]).sqrt(),
            None => xb[i] * xb[i],
        };
    }
    let mut waux = [0.0f32; 32];
    for i in 0..32 {
        waux[i] = weight[i].sqrt();
    }
    (weight, waux)
}

/// How a grid quantizer searches a sub-block's scale (`quantize_row_iq3_*_impl`,
/// `quantize_row_iq2_{xs,s}_impl` differ only in these).
struct GridSearch {
    /// Magnitude codes run `0..kmaxq` (odd magnitudes `1..=2 kmaxq - 1`).
    kmaxq: i32,
    /// Inverse-scale steps `is` tried: `-steps..=steps`, each `step` apart.
    steps: i32,
    step: f32,
    /// Whether a group counts as on the grid before any candidate scale was accepted.
    on_grid_init: bool,
    /// Whether the final pass re-snaps only the groups that were off the grid.
    skip_on_grid: bool,
}

/// `sum w * x * q` and `sum w * q * q` for magnitude codes `l` (q = 2l + 1).
fn grid_sums(weight: &[f32], xval: &[f32], l: &[i8]) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for ((&w, &x), &c) in weight.iter().zip(xval).zip(l) {
        let q = (2 * i32::from(c) + 1) as f32;
        sumqx += w * x * q;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

impl<const N: usize, const BITS: usize> Grid<N, BITS> {
    /// Magnitude codes of the `N` values of group `k` at inverse scale `id`, clamped to
    /// `0..kmaxq`, into `l[N k..]`; returns their code.
    fn codes(xval: &[f32], k: usize, id: f32, kmaxq: i32, l: &mut [i8]) -> usize {
        for i in 0..N {
            l[N * k + i] =
                nearest_int(0.5 * (id * xval[N * k + i] - 1.0)).clamp(0, kmaxq - 1) as i8;
        }
        Self::code(&l[N * k..N * k + N])
    }

    /// The scale search of one sub-block of `E` magnitudes `xval` (largest `max` > 0): the
    /// best of the candidate scales, groups snapped to the grid, then the off-grid groups
    /// re-snapped at the chosen scale and the scale refitted. Returns the scale and the
    /// magnitude codes (every group on the grid).
    fn search<const E: usize>(
        &self,
        xval: &[f32; E],
        weight: &[f32; E],
        waux: &[f32; E],
        max: f32,
        how: &GridSearch,
    ) -> (f32, [i8; E]) {
        let groups = E / N;
        let top = (2 * how.kmaxq - 1) as f32;
        let mut l = [0i8; E];
        let mut best = 0.0f32;
        let mut scale = max / top;
        let mut is_on_grid = [how.on_grid_init; 8];
        let mut laux = [0i8; E];
        let mut on_aux = [false; 8];
        for is in -how.steps..=how.steps {
            let id = (top + is as f32 * how.step) / max;
            let this_scale = 1.0 / id;
            for k in 0..groups {
                let u = Self::codes(xval, k, id, how.kmaxq, &mut laux);
                on_aux[k] = self.map[u] >= 0;
                if !on_aux[k] {
                    let r = N * k..N * k + N;
                    self.best_neighbour(
                        u,
                        &xval[r.clone()],
                        &waux[r.clone()],
                        this_scale,
                        &mut laux[r],
                    );
                }
            }
            let (sumqx, sumq2) = grid_sums(weight, xval, &laux);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                l = laux;
                is_on_grid = on_aux;
            }
        }
        if is_on_grid[..groups].iter().any(|b| !*b) && scale > 0.0 {
            let id = 1.0 / scale;
            for k in 0..groups {
                if how.skip_on_grid && is_on_grid[k] {
                    continue;
                }
                let u = Self::codes(xval, k, id, how.kmaxq, &mut l);
                if self.map[u] < 0 {
                    let r = N * k..N * k + N;
                    self.best_neighbour(u, &xval[r.clone()], &waux[r.clone()], scale, &mut l[r]);
                }
            }
            let (sumqx, sumq2) = grid_sums(weight, xval, &l);
            if sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }
        (scale, l)
    }
}

/// Magnitudes and sign bits (per 8 values) of a sub-block of `E = 8 G` values, and the number
/// of negatives per 8.
fn group_signs<const E: usize, const G: usize>(xb: &[f32]) -> ([f32; E], [u8; G], [u32; G]) {
    let mut xval = [0.0f32; E];
    let mut signs = [0u8; G];
    let mut nflip = [0u32; G];
    for k in 0..G {
        for i in 0..8 {
            let v = xb[8 * k + i];
            if v >= 0.0 {
                xval[8 * k + i] = v;
            } else {
                xval[8 * k + i] = -v;
                nflip[k] += 1;
                signs[k] |= 1 << i;
            }
        }
    }
    (xval, signs, nflip)
}

fn iq3_sigma2(x: &[f32]) -> f32 {
    2.0 * sum_squares(x) / QK_K as f32
}

/// The largest value (ggml's `MAX` chain from the first element).
fn chain_max(v: &[f32]) -> f32 {
    let mut max = v[0];
    for &x in &v[1..] {
        max = c_max(max, x);
    }
    max
}

/// `quantize_row_iq3_s_impl` for one super-block, with block size 32. Like ggml, a sub-block
/// whose values are all zero does not advance the `qs`/`signs` write position (its scale is 0;
/// later sub-blocks' bytes shift down) — reproduced because the bytes must match.
fn iq3_s(x: &[f32], qw: Option<&[f32]>, g: &Iq3Grid) -> BlockIq3S {
    const HOW: GridSearch = GridSearch {
        kmaxq: 8,
        steps: 9,
        step: 0.2,
        on_grid_init: false,
        skip_on_grid: false,
    };
    let mut y = BlockIq3S {
        d: fp32_to_fp16(0.0),
        qs: [0; 64],
        qh: [0; 8],
        signs: [0; 32],
        scales: [0; 4],
    };
    let sigma2 = iq3_sigma2(x);
    let mut scales = [0.0f32; 8];
    let mut max_scale = 0.0f32;
    let (mut qs_at, mut signs_at) = (0usize, 0usize);
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let (weight, waux) = iq3_weights(xb, qw.map(|q| &q[32 * ib..32 * ib + 32]), sigma2);
        // ggml skips only all-zero sub-blocks: below the least subnormal is exactly zero.
        let Some((scale, l, block_signs)) = signed_sub_block::<4, 3, 32, 4>(
            g,
            xb,
            (&weight, &waux),
            f32::from_bits(1),
            false,
            &HOW,
        ) else {
            scales[ib] = 0.0;
            continue;
        };
        for k in 0..8 {
            // Every code here came from the grid or its neighbour lists (ggml aborts
            // otherwise); index 0 keeps the block decodable should it ever happen.
            let gi = g.map[Iq3Grid::code(&l[4 * k..4 * k + 4])].max(0) as usize;
            y.qs[qs_at + k] = (gi & 255) as u8;
            let bit = ib * 8 + k;
            y.qh[bit / 8] |= ((gi >> 8) << (bit % 8)) as u8;
        }
        qs_at += 8;
        y.signs[signs_at..signs_at + 4].copy_from_slice(&block_signs);
        signs_at += 4;
        scales[ib] = scale;
        max_scale = c_max(max_scale, scale);
    }
    if max_scale == 0.0 {
        return y;
    }
    let d = max_scale / 31.0;
    y.d = fp32_to_fp16(d * 1.033);
    let id = 1.0 / d;
    for ib in (0..8).step_by(2) {
        let l1 = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 15);
        let l2 = nearest_int(0.5 * (id * scales[ib + 1] - 1.0)).clamp(0, 15);
        y.scales[ib / 2] = (l1 | l2 << 4) as u8;
    }
    y
}

/// `quantize_row_iq3_xxs_impl` (grid 256) for one super-block.
fn iq3_xxs(x: &[f32], qw: Option<&[f32]>, g: &Iq3Grid) -> BlockIq3Xxs {
    const HOW: GridSearch = GridSearch {
        kmaxq: 8,
        steps: 15,
        step: 0.2,
        on_grid_init: true,
        skip_on_grid: true,
    };
    const EPS: f32 = 1e-8; // GROUP_MAX_EPS_IQ3_XXS
    let mut q3 = [0u8; 64];
    let mut scales_and_signs = [0u32; 8];
    let sigma2 = iq3_sigma2(x);
    let mut scales = [0.0f32; 8];
    let mut max_scale = 0.0f32;
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let (weight, waux) = iq3_weights(xb, qw.map(|q| &q[32 * ib..32 * ib + 32]), sigma2);
        let Some((scale, l, block_signs)) =
            signed_sub_block::<4, 3, 32, 4>(g, xb, (&weight, &waux), EPS, true, &HOW)
        else {
            scales[ib] = 0.0;
            continue;
        };
        for k in 0..8 {
            q3[8 * ib + k] = g.map[Iq3Grid::code(&l[4 * k..4 * k + 4])].max(0) as u8;
        }
        scales_and_signs[ib] = u32::from(block_signs[0])
            | u32::from(block_signs[1]) << 7
            | u32::from(block_signs[2]) << 14
            | u32::from(block_signs[3]) << 21;
        scales[ib] = scale;
        max_scale = c_max(max_scale, scale);
    }
    if max_scale == 0.0 {
        return BlockIq3Xxs {
            d: fp32_to_fp16(0.0),
            qs: [0; 64],
            scales_signs: [0; 32],
        };
    }
    let d = max_scale / 31.0;
    let id = 1.0 / d;
    for ib in 0..8 {
        let v = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 15);
        scales_and_signs[ib] |= (v as u32) << 28;
    }
    let mut ss = [0u8; 32];
    for (c, v) in ss.chunks_exact_mut(4).zip(scales_and_signs) {
        c.copy_from_slice(&v.to_le_bytes());
    }
    BlockIq3Xxs {
        d: fp32_to_fp16(d * 1.0125),
        qs: q3,
        scales_signs: ss,
    }
}

/// One sub-block of the grid types with a searched scale (IQ3_S, IQ3_XXS, IQ2_XS, IQ2_S):
/// magnitudes and sign bits (with `parity`, the even-parity fix-up and 7-bit signs), the scale
/// search, the signs flipped if the scale came out negative. `None` when the largest magnitude
/// is below `eps` (scale 0).
fn signed_sub_block<const N: usize, const BITS: usize, const E: usize, const G: usize>(
    g: &Grid<N, BITS>,
    xb: &[f32],
    (weight, waux): (&[f32; E], &[f32; E]),
    eps: f32,
    parity: bool,
    how: &GridSearch,
) -> Option<(f32, [i8; E], [u8; G])> {
    let (mut xval, mut signs, nflip) = group_signs::<E, G>(xb);
    if parity {
        even_sign_parity(xb, weight, &mut xval, &mut signs, &nflip);
    }
    let max = chain_max(&xval);
    if max < eps {
        return None;
    }
    let (mut scale, l) = g.search(&xval, weight, waux, max, how);
    if scale < 0.0 {
        scale = -scale;
        let mask = if parity { 127 } else { 255 };
        for s in signs.iter_mut() {
            *s = !*s & mask;
        }
    }
    Some((scale, l, signs))
}

/// IQ2_XXS/IQ3_XXS store 7 sign bits per 8 values, the eighth implied by even parity: in a
/// group with an odd number of negatives the value that matters least (smallest `w x²`) has its
/// sign flipped. The stored sign bytes keep 7 bits.
fn even_sign_parity(xb: &[f32], weight: &[f32], xval: &mut [f32], signs: &mut [u8], nflip: &[u32]) {
    for k in 0..signs.len() {
        if nflip[k] % 2 == 1 {
            let mut imin = 0usize;
            let mut min = weight[8 * k] * xb[8 * k] * xb[8 * k];
            for i in 1..8 {
                let ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                if ax < min {
                    min = ax;
                    imin = i;
                }
            }
            xval[8 * k + imin] = -xval[8 * k + imin];
            signs[k] ^= 1 << imin;
        }
        signs[k] &= 127;
    }
}

// ---------------------------------------------------------------------------------------------
// IQ2: 8-value groups snapped to a grid of magnitudes 1, 3, 5 (ggml's `iq2xs_init_impl`).

/// ggml's IQ2 `kmap_size`: every code whose 2-bit fields are at most 2, plus two.
const IQ2_MAP_SIZE: usize = 43692;

impl Iq2Grid {
    /// Grid index of the 8 magnitude codes of group `k` at inverse scale `id` (snapped to the
    /// best neighbour when off the grid, which also rewrites `l`).
    fn snap(
        &self,
        xval: &[f32],
        waux: &[f32],
        k: usize,
        id: f32,
        scale: f32,
        l: &mut [i8],
    ) -> usize {
        let u = Self::codes(xval, k, id, 3, l);
        if self.map[u] >= 0 {
            return self.map[u] as usize;
        }
        self.best_neighbour(
            u,
            &xval[8 * k..8 * k + 8],
            &waux[8 * k..8 * k + 8],
            scale,
            &mut l[8 * k..8 * k + 8],
        )
    }
}

fn iq2xxs_grid() -> Result<&'static Iq2Grid, QuantError> {
    static CELL: std::sync::OnceLock<Result<Iq2Grid, String>> = std::sync::OnceLock::new();
    iq12::iq2_grid(&CELL, &tables()?.iq2xxs[..], 2)
}

/// `quantize_row_iq2_xxs_impl` for one super-block (needs importance weights).
fn iq2_xxs(x: &[f32], qw: &[f32], g: &Iq2Grid) -> BlockIq2Xxs {
    const KMAXQ: i32 = 3;
    let mut q2 = [0u32; 16];
    let sigma2 = sum_squares(x) / QK_K as f32;
    let mut scales = [0.0f32; 8];
    let mut max_scale = 0.0f32;
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let mut weight = [0.0f32; 32];
        for i in 0..32 {
            weight[i] = qw[32 * ib + i] * (sigma2 + xb[i] * xb[i]).sqrt();
        }
        let mut waux = [0.0f32; 32];
        for i in 0..32 {
            waux[i] = weight[i].sqrt();
        }
        let (mut xval, mut block_signs, nflip) = group_signs::<32, 4>(xb);
        even_sign_parity(xb, &weight, &mut xval, &mut block_signs, &nflip);
        let max = chain_max(&xval);
        if max < GROUP_MAX_EPS {
            scales[ib] = 0.0;
            continue;
        }
        let mut lu = [0u8; 32];
        let mut scale = make_qp_quants(KMAXQ + 1, &xval, &mut lu, &weight);
        let mut l: [i8; 32] = std::array::from_fn(|i| lu[i] as i8);
        let eff_max = scale * KMAXQ as f32;
        if eff_max <= 0.0 {
            scales[ib] = 0.0;
            continue;
        }
        let mut best = 0.0f32;
        let mut laux = [0i8; 32];
        for is in -6..=6 {
            let id = ((2 * KMAXQ - 1) as f32 + is as f32 * 0.1) / eff_max;
            let this_scale = 1.0 / id;
            for k in 0..4 {
                g.snap(&xval, &waux, k, id, this_scale, &mut laux);
            }
            let (sumqx, sumq2) = grid_sums(&weight, &xval, &laux);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                l = laux;
            }
        }
        if scale > 0.0 {
            let id = 1.0 / scale;
            for k in 0..4 {
                let gi = g.snap(&xval, &waux, k, id, scale, &mut l);
                for i in 0..8 {
                    l[8 * k + i] = ((g.points[gi][i] - 1) / 2) as i8;
                }
            }
            let (sumqx, sumq2) = grid_sums(&weight, &xval, &l);
            if sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }
        if scale < 0.0 {
            scale = -scale;
            for s in block_signs.iter_mut() {
                *s = !*s & 127;
            }
        }
        for k in 0..4 {
            let gi = g.map[Iq2Grid::code(&l[8 * k..8 * k + 8])].max(0) as u32;
            q2[2 * ib] |= gi << (8 * k);
            q2[2 * ib + 1] |= u32::from(block_signs[k]) << (7 * k);
        }
        scales[ib] = scale;
        max_scale = c_max(max_scale, scale);
    }
    if max_scale == 0.0 {
        return BlockIq2Xxs {
            d: fp32_to_fp16(0.0),
            qs: [0; 32],
        };
    }
    let d = max_scale / 31.0;
    let id = 1.0 / d;
    for ib in 0..8 {
        let v = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 15);
        q2[2 * ib + 1] |= (v as u32) << 28;
    }
    let mut qs = [0u16; 32];
    for (i, v) in q2.iter().enumerate() {
        qs[2 * i] = (*v & 0xffff) as u16;
        qs[2 * i + 1] = (*v >> 16) as u16;
    }
    BlockIq2Xxs {
        d: fp32_to_fp16(d),
        qs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp16_conversion_matches_rne_on_every_class() {
        // Exhaustive over a stride of all f32 bit patterns: ggml's software conversion equals
        // round-to-nearest-even (half's) except for NaN, which ggml canonicalises.
        let mut bits = 0u32;
        loop {
            let f = f32::from_bits(bits);
            let ours = fp32_to_fp16(f);
            if f.is_nan() {
                assert_eq!(ours & 0x7fff, 0x7e00);
            } else {
                assert_eq!(ours, half::f16::from_f32(f).to_bits(), "{f:e} ({bits:#x})");
            }
            match bits.checked_add(0x1235) {
                Some(b) => bits = b,
                None => break,
            }
        }
    }

    #[test]
    fn nearest_int_is_round_half_even() {
        for (f, i) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
            (-7.6, -8),
        ] {
            assert_eq!(nearest_int(f), i, "{f}");
        }
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(fp32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between two bf16 values: ties to even (down).
        assert_eq!(fp32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(fp32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(fp32_to_bf16(f32::NAN) & 0x7fc0, 0x7fc0);
    }

    #[test]
    fn q4_0_hand_computed() {
        // max = -8 (largest magnitude) -> d = 1, id = 1; q = min(15, (int)(x + 8.5)).
        let mut x = [0.0f32; 32];
        x[0] = -8.0;
        x[1] = 7.0;
        x[16] = 3.4;
        let mut out = [0u8; 18];
        quantize_rows(GgmlType::Q4_0, &x, 32, None, &mut out).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(u16::from_le_bytes([out[0], out[1]]), 0x3c00);
        assert_eq!(out[2], 11 << 4); // x0 = -8 -> 0; x16 = 3.4 -> 11
        assert_eq!(out[3] & 0xf, 15);
        assert_eq!(out[4], 8 | (8 << 4));
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = [0u8; 18];
        assert!(quantize_rows(GgmlType::Q4_0, &[0.0; 31], 31, None, &mut out).is_err());
        assert!(quantize_rows(GgmlType::Q4_0, &[0.0; 32], 32, None, &mut out[..17]).is_err());
        assert!(quantize_rows(GgmlType::Q4_0, &[0.0; 32], 32, Some(&[1.0; 16]), &mut out).is_err());
        assert!(quantize_rows(GgmlType::IQ2_XXS, &[0.0; 256], 256, None, &mut [0u8; 66]).is_err());
    }
}
