//! GPU-against-CPU comparison of a whole model: prefill logits, then teacher-forced decoding
//! (both models are fed the CPU's greedy token every step, so the comparison continues past a
//! near tie instead of stopping). Used by the fixture tests and by `gguftool doctor --model`.
//!
//! Tolerance, from the math of the kernels the GPU runs (relative to max |logit|):
//! - Exact path ([`super::CudaOptions::exact`]): both backends compute in f32 and differ only in
//!   summation order. One dot product of length k differs by at most k * 2^-24 * sum|a_i b_i|
//!   (k <= 512 on the fixtures: <= 3e-5 relative, typically ~1e-6); norms, softmax and the
//!   residual stream carry such differences through the model without amplifying them by more
//!   than a small factor: [`LOGIT_TOL`] = 1e-3 (about 30x the per-op bound).
//! - Fast path: three roundings, each an independent relative error of the outputs it feeds
//!   (standard deviations, uniform rounding errors have std = half-step / sqrt(3)):
//!   * q8 activations of every quantized GEMV: codes of step d = a/127 for a block max a <= 3 rms
//!     (Gaussian-like activations over 32 values), so an output's relative error has std
//!     <= (a/rms) / (127 sqrt(12)) = [`EPS_Q8`] = 6.8e-3;
//!   * bf16 rounding (8-bit significand) moves a value in [2^e, 2^(e+1)) by a uniform error of
//!     at most half its step 2^(e-7): std 2^(e-7) / sqrt(12) <= 2^-8 / sqrt(3) of the value
//!     (the worst case, values just above a power of two). The prefill GEMMs round both
//!     operands: sqrt(2) * 2^-8 / sqrt(3) = [`EPS_BF16`] = 3.3e-3;
//!   * the bf16 KV cache, read by every attention: 2^-8 / sqrt(3) = [`EPS_KV`] = 2.3e-3;
//!   * the MLA attention on tensor cores (taken with the bf16 cache: prefill, long and sparse
//!     decode; kernels/cuda/mla.cu `mla_tc_bf16`) also rounds the queries and the softmax
//!     weights to bf16, two more operands: a further [`EPS_BF16`] per attention.
//!
//!   Along the deepest path of an n-layer model there are L = 8n + 1 GEMVs (q_a, q_b, k_b, v_b,
//!   o, gate/up, down per layer and the head) and n attentions; independent errors add in
//!   quadrature, and the bound taken is 4 standard deviations plus the exact path's:
//!   tol = 4 sqrt(L (EPS_Q8^2 + EPS_BF16^2) + n (EPS_KV^2 + EPS_BF16^2)) + LOGIT_TOL (0.17 for
//!   4 layers; the attention terms are bf16-cache only).
//!   Wrong kernels give errors of the order of the logits themselves, far above it; the tight
//!   check of the arithmetic is the exact path's.
//!
//! Top-1 must agree wherever the CPU's top-1/top-2 gap exceeds twice the tolerance (both
//! choices are correct inside it: a near tie, counted and reported).
//!
//! Discrete selections (the DSA indexer's top-k keys, the router's experts) are not smooth: a
//! rounding can swap the element at a selection boundary, which changes that step's outputs by
//! far more than any rounding bound, and every later step through the cache. [`compare`]
//! therefore observes both models' selections every step, in forward order, with the keys the
//! reference (the first model, the CPU) ranked them by: equal sets continue the comparison; the
//! first selection that differs is judged row by row by the reference's keys. If every
//! differing row is a near tie (below), the comparison ends at that step as a "selection flip"
//! (reported, not a failure: both models computed a valid state; later layers' selections of
//! that step are downstream of the swap and not judged); any other differing row is a failure
//! (a kernel selecting wrongly), named with its elements and their gap against the delta.
//!
//! Near tie. Let k be the keys the reference ranks in one row (`blk.N.indexer.scores`,
//! `blk.N.router.choice`), A its chosen set and B the other model's, |A| = |B| (else a failure).
//! B is a top-|B| of some keys k' with |k'_j - k_j| <= h for every j (ties either way) iff
//!   gap = max_{j not in B} k_j - min_{j in B} k_j <= 2h
//! (raise B's keys by h and lower the others by h; masked keys, -inf to the top-k, are never
//! candidates, and choosing one is infinitely far). As A is a top-|A| of k, for A != B the gap is
//! max_{A \ B} k - min_{B \ A} k: the swap is explainable by perturbations of size <= h =
//! delta/2 on each key. Exact ties (gap 0) are always near ties. The key error h comes from the
//! same bound as the logits': the activations the keys are computed from carry errors of at
//! most `tol` (the logit tolerance above) relative to the row's largest magnitude, since they
//! lie at most as deep in the model as the logits (fewer roundings on their path):
//! - indexer, k_j = sum_h w_h relu(scale q_h . key_j): h = tol * max_j |k_j| (unmasked keys),
//!   delta = 2 tol max|k|;
//! - sigmoid router, k_j = sigmoid(l_j) + b_j (b a weight, exact on both sides): the logits err
//!   by at most E = tol * max|l| and sigmoid is 1/4-Lipschitz: h = E / 4, delta = tol max|l| / 2;
//! - softmax router, k_j = p_j + b_j: logits moved by at most E scale every p_j by a factor in
//!   [e^-2E, e^2E] (numerator and normaliser), so |dp_j| <= p_j (e^2E - 1) <= p_max (e^2E - 1) =
//!   h, exactly (not to first order); p_max = 1 / sum_j e^(l_j - max l);
//! - group-limited routing (n_group > 1, n_group_used < n_group; the fixtures: 6 experts in 2
//!   groups, one kept, 2 chosen, so a group swap changes both experts): groups rank by the sum
//!   of their two best keys, which moves by <= 2h. The groups B draws from, filled up to
//!   n_group_used with the reference's best other groups (the filling that makes the groups
//!   easiest to explain), must have group gap <= 4h, and B a gap <= 2h against the keys of
//!   those groups (unmasked: `blk.N.router.keys`). Each level is judged with its own worst
//!   perturbation, slightly more lenient than one perturbation for both.
//!
//! The former count rule (a symmetric difference of at most 2 + |set|/50 was a flip) is gone:
//! it took a wrong pick of one element for a tie and a tie that moved a whole small set (both
//! experts of a group) for a failure. Every selection that can differ first carries its keys; a
//! shared indexer's layer (GLM-5.2 IndexShare) copies the selection of the layer before it,
//! judged there, so a differing row without keys is a failure too.

