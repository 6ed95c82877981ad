//! `gguftool bench`: GPU kernel benchmarks against the measured copy bandwidth of the device.
//!
//! Method (device README METHOD.md): device time from CUDA events around a batch of back-to-back
//! launches (what an un-graphed decode step sees), median of several batches after a warm-up;
//! weights rotate through copies whose total exceeds 3x the L2 cache so no launch reads from L2;
//! inputs are random bytes (never zeros). Bandwidth counts the bytes a launch must move at least:
//! the weight bytes for GEMV, input + f32 output for dequantization, read + write for the copy.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use gguf::GgmlType;
use kernels::{AttnShape, Channels, CudaSlice, Gpu, IndexerShape, MatShape};

#[derive(clap::Args)]
pub struct Args {
    /// Run the GPU kernel benchmarks (copy bandwidth, dequantization, GEMV, attention, indexer).
    #[arg(long)]
    gpu: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Fewer types and repetitions (a smoke run).
    #[arg(long)]
    quick: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Decode benchmark: greedy-generate from this GGUF model on the GPU and on the CPU and
    /// report prefill and decode tokens/s (instead of the kernel benchmarks).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens to decode in the decode benchmark.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Backends of the decode benchmark: `both`, `cuda` or `cpu` (the CPU is slow on large models).
    #[arg(long, default_value = "both")]
    backend: String,
    /// Tensor parallelism of the decode benchmark (`--tp N --tp-devices ...`, see docs/TP.md).
    #[command(flatten)]
    tp: super::tp::TpArgs,
    /// Speculative decoding in the decode benchmark (`--draft mtp --draft-n K`).
    #[command(flatten)]
    draft: super::bench_draft::BenchDraftArgs,
}

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
        println!(
            "| {kind:<10} | {what:<44} | {:>10.1} | {:>9.1} | {:>5.0}% |",
            ms * 1e3,
            gbs,
            100.0 * frac
        );
        self.rows.push(serde_json::json!({
            "kind": kind, "what": what, "us": ms * 1e3, "bytes": bytes, "gb_per_s": gbs,
            "fraction_of_copy": frac,
        }));
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    if let Some(model) = &args.model {
        return decode_bench(
            model,
            args.device,
            args.tokens,
            &args.backend,
            args.json.as_deref(),
            &args.tp,
            &args.draft,
        );
    }
    if args.tp.tp != runtime::device::TpSize::Ranks(1) {
        bail!("--tp applies to the decode benchmark (--model)");
    }
    if !args.gpu {
        bail!("nothing to benchmark: pass --gpu (kernel benchmarks) or --model PATH (decode)");
    }
    let g = Gpu::get(args.device).context("opening the CUDA device")?;
    let info = g.info().clone();
    println!(
        "device {}: {} (sm_{}{}, {} SMs, {:.0} GiB, L2 {} MiB)",
        info.ordinal,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        info.total_mem as f64 / (1u64 << 30) as f64,
        info.l2_bytes >> 20
    );
    let mut b = Bench {
        g: g.clone(),
        batches: if args.quick { 3 } else { 7 },
        per_batch: if args.quick { 5 } else { 20 },
        rows: Vec::new(),
        copy_gbs: 0.0,
    };
    println!("| kind       | what                                         | us/launch  | GB/s      | copy  |");
    println!("|------------|----------------------------------------------|------------|-----------|-------|");

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

    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "device": info.name, "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
            "sm_count": info.sm_count, "copy_gb_per_s": b.copy_gbs, "results": b.rows,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Greedy decode from a fixed prompt on CUDA and on the CPU: prefill time and decode tokens/s
