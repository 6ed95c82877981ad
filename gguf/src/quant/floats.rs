//! Scalar float encodings used inside blocks: IEEE f16, bf16, OCP E8M0 and the UE4M3 of NVFP4.

/// IEEE binary16 bits to f32; exact for every input, NaN payloads kept (as numpy does).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: man * 2^-24; renormalise so the leading one becomes implicit.
            let top = 31 - man.leading_zeros(); // position of the leading one, 0..=9
            let exp32 = top + 127 - 24;
            sign | (exp32 << 23) | ((man << (23 - top)) & 0x7f_ffff)
        }
        (31, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Branch-free form of [`f16_to_f32`] (same results for all 65536 inputs) so that bulk loops
/// vectorise: subnormals are produced by an exact float subtraction instead of a bit scan.
#[inline(always)]
pub(crate) fn f16_to_f32_fast(h: u16) -> f32 {
    let h = u32::from(h);
    let magnitude = (h & 0x7fff) << 13;
    let exp = magnitude & 0x0f80_0000;
    let rebiased = magnitude + ((127 - 15) << 23);
    let inf_nan = rebiased + ((128 - 16) << 23);
    // For subnormal inputs, bias the exponent one up and subtract 2^-14: exact in f32.
    let sub = f32::from_bits(rebiased + (1 << 23)) - f32::from_bits(113 << 23);
    let normal = if exp == 0x0f80_0000 {
        inf_nan
    } else {
        rebiased
    };
    let bits = if exp == 0 { sub.to_bits() } else { normal };
    f32::from_bits(bits | ((h & 0x8000) << 16))
}

/// Reads a little-endian f16 at `at`.
#[inline(always)]
pub(crate) fn f16_le(b: &[u8], at: usize) -> f32 {
    f16_to_f32_fast(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// bfloat16 bits to f32: the upper half of the f32 bit pattern.
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 to IEEE binary16 bits, round to nearest even (ggml's `GGML_FP32_TO_FP16`).
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// OCP E8M0 scale to f32, halved (ggml's `GGML_E8M0_TO_FP32_HALF`): MXFP4's value table is
/// stored doubled. e = 0 and 1 give subnormals; e = 255 gives 2^127 (ggml has no NaN here).
#[inline(always)]
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let e = u32::from(e);
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits((e - 1) << 23)
    }
}

/// NVFP4's unsigned E4M3 scale (bias 7, no sign) to f32, halved for the doubled value table.
/// 0x00 and 0x7F decode to 0; bit 7 is ignored, as in gguf-py.
#[inline(always)]
pub(crate) fn ue4m3_to_f32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let exp = i32::from((x >> 3) & 0xf);
    let man = f32::from(x & 7);
    let raw = if exp == 0 {
        man * pow2(-9)
    } else {
        (1.0 + man / 8.0) * pow2(exp - 7)
    };
    raw * 0.5
}

/// 2^k for normal-range k.
#[inline(always)]
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_matches_the_half_crate_for_every_pattern() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let fast = f16_to_f32_fast(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan() && fast.is_nan(), "{h:#06x}");
                // Payload and sign are kept bit for bit (numpy's behaviour).
                assert_eq!(ours.to_bits() & !0x0040_0000, fast.to_bits() & !0x0040_0000);
                assert_eq!(ours.to_bits(), fast.to_bits(), "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
                assert_eq!(fast.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn e8m0_is_two_to_the_e_minus_128() {
        for e in 0..=254u8 {
            let want = 2f64.powi(i32::from(e) - 128);
            assert_eq!(f64::from(e8m0_to_f32_half(e)), want, "e={e}");
        }
        assert_eq!(e8m0_to_f32_half(255), 2f32.powi(127));
    }

    #[test]
    fn ue4m3_known_values() {
        // (1 + 0/8) * 2^0 * 0.5
        assert_eq!(ue4m3_to_f32_half(0x38), 0.5);
        // largest: exp 15, man 6 -> 1.75 * 2^8 = 448, halved
        assert_eq!(ue4m3_to_f32_half(0x7e), 224.0);
        // smallest subnormal: 1 * 2^-9, halved
        assert_eq!(ue4m3_to_f32_half(0x01), 2f32.powi(-10));
        assert_eq!(ue4m3_to_f32_half(0x7f), 0.0);
        assert_eq!(ue4m3_to_f32_half(0x00), 0.0);
    }
}
