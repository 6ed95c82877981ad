//! Dequantization and fused statistics throughput, in bytes of quantized input per second, for
//! the types GLM-5 files are made of. Run: `cargo bench -p gguf --bench dequant`.
//!
//! Inputs are synthetic blocks with realistic f16 scales (|d| ~ 1e-3) and random quant bits:
//! the kernels' speed does not depend on the values, but a random f16 scale would often be
//! NaN/Inf and send the statistics down their rare non-finite path.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gguf::quant::{dequantize, dequantize_row, f32_to_f16};
use gguf::stats::tensor_stats;
use gguf::GgmlType;
use std::hint::black_box;
use std::time::Duration;

/// xorshift64* bytes.
fn random_bytes(n: usize, mut s: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Byte offsets of each block's f16 scale fields.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q8_0 | GgmlType::Q5_0 | GgmlType::IQ4_XS => &[0],
        _ => &[],
    }
}

fn tensor(ty: GgmlType, n_bytes: usize) -> Vec<u8> {
    let n_bytes = n_bytes / ty.type_size() * ty.type_size();
    let mut data = random_bytes(n_bytes, 0x5eed ^ ty.id() as u64);
    let d = f32_to_f16(1e-3).to_le_bytes();
    match ty {
        GgmlType::BF16 => {
            // Weights around +-0.05: exponent bits of 0.05 with random sign/mantissa.
            for v in data.chunks_exact_mut(2) {
                v[1] = 0x3d | (v[1] & 0x80);
            }
        }
        _ => {
            for block in data.chunks_exact_mut(ty.type_size()) {
                for &at in f16_fields(ty) {
                    block[at..at + 2].copy_from_slice(&d);
                }
            }
        }
    }
    data
}

const TYPES: [GgmlType; 6] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::BF16,
    GgmlType::IQ4_XS,
];

fn bench(c: &mut Criterion) {
    // 32 MiB per tensor: several parallel tasks per core, far larger than the caches.
    let size = 32 << 20;
    let mut group = c.benchmark_group("stats");
    for ty in TYPES {
        let data = tensor(ty, size);
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(ty), &data, |b, data| {
            b.iter(|| tensor_stats(ty, black_box(data)))
        });
    }
    group.finish();

    let mut group = c.benchmark_group("dequantize");
    for ty in TYPES {
        let data = tensor(ty, size / 4);
        let mut out = vec![0.0f32; data.len() / ty.type_size() * ty.block_size()];
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(ty), &data, |b, data| {
            b.iter(|| dequantize(ty, black_box(data), &mut out))
        });
    }
    group.finish();

    // One thread, cache-resident: the per-core kernel speed.
    let mut group = c.benchmark_group("dequantize_row_1thread");
    for ty in TYPES {
        let data = tensor(ty, 64 << 10);
        let mut out = vec![0.0f32; data.len() / ty.type_size() * ty.block_size()];
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(ty), &data, |b, data| {
            b.iter(|| dequantize_row(ty, black_box(data), &mut out))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    // The build machine has 2 shared cores: short runs.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
