//! `gguftool map`: the HF <-> GGUF tensor-name table of a model (GGUF file or shard, HF checkpoint
//! directory, or names on stdin), with composite tensors (stacked experts, kv_b split, tied
//! embeddings) as single rows. `--kv-b` rebuilds HF kv_b_proj from a GGUF instead, optionally per
//! tensor-parallel rank and compared against an HF original.

use anyhow::{bail, Context, Result};
use mappings::hf::HfDir;
use mappings::{map_gguf_names, map_hf_names, Direction, GgufName, Kind, NameMap, Table};
use serde_json::json;
use std::fmt::Write as _;
use std::io::{BufRead, Read, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Clone, Copy, clap::ValueEnum)]
enum Dir {
    HfToGguf,
    GgufToHf,
}

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file (any shard of a split model), an HF checkpoint directory (or one .safetensors
    /// file), or `-` for tensor names on stdin, one per line.
    input: PathBuf,
    /// Orientation of the table; for stdin also the scheme of the input names. Defaults to the
    /// input's own scheme (gguf-to-hf for a GGUF, hf-to-gguf for an HF checkpoint).
    #[arg(long, value_enum)]
    direction: Option<Dir>,
    /// llama.cpp architecture (default: from the GGUF, config.json model_type, or the table that
    /// maps the most stdin names).
    #[arg(long)]
    arch: Option<String>,
    /// Expert count for stacked-expert GGUF names read from stdin (a GGUF gives it per tensor).
    #[arg(long, value_name = "N")]
    n_expert: Option<u64>,
    /// Print JSON (schema gguftool.map/1).
    #[arg(long, conflicts_with = "yaml")]
    json: bool,
    /// Print YAML.
    #[arg(long)]
    yaml: bool,
    /// Rebuild HF kv_b_proj of every layer from the GGUF's attn_k_b/attn_v_b instead.
    #[arg(long)]
    kv_b: bool,
    /// With --kv-b: HF checkpoint to compare against (bit equality, max abs error).
    #[arg(long, value_name = "HF_DIR", requires = "kv_b")]
    reference: Option<PathBuf>,
    /// With --kv-b: tensor-parallel world size; rebuild only rank --rank's colwise slice.
    #[arg(long, value_name = "N", requires = "rank")]
    tp: Option<usize>,
    /// With --tp: the rank.
    #[arg(long, value_name = "R", requires = "tp")]
    rank: Option<usize>,
}

fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// Tensor names and `model_type` of an HF checkpoint. With a `model.safetensors.index.json` the
/// names come from its weight map alone, so the table can be printed before (or without)
/// downloading the weight files; otherwise the safetensors headers are read.
fn hf_names(path: &Path) -> Result<(Vec<String>, Option<String>)> {
    let index = path.join("model.safetensors.index.json");
    if path.is_dir() && index.is_file() {
        let read = |p: &Path| -> Result<serde_json::Value> {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not valid JSON", p.display()))
        };
        let idx = read(&index)?;
        let map = idx["weight_map"]
            .as_object()
            .with_context(|| format!("{}: no weight_map object", index.display()))?;
        let cfg = path.join("config.json");
        let model_type = if cfg.is_file() {
            read(&cfg)?["model_type"].as_str().map(str::to_string)
        } else {
            None
        };
        return Ok((map.keys().cloned().collect(), model_type));
    }
    let hf = HfDir::open(path)?;
    let names = hf.tensors.iter().map(|t| t.name.clone()).collect();
    Ok((names, hf.model_type().map(str::to_string)))
}

