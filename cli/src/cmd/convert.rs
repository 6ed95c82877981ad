//! `gguftool convert`: both directions between GGUF and HF checkpoints.
//! - `convert MODEL.gguf --to safetensors OUT_DIR`: a GGUF model back to an HF-layout checkpoint
//!   (sharded safetensors + index, config.json, generation_config.json, tokenizer files), streamed
//!   tensor by tensor; OUT_DIR appears only when complete.
//! - `convert HF_DIR --to gguf OUT.gguf`: an HF checkpoint to GGUF as llama.cpp's converter writes
//!   it (mappings::import), streamed in one pass; shards appear only when all are complete.

use crate::util::{
    byte_progress, check_interrupted, count_progress, free_space, human_bytes,
    install_interrupt_handler, parse_size, same_file, AtomicDir, PartialFile,
};
use anyhow::{bail, Context, Result};
use mappings::export::{export_safetensors_into, ExportOptions, OutDtype, Progress};
use mappings::import::{self, ImportOptions, OutType};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Safetensors,
    Gguf,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dtype {
    Bf16,
    /// Every tensor bf16, rounding values bf16 cannot hold (lossy).
    #[value(name = "bf16-round")]
    Bf16Round,
    F16,
    F32,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OutTypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    Auto,
}

#[derive(clap::Args)]
pub struct Args {
    /// --to safetensors: a GGUF file or any shard of a split model. --to gguf: an HF checkpoint
    /// directory (config.json, tokenizer files, *.safetensors); its name becomes general.name.
    #[arg(value_name = "INPUT")]
    model: PathBuf,
    /// --to safetensors: output directory. --to gguf: output .gguf file (split output is named
    /// OUT-00001-of-0000N.gguf beside it). Written aside as *.partial and renamed when complete.
    #[arg(value_name = "OUTPUT")]
    out_dir: PathBuf,
    /// Output format [default: gguf for a directory input, safetensors for a GGUF input].
    #[arg(long, value_enum)]
    to: Option<Format>,
    /// (--to safetensors) Storage dtype: bf16/f16 narrow a tensor only where that is exact
    /// (others keep the narrowest exact float type, e.g. f32 values bf16 cannot hold);
    /// bf16-round rounds everything to bf16 (lossy); f32 widens everything.
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// (--to safetensors) Largest shard (decimal units: 5G, 500M) [default: 5G].
    #[arg(long)]
    max_shard_size: Option<String>,
    /// (--to safetensors) Tensor-parallel world size: write only rank --rank's slice of tensors
    /// with a TP plan.
    #[arg(long, value_name = "N", requires = "rank")]
    tp: Option<usize>,
    /// (--to safetensors) With --tp: the rank to write.
    #[arg(long, value_name = "R", requires = "tp")]
    rank: Option<usize>,
    /// (--to gguf) Tensor type as llama.cpp's converter: norms, 1-D tensors, routers and
    /// indexer.proj stay F32; q8_0 falls back to f16 where a row is not a multiple of 32;
    /// auto = the 16-bit type of the checkpoint [default: auto].
    #[arg(long, value_enum)]
    outtype: Option<OutTypeArg>,
    /// (--to gguf) Split output: largest shard by tensor bytes (decimal units: 50G, 500M).
    #[arg(long, value_name = "SIZE", conflicts_with = "split_max_tensors")]
    split_max_size: Option<String>,
    /// (--to gguf) Split output: at most N tensors per shard.
    #[arg(long, value_name = "N")]
    split_max_tensors: Option<usize>,
    /// (--to gguf) general.name instead of the one derived from the directory name.
    #[arg(long, value_name = "NAME")]
    model_name: Option<String>,
    /// Replace an existing output that gguftool wrote (a directory holding its
    /// `.gguftool-output` marker, an empty directory, or a file); never an input.
    #[arg(long)]
    force: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Print the summary as JSON (schema in docs/JSON.md).
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let to = args.to.unwrap_or(if args.model.is_dir() {
        Format::Gguf
    } else {
        Format::Safetensors
    });
    match to {
        Format::Safetensors => to_safetensors(args),
        Format::Gguf => to_gguf(args),
    }
}

/// Flags of the other direction are refused rather than silently ignored.
fn refuse(given: &[(bool, &str)], direction: &str) -> Result<()> {
    let bad: Vec<&str> = given.iter().filter(|(g, _)| *g).map(|(_, n)| *n).collect();
    if !bad.is_empty() {
        bail!(
            "{} only apply to the other direction, not {direction}",
            bad.join(", ")
        );
    }
    Ok(())
}

