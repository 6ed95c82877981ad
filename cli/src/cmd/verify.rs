//! `gguftool verify`: structure (container validation, split completeness, layout), per-tensor
//! statistics of the dequantized values, optional sha256 of the raw bytes and a model digest,
//! architecture checks from the mapping tables, anomaly flags, and comparison against another
//! model or a saved report. Exit 0 clean, 1 findings, 2 error.

use crate::util::{self, human_bytes, name_matches};
use anyhow::{bail, Context, Result};
use gguf::stats::{tensor_stats, TensorStats};
use gguf::Model;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file or any shard of a split model.
    model: PathBuf,
    /// Print the report as JSON (schema `gguftool.verify/1`, docs/JSON.md).
    #[arg(long, conflicts_with = "yaml")]
    json: bool,
    /// Print the report as YAML.
    #[arg(long)]
    yaml: bool,
    /// Also write the JSON report to FILE (for a later --against).
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Compare with another model (any shard) or a saved JSON report; list every difference.
    #[arg(long, value_name = "MODEL|REPORT")]
    against: Option<PathBuf>,
    /// sha256 of each tensor's raw bytes and a model digest over (name, type, shape, sha256).
    #[arg(long)]
    hash: bool,
    /// Only tensors whose name matches (glob with * and ?, else substring).
    #[arg(long, value_name = "PATTERN")]
    tensor: Option<String>,
    /// Also dequantize every tensor on the GPU and compare with the CPU reference.
    #[arg(long)]
    gpu: bool,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

/// One tensor's line in the report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TensorRecord {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub ne: Vec<u64>,
    pub shape: Vec<u64>,
    pub n_bytes: u64,
    #[serde(default)]
    pub stats: Option<StatsRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Statistics as stored in a report (JSON has no NaN/Inf: those become null).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StatsRecord {
    pub count: u64,
    pub mean: Option<f64>,
    pub std: Option<f64>,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub absmax: Option<f64>,
    pub zero_fraction: f64,
    pub n_nan: u64,
    pub n_inf: u64,
}

