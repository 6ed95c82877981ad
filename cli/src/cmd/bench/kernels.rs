//! `gguftool bench --kernels`: GPU kernel microbenchmarks against the copy bandwidth measured in
//! the same run.
//!
//! Method (device README METHOD.md): device time from CUDA events around a batch of back-to-back
//! launches (what an un-graphed decode step sees), median of several batches after a warm-up;
//! weights rotate through copies whose total exceeds 3x the L2 cache so no launch reads from L2;
//! inputs are random bytes (never zeros). Bandwidth counts the bytes a launch must move at least:
//! the weight bytes for GEMV, input + f32 output for dequantization, read + write for the copy.

use std::process::ExitCode;

use anyhow::{Context, Result};
use gguf::GgmlType;
use kernels::{AttnShape, Channels, CudaSlice, Gpu, IndexerShape, MatShape};

struct Bench {
    g: std::sync::Arc<Gpu>,
    batches: usize,
    per_batch: usize,
    rows: Vec<serde_json::Value>,
    copy_gbs: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Random bytes, fast (xorshift64 per 8 bytes); content only needs to be non-trivial.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(n);
    out
}

impl Bench {
    /// Median per-launch milliseconds of `f(i)` run `per_batch` times back to back.
    fn time(&self, mut f: impl FnMut(usize) -> Result<(), kernels::KernelError>) -> Result<f64> {
        let mut i = 0usize;
        // Warm-up: module load and compilation, then >= 100 ms of the same launches so the SM
        // clock has ramped up (it idles near 345 MHz and boosts to ~1980 MHz under load).
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(100) {
            for _ in 0..10 {
                f(i)?;
                i += 1;
            }
            self.g.synchronize()?;
        }
        let mut samples = Vec::with_capacity(self.batches);
        for _ in 0..self.batches {
            let ms = self.g.time_ms(|| {
                for _ in 0..self.per_batch {
                    f(i)?;
                    i += 1;
                }
                Ok(())
            })?;
            samples.push(f64::from(ms) / self.per_batch as f64);
        }
        Ok(median(samples))
    }

    fn record(&mut self, kind: &str, what: &str, bytes: f64, ms: f64) {
        let gbs = bytes / (ms * 1e-3) / 1e9;
        let frac = if self.copy_gbs > 0.0 {
            gbs / self.copy_gbs
        } else {
            0.0
        };
        say(&format!(
            "| {kind:<10} | {what:<44} | {:>10.1} | {:>9.1} | {:>5.0}% |",
            ms * 1e3,
            gbs,
            100.0 * frac
        ));
        self.rows.push(serde_json::json!({
            "kind": kind, "what": what, "us": ms * 1e3, "bytes": bytes, "gb_per_s": gbs,
            "fraction_of_copy": frac,
        }));
    }
}

