//! Lossless device layout for the weight types whose GGUF blocks are not 16-byte aligned
//! (Q4_0 18 B, Q4_1 20 B, Q5_0 22 B, Q5_1 24 B, Q8_0 34 B, IQ4_NL 18 B, Q6_K 210 B): the same
//! bytes, permuted into one region per block field (quants first), so every lane of a GEMV loads
//! its 32 weights with one 16-byte load (gpu-kernels.md §1.3.2). Block g's field f lies at
//! `nblk * (bytes of the fields before f) + g * len(f)`; `kernels/cuda/quant.cuh` (`dec_chunk`)
//! and `gemvq.cu` read exactly this. The permutation needs no arithmetic, so it is exact;
//! [`unpack`] is its inverse.

use gguf::GgmlType;

/// The fields of one GGUF block, `(offset in the block, length)`, in device region order.
fn fields(ty: GgmlType) -> Option<&'static [(usize, usize)]> {
    use GgmlType::*;
    Some(match ty {
        Q4_0 | IQ4_NL => &[(2, 16), (0, 2)],
        Q4_1 => &[(4, 16), (0, 2), (2, 2)],
        Q5_0 => &[(6, 16), (2, 4), (0, 2)],
        Q5_1 => &[(8, 16), (4, 4), (0, 2), (2, 2)],
        Q8_0 => &[(2, 32), (0, 2)],
        Q6_K => &[(0, 192), (192, 16), (208, 2)],
        _ => return None,
    })
}

/// Whether tensors of `ty` are stored repacked on the device.
pub fn is_packed(ty: GgmlType) -> bool {
    fields(ty).is_some()
}

/// GGUF blocks of `ty` -> the device layout (same length). `None` when `ty` is stored as is or
/// `bytes` is not a whole number of blocks.
pub fn repack(ty: GgmlType, bytes: &[u8]) -> Option<Vec<u8>> {
    permute(ty, bytes, true)
}

/// The device layout -> GGUF blocks (the inverse of [`repack`]).
pub fn unpack(ty: GgmlType, bytes: &[u8]) -> Option<Vec<u8>> {
    permute(ty, bytes, false)
}

fn permute(ty: GgmlType, bytes: &[u8], forward: bool) -> Option<Vec<u8>> {
    let f = fields(ty)?;
    let bs = ty.type_size();
    if !bytes.len().is_multiple_of(bs) {
        return None;
    }
    let n = bytes.len() / bs;
    let mut out = vec![0u8; bytes.len()];
    let mut region = 0usize;
    for &(off, len) in f {
        for g in 0..n {
            let (blk, dev) = (g * bs + off, region + g * len);
            if forward {
                out[dev..dev + len].copy_from_slice(&bytes[blk..blk + len]);
            } else {
                out[blk..blk + len].copy_from_slice(&bytes[dev..dev + len]);
            }
        }
        region += n * len;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_cover_each_block_exactly_once() {
        for ty in GgmlType::ALL {
            let Some(f) = fields(ty) else { continue };
            let mut seen = vec![0u8; ty.type_size()];
            for &(off, len) in f {
                for b in &mut seen[off..off + len] {
                    *b += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{ty}: {seen:?}");
            // The quant field comes first and is a multiple of 16 bytes per block, so every
            // block's quants start on a 16-byte boundary.
            assert_eq!(f[0].1 % 16, 0, "{ty}");
        }
    }

    #[test]
    fn round_trip_is_identity() {
        let mut s = 0x1234_5678_9abc_def0u64;
        for ty in GgmlType::ALL.iter().copied().filter(|&t| is_packed(t)) {
            let bytes: Vec<u8> = (0..ty.type_size() * 37)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s as u8
                })
                .collect();
            let r = repack(ty, &bytes).unwrap();
            assert_eq!(r.len(), bytes.len());
            assert_ne!(r, bytes, "{ty}: a permutation that moves nothing");
            assert_eq!(unpack(ty, &r).unwrap(), bytes, "{ty}");
        }
        assert!(repack(GgmlType::Q4_K, &[0u8; 144]).is_none());
        assert!(repack(GgmlType::Q8_0, &[0u8; 35]).is_none());
    }
}