use std::collections::HashMap;

use crate::backend::{Backend, Gating, RouteParams};
use crate::cpu::CpuBackend;
use crate::glm::{Activation, GlmModel, MASKED_KEY};
use crate::lm::{LanguageModel, SeqStep, SequenceState};
use crate::RuntimeError;

use super::{CudaBackend, CudaOptions};

/// Allowed max |logit difference| relative to max |logit| on the exact path.
pub const LOGIT_TOL: f32 = 1e-3;
/// Relative output error (std) of one GEMV on q8 activations.
pub const EPS_Q8: f64 = 3.0 / (127.0 * 3.464_101_615_137_754);
/// Relative output error (std) of one GEMM on bf16 operands (both rounded).
pub const EPS_BF16: f64 = std::f64::consts::SQRT_2 * (1.0 / 256.0) / 1.732_050_807_568_877_2;
/// Relative error (std) of values read from the bf16 KV cache.
pub const EPS_KV: f64 = (1.0 / 256.0) / 1.732_050_807_568_877_2;

/// The logit tolerance (relative to max |logit|) for a model of `n_layer` layers run with
/// `opts` (see the module docs for the derivation).
pub fn logit_tolerance(opts: CudaOptions, n_layer: usize) -> f32 {
    if opts.exact && !opts.kv_bf16 {
        return LOGIT_TOL;
    }
    let n = n_layer as f64;
    let l = 8.0 * n + 1.0;
    let (q, kv) = (
        if opts.exact {
            0.0
        } else {
            EPS_Q8 * EPS_Q8 + EPS_BF16 * EPS_BF16
        },
        // The bf16 cache, and the tensor-core attention's bf16 queries and weights.
        if opts.kv_bf16 {
            EPS_KV * EPS_KV + EPS_BF16 * EPS_BF16
        } else {
            0.0
        },
    );
    (4.0 * (l * q + n * kv).sqrt()) as f32 + LOGIT_TOL
}

/// The logit tolerance of a model loaded on `device` (resolved) with the default options: the
/// CPU's f32 summation order, or [`logit_tolerance`] of the CUDA path chosen by the environment.
pub fn tolerance_for(device: crate::device::Device, n_layer: usize) -> f32 {
    match device {
        crate::device::Device::Cuda(_) => logit_tolerance(CudaOptions::default(), n_layer),
        _ => LOGIT_TOL,
    }
}

/// Outcome for one prompt.
#[derive(Debug, Clone)]
pub struct PromptCheck {
    /// Largest `max|gpu - cpu| / max|cpu|` over the prefill and every decode step compared.
    pub max_rel_diff: f32,
    /// Decode steps whose greedy token was identical.
    pub greedy_identical: usize,
    pub steps: usize,
    /// The first top-1 disagreement inside the tolerance: (step, CPU top-1/top-2 gap).
    pub near_tie: Option<(usize, f32)>,
    /// Every such near tie (the comparison continues past them).
    pub near_ties: Vec<(usize, f32)>,
    /// The step at which the models' key or expert selections differed by a near-tie swap
    /// (the comparison ends there, see the module docs), and the selection's name with the
    /// swap: its first differing row, the elements, their gap and the delta it is within.
    pub selection_flip: Option<(usize, String)>,
    /// The tolerance applied (relative to max |logit|).
    pub tolerance: f32,
    /// Why the check failed, if it did.
    pub failure: Option<String>,
}

fn step(
    m: &dyn LanguageModel,
    seq: &mut Box<dyn SequenceState>,
    tokens: &[u32],
) -> Result<Vec<f32>, RuntimeError> {
    let mut batch = [SeqStep {
        seq: seq.as_mut(),
        tokens,
        all_logits: false,
    }];
    let mut out = m.forward(&mut batch)?;
    if out.is_empty() {
        return Err(RuntimeError::Backend("forward returned no logits".into()));
    }
    Ok(out.remove(0))
}

/// Top-1 index and its gap to the runner-up.
fn top1(v: &[f32]) -> (usize, f32) {
    let mut b = 0;
    for i in 1..v.len() {
        if v[i] > v[b] {
            b = i;
        }
    }
    let second = v
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != b)
        .fold(f32::NEG_INFINITY, |m, (_, &x)| m.max(x));
    (b, v.get(b).copied().unwrap_or(0.0) - second)
}

/// One step's observations: the selections in forward order and the keys they ranked.
#[derive(Debug, Default)]
struct Observed {
    /// `(name, rows as sorted sets)` of every `*.indexer.topk_indices` and `*.router.experts`.
    sels: Vec<(String, Vec<Vec<i64>>)>,
    /// The ranking keys a selection is judged by, by name (`*.indexer.scores`,
    /// `*.router.logits`, `*.router.choice`, `*.router.keys`): `(cols, data)`.
    keys: HashMap<String, (usize, Vec<f32>)>,
}

impl Observed {
    /// Row `r` of the keys activation `name`.
    fn row(&self, name: &str, r: usize) -> Option<&[f32]> {
        let (cols, data) = self.keys.get(name)?;
        data.get(r * cols..(r + 1) * cols)
    }
}