pub fn run(args: &super::Args, device: usize) -> Result<ExitCode> {
    let g = Gpu::get(device).context("opening the CUDA device")?;
    let info = g.info().clone();
    say(&format!(
        "device {}: {} (sm_{}{}, {} SMs, {:.0} GiB, L2 {} MiB)",
        info.ordinal,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        info.total_mem as f64 / (1u64 << 30) as f64,
        info.l2_bytes >> 20
    ));
    let mut b = Bench {
        g: g.clone(),
        batches: if args.quick { 3 } else { 7 },
        per_batch: if args.quick { 5 } else { 20 },
        rows: Vec::new(),
        copy_gbs: 0.0,
    };
    say("| kind       | what                                         | us/launch  | GB/s      | copy  |");
    say("|------------|----------------------------------------------|------------|-----------|-------|");

    // 1. Copy bandwidth: the ceiling the others are measured against.
    let copy_bytes: usize = if args.quick { 256 << 20 } else { 2 << 30 };
    let src: CudaSlice<u8> = g.upload(&random_bytes(copy_bytes, 7))?;
    let mut dst: CudaSlice<u8> = g.zeros(copy_bytes)?;
    let ms = b.time(|_| g.copy(&src, &mut dst))?;
    let gbs = 2.0 * copy_bytes as f64 / (ms * 1e-3) / 1e9;
    b.copy_gbs = gbs;
    b.record(
        "copy",
        &format!("device-to-device {} MiB (read+write)", copy_bytes >> 20),
        2.0 * copy_bytes as f64,
        ms,
    );
    drop((src, dst));

    let l2: usize = (info.l2_bytes as usize).max(32 << 20);
    let types: Vec<GgmlType> = if args.quick {
        vec![GgmlType::Q4_K, GgmlType::Q8_0]
    } else {
        vec![
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::IQ4_XS,
            GgmlType::IQ4_NL,
            GgmlType::BF16,
            GgmlType::F16,
            GgmlType::F32,
        ]
    };

    // 2. Dequantization of an attn_output-sized matrix (6144 x 16384).
    for &ty in &types {
        let n = 6144usize * 16384;
        let bytes = ty.row_bytes(n as u64).context("size")? as usize;
        let w = g.upload(&random_bytes(bytes, 11))?;
        let mut out: CudaSlice<f32> = g.zeros(n)?;
        let ms = b.time(|_| g.dequantize(ty, &w, &mut out))?;
        b.record(
            "dequant",
            &format!("{ty} 6144x16384 -> f32"),
            (bytes + 4 * n) as f64,
            ms,
        );
    }

    // 3. GEMV at decode shapes, weights rotated through > 3x L2.
    let shapes: [(&str, usize, usize); 3] = [
        ("attn_output 6144x16384", 6144, 16384),
        ("q_a 2048x6144", 2048, 6144),
        ("kv_a 576x6144", 576, 6144),
    ];
    for &ty in &types {
        for (name, rows, k) in shapes {
            let shape = MatShape::new(ty, rows, k);
            let mat = shape.bytes().context("size")?;
            let copies = (3 * l2).div_ceil(mat).max(2);
            let w = g.upload(&random_bytes(mat * copies, 13))?;
            let x = g.upload(&vec![0.5f32; k])?;
            let mut y: CudaSlice<f32> = g.zeros(rows)?;
            let ms = b.time(|i| {
                let c = i % copies;
                let wv = w.slice(c * mat..(c + 1) * mat);
                g.gemv(shape, &wv, &x, &mut y)
            })?;
            b.record("gemv", &format!("{ty} {name}"), mat as f64, ms);
        }
        // MoE: 8 of 32 experts of 2048x6144 (gate_exps shape), one launch with ids.
        let (ne, rows, k, top) = (32usize, 2048usize, 6144usize, 8usize);
        let shape = MatShape {
            ty,
            rows,
            k,
            slabs: ne,
            packed: false,
        };
        let slab = shape.slab_bytes().context("size")?;
        let w = g.upload(&random_bytes(slab * ne, 17))?;
        let x = g.upload(&vec![0.5f32; k])?;
        let mut y: CudaSlice<f32> = g.zeros(top * rows)?;
        let id_sets: Vec<CudaSlice<i32>> = (0..8)
            .map(|s| {
                g.upload(
                    &(0..top)
                        .map(|j| ((s * top + j) % ne) as i32)
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Result<_, _>>()?;
        let ms = b.time(|i| {
            let ids = id_sets[i % id_sets.len()].as_view();
            let ch = Channels {
                count: top,
                ids: Some(&ids),
                x_stride: 0,
                x_div: top,
                y_stride: rows,
            };
            g.gemv_batched(shape, &w, ch, &x, &mut y)
        })?;
        b.record(
            "gemv moe",
            &format!("{ty} 8 of 32 experts 2048x6144"),
            (slab * top) as f64,
            ms,
        );
    }

    // 4. Absorbed MLA decode (64 heads, 576/512, f32 latent cache) and the DSA indexer + top-2048.
    for t_len in [4096usize, 32768] {
        let (heads, d_qk, d_v) = (64usize, 576usize, 512usize);
        let kv = g.upload(&vec![0.01f32; t_len * d_qk])?;
        let q = g.upload(&vec![0.02f32; heads * d_qk])?;
        let pos = g.upload(&[t_len as i32 - 1])?;
        let mut o: CudaSlice<f32> = g.zeros(heads * d_v)?;
        let shape = AttnShape {
            tokens: 1,
            heads,
            kv_heads: 1,
            d_k: d_qk,
            d_v,
            q_tok_stride: heads * d_qk,
            q_head_stride: d_qk,
            k_stride: d_qk,
            v_stride: d_qk,
            kv_len: t_len,
            o_tok_stride: heads * d_v,
            o_head_stride: d_v,
            scale: 1.0 / 16.0,
            pos0: t_len - 1,
        };
        let ms = b.time(|_| g.attention(&q, &kv, &kv, None, &mut o, shape))?;
        b.record(
            "mla",
            &format!("decode dense, 64 heads, T {t_len}"),
            (t_len * d_qk * 4) as f64,
            ms,
        );

        let (ih, id) = (32usize, 128usize);
        let kc = g.upload(
            &random_bytes(t_len * id * 4, 19)
                .chunks_exact(4)
                .map(|c| f32::from(c[0]) / 255.0 - 0.5)
                .collect::<Vec<f32>>(),
        )?;
        let qi = g.upload(&vec![0.03f32; ih * id])?;
        let wi = g.upload(&vec![0.1f32; ih])?;
        let mut sc: CudaSlice<f32> = g.zeros(t_len)?;
        let ish = IndexerShape {
            tokens: 1,
            heads: ih,
            dim: id,
            q_stride: ih * id,
            k_stride: id,
            kv_len: t_len,
            w_stride: ih,
            out_stride: t_len,
            scale: 1.0 / (id as f32).sqrt(),
        };
        let ms = b.time(|_| g.indexer_scores(&qi, &kc, &wi, &pos, &mut sc, ish))?;
        b.record(
            "indexer",
            &format!("scores 32x128, T {t_len}"),
            (t_len * id * 4) as f64,
            ms,
        );
        let mut sel: CudaSlice<i32> = g.zeros(2048)?;
        let ms = b.time(|_| g.topk(&sc, 1, t_len, t_len, 2048, &mut sel, None))?;
        b.record(
            "topk",
            &format!("top-2048 of T {t_len}"),
            (t_len * 4) as f64,
            ms,
        );
    }

    if args.json {
        let doc = serde_json::json!({
            "device": info.name, "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
            "sm_count": info.sm_count, "copy_gb_per_s": b.copy_gbs, "results": b.rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Human-readable lines go to stderr, so `--json` leaves stdout to the JSON document.
fn say(s: &str) {
    eprintln!("{s}");
}
