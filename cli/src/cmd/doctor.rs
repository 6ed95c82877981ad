//! `gguftool doctor [MODEL]`: the one command to run on a model that misbehaves. Seven checks in
//! the order a fault is best fixed, none stopping the ones after it:
//! 1. container and split integrity, metadata against the architecture (headers only),
//! 2. name mapping in both directions, every tensor present with its shape (headers only),
//! 3. tensor statistics (NaN/Inf, zero or constant tensors, damaged blocks; outliers warn),
//! 4. the MLA kv_b split (and against HF's kv_b_proj with `--hf`),
//! 5. GPU against CPU dequantization of every tensor (with a GPU),
//! 6. forward-pass sanity on the CPU reference (next-token distribution finite, not flat),
//! 7. layer by layer against a reference (the CPU for the chosen backend, a saved activation
//!    dump, transformers on `--hf`), naming the first diverging layer and operation.
//!
//! Without MODEL: what this machine offers the CUDA backend (driver, devices, NVRTC, kernels,
//! cuBLAS), and with `--model M` the CUDA forward pass against the CPU reference.
//! Exit 0 healthy (warnings allowed), 1 findings, 2 could not run. A damaged file is a finding.

mod container;
mod forward;
mod hf_dump;
mod kvb;
mod layers;
mod names;
mod report;
mod stats;
mod tolerance;

use anyhow::{bail, Context, Result};
use gguf::{GgmlType, Header, Model};
use kernels::{nvrtc, Gpu, Op};
use report::{timed, CheckResult, Item, Report};
use runtime::device::Device;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// `--quick`: layers checks 4, 5 and 7 look at.
pub const QUICK_LAYERS: u64 = 2;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (a file or any shard of a split model). Without it: the machine checks.
    model: Option<PathBuf>,
    /// The HF checkpoint the GGUF was converted from: names and shapes (check 2), kv_b_proj
    /// (check 4) and, when python3 can import torch and transformers, activations (check 7).
    #[arg(long, value_name = "HF_DIR")]
    hf: Option<PathBuf>,
    /// Backend whose forward pass check 7 compares with the CPU reference: auto, cpu, cuda,
    /// cuda:N (auto: a CUDA GPU when present).
    #[arg(long, default_value = "auto")]
    device: Device,
    /// Tensor-parallel split of the backend under test (check 7 compares it with the CPU).
    #[command(flatten)]
    tp: super::tp::TpArgs,
    /// A saved activation dump to compare the CPU reference with, layer by layer (safetensors
    /// with `token_ids` and activations named like the fixtures' refs/activations-*.safetensors).
    #[arg(long, value_name = "FILE")]
    activations: Option<PathBuf>,
    /// Print `{"checks": [...], "first_finding": ...}` (docs/JSON.md).
    #[arg(long)]
    json: bool,
    /// Limit checks 3-7: a sample of blocks per tensor, the first layers, one prompt.
    #[arg(long)]
    quick: bool,
    /// Run only these checks (e.g. `1,2` or `1-4`); the others are reported as skipped.
    #[arg(long, value_name = "LIST")]
    checks: Option<String>,
    /// No progress bars or notes on stderr.
    #[arg(short, long)]
    quiet: bool,
    /// Machine checks: skip compiling every kernel (a few seconds per architecture).
    #[arg(long)]
    no_compile: bool,
    /// Machine checks: compare the GPU with the CPU reference on this GGUF (repeatable).
    #[arg(long = "model", value_name = "GGUF")]
    gpu_models: Vec<PathBuf>,
    /// With --model: prompts as token ids from a reference JSON (`{"prompts": [{"id",
    /// "token_ids"}]}`, e.g. refs/hf-tiny-glm5*.json; repeatable). Default: a fixed 40-token prompt.
    #[arg(long)]
    refs: Vec<PathBuf>,
    /// With --model: greedy decode steps compared per prompt.
    #[arg(long, default_value_t = 16)]
    steps: usize,
}