/// Whether an observed F32 activation is one a selection is judged by.
fn is_key(name: &str) -> bool {
    [
        "indexer.scores",
        "router.logits",
        "router.choice",
        "router.keys",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

/// One forward step, collecting the indexer's and the router's selections and their keys.
fn step_observed<B: Backend>(
    m: &GlmModel<B>,
    seq: &mut Box<dyn SequenceState>,
    tokens: &[u32],
) -> Result<(Vec<f32>, Observed), RuntimeError> {
    let mut seen = Observed::default();
    let mut obs = |name: &str, a: Activation<'_>| match a {
        Activation::Index { rows, cols, data }
            if name.ends_with("indexer.topk_indices") || name.ends_with("router.experts") =>
        {
            let sets = (0..rows)
                .map(|r| {
                    let mut v: Vec<i64> = data[r * cols..(r + 1) * cols]
                        .iter()
                        .copied()
                        .filter(|&x| x >= 0)
                        .collect();
                    v.sort_unstable();
                    v
                })
                .collect();
            seen.sels.push((name.to_string(), sets));
        }
        Activation::F32 { cols, data, .. } if is_key(name) => {
            seen.keys.insert(name.to_string(), (cols, data.to_vec()));
        }
        _ => {}
    };
    let mut batch = [SeqStep {
        seq: seq.as_mut(),
        tokens,
        all_logits: false,
    }];
    let mut out = m.forward_observed(&mut batch, Some(&mut obs))?;
    if out.is_empty() {
        return Err(RuntimeError::Backend("forward returned no logits".into()));
    }
    Ok((out.remove(0), seen))
}

/// How two steps' selections relate: equal, a near-tie swap (described), or a real difference.
#[derive(Debug)]
enum SelCmp {
    Equal,
    Flip(String),
    Differ(String),
}

/// What judging a differing selection needs besides the observations.
#[derive(Debug, Clone, Copy)]
struct Judge {
    /// Relative error bound of the activations the keys are computed from (the logit
    /// tolerance, relative to a row's largest magnitude).
    tol: f32,
    /// The reference's routing (gating, expert groups), when it has experts.
    route: Option<RouteParams>,
}

/// Where a chosen set stands against the keys it was chosen by: `gap` = max over the keys not
/// chosen minus min over the chosen ones (masked keys never count as not chosen; choosing one,
/// or an index without a key, is infinitely far). The set is a top-|set| of keys moved by at
/// most h each iff `gap <= 2 h` (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Gap {
    gap: f32,
    /// The best key not chosen and the worst chosen, when there are such.
    best_out: Option<usize>,
    worst_in: Option<usize>,
}

/// [`Gap`] of the set `b` (ascending indices) against `keys`, counting only the keys for which
/// `region` holds as candidates.
fn swap_gap(keys: &[f32], b: &[i64], region: impl Fn(usize) -> bool) -> Gap {
    let mut worst_in: Option<usize> = None;
    let mut lo = f32::INFINITY;
    for &j in b {
        let k = usize::try_from(j)
            .ok()
            .and_then(|u| keys.get(u).map(|&v| (u, v)));
        match k {
            Some((u, v)) if v > MASKED_KEY && region(u) => {
                if v < lo || worst_in.is_none() {
                    lo = v;
                    worst_in = Some(u);
                }
            }
            // A masked key, one outside the candidates or no key at all: no rounding of the
            // keys makes a correct top-k choose it.
            _ => {
                return Gap {
                    gap: f32::INFINITY,
                    best_out: None,
                    worst_in: usize::try_from(j).ok(),
                };
            }
        }
    }
    let mut best_out: Option<usize> = None;
    let mut hi = f32::NEG_INFINITY;
    for (u, &v) in keys.iter().enumerate() {
        if v > MASKED_KEY && region(u) && b.binary_search(&(u as i64)).is_err() && v > hi {
            hi = v;
            best_out = Some(u);
        }
    }
    Gap {
        gap: hi - lo,
        best_out,
        worst_in,
    }
}

/// Elements of sorted `a` not in sorted `b`.
fn minus(a: &[i64], b: &[i64]) -> Vec<i64> {
    a.iter()
        .copied()
        .filter(|x| b.binary_search(x).is_err())
        .collect()
}

/// Largest |value| of the unmasked keys.
fn max_abs(v: &[f32]) -> f32 {
    v.iter()
        .filter(|&&x| x > MASKED_KEY)
        .fold(0f32, |m, x| m.max(x.abs()))
}

/// The largest error `h` of one router key (probability plus bias) under logits of error at
/// most `tol` times the row's max |logit| (module docs).
fn route_key_error(logits: &[f32], gating: Gating, tol: f32) -> f32 {
    let e = tol * max_abs(logits);
    match gating {
        Gating::Sigmoid => e / 4.0,
        Gating::Softmax => {
            let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = logits.iter().map(|l| (l - mx).exp()).sum();
            let p_max = if z > 0.0 { 1.0 / z } else { 1.0 };
            p_max * (2.0 * e).exp_m1()
        }
    }
}

/// A row's verdict: `Ok` with a description of the near-tie swap, `Err` with why it is not one.
type RowVerdict = Result<String, String>;

/// "`b`'s elements not in `a` for `a`'s not in `b`", with the gap against the allowed delta.
fn describe(a: &[i64], b: &[i64], keys: &[f32], g: &Gap, delta: f32) -> String {
    let key = |j: Option<usize>| {
        j.map(|u| match keys.get(u) {
            Some(&v) if v > MASKED_KEY => format!("{u} ({v:.4e})"),
            Some(_) => format!("{u} (masked)"),
            None => format!("{u} (no key)"),
        })
        .unwrap_or_else(|| "-".into())
    };
    format!(
        "{:?} chosen for {:?}: best key not chosen {}, worst chosen {}, gap {:.3e} {} delta {:.3e}",
        minus(b, a),
        minus(a, b),
        key(g.best_out),
        key(g.worst_in),
        g.gap,
        if g.gap <= delta { "<=" } else { ">" },
        delta
    )
}

/// Judge row `r` of the indexer selection `name` (reference set `a`, other `b`).
fn judge_indexer(c: &Observed, name: &str, r: usize, a: &[i64], b: &[i64], tol: f32) -> RowVerdict {
    let sname = format!(
        "{}indexer.scores",
        name.trim_end_matches("indexer.topk_indices")
    );
    let s = c
        .row(&sname, r)
        .ok_or_else(|| format!("no reference {sname} row to judge it by"))?;
    // h = tol * max|s|: delta = 2h.
    let delta = 2.0 * tol * max_abs(s);
    let g = swap_gap(s, b, |_| true);
    let d = describe(a, b, s, &g, delta);
    if g.gap <= delta {
        Ok(d)
    } else {
        Err(d)
    }
}

