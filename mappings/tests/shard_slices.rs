//! A rank's share of a tensor, read through `shard::slice` byte ranges, dequantizes to exactly the
//! corresponding sub-array of the dequantized whole tensor, for every axis and the quant formats
//! the runtime shards (float, 32-element legacy blocks, 256-element K-quant super-blocks).

use gguf::GgmlType;
use mappings::shard::{even_part, slice};
use mappings::MappingError;

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect()
}

/// Dequantize `rows` rows of `ne0` elements.
fn dequant(ty: GgmlType, bytes: &[u8], ne0: usize) -> Vec<f32> {
    let rb = ty.row_bytes(ne0 as u64).unwrap() as usize;
    assert_eq!(bytes.len() % rb, 0);
    let mut out = vec![0f32; bytes.len() / rb * ne0];
    for (o, r) in out.chunks_mut(ne0).zip(bytes.chunks(rb)) {
        match ty {
            GgmlType::F32 => {
                for (v, b) in o.iter_mut().zip(r.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            GgmlType::F16 => {
                for (v, b) in o.iter_mut().zip(r.chunks_exact(2)) {
                    *v = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            GgmlType::BF16 => {
                for (v, b) in o.iter_mut().zip(r.chunks_exact(2)) {
                    *v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            _ => gguf::quant::dequantize_row(ty, r, o).unwrap(),
        }
    }
    out
}

#[test]
fn every_share_dequantizes_to_its_slice_of_the_whole_tensor() {
    use GgmlType::*;
    let mut checked = 0;
    for (ti, ty) in [F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K]
        .into_iter()
        .enumerate()
    {
        let ne = [ty.block_size() as u64 * 4, 6, 4];
        let n_rows = (ne[1] * ne[2]) as usize;
        let data = random_bytes(
            ty.row_bytes(ne[0]).unwrap() as usize * n_rows,
            ti as u64 + 7,
        );
        let full = dequant(ty, &data, ne[0] as usize);
        let at = |i: [u64; 3]| full[(i[0] + ne[0] * (i[1] + ne[1] * i[2])) as usize];
        for axis in 0..3 {
            for world in [2u64, 4] {
                for rank in 0..world {
                    let Some(range) = even_part(ne[axis], world, rank) else {
                        continue;
                    };
                    let s = slice(ty, &ne, axis, range.clone()).unwrap();
                    assert_eq!(s.n_bytes() * world, data.len() as u64, "{ty} axis {axis}");
                    let part = dequant(ty, &s.gather(&data).unwrap(), s.ne[0] as usize);
                    let mut k = 0;
                    for i2 in 0..s.ne[2] {
                        for i1 in 0..s.ne[1] {
                            for i0 in 0..s.ne[0] {
                                let mut idx = [i0, i1, i2];
                                idx[axis] += range.start;
                                // NaN patterns from random scale bytes compare by bits.
                                assert_eq!(
                                    part[k].to_bits(),
                                    at(idx).to_bits(),
                                    "{ty} axis {axis} rank {rank}/{world} at {idx:?}"
                                );
                                k += 1;
                            }
                        }
                    }
                    assert_eq!(k, part.len());
                    checked += 1;
                }
            }
        }
        // Half a block per rank along the rows cannot be read from the file as such.
        let cut = slice(ty, &ne, 0, 0..ty.block_size() as u64 / 2);
        if ty.block_size() > 1 {
            assert!(
                matches!(cut, Err(MappingError::SplitCutsBlock { .. })),
                "{ty}"
            );
        }
    }
    // 9 types x (3 axes x (2 + 4) ranks), except axis 1 (6 rows) at world 4.
    assert_eq!(checked, 9 * (6 + 2 + 6));
}
