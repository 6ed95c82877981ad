//! `gguftool bench`: prefill and decode speed of a model, like llama-bench (`-p`, `-n`, `-d`, `-r`)
//! and llama-batched-bench (`--npl`, sequences decoded together), on the CPU or a CUDA GPU; with
//! `--kernels` the GPU kernel microbenchmarks instead.
//!
//! Method: for every (test, depth, sequences) the sequences are created and filled to the depth
//! first (untimed, in chunks), then the test is timed on the host clock around the forward calls
//! (which return logits to the host, so every call ends with the device's work done):
//! `pp` = one forward of `n_prompt` tokens per sequence, `tg` = `n_gen` steps of one token per
//! sequence. Rates count the tokens of all sequences. Each configuration runs once untimed at
//! depth 0 first (kernel compilation, allocator warm-up), then `-r` timed repetitions; mean and
//! sample standard deviation as llama-bench reports them. On a GPU, one more profiled run of each
//! test attributes device time to kernel kinds (events around every launch), and the copy
//! bandwidth of the same device is measured in the same run as the ceiling to compare against.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use runtime::device::Device;
use runtime::lm::{LanguageModel, SeqStep, SequenceState};

#[path = "bench/kernels.rs"]
mod kernels_bench;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (any shard of a split model) to benchmark.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Prompt lengths of the prefill (pp) tests, comma-separated; 0 skips them.
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    n_prompt: Vec<usize>,
    /// Generated tokens of the decode (tg) tests, comma-separated; 0 skips them.
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    n_gen: Vec<usize>,
    /// Context depths: the cache is filled to each before the test (e.g. 0,4096,32768).
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    n_depth: Vec<usize>,
    /// Numbers of sequences processed together (batched decode), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    npl: Vec<usize>,
    /// Tensor parallelism (`--tp N --tp-devices ...`, docs/TP.md).
    #[command(flatten)]
    tp: super::tp::TpArgs,
    /// Compute device: auto (a CUDA GPU when present, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, default_value = "auto")]
    device: Device,
    /// Timed repetitions of every test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    repetitions: usize,
    /// Print one JSON array (one record per test, depth and sequence count) on stdout instead
    /// of the table.
    #[arg(long)]
    json: bool,
    /// Skip the profiled run (kernel time by kind) and the copy-bandwidth measurement.
    #[arg(long)]
    no_profile: bool,
    /// Run the GPU kernel microbenchmarks instead of a model (`--gpu` is the old name).
    #[arg(long, alias = "gpu")]
    kernels: bool,
    /// Kernel microbenchmarks: fewer types and repetitions (a smoke run).
    #[arg(long)]
    quick: bool,
    /// Speculative decoding after the tests (`--draft mtp --draft-n K`): greedy decode of the
    /// first `-n` length with drafts against plain decoding from the same prompt.
    #[command(flatten)]
    draft: super::bench_draft::BenchDraftArgs,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.kernels {
        let ordinal = match args.device.resolve() {
            Device::Cuda(i) => i,
            _ => bail!("--kernels needs a CUDA device (none found or --device cpu)"),
        };
        return kernels_bench::run(&args, ordinal);
    }
    let Some(path) = args.model.clone() else {
        bail!("nothing to benchmark: pass -m MODEL (or --kernels for the GPU kernel benchmarks)");
    };
    if args.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    if args.npl.contains(&0) {
        bail!("--npl values must be at least 1");
    }
    let mut tests: Vec<(Test, usize)> = Vec::new();
    tests.extend(
        args.n_prompt
            .iter()
            .filter(|&&p| p > 0)
            .map(|&p| (Test::Pp, p)),
    );
    tests.extend(
        args.n_gen
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| (Test::Tg, n)),
    );
    if tests.is_empty() {
        bail!("no test: every -p and -n value is 0");
    }
    let model =
        Arc::new(gguf::Model::open(&path).with_context(|| format!("opening {}", path.display()))?);
    let spec = runtime::spec::ModelSpec::from_model(&model)?;
    let max_need = args.n_depth.iter().max().copied().unwrap_or(0)
        + tests.iter().map(|t| t.1).max().unwrap_or(0);
    if max_need > spec.n_ctx_train {
        bail!(
            "depth + test length {max_need} exceeds the model's context ({})",
            spec.n_ctx_train
        );
    }
    let weights = WeightBytes::of(&model, &spec);
    let loaded = super::tp::load(model.clone(), args.tp.options(args.device)?, args.json)?;
    let (lm, device) = (loaded.lm, loaded.device);
    let tp_world = loaded.tp.as_ref().map_or(1, |r| r.world);
    let gpu = match device {
        Device::Cuda(i) => Some(kernels::Gpu::get(i)?),
        _ => None,
    };
    let backend = match &gpu {
        Some(g) => format!(
            "{} ({}, sm_{}{})",
            device.name(),
            g.info().name,
            g.info().compute_capability.0,
            g.info().compute_capability.1
        ),
        None => format!("cpu ({} threads)", rayon::current_num_threads()),
    };
    let copy_gbs = if args.no_profile {
        None
    } else {
        Some(match &gpu {
            Some(g) => gpu_copy_gbs(g)?,
            None => host_copy_gbs(),
        })
    };
    let b = Bencher {
        lm: lm.as_ref(),
        vocab: lm.vocab_size(),
        chunk: if gpu.is_some() { 2048 } else { 256 },
        waits: std::cell::Cell::new((0, 0)),
    };
    let model_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let date = utc_date();
    if !args.json {
        println!(
            "model {model_name}: {} of weights, {:.2} B parameters; {backend}; {date}",
            crate::util::human_bytes(weights.total),
            weights.params as f64 / 1e9
        );
        if let Some(c) = copy_gbs {
            println!("copy bandwidth (same run, read+write): {c:.0} GB/s");
        }
        println!("| test | depth | seqs | t/s | weight GB/s | share of copy |");
        println!("|---|---:|---:|---:|---:|---:|");
    }
    let mut records = Vec::new();
    for &npl in &args.npl {
        for &(test, len) in &tests {
            // Warm-up at depth 0: compiles kernels and fills the allocator's pools.
            b.run_once(test, len, 0, npl)?;
            for &depth in &args.n_depth {
                let mut samples = Vec::with_capacity(args.repetitions);
                let (mut wall_ns, mut wait_ns) = (0u64, 0u64);
                for _ in 0..args.repetitions {
                    samples.push(b.run_once(test, len, depth, npl)?);
                    let (w, t) = b.waits.get();
                    wall_ns += w;
                    wait_ns += t;
                }
                // The host's share of the wall time spent building and launching work (not
                // waiting for the device): near 1 means the step is bound by the host, not the
                // GPU. One host thread per rank waits: meaningful at TP 1 only.
                let host_busy = (gpu.is_some() && tp_world == 1 && wall_ns > 0)
                    .then(|| 1.0 - (wait_ns as f64 / wall_ns as f64).min(1.0));
                let (avg, sd) = mean_sd(&samples);
                let kernels = match (&gpu, args.no_profile) {
                    (Some(g), false) => Some(b.profile(g, test, len, depth, npl)?),
                    _ => None,
                };
                // Weight bytes read per second: one read per forward call of what its tokens
                // reach (all sequences of a decode step share it; `npl` prompts of `len` tokens
                // reach the distinct experts of `npl * len` tokens, not every expert: counting
                // them all put pp8 at 190% of the copy bandwidth).
                let tokens_per_call = match test {
                    Test::Tg => npl,
                    Test::Pp => npl * len,
                };
                let wbytes = weights.per_step(tokens_per_call);
                let weight_gbs = wbytes * (avg / tokens_per_call as f64) / 1e9;
                let share = copy_gbs.map(|c| weight_gbs / c);
                let name = format!(
                    "{}{len}{}{}",
                    test.name(),
                    if depth > 0 {
                        format!(" @ d{depth}")
                    } else {
                        String::new()
                    },
                    if npl > 1 {
                        format!(" x{npl}")
                    } else {
                        String::new()
                    }
                );
                if !args.json {
                    println!(
                        "| {}{len} | {depth} | {npl} | {avg:.2} ± {sd:.2} | {weight_gbs:.2} | {} |",
                        test.name(),
                        share.map_or("-".into(), |s| format!("{:.1}%", 100.0 * s))
                    );
                    if let Some(k) = &kernels {
                        println!("|   device time per token: {} |", kernel_line(k, 6));
                    }
                    if let Some(h) = host_busy {
                        println!(
                            "|   host busy (launching, not waiting for the GPU): {:.0}% of the wall time |",
                            100.0 * h
                        );
                    }
                }
                let (n_prompt, n_gen) = match test {
                    Test::Pp => (len, 0),
                    Test::Tg => (0, len),
                };
                records.push(serde_json::json!({
                    "test": test.name(),
                    "name": name,
                    "model": model_name,
                    "model_size": weights.total,
                    "model_n_params": weights.params,
                    "backend": backend,
                    "device": device.name(),
                    "tp": tp_world,
                    "n_prompt": n_prompt,
                    "n_gen": n_gen,
                    "n_depth": depth,
                    "n_seq": npl,
                    "avg_ts": avg,
                    "stddev_ts": sd,
                    "samples_ts": samples,
                    "weight_bytes_per_step": wbytes,
                    "weight_gbs": weight_gbs,
                    "copy_gbs": copy_gbs,
                    "copy_share": share,
                    "kernels": kernels.as_ref().map(kernels_json),
                    "host_busy_share": host_busy,
                    "date": date,
                }));
            }
        }
    }
    if args.draft.draft.draft.is_some() {
        let n = args.n_gen.iter().copied().find(|&n| n > 0).unwrap_or(64);
        let prompt = tokens(
            b.vocab,
            args.n_prompt.first().copied().unwrap_or(0).max(1),
            5,
        );
        // The baseline: plain greedy decoding of the same length right before.
        b.run_once(Test::Tg, n, 0, 1)?;
        let plain = b.run_once(Test::Tg, n, 0, 1)?;
        if let Some(mut d) =
            super::bench_draft::run(&args.draft, b.lm, &prompt, n, plain, !args.json)?
        {
            d["test"] = serde_json::json!("tg-draft");
            d["model"] = serde_json::json!(model_name);
            d["backend"] = serde_json::json!(backend);
            d["device"] = serde_json::json!(device.name());
            d["tp"] = serde_json::json!(tp_world);
            d["n_prompt"] = serde_json::json!(prompt.len());
            d["n_gen"] = serde_json::json!(n);
            d["plain_decode_tok_s"] = serde_json::json!(plain);
            d["date"] = serde_json::json!(date);
            records.push(d);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&records)?);
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Test {
    Pp,
    Tg,
}

