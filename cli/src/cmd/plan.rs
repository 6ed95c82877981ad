//! `gguftool plan`: per-GPU memory of a model split over `--tp N` GPUs, from the file's header
//! only (works on the 402 GB model and on header-only stand-ins): weights by kind, KV cache bytes
//! per token and the context left for it, activation workspace, headroom. Exit 0 when it fits,
//! 1 when it does not (saying how many GPUs it needs, or that it fits at no TP size), 2 on error.

use crate::util::{human_bytes, parse_size};
use anyhow::{bail, Context, Result};
use runtime::spec::ModelSpec;
use runtime::tp::plan::{weight_plan, workspace_for, WeightPlan};
use runtime::tp::{valid_world_sizes, MoeSplit};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (any shard of a split model; only headers are read).
    model: PathBuf,
    /// Tensor-parallel GPUs.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Memory of each GPU (K/M/G/T = 10^3..10^12 bytes, as `split`).
    #[arg(long, default_value = "96G")]
    gpu_mem: String,
    /// Context tokens each sequence needs.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Sequences decoded together (serve --parallel).
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Routed-expert split: column or expert.
    #[arg(long, default_value = "column")]
    moe_split: MoeSplit,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Memory beyond weights, cache and workspace: CUDA context, cuBLAS handles, fragmentation.
fn headroom(gpu_mem: u64) -> u64 {
    (gpu_mem / 25).max(1 << 30)
}

struct Fit {
    plan: WeightPlan,
    workspace: u64,
    headroom: u64,
    /// Bytes left on the fullest rank for the KV cache (negative: the weights do not fit).
    left: i128,
    kv_per_token: u64,
    need_kv: u64,
}

impl Fit {
    fn fits(&self) -> bool {
        self.left >= self.need_kv as i128
    }
    fn capacity_tokens(&self) -> u64 {
        if self.left <= 0 {
            0
        } else {
            (self.left as u64) / self.kv_per_token.max(1)
        }
    }
}

fn fit(model: &gguf::Model, spec: &ModelSpec, world: usize, a: &Args, gpu_mem: u64) -> Result<Fit> {
    let plan = weight_plan(model, spec, world, a.moe_split)?;
    let workspace = workspace_for(spec, world, a.ctx, a.parallel);
    let headroom = headroom(gpu_mem);
    let kv_per_token = plan.kv_bytes_per_token();
    let left = gpu_mem as i128 - (plan.max_weight_bytes() + workspace + headroom) as i128;
    Ok(Fit {
        plan,
        workspace,
        headroom,
        left,
        kv_per_token,
        need_kv: kv_per_token * (a.ctx * a.parallel) as u64,
    })
}

