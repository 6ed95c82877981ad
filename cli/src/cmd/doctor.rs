//! `gguftool doctor`: what this machine offers for the CUDA backend — driver, devices, NVRTC,
//! whether every kernel compiles for the device (or for sm_90/sm_120 without one), cuBLAS —
//! and, with `--model`, whether the GPU reproduces the CPU reference on that model (logits within
//! tolerance, identical greedy continuations; see runtime::cuda::check).
//! Exit 0 when a usable GPU path exists, 1 when something is missing or diverges (with the reason).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use kernels::{nvrtc, Gpu, Op};

#[derive(clap::Args)]
pub struct Args {
    /// Skip compiling every kernel (the slowest check, a few seconds per architecture).
    #[arg(long)]
    no_compile: bool,
    /// Compare the GPU against the CPU reference on this GGUF model (repeatable).
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Prompts for --model as token ids, from a reference JSON (`{"prompts": [{"id",
    /// "token_ids"}]}`, e.g. the fixtures' refs/hf-tiny-glm5*.json; repeatable). Without it a
    /// fixed 40-token prompt is used.
    #[arg(long)]
    refs: Vec<PathBuf>,
    /// Greedy decode steps compared per prompt.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// CUDA device for --model.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Compare the GPU split over tensor-parallel ranks (`--tp N --tp-devices ...`) with the CPU.
    #[command(flatten)]
    tp: super::tp::TpArgs,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let mut findings = Vec::new();
    let driver = kernels::driver_available();
    println!(
        "CUDA driver library: {}",
        if driver { "found" } else { "not found" }
    );
    let count = kernels::device_count();
    println!("CUDA devices: {count}");
    let mut archs = Vec::new();
    for i in 0..count {
        match Gpu::get(i) {
            Ok(g) => {
                let d = g.info();
                println!(
                    "  [{i}] {}: compute capability {}.{} ({}), {} SMs, {:.1} GiB, L2 {} MiB",
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.arch,
                    d.sm_count,
                    d.total_mem as f64 / (1u64 << 30) as f64,
                    d.l2_bytes >> 20
                );
                archs.push(d.arch.clone());
            }
            Err(e) => findings.push(format!("device {i}: {e}")),
        }
    }
    if count == 0 {
        findings.push("no CUDA device: the GPU backend is unavailable (CPU only)".into());
    }
    if !nvrtc::available() {
        findings
            .push("NVRTC (libnvrtc) not found: kernels cannot be compiled (docs/GPU.md)".into());
    } else {
        let (maj, min) = nvrtc::version()?;
        let supported = nvrtc::supported_archs()?;
        println!("NVRTC {maj}.{min}, targets {supported:?}");
        if archs.is_empty() {
            archs = vec!["sm_90".to_string(), "sm_120".to_string()];
        }
        if !args.no_compile {
            for arch in &archs {
                let t = Instant::now();
                let mut failed = Vec::new();
                for op in Op::ALL {
                    if let Err(e) = nvrtc::compile(op, arch, false) {
                        failed.push(format!("{}: {e}", op.name()));
                    }
                }
                println!(
                    "compile all {} kernel modules for {arch}: {} ({:.1} s)",
                    Op::ALL.len(),
                    if failed.is_empty() { "ok" } else { "FAILED" },
                    t.elapsed().as_secs_f64()
                );
                findings.extend(failed);
            }
        }
    }
    if count > 0 {
        match Gpu::get(0).and_then(|g| {
            // A one-row matmul exercises dequantization, cuBLAS and the stream end to end.
            let w = g.upload(&[0u8; 4 * 32])?;
            let x = g.upload(&[1.0f32; 32])?;
            let mut y = g.zeros::<f32>(1)?;
            g.matmul(
                kernels::MatShape::new(gguf::GgmlType::F32, 1, 32),
                &w,
                &x,
                1,
                &mut y,
            )?;
            g.synchronize()
        }) {
            Ok(()) => println!("cuBLAS + kernel launch on device 0: ok"),
            Err(e) => findings.push(format!("launch check on device 0: {e}")),
        }
    }
    if !args.model.is_empty() && count > 0 {
        let mut prompts = Vec::new();
        for r in &args.refs {
            let text =
                std::fs::read_to_string(r).with_context(|| format!("reading {}", r.display()))?;
            prompts.extend(runtime::cuda::check::reference_prompts(&text)?);
        }
        if prompts.is_empty() {
            prompts.push((
                "fixed-40".to_string(),
                (0..40u32).map(|i| 100 + 7 * i).collect(),
            ));
        }
        println!(
            "GPU vs CPU (logits within {:.0e} of max|logit|, greedy {} steps):",
            runtime::cuda::check::LOGIT_TOL,
            args.steps
        );
        println!("| model | prompt | max rel diff | greedy identical |");
        println!("|---|---|---|---|");
        for path in &args.model {
            let model = Arc::new(
                gguf::Model::open(path).with_context(|| format!("opening {}", path.display()))?,
            );
            let cpu = runtime::glm::load_cpu(model.clone())?;
            let dev = runtime::device::Device::Cuda(args.device);
            let gpu = super::tp::load(model, args.tp.options(dev)?, true)?.lm;
            let gpu = gpu.as_ref();
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            for (id, ids) in &prompts {
                let r = runtime::cuda::check::compare(&cpu, gpu, ids, args.steps)?;
                let tie = r
                    .near_tie
                    .map(|(s, g)| format!(" (near tie at step {s}, gap {g:.1e})"))
                    .unwrap_or_default();
                println!(
                    "| {name} | {id} ({} tok) | {:.2e} | {}/{}{tie} |",
                    ids.len(),
                    r.max_rel_diff,
                    r.greedy_identical,
                    r.steps
                );
                if let Some(f) = r.failure {
                    findings.push(format!("{name} {id}: GPU diverges from CPU: {f}"));
                }
            }
        }
    }
    if findings.is_empty() {
        println!("doctor: no findings");
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &findings {
            println!("finding: {f}");
        }
        Ok(ExitCode::from(1))
    }
}