/// One file of the model, as check 1 read it.
pub struct Shard {
    pub path: PathBuf,
    pub size: u64,
    pub header: Option<Header>,
}

/// A tensor from the headers.
pub struct TensorEntry {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub shard: usize,
    /// Absolute offset of its data in its file.
    pub at: u64,
}

/// What every check may consult: the headers, the mapping table and its report, the spec.
pub struct Ctx {
    pub shards: Vec<Shard>,
    pub tensors: Vec<TensorEntry>,
    pub table: Option<&'static mappings::Table>,
    pub arch: Option<mappings::ArchReport>,
    pub spec: Option<runtime::spec::ModelSpec>,
}

impl Ctx {
    fn build(shards: Vec<Shard>) -> Ctx {
        let mut tensors = Vec::new();
        for (i, s) in shards.iter().enumerate() {
            if let Some(h) = &s.header {
                tensors.extend(h.tensors.iter().map(|t| TensorEntry {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ty: t.ty,
                    shard: i,
                    at: h.data_offset.saturating_add(t.offset),
                }));
            }
        }
        let meta = shards
            .first()
            .and_then(|s| s.header.as_ref())
            .map(|h| &h.metadata);
        let table = meta
            .and_then(|m| m.architecture())
            .and_then(|a| mappings::table(a).ok());
        let arch = match (table, meta) {
            (Some(t), Some(m)) => {
                let parts: Vec<(&str, &[u64])> = tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.dims.as_slice()))
                    .collect();
                Some(mappings::arch_check::check_parts(t, m, &parts))
            }
            _ => None,
        };
        let spec = meta.and_then(|m| runtime::spec::ModelSpec::from_metadata(m).ok());
        Ctx {
            shards,
            tensors,
            table,
            arch,
            spec,
        }
    }

    fn meta(&self) -> Option<&gguf::Metadata> {
        self.shards
            .first()
            .and_then(|s| s.header.as_ref())
            .map(|h| &h.metadata)
    }

    fn meta_u64(&self, key: &str) -> Option<u64> {
        self.meta()?.get(key)?.as_u64()
    }

    fn arch_name(&self) -> Option<&str> {
        self.meta()?.architecture()
    }

    /// "shard F at byte N" for a tensor.
    fn locate(&self, name: &str) -> String {
        match self.tensors.iter().find(|t| t.name == name) {
            Some(t) => format!(
                "{} {:?} in {} at byte {}",
                t.ty.name(),
                t.dims,
                file_name(&self.shards[t.shard].path),
                t.at
            ),
            None => "not in the model".into(),
        }
    }
}

pub fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// The same tensor kind across blocks: `blk.7.attn_norm.weight` -> `blk.*.attn_norm.weight`.
pub fn kind_of(name: &str) -> String {
    let mut parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 2 && parts[0] == "blk" && parts[1].bytes().all(|b| b.is_ascii_digit()) {
        parts[1] = "*";
    }
    parts.join(".")
}

/// `1,2,5-7` -> {1, 2, 5, 6, 7}.
fn parse_checks(s: &str) -> Result<BTreeSet<usize>> {
    let mut out = BTreeSet::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let (a, b): (usize, usize) = (
            a.parse()
                .with_context(|| format!("--checks: {part:?} is not a check number"))?,
            b.parse()
                .with_context(|| format!("--checks: {part:?} is not a check number"))?,
        );
        if a == 0 || b > 7 || a > b {
            bail!("--checks: {part:?}: checks are numbered 1 to 7");
        }
        out.extend(a..=b);
    }
    if out.is_empty() {
        bail!("--checks: no check given");
    }
    Ok(out)
}

