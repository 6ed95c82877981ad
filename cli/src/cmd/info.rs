//! `gguftool info`: what a GGUF model is — architecture, size, types, split, metadata and the
//! tensor table — read from the header region only, so a 400 GB model answers as fast as 4 MB.

use crate::util::{file_type_name, human_bytes, name_matches, value_json, value_type_json};
use anyhow::Result;
use gguf::{GgufFile, Model};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file or any shard of a split model.
    model: PathBuf,
    /// Print one JSON object (schema `gguftool.info/1`, see docs/JSON.md).
    #[arg(long)]
    json: bool,
    /// Include the tensor table.
    #[arg(long)]
    tensors: bool,
    /// Only tensors whose name matches (glob with * and ?, else substring); implies --tensors.
    #[arg(long, value_name = "PATTERN")]
    filter: Option<String>,
    /// Print long metadata arrays in full instead of a summary.
    #[arg(long)]
    full: bool,
    /// Describe only the given file, not the whole split model.
    #[arg(long)]
    shard_only: bool,
}

/// Arrays longer than this are summarized unless --full.
const SUMMARY_ITEMS: usize = 16;

pub fn run(args: Args) -> Result<ExitCode> {
    let model = if args.shard_only {
        // A lone shard is not a complete model; describe it as the file it is.
        Model::from_shards_unchecked(vec![GgufFile::open(&args.model)?])
    } else {
        Model::open(&args.model)?
    };
    let show_tensors = args.tensors || args.filter.is_some();
    let meta = model.metadata();
    let max_items = (!args.full).then_some(SUMMARY_ITEMS);

    let mut type_counts: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    let mut n_params = 0u64;
    let mut data_bytes = 0u64;
    for t in model.tensors() {
        let e = type_counts.entry(t.info.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.info.n_bytes();
        n_params += t.info.n_elements();
        data_bytes += t.info.n_bytes();
    }
    let file_type = meta.get("general.file_type").and_then(|v| v.as_u64());
    let ft_name = file_type.and_then(file_type_name);
    let split = model.shards()[0].split_info()?;

    let tensors: Vec<serde_json::Value> = if show_tensors {
        model
            .tensors()
            .filter(|t| {
                args.filter
                    .as_deref()
                    .is_none_or(|p| name_matches(p, &t.info.name))
            })
            .map(|t| {
                let f = &model.shards()[t.shard];
                json!({
                    "name": t.info.name,
                    "type": t.info.ty.name(),
                    "ne": t.info.dims,
                    "shape": t.info.shape_rowmajor(),
                    "n_elements": t.info.n_elements(),
                    "n_bytes": t.info.n_bytes(),
                    "offset": f.data_offset() + t.info.offset,
                    "shard": t.shard,
                    "file": f.path(),
                })
            })
            .collect()
    } else {
        Vec::new()
    };

    if args.json {
        let files: Vec<serde_json::Value> = model
            .shards()
            .iter()
            .map(|f| {
                json!({
                    "path": f.path(),
                    "size": f.file_size(),
                    "version": f.version(),
                    "alignment": f.alignment(),
                    "data_offset": f.data_offset(),
                    "n_tensors": f.tensors().len(),
                    "n_kv": f.metadata().len(),
                    "split": f.split_info().ok().flatten(),
                })
            })
            .collect();
        let metadata: Vec<serde_json::Value> = meta
            .iter()
            .map(|(k, v)| json!({"key": k, "type": value_type_json(v), "value": value_json(v, max_items)}))
            .collect();
        let mut out = json!({
            "schema": "gguftool.info/1",
            "path": model.path(),
            "architecture": model.architecture(),
            "name": meta.get("general.name").and_then(|v| v.as_str()),
            "file_type": file_type.map(|id| json!({"id": id, "name": ft_name})),
            "parameters": n_params,
            "file_size": model.total_file_size(),
            "tensor_data_bytes": data_bytes,
            "n_tensors": model.n_tensors(),
            "tensor_types": type_counts.iter().map(|(k, (n, b))| (k.to_string(), json!({"count": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
            "split": split.map(|s| json!({"count": s.count, "tensors_count": s.tensors_count, "shards": model.shards().len()})),
            "files": files,
            "metadata": metadata,
        });
        if show_tensors {
            out["tensors"] = tensors.into();
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }

    println!("model:        {}", model.path().display());
    println!("architecture: {}", model.architecture().unwrap_or("(none)"));
    if let Some(n) = meta.get("general.name").and_then(|v| v.as_str()) {
        println!("name:         {n}");
    }
    match (file_type, ft_name) {
        (Some(id), Some(n)) => println!("file type:    {n} ({id})"),
        (Some(id), None) => println!("file type:    unknown ({id})"),
        _ => {}
    }
    println!(
        "parameters:   {} ({:.3} B)",
        n_params,
        n_params as f64 / 1e9
    );
    println!(
        "file size:    {} ({} bytes) in {} file(s); tensor data {}",
        human_bytes(model.total_file_size()),
        model.total_file_size(),
        model.shards().len(),
        human_bytes(data_bytes)
    );
    println!(
        "gguf:         v{}, alignment {}, {} tensors, {} metadata keys",
        model.shards()[0].version(),
        model.shards()[0].alignment(),
        model.n_tensors(),
        meta.len()
    );
    if let Some(s) = split {
        println!(
            "split:        {} shards (split.count {}, split.tensors.count {})",
            model.shards().len(),
            s.count,
            s.tensors_count.map_or("-".into(), |n| n.to_string())
        );
        for f in model.shards() {
            println!(
                "  {}  {} tensors  {}",
                f.path().display(),
                f.tensors().len(),
                human_bytes(f.file_size())
            );
        }
    }
    println!("tensor types:");
    for (k, (n, b)) in &type_counts {
        println!("  {k:<8} {n:>6} tensors  {}", human_bytes(*b));
    }
    println!("metadata:");
    for (k, v) in meta.iter() {
        let shown = match max_items {
            Some(m) => v.display_summary(m),
            None => v.display_summary(usize::MAX),
        };
        println!("  {k:<48} {:<14} {shown}", value_type_json(v));
    }
    if show_tensors {
        // Offsets are positions inside the file holding the tensor: with several shards, say
        // which one (1-based, as in the shard names).
        let split_model = model.shards().len() > 1;
        if split_model {
            println!("tensors (offset = byte offset inside the tensor's shard file):");
        } else {
            println!("tensors:");
        }
        let shard_col = |v: &str| {
            if split_model {
                format!(" {v:>5}")
            } else {
                String::new()
            }
        };
        println!(
            "  {:<44} {:<8} {:<24} {:<24}{} {:>14} {:>12}",
            "name",
            "type",
            "ne (ggml)",
            "shape (HF)",
            shard_col("shard"),
            "offset",
            "bytes"
        );
        for t in &tensors {
            let shard = t["shard"].as_u64().map_or(0, |s| s + 1).to_string();
            println!(
                "  {:<44} {:<8} {:<24} {:<24}{} {:>14} {:>12}",
                t["name"].as_str().unwrap_or(""),
                t["type"].as_str().unwrap_or(""),
                t["ne"].to_string(),
                t["shape"].to_string(),
                shard_col(&shard),
                t["offset"],
                t["n_bytes"]
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
