//! Element conversions between the float storage types, and the lossless-narrowing tests the
//! safetensors export relies on ("bf16 only where that loses nothing").

use half::{bf16, f16};

/// Decodes little-endian F32/BF16/F16 bytes to f32 (exact: both 16-bit formats embed in f32).
pub fn to_f32(dtype: &str, raw: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        "F32" => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        "BF16" => raw
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        "F16" => raw
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => return None,
    })
}

/// Whether every value survives f32 -> bf16 -> f32 bit for bit (NaN payloads included).
pub fn fits_bf16(v: &[f32]) -> bool {
    v.iter().all(|x| x.to_bits() & 0xffff == 0)
}

/// Whether every value survives f32 -> f16 -> f32 bit for bit.
pub fn fits_f16(v: &[f32]) -> bool {
    v.iter()
        .all(|x| f16::from_f32(*x).to_f32().to_bits() == x.to_bits())
}

/// f32 values as little-endian bf16 bytes: the exact truncation where the low 16 bits are zero
/// (what [`fits_bf16`] checks), else rounded to nearest even with NaNs quiet (gguf-py's rule, used
/// by the lossy `bf16-round` export).
pub fn f32_to_bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| {
            let b = x.to_bits();
            let h = if b & 0xffff == 0 {
                (b >> 16) as u16
            } else {
                crate::import::f32_to_bf16(*x)
            };
            h.to_le_bytes()
        })
        .collect()
}

/// f32 values as little-endian f16 bytes.
pub fn f32_to_f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian u16 words of a byte buffer (raw bf16/f16 elements).
pub fn u16_words(raw: &[u8]) -> Vec<u16> {
    raw.chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// u16 words back to little-endian bytes.
pub fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_tests() {
        assert!(fits_bf16(&[1.0, -2.5, 0.0, f32::INFINITY]));
        assert!(!fits_bf16(&[1.0 + f32::EPSILON]));
        assert!(fits_f16(&[1.0, 0.5, 65504.0]));
        assert!(!fits_f16(&[1e-9, 70000.0]));
        let v = [1.5f32, -0.125];
        assert_eq!(to_f32("BF16", &f32_to_bf16_bytes(&v)).unwrap(), v);
        assert_eq!(to_f32("F16", &f32_to_f16_bytes(&v)).unwrap(), v);
        assert_eq!(to_f32("F32", &f32_bytes(&v)).unwrap(), v);
        assert!(to_f32("I8", &[1]).is_none());
    }
}
