//! Check 7, layer by layer: the named activations of one forward pass (`token_embd.out`,
//! `blk.N.attn_q_b.out`, ... `logits`, see `runtime::glm::forward_observed`) compared in forward
//! order with a reference, naming the first layer and operation that diverges, the weights it
//! reads (and their shards) and, where the numbers fit a known mistake, the mistake (RoPE dims
//! laid out half-split, experts stacked out of order).
//!
//! References: a saved activation dump (`--activations`, safetensors with `token_ids` and
//! activations named as above, like the fixtures' `refs/activations-*.safetensors`), a dump made
//! here by transformers from `--hf` (when python3 with torch and transformers is importable), and
//! the CPU reference itself for the chosen backend (`--device cuda`). The tolerance against a
//! transformers dump follows from the model's storage types (tolerance.rs); backend against CPU
//! is `runtime::cuda::check::LOGIT_TOL` of the largest magnitude (same f32 math, different
//! summation order).

use super::report::{CheckResult, Item};
use super::tolerance::{activation_tolerance, model_weight_error, rel_rms};
use gguf::Model;
use runtime::backend::Backend;
use runtime::glm::{Activation, GlmModel};
use runtime::spec::{AttentionSpec, ModelSpec};
use runtime::weights::HostWeight;
use runtime::{RuntimeError, SeqStep};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

/// Values of one observed activation.
#[derive(Debug, Clone)]
pub enum Data {
    F32(Vec<f32>),
    Idx(Vec<i64>),
}

/// One named activation, `[rows, cols]` row-major, rows = tokens.
#[derive(Debug, Clone)]
pub struct Act {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub data: Data,
}

/// The model with only its first `layers` trunk blocks (all of them when `None`): `--quick`
/// compares the first layers without running the rest.
pub fn load<B: Backend>(
    backend: B,
    model: &Arc<Model>,
    layers: Option<usize>,
) -> Result<GlmModel<B>, RuntimeError> {
    let mut spec = ModelSpec::from_model(model)?;
    if let Some(n) = layers.filter(|&n| n < spec.n_layer) {
        spec.n_layer = n;
        spec.layers.truncate(n);
    }
    let get = |name: &str| -> Result<Option<HostWeight>, RuntimeError> {
        if model.tensor(name).is_none() {
            return Ok(None);
        }
        HostWeight::from_model(model, name).map(Some)
    };
    GlmModel::from_weights(backend, spec, &get)
}

/// Every activation of one prefill of `ids`, in forward order.
pub fn observe<B: Backend>(m: &GlmModel<B>, ids: &[u32]) -> Result<Vec<Act>, RuntimeError> {
    let mut out = Vec::new();
    let mut obs = |name: &str, a: Activation<'_>| {
        out.push(match a {
            Activation::F32 { rows, cols, data } => Act {
                name: name.to_string(),
                rows,
                cols,
                data: Data::F32(data.to_vec()),
            },
            Activation::Index { rows, cols, data } => Act {
                name: name.to_string(),
                rows,
                cols,
                data: Data::Idx(data.to_vec()),
            },
        })
    };
    let mut seq = m.new_cache()?;
    let mut b = [SeqStep {
        seq: &mut seq,
        tokens: ids,
        all_logits: true,
    }];
    m.forward_observed(&mut b, Some(&mut obs))?;
    Ok(out)
}

/// A saved dump: its token ids and activations by name.
pub struct Dump {
    pub source: String,
    /// Made from the first `--quick` layers only (its norm and head follow the last of them).
    pub truncated: bool,
    pub ids: Vec<u32>,
    pub acts: HashMap<String, Act>,
}