pub fn run(args: Args) -> Result<ExitCode> {
    crate::util::install_interrupt_handler();
    let report = match &args.model {
        Some(path) => {
            if !args.gpu_models.is_empty() {
                bail!(
                    "--model is for the machine checks; give the model to diagnose as MODEL only"
                );
            }
            model_checks(path, &args)?
        }
        None => {
            for (flag, set) in [
                ("--hf", args.hf.is_some()),
                ("--activations", args.activations.is_some()),
                ("--checks", args.checks.is_some()),
                ("--quick", args.quick),
            ] {
                if set {
                    bail!("{flag} needs a MODEL to diagnose");
                }
            }
            machine_checks(&args)?
        }
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        report.print_human();
    }
    Ok(if report.has_findings() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn note(args: &Args, msg: &str) {
    if !args.quiet && !args.json {
        eprintln!("doctor: {msg}");
    }
}

/// `--tp N` (N > 1, or `auto` over several GPUs): the load options of the sharded backend under
/// test; None for one rank, which check 7 compares layer by layer instead.
fn tp_options(args: &Args) -> Result<Option<runtime::device::LoadOptions>> {
    use runtime::device::TpSize;
    let many = match args.tp.tp {
        TpSize::Ranks(0) => bail!("--tp must be at least 1"),
        TpSize::Ranks(n) => n > 1,
        TpSize::Auto => {
            matches!(args.device.resolve(), Device::Cuda(_)) && kernels::device_count() > 1
        }
    };
    Ok(if many {
        Some(args.tp.options(args.device)?)
    } else {
        None
    })
}

fn model_checks(path: &Path, args: &Args) -> Result<Report> {
    let selected = match &args.checks {
        Some(s) => parse_checks(s)?,
        None => (1..=7).collect(),
    };
    let on = |n: usize| selected.contains(&n);
    let not_selected =
        |n: usize, id: &'static str| CheckResult::skipped(n, id, "not selected (--checks)");
    let quiet = args.quiet || args.json;
    let tp_opts = tp_options(args)?;
    let t0 = Instant::now();
    let (shards, mut c1) = container::open(path)?;
    let ctx = Ctx::build(shards);
    let model = if c1.first_finding().is_none() {
        container::open_model(path, &mut c1)
    } else {
        None
    };
    container::check_metadata(&ctx, &mut c1);
    c1.summary = container_summary(&ctx);
    c1.seconds = t0.elapsed().as_secs_f64();
    let no_model = |n: usize, id: &'static str| {
        CheckResult::skipped(n, id, "not run: the model cannot be opened (check 1)")
    };
    let mut checks = vec![if on(1) {
        c1
    } else {
        not_selected(1, "container")
    }];
    checks.push(if on(2) {
        timed(|| names::run(&ctx, args.hf.as_deref()))
    } else {
        not_selected(2, "mapping")
    });
    checks.push(match (&model, on(3)) {
        (_, false) => not_selected(3, "statistics"),
        (None, _) => no_model(3, "statistics"),
        (Some(m), _) => {
            let bytes: u64 = m.tensors().map(|t| t.info.n_bytes()).sum();
            note(
                args,
                &format!(
                    "check 3: statistics of every tensor ({} of tensor data{})",
                    crate::util::human_bytes(bytes),
                    if args.quick {
                        ", sampled"
                    } else {
                        " read once; --quick samples"
                    }
                ),
            );
            timed(|| stats::run(&ctx, m, args.quick, quiet))
        }
    });
    checks.push(match (&model, on(4)) {
        (_, false) => not_selected(4, "kv_b"),
        (None, _) => no_model(4, "kv_b"),
        (Some(m), _) => timed(|| kvb::run(&ctx, m, args.hf.as_deref(), args.quick)),
    });
    checks.push(match (&model, on(5)) {
        (_, false) => not_selected(5, "gpu_dequant"),
        (None, _) => no_model(5, "gpu_dequant"),
        (Some(m), _) => timed(|| gpu_dequant(m, args, quiet)),
    });
    let runnable = runtime_support(&ctx);
    let tok = ctx
        .meta()
        .map(serving::tokenizer::Tokenizer::from_gguf)
        .transpose()
        .map_err(|e| e.to_string());
    let count_ids = match &tok {
        Ok(Some(t)) => t.encode(forward::COUNT_PROMPT, true).ok(),
        _ => None,
    };
    checks.push(match (&model, on(6), &runnable) {
        (_, false, _) => not_selected(6, "forward"),
        (None, _, _) => no_model(6, "forward"),
        (_, _, Err(why)) => CheckResult::skipped(6, "forward", why.clone()),
        (Some(m), _, Ok(())) => {
            note(args, "check 6: CPU forward pass on two prompts");
            timed(|| forward_check(m, &tok, args.quick))
        }
    });
    checks.push(match (&model, on(7), &runnable) {
        (_, false, _) => not_selected(7, "layers"),
        (None, _, _) => no_model(7, "layers"),
        (_, _, Err(why)) => CheckResult::skipped(7, "layers", why.clone()),
        (Some(m), _, Ok(())) => {
            note(args, "check 7: layer-by-layer comparison");
            timed(|| {
                layers::run(
                    m,
                    &layers::Options {
                        activations: args.activations.as_deref(),
                        hf: args.hf.as_deref(),
                        device: args.device,
                        quick: args.quick,
                        prompt: count_ids.clone(),
                        tp: tp_opts.clone(),
                    },
                )
            })
        }
    });
    let size: u64 = ctx.shards.iter().map(|s| s.size).sum();
    Ok(Report {
        title: format!(
            "gguftool doctor: {} ({}, {} tensors, {} file(s), {})",
            path.display(),
            ctx.arch_name().unwrap_or("unknown architecture"),
            ctx.tensors.len(),
            ctx.shards.len(),
            crate::util::human_bytes(size)
        ),
        checks,
    })
}

fn container_summary(ctx: &Ctx) -> String {
    let read = ctx.shards.iter().filter(|s| s.header.is_some()).count();
    let version = ctx
        .shards
        .iter()
        .find_map(|s| s.header.as_ref().map(|h| h.version))
        .unwrap_or(0);
    format!(
        "{read} of {} file(s) read, GGUF v{version}, {} tensors, architecture {}; headers only",
        ctx.shards.len(),
        ctx.tensors.len(),
        ctx.arch_name().unwrap_or("?")
    )
}

/// Checks 6 and 7 need an architecture the runtime implements.
fn runtime_support(ctx: &Ctx) -> Result<(), String> {
    match ctx.arch_name() {
        None => Err("the model has no architecture (check 1)".into()),
        Some(a) if runtime::spec::Arch::from_name(a).is_none() => Err(format!(
            "the runtime does not implement architecture {a:?} (glm-dsa, deepseek2, glm4moe)"
        )),
        Some(_) => Ok(()),
    }
}

fn forward_check(
    model: &Arc<Model>,
    tok: &Result<Option<serving::tokenizer::Tokenizer>, String>,
    quick: bool,
) -> CheckResult {
    let tok = match tok {
        Ok(Some(t)) => t,
        Ok(None) => return CheckResult::skipped(6, "forward", "no metadata"),
        Err(e) => {
            return CheckResult::skipped(
                6,
                "forward",
                format!("no usable tokenizer in the GGUF: {e}"),
            )
        }
    };
    match runtime::glm::load_cpu(Arc::clone(model)) {
        Ok(lm) => forward::run(&lm, tok, model.metadata(), quick),
        Err(e) => {
            let mut r = CheckResult::new(6, "forward");
            r.push(
                Item::finding(
                    file_name(model.path()),
                    format!("the CPU reference runtime cannot load the model: {e}"),
                )
                .advice("fix what checks 1-2 report first"),
            );
            r
        }
    }
}

/// Check 5: every tensor dequantized on the GPU against the CPU reference (verify --gpu).
fn gpu_dequant(model: &Model, args: &Args, quiet: bool) -> CheckResult {
    if kernels::device_count() == 0 {
        return CheckResult::skipped(5, "gpu_dequant", "no CUDA device");
    }
    if args.device == Device::Cpu {
        return CheckResult::skipped(5, "gpu_dequant", "--device cpu");
    }
    let mut r = CheckResult::new(5, "gpu_dequant");
    let tensors: Vec<_> = model
        .tensors()
        .filter(|t| {
            !args.quick
                || !t.info.name.starts_with("blk.")
                || t.info
                    .name
                    .split('.')
                    .nth(1)
                    .and_then(|b| b.parse::<u64>().ok())
                    .is_some_and(|b| b < QUICK_LAYERS)
        })
        .collect();
    match crate::cmd::verify_gpu::run(model, &tensors, quiet) {
        Ok((v, findings)) => {
            for f in findings {
                r.push(
                    Item::finding(f.tensor, f.message)
                        .advice("the CUDA dequantizer of this type is wrong: report it with the tensor's type; use --device cpu meanwhile"),
                );
            }
            r.summary = format!(
                "{} tensors dequantized on {}{}: max abs diff {}, max rel diff {}",
                v["checked"],
                v["device"].as_str().unwrap_or("?"),
                if args.quick {
                    format!(" (--quick: outside blocks and the first {QUICK_LAYERS} layers)")
                } else {
                    String::new()
                },
                v["max_abs"],
                v["max_rel"]
            );
        }
        Err(e) => r.push(Item::finding(
            None,
            format!("GPU dequantization failed: {e:#}"),
        )),
    }
    r
}

/// Without MODEL: what this machine offers the CUDA backend. No GPU is not a fault of the
/// machine: those checks are skipped; a GPU that cannot be used is a finding.
fn machine_checks(args: &Args) -> Result<Report> {
    let mut checks = Vec::new();
    let driver = kernels::driver_available();
    let count = kernels::device_count();
    let mut c = CheckResult::new(1, "cuda_devices");
    let mut archs = Vec::new();
    c.summary = format!(
        "driver library {}; {count} CUDA device(s)",
        if driver { "found" } else { "not found" }
    );
    for i in 0..count {
        match Gpu::get(i) {
            Ok(g) => {
                let d = g.info();
                c.summary.push_str(&format!(
                    "; [{i}] {}: compute capability {}.{} ({}), {} SMs, {:.1} GiB, L2 {} MiB",
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.arch,
                    d.sm_count,
                    d.total_mem as f64 / (1u64 << 30) as f64,
                    d.l2_bytes >> 20
                ));
                archs.push(d.arch.clone());
            }
            Err(e) => c.push(Item::finding(format!("device {i}"), e.to_string())),
        }
    }
    if count == 0 {
        c.skipped =
            Some("no CUDA device: the GPU backend is unavailable, the CPU backend runs".into());
    }
    checks.push(c);

    let mut c = CheckResult::new(2, "nvrtc");
    let t = Instant::now();
    if !nvrtc::available() {
        let text = "NVRTC (libnvrtc) not found: kernels cannot be compiled (docs/GPU.md)";
        if count > 0 {
            c.push(Item::finding(None, text.to_string()));
        } else {
            c.skipped = Some(text.into());
        }
        checks.push(c);
    } else {
        let (maj, min) = nvrtc::version()?;
        let supported = nvrtc::supported_archs()?;
        c.summary = format!("NVRTC {maj}.{min}, targets {supported:?}");
        checks.push(c);
        let mut k = CheckResult::new(3, "kernel_compile");
        if archs.is_empty() {
            archs = vec!["sm_90".to_string(), "sm_120".to_string()];
        }
        if args.no_compile {
            k.skipped = Some("--no-compile".into());
        } else {
            let mut lines = Vec::new();
            for arch in &archs {
                let ta = Instant::now();
                let mut failed = 0;
                for op in Op::ALL {
                    if let Err(e) = nvrtc::compile(op, arch, false) {
                        failed += 1;
                        k.push(Item::finding(
                            format!("{} for {arch}", op.name()),
                            e.to_string(),
                        ));
                    }
                }
                lines.push(format!(
                    "{} kernel modules for {arch}: {} ({:.1} s)",
                    Op::ALL.len(),
                    if failed == 0 { "ok" } else { "FAILED" },
                    ta.elapsed().as_secs_f64()
                ));
            }
            k.summary = lines.join("; ");
        }
        k.seconds = t.elapsed().as_secs_f64();
        checks.push(k);
    }

    let mut c = CheckResult::new(4, "cuda_launch");
    if count == 0 {
        c.skipped = Some("no CUDA device".into());
    } else {
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
            Ok(()) => c.summary = "cuBLAS + kernel launch on device 0: ok".into(),
            Err(e) => c.push(Item::finding(
                "device 0".to_string(),
                format!("launch check: {e}"),
            )),
        }
    }
    checks.push(c);

    if !args.gpu_models.is_empty() {
        checks.push(timed(|| gpu_vs_cpu(args, count)));
    }
    Ok(Report {
        title: "gguftool doctor: this machine".into(),
        checks,
    })
}

