//! One `#[repr(C)]` struct per ggml block layout (ggml-common.h field order), each with a
//! compile-time size check, decoded from little-endian bytes with [`Block::read`] — never by
//! casting file bytes, which are neither aligned nor necessarily host-endian.
//!
//! f16 fields hold the raw IEEE binary16 bits (`u16`); convert with [`super::f16_to_f32`].

use crate::{GgmlType, QK_K};

/// A ggml block layout.
pub trait Block: Sized + Copy {
    const TYPE: GgmlType;
    /// Bytes of one block in a file (= `size_of::<Self>()`, checked at compile time).
    const BYTES: usize;
    /// Values one block decodes to.
    const ELEMS: usize;
    /// Decode one block from its `BYTES` little-endian bytes; `None` if `bytes` has another length.
    fn read(bytes: &[u8]) -> Option<Self>;
    /// Encode the block into its `BYTES` little-endian bytes (the quantizers' output path).
    /// `out` must be exactly `BYTES` long; a slice of another length is left untouched and
    /// `false` returned.
    fn write(&self, out: &mut [u8]) -> bool;
}

/// A field type with a fixed little-endian encoding.
trait LeField: Sized {
    const SIZE: usize;
    /// `b` is exactly `SIZE` bytes.
    fn from_le(b: &[u8]) -> Self;
    /// `b` is exactly `SIZE` bytes.
    fn put_le(&self, b: &mut [u8]);
}

impl LeField for u8 {
    const SIZE: usize = 1;
    fn from_le(b: &[u8]) -> Self {
        b[0]
    }
    fn put_le(&self, b: &mut [u8]) {
        b[0] = *self;
    }
}

impl LeField for u16 {
    const SIZE: usize = 2;
    fn from_le(b: &[u8]) -> Self {
        u16::from_le_bytes([b[0], b[1]])
    }
    fn put_le(&self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_le_bytes());
    }
}

impl LeField for f32 {
    const SIZE: usize = 4;
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn put_le(&self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_le_bytes());
    }
}

impl LeField for i8 {
    const SIZE: usize = 1;
    fn from_le(b: &[u8]) -> Self {
        b[0] as i8
    }
    fn put_le(&self, b: &mut [u8]) {
        b[0] = *self as u8;
    }
}

impl LeField for i16 {
    const SIZE: usize = 2;
    fn from_le(b: &[u8]) -> Self {
        i16::from_le_bytes([b[0], b[1]])
    }
    fn put_le(&self, b: &mut [u8]) {
        b.copy_from_slice(&self.to_le_bytes());
    }
}

impl<T: LeField + Copy + Default, const N: usize> LeField for [T; N] {
    const SIZE: usize = T::SIZE * N;
    fn from_le(b: &[u8]) -> Self {
        let mut out = [T::default(); N];
        for (o, c) in out.iter_mut().zip(b.chunks_exact(T::SIZE)) {
            *o = T::from_le(c);
        }
        out
    }
    fn put_le(&self, b: &mut [u8]) {
        for (v, c) in self.iter().zip(b.chunks_exact_mut(T::SIZE)) {
            v.put_le(c);
        }
    }
}