pub fn load_dump(path: &Path) -> Result<Dump, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{}: not a safetensors file: {e}", path.display()))?;
    let mut acts = HashMap::new();
    let mut ids = None;
    for (name, t) in st.tensors() {
        let shape = t.shape();
        let (rows, cols) = match shape {
            [r, c] => (*r, *c),
            [n] => (*n, 1),
            _ => continue,
        };
        let data = match t.dtype() {
            safetensors::Dtype::F32 => Data::F32(
                t.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            safetensors::Dtype::I64 => Data::Idx(
                t.data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
            _ => continue,
        };
        if name == "token_ids" {
            if let Data::Idx(v) = &data {
                ids = Some(
                    v.iter()
                        .map(|&x| {
                            u32::try_from(x).map_err(|_| format!("token id {x} out of range"))
                        })
                        .collect::<Result<Vec<u32>, String>>()?,
                );
            }
            continue;
        }
        acts.insert(
            name.clone(),
            Act {
                name,
                rows,
                cols,
                data,
            },
        );
    }
    let ids = ids.ok_or_else(|| {
        format!(
            "{}: no token_ids tensor (the prompt the activations belong to)",
            path.display()
        )
    })?;
    if acts.is_empty() {
        return Err(format!("{}: no activations", path.display()));
    }
    Ok(Dump {
        source: path.display().to_string(),
        truncated: false,
        ids,
        acts,
    })
}

/// How two activations are compared.
#[derive(Debug, Clone)]
pub enum Metric {
    /// `||got - want|| / ||want||` at most `tol` (reference from the original weights).
    RelRms { tol: f64, why: String },
    /// `max |got - want|` at most `tol` times `max |want|` (two backends, same weights).
    MaxAbs { tol: f64, why: String },
}

impl Metric {
    fn tol(&self) -> f64 {
        match self {
            Metric::RelRms { tol, .. } | Metric::MaxAbs { tol, .. } => *tol,
        }
    }
    fn why(&self) -> &str {
        match self {
            Metric::RelRms { why, .. } | Metric::MaxAbs { why, .. } => why,
        }
    }
    fn error(&self, got: &[f32], want: &[f32]) -> f64 {
        match self {
            Metric::RelRms { .. } => rel_rms(got, want),
            Metric::MaxAbs { .. } => {
                let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                let d = got.iter().zip(want).fold(0f32, |m, (a, b)| {
                    if (a - b).is_nan() {
                        f32::NAN
                    } else {
                        m.max((a - b).abs())
                    }
                });
                f64::from(d / scale)
            }
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Metric::RelRms { .. } => "relative RMS error",
            Metric::MaxAbs { .. } => "max |difference| / max |reference|",
        }
    }
}

/// The first activation beyond the tolerance, with what the comparison saw before it.
pub struct Divergence {
    pub name: String,
    pub err: f64,
    /// (row, col, got, want) of the largest difference.
    pub worst: (usize, usize, f32, f32),
    pub got: Act,
    pub want: Act,
    /// Errors of the activations of the same layer compared before it.
    pub before: Vec<(String, f64)>,
}

pub struct Outcome {
    pub compared: usize,
    /// Largest error among the activations within tolerance.
    pub worst_ok: Option<(String, f64)>,
    pub divergence: Option<Divergence>,
    /// Index activations (router experts, indexer selections) whose rows differ as sets.
    pub index_rows_differ: Vec<(String, usize, usize)>,
    /// Rows whose chosen experts differ, per `blk.N` prefix.
    pub routing_differs: HashMap<String, Vec<usize>>,
}

fn layer_of(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("blk.")?;
    let n = rest.split('.').next()?;
    Some(&name[..4 + n.len()])
}

fn sorted_rows(v: &[f32], cols: usize) -> Vec<f32> {
    let mut out = v.to_vec();
    for row in out.chunks_mut(cols.max(1)) {
        row.sort_by(|x, y| y.total_cmp(x));
    }
    out
}

fn row_sets(a: &[i64], cols: usize, i: usize, limit: Option<i64>) -> BTreeSet<i64> {
    a[i * cols..(i + 1) * cols]
        .iter()
        .copied()
        .filter(|&x| x >= 0 && limit.is_none_or(|l| x <= l))
        .collect()
}

/// Compares `got` in order against `want`; stops at the first float activation beyond the
/// tolerance.
pub fn compare(got: &[Act], want: &dyn Fn(&str) -> Option<Act>, metric: &Metric) -> Outcome {
    let mut out = Outcome {
        compared: 0,
        worst_ok: None,
        divergence: None,
        index_rows_differ: Vec::new(),
        routing_differs: HashMap::new(),
    };
    let mut layer_errs: Vec<(String, f64)> = Vec::new();
    for g in got {
        let Some(w) = want(&g.name) else { continue };
        if layer_errs
            .first()
            .is_some_and(|(n, _)| layer_of(n) != layer_of(&g.name))
        {
            layer_errs.clear();
        }
        match (&g.data, &w.data) {
            (Data::F32(a), Data::F32(b)) => {
                out.compared += 1;
                let shape_ok = g.rows == w.rows && g.cols == w.cols;
                // The chosen experts' weights come in top-k order, which implementations
                // leave unspecified: compare each row's weights sorted.
                let (a, b) = if g.name.ends_with("router.weights") && shape_ok {
                    (sorted_rows(a, g.cols), sorted_rows(b, w.cols))
                } else {
                    (a.clone(), b.clone())
                };
                let (a, b) = (&a, &b);
                let err = if shape_ok {
                    metric.error(a, b)
                } else {
                    f64::INFINITY
                };
                if err.is_nan() || err > metric.tol() {
                    let mut worst = (0, 0, 0f32, 0f32);
                    if shape_ok {
                        let mut best = -1f32;
                        for (i, (x, y)) in a.iter().zip(b).enumerate() {
                            let d = if (x - y).is_nan() {
                                f32::INFINITY
                            } else {
                                (x - y).abs()
                            };
                            if d > best {
                                best = d;
                                worst = (i / g.cols.max(1), i % g.cols.max(1), *x, *y);
                            }
                        }
                    }
                    out.divergence = Some(Divergence {
                        name: g.name.clone(),
                        err,
                        worst,
                        got: g.clone(),
                        want: w,
                        before: layer_errs,
                    });
                    return out;
                }
                if out.worst_ok.as_ref().is_none_or(|(_, e)| err > *e) {
                    out.worst_ok = Some((g.name.clone(), err));
                }
                layer_errs.push((g.name.clone(), err));
            }
            (Data::Idx(a), Data::Idx(b)) if g.rows == w.rows => {
                let indexer = g.name.ends_with("indexer.topk_indices");
                let mut differ = Vec::new();
                for i in 0..g.rows {
                    // Selections past the query's own position are causally masked anyway.
                    let lim = indexer.then_some(i as i64);
                    if row_sets(a, g.cols, i, lim) != row_sets(b, w.cols, i, lim) {
                        differ.push(i);
                    }
                }
                if !differ.is_empty() {
                    out.index_rows_differ
                        .push((g.name.clone(), differ.len(), g.rows));
                    if g.name.ends_with("router.experts") {
                        if let Some(l) = layer_of(&g.name) {
                            out.routing_differs.insert(l.to_string(), differ);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The weights an activation is computed from (those present in the model).
fn op_weights(name: &str, model: &Model) -> Vec<String> {
    let (prefix, op) = match layer_of(name) {
        Some(l) => (format!("{l}."), name.get(l.len() + 1..).unwrap_or("")),
        None => (String::new(), name),
    };
    let parts: &[&str] = match op {
        "token_embd.out" => &["token_embd.weight"],
        "output_norm.out" => &["output_norm.weight"],
        "logits" => &["output.weight", "token_embd.weight"],
        "attn_norm.out" => &["attn_norm.weight"],
        "attn_q_a_norm.out" => &["attn_q_a.weight", "attn_q_a_norm.weight"],
        "attn_q_b.out" => &["attn_q_b.weight", "attn_q.weight"],
        "attn_kv_a_mqa.out" => &["attn_kv_a_mqa.weight"],
        "attn_kv_a_norm.out" => &["attn_kv_a_norm.weight"],
        "attn_output.out" => &[
            "attn_k_b.weight",
            "attn_v_b.weight",
            "attn_kv_b.weight",
            "attn_output.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
        ],
        "ffn_norm.out" => &["ffn_norm.weight"],
        "router.weights" => &["ffn_gate_inp.weight", "exp_probs_b.bias"],
        "ffn.out" => &[
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
            "ffn_gate_shexp.weight",
            "ffn_up_shexp.weight",
            "ffn_down_shexp.weight",
        ],
        _ => &[],
    };
    let mut v: Vec<String> = parts
        .iter()
        .map(|p| format!("{prefix}{p}"))
        .filter(|n| model.tensor(n).is_some())
        .collect();
    if op == "logits" && v.len() == 2 {
        v.truncate(1);
    }
    v
}

fn with_shards(names: &[String], model: &Model) -> String {
    let mut by_shard: Vec<(String, Vec<&str>)> = Vec::new();
    for n in names {
        let Some(t) = model.tensor(n) else { continue };
        let f = super::file_name(model.shards()[t.shard].path());
        match by_shard.iter_mut().find(|(s, _)| *s == f) {
            Some((_, v)) => v.push(n),
            None => by_shard.push((f, vec![n])),
        }
    }
    by_shard
        .iter()
        .map(|(s, v)| format!("{} (in {s})", v.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Interleaved pair order <-> half-split order of `n` rotary dims: position `j` of a half-split
/// layout holds interleaved dim `sigma(j)`.
fn half_split(n: usize) -> Vec<usize> {
    (0..n)
        .map(|j| {
            if j < n / 2 {
                2 * j
            } else {
                2 * (j - n / 2) + 1
            }
        })
        .collect()
}

/// Whether permuting the rotary columns (`offset..offset+n_rot` of every `group`-wide head)
/// between interleaved and half-split order makes `got` match `want`.
fn rope_layout_fits(
    d: &Divergence,
    group: usize,
    offset: usize,
    n_rot: usize,
    metric: &Metric,
) -> bool {
    let (Data::F32(g), Data::F32(w)) = (&d.got.data, &d.want.data) else {
        return false;
    };
    let cols = d.got.cols;
    if group == 0 || !cols.is_multiple_of(group) || offset + n_rot > group || n_rot < 4 {
        return false;
    }
    let s = half_split(n_rot);
    let mut inv = vec![0; n_rot];
    for (j, &x) in s.iter().enumerate() {
        inv[x] = j;
    }
    [s, inv].iter().any(|p| {
        let mut moved = g.clone();
        for (row_m, row_g) in moved.chunks_mut(cols).zip(g.chunks(cols)) {
            for h in 0..cols / group {
                let base = h * group + offset;
                for (j, &src) in p.iter().enumerate() {
                    row_m[base + src] = row_g[base + j];
                }
            }
        }
        metric.error(&moved, w) <= metric.tol()
    })
}

/// Experts used by diverging rows of an MoE FFN output and by no matching row.
fn suspect_experts(
    d: &Divergence,
    experts: Option<&Act>,
    metric: &Metric,
) -> Option<(Vec<i64>, usize)> {
    let (Data::F32(g), Data::F32(w)) = (&d.got.data, &d.want.data) else {
        return None;
    };
    let e = experts?;
    let Data::Idx(ids) = &e.data else { return None };
    let cols = d.got.cols;
    let mut bad_rows = 0;
    let (mut bad, mut good) = (BTreeSet::new(), BTreeSet::new());
    for i in 0..d.got.rows.min(e.rows) {
        let err = metric.error(&g[i * cols..(i + 1) * cols], &w[i * cols..(i + 1) * cols]);
        let set = row_sets(ids, e.cols, i, None);
        if err > metric.tol() || err.is_nan() {
            bad_rows += 1;
            bad.extend(set);
        } else {
            good.extend(set);
        }
    }
    let s: Vec<i64> = bad.difference(&good).copied().collect();
    (!s.is_empty()).then_some((s, bad_rows))
}

/// Turns a divergence into a finding: where, the numbers, the weights involved, a diagnosis.
fn describe(
    d: &Divergence,
    out: &Outcome,
    metric: &Metric,
    against: &str,
    model: &Model,
    spec: Option<&ModelSpec>,
    got_all: &[Act],
) -> Item {
    let (row, col, gv, wv) = d.worst;
    let mut s = format!(
        "first divergence from {against}: {} {:.3e} > tolerance {:.1e} ({}); largest difference at token {row}, column {col}: {gv} vs {wv}",
        metric.name(),
        d.err,
        metric.tol(),
        metric.why(),
    );
    if d.got.rows != d.want.rows || d.got.cols != d.want.cols {
        s = format!(
            "first divergence from {against}: shape [{}, {}] vs the reference's [{}, {}]",
            d.got.rows, d.got.cols, d.want.rows, d.want.cols
        );
    }
    if !d.before.is_empty() {
        let b: Vec<String> = d
            .before
            .iter()
            .map(|(n, e)| format!("{n} {e:.1e}"))
            .collect();
        s.push_str(&format!(
            "; its inputs in this layer match ({})",
            b.join(", ")
        ));
    }
    let w = op_weights(&d.name, model);
    if !w.is_empty() {
        s.push_str(&format!("; computed from {}", with_shards(&w, model)));
    }
    let mut advice = "compare these weights with the checkpoint (doctor --hf) and reconvert the model; if the weights are right, the runtime's op is wrong".to_string();
    let mla = spec.and_then(|sp| match &sp.attention {
        AttentionSpec::Mla(m) => Some(*m),
        _ => None,
    });
    let op = layer_of(&d.name).map_or(d.name.as_str(), |l| d.name.get(l.len() + 1..).unwrap_or(""));
    match (op, mla) {
        ("attn_q_b.out", Some(m))
            if rope_layout_fits(d, m.qk_head(), m.qk_nope, m.qk_rope, metric) =>
        {
            s.push_str(&format!(
                "; it matches once the {} rotary columns of each head are reordered between interleaved and half-split order: the RoPE dims of the attn_q_b rows are laid out half-split (NeoX) instead of interleaved",
                m.qk_rope
            ));
            advice = "the converter permuted the rope rows for the wrong RoPE style: reconvert with the architecture's own converter (glm-dsa/deepseek2 keep HF's interleaved order)".into();
        }
        ("attn_kv_a_mqa.out", Some(m))
            if rope_layout_fits(
                d,
                m.kv_lora_rank + m.qk_rope,
                m.kv_lora_rank,
                m.qk_rope,
                metric,
            ) =>
        {
            s.push_str(&format!(
                "; it matches once the last {} (rotary) columns are reordered between interleaved and half-split order: the RoPE rows of attn_kv_a_mqa are laid out half-split (NeoX) instead of interleaved",
                m.qk_rope
            ));
            advice = "the converter permuted the rope rows for the wrong RoPE style: reconvert with the architecture's own converter".into();
        }
        ("attn_output.out", _) => {
            s.push_str("; queries and latents entering attention match, so the kv_b split (attn_k_b/attn_v_b), the output projection or the attention op itself (RoPE style, mask, DSA selection) is wrong");
            advice = "run doctor with --hf to compare the kv_b split with kv_b_proj (check 4); if the weights match, the runtime's attention is wrong".into();
        }
        ("ffn.out", _) => {
            let layer = layer_of(&d.name).unwrap_or("");
            let experts = got_all
                .iter()
                .find(|a| a.name == format!("{layer}.router.experts"));
            match (experts, out.routing_differs.get(layer)) {
                (Some(_), None) => {
                    s.push_str("; the router chose the same experts as the reference");
                    if let Some((ex, rows)) = suspect_experts(d, experts, metric) {
                        s.push_str(&format!(
                            ", and the {rows} diverging tokens are exactly those routed to experts {ex:?}: those experts' slices of the stacked ffn_*_exps tensors are wrong (experts stacked in the wrong order?)"
                        ));
                    } else {
                        s.push_str(
                            ": the expert weights (ffn_*_exps) or the shared expert are wrong",
                        );
                    }
                    advice = "restack the experts in HF order (expert E is slice E along ne2) by reconverting the model".into();
                }
                (Some(_), Some(rows)) => {
                    s.push_str(&format!(
                        "; the router chose other experts than the reference for {} token(s): the divergence may start in the router inputs",
                        rows.len()
                    ));
                }
                _ => {}
            }
        }
        _ => {}
    }
    if !out.index_rows_differ.is_empty() {
        let v: Vec<String> = out
            .index_rows_differ
            .iter()
            .map(|(n, k, r)| format!("{n} {k}/{r} rows"))
            .collect();
        s.push_str(&format!(
            "; selections that differ before it: {}",
            v.join(", ")
        ));
    }
    Item::finding(d.name.clone(), s).advice(advice)
}

/// Tolerance against a reference from the original weights, and its reason.
pub fn reference_metric(model: &Model) -> Metric {
    let (e, ty) = model_weight_error(model);
    let tol = activation_tolerance(e);
    let why = if e == 0.0 {
        "f32 weights: f32 summation-order floor".to_string()
    } else {
        format!(
            "{} x the {ty} rounding error {e:.1e} of the model's coarsest matrices (tolerance.rs)",
            super::tolerance::ACTIVATION_FACTOR
        )
    };
    Metric::RelRms { tol, why }
}

/// The options check 7 runs with.
pub struct Options<'a> {
    pub activations: Option<&'a Path>,
    pub hf: Option<&'a Path>,
    pub device: runtime::device::Device,
    pub quick: bool,
    /// The count prompt's token ids (backend comparison and the `--hf` dump).
    pub prompt: Option<Vec<u32>>,
    /// `--tp N` with N > 1: the sharded model (on `device`) is the backend under test.
    pub tp: Option<runtime::device::LoadOptions>,
}

pub fn run(model: &Arc<Model>, opts: &Options<'_>) -> CheckResult {
    let mut r = CheckResult::new(7, "layers");
    let cuda = match opts.device.resolve() {
        runtime::device::Device::Cuda(i) if kernels::device_count() > i => Ok(i),
        runtime::device::Device::Cuda(_) => Err("cuda side: no CUDA device"),
        _ if kernels::device_count() == 0 => Err("cuda side: no CUDA device"),
        _ => Err("cuda side: --device cpu"),
    };
    if opts.activations.is_none() && opts.hf.is_none() && cuda.is_err() && opts.tp.is_none() {
        r.skipped = Some(format!(
            "{}; no reference activations (--activations FILE or --hf HF_DIR)",
            cuda.err().unwrap_or_default()
        ));
        return r;
    }
    let layers = opts.quick.then_some(super::QUICK_LAYERS as usize);
    let spec = ModelSpec::from_model(model).ok();
    let mut done = Vec::new();
    let mut skipped = Vec::new();
    let cpu = match load(runtime::cpu::CpuBackend, model, layers) {
        Ok(m) => m,
        Err(e) => {
            r.push(Item::finding(
                super::file_name(model.path()),
                format!("the CPU reference runtime cannot load the model: {e}"),
            ));
            return r;
        }
    };
    let scope = match layers {
        Some(n) => format!(" (--quick: the first {n} layers)"),
        None => String::new(),
    };
    // References from the original weights.
    let mut dumps: Vec<Result<Dump, String>> = Vec::new();
    if let Some(p) = opts.activations {
        dumps.push(load_dump(p));
    }
    if let Some(hf) = opts.hf {
        match (&opts.prompt, super::hf_dump::python_transformers()) {
            (None, _) => {
                skipped.push("transformers side: no prompt (the GGUF has no tokenizer)".to_string())
            }
            (_, Err(why)) => skipped.push(format!("transformers side: {why}")),
            (Some(ids), Ok(py)) => dumps.push(super::hf_dump::run(&py, hf, ids, layers)),
        }
    }
    let metric = reference_metric(model);
    for d in dumps {
        let d = match d {
            Ok(d) => d,
            Err(e) => {
                r.push(Item::warning(None, format!("reference not usable: {e}")));
                continue;
            }
        };
        let got = match observe(&cpu, &d.ids) {
            Ok(g) => g,
            Err(e) => {
                r.push(Item::finding(
                    format!("prompt of {}", d.source),
                    format!(
                        "the CPU forward pass fails on its {} tokens: {e}",
                        d.ids.len()
                    ),
                ));
                continue;
            }
        };
        // A truncated model's last norm and head see layer `n`'s output: compare them only with
        // a reference truncated the same way (the --hf dump), never with a full model's.
        let in_scope = |n: &str| match (layers, layer_of(n)) {
            (None, _) | (_, Some(_)) => true,
            (Some(_), None) => n == "token_embd.out" || d.truncated,
        };
        let want = |n: &str| d.acts.get(n).filter(|_| in_scope(n)).cloned();
        let out = compare(&got, &want, &metric);
        if out.compared == 0 {
            r.push(Item::warning(
                d.source.clone(),
                "no activation of the dump has a name this runtime produces".to_string(),
            ));
            continue;
        }
        match &out.divergence {
            Some(div) => r.push(describe(
                div,
                &out,
                &metric,
                &format!("the reference {}", d.source),
                model,
                spec.as_ref(),
                &got,
            )),
            None => done.push(format!(
                "CPU reference vs {}: {} activations of {} tokens within {:.1e} ({}; largest {}){scope}",
                d.source,
                out.compared,
                d.ids.len(),
                metric.tol(),
                metric.why(),
                out.worst_ok
                    .as_ref()
                    .map(|(n, e)| format!("{e:.1e} at {n}"))
                    .unwrap_or_default()
            )),
        }
    }
    // The chosen backend against the CPU reference.
    match (&opts.tp, cuda) {
        (Some(lo), _) => {
            if let Some(line) = tp_side(model, lo, opts.prompt.as_deref(), &mut r) {
                done.push(line);
            }
        }
        (None, Ok(i)) => {
            if let Some(line) = cuda_side(
                model,
                i,
                layers,
                opts.prompt.as_deref(),
                &cpu,
                spec.as_ref(),
                &mut r,
            ) {
                done.push(format!("{line}{scope}"));
            }
        }
        (None, Err(why)) => skipped.push(why.to_string()),
    }
    if opts.activations.is_none() && opts.hf.is_none() {
        skipped.push("no reference activations (--activations FILE or --hf HF_DIR)".into());
    }
    if done.is_empty()
        && r.items
            .iter()
            .all(|i| i.severity != super::report::Severity::Finding)
    {
        r.skipped = Some(skipped.join("; "));
    } else if !skipped.is_empty() {
        done.push(format!("skipped: {}", skipped.join("; ")));
    }
    r.summary = done.join("; ");
    r
}

/// The tensor-parallel model (`--tp N`, CPU or CUDA ranks) against the whole-model CPU reference
/// on the count prompt: logits within the backend tolerance and the same greedy continuation.
/// Ranks hold no per-layer observer (their partial sums are not activations), so this compares
/// the model's output; `--tp 1` localizes a divergence layer by layer.
fn tp_side(
    model: &Arc<Model>,
    lo: &runtime::device::LoadOptions,
    prompt: Option<&[u32]>,
    r: &mut CheckResult,
) -> Option<String> {
    let ids: Vec<u32> = match prompt {
        Some(p) => p.to_vec(),
        None => (0..40u32).map(|i| 100 + 7 * i).collect(),
    };
    let subject = match lo.tp {
        Some(runtime::device::TpSize::Ranks(n)) => format!("tp {n} on {}", lo.device.name()),
        _ => format!("tp on {}", lo.device.name()),
    };
    // The whole model on the CPU: --quick's truncated reference cannot be compared with a
    // full sharded forward pass.
    let cpu = match runtime::glm::load_cpu(Arc::clone(model)) {
        Ok(m) => m,
        Err(e) => {
            r.push(Item::finding(
                super::file_name(model.path()),
                format!("the CPU reference runtime cannot load the model: {e}"),
            ));
            return None;
        }
    };
    let tp = match crate::cmd::tp::load(Arc::clone(model), lo.clone(), true) {
        Ok(l) => l,
        Err(e) => {
            r.push(
                Item::finding(subject, format!("the sharded model cannot load: {e:#}"))
                    .advice("`gguftool plan MODEL --tp N` shows which dimension does not divide"),
            );
            return None;
        }
    };
    let tol = runtime::cuda::check::tolerance_for(tp.device, cpu.spec().n_layer);
    // Layer by layer first, where the ranks compute in f32 like the reference (CPU ranks, or
    // CUDA ranks on the exact path): rank 0's replicated and all-reduced activations are the
    // whole model's, so the first block whose outputs diverge is named as for one device.
    let exact_ranks = match tp.device {
        runtime::device::Device::Cuda(_) => runtime::cuda::CudaOptions::default().exact,
        _ => true,
    };
    let mut by_layer = String::new();
    match (&tp.sharded, exact_ranks) {
        (Some(ranks), true) => match (observe(&cpu, &ids), ranks.observe_rank0(&ids)) {
            (Ok(want), Ok(got)) => {
                let by_name: HashMap<&str, &Act> =
                    want.iter().map(|a| (a.name.as_str(), a)).collect();
                // Head- and vocabulary-split activations have the rank's local shape: only
                // the whole ones are comparable.
                let got: Vec<Act> = got
                    .into_iter()
                    .map(|o| Act {
                        name: o.name,
                        rows: o.rows,
                        cols: o.cols,
                        data: match o.data {
                            runtime::tp::ObservedData::F32(v) => Data::F32(v),
                            runtime::tp::ObservedData::Index(v) => Data::Idx(v),
                        },
                    })
                    .filter(|g| {
                        by_name
                            .get(g.name.as_str())
                            .is_some_and(|w| w.rows == g.rows && w.cols == g.cols)
                    })
                    .collect();
                let metric = Metric::MaxAbs {
                    tol: f64::from(runtime::cuda::check::LOGIT_TOL),
                    why: "f32 on every rank; only the summation order of the all-reduced partial sums differs".into(),
                };
                let lookup = |n: &str| by_name.get(n).map(|a| (*a).clone());
                let out = compare(&got, &lookup, &metric);
                if let Some(div) = &out.divergence {
                    let spec = ModelSpec::from_model(model).ok();
                    let mut item = describe(
                        div,
                        &out,
                        &metric,
                        &format!("the CPU reference ({subject}, rank 0)"),
                        model,
                        spec.as_ref(),
                        &got,
                    );
                    item.advice = Some(
                        "run with --tp 1: if that passes, a shard role or slice in the mapping table is wrong for this model".into(),
                    );
                    r.push(item);
                    return None;
                }
                by_layer = format!(
                    "; rank 0: {} whole activations within {:.0e} of max |value|",
                    out.compared,
                    metric.tol()
                );
            }
            (Err(e), _) | (_, Err(e)) => {
                r.push(Item::finding(
                    subject.clone(),
                    format!("the observed forward pass failed: {e}"),
                ));
                return None;
            }
        },
        (Some(_), false) => {
            by_layer = "; not layer by layer: the fast path's quantized activations have no per-layer bound (GGUFTOOL_CUDA_EXACT=1 compares them)".into();
        }
        (None, _) => {}
    }
    match runtime::cuda::check::compare_with(&cpu, tp.lm.as_ref(), &ids, 8, tol) {
        Ok(c) => match c.failure {
            Some(f) => {
                r.push(
                    Item::finding(
                        subject,
                        format!("the sharded forward pass diverges from the CPU reference: {f}"),
                    )
                    .advice(
                        "run with --tp 1: if that passes, a shard role or slice in the mapping table is wrong for this model",
                    ),
                );
                None
            }
            None => Some(format!(
                "{subject} vs CPU reference: logits of {} tokens within {tol:.1e} of max |logit| (max rel diff {:.2e}), greedy {}/{} decode steps identical{by_layer}",
                ids.len(),
                c.max_rel_diff,
                c.greedy_identical,
                c.steps
            )),
        },
        Err(e) => {
            r.push(Item::finding(subject, format!("forward pass failed: {e}")));
            None
        }
    }
}

/// CUDA model vs CPU model on the count prompt; returns the summary line when it ran clean.
fn cuda_side(
    model: &Arc<Model>,
    ordinal: usize,
    layers: Option<usize>,
    prompt: Option<&[u32]>,
    cpu: &GlmModel<runtime::cpu::CpuBackend>,
    spec: Option<&ModelSpec>,
    r: &mut CheckResult,
) -> Option<String> {
    let ids: Vec<u32> = match prompt {
        Some(p) => p.to_vec(),
        None => (0..40u32).map(|i| 100 + 7 * i).collect(),
    };
    // Layer by layer on the exact path (f32 activations and cache): beyond summation order any
    // difference is a fault. The fast path's quantized activations are judged below by their
    // own derived logit tolerance.
    let exact = runtime::cuda::CudaOptions {
        exact: true,
        kv_bf16: false,
    };
    let gpu = match runtime::cuda::CudaBackend::with_options(ordinal, exact)
        .and_then(|b| load(b, model, layers))
    {
        Ok(g) => g,
        Err(e) => {
            r.push(Item::finding(
                format!("cuda:{ordinal}"),
                format!("the CUDA backend cannot load the model: {e}"),
            ));
            return None;
        }
    };
    let (want, got) = match (observe(cpu, &ids), observe(&gpu, &ids)) {
        (Ok(w), Ok(g)) => (w, g),
        (Err(e), _) | (_, Err(e)) => {
            r.push(Item::finding(
                format!("cuda:{ordinal}"),
                format!("forward pass failed: {e}"),
            ));
            return None;
        }
    };
    let metric = Metric::MaxAbs {
        tol: f64::from(runtime::cuda::check::LOGIT_TOL),
        why: "same weights and f32 math on both, only the summation order differs (runtime/src/cuda/check.rs)".into(),
    };
    let by_name: HashMap<&str, &Act> = want.iter().map(|a| (a.name.as_str(), a)).collect();
    let lookup = |n: &str| by_name.get(n).map(|a| (*a).clone());
    let out = compare(&got, &lookup, &metric);
    if let Some(div) = &out.divergence {
        r.push(describe(
            div,
            &out,
            &metric,
            "the CPU reference (CUDA backend)",
            model,
            spec,
            &got,
        ));
        return None;
    }
    let mut line = format!(
        "cuda:{ordinal} vs CPU reference: {} activations of {} tokens within {:.0e} of max |value|",
        out.compared,
        ids.len(),
        metric.tol()
    );
    if layers.is_none() {
        match runtime::cuda::check::compare(cpu, &gpu, &ids, 8) {
            Ok(c) => match c.failure {
                Some(f) => {
                    r.push(Item::finding(
                        format!("cuda:{ordinal}"),
                        format!("greedy decoding diverges from the CPU: {f}"),
                    ));
                    return None;
                }
                None => line.push_str(&format!(
                    "; greedy {}/{} decode steps identical",
                    c.greedy_identical, c.steps
                )),
            },
            Err(e) => r.push(Item::warning(
                format!("cuda:{ordinal}"),
                format!("greedy comparison failed: {e}"),
            )),
        }
        // The default (fast) path users run: q8 activations and a bf16 cache can move a
        // near-tie expert or key selection, so a divergence here is a warning, not a fault.
        match runtime::cuda::load_cuda(Arc::clone(model), ordinal)
            .and_then(|fast| runtime::cuda::check::compare(cpu, &fast, &ids, 8))
        {
            Ok(c) => match c.failure {
                Some(f) => r.push(
                    Item::warning(
                        format!("cuda:{ordinal} fast path"),
                        format!("differs from the CPU beyond its derived tolerance: {f}"),
                    )
                    .advice("GGUFTOOL_CUDA_EXACT=1 runs the exact path, which matched above"),
                ),
                None => line.push_str(&format!(
                    "; fast path: max rel diff {:.2e} (tol {:.1e}), greedy {}/{}",
                    c.max_rel_diff, c.tolerance, c.greedy_identical, c.steps
                )),
            },
            Err(e) => r.push(Item::warning(
                format!("cuda:{ordinal} fast path"),
                format!("comparison failed: {e}"),
            )),
        }
    }
    Some(line)
}