/// Judge row `r` of the router selection `name` (reference set `a`, other `b`).
fn judge_router(c: &Observed, name: &str, r: usize, a: &[i64], b: &[i64], j: &Judge) -> RowVerdict {
    let p = j
        .route
        .ok_or_else(|| "the reference has no routing parameters".to_string())?;
    let prefix = name.trim_end_matches("router.experts");
    let get = |what: &str| {
        let n = format!("{prefix}router.{what}");
        c.row(&n, r)
            .ok_or_else(|| format!("no reference {n} row to judge it by"))
    };
    let h = route_key_error(get("logits")?, p.gating, j.tol);
    let delta = 2.0 * h;
    if !crate::cpu::group_limited(&p) {
        let choice = get("choice")?;
        let g = swap_gap(choice, b, |_| true);
        let d = describe(a, b, choice, &g, delta);
        return if g.gap <= delta { Ok(d) } else { Err(d) };
    }
    // Group-limited: the groups `b` draws from, filled with the reference's best other groups,
    // must be a top n_group_used of the group scores moved by <= 2h each; then `b` a top-k of
    // the (unmasked) keys within those groups.
    let keys = get("keys")?;
    let gs = (p.n_expert / p.n_group).max(1);
    let gscore = crate::cpu::route_group_scores(keys, &p);
    let group_of = |set: &[i64]| {
        let mut v: Vec<i64> = set.iter().map(|&e| e / gs as i64).collect();
        v.dedup();
        v
    };
    let (ga, mut gb) = (group_of(a), group_of(b));
    if gb.len() > p.n_group_used {
        return Err(format!(
            "experts {b:?} span groups {gb:?}, more than the {} kept",
            p.n_group_used
        ));
    }
    let mut rest: Vec<usize> = (0..gscore.len())
        .filter(|g| gb.binary_search(&(*g as i64)).is_err())
        .collect();
    rest.sort_by(|x, y| gscore[*y].total_cmp(&gscore[*x]).then(x.cmp(y)));
    gb.extend(
        rest.iter()
            .take(p.n_group_used - gb.len())
            .map(|&g| g as i64),
    );
    gb.sort_unstable();
    // A group's score is the sum of its two best keys: each moves by <= h.
    let delta_g = 2.0 * gs.min(2) as f32 * h;
    let gg = swap_gap(&gscore, &gb, |_| true);
    let kept = |e: usize| gb.binary_search(&((e / gs) as i64)).is_ok();
    let ge = swap_gap(keys, b, kept);
    let d = format!(
        "groups {gb:?} kept for {ga:?}: group gap {:.3e} {} delta {delta_g:.3e}; {}",
        gg.gap,
        if gg.gap <= delta_g { "<=" } else { ">" },
        describe(a, b, keys, &ge, delta)
    );
    if gg.gap <= delta_g && ge.gap <= delta {
        Ok(d)
    } else {
        Err(d)
    }
}

/// Compare the selections of one step, `c` the reference's (whose keys judge a difference).
fn compare_selections(c: &Observed, g: &Observed, j: &Judge) -> SelCmp {
    if c.sels.len() != g.sels.len() {
        return SelCmp::Differ(format!("{} vs {} selections", g.sels.len(), c.sels.len()));
    }
    // Selections come in forward order. The first one that differs is judged (each of its rows
    // on its own: rows of one selection are computed from the same inputs); every later one is
    // downstream of it (a swapped expert or key changes the next layers' inputs, so at prefill
    // one near-tie swap in layer l can move many choices in layer l + 1 of the same step) and
    // says nothing more about the kernels.
    for ((nc, sc), (ng, sg)) in c.sels.iter().zip(&g.sels) {
        if nc != ng || sc.len() != sg.len() {
            return SelCmp::Differ(format!("{ng} vs {nc}"));
        }
        let mut flips = Vec::new();
        for (r, (a, b)) in sc.iter().zip(sg).enumerate() {
            if a == b {
                continue;
            }
            let verdict = if a.len() != b.len() {
                Err(format!("{} entries chosen for {}", b.len(), a.len()))
            } else if nc.ends_with("indexer.topk_indices") {
                judge_indexer(c, nc, r, a, b, j.tol)
            } else {
                judge_router(c, nc, r, a, b, j)
            };
            match verdict {
                Ok(d) => flips.push(format!("row {r}: {d}")),
                Err(d) => return SelCmp::Differ(format!("{nc} row {r}: {d}")),
            }
        }
        if let Some(first) = flips.first() {
            let more = match flips.len() {
                1 => String::new(),
                n => format!(" (and {} more rows within delta)", n - 1),
            };
            return SelCmp::Flip(format!("{nc} {first}{more}"));
        }
    }
    SelCmp::Equal
}

/// Prefill `prompt` on both models, then teacher-forced greedy decoding of `steps` tokens (the
/// CPU's choice is fed to both), comparing logits at every step with the tolerance of the GPU
/// model's options, and the key / expert selections (see the module docs).
pub fn compare(
    cpu: &GlmModel<CpuBackend>,
    gpu: &GlmModel<CudaBackend>,
    prompt: &[u32],
    steps: usize,
) -> Result<PromptCheck, RuntimeError> {
    let tol = logit_tolerance(gpu.backend().options(), gpu.spec().n_layer);
    compare_models(cpu, gpu, prompt, steps, tol)
}

