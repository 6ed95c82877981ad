//! `gguftool edit`: change metadata or tensor names without touching tensor bytes. Each edit
//! goes to the shard that holds the key or tensor (new keys to shard 0, where llama.cpp reads
//! metadata); the other shards are copied as they are, so every shard's split keys stay right.
//! With `-o` the new files are written aside and renamed into place, data moved with
//! copy_file_range; with `--in-place` only the header is rewritten, and only when the new header
//! fits the padding before the data (else a refusal that says by how much it does not).

use crate::util::{self, human_bytes, PartialFile};
use anyhow::{bail, Context, Result};
use gguf::copy::Copier;
use gguf::edit::{self, Edit, Rewrite};
use gguf::{split, Model, Value};
use serde_json::json;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// The model (any shard of a split model).
    model: PathBuf,
    /// Write the edited model here (a split model: this name's shard prefix).
    #[arg(short, long, conflicts_with = "in_place", required_unless_present_any = ["in_place", "dry_run"])]
    output: Option<PathBuf>,
    /// Rewrite the header in place (only when it fits the existing padding).
    #[arg(long)]
    in_place: bool,
    /// Set KEY to VALUE; VALUE is parsed as the key's current type, or as TYPE (u8..u64,
    /// i8..i64, f32, f64, bool, str); a new key without TYPE is a string. Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE[:TYPE]")]
    set: Vec<String>,
    /// Remove a key. Repeatable.
    #[arg(long = "delete", value_name = "KEY")]
    delete: Vec<String>,
    /// Set tokenizer.chat_template to the contents of FILE.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Rename tensor A to B. Repeatable.
    #[arg(long = "rename-tensor", value_name = "A=B")]
    rename_tensor: Vec<String>,
    /// Allow edits that can make the file inconsistent (split.*, alignment, architecture,
    /// block/expert counts, type changes), and overwrite an existing output.
    #[arg(long)]
    force: bool,
    /// Show what would change without writing.
    #[arg(long)]
    dry_run: bool,
    /// No progress bar or summary.
    #[arg(short, long)]
    quiet: bool,
    /// Print a JSON summary (schema gguftool.edit/1).
    #[arg(long)]
    json: bool,
}

fn parse_edits(args: &Args) -> Result<Vec<Edit>> {
    let mut edits = Vec::new();
    for s in &args.set {
        let (key, rest) = s
            .split_once('=')
            .with_context(|| format!("--set {s:?}: expected KEY=VALUE[:TYPE]"))?;
        let (text, ty) = edit::split_type_suffix(rest);
        edits.push(Edit::Set {
            key: key.to_string(),
            text: text.to_string(),
            ty,
        });
    }
    for k in &args.delete {
        edits.push(Edit::Delete { key: k.clone() });
    }
    if let Some(p) = &args.chat_template {
        let t = std::fs::read_to_string(p)
            .with_context(|| format!("reading chat template {}", p.display()))?;
        edits.push(Edit::SetValue {
            key: "tokenizer.chat_template".into(),
            value: Value::String(t),
        });
    }
    for s in &args.rename_tensor {
        let (a, b) = s
            .split_once('=')
            .with_context(|| format!("--rename-tensor {s:?}: expected OLD=NEW"))?;
        edits.push(Edit::RenameTensor {
            from: a.to_string(),
            to: b.to_string(),
        });
    }
    if edits.is_empty() {
        bail!("nothing to do: give --set, --delete, --chat-template or --rename-tensor");
    }
    Ok(edits)
}

