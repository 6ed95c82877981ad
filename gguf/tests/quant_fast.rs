//! The fast dequantizers (parallel, row-wise, vectorised) against the scalar reference on random
//! block bytes of every type: bit-identical results, NaN only matching NaN. Random bytes include
//! Inf/NaN/subnormal scales, so this also covers the inputs the golden data leaves out.

use gguf::quant::{dequantize, dequantize_row, dequantize_to_vec, reference};
use gguf::GgmlType;

/// xorshift64*: deterministic, dependency-free test bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 56) as u8).collect()
    }
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn check(ty: GgmlType, data: &[u8]) {
    let want = {
        let mut v = vec![0.0f32; data.len() / ty.type_size() * ty.block_size()];
        reference::dequantize(ty, data, &mut v).unwrap_or_else(|e| panic!("{e}"));
        v
    };
    let fast = dequantize_to_vec(ty, data).unwrap_or_else(|e| panic!("{e}"));
    let mut row = vec![f32::NAN; want.len()];
    dequantize_row(ty, data, &mut row).unwrap_or_else(|e| panic!("{e}"));
    for (i, ((w, f), r)) in want.iter().zip(&fast).zip(&row).enumerate() {
        assert!(
            same(*w, *f),
            "{ty}: element {i}: fast {f:e}, reference {w:e}"
        );
        assert!(
            same(*w, *r),
            "{ty}: element {i}: row {r:e}, reference {w:e}"
        );
    }
}

#[test]
fn fast_equals_reference_on_random_blocks_of_every_type() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in GgmlType::ALL {
        for n_blocks in [1usize, 3, 17] {
            let data = rng.bytes(n_blocks * ty.type_size());
            check(ty, &data);
        }
    }
}

#[test]
fn fast_equals_reference_across_parallel_task_boundaries() {
    // More than one rayon task (65536 values each) with a partial last task.
    let mut rng = Rng(42);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::BF16,
        GgmlType::F16,
        GgmlType::F32,
        GgmlType::IQ4_XS,
        GgmlType::Q5_0,
        GgmlType::IQ2_XXS,
    ] {
        let n_elems = 3 * 65536 + 5 * 256;
        let data = rng.bytes(n_elems / ty.block_size() * ty.type_size());
        check(ty, &data);
    }
}

#[test]
fn output_buffer_is_fully_written() {
    // A fast path that skipped a tail would leave the sentinel in place.
    let mut rng = Rng(7);
    for ty in GgmlType::ALL {
        for n_blocks in [1usize, 5, 33] {
            let data = rng.bytes(n_blocks * ty.type_size());
            let n = n_blocks * ty.block_size();
            let mut out = vec![f32::from_bits(0x7fc0_1234); n];
            dequantize(ty, &data, &mut out).unwrap_or_else(|e| panic!("{e}"));
            let mut want = vec![0.0f32; n];
            reference::dequantize(ty, &data, &mut want).unwrap_or_else(|e| panic!("{e}"));
            for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                assert!(same(*o, *w), "{ty} element {i}");
            }
        }
    }
}
