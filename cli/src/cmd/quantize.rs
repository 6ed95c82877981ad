//! `gguftool quantize IN OUT TYPE`: llama-quantize's job with its exact output. The per-tensor
//! types come from `gguf::quant::quantize_mix` (llama.cpp's rules), the bytes from the scalar
//! quantizers (`gguf::quant::quantize`), run in parallel over rows. Tensors are streamed: a
//! slab of rows is converted to f32, quantized and written at its final offset, so memory stays
//! at one slab whatever the model size; unchanged tensors are copied with copy_file_range.
//! The output appears under its name only when complete (`.partial` + rename).

use crate::util::{self, human_bytes, PartialFile};
use anyhow::{bail, Context, Result};
use gguf::copy::{write_zeros_at, Copier};
use gguf::quant::quantize::{can_quantize, requires_imatrix};
use gguf::quant::quantize_fast::quantize_rows_par;
use gguf::quant::quantize_imatrix::Imatrix;
use gguf::quant::quantize_mix::{plan, FileType, MixHparams, MixOptions, MixTensor, PlannedTensor};
use gguf::reader::align_up;
use gguf::writer::Layout;
use gguf::{split, GgmlType, Metadata, Model, TensorInfo, TensorRef, Value};
use serde_json::json;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Input GGUF (any shard of a split model).
    input: PathBuf,
    /// Output GGUF (with --split-max-size: the shard prefix, `OUT-00001-of-0000N.gguf`).
    output: PathBuf,
    /// llama.cpp file type: Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q4_K_M, Q4_K_S, Q3_K_L, Q3_K_M, Q3_K_S,
    /// Q2_K, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4_MOE, F16, BF16, F32, ...
    #[arg(value_name = "TYPE")]
    ftype: String,
    /// Quantize tensors whose name matches the regex PATTERN (searched, lower-cased as
    /// llama-quantize does) to TYPE, e.g. `attn_k_b=q8_0`. First match wins; repeatable.
    #[arg(long = "tensor-type", value_name = "PATTERN=TYPE")]
    tensor_type: Vec<String>,
    /// ggml type for output.weight.
    #[arg(long, value_name = "TYPE")]
    output_tensor_type: Option<String>,
    /// ggml type for the token embeddings.
    #[arg(long, value_name = "TYPE")]
    token_embedding_type: Option<String>,
    /// Leave output.weight as it is.
    #[arg(long)]
    leave_output_tensor: bool,
    /// Allow requantizing tensors that are already quantized (loses quality).
    #[arg(long)]
    allow_requantize: bool,
    /// No k-quant mixture: the file type's default type for every quantizable tensor.
    #[arg(long)]
    pure: bool,
    /// Importance matrix (llama-imatrix GGUF output).
    #[arg(long, value_name = "FILE")]
    imatrix: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Write shards of at most SIZE bytes of tensor data (50G, 500M; gguf-split's rule).
    #[arg(long, value_name = "SIZE")]
    split_max_size: Option<String>,
    /// Show the plan (type and size per tensor) without writing anything.
    #[arg(long)]
    dry_run: bool,
    /// Overwrite an existing output.
    #[arg(long)]
    force: bool,
    /// No progress bar or summary.
    #[arg(short, long)]
    quiet: bool,
    /// Print a JSON summary (schema gguftool.quantize/1, docs/JSON.md).
    #[arg(long)]
    json: bool,
}

/// A tensor as it will be written.
struct OutTensor<'m> {
    src: TensorRef<'m>,
    target: GgmlType,
    imatrix: Option<&'m [f32]>,
}

fn parse_type(s: &str, flag: &str) -> Result<GgmlType> {
    GgmlType::from_name(s).with_context(|| format!("{flag}: unknown ggml type {s:?}"))
}