/// The one place outputs are created, so the shared atomic-output layer can replace it.
fn create_output(path: &Path, force: bool) -> Result<PartialFile> {
    PartialFile::create(path, force)
}

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let edits = parse_edits(&args)?;
    let model = Model::open(&args.model)
        .with_context(|| format!("cannot open {}", args.model.display()))?;
    let shards = model.shards();
    let mut metas: Vec<_> = shards.iter().map(|f| f.metadata().clone()).collect();
    let mut tables: Vec<_> = shards.iter().map(|f| f.tensors().to_vec()).collect();
    let mut touched = vec![false; shards.len()];
    let arch = model.architecture().map(str::to_string);
    for e in &edits {
        let target = match e {
            Edit::RenameTensor { from, .. } => model
                .tensor(from)
                .map(|t| t.shard)
                .with_context(|| format!("--rename-tensor: no tensor {from:?}"))?,
            Edit::Set { key, .. } | Edit::SetValue { key, .. } | Edit::Delete { key } => {
                metas.iter().position(|m| m.contains(key)).unwrap_or(0)
            }
        };
        match e {
            Edit::RenameTensor { from, to } => {
                if model.tensor(to).is_some() && !tables[target].iter().any(|t| &t.name == to) {
                    bail!("--rename-tensor: tensor {to:?} already exists in another shard");
                }
                edit::rename_tensor(&mut tables[target], from, to)?;
            }
            _ => edit::apply_metadata(&mut metas[target], e, args.force, arch.as_deref())?,
        }
        touched[target] = true;
    }
    let mut rewrites: Vec<Option<Rewrite>> = Vec::with_capacity(shards.len());
    for (i, f) in shards.iter().enumerate() {
        rewrites.push(if touched[i] {
            Some(edit::rewrite(f.header(), &metas[i], tables[i].clone())?)
        } else {
            None
        });
    }
    let changes = diff_summary(&model, &metas, &tables);
    if args.in_place {
        for (f, r) in shards.iter().zip(&rewrites) {
            if let Some(r) = r {
                if !r.fits_in_place {
                    let need = r.layout.header.len() as u64;
                    bail!(
                        "{}: the new header ({} bytes) does not fit the {} bytes before the tensor data \
                         (the data would have to move); write a new file with -o instead",
                        f.path().display(),
                        need,
                        r.old_data_offset
                    );
                }
            }
        }
    }
    let outputs = output_paths(&model, args.output.as_deref(), args.in_place)?;
    if args.dry_run || args.json {
        let v = json!({
            "schema": "gguftool.edit/1",
            "model": args.model,
            "dry_run": args.dry_run,
            "in_place": args.in_place,
            "changes": changes,
            "outputs": outputs,
        });
        if args.json {
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            for c in &changes {
                println!("{c}");
            }
        }
        if args.dry_run {
            return Ok(ExitCode::SUCCESS);
        }
    }
    if args.in_place {
        for (f, r) in shards.iter().zip(&rewrites) {
            let Some(r) = r else { continue };
            let mut header = Vec::with_capacity(r.layout.data_offset as usize);
            r.layout.write_header(&mut header)?;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(f.path())
                .with_context(|| format!("cannot open {} for writing", f.path().display()))?;
            // One write of the whole region before the data: header and its padding.
            file.write_all_at(&header, 0)
                .and_then(|_| file.sync_all())
                .with_context(|| format!("rewriting the header of {}", f.path().display()))?;
        }
    } else {
        write_copies(&model, &rewrites, &outputs, &args)?;
    }
    if !args.quiet && !args.json {
        for c in &changes {
            eprintln!("{c}");
        }
        eprintln!(
            "{} {}",
            if args.in_place {
                "edited in place:"
            } else {
                "wrote"
            },
            outputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Where each shard goes: the input paths in place, OUT for one file, OUT's shard names for a
/// split model.
fn output_paths(model: &Model, out: Option<&Path>, in_place: bool) -> Result<Vec<PathBuf>> {
    let shards = model.shards();
    if in_place {
        return Ok(shards.iter().map(|f| f.path().to_path_buf()).collect());
    }
    let Some(out) = out else {
        return Ok(Vec::new());
    };
    let paths = if shards.len() == 1 {
        vec![out.to_path_buf()]
    } else {
        let n = shards.len() as u32;
        let prefix = match split::parse_shard_name(out) {
            Some((p, _, count)) if count == n => p,
            Some((_, _, count)) => bail!(
                "{}: names {count} shards but the model has {n}",
                out.display()
            ),
            None => {
                let s = out.to_string_lossy();
                s.strip_suffix(".gguf").unwrap_or(&s).to_string()
            }
        };
        (0..n).map(|i| split::shard_path(&prefix, i, n)).collect()
    };
    for p in &paths {
        if shards.iter().any(|f| util::same_file(f.path(), p)) {
            bail!(
                "{} is an input file (use --in-place to edit it)",
                p.display()
            );
        }
    }
    Ok(paths)
}

fn write_copies(
    model: &Model,
    rewrites: &[Option<Rewrite>],
    outputs: &[PathBuf],
    args: &Args,
) -> Result<()> {
    let total: u64 = model.total_file_size();
    if let Some(free) = util::free_space(&outputs[0]) {
        if free < total {
            bail!(
                "not enough free space: need {}, {} available",
                human_bytes(total),
                human_bytes(free)
            );
        }
    }
    let pb = util::byte_progress(total, args.quiet || args.json, "writing");
    let mut copier = Copier::new();
    let mut files = Vec::with_capacity(outputs.len());
    for ((f, r), path) in model.shards().iter().zip(rewrites).zip(outputs) {
        let out = create_output(path, args.force)?;
        let src = f.file().context("input has no file handle")?;
        let (src_at, dst_at) = match r {
            Some(r) => {
                let mut header = Vec::with_capacity(r.layout.data_offset as usize);
                r.layout.write_header(&mut header)?;
                out.file.write_all_at(&header, 0)?;
                (r.old_data_offset, r.layout.data_offset)
            }
            None => (0, 0),
        };
        let len = f.file_size() - src_at;
        copier
            .copy(src, src_at, &out.file, dst_at, len, &mut |b| {
                pb.inc(b);
                util::check_interrupted().is_ok()
            })
            .with_context(|| format!("copying {}", f.path().display()))?;
        files.push(out);
    }
    pb.finish_and_clear();
    for f in files {
        f.commit()?;
    }
    Ok(())
}

/// One line per change, for the summary and --dry-run.
fn diff_summary(
    model: &Model,
    metas: &[gguf::Metadata],
    tables: &[Vec<gguf::TensorInfo>],
) -> Vec<String> {
    let mut out = Vec::new();
    for (i, f) in model.shards().iter().enumerate() {
        let where_ = if model.shards().len() > 1 {
            format!(" (shard {})", i + 1)
        } else {
            String::new()
        };
        for d in crate::cmd::verify::metadata_diff(f.metadata(), &metas[i]) {
            out.push(format!("{d}{where_}"));
        }
        for (a, b) in f.tensors().iter().zip(&tables[i]) {
            if a.name != b.name {
                out.push(format!(
                    "tensor {:?} renamed to {:?}{where_}",
                    a.name, b.name
                ));
            }
        }
    }
    out
}