impl From<&TensorStats> for StatsRecord {
    fn from(s: &TensorStats) -> Self {
        let f = |x: f64| x.is_finite().then_some(x);
        StatsRecord {
            count: s.count,
            mean: f(s.mean),
            std: f(s.std),
            min: f(s.min),
            max: f(s.max),
            absmax: f(s.absmax),
            zero_fraction: s.zero_fraction,
            n_nan: s.n_nan,
            n_inf: s.n_inf,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Finding {
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<String>,
    pub message: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub model: PathBuf,
    pub files: Vec<PathBuf>,
    pub architecture: Option<String>,
    pub tensors: Vec<TensorRecord>,
    /// sha256 over the ordered (name, type, ne, sha256) lines; present with --hash on all tensors.
    pub digest: Option<String>,
    #[serde(default)]
    pub arch_check: Option<serde_json::Value>,
    #[serde(default)]
    pub gpu: Option<serde_json::Value>,
    /// Every metadata key but split.* (which differ between shards and their merged file), in
    /// file order, with a digest of its exact type and bytes. Absent in reports of older
    /// versions, which then compare without metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Vec<MetaRecord>>,
    /// Value-level comparison of the tensors both models have (with --against MODEL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comparison: Option<Vec<TensorComparison>>,
    pub findings: Vec<Finding>,
    pub summary: Summary,
}

/// One metadata key in a report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MetaRecord {
    pub key: String,
    #[serde(rename = "type")]
    pub ty: String,
    /// The value, arrays over 8 items summarised.
    pub value: serde_json::Value,
    /// sha256 of the key's serialized type and value bytes.
    pub sha256: String,
}

/// Dequantized values of one tensor in two models compared.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TensorComparison {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub other_type: String,
    pub max_abs_error: f64,
    pub rmse: f64,
    /// Cosine similarity of the two value vectors (1 when both are all zero).
    pub cosine: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub tensors: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub gb_per_s: f64,
    pub findings: usize,
}

const SCHEMA: &str = "gguftool.verify/1";

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let compare_hash = args.hash || args.against.is_some();
    let report = build_report(
        &args.model,
        compare_hash,
        args.tensor.as_deref(),
        args.quiet || args.json || args.yaml,
        args.gpu,
    )?;
    let mut report = report;
    if let Some(other) = &args.against {
        let theirs = if other.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(other)
                .with_context(|| format!("reading {}", other.display()))?;
            let r: Report = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a gguftool verify report", other.display()))?;
            if r.schema != SCHEMA {
                bail!(
                    "{}: report schema {:?}, expected {SCHEMA:?}",
                    other.display(),
                    r.schema
                );
            }
            r
        } else {
            let r = build_report(other, true, args.tensor.as_deref(), true, false)?;
            let a = Model::open(&args.model)?;
            let b = Model::open(other)?;
            report.comparison = Some(compare_values(&a, &b, args.tensor.as_deref())?);
            r
        };
        let diffs = compare(&report, &theirs);
        report.findings.extend(diffs);
        report.summary.findings = report.findings.len();
    }
    if let Some(path) = &args.report {
        let out = util::PartialFile::create(path, true)?;
        serde_json::to_writer_pretty(&out.file, &report)?;
        out.commit()?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if args.yaml {
        print!("{}", serde_yaml::to_string(&report)?);
    } else {
        print_human(&report, args.hash);
    }
    Ok(if report.findings.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn build_report(
    path: &Path,
    hash: bool,
    filter: Option<&str>,
    quiet: bool,
    gpu: bool,
) -> Result<Report> {
    let t0 = Instant::now();
    let model = Model::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut findings = Vec::new();
    for f in model.shards() {
        for e in f.header().layout_findings() {
            findings.push(Finding {
                kind: "layout".into(),
                tensor: None,
                message: format!("{e} (readable, but llama.cpp requires each tensor right after the previous one)"),
            });
        }
    }
    let selected: Vec<_> = model
        .tensors()
        .filter(|t| filter.is_none_or(|p| name_matches(p, &t.info.name)))
        .collect();
    let total_bytes: u64 = selected.iter().map(|t| t.info.n_bytes()).sum();
    let pb = util::byte_progress(total_bytes, quiet, "verifying");
    let results: Vec<Result<(TensorStats, Option<String>)>> = selected
        .par_iter()
        .map(|t| {
            util::check_interrupted()?;
            let data = model.data(t);
            let stats = tensor_stats(t.info.ty, data)
                .with_context(|| format!("tensor {:?}", t.info.name))?;
            let sha = hash.then(|| gguf::copy::hex(&Sha256::digest(data)));
            pb.inc(t.info.n_bytes());
            Ok((stats, sha))
        })
        .collect();
    pb.finish_and_clear();
    let mut tensors = Vec::with_capacity(selected.len());
    let mut stats_list = Vec::with_capacity(selected.len());
    for (t, r) in selected.iter().zip(results) {
        let (stats, sha) = r?;
        tensors.push(TensorRecord {
            name: t.info.name.clone(),
            ty: t.info.ty.name().into(),
            ne: t.info.dims.clone(),
            shape: t.info.shape_rowmajor(),
            n_bytes: t.info.n_bytes(),
            stats: Some(StatsRecord::from(&stats)),
            sha256: sha,
        });
        stats_list.push(stats);
    }
    findings.extend(anomalies(&tensors, &stats_list));

    let digest = (hash && filter.is_none()).then(|| model_digest(&tensors));
    let arch_check = match mappings::check_architecture(&model) {
        Ok(r) => {
            for m in &r.missing_tensors {
                findings.push(Finding {
                    kind: "arch.missing".into(),
                    tensor: Some(m.clone()),
                    message: format!("expected tensor {m} is missing"),
                });
            }
            for u in &r.unexpected_tensors {
                findings.push(Finding {
                    kind: "arch.unexpected".into(),
                    tensor: Some(u.name.clone()),
                    message: u.reason.clone(),
                });
            }
            for w in &r.wrong_shapes {
                findings.push(Finding {
                    kind: "arch.shape".into(),
                    tensor: Some(w.name.clone()),
                    message: format!(
                        "ne {:?}, expected {:?} from the metadata",
                        w.got, w.expected
                    ),
                });
            }
            for k in &r.metadata_issues {
                findings.push(Finding {
                    kind: "arch.metadata".into(),
                    tensor: None,
                    message: format!("key {}: {}", k.key, k.problem),
                });
            }
            for m in &r.inconsistent_metadata {
                findings.push(Finding {
                    kind: "arch.metadata".into(),
                    tensor: None,
                    message: m.clone(),
                });
            }
            Some(serde_json::to_value(&r)?)
        }
        Err(e) => Some(serde_json::json!({"skipped": e.to_string()})),
    };
    let gpu_report = if gpu {
        let (v, f) = crate::cmd::verify_gpu::run(&model, &selected, quiet)?;
        findings.extend(f);
        Some(v)
    } else {
        None
    };
    let seconds = t0.elapsed().as_secs_f64();
    let metadata = Some(meta_records(model.metadata())?);
    Ok(Report {
        schema: SCHEMA.into(),
        model: path.to_path_buf(),
        files: model
            .shards()
            .iter()
            .map(|f| f.path().to_path_buf())
            .collect(),
        architecture: model.architecture().map(str::to_string),
        summary: Summary {
            tensors: tensors.len(),
            bytes: total_bytes,
            seconds,
            gb_per_s: total_bytes as f64 / 1e9 / seconds.max(1e-9),
            findings: findings.len(),
        },
        tensors,
        digest,
        arch_check,
        gpu: gpu_report,
        metadata,
        comparison: None,
        findings,
    })
}

/// The metadata a report records and compares (split.* left out).
pub fn meta_records(m: &gguf::Metadata) -> Result<Vec<MetaRecord>> {
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m.iter() {
        if k.starts_with("split.") {
            continue;
        }
        let one = gguf::Metadata::from_entries(m.file(), vec![(k.to_string(), v.clone())]);
        let bytes = gguf::writer::header_bytes(3, &one, &[])?;
        out.push(MetaRecord {
            key: k.to_string(),
            ty: util::value_type_json(v),
            value: util::value_json(v, Some(8)),
            sha256: gguf::copy::hex(&Sha256::digest(&bytes)),
        });
    }
    Ok(out)
}

/// Keys added, removed or changed from `a` to `b`, one line each.
pub fn diff_meta(a: &[MetaRecord], b: &[MetaRecord]) -> Vec<String> {
    let amap: BTreeMap<&str, &MetaRecord> = a.iter().map(|r| (r.key.as_str(), r)).collect();
    let bmap: BTreeMap<&str, &MetaRecord> = b.iter().map(|r| (r.key.as_str(), r)).collect();
    let short = |v: &serde_json::Value| {
        let s = v.to_string();
        if s.chars().count() > 80 {
            format!(
                "{}... ({} chars)",
                s.chars().take(77).collect::<String>(),
                s.chars().count()
            )
        } else {
            s
        }
    };
    let mut out = Vec::new();
    for r in a {
        match bmap.get(r.key.as_str()) {
            None => out.push(format!(
                "key {} removed (was {} {})",
                r.key,
                r.ty,
                short(&r.value)
            )),
            Some(o) if o.sha256 != r.sha256 => out.push(format!(
                "key {} changed: {} {} -> {} {}",
                r.key,
                r.ty,
                short(&r.value),
                o.ty,
                short(&o.value)
            )),
            Some(_) => {}
        }
    }
    for r in b {
        if !amap.contains_key(r.key.as_str()) {
            out.push(format!("key {} added: {} {}", r.key, r.ty, short(&r.value)));
        }
    }
    out
}

/// [`diff_meta`] of two metadata sets.
pub fn metadata_diff(a: &gguf::Metadata, b: &gguf::Metadata) -> Vec<String> {
    match (meta_records(a), meta_records(b)) {
        (Ok(x), Ok(y)) => diff_meta(&x, &y),
        _ => vec!["metadata cannot be serialized".into()],
    }
}

/// Elements dequantized per step when comparing values (a multiple of every block size).
const COMPARE_CHUNK: usize = 1 << 20;

/// Max abs error, RMSE and cosine similarity between the dequantized values of the tensors
/// both models have with the same shape; streamed in chunks so memory stays bounded.
fn compare_values(a: &Model, b: &Model, filter: Option<&str>) -> Result<Vec<TensorComparison>> {
    let pairs: Vec<_> = a
        .tensors()
        .filter(|t| filter.is_none_or(|p| name_matches(p, &t.info.name)))
        .filter_map(|t| {
            let o = b.tensor(&t.info.name)?;
            (o.info.dims == t.info.dims).then_some((t, o))
        })
        .collect();
    pairs
        .par_iter()
        .map(|(ta, tb)| {
            util::check_interrupted()?;
            let (da, db) = (a.data(ta), b.data(tb));
            let n = ta.info.n_elements() as usize;
            let (mut sq, mut ab, mut aa, mut bb, mut max) = (0f64, 0f64, 0f64, 0f64, 0f64);
            let mut xa = vec![0f32; COMPARE_CHUNK.min(n)];
            let mut xb = vec![0f32; COMPARE_CHUNK.min(n)];
            let mut at = 0usize;
            let span = |ty: gguf::GgmlType, from: usize, len: usize| {
                let (bs, ts) = (ty.block_size(), ty.type_size());
                from / bs * ts..(from + len) / bs * ts
            };
            while at < n {
                let len = COMPARE_CHUNK.min(n - at);
                let (ya, yb) = (&mut xa[..len], &mut xb[..len]);
                gguf::quant::dequantize_row(ta.info.ty, &da[span(ta.info.ty, at, len)], ya)
                    .with_context(|| format!("tensor {:?}", ta.info.name))?;
                gguf::quant::dequantize_row(tb.info.ty, &db[span(tb.info.ty, at, len)], yb)
                    .with_context(|| format!("tensor {:?}", tb.info.name))?;
                for (&x, &y) in ya.iter().zip(yb.iter()) {
                    let (x, y) = (f64::from(x), f64::from(y));
                    let d = x - y;
                    sq += d * d;
                    ab += x * y;
                    aa += x * x;
                    bb += y * y;
                    max = max.max(d.abs());
                }
                at += len;
            }
            let cosine = if aa == 0.0 && bb == 0.0 {
                1.0
            } else {
                // One square root of the product: identical vectors give exactly 1.
                ab / (aa * bb).sqrt()
            };
            Ok(TensorComparison {
                name: ta.info.name.clone(),
                ty: ta.info.ty.name().into(),
                other_type: tb.info.ty.name().into(),
                max_abs_error: max,
                rmse: (sq / n.max(1) as f64).sqrt(),
                cosine,
            })
        })
        .collect()
}

/// sha256 over one line per tensor: `name\ttype\tne0,ne1,..\tsha256\n`, in model order. Shards
/// and their merged file give the same digest, whatever the file layout.
pub fn model_digest(tensors: &[TensorRecord]) -> String {
    let mut h = Sha256::new();
    for t in tensors {
        let ne: Vec<String> = t.ne.iter().map(u64::to_string).collect();
        h.update(format!(
            "{}\t{}\t{}\t{}\n",
            t.name,
            t.ty,
            ne.join(","),
            t.sha256.as_deref().unwrap_or("")
        ));
    }
    gguf::copy::hex(&h.finalize())
}

/// Same tensor kind across blocks: `blk.7.attn_norm.weight` -> `blk.*.attn_norm.weight`.
fn kind_of(name: &str) -> String {
    let mut parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 2 && parts[0] == "blk" && parts[1].bytes().all(|b| b.is_ascii_digit()) {
        parts[1] = "*";
    }
    parts.join(".")
}

/// Robust z-scores (median / MAD) above this flag a tensor against its siblings. A normal
/// population gives |z| > 8 with probability ~1e-15, so a flag means a different distribution,
/// not chance.
const OUTLIER_Z: f64 = 8.0;
/// Fewest siblings for a robust spread estimate.
const MIN_GROUP: usize = 5;

fn anomalies(tensors: &[TensorRecord], stats: &[TensorStats]) -> Vec<Finding> {
    let mut out = Vec::new();
    for (t, s) in tensors.iter().zip(stats) {
        if s.n_nan > 0 || s.n_inf > 0 {
            out.push(Finding {
                kind: "nan_inf".into(),
                tensor: Some(t.name.clone()),
                message: format!("{} NaN and {} Inf values", s.n_nan, s.n_inf),
            });
        }
        if s.count > 0 && s.n_zero == s.count {
            out.push(Finding {
                kind: "all_zero".into(),
                tensor: Some(t.name.clone()),
                message: "every value is zero".into(),
            });
        }
    }
    let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, t) in tensors.iter().enumerate() {
        if t.name.starts_with("blk.") {
            groups.entry(kind_of(&t.name)).or_default().push(i);
        }
    }
    for (kind, idx) in groups {
        if idx.len() < MIN_GROUP {
            continue;
        }
        // Norm weights are judged by their mean (they sit near a learned scale), others by std.
        let is_norm = kind.contains("norm") && tensors[idx[0]].ne.len() == 1;
        let vals: Vec<f64> = idx
            .iter()
            .map(|&i| if is_norm { stats[i].mean } else { stats[i].std })
            .collect();
        if vals.iter().any(|v| !v.is_finite()) {
            continue;
        }
        let med = median(&vals);
        let mad = median(&vals.iter().map(|v| (v - med).abs()).collect::<Vec<_>>());
        // 1.4826 * MAD estimates sigma for normal data; guard tiny MADs with a relative floor.
        let sigma = (1.4826 * mad).max(med.abs() * 1e-3).max(1e-12);
        for (&i, v) in idx.iter().zip(&vals) {
            let z = (v - med) / sigma;
            if z.abs() > OUTLIER_Z {
                out.push(Finding {
                    kind: if is_norm {
                        "norm_outlier"
                    } else {
                        "std_outlier"
                    }
                    .into(),
                    tensor: Some(tensors[i].name.clone()),
                    message: format!(
                        "{} {:.6} vs median {:.6} of {} siblings {kind} (robust z {:.1})",
                        if is_norm { "mean" } else { "std" },
                        v,
                        med,
                        vals.len(),
                        z
                    ),
                });
            }
        }
    }
    out
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Every difference between two reports: tensor sets, types, shapes, hashes (or statistics when
/// a side has no hashes), and the digests.
fn compare(a: &Report, b: &Report) -> Vec<Finding> {
    let mut out = Vec::new();
    let mk = |tensor: Option<&str>, message: String| Finding {
        kind: "against".into(),
        tensor: tensor.map(str::to_string),
        message,
    };
    let bmap: BTreeMap<&str, &TensorRecord> =
        b.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let amap: BTreeMap<&str, &TensorRecord> =
        a.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    for t in &a.tensors {
        let Some(o) = bmap.get(t.name.as_str()) else {
            out.push(mk(Some(&t.name), format!("only in {}", a.model.display())));
            continue;
        };
        if t.ty != o.ty {
            out.push(mk(Some(&t.name), format!("type {} vs {}", t.ty, o.ty)));
        }
        if t.ne != o.ne {
            out.push(mk(Some(&t.name), format!("ne {:?} vs {:?}", t.ne, o.ne)));
        }
        match (&t.sha256, &o.sha256) {
            (Some(x), Some(y)) if x != y => {
                out.push(mk(Some(&t.name), format!("sha256 {x} vs {y}")))
            }
            (Some(_), Some(_)) => {}
            _ => {
                if t.stats != o.stats {
                    out.push(mk(Some(&t.name), "statistics differ".into()));
                }
            }
        }
    }
    for t in &b.tensors {
        if !amap.contains_key(t.name.as_str()) {
            out.push(mk(Some(&t.name), format!("only in {}", b.model.display())));
        }
    }
    let order_a: Vec<&str> = a
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| bmap.contains_key(n))
        .collect();
    let order_b: Vec<&str> = b
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| amap.contains_key(n))
        .collect();
    if order_a != order_b {
        out.push(mk(None, "tensor order differs".into()));
    }
    if let (Some(x), Some(y)) = (&a.metadata, &b.metadata) {
        for d in diff_meta(x, y) {
            out.push(Finding {
                kind: "against.metadata".into(),
                tensor: None,
                message: d,
            });
        }
    }
    if let (Some(x), Some(y)) = (&a.digest, &b.digest) {
        if x != y && out.is_empty() {
            out.push(mk(None, format!("model digest {x} vs {y}")));
        }
    }
    out
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map_or("nan/inf".into(), |x| format!("{x:.6}"))
}

fn print_human(r: &Report, hash: bool) {
    println!(
        "model: {} ({} file(s)), architecture {}",
        r.model.display(),
        r.files.len(),
        r.architecture.as_deref().unwrap_or("?")
    );
    println!(
        "{:<44} {:<7} {:>11} {:>11} {:>11} {:>11} {:>7} {:>5}{}",
        "tensor",
        "type",
        "mean",
        "std",
        "min",
        "max",
        "zeros",
        "nan",
        if hash { "  sha256" } else { "" }
    );
    for t in &r.tensors {
        if let Some(s) = &t.stats {
            println!(
                "{:<44} {:<7} {:>11} {:>11} {:>11} {:>11} {:>6.2}% {:>5}{}",
                t.name,
                t.ty,
                fmt_opt(s.mean),
                fmt_opt(s.std),
                fmt_opt(s.min),
                fmt_opt(s.max),
                s.zero_fraction * 100.0,
                s.n_nan + s.n_inf,
                t.sha256
                    .as_deref()
                    .map(|h| format!("  {}", &h[..16]))
                    .unwrap_or_default()
            );
        }
    }
    if let Some(d) = &r.digest {
        println!("model digest: {d}");
    }
    if let Some(c) = &r.comparison {
        println!(
            "{:<44} {:<7} {:<7} {:>12} {:>12} {:>10}",
            "value comparison", "type", "other", "max_abs_err", "rmse", "cosine"
        );
        for t in c {
            println!(
                "{:<44} {:<7} {:<7} {:>12.6e} {:>12.6e} {:>10.6}",
                t.name, t.ty, t.other_type, t.max_abs_error, t.rmse, t.cosine
            );
        }
    }
    if let Some(g) = &r.gpu {
        println!(
            "gpu: {} tensors dequantized on {} vs the CPU reference: max abs diff {}, max rel diff {}, {} beyond tolerance",
            g["checked"], g["device"].as_str().unwrap_or("?"), g["max_abs"], g["max_rel"], g["failed"]
        );
    }
    println!(
        "{} tensors, {} in {:.2}s ({:.2} GB/s)",
        r.summary.tensors,
        human_bytes(r.summary.bytes),
        r.summary.seconds,
        r.summary.gb_per_s
    );
    if r.findings.is_empty() {
        println!("no findings");
    } else {
        println!("{} finding(s):", r.findings.len());
        for f in &r.findings {
            println!(
                "  [{}] {}{}",
                f.kind,
                f.tensor
                    .as_deref()
                    .map(|t| format!("{t}: "))
                    .unwrap_or_default(),
                f.message
            );
        }
    }
}
