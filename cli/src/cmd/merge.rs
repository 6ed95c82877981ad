//! `gguftool merge`: join split shards into one file after checking the whole set, streaming the
//! tensor data (copy_file_range) into `OUT.partial`, then fsync and rename. Nothing is left at
//! OUT on any error or Ctrl-C.

use crate::util::{self, human_bytes, PartialFile};
use anyhow::{bail, Context, Result};
use gguf::copy::{hex, sha256_range, write_zeros_at, Copier};
use gguf::reader::align_up;
use gguf::writer::Layout;
use gguf::{split, GgufFile, Metadata, Model, TensorInfo, Value};
use serde_json::json;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// The first shard (siblings found by the -NNNNN-of-MMMMM.gguf pattern), or every shard.
    #[arg(required = true)]
    shards: Vec<PathBuf>,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
    /// Keep split.no, split.count = 0 and split.tensors.count like llama-gguf-split --merge
    /// (byte-identical to its output). Default: the model as it was before splitting.
    #[arg(long)]
    keep_split_keys: bool,
    /// Overwrite an existing output (a regular file only).
    #[arg(long)]
    force: bool,
    /// Do not compare the tensor names and shapes of shards 2..N with what shard 1's
    /// architecture and hyper-parameters define (for architectures whose table lags behind).
    #[arg(long)]
    skip_arch_check: bool,
    /// Re-read the output and compare every tensor's sha256 with the shards before finishing.
    #[arg(long)]
    verify: bool,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
    /// Print a JSON summary.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let t0 = Instant::now();
    // A target that can never be written (a directory, a device, a FIFO) fails before any work.
    util::check_output_file(&args.output, args.force)?;
    let model = open_set(&args.shards)?;
    let inputs: Vec<&Path> = model.shards().iter().map(|f| f.path()).collect();
    util::refuse_input_as_output(&args.output, &inputs)?;
    check_foreign(&model)?;
    if !args.skip_arch_check {
        check_against_architecture(&model)?;
    }

    let (meta, tensors) = merged_header(&model, args.keep_split_keys)?;
    let version = if args.keep_split_keys {
        3
    } else {
        model.shards()[0].version()
    };
    let layout = Layout::new(version, &meta, tensors)?;
    let total = layout.file_size();
    if let Some(free) = util::free_space(&args.output) {
        if free < total {
            bail!(
                "not enough free space for {}: need {} ({} bytes), {} available",
                args.output.display(),
                human_bytes(total),
                total,
                human_bytes(free)
            );
        }
    }

    let out = PartialFile::create(&args.output, args.force)?;
    out.file
        .set_len(0)
        .with_context(|| format!("truncate {}", out.partial_path().display()))?;
    let mut header = Vec::with_capacity(layout.data_offset as usize);
    layout.write_header(&mut header)?;
    out.file
        .write_all_at(&header, 0)
        .with_context(|| format!("write {}", out.partial_path().display()))?;

    let pb = util::byte_progress(total, args.quiet || args.json, "merging");
    pb.inc(header.len() as u64);
    let mut copier = Copier::new();
    let sources: Vec<_> = model.tensors().collect();
    for (t, src) in layout.tensors.iter().zip(&sources) {
        util::check_interrupted()?;
        let shard = &model.shards()[src.shard];
        let sf = shard.file().context("shard has no file handle")?;
        let dst_off = layout.data_offset + t.offset;
        copier
            .copy(
                sf,
                shard.data_offset() + src.info.offset,
                &out.file,
                dst_off,
                t.n_bytes(),
                &mut |n| {
                    pb.inc(n);
                    util::check_interrupted().is_ok()
                },
            )
            .with_context(|| {
                format!(
                    "copying tensor {:?} from {}",
                    t.name,
                    shard.path().display()
                )
            })?;
        let pad = align_up(t.n_bytes(), layout.alignment) - t.n_bytes();
        write_zeros_at(&out.file, dst_off + t.n_bytes(), pad)?;
        pb.inc(pad);
    }
    pb.finish_and_clear();
    let written = out.file.metadata()?.len();
    if written != total {
        bail!("output has {written} bytes, expected {total}");
    }

    let mut verified = false;
    if args.verify {
        let f = GgufFile::open(out.partial_path())?;
        let of = f.file().context("output has no file handle")?;
        let vb = util::count_progress(sources.len() as u64, args.quiet || args.json, "verifying");
        for (t, src) in f.tensors().iter().zip(&sources) {
            util::check_interrupted()?;
            let shard = &model.shards()[src.shard];
            let a = sha256_range(of, f.data_offset() + t.offset, t.n_bytes())?;
            let b = sha256_range(
                shard.file().context("shard has no file handle")?,
                shard.data_offset() + src.info.offset,
                src.info.n_bytes(),
            )?;
            if a != b || t.name != src.info.name || t.ty != src.info.ty || t.dims != src.info.dims {
                bail!(
                    "verify: tensor {:?} differs from {} (sha256 {} vs {})",
                    t.name,
                    shard.path().display(),
                    hex(&a),
                    hex(&b)
                );
            }
            vb.inc(1);
        }
        vb.finish_and_clear();
        verified = true;
    }
    out.commit()?;
    let secs = t0.elapsed().as_secs_f64();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "output": args.output,
                "bytes": total,
                "tensors": layout.tensors.len(),
                "shards": model.shards().iter().map(|f| f.path()).collect::<Vec<_>>(),
                "keep_split_keys": args.keep_split_keys,
                "copy_method": format!("{:?}", copier.method()),
                "verified": verified,
                "seconds": secs,
            }))?
        );
    } else if !args.quiet {
        eprintln!(
            "merged {} shards, {} tensors, {} into {} in {:.1}s{}",
            model.shards().len(),
            layout.tensors.len(),
            human_bytes(total),
            args.output.display(),
            secs,
            if verified { " (verified)" } else { "" }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Open the shard set: one path (siblings by name) or an explicit list.
fn open_set(paths: &[PathBuf]) -> Result<Model> {
    let model = if paths.len() == 1 {
        let m = Model::open(&paths[0])?;
        if m.shards()[0].split_info()?.is_none() {
            bail!(
                "{} is not a split shard (no split.count key): nothing to merge",
                paths[0].display()
            );
        }
        m
    } else {
        let files = paths
            .iter()
            .map(GgufFile::open)
            .collect::<gguf::Result<Vec<_>>>()?;
        Model::from_shards(files)?
    };
    Ok(model)
}

/// Refuse shards that visibly belong to another model: different alignment than the split
/// tool writes, or tensor types impossible for shard 1's file type.
fn check_foreign(model: &Model) -> Result<()> {
    let first = &model.shards()[0];
    let float_file = matches!(
        first
            .metadata()
            .get("general.file_type")
            .and_then(Value::as_u64),
        Some(0 | 1 | 32)
    );
    for f in model.shards() {
        if f.alignment() != first.alignment() && f.metadata().contains("general.alignment") {
            bail!(
                "{}: general.alignment {} differs from {}'s {}",
                f.path().display(),
                f.alignment(),
                first.path().display(),
                first.alignment()
            );
        }
        if float_file {
            if let Some(t) = f.tensors().iter().find(|t| t.ty.is_quantized()) {
                bail!(
                    "{}: tensor {:?} is {} but {} is an unquantized (F32/F16/BF16) model: shard of another model",
                    f.path().display(),
                    t.name,
                    t.ty,
                    first.path().display()
                );
            }
        }
    }
    let quant_file = !float_file && first.tensors().iter().any(|t| t.ty.is_quantized());
    for f in &model.shards()[1..] {
        // Shards after the first carry only split.* keys; if one says what it is, it must agree.
        for key in ["general.architecture", "general.file_type"] {
            if let (Some(a), Some(b)) = (f.metadata().get(key), first.metadata().get(key)) {
                if a != b {
                    bail!(
                        "{}: {key} is {} but {} says {}: shard of another model",
                        f.path().display(),
                        a.display_summary(4),
                        first.path().display(),
                        b.display_summary(4)
                    );
                }
            }
        }
        let matrices: Vec<&TensorInfo> = f.tensors().iter().filter(|t| t.dims.len() >= 2).collect();
        if quant_file && matrices.len() >= 4 && matrices.iter().all(|t| !t.ty.is_quantized()) {
            bail!(
                "{}: {} matrices and none quantized, but {} is a quantized model: shard of another model",
                f.path().display(),
                matrices.len(),
                first.path().display()
            );
        }
    }
    Ok(())
}

/// Shards 2..N carry no metadata of their own, so a shard of another model with the same split
/// layout passes every count check: compare its tensors with what shard 1's architecture table
/// and hyper-parameters say they must be (names, ggml shapes). Architectures without a table
/// cannot be checked this way.
fn check_against_architecture(model: &Model) -> Result<()> {
    let Ok(report) = mappings::check_architecture(model) else {
        return Ok(());
    };
    let later = |name: &str| model.tensor(name).filter(|t| t.shard > 0);
    for w in &report.wrong_shapes {
        if let Some(t) = later(&w.name) {
            bail!(
                "{}: tensor {:?} has shape {:?} but {}'s {} hyper-parameters give {:?}: shard of another model (--skip-arch-check to merge anyway)",
                model.shards()[t.shard].path().display(),
                w.name,
                w.got,
                model.path().display(),
                report.arch,
                w.expected
            );
        }
    }
    for u in &report.unexpected_tensors {
        if let Some(t) = later(&u.name) {
            bail!(
                "{}: tensor {:?} does not belong to {}'s {} architecture ({}): shard of another model (--skip-arch-check to merge anyway)",
                model.shards()[t.shard].path().display(),
                u.name,
                model.path().display(),
                report.arch,
                u.reason
            );
        }
    }
    Ok(())
}

/// Shard 1's metadata (split keys dropped, or kept llama-gguf-split style) and every tensor.
fn merged_header(model: &Model, keep_split_keys: bool) -> Result<(Metadata, Vec<TensorInfo>)> {
    let mut meta = model.metadata().clone();
    let mut tensors: Vec<TensorInfo> = model.tensors().map(|t| t.info.clone()).collect();
    if keep_split_keys {
        // llama-gguf-split re-sets split.count to 0 (moving it last) and writes n_dims without
        // trailing unit dimensions (ggml_n_dims).
        meta.remove(split::KEY_COUNT);
        meta.set(split::KEY_COUNT, Value::U16(0));
        // The set id only ties shards together; a merged file has none.
        meta.remove(split::KEY_SET_ID);
        for t in &mut tensors {
            while t.dims.len() > 1 && t.dims.last() == Some(&1) {
                t.dims.pop();
            }
        }
    } else {
        meta.retain(|k, _| !k.starts_with("split."));
    }
    Ok((meta, tensors))
}