fn pick_table(arch: Option<&str>, fallback: Option<&str>) -> Result<&'static Table> {
    match arch.or(fallback) {
        Some(a) => Ok(mappings::table(a)?),
        None => bail!(
            "cannot tell the architecture: pass --arch ({})",
            mappings::architectures().join(", ")
        ),
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.kv_b {
        return run_kv_b(&args);
    }
    let (map, source) = if args.input.as_os_str() == "-" {
        let dir = args
            .direction
            .context("names on stdin need --direction (which scheme they are in)")?;
        let mut names = Vec::new();
        for line in std::io::stdin().lock().lines() {
            let line = line.context("reading stdin")?;
            let n = line.trim();
            if !n.is_empty() {
                names.push(n.to_string());
            }
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let run_one = |t: &Table| match dir {
            Dir::HfToGguf => map_hf_names(t, &refs),
            Dir::GgufToHf => {
                let g: Vec<GgufName> = refs
                    .iter()
                    .map(|n| GgufName {
                        name: n,
                        dims: None,
                    })
                    .collect();
                map_gguf_names(t, &g, args.n_expert)
            }
        };
        let map = match &args.arch {
            Some(a) => run_one(mappings::table(a)?),
            None => {
                let all: Vec<NameMap> = mappings::architectures()
                    .into_iter()
                    .filter_map(|a| mappings::table(a).ok())
                    .map(run_one)
                    .collect();
                let best = all
                    .iter()
                    .map(|m| m.unmapped.len())
                    .min()
                    .context("no mapping tables")?;
                let ties: Vec<String> = all
                    .iter()
                    .filter(|m| m.unmapped.len() == best)
                    .map(|m| m.arch.clone())
                    .collect();
                let note = format!(
                    "architecture guessed from the names ({} fit equally well); pass --arch to choose",
                    ties.join(", ")
                );
                let mut m = all
                    .into_iter()
                    .find(|m| m.unmapped.len() == best)
                    .context("no mapping tables")?;
                if ties.len() > 1 {
                    m.notes.push(note);
                }
                m
            }
        };
        (map, "-".to_string())
    } else if is_gguf(&args.input) {
        let model = gguf::Model::open(&args.input)
            .with_context(|| format!("cannot open {}", args.input.display()))?;
        let t = pick_table(args.arch.as_deref(), model.architecture())?;
        let tensors: Vec<GgufName> = model
            .tensors()
            .map(|r| GgufName {
                name: &r.info.name,
                dims: Some(&r.info.dims),
            })
            .collect();
        let n_expert = model
            .metadata()
            .get(&format!("{}.expert_count", t.arch))
            .and_then(gguf::Value::as_u64);
        (
            map_gguf_names(t, &tensors, n_expert),
            args.input.display().to_string(),
        )
    } else {
        let (names, model_type) = hf_names(&args.input)?;
        let t = match (&args.arch, model_type.as_deref()) {
            (Some(a), _) => mappings::table(a)?,
            (None, Some(mt)) => mappings::table_for_model_type(mt)?,
            (None, None) => bail!(
                "no config.json model_type in {}: pass --arch",
                args.input.display()
            ),
        };
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        (map_hf_names(t, &names), args.input.display().to_string())
    };
    let orient = match (args.direction, map.direction) {
        (Some(Dir::HfToGguf), _) => Direction::HfToGguf,
        (Some(Dir::GgufToHf), _) => Direction::GgufToHf,
        (None, d) => d,
    };
    print_map(&map, orient, &source, args.json, args.yaml)?;
    if !map.unmapped.is_empty() {
        eprintln!("error: {} name(s) could not be mapped:", map.unmapped.len());
        for n in &map.unmapped {
            eprintln!("  {n}");
        }
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn print_map(
    map: &NameMap,
    orient: Direction,
    source: &str,
    as_json: bool,
    as_yaml: bool,
) -> Result<()> {
    let doc = json!({
        "schema": "gguftool.map/1",
        "source": source,
        "arch": map.arch,
        "direction": orient.as_str(),
        "input_scheme": match map.direction { Direction::HfToGguf => "hf", Direction::GgufToHf => "gguf" },
        "rows": map.rows,
        "unmapped": map.unmapped,
        "notes": map.notes,
    });
    if as_json {
        return emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    }
    if as_yaml {
        return emit(&serde_yaml::to_string(&doc)?);
    }
    let mut out = String::new();
    writeln!(
        out,
        "# {} ({}), {} rows, {} unmapped",
        map.arch,
        orient.as_str(),
        map.rows.len(),
        map.unmapped.len()
    )?;
    for r in &map.rows {
        let (from, to) = match orient {
            Direction::GgufToHf => (&r.gguf, &r.hf),
            Direction::HfToGguf => (&r.hf, &r.gguf),
        };
        let tag = match (r.kind, &r.note) {
            (Kind::Plain, None) => String::new(),
            (k, Some(n)) => format!("  [{}: {n}]", k.as_str()),
            (k, None) => format!("  [{}]", k.as_str()),
        };
        let left = if from.is_empty() {
            "-".to_string()
        } else {
            from.join(" + ")
        };
        if to.len() > 1 {
            writeln!(out, "{left} ->{tag}")?;
            for n in to {
                writeln!(out, "    {n}")?;
            }
        } else {
            writeln!(
                out,
                "{left} -> {}{tag}",
                to.first().map_or("-", String::as_str)
            )?;
        }
    }
    for n in &map.notes {
        writeln!(out, "note: {n}")?;
    }
    if !map.unmapped.is_empty() {
        writeln!(out, "unmapped:")?;
        for n in &map.unmapped {
            writeln!(out, "    {n}")?;
        }
    }
    emit(&out)
}

/// Writes to stdout; a closed pipe (`| head`) ends the output quietly instead of panicking.
fn emit(s: &str) -> Result<()> {
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn run_kv_b(args: &Args) -> Result<ExitCode> {
    if !is_gguf(&args.input) {
        bail!(
            "--kv-b needs a GGUF model, {} is not one",
            args.input.display()
        );
    }
    let model = gguf::Model::open(&args.input)
        .with_context(|| format!("cannot open {}", args.input.display()))?;
    let tp = args.tp.zip(args.rank);
    let reference = args.reference.as_deref().map(HfDir::open).transpose()?;
    let mut blocks: Vec<u64> = model
        .tensors()
        .filter_map(|r| {
            r.info
                .name
                .strip_prefix("blk.")?
                .strip_suffix(".attn_k_b.weight")?
                .parse()
                .ok()
        })
        .collect();
    blocks.sort_unstable();
    if blocks.is_empty() {
        bail!("{} has no attn_k_b tensors", args.input.display());
    }
    let mut rows = Vec::new();
    for bid in blocks {
        let (name, shape, w) = mappings::export::kv_b_f32(&model, bid, tp)?;
        let types: Vec<&str> = [
            format!("blk.{bid}.attn_k_b.weight"),
            format!("blk.{bid}.attn_v_b.weight"),
        ]
        .iter()
        .filter_map(|n| model.tensor(n).map(|t| t.info.ty.name()))
        .collect();
        let mut row = json!({"block": bid, "hf_name": name, "shape": shape, "source_types": types});
        if let Some(hf) = &reference {
            let t = hf
                .tensor(&name)
                .with_context(|| format!("{name} not in the reference checkpoint"))?;
            let mut want = hf.read_f32(t)?;
            if let Some((n, r)) = tp {
                want = mappings::kvb::colwise_slice(
                    &want,
                    t.shape.first().copied().unwrap_or(0) as usize,
                    shape[1],
                    n,
                    r,
                )?;
            }
            if want.len() != w.len() {
                bail!(
                    "{name}: reference has {} elements, rebuilt {}",
                    want.len(),
                    w.len()
                );
            }
            let exact = want.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits());
            let max_err = want
                .iter()
                .zip(&w)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            row["bit_identical"] = json!(exact);
            row["max_abs_error"] = json!(max_err);
        }
        rows.push(row);
    }
    let doc = json!({
        "schema": "gguftool.map-kv-b/1",
        "source": args.input.display().to_string(),
        "tp": tp.map(|(n, r)| json!({"size": n, "rank": r})),
        "layers": rows,
    });
    if args.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?))?;
    } else if args.yaml {
        emit(&serde_yaml::to_string(&doc)?)?;
    } else {
        let mut out = String::new();
        for r in doc["layers"].as_array().into_iter().flatten() {
            let cmp = match (r.get("bit_identical"), r.get("max_abs_error")) {
                (Some(e), Some(m)) => format!("  bit-identical {e}, max |err| {m}"),
                _ => String::new(),
            };
            writeln!(
                out,
                "{} {} from {}{cmp}",
                r["hf_name"].as_str().unwrap_or(""),
                r["shape"],
                r["source_types"]
            )?;
        }
        emit(&out)?;
    }
    Ok(ExitCode::SUCCESS)
}