/// (host-timed, including the per-step logits copy, after a warm-up sequence).
fn decode_bench(
    path: &std::path::Path,
    device: usize,
    n_tokens: usize,
    backend: &str,
    json: Option<&std::path::Path>,
    tp: &super::tp::TpArgs,
    draft: &super::bench_draft::BenchDraftArgs,
) -> Result<ExitCode> {
    let (use_gpu, use_cpu) = match backend {
        "both" => (true, true),
        "cuda" => (true, false),
        "cpu" => (false, true),
        other => bail!("--backend {other}: expected both, cuda or cpu"),
    };
    use runtime::lm::{LanguageModel, SeqStep};
    use serde_json::json;
    use std::time::Instant;
    let model = std::sync::Arc::new(
        gguf::Model::open(path).with_context(|| format!("opening {}", path.display()))?,
    );
    let prompt: Vec<u32> = (0..32u32).map(|i| 100 + 7 * i).collect();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &x)| {
                if x > b.1 {
                    (i, x)
                } else {
                    b
                }
            })
            .0 as u32
    };
    let run = |m: &dyn LanguageModel| -> Result<(f64, f64, Vec<u32>)> {
        // Warm-up sequence: kernel compilation, cuBLAS handle, first allocations.
        {
            let mut w = m.new_sequence();
            m.forward(&mut [SeqStep {
                seq: w.as_mut(),
                tokens: &prompt,
                all_logits: false,
            }])?;
            m.forward(&mut [SeqStep {
                seq: w.as_mut(),
                tokens: &prompt[..1],
                all_logits: false,
            }])?;
        }
        let mut seq = m.new_sequence();
        let t0 = Instant::now();
        let logits = m.forward(&mut [SeqStep {
            seq: seq.as_mut(),
            tokens: &prompt,
            all_logits: false,
        }])?;
        let prefill = t0.elapsed().as_secs_f64();
        let mut next = argmax(&logits[0]);
        let mut out = vec![next];
        // One warm-up step, then the timed ones.
        let l = m.forward(&mut [SeqStep {
            seq: seq.as_mut(),
            tokens: &[next],
            all_logits: false,
        }])?;
        next = argmax(&l[0]);
        out.push(next);
        let t1 = Instant::now();
        for _ in 0..n_tokens {
            let l = m.forward(&mut [SeqStep {
                seq: seq.as_mut(),
                tokens: &[next],
                all_logits: false,
            }])?;
            next = argmax(&l[0]);
            out.push(next);
        }
        let decode = t1.elapsed().as_secs_f64();
        Ok((prompt.len() as f64 / prefill, n_tokens as f64 / decode, out))
    };
    println!(
        "model {} ({} prompt tokens, {n_tokens} decode tokens)",
        path.display(),
        prompt.len()
    );
    println!("| backend | prefill tok/s | decode tok/s |");
    println!("|---------|---------------|--------------|");
    let mut doc = serde_json::json!({
        "model": path.display().to_string(), "prompt_tokens": prompt.len(), "decode_tokens": n_tokens,
    });
    let mut outs = Vec::new();
    let split = tp.tp != runtime::device::TpSize::Ranks(1);
    if use_gpu && split {
        let dev = runtime::device::Device::Cuda(device);
        let l = super::tp::load(model.clone(), tp.options(dev)?, true)?;
        let r = l.tp.clone().context("tensor-parallel report")?;
        let name = format!(
            "{} ranks on {} ({})",
            r.world,
            r.ranks
                .iter()
                .map(|x| x.device.as_str())
                .collect::<Vec<_>>()
                .join(","),
            r.comm
        );
        let (p, d, t) = run(l.lm.as_ref())?;
        println!("| cuda {name} | {p:.0} | {d:.1} |");
        doc["cuda"] = serde_json::json!({"device": name, "tp": r.world, "prefill_tok_s": p, "decode_tok_s": d});
        doc["cuda"]["draft"] = json!(super::bench_draft::run(
            draft,
            l.lm.as_ref(),
            &prompt,
            n_tokens,
            d
        )?);
        outs.push(t);
    } else if use_gpu {
        let gpu = runtime::cuda::load_cuda(model.clone(), device)?;
        let name = gpu.backend().gpu().info().name.clone();
        let (p, d, t) = run(&gpu)?;
        println!("| cuda:{device} {name} | {p:.0} | {d:.1} |");
        doc["cuda"] = serde_json::json!({"device": name, "prefill_tok_s": p, "decode_tok_s": d});
        doc["cuda"]["draft"] = json!(super::bench_draft::run(draft, &gpu, &prompt, n_tokens, d)?);
        outs.push(t);
    }
    if use_cpu && split {
        let l = super::tp::load(model, tp.options(runtime::device::Device::Cpu)?, true)?;
        let world = l.tp.as_ref().map_or(1, |r| r.world);
        let (p, d, t) = run(l.lm.as_ref())?;
        println!("| cpu {world} ranks | {p:.0} | {d:.1} |");
        doc["cpu"] = serde_json::json!({"tp": world, "prefill_tok_s": p, "decode_tok_s": d});
        doc["cpu"]["draft"] = json!(super::bench_draft::run(
            draft,
            l.lm.as_ref(),
            &prompt,
            n_tokens,
            d
        )?);
        outs.push(t);
    } else if use_cpu {
        let cpu = runtime::glm::load_cpu(model)?;
        let (p, d, t) = run(&cpu)?;
        println!(
            "| cpu ({} threads) | {p:.0} | {d:.1} |",
            rayon::current_num_threads()
        );
        doc["cpu"] = serde_json::json!({"threads": rayon::current_num_threads(), "prefill_tok_s": p, "decode_tok_s": d});
        doc["cpu"]["draft"] = json!(super::bench_draft::run(draft, &cpu, &prompt, n_tokens, d)?);
        outs.push(t);
    }
    if let [g, c] = outs.as_slice() {
        let same = g.iter().zip(c).take_while(|(a, b)| a == b).count();
        println!("greedy tokens identical: {same}/{}", g.len().min(c.len()));
        doc["greedy_identical"] = serde_json::json!(same);
    }
    if let Some(p) = json {
        std::fs::write(p, serde_json::to_vec_pretty(&doc)?)?;
    }
    Ok(ExitCode::SUCCESS)
}