/// [`compare`] for any two backends, with an explicit tolerance (relative to max |logit|).
pub fn compare_models<B1: Backend, B2: Backend>(
    a: &GlmModel<B1>,
    b: &GlmModel<B2>,
    prompt: &[u32],
    steps: usize,
    tol_rel: f32,
) -> Result<PromptCheck, RuntimeError> {
    if prompt.is_empty() {
        return Err(RuntimeError::Backend("compare: empty prompt".into()));
    }
    let mut sa = a.new_sequence();
    let mut sb = b.new_sequence();
    let (mut la, mut xa) = step_observed(a, &mut sa, prompt)?;
    let (mut lb, mut xb) = step_observed(b, &mut sb, prompt)?;
    let judge = Judge {
        tol: tol_rel,
        route: a.spec().moe.map(|m| RouteParams {
            n_expert: m.n_expert,
            n_used: m.n_used,
            n_group: m.n_group,
            n_group_used: m.n_group_used,
            gating: m.gating,
            normalize: m.normalize,
            scale: m.scale,
        }),
    };
    let mut r = new_check(steps, tol_rel);
    for n in 0..=steps {
        match compare_selections(&xa, &xb, &judge) {
            SelCmp::Equal => {}
            SelCmp::Flip(swap) => {
                r.selection_flip = Some((n, swap));
                break;
            }
            SelCmp::Differ(why) => {
                r.failure = Some(format!("step {n}: selections differ: {why}"));
                break;
            }
        }
        match check_step(&mut r, n, &la, &lb) {
            Some(t) if n < steps => {
                (la, xa) = step_observed(a, &mut sa, &[t])?;
                (lb, xb) = step_observed(b, &mut sb, &[t])?;
            }
            _ => break,
        }
    }
    Ok(r)
}

fn new_check(steps: usize, tol_rel: f32) -> PromptCheck {
    PromptCheck {
        max_rel_diff: 0.0,
        greedy_identical: 0,
        steps,
        near_tie: None,
        near_ties: Vec::new(),
        selection_flip: None,
        tolerance: tol_rel,
        failure: None,
    }
}

/// Compare step `n`'s logits (`lc` the reference): records the difference, near ties and
/// failures into `r`; returns the reference's greedy token to feed next, or `None` to stop.
fn check_step(r: &mut PromptCheck, n: usize, lc: &[f32], lg: &[f32]) -> Option<u32> {
    if lc.len() != lg.len() {
        r.failure = Some(format!("step {n}: {} vs {} logits", lg.len(), lc.len()));
        return None;
    }
    let scale = lc.iter().fold(1f32, |m, v| m.max(v.abs()));
    let tol = r.tolerance * scale;
    let diff = lc.iter().zip(lg).fold(0f32, |m, (a, b)| {
        if (a - b).is_nan() {
            f32::NAN
        } else {
            m.max((a - b).abs())
        }
    });
    if diff.is_nan() {
        r.max_rel_diff = f32::NAN;
        r.failure = Some(format!("step {n}: NaN in the logits"));
        return None;
    }
    r.max_rel_diff = r.max_rel_diff.max(diff / scale);
    if diff > tol {
        r.failure = Some(format!("step {n}: max |dlogit| {diff} > {tol}"));
        return None;
    }
    let (tc, gap) = top1(lc);
    let (tg, _) = top1(lg);
    if tc == tg {
        if n < r.steps {
            r.greedy_identical += 1;
        }
    } else if gap > 2.0 * tol {
        r.failure = Some(format!(
            "step {n}: top-1 {tg} (GPU) vs {tc} (CPU), gap {gap} > 2 x {tol}"
        ));
        return None;
    } else {
        r.near_ties.push((n, gap));
        r.near_tie.get_or_insert((n, gap));
    }
    Some(tc as u32)
}

/// Logits-only comparison (no selection observation: cheap for long prompts) of any two
/// models, with an explicit tolerance (relative to max |logit|).
pub fn compare_with(
    cpu: &dyn LanguageModel,
    gpu: &dyn LanguageModel,
    prompt: &[u32],
    steps: usize,
    tol_rel: f32,
) -> Result<PromptCheck, RuntimeError> {
    if prompt.is_empty() {
        return Err(RuntimeError::Backend("compare: empty prompt".into()));
    }
    let mut cs = cpu.new_sequence();
    let mut gs = gpu.new_sequence();
    let mut lc = step(cpu, &mut cs, prompt)?;
    let mut lg = step(gpu, &mut gs, prompt)?;
    let mut r = new_check(steps, tol_rel);
    for n in 0..=steps {
        match check_step(&mut r, n, &lc, &lg) {
            Some(t) if n < steps => {
                lc = step(cpu, &mut cs, &[t])?;
                lg = step(gpu, &mut gs, &[t])?;
            }
            _ => break,
        }
    }
    Ok(r)
}

/// [`compare`] over a prompt list; an empty list is an error (a check over nothing would pass).
pub fn compare_all(
    cpu: &GlmModel<CpuBackend>,
    gpu: &GlmModel<CudaBackend>,
    prompts: &[(String, Vec<u32>)],
    steps: usize,
) -> Result<Vec<(String, PromptCheck)>, RuntimeError> {
    if prompts.is_empty() {
        return Err(RuntimeError::Backend(
            "GPU check: no prompts to compare".into(),
        ));
    }
    prompts
        .iter()
        .map(|(id, ids)| Ok((id.clone(), compare(cpu, gpu, ids, steps)?)))
        .collect()
}