macro_rules! block {
    ($(#[$meta:meta])* $name:ident: $ty:ident, $bytes:literal bytes, $elems:expr,
     { $($(#[$fmeta:meta])* $field:ident: $fty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[allow(non_camel_case_types)]
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $fty,)*
        }

        const _: () = assert!(std::mem::size_of::<$name>() == $bytes);
        // The fields tile the block exactly: no padding sneaks in between them.
        const _: () = assert!(0 $(+ <$fty as LeField>::SIZE)* == $bytes);

        impl Block for $name {
            const TYPE: GgmlType = GgmlType::$ty;
            const BYTES: usize = $bytes;
            const ELEMS: usize = $elems;

            fn read(bytes: &[u8]) -> Option<Self> {
                if bytes.len() != $bytes {
                    return None;
                }
                let mut at = 0usize;
                $(
                    let $field = <$fty as LeField>::from_le(&bytes[at..at + <$fty as LeField>::SIZE]);
                    at += <$fty as LeField>::SIZE;
                )*
                debug_assert_eq!(at, $bytes);
                Some(Self { $($field),* })
            }

            fn write(&self, out: &mut [u8]) -> bool {
                if out.len() != $bytes {
                    return false;
                }
                let mut at = 0usize;
                $(
                    self.$field.put_le(&mut out[at..at + <$fty as LeField>::SIZE]);
                    at += <$fty as LeField>::SIZE;
                )*
                debug_assert_eq!(at, $bytes);
                true
            }
        }
    };
}

block!(
    /// `x = d * (q - 8)`, nibbles: low = element j, high = element j + 16.
    BlockQ4_0: Q4_0, 18 bytes, 32, { d: u16, qs: [u8; 16] });
block!(
    /// `x = d * q + m`.
    BlockQ4_1: Q4_1, 20 bytes, 32, { d: u16, m: u16, qs: [u8; 16] });
block!(
    /// `x = d * (q - 16)`, bit e of `qh` (u32 LE) is the fifth bit of element e.
    BlockQ5_0: Q5_0, 22 bytes, 32, { d: u16, qh: [u8; 4], qs: [u8; 16] });
block!(
    /// `x = d * q + m`, 5-bit q as in Q5_0.
    BlockQ5_1: Q5_1, 24 bytes, 32, { d: u16, m: u16, qh: [u8; 4], qs: [u8; 16] });
block!(
    /// `x = d * q`.
    BlockQ8_0: Q8_0, 34 bytes, 32, { d: u16, qs: [i8; 32] });
block!(
    /// ggml's activation block (36 bytes; gguf-py's table says 40): `s = d * sum(q)`.
    BlockQ8_1: Q8_1, 36 bytes, 32, { d: u16, s: u16, qs: [i8; 32] });
block!(
    /// 16 sub-blocks of 16 with 4-bit scale (low nibble) and min (high nibble).
    BlockQ2K: Q2_K, 84 bytes, QK_K, { scales: [u8; 16], qs: [u8; 64], d: u16, dmin: u16 });
block!(
    /// 16 six-bit signed scales packed in 12 bytes; `hmask` holds the third bit.
    BlockQ3K: Q3_K, 110 bytes, QK_K, { hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: u16 });
block!(
    /// 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes.
    BlockQ4K: Q4_K, 144 bytes, QK_K, { d: u16, dmin: u16, scales: [u8; 12], qs: [u8; 128] });
block!(
    /// Q4_K plus one high bit per element in `qh`.
    BlockQ5K: Q5_K, 176 bytes, QK_K, { d: u16, dmin: u16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128] });
block!(
    /// 6-bit quants (4 low bits in `ql`, 2 high in `qh`) with 16 signed 8-bit scales.
    BlockQ6K: Q6_K, 210 bytes, QK_K, { ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: u16 });
block!(
    /// Activation block of the K-quant dot products: f32 scale, `bsums` = sums of 16 quants.
    BlockQ8K: Q8_K, 292 bytes, QK_K, { d: f32, qs: [i8; 256], bsums: [i16; 16] });
block!(
    /// 8 groups of 32: per group two u32 LE (4 grid indices; 4 sign indices + 4-bit scale).
    BlockIq2Xxs: IQ2_XXS, 66 bytes, QK_K, { d: u16, qs: [u16; 32] });
block!(
    /// Each u16: 9-bit grid index and 7-bit sign index; 4-bit scales per 16 elements.
    BlockIq2Xs: IQ2_XS, 74 bytes, QK_K, { d: u16, qs: [u16; 32], scales: [u8; 8] });
block!(
    /// 10-bit grid indices (low 8 in `qs`, high 2 in `qh`), explicit sign bytes.
    BlockIq2S: IQ2_S, 82 bytes, QK_K, { d: u16, qs: [u8; 32], signs: [u8; 32], qh: [u8; 8], scales: [u8; 8] });
block!(
    /// 64 grid indices of 4 elements, then 8 u32 LE with sign indices and 4-bit scales
    /// (ggml stores both in one `qs[96]`).
    BlockIq3Xxs: IQ3_XXS, 98 bytes, QK_K, { d: u16, qs: [u8; 64], scales_signs: [u8; 32] });
block!(
    /// `x = dl * (grid + delta)`; `qh[i]` (u16) carries high index bits, scale and delta sign.
    BlockIq1S: IQ1_S, 50 bytes, QK_K, { d: u16, qs: [u8; 32], qh: [u16; 8] });
block!(
    /// Q4_0 layout with the non-linear IQ4_NL value table.
    BlockIq4Nl: IQ4_NL, 18 bytes, 32, { d: u16, qs: [u8; 16] });
block!(
    /// 9-bit grid indices (high bit in `qh`), explicit sign bytes, 4-bit scales per 32.
    BlockIq3S: IQ3_S, 110 bytes, QK_K, { d: u16, qs: [u8; 64], qh: [u8; 8], signs: [u8; 32], scales: [u8; 4] });
block!(
    /// IQ4_NL values with 6-bit scales per 32 (4 low bits in `scales_l`, 2 high in `scales_h`).
    BlockIq4Xs: IQ4_XS, 136 bytes, QK_K, { d: u16, scales_h: u16, scales_l: [u8; 4], qs: [u8; 128] });
block!(
    /// No separate scale: the f16 super-scale is spread over the top nibbles of `scales`.
    BlockIq1M: IQ1_M, 56 bytes, QK_K, { qs: [u8; 32], qh: [u8; 16], scales: [u8; 8] });
block!(
    /// Ternary, 5 base-3 digits per byte (`qs`, `qh`).
    BlockTq1_0: TQ1_0, 54 bytes, QK_K, { qs: [u8; 48], qh: [u8; 4], d: u16 });
block!(
    /// Ternary, 2 bits per element, `x = d * (q - 1)`.
    BlockTq2_0: TQ2_0, 66 bytes, QK_K, { qs: [u8; 64], d: u16 });
block!(
    /// E8M0 scale `e` and 32 E2M1 values.
    BlockMxfp4: MXFP4, 17 bytes, 32, { e: u8, qs: [u8; 16] });
block!(
    /// Four UE4M3 scales, one per 16 E2M1 values.
    BlockNvfp4: NVFP4, 36 bytes, 64, { d: [u8; 4], qs: [u8; 32] });
block!(
    /// One sign bit per element: `x = bit ? d : -d`.
    BlockQ1_0: Q1_0, 18 bytes, 128, { d: u16, qs: [u8; 16] });

#[cfg(test)]
mod tests {
    use super::*;

    fn check<B: Block>() {
        assert_eq!(B::BYTES, B::TYPE.type_size(), "{}", B::TYPE);
        assert_eq!(B::ELEMS, B::TYPE.block_size(), "{}", B::TYPE);
        assert!(B::read(&vec![0u8; B::BYTES + 1]).is_none());
        assert!(B::read(&vec![0u8; B::BYTES]).is_some());
        // write is the inverse of read on arbitrary bytes.
        let bytes: Vec<u8> = (0..B::BYTES).map(|i| (i * 37 + 11) as u8).collect();
        let b = B::read(&bytes).unwrap_or_else(|| unreachable!());
        let mut back = vec![0u8; B::BYTES];
        assert!(b.write(&mut back));
        assert_eq!(back, bytes, "{}", B::TYPE);
        assert!(!b.write(&mut vec![0u8; B::BYTES - 1]));
    }

    #[test]
    fn layouts_agree_with_the_type_table() {
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ8_1>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
        check::<BlockQ8K>();
        check::<BlockIq2Xxs>();
        check::<BlockIq2Xs>();
        check::<BlockIq2S>();
        check::<BlockIq3Xxs>();
        check::<BlockIq1S>();
        check::<BlockIq4Nl>();
        check::<BlockIq3S>();
        check::<BlockIq4Xs>();
        check::<BlockIq1M>();
        check::<BlockTq1_0>();
        check::<BlockTq2_0>();
        check::<BlockMxfp4>();
        check::<BlockNvfp4>();
        check::<BlockQ1_0>();
    }

    #[test]
    fn fields_are_little_endian() {
        let mut b = [0u8; 292];
        b[..4].copy_from_slice(&1.5f32.to_le_bytes());
        b[4] = 0xff;
        b[260] = 0x34;
        b[261] = 0x12;
        let q = BlockQ8K::read(&b).unwrap_or_else(|| unreachable!());
        assert_eq!(q.d, 1.5);
        assert_eq!(q.qs[0], -1);
        assert_eq!(q.bsums[0], 0x1234);
    }
}
