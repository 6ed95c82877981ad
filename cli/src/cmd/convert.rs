//! `gguftool convert MODEL --to safetensors OUT_DIR`: a GGUF model back to an HF-layout checkpoint
//! (sharded safetensors + index, config.json, generation_config.json, tokenizer files), streamed
//! tensor by tensor; OUT_DIR appears only when complete.

use crate::util::{
    check_interrupted, count_progress, human_bytes, install_interrupt_handler, parse_size,
    AtomicDir,
};
use anyhow::{Context, Result};
use mappings::export::{export_safetensors_into, ExportOptions, OutDtype, Progress};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Safetensors,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dtype {
    Bf16,
    F16,
    F32,
}

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file or any shard of a split model.
    model: PathBuf,
    /// Output directory (written aside, swapped in when complete). `--force` replaces only a
    /// directory gguftool wrote (it holds a `.gguftool-output` marker) or an empty one.
    out_dir: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value = "safetensors")]
    to: Format,
    /// Storage dtype: bf16/f16 narrow a tensor only where that is exact (others keep the
    /// narrowest exact float type, e.g. f32 values bf16 cannot hold); f32 widens everything.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: Dtype,
    /// Largest shard (decimal units: 5G, 500M).
    #[arg(long, default_value = "5G")]
    max_shard_size: String,
    /// Tensor-parallel world size: write only rank --rank's slice of tensors with a TP plan.
    #[arg(long, value_name = "N", requires = "rank")]
    tp: Option<usize>,
    /// With --tp: the rank to write.
    #[arg(long, value_name = "R", requires = "tp")]
    rank: Option<usize>,
    /// Replace an existing OUT_DIR that gguftool wrote (or an empty one).
    #[arg(long)]
    force: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let Format::Safetensors = args.to;
    let model = gguf::Model::open(&args.model)?;
    let opts = ExportOptions {
        dtype: match args.dtype {
            Dtype::Bf16 => OutDtype::Bf16,
            Dtype::F16 => OutDtype::F16,
            Dtype::F32 => OutDtype::F32,
        },
        max_shard_bytes: parse_size(&args.max_shard_size)?,
        tp: args.tp.zip(args.rank),
        overwrite: args.force,
    };
    install_interrupt_handler();
    let inputs: Vec<&Path> = model.shards().iter().map(|f| f.path()).collect();
    let out = AtomicDir::create(&args.out_dir, args.force, &inputs)?;
    let mut bar = None;
    let quiet = args.quiet;
    let summary = export_safetensors_into(&model, out.path(), &opts, &mut |p| {
        match p {
            Progress::Start { tensors, .. } => {
                bar = Some(count_progress(tensors as u64, quiet, "writing tensors"));
            }
            Progress::Tensor { .. } => {
                if let Some(b) = &bar {
                    b.inc(1);
                }
            }
        }
        check_interrupted().is_ok()
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    check_interrupted()?;
    let mut summary = summary.with_context(|| {
        format!(
            "converting {} failed; nothing was written",
            args.model.display()
        )
    })?;
    out.commit()?;
    summary.out_dir = args.out_dir.clone();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "wrote {} tensors ({}) in {} shard(s) to {}",
            summary.tensors,
            human_bytes(summary.bytes),
            summary.shards,
            summary.out_dir.display()
        );
        let dtypes: Vec<String> = summary
            .dtypes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        println!("dtypes: {}", dtypes.join(", "));
        if !summary.kept_wide.is_empty() {
            println!(
                "kept wider than requested (narrowing would change values): {}",
                summary.kept_wide.join(", ")
            );
        }
        for n in &summary.notes {
            println!("note: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