/// `--model M`: the CUDA forward pass against the CPU reference on whole prompts (logits within
/// tolerance, identical greedy continuations; runtime::cuda::check).
fn gpu_vs_cpu(args: &Args, count: usize) -> CheckResult {
    let mut r = CheckResult::new(5, "gpu_vs_cpu");
    let tp_opts = match tp_options(args) {
        Ok(o) => o,
        Err(e) => {
            r.push(Item::finding(Some("--tp".to_string()), format!("{e:#}")));
            return r;
        }
    };
    if count == 0 {
        r.skipped = Some("no CUDA device".into());
        return r;
    }
    let ordinal = match args.device {
        Device::Cuda(i) => i,
        _ => 0,
    };
    let mut prompts = Vec::new();
    for p in &args.refs {
        match std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|t| runtime::cuda::check::reference_prompts(&t).map_err(|e| e.to_string()))
        {
            Ok(v) => prompts.extend(v),
            Err(e) => r.push(Item::finding(p.display().to_string(), e)),
        }
    }
    if prompts.is_empty() {
        prompts.push((
            "fixed-40".to_string(),
            (0..40u32).map(|i| 100 + 7 * i).collect(),
        ));
    }
    let mut rows = vec![format!(
        "logits within the backend's derived tolerance of max|logit|, greedy {} steps",
        args.steps
    )];
    for path in &args.gpu_models {
        let name = file_name(path);
        let loaded = Model::open(path)
            .map_err(|e| e.to_string())
            .map(Arc::new)
            .and_then(|m| {
                let cpu = runtime::glm::load_cpu(m.clone()).map_err(|e| e.to_string())?;
                let gpu: Arc<dyn runtime::LanguageModel> = match &tp_opts {
                    Some(lo) => {
                        super::tp::load(m, lo.clone(), true)
                            .map_err(|e| format!("{e:#}"))?
                            .lm
                    }
                    None => {
                        Arc::new(runtime::cuda::load_cuda(m, ordinal).map_err(|e| e.to_string())?)
                    }
                };
                Ok((cpu, gpu))
            });
        let (cpu, gpu) = match loaded {
            Ok(x) => x,
            Err(e) => {
                r.push(Item::finding(name, e));
                continue;
            }
        };
        for (id, ids) in &prompts {
            let tol =
                runtime::cuda::check::tolerance_for(Device::Cuda(ordinal), cpu.spec().n_layer);
            match runtime::cuda::check::compare_with(&cpu, gpu.as_ref(), ids, args.steps, tol) {
                Ok(c) => {
                    let tie = c
                        .near_tie
                        .map(|(s, g)| format!(" (near tie at step {s}, gap {g:.1e})"))
                        .unwrap_or_default();
                    rows.push(format!(
                        "{name} {id} ({} tok): max rel diff {:.2e} (tol {tol:.1e}), greedy {}/{}{tie}",
                        ids.len(),
                        c.max_rel_diff,
                        c.greedy_identical,
                        c.steps
                    ));
                    if let Some(f) = c.failure {
                        r.push(Item::finding(
                            format!("{name} {id}"),
                            format!("GPU diverges from CPU: {f}"),
                        ));
                    }
                }
                Err(e) => r.push(Item::finding(format!("{name} {id}"), e.to_string())),
            }
        }
    }
    r.summary = rows.join("; ");
    r
}
