//! `gguftool split`: write llama.cpp-compatible shards (same naming, keys and first-shard
//! metadata as llama-gguf-split), all-or-nothing: shards appear under their names only when
//! every one is complete.

use crate::util::{self, human_bytes, PartialFile, PartialSet};
use anyhow::{bail, Context, Result};
use gguf::copy::{write_zeros_at, Copier};
use gguf::reader::align_up;
use gguf::writer::Layout;
use gguf::{split, Metadata, Model, TensorInfo, Value};
use serde_json::json;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("limit").required(true).args(["max_size", "max_tensors"])))]
pub struct Args {
    /// The model to split (a file, or any shard of a split model to re-split).
    model: PathBuf,
    /// Output prefix: shards are PREFIX-00001-of-0000N.gguf.
    #[arg(short, long)]
    output: String,
    /// Largest tensor data per shard (decimal units: 50G = 50*10^9 bytes, as gguf-split).
    #[arg(long, value_name = "SIZE", visible_alias = "split-max-size")]
    max_size: Option<String>,
    /// Most tensors per shard.
    #[arg(long, value_name = "N", visible_alias = "split-max-tensors")]
    max_tensors: Option<usize>,
    /// Mark every shard with a set identifier (`split.set_id`, a key llama.cpp ignores) so that
    /// merge, verify and the loaders refuse a shard of another model. Without a value it is
    /// derived from the model and the plan. Off by default: the shards are then byte-identical
    /// to llama-gguf-split's.
    #[arg(long, value_name = "ID", num_args = 0..=1, default_missing_value = "")]
    set_id: Option<String>,
    /// Print the plan, write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Overwrite existing shards.
    #[arg(long)]
    force: bool,
    #[arg(short, long)]
    quiet: bool,
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let model = Model::open(&args.model)?;
    let max_bytes = args.max_size.as_deref().map(util::parse_size).transpose()?;
    if args.max_tensors == Some(0) {
        bail!("--max-tensors must be at least 1");
    }
    let tensors: Vec<_> = model.tensors().collect();
    let sizes: Vec<u64> = tensors.iter().map(|t| t.info.n_bytes()).collect();
    let plan = split::plan(&sizes, args.max_tensors, max_bytes);
    let n = plan.len();
    if n > u16::MAX as usize {
        bail!("{n} shards: split.count is a u16");
    }
    let total_tensors =
        i32::try_from(tensors.len()).context("too many tensors for split.tensors.count (i32)")?;

    let mut base = model.metadata().clone();
    base.retain(|k, _| !k.starts_with("split."));
    let set_id = match args.set_id.as_deref() {
        None => None,
        Some("") => Some(split::derive_set_id(
            &base,
            tensors.iter().map(|t| (t.info, model.data(t))),
            &plan,
        )),
        Some(id) if id.chars().all(|c| c.is_ascii_graphic()) && id.len() <= 128 => {
            Some(id.to_string())
        }
        Some(id) => bail!("--set-id {id:?}: use up to 128 printable ASCII characters"),
    };
    let mut layouts = Vec::with_capacity(n);
    for (i, range) in plan.iter().enumerate() {
        let mut meta = if i == 0 {
            base.clone()
        } else {
            Metadata::new(model.path())
        };
        // Order as llama-gguf-split leaves them: split.no, split.tensors.count, split.count.
        meta.set(split::KEY_NO, Value::U16(i as u16));
        meta.set(split::KEY_TENSORS_COUNT, Value::I32(total_tensors));
        meta.set(split::KEY_COUNT, Value::U16(n as u16));
        if let Some(id) = &set_id {
            meta.set(split::KEY_SET_ID, Value::String(id.clone()));
        }
        if i > 0 {
            if let Some(a) = base.get("general.alignment") {
                // Shards after the first need the alignment too, or readers assume 32.
                meta.set("general.alignment", a.clone());
            }
        }
        let infos: Vec<TensorInfo> = tensors[range.clone()]
            .iter()
            .map(|t| t.info.clone())
            .collect();
        layouts.push(Layout::new(3, &meta, infos)?);
    }
    let paths: Vec<PathBuf> = (0..n)
        .map(|i| split::shard_path(&args.output, i as u32, n as u32))
        .collect();
    let total: u64 = layouts.iter().map(Layout::file_size).sum();

    if args.dry_run || args.json {
        let shards: Vec<_> = paths
            .iter()
            .zip(&layouts)
            .map(|(p, l)| json!({"path": p, "tensors": l.tensors.len(), "bytes": l.file_size()}))
            .collect();
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(
                    &json!({"shards": shards, "bytes": total, "dry_run": args.dry_run, "set_id": set_id})
                )?
            );
        } else {
            for (p, l) in paths.iter().zip(&layouts) {
                println!(
                    "{}  {} tensors  {}",
                    p.display(),
                    l.tensors.len(),
                    human_bytes(l.file_size())
                );
            }
        }
        if args.dry_run {
            return Ok(ExitCode::SUCCESS);
        }
    }
    let inputs: Vec<&Path> = model.shards().iter().map(|f| f.path()).collect();
    for p in &paths {
        util::check_output_file(p, args.force)?;
        util::refuse_input_as_output(p, &inputs)?;
    }
    if let Some(free) = util::free_space(&paths[0]) {
        if free < total {
            bail!(
                "not enough free space: need {}, {} available",
                human_bytes(total),
                human_bytes(free)
            );
        }
    }

    let pb = util::byte_progress(total, args.quiet || args.json, "splitting");
    let mut copier = Copier::new();
    let mut outs = PartialSet::default();
    let mut k = 0usize;
    for (p, layout) in paths.iter().zip(&layouts) {
        let out = outs.push(PartialFile::create(p, args.force)?);
        let mut header = Vec::with_capacity(layout.data_offset as usize);
        layout.write_header(&mut header)?;
        out.file.write_all_at(&header, 0)?;
        pb.inc(header.len() as u64);
        for t in &layout.tensors {
            util::check_interrupted()?;
            let src = &tensors[k];
            k += 1;
            let shard = &model.shards()[src.shard];
            let off = layout.data_offset + t.offset;
            copier
                .copy(
                    shard.file().context("input has no file handle")?,
                    shard.data_offset() + src.info.offset,
                    &out.file,
                    off,
                    t.n_bytes(),
                    &mut |b| {
                        pb.inc(b);
                        util::check_interrupted().is_ok()
                    },
                )
                .with_context(|| format!("copying tensor {:?}", t.name))?;
            let pad = align_up(t.n_bytes(), layout.alignment) - t.n_bytes();
            write_zeros_at(&out.file, off + t.n_bytes(), pad)?;
            pb.inc(pad);
        }
    }
    pb.finish_and_clear();
    // Rename only when every shard is complete: a failure above drops (removes) all partials.
    outs.commit()?;
    if !args.quiet && !args.json {
        eprintln!(
            "wrote {n} shards ({}) with prefix {}",
            human_bytes(total),
            args.output
        );
    }
    Ok(ExitCode::SUCCESS)
}
