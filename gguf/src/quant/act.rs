//! Activation quantizers: ggml's reference (`quantize_row_*_ref`) rounding for the 8-bit blocks
//! that quantized dot products consume, as CPU oracles for the matmul kernels.
//!
//! These follow ggml-quants.c's `_ref` functions. ggml's SIMD CPU paths and its CUDA
//! `quantize_q8_1` round differently in corner cases (CUDA divides by d instead of multiplying
//! by 1/d, and stores sum(x) rather than d*sum(q) in `s`), so an oracle for a GPU kernel must say
//! which one it follows.

use super::floats::f32_to_f16;
use super::QuantError;
use crate::{GgmlType, QK_K};

fn check(ty: GgmlType, x: &[f32]) -> Result<(), QuantError> {
    let block_size = ty.block_size();
    if !x.len().is_multiple_of(block_size) {
        return Err(QuantError::PartialRow {
            ty,
            len: x.len(),
            block_size,
        });
    }
    Ok(())
}

/// ggml's `MAX(a, b)`: `a > b ? a : b` (a NaN in `b` wins, one in `a` does not).
fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Scale and rounded quants of one 32-value block: `d = amax / 127`, `q = roundf(x / d)` via
/// the reciprocal, rounding half away from zero (C `roundf`).
fn q8_block(x: &[f32]) -> (f32, [i8; 32]) {
    let amax = x.iter().fold(0.0f32, |m, v| c_max(m, v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; 32];
    for (q, v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    (d, qs)
}

/// Quantize a row to Q8_0 blocks (`quantize_row_q8_0_ref`).
pub fn quantize_row_q8_0(x: &[f32]) -> Result<Vec<u8>, QuantError> {
    check(GgmlType::Q8_0, x)?;
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for block in x.chunks_exact(32) {
        let (d, qs) = q8_block(block);
        out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
        out.extend(qs.iter().map(|&q| q as u8));
    }
    Ok(out)
}

/// Quantize a row to ggml's 36-byte Q8_1 blocks (`quantize_row_q8_1_ref`): as Q8_0 plus
/// `s = f16(d * sum(q))`, computed from the unrounded f32 `d`.
pub fn quantize_row_q8_1(x: &[f32]) -> Result<Vec<u8>, QuantError> {
    check(GgmlType::Q8_1, x)?;
    let mut out = Vec::with_capacity(x.len() / 32 * 36);
    for block in x.chunks_exact(32) {
        let (d, qs) = q8_block(block);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
        out.extend_from_slice(&f32_to_f16(sum as f32 * d).to_le_bytes());
        out.extend(qs.iter().map(|&q| q as u8));
    }
    Ok(out)
}

/// Quantize a row to Q8_K blocks (`quantize_row_q8_K_ref`): the scale comes from the value of
/// largest magnitude (`iscale = -127 / max`, `d = 1 / iscale`), quants round half to even and
/// are clamped to 127, and `bsums` hold the sums of each 16 quants.
pub fn quantize_row_q8_k(x: &[f32]) -> Result<Vec<u8>, QuantError> {
    check(GgmlType::Q8_K, x)?;
    let mut out = Vec::with_capacity(x.len() / QK_K * 292);
    for block in x.chunks_exact(QK_K) {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in block {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut qs = [0i8; QK_K];
        let d = if amax == 0.0 {
            0.0
        } else {
            let iscale = -127.0 / max;
            for (q, &v) in qs.iter_mut().zip(block) {
                // ggml's nearest_int (float magic-number trick) is round-half-even.
                *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
            }
            1.0 / iscale
        };
        out.extend_from_slice(&d.to_le_bytes());
        out.extend(qs.iter().map(|&q| q as u8));
        for group in qs.chunks_exact(16) {
            let s: i32 = group.iter().map(|&q| i32::from(q)).sum();
            out.extend_from_slice(&(s as i16).to_le_bytes());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_to_vec;

    #[test]
    fn q8_0_hand_computed() {
        // amax = 127 -> d = 1 exactly, q = round(x): 2.5 rounds away from zero to 3.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.49;
        let b = quantize_row_q8_0(&x).unwrap_or_default();
        assert_eq!(b.len(), 34);
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x3c00); // f16 1.0
        assert_eq!(&b[2..6], &[127, 3, (-3i8) as u8, 0]);
    }

    #[test]
    fn q8_1_sum_field() {
        // d = 254/127 = 2, q = x/2: {127, 1, -1, 0...}; s = 2 * 127 = 254.
        let mut x = [0.0f32; 32];
        x[0] = 254.0;
        x[1] = 2.0;
        x[2] = -2.0;
        let b = quantize_row_q8_1(&x).unwrap_or_default();
        assert_eq!(b.len(), 36);
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x4000); // 2.0
        assert_eq!(u16::from_le_bytes([b[2], b[3]]), 0x5bf0); // 254.0
        assert_eq!(&b[4..7], &[127, 1, 255]);
        // Dequantizing gives back d * q.
        let y = dequantize_to_vec(GgmlType::Q8_1, &b).unwrap_or_default();
        assert_eq!(&y[..3], &[254.0, 2.0, -2.0]);
    }

    #[test]
    fn q8_k_hand_computed() {
        // max = -127 (largest magnitude, negative) -> iscale = 1, d = 1; 0.5 -> 0 and 1.5 -> 2
        // (ties to even); +127 stays 127.
        let mut x = [0.0f32; 256];
        x[0] = -127.0;
        x[1] = 0.5;
        x[2] = 1.5;
        x[17] = 100.0;
        let b = quantize_row_q8_k(&x).unwrap_or_default();
        assert_eq!(b.len(), 292);
        assert_eq!(f32::from_le_bytes([b[0], b[1], b[2], b[3]]), 1.0);
        assert_eq!(&b[4..7], &[(-127i8) as u8, 0, 2]);
        // bsums[0] = -127 + 0 + 2, bsums[1] = 100
        assert_eq!(i16::from_le_bytes([b[260], b[261]]), -125);
        assert_eq!(i16::from_le_bytes([b[262], b[263]]), 100);
        let y = dequantize_to_vec(GgmlType::Q8_K, &b).unwrap_or_default();
        assert_eq!(&y[..3], &[-127.0, 0.0, 2.0]);
        assert_eq!(y[17], 100.0);
    }

    #[test]
    fn partial_rows_are_errors() {
        assert!(matches!(
            quantize_row_q8_1(&[1.0; 33]),
            Err(QuantError::PartialRow { len: 33, .. })
        ));
        assert!(quantize_row_q8_k(&[1.0; 255]).is_err());
    }
}