/// `PATTERN=TYPE` as llama-quantize parses it (pattern lower-cased).
fn parse_tensor_type(s: &str) -> Result<(String, GgmlType)> {
    let (p, t) = s
        .split_once('=')
        .with_context(|| format!("--tensor-type {s:?}: expected PATTERN=TYPE"))?;
    if p.is_empty() {
        bail!("--tensor-type {s:?}: missing tensor name pattern");
    }
    if t.is_empty() {
        bail!("--tensor-type {s:?}: missing type");
    }
    let p = p.to_lowercase();
    regex::Regex::new(&p).with_context(|| format!("--tensor-type {s:?}: bad regex"))?;
    Ok((p, parse_type(t, "--tensor-type")?))
}

/// The one place outputs are created, so the shared atomic-output layer can replace it.
fn create_output(path: &Path, force: bool) -> Result<PartialFile> {
    PartialFile::create(path, force)
}

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let t0 = Instant::now();
    let ftype = FileType::parse(&args.ftype).with_context(|| {
        let names: Vec<&str> = FileType::all().map(FileType::name).collect();
        format!(
            "unknown file type {:?} (one of {})",
            args.ftype,
            names.join(", ")
        )
    })?;
    let mut opts = MixOptions {
        pure: args.pure,
        leave_output_tensor: args.leave_output_tensor,
        ..Default::default()
    };
    if let Some(t) = &args.output_tensor_type {
        opts.output_tensor_type = Some(parse_type(t, "--output-tensor-type")?);
    }
    if let Some(t) = &args.token_embedding_type {
        opts.token_embedding_type = Some(parse_type(t, "--token-embedding-type")?);
    }
    for s in &args.tensor_type {
        opts.tensor_types.push(parse_tensor_type(s)?);
    }
    let regexes: Vec<(String, regex::Regex)> = opts
        .tensor_types
        .iter()
        .filter_map(|(p, _)| regex::Regex::new(p).ok().map(|r| (p.clone(), r)))
        .collect();
    let matcher = |p: &str, name: &str| regexes.iter().any(|(q, r)| q == p && r.is_match(name));

    let model = Model::open(&args.input)
        .with_context(|| format!("cannot open {}", args.input.display()))?;
    let imatrix = match &args.imatrix {
        Some(p) => Some(Imatrix::open(p)?),
        None => None,
    };
    opts.has_imatrix = imatrix.is_some();
    let hp = MixHparams::from_metadata(model.metadata())?;
    let inputs: Vec<TensorRef<'_>> = model.tensors().collect();
    let mix: Vec<MixTensor<'_>> = inputs
        .iter()
        .map(|t| MixTensor {
            name: &t.info.name,
            dims: &t.info.dims,
            ty: t.info.ty,
        })
        .collect();
    let planned = plan(&mix, &hp, ftype, &opts, &matcher)?;
    let outs = resolve(&planned, &inputs, imatrix.as_ref(), &args)?;

    let metadata = output_metadata(model.metadata(), ftype, imatrix.as_ref(), &args)?;
    let shards = lay_out(&metadata, &outs, &args)?;
    let total_in: u64 = outs.iter().map(|o| o.src.info.n_bytes()).sum();
    let total_out: u64 = shards.iter().map(|(_, l)| l.file_size()).sum();

    if args.dry_run {
        print_plan(&outs, &shards, &args)?;
        return Ok(ExitCode::SUCCESS);
    }
    for (p, _) in &shards {
        if model.shards().iter().any(|f| util::same_file(f.path(), p)) {
            bail!("output {} is an input file", p.display());
        }
    }
    if let Some(free) = util::free_space(&shards[0].0) {
        if free < total_out {
            bail!(
                "not enough free space: need {}, {} available",
                human_bytes(total_out),
                human_bytes(free)
            );
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.unwrap_or(0))
        .build()
        .context("cannot start worker threads")?;
    let pb = util::byte_progress(total_in, args.quiet || args.json, "quantizing");
    let mut files = Vec::with_capacity(shards.len());
    let mut k = 0usize;
    let mut copier = Copier::new();
    for (path, layout) in &shards {
        let out = create_output(path, args.force)?;
        let mut header = Vec::with_capacity(layout.data_offset as usize);
        layout.write_header(&mut header)?;
        out.file
            .write_all_at(&header, 0)
            .with_context(|| format!("writing {}", out.partial_path().display()))?;
        for t in &layout.tensors {
            let o = &outs[k];
            k += 1;
            let at = layout.data_offset + t.offset;
            pool.install(|| write_tensor(&model, o, &out.file, at, &mut copier, &pb))
                .with_context(|| format!("tensor {:?}", t.name))?;
            let pad = align_up(t.n_bytes(), layout.alignment) - t.n_bytes();
            write_zeros_at(&out.file, at + t.n_bytes(), pad)?;
        }
        files.push(out);
    }
    pb.finish_and_clear();
    // Renamed only when every file is complete; an error above removes all partial files.
    for f in files {
        f.commit()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    if args.json {
        let v = json!({
            "schema": "gguftool.quantize/1",
            "input": args.input,
            "ftype": ftype.name(),
            "outputs": shards.iter().map(|(p, l)| json!({"path": p, "bytes": l.file_size(), "tensors": l.tensors.len()})).collect::<Vec<_>>(),
            "input_tensor_bytes": total_in,
            "output_bytes": total_out,
            "fallbacks": planned.iter().filter(|p| p.fell_back).count(),
            "seconds": secs,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if !args.quiet {
        let fallbacks = planned.iter().filter(|p| p.fell_back).count();
        eprintln!(
            "quantized {} tensors to {}: {} -> {} in {:.2}s{}",
            outs.len(),
            ftype,
            human_bytes(total_in),
            human_bytes(total_out),
            secs,
            if fallbacks > 0 {
                format!(" ({fallbacks} tensor(s) used a fallback type: rows not a multiple of the block size)")
            } else {
                String::new()
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Check the plan against what can be done and attach importance-matrix slices.
fn resolve<'m>(
    planned: &[PlannedTensor],
    inputs: &[TensorRef<'m>],
    imatrix: Option<&'m Imatrix>,
    args: &Args,
) -> Result<Vec<OutTensor<'m>>> {
    // As llama-quantize: the importance-matrix requirement is checked for every tensor before
    // anything else, so its error is the one a user sees.
    if imatrix.is_none() {
        if let Some(p) = planned.iter().find(|p| {
            p.target != inputs[p.index].info.ty
                && (p.requires_imatrix || requires_imatrix(p.target))
        }) {
            bail!(
                "this quantization requires an importance matrix (--imatrix FILE): tensor {:?} would be {}",
                inputs[p.index].info.name,
                p.target
            );
        }
    }
    let mut outs = Vec::with_capacity(planned.len());
    for p in planned {
        let src = inputs[p.index];
        let name = &src.info.name;
        let changes = p.target != src.info.ty;
        let mut im = None;
        if changes {
            if let Some(m) = imatrix {
                if let Some(v) = m.entries.get(name.as_str()) {
                    let ne0 = src.info.dims.first().copied().unwrap_or(1);
                    let ne2 = src.info.dims.get(2).copied().unwrap_or(1);
                    if v.len() as u64 == ne0 * ne2 {
                        im = Some(v.as_slice());
                    } else if !matches!(
                        name.as_str(),
                        "token_embd.weight" | "per_layer_token_embd.weight"
                    ) {
                        bail!(
                            "tensor {name:?}: importance matrix has {} values, the tensor needs {}",
                            v.len(),
                            ne0 * ne2
                        );
                    }
                }
            }
            if im.is_none() && (p.requires_imatrix || requires_imatrix(p.target)) {
                bail!(
                    "tensor {name:?}: {} needs an importance matrix (--imatrix FILE)",
                    p.target
                );
            }
            if src.info.ty.is_quantized() && !args.allow_requantize {
                bail!(
                    "tensor {name:?} is already {}: requantizing loses quality; pass --allow-requantize to do it anyway",
                    src.info.ty
                );
            }
            if !can_quantize(p.target) {
                bail!(
                    "tensor {name:?}: quantizing to {} is not implemented yet",
                    p.target
                );
            }
        }
        outs.push(OutTensor {
            src,
            target: p.target,
            imatrix: im,
        });
    }
    Ok(outs)
}

/// llama-quantize's metadata: the input's keys in order, `general.quantization_version` and
/// `general.file_type` moved to the end, split keys dropped, importance-matrix keys after.
fn output_metadata(
    input: &Metadata,
    ftype: FileType,
    imatrix: Option<&Imatrix>,
    args: &Args,
) -> Result<Metadata> {
    let mut m = input.clone();
    // ggml's GGML_QNT_VERSION.
    for (k, v) in [
        ("general.quantization_version", Value::U32(2)),
        ("general.file_type", Value::U32(ftype.id())),
    ] {
        m.remove(k);
        m.set(k, v);
    }
    for k in [split::KEY_NO, split::KEY_COUNT, split::KEY_TENSORS_COUNT] {
        m.remove(k);
    }
    if let (Some(im), Some(path)) = (imatrix, &args.imatrix) {
        // llama-quantize passes these as overrides with 127-byte string buffers.
        let cap = |s: &str| {
            let mut end = s.len().min(127);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s[..end].to_string()
        };
        let mut set = |k: &str, v: Value| {
            m.remove(k);
            m.set(k, v);
        };
        set(
            "quantize.imatrix.file",
            Value::String(cap(&path.to_string_lossy())),
        );
        if let Some(d) = im.datasets.first() {
            set("quantize.imatrix.dataset", Value::String(cap(d)));
        }
        set(
            "quantize.imatrix.entries_count",
            Value::U32(im.entries.len() as u32),
        );
        if im.chunk_count > 0 {
            set("quantize.imatrix.chunks_count", Value::U32(im.chunk_count));
        }
    }
    Ok(m)
}

/// Output files and their layouts: one file, or gguf-split-style shards.
fn lay_out(
    metadata: &Metadata,
    outs: &[OutTensor<'_>],
    args: &Args,
) -> Result<Vec<(PathBuf, Layout)>> {
    let infos: Vec<TensorInfo> = outs
        .iter()
        .map(|o| TensorInfo {
            name: o.src.info.name.clone(),
            dims: o.src.info.dims.clone(),
            ty: o.target,
            offset: 0,
        })
        .collect();
    let Some(max) = &args.split_max_size else {
        return Ok(vec![(
            args.output.clone(),
            Layout::new(3, metadata, infos)?,
        )]);
    };
    let max = util::parse_size(max)?;
    let sizes: Vec<u64> = infos.iter().map(TensorInfo::n_bytes).collect();
    let ranges = split::plan(&sizes, None, Some(max));
    let n = ranges.len();
    if n > usize::from(u16::MAX) {
        bail!("{n} shards: split.count is a u16");
    }
    let total = i32::try_from(infos.len()).context("too many tensors for split.tensors.count")?;
    let prefix = args.output.to_string_lossy();
    let prefix = prefix.strip_suffix(".gguf").unwrap_or(&prefix).to_string();
    let mut out = Vec::with_capacity(n);
    for (i, r) in ranges.into_iter().enumerate() {
        // Shard 0 carries all metadata, the others only what a reader needs to find its place;
        // split keys in the order llama-gguf-split writes them.
        let mut m = if i == 0 {
            metadata.clone()
        } else {
            let mut m = Metadata::new(metadata.file());
            if let Some(a) = metadata.get("general.alignment") {
                m.set("general.alignment", a.clone());
            }
            m
        };
        m.set(split::KEY_NO, Value::U16(i as u16));
        m.set(split::KEY_TENSORS_COUNT, Value::I32(total));
        m.set(split::KEY_COUNT, Value::U16(n as u16));
        let layout = Layout::new(3, &m, infos[r].to_vec())?;
        out.push((split::shard_path(&prefix, i as u32, n as u32), layout));
    }
    Ok(out)
}

/// Rows per slab: a bound on the f32 buffer (and the quantized one) whatever the tensor size.
const SLAB_ELEMS: usize = 16 << 20;

fn write_tensor(
    model: &Model,
    o: &OutTensor<'_>,
    file: &std::fs::File,
    at: u64,
    copier: &mut Copier,
    pb: &indicatif::ProgressBar,
) -> Result<()> {
    util::check_interrupted()?;
    let info = o.src.info;
    if o.target == info.ty {
        let shard = &model.shards()[o.src.shard];
        copier.copy(
            shard.file().context("input has no file handle")?,
            shard.data_offset() + info.offset,
            file,
            at,
            info.n_bytes(),
            &mut |b| {
                pb.inc(b);
                util::check_interrupted().is_ok()
            },
        )?;
        return Ok(());
    }
    let data = model.data(&o.src);
    let n_per_row = info.dims.first().copied().unwrap_or(1) as usize;
    let rows_per_expert = info.dims.get(1).copied().unwrap_or(1).max(1) as usize;
    let n_rows = (info.n_elements() as usize)
        .checked_div(n_per_row)
        .unwrap_or(0);
    let src_row = info.ty.row_bytes(n_per_row as u64).context("bad row")? as usize;
    let dst_row = o.target.row_bytes(n_per_row as u64).context("bad row")? as usize;
    let slab_rows = (SLAB_ELEMS / n_per_row.max(1)).max(1);
    let mut f32s = vec![0.0f32; slab_rows.min(n_rows) * n_per_row];
    let mut q = vec![0u8; slab_rows.min(n_rows) * dst_row];
    let mut row = 0usize;
    while row < n_rows {
        util::check_interrupted()?;
        let nr = slab_rows.min(n_rows - row);
        let src = &data[row * src_row..(row + nr) * src_row];
        let x = &mut f32s[..nr * n_per_row];
        gguf::quant::dequantize(info.ty, src, x)?;
        let y = &mut q[..nr * dst_row];
        let first = row;
        let im = o.imatrix;
        quantize_rows_par(
            o.target,
            x,
            n_per_row,
            &|r| {
                im.map(|v| {
                    let e = (first + r) / rows_per_expert;
                    &v[e * n_per_row..(e + 1) * n_per_row]
                })
            },
            y,
        )?;
        file.write_all_at(y, at + (row * dst_row) as u64)?;
        pb.inc((nr * src_row) as u64);
        row += nr;
    }
    Ok(())
}

fn print_plan(outs: &[OutTensor<'_>], shards: &[(PathBuf, Layout)], args: &Args) -> Result<()> {
    let rows: Vec<_> = outs
        .iter()
        .map(|o| {
            let i = o.src.info;
            let n = TensorInfo {
                ty: o.target,
                ..i.clone()
            }
            .n_bytes();
            (i, n)
        })
        .collect();
    if args.json {
        let v = json!({
            "schema": "gguftool.quantize/1",
            "dry_run": true,
            "tensors": rows.iter().zip(outs).map(|((i, n), o)| json!({
                "name": i.name, "ne": i.dims, "type": i.ty.name(), "new_type": o.target.name(),
                "bytes": i.n_bytes(), "new_bytes": n,
            })).collect::<Vec<_>>(),
            "outputs": shards.iter().map(|(p, l)| json!({"path": p, "bytes": l.file_size()})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    for ((i, n), o) in rows.iter().zip(outs) {
        println!(
            "{:<40} {:>24} {:>7} -> {:<7} {:>10} -> {:>10}",
            i.name,
            format!("{:?}", i.dims),
            i.ty.name(),
            o.target.name(),
            human_bytes(i.n_bytes()),
            human_bytes(*n)
        );
    }
    for (p, l) in shards {
        println!("{}: {}", p.display(), human_bytes(l.file_size()));
    }
    Ok(())
}