fn to_safetensors(args: Args) -> Result<ExitCode> {
    refuse(
        &[
            (args.outtype.is_some(), "--outtype"),
            (args.split_max_size.is_some(), "--split-max-size"),
            (args.split_max_tensors.is_some(), "--split-max-tensors"),
            (args.model_name.is_some(), "--model-name"),
        ],
        "--to safetensors",
    )?;
    let model = gguf::Model::open(&args.model)
        .with_context(|| format!("cannot open {}", args.model.display()))?;
    let opts = ExportOptions {
        dtype: match args.dtype.unwrap_or(Dtype::Bf16) {
            Dtype::Bf16 => OutDtype::Bf16,
            Dtype::Bf16Round => OutDtype::Bf16Round,
            Dtype::F16 => OutDtype::F16,
            Dtype::F32 => OutDtype::F32,
        },
        max_shard_bytes: parse_size(args.max_shard_size.as_deref().unwrap_or("5G"))?,
        tp: args.tp.zip(args.rank),
        overwrite: args.force,
    };
    install_interrupt_handler();
    let inputs: Vec<&Path> = model.shards().iter().map(|f| f.path()).collect();
    let out = AtomicDir::create(&args.out_dir, args.force, &inputs)?;
    let mut bar = None;
    let quiet = args.quiet || args.json;
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
        if let Some(line) = kept_wide_line(&summary.kept_wide) {
            println!("{line}");
        }
        for n in &summary.notes {
            println!("note: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One line about tensors kept wider than requested: the count, a few names, and the lossy way
/// out (the full list is in --json).
fn kept_wide_line(kept: &[String]) -> Option<String> {
    if kept.is_empty() {
        return None;
    }
    let shown: Vec<&str> = kept.iter().take(3).map(String::as_str).collect();
    let more = if kept.len() > 3 {
        format!(", ... ({} more; --json lists all)", kept.len() - 3)
    } else {
        String::new()
    };
    Some(format!(
        "kept wider than requested: {} tensor(s) whose values the requested dtype cannot hold \
         exactly ({}{more}); --dtype bf16-round rounds them (lossy)",
        kept.len(),
        shown.join(", ")
    ))
}

fn to_gguf(args: Args) -> Result<ExitCode> {
    refuse(
        &[
            (args.dtype.is_some(), "--dtype"),
            (args.max_shard_size.is_some(), "--max-shard-size"),
            (args.tp.is_some(), "--tp/--rank"),
        ],
        "--to gguf",
    )?;
    if !args.model.is_dir() {
        bail!(
            "{} is not a directory: --to gguf converts an HF checkpoint directory",
            args.model.display()
        );
    }
    let opts = ImportOptions {
        outtype: match args.outtype.unwrap_or(OutTypeArg::Auto) {
            OutTypeArg::F32 => OutType::F32,
            OutTypeArg::F16 => OutType::F16,
            OutTypeArg::Bf16 => OutType::Bf16,
            OutTypeArg::Q8_0 => OutType::Q8_0,
            OutTypeArg::Auto => OutType::Auto,
        },
        model_name: args.model_name.clone(),
        split_max_tensors: args.split_max_tensors,
        split_max_bytes: args.split_max_size.as_deref().map(parse_size).transpose()?,
    };
    let plan = import::plan(&args.model, &opts)
        .with_context(|| format!("cannot convert {}", args.model.display()))?;
    let paths = import::shard_paths(&args.out_dir, plan.shards.len());
    write_gguf(&plan, &paths, &args)?;
    let s = &plan.summary;
    if args.json {
        let mut j = serde_json::to_value(s)?;
        j["schema"] = "gguftool.convert-gguf/1".into();
        j["files"] = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .into();
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        let types: Vec<String> = s.types.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "wrote {} ({} {:?} {}, {}): {} tensors ({}; {}), {} metadata keys, {} file(s)",
            paths[0].display(),
            s.arch,
            s.name.as_deref().unwrap_or(""),
            s.size_label.as_deref().unwrap_or(""),
            s.file_type,
            s.tensors,
            human_bytes(s.bytes),
            types.join(", "),
            s.metadata_keys,
            paths.len()
        );
        if !s.duplicated_keys.is_empty() {
            println!(
                "note: written twice as llama.cpp's converter does (last value kept): {}",
                s.duplicated_keys.join(", ")
            );
        }
        for n in &s.notes {
            println!("note: {n}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The one place GGUF output files are created: each shard as `NAME.partial`, all renamed only
/// after every shard was written and synced; on error or Ctrl-C the partial files are removed.
fn write_gguf(plan: &import::Plan, paths: &[PathBuf], args: &Args) -> Result<()> {
    for p in paths {
        for input in std::fs::read_dir(&args.model)?.filter_map(|e| e.ok()) {
            if same_file(p, &input.path()) {
                bail!("refusing to overwrite input {}", p.display());
            }
        }
    }
    let total: u64 = plan.shards.iter().map(|s| s.layout.file_size()).sum();
    if let Some(free) = free_space(&paths[0]) {
        if free < total {
            bail!(
                "{} needs {} but only {} are free",
                paths[0].display(),
                human_bytes(total),
                human_bytes(free)
            );
        }
    }
    let mut files = paths
        .iter()
        .map(|p| PartialFile::create(p, args.force))
        .collect::<Result<Vec<_>>>()?;
    install_interrupt_handler();
    let bar = byte_progress(plan.summary.bytes, args.quiet || args.json, "converting");
    for (i, f) in files.iter_mut().enumerate() {
        let mut w = BufWriter::with_capacity(8 << 20, &mut f.file);
        plan.write_shard(i, &mut w, &mut |p| {
            let import::Progress::Tensor { bytes, .. } = p;
            bar.inc(bytes);
            check_interrupted().is_ok()
        })
        .with_context(|| format!("writing {} failed; nothing was written", display(&paths[i])))?;
    }
    bar.finish_and_clear();
    for f in files {
        f.commit()?;
    }
    Ok(())
}

fn display(p: &Path) -> String {
    p.display().to_string()
}