pub fn run(a: Args) -> Result<ExitCode> {
    if a.tp == 0 || a.ctx == 0 || a.parallel == 0 {
        bail!("--tp, --ctx and --parallel must be at least 1");
    }
    let gpu_mem = parse_size(&a.gpu_mem).context("--gpu-mem")?;
    let model =
        gguf::Model::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let spec = ModelSpec::from_model(&model).context("reading the model")?;
    let f = fit(&model, &spec, a.tp, &a, gpu_mem)?;
    let n_head = match &spec.attention {
        runtime::spec::AttentionSpec::Mla(m) => m.n_head,
        runtime::spec::AttentionSpec::Gqa(g) => g.n_head,
    };
    let sizes = valid_world_sizes(&spec, a.moe_split, n_head.max(64));
    let mut needed = None;
    for &w in &sizes {
        if fit(&model, &spec, w, &a, gpu_mem)?.fits() {
            needed = Some(w);
            break;
        }
    }
    let message = if f.fits() {
        format!(
            "fits: {} GPU(s) of {} hold {} tokens of KV cache each beyond the weights ({} needed)",
            a.tp,
            human_bytes(gpu_mem),
            f.capacity_tokens(),
            a.ctx * a.parallel
        )
    } else {
        let why = if f.left < 0 {
            format!(
                "the weights of the fullest rank ({}) plus workspace and headroom exceed {}",
                human_bytes(f.plan.max_weight_bytes()),
                human_bytes(gpu_mem)
            )
        } else {
            format!(
                "{} tokens of KV cache fit, {} needed",
                f.capacity_tokens(),
                a.ctx * a.parallel
            )
        };
        match needed {
            Some(w) => format!(
                "does not fit on {} GPU(s): {why}; needs {w} GPUs (--tp {w})",
                a.tp
            ),
            None => format!(
                "does not fit on {} GPU(s): {why}; it fits at no TP size (tried {})",
                a.tp,
                sizes
                    .iter()
                    .map(|w| w.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    };
    let code = if f.fits() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    };
    if a.json {
        let ranks: Vec<_> = f
            .plan
            .ranks
            .iter()
            .map(|r| {
                json!({
                    "rank": r.rank,
                    "weight_bytes": r.weight_bytes,
                    "weights_by_kind": r.by_kind,
                    "reencoded_f32": r.reencoded_f32,
                    "reencoded_extra_bytes": r.reencoded_extra_bytes,
                    "kv_bytes_per_token": r.kv_bytes_per_token,
                    "workspace_bytes": f.workspace,
                    "headroom_bytes": f.headroom,
                    "free_for_kv_bytes": (gpu_mem as i128 - (r.weight_bytes + f.workspace + f.headroom) as i128).max(0),
                })
            })
            .collect();
        let doc = json!({
            "model": a.model.display().to_string(),
            "arch": spec.arch.name(),
            "tp": a.tp,
            "moe_split": a.moe_split,
            "gpu_mem_bytes": gpu_mem,
            "ctx": a.ctx,
            "parallel": a.parallel,
            "gpus": ranks,
            "weight_bytes": f.plan.max_weight_bytes(),
            "total_weight_bytes": f.plan.ranks.iter().map(|r| r.weight_bytes).sum::<u64>(),
            "kv_bytes_per_token": f.kv_per_token,
            "workspace_bytes": f.workspace,
            "headroom_bytes": f.headroom,
            "context_capacity_tokens": f.capacity_tokens(),
            "fits": f.fits(),
            "gpus_needed": needed,
            "valid_tp_sizes": sizes,
            "message": message,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(code);
    }
    print_table(&a, &spec, &f, gpu_mem);
    println!("{message}");
    Ok(code)
}

fn print_table(a: &Args, spec: &ModelSpec, f: &Fit, gpu_mem: u64) {
    println!(
        "{}: {} over {} GPU(s) of {} (experts split by {}; context {} x {} sequences)",
        a.model.display(),
        spec.arch.name(),
        a.tp,
        human_bytes(gpu_mem),
        a.moe_split.name(),
        a.ctx,
        a.parallel
    );
    // Identical ranks are printed once.
    let mut rows: Vec<(String, Vec<u64>)> = vec![
        ("attention".into(), vec![]),
        ("experts (routed + shared + router)".into(), vec![]),
        ("dense FFN".into(), vec![]),
        ("embeddings + head".into(), vec![]),
        ("MTP / NextN".into(), vec![]),
        ("weights".into(), vec![]),
        ("  of which F32 re-encoding".into(), vec![]),
    ];
    for r in &f.plan.ranks {
        let k = &r.by_kind;
        for (row, v) in rows.iter_mut().zip([
            k.attention,
            k.experts,
            k.dense,
            k.embeddings,
            k.mtp,
            r.weight_bytes,
            r.reencoded_extra_bytes,
        ]) {
            row.1.push(v);
        }
    }
    let width = 36;
    print!("{:width$}", "per GPU");
    for r in &f.plan.ranks {
        print!(" {:>12}", format!("rank {}", r.rank));
    }
    println!();
    for (name, v) in &rows {
        print!("{name:width$}");
        for x in v {
            print!(" {:>12}", human_bytes(*x));
        }
        println!();
    }
    println!(
        "{:width$} {:>12}",
        "activation workspace",
        human_bytes(f.workspace)
    );
    println!("{:width$} {:>12}", "headroom", human_bytes(f.headroom));
    println!(
        "{:width$} {:>12}",
        "KV cache per token",
        human_bytes(f.kv_per_token)
    );
    println!(
        "{:width$} {:>12}",
        "context capacity left (tokens)",
        f.capacity_tokens()
    );
    let names: Vec<&String> = f.plan.ranks.iter().flat_map(|r| &r.reencoded_f32).collect();
    if !names.is_empty() {
        let mut n: Vec<&String> = names;
        n.sort();
        n.dedup();
        println!(
            "note: {} tensor(s) split inside quant blocks are held as exact F32 values (e.g. {})",
            n.len(),
            n[0]
        );
    }
}