impl Test {
    fn name(self) -> &'static str {
        match self {
            Test::Pp => "pp",
            Test::Tg => "tg",
        }
    }
}

struct Bencher<'a> {
    lm: &'a dyn LanguageModel,
    vocab: usize,
    /// Largest prefill chunk when filling the depth (bounds activation memory).
    chunk: usize,
    /// Of the last timed repetition: (wall ns, ns host threads waited for the device).
    waits: std::cell::Cell<(u64, u64)>,
}

/// Deterministic token ids spread over the vocabulary (llama-bench feeds arbitrary tokens too:
/// the speed does not depend on them, except through MoE routing, which random ids exercise).
fn tokens(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    let mut s = (salt as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

impl Bencher<'_> {
    fn step(&self, seqs: &mut [Box<dyn SequenceState>], toks: &[Vec<u32>]) -> Result<()> {
        let mut batch: Vec<SeqStep<'_>> = seqs
            .iter_mut()
            .zip(toks)
            .map(|(s, t)| SeqStep {
                seq: s.as_mut(),
                tokens: t,
                all_logits: false,
            })
            .collect();
        // What `generate` and the server run per step: greedy sampling inside the model (on
        // the GPU only the ids come back).
        let reqs = vec![
            runtime::sampling::SampleRequest {
                params: runtime::sampling::SampleParams::GREEDY,
                u: 0.0,
                logprobs: None,
            };
            batch.len()
        ];
        self.lm.forward_sample(&mut batch, &reqs)?;
        Ok(())
    }

    /// `npl` fresh sequences filled to `depth` (untimed).
    fn filled(&self, depth: usize, npl: usize) -> Result<Vec<Box<dyn SequenceState>>> {
        let mut seqs: Vec<_> = (0..npl).map(|_| self.lm.new_sequence()).collect();
        let mut done = 0;
        while done < depth {
            let n = self.chunk.min(depth - done);
            let toks: Vec<Vec<u32>> = (0..npl)
                .map(|s| tokens(self.vocab, n, 1000 + s * 7919 + done))
                .collect();
            self.step(&mut seqs, &toks)?;
            done += n;
        }
        Ok(seqs)
    }

    /// The timed part of one repetition: tokens per second over all sequences.
    fn timed(&self, seqs: &mut [Box<dyn SequenceState>], test: Test, len: usize) -> Result<f64> {
        let (t0, w0) = (Instant::now(), kernels::host_wait_ns());
        let r = self.timed_inner(seqs, test, len);
        let wall = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waits
            .set((wall, kernels::host_wait_ns().saturating_sub(w0)));
        r
    }

    fn timed_inner(
        &self,
        seqs: &mut [Box<dyn SequenceState>],
        test: Test,
        len: usize,
    ) -> Result<f64> {
        let npl = seqs.len();
        match test {
            Test::Pp => {
                let toks: Vec<Vec<u32>> = (0..npl).map(|s| tokens(self.vocab, len, s)).collect();
                let t0 = Instant::now();
                self.step(seqs, &toks)?;
                Ok((npl * len) as f64 / t0.elapsed().as_secs_f64())
            }
            Test::Tg => {
                let all: Vec<Vec<u32>> =
                    (0..npl).map(|s| tokens(self.vocab, len, 77 + s)).collect();
                let t0 = Instant::now();
                for i in 0..len {
                    let toks: Vec<Vec<u32>> = all.iter().map(|t| vec![t[i]]).collect();
                    self.step(seqs, &toks)?;
                }
                Ok((npl * len) as f64 / t0.elapsed().as_secs_f64())
            }
        }
    }

    fn run_once(&self, test: Test, len: usize, depth: usize, npl: usize) -> Result<f64> {
        let mut seqs = self.filled(depth, npl)?;
        self.timed(&mut seqs, test, len)
    }

    /// Device time by kernel kind, per token, from one profiled run of the test.
    fn profile(
        &self,
        g: &kernels::Gpu,
        test: Test,
        len: usize,
        depth: usize,
        npl: usize,
    ) -> Result<kernels::Profile> {
        let mut seqs = self.filled(depth, npl)?;
        g.profile_begin();
        let r = self.timed(&mut seqs, test, len);
        let p = g.profile_end()?;
        r?;
        Ok(p.per(npl * len))
    }
}

fn kernel_line(p: &kernels::Profile, top: usize) -> String {
    let total: f64 = p.kinds.iter().map(|k| k.us).sum();
    let mut parts: Vec<String> = p
        .kinds
        .iter()
        .take(top)
        .map(|k| format!("{} {:.1} us", k.kind, k.us))
        .collect();
    if p.kinds.len() > top {
        parts.push(format!("{} more kinds", p.kinds.len() - top));
    }
    format!("{total:.1} us: {}", parts.join(", "))
}

fn kernels_json(p: &kernels::Profile) -> serde_json::Value {
    serde_json::Value::Array(
        p.kinds
            .iter()
            .map(|k| {
                serde_json::json!({"kind": k.kind, "us_per_token": k.us, "launches_per_token": k.launches})
            })
            .collect(),
    )
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// Weight bytes a forward step reads (bench-models.md's count): every trunk tensor once, the
/// routed experts' share of the expert tensors, the output head; not the token embedding (one
/// row per token) nor the NextN block (not run).
struct WeightBytes {
    total: u64,
    params: u64,
    /// Non-expert trunk + head bytes.
    dense: u64,
    /// Routed-expert tensor bytes (all experts).
    experts: u64,
    used_fraction: f64,
}

impl WeightBytes {
    fn of(model: &gguf::Model, spec: &runtime::spec::ModelSpec) -> Self {
        let mtp: Vec<String> = spec
            .layers
            .iter()
            .filter(|l| l.mtp)
            .map(|l| format!("blk.{}.", l.index))
            .collect();
        let (mut total, mut params, mut dense, mut experts) = (0, 0, 0, 0);
        for t in model.tensors() {
            let b = t.info.n_bytes();
            total += b;
            params += t.info.n_elements();
            let name = t.info.name.as_str();
            if name.starts_with("token_embd.") || mtp.iter().any(|p| name.starts_with(p)) {
                continue;
            }
            if name.contains("_exps.") {
                experts += b;
            } else {
                dense += b;
            }
        }
        let used_fraction = spec
            .moe
            .map_or(1.0, |e| e.n_used as f64 / e.n_expert as f64);
        WeightBytes {
            total,
            params,
            dense,
            experts,
            used_fraction,
        }
    }

    /// Expected bytes of one forward call over `tokens` tokens: distinct experts of `tokens`
    /// tokens under uniform routing, `E * (1 - (1 - k/E)^tokens)` (gpu-kernels.md §1.5).
    fn per_step(&self, tokens: usize) -> f64 {
        let f = 1.0 - (1.0 - self.used_fraction).powf(tokens as f64);
        self.dense as f64 + self.experts as f64 * f
    }
}

/// Device-to-device copy bandwidth (read + write bytes), median of several 1 GiB copies.
fn gpu_copy_gbs(g: &kernels::Gpu) -> Result<f64> {
    let n = 1usize << 30;
    let src = g.zeros::<u8>(n)?;
    let mut dst = g.zeros::<u8>(n)?;
    g.copy(&src, &mut dst)?;
    let mut v = Vec::new();
    for _ in 0..7 {
        let ms = g.time_ms(|| g.copy(&src, &mut dst))?;
        v.push(2.0 * n as f64 / (f64::from(ms) * 1e-3) / 1e9);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[v.len() / 2])
}

/// Host memory copy bandwidth (read + write), all threads, median of several 256 MiB copies.
fn host_copy_gbs() -> f64 {
    use rayon::prelude::*;
    let n = 256usize << 20;
    let src: Vec<u8> = (0..n).map(|i| (i * 31) as u8).collect();
    let mut dst = vec![0u8; n];
    let chunk = n / rayon::current_num_threads().max(1);
    let mut v = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        v.push(2.0 * n as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&dst);
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Today's UTC date, `YYYY-MM-DD` (civil-from-days, H. Hinnant's algorithm).
fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let z = (secs / 86400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_sample_sd() {
        let (m, s) = mean_sd(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12 && (s - 1.0).abs() < 1e-12);
        assert_eq!(mean_sd(&[5.0]), (5.0, 0.0));
    }

    #[test]
    fn date_format() {
        let d = utc_date();
        assert_eq!(d.len(), 10);
        assert!(d.starts_with("20"));
    }

    #[test]
    fn tokens_in_range_and_deterministic() {
        let a = tokens(1000, 64, 3);
        assert_eq!(a, tokens(1000, 64, 3));
        assert!(a.iter().all(|&t| t < 1000));
    }
}