/// Token ids of the prompts in a reference JSON (`{"prompts": [{"id", "token_ids"}]}`, the
/// format of the fixtures' `refs/hf-tiny-glm5*.json`). A file with no usable prompt is an error.
pub fn reference_prompts(json: &str) -> Result<Vec<(String, Vec<u32>)>, RuntimeError> {
    let doc: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| RuntimeError::Model(format!("reference JSON: {e}")))?;
    let mut out = Vec::new();
    for p in doc["prompts"].as_array().into_iter().flatten() {
        let id = p["id"].as_str().unwrap_or("?").to_string();
        let ids: Vec<u32> = p["token_ids"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect();
        if !ids.is_empty() {
            out.push((id, ids));
        }
    }
    if out.is_empty() {
        return Err(RuntimeError::Model(
            "reference JSON: no prompt with token_ids".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn tolerances_follow_the_options() {
        let exact = CudaOptions {
            exact: true,
            kv_bf16: false,
        };
        assert_eq!(logit_tolerance(exact, 4), LOGIT_TOL);
        let fast = CudaOptions {
            exact: false,
            kv_bf16: true,
        };
        let t4 = logit_tolerance(fast, 4);
        assert!(t4 > 0.1 && t4 < 0.2, "{t4}");
        assert!(logit_tolerance(fast, 78) > t4);
        let kv_only = CudaOptions {
            exact: true,
            kv_bf16: true,
        };
        // Only the attention terms: the bf16 cache and the tensor-core MLA's bf16 operands.
        let t = logit_tolerance(kv_only, 4);
        let want = 4.0 * (4.0 * (EPS_KV * EPS_KV + EPS_BF16 * EPS_BF16)).sqrt() + 1e-3;
        assert!((f64::from(t) - want).abs() < 1e-6 && t < 0.05, "{t}");
    }

    /// Observations of one selection `name` (rows `sets`) with the keys activations `keys`
    /// (`(name, cols, data)`).
    fn observed(sels: &[(&str, Vec<Vec<i64>>)], keys: &[(&str, usize, Vec<f32>)]) -> Observed {
        Observed {
            sels: sels
                .iter()
                .map(|(n, s)| (n.to_string(), s.clone()))
                .collect(),
            keys: keys
                .iter()
                .map(|(n, c, d)| (n.to_string(), (*c, d.clone())))
                .collect(),
        }
    }

    const IX: &str = "blk.1.indexer.topk_indices";
    const IX_SCORES: &str = "blk.1.indexer.scores";

    fn no_route(tol: f32) -> Judge {
        Judge { tol, route: None }
    }

    fn sigmoid_route(n_group: usize, n_group_used: usize) -> RouteParams {
        RouteParams {
            n_expert: 6,
            n_used: 2,
            n_group,
            n_group_used,
            gating: Gating::Sigmoid,
            normalize: true,
            scale: 1.0,
        }
    }

    /// Indexer: the reference (scores 10, 9, 5, 4.99, 1) chose {0, 1, 2}. Swapping 2 (5) for 3
    /// (4.99) is a gap of 0.01: within delta = 2 tol max|s| = 0.02 at tol 1e-3, beyond it at 1e-4.
    /// Swapping 1 (9) for 3 is a gap of 4.01, a wrong pick however few entries differ.
    #[test]
    fn indexer_swaps_are_judged_by_the_reference_scores() {
        let scores = vec![10.0, 9.0, 5.0, 4.99, 1.0];
        let keys = [(IX_SCORES, 5, scores)];
        let c = observed(&[(IX, vec![vec![0, 1, 2]])], &keys);
        assert!(matches!(
            compare_selections(&c, &c, &no_route(1e-3)),
            SelCmp::Equal
        ));
        let near = observed(&[(IX, vec![vec![0, 1, 3]])], &[]);
        match compare_selections(&c, &near, &no_route(1e-3)) {
            SelCmp::Flip(d) => {
                assert!(d.starts_with(IX) && d.contains("[3] chosen for [2]"), "{d}")
            }
            other => panic!("a swap within delta is a flip: {other:?}"),
        }
        assert!(matches!(
            compare_selections(&c, &near, &no_route(1e-4)),
            SelCmp::Differ(_)
        ));
        let wrong = observed(&[(IX, vec![vec![0, 2, 3]])], &[]);
        match compare_selections(&c, &wrong, &no_route(1e-3)) {
            SelCmp::Differ(d) => assert!(d.contains("row 0") && d.contains("> delta"), "{d}"),
            other => panic!("a swap past delta is a failure: {other:?}"),
        }
        // A different number of entries is never a tie.
        let short = observed(&[(IX, vec![vec![0, 1]])], &[]);
        assert!(matches!(
            compare_selections(&c, &short, &no_route(1.0)),
            SelCmp::Differ(_)
        ));
    }

    /// Exact ties (ReLU zeroes whole heads: many keys score exactly 0) are flips at any tolerance;
    /// masked keys (past the query's position) can never be chosen.
    #[test]
    fn ties_are_flips_and_masked_keys_are_never_chosen() {
        let scores = vec![3.0, 0.0, 0.0, 0.0, MASKED_KEY, MASKED_KEY];
        let keys = [(IX_SCORES, 6, scores)];
        let c = observed(&[(IX, vec![vec![0, 1]])], &keys);
        let tie = observed(&[(IX, vec![vec![0, 3]])], &[]);
        assert!(matches!(
            compare_selections(&c, &tie, &no_route(0.0)),
            SelCmp::Flip(_)
        ));
        let masked = observed(&[(IX, vec![vec![0, 4]])], &[]);
        match compare_selections(&c, &masked, &no_route(1.0)) {
            SelCmp::Differ(d) => assert!(d.contains("masked"), "{d}"),
            other => panic!("choosing a masked key is a failure: {other:?}"),
        }
        // Without the reference's keys a difference cannot be a tie.
        let bare = observed(&[(IX, vec![vec![0, 1]])], &[]);
        assert!(matches!(
            compare_selections(&bare, &tie, &no_route(1.0)),
            SelCmp::Differ(_)
        ));
    }

    #[test]
    fn swap_gaps_are_max_out_minus_min_in() {
        let k = [4.0, 3.0, 2.0, 1.0, MASKED_KEY];
        let g = swap_gap(&k, &[0, 2], |_| true);
        assert_eq!((g.gap, g.best_out, g.worst_in), (1.0, Some(1), Some(2)));
        // The reference's own choice stands below every other key: a negative gap.
        assert_eq!(swap_gap(&k, &[0, 1], |_| true).gap, -1.0);
        // Candidates limited to a region: key 1 outside it does not count.
        assert_eq!(swap_gap(&k, &[0, 2], |u| u != 1).gap, -1.0);
        assert_eq!(swap_gap(&k, &[0, 4], |_| true).gap, f32::INFINITY);
        assert_eq!(swap_gap(&k, &[0, 9], |_| true).gap, f32::INFINITY);
    }

    /// Sigmoid router without groups: delta = tol max|l| / 2 on the choice (sigmoid + bias).
    #[test]
    fn sigmoid_router_swaps_use_the_logits_bound() {
        let n = "blk.2.router.experts";
        let logits = vec![4.0, -4.0, 1.0, 0.5, 0.0, -1.0];
        let choice = vec![0.9, 0.1, 0.60, 0.59, 0.3, 0.2];
        let keys = [
            ("blk.2.router.logits", 6, logits),
            ("blk.2.router.choice", 6, choice),
        ];
        let c = observed(&[(n, vec![vec![0, 2]])], &keys);
        let near = observed(&[(n, vec![vec![0, 3]])], &[]);
        let judge = |tol| Judge {
            tol,
            route: Some(sigmoid_route(1, 1)),
        };
        // gap 0.01; delta = tol * 4 / 2 = 2 tol.
        assert_eq!(route_key_error(&[4.0, -4.0], Gating::Sigmoid, 0.01), 0.01);
        assert!(matches!(
            compare_selections(&c, &near, &judge(0.01)),
            SelCmp::Flip(_)
        ));
        assert!(matches!(
            compare_selections(&c, &near, &judge(0.001)),
            SelCmp::Differ(_)
        ));
        // Without the logits (the bound's scale) nothing is judged a tie.
        let no_logits = observed(&[(n, vec![vec![0, 2]])], &keys[1..]);
        assert!(matches!(
            compare_selections(&no_logits, &near, &judge(1.0)),
            SelCmp::Differ(_)
        ));
    }

    /// Softmax gating: |dp_j| <= p_max (e^2E - 1), E = tol max|l|, for every key and every
    /// perturbation of the logits by at most E (the corners of the box are the extremes).
    #[test]
    fn softmax_key_error_bounds_every_probability() {
        let l = [2.0f32, 0.0, -1.0];
        let tol = 0.01;
        let h = route_key_error(&l, Gating::Softmax, tol);
        let e = tol * 2.0;
        let probs = |v: &[f32]| {
            let z: f32 = v.iter().map(|x| x.exp()).sum();
            v.iter().map(|x| x.exp() / z).collect::<Vec<f32>>()
        };
        let p0 = probs(&l);
        let mut worst = 0f32;
        for corner in 0..8 {
            let moved: Vec<f32> = (0..3)
                .map(|i| l[i] + if corner >> i & 1 == 1 { e } else { -e })
                .collect();
            for (a, b) in probs(&moved).iter().zip(&p0) {
                worst = worst.max((a - b).abs());
            }
        }
        assert!(worst > 0.0 && worst <= h, "{worst} vs {h}");
        assert!((h - p0[0] * (2.0 * e).exp_m1()).abs() < 1e-6, "{h}");
    }

    /// Group-limited routing (6 experts, 2 groups of 3, one kept, 2 chosen): a swap of the kept
    /// group changes both experts, a near tie when the groups' scores are within 4h and the
    /// experts are the new group's best; a wrong pick inside the new group is a failure.
    #[test]
    fn group_swaps_are_judged_at_both_levels() {
        let n = "blk.2.router.experts";
        // Group 0: 0.50 + 0.40 = 0.90; group 1: 0.46 + 0.43 = 0.89.
        let k = vec![0.50, 0.40, 0.10, 0.46, 0.43, 0.05];
        let mut choice = k.clone();
        choice[3..].iter_mut().for_each(|v| *v = MASKED_KEY);
        let keys = [
            ("blk.2.router.logits", 6, vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
            ("blk.2.router.choice", 6, choice),
            ("blk.2.router.keys", 6, k),
        ];
        let c = observed(&[(n, vec![vec![0, 1]])], &keys);
        let judge = |tol| Judge {
            tol,
            route: Some(sigmoid_route(2, 1)),
        };
        let swapped = observed(&[(n, vec![vec![3, 4]])], &[]);
        // h = tol * 2 / 4: group gap 0.01 <= 4h = 2 tol from tol 0.005 on.
        match compare_selections(&c, &swapped, &judge(0.01)) {
            SelCmp::Flip(d) => assert!(d.contains("groups [1] kept for [0]"), "{d}"),
            other => panic!("a group near tie is a flip: {other:?}"),
        }
        assert!(matches!(
            compare_selections(&c, &swapped, &judge(0.001)),
            SelCmp::Differ(_)
        ));
        // Group 1 kept, but its worst expert chosen over its second best (gap 0.38).
        let wrong = observed(&[(n, vec![vec![3, 5]])], &[]);
        assert!(matches!(
            compare_selections(&c, &wrong, &judge(0.01)),
            SelCmp::Differ(_)
        ));
        // Experts from two groups when one is kept.
        let spread = observed(&[(n, vec![vec![0, 3]])], &[]);
        match compare_selections(&c, &spread, &judge(1.0)) {
            SelCmp::Differ(d) => assert!(d.contains("span groups"), "{d}"),
            other => panic!("{other:?}"),
        }
    }

    /// Only the first differing selection of a step is judged: what follows it is downstream.
    #[test]
    fn selections_after_the_first_swap_are_downstream() {
        let l0 = "blk.0.router.experts";
        let l1 = "blk.1.router.experts";
        let logits = vec![1.0; 6];
        let choice = vec![0.5, 0.5, 0.5, 0.5, 0.5, 0.1];
        let keys = [
            ("blk.0.router.logits", 6, logits.clone()),
            ("blk.0.router.choice", 6, choice.clone()),
            ("blk.1.router.logits", 6, logits),
            ("blk.1.router.choice", 6, choice),
        ];
        let base = observed(&[(l0, vec![vec![0, 1]]), (l1, vec![vec![0, 1]])], &keys);
        let judge = Judge {
            tol: 1e-3,
            route: Some(sigmoid_route(1, 1)),
        };
        // Layer 0 swaps tied experts; layer 1 then differs completely: a flip at layer 0.
        let cascade = observed(&[(l0, vec![vec![0, 2]]), (l1, vec![vec![4, 5]])], &[]);
        match compare_selections(&base, &cascade, &judge) {
            SelCmp::Flip(d) => assert!(d.starts_with(l0), "{d}"),
            other => panic!("a near-tie swap followed by its consequences is a flip: {other:?}"),
        }
        // Layer 0 equal, layer 1 choosing expert 5 (0.1 against 0.5): a kernel selecting wrongly.
        let wrong = observed(&[(l0, vec![vec![0, 1]]), (l1, vec![vec![0, 5]])], &[]);
        match compare_selections(&base, &wrong, &judge) {
            SelCmp::Differ(d) => assert!(d.starts_with(l1), "{d}"),
            other => panic!("{other:?}"),
        }
    }

    /// Indices of the `k` largest keys (ties to the lower index), ascending: an independent
    /// top-k to check the observed keys against the observed selections.
    fn top(keys: &[f32], k: usize) -> Vec<i64> {
        let mut idx: Vec<usize> = (0..keys.len()).collect();
        idx.sort_by(|a, b| keys[*b].total_cmp(&keys[*a]).then(a.cmp(b)));
        let mut v: Vec<i64> = idx.into_iter().take(k).map(|i| i as i64).collect();
        v.sort_unstable();
        v
    }

    /// On the CPU, the observed keys are what the selections ranked: the top-k of every
    /// `router.choice` row is that row's `router.experts`, of every `indexer.scores` row its
    /// `indexer.topk_indices` (a prompt longer than the indexer's top-k, so it ranks), and every
    /// observed value is finite (the mask is [`MASKED_KEY`]).
    #[test]
    fn observed_keys_are_what_the_cpu_ranks() {
        let dir = std::env::var_os("GGUFTOOL_FIXTURES")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
            });
        let text = std::fs::read_to_string(dir.join("refs/hf-tiny-glm5-long.json")).unwrap();
        let prompts = reference_prompts(&text).unwrap();
        let (_, ids) = prompts
            .iter()
            .find(|(id, _)| id == "long_counting")
            .expect("long_counting prompt");
        let model = std::sync::Arc::new(
            gguf::Model::open(dir.join("gguf/tiny-glm5-BF16.gguf")).expect("fixture"),
        );
        let m = crate::glm::load_cpu(model).unwrap();
        let (ix, moe) = (m.spec().indexer.unwrap(), m.spec().moe.unwrap());
        assert!(
            ids.len() > ix.top_k && moe.n_group > 1,
            "the test needs both to rank"
        );
        let mut non_finite = Vec::new();
        let mut f32s: HashMap<String, (usize, usize, Vec<f32>)> = HashMap::new();
        let mut idx: Vec<(String, usize, usize, Vec<i64>)> = Vec::new();
        let mut obs = |name: &str, a: Activation<'_>| match a {
            Activation::F32 { rows, cols, data } => {
                if data.iter().any(|v| !v.is_finite()) {
                    non_finite.push(name.to_string());
                }
                f32s.insert(name.to_string(), (rows, cols, data.to_vec()));
            }
            Activation::Index { rows, cols, data } => {
                idx.push((name.to_string(), rows, cols, data.to_vec()))
            }
        };
        let mut seq = m.new_sequence();
        let mut batch = [SeqStep {
            seq: seq.as_mut(),
            tokens: ids,
            all_logits: false,
        }];
        m.forward_observed(&mut batch, Some(&mut obs)).unwrap();
        assert!(non_finite.is_empty(), "{non_finite:?}");
        let (mut routers, mut indexers, mut ranked) = (0, 0, 0);
        for (name, rows, cols, data) in &idx {
            let (keys_name, k) = if let Some(p) = name.strip_suffix("router.experts") {
                routers += 1;
                let keys = &f32s[&format!("{p}router.keys")];
                let (_, _, ch) = &f32s[&format!("{p}router.choice")];
                // The choice is the keys with the groups not kept masked.
                for (c, k) in ch.iter().zip(&keys.2) {
                    assert!(*c == MASKED_KEY || c == k, "{name}: {c} vs {k}");
                }
                (format!("{p}router.choice"), moe.n_used)
            } else {
                indexers += 1;
                let p = name.trim_end_matches("indexer.topk_indices");
                (format!("{p}indexer.scores"), ix.top_k)
            };
            let (kr, kc, kd) = &f32s[&keys_name];
            assert_eq!(kr, rows, "{keys_name}");
            for r in 0..*rows {
                let mut want: Vec<i64> = data[r * cols..(r + 1) * cols]
                    .iter()
                    .copied()
                    .filter(|&x| x >= 0)
                    .collect();
                want.sort_unstable();
                let row = &kd[r * kc..(r + 1) * kc];
                let valid = row.iter().filter(|&&v| v > MASKED_KEY).count();
                if valid > k {
                    ranked += 1;
                }
                assert_eq!(top(row, k.min(valid)), want, "{keys_name} row {r}");
            }
        }
        assert!(
            routers > 0 && indexers > 0 && ranked > 0,
            "{routers} {indexers} {ranked}"
        );
    }

    /// The observed comparison of a model with itself (CPU) finds no difference, no flip.
    #[test]
    fn a_model_matches_itself() {
        // GGUFTOOL_FIXTURES: the fixtures away from the checkout (the GPU machine's copy).
        let path = std::env::var_os("GGUFTOOL_FIXTURES")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
            })
            .join("gguf/tiny-glm5-Q4_K_M.gguf");
        let model = std::sync::Arc::new(gguf::Model::open(&path).expect("fixture"));
        let a = crate::glm::load_cpu(model.clone()).unwrap();
        let b = crate::glm::load_cpu(model).unwrap();
        let r = compare_models(&a, &b, &[1, 2, 3, 4, 5], 4, LOGIT_TOL).unwrap();
        assert!(r.failure.is_none() && r.selection_flip.is_none(), "{r:?}");
        assert_eq!((r.max_rel_diff, r.greedy_identical), (0.0, 4));
    }

    #[test]
    fn reference_prompts_reject_empty_lists() {
        assert!(reference_prompts(r#"{"prompts": []}"#).is_err());
        assert!(reference_prompts(r#"{"prompts": [{"id": "a", "token_ids": []}]}"#).is_err());
        let p = reference_prompts(r#"{"prompts": [{"id": "a", "token_ids": [1, 2]}]}"#).unwrap();
        assert_eq!(p, vec![("a".to_string(), vec![1, 2])]);
    }
}
