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
//!   * bf16 operands of the prefill GEMMs (both rounded, 2^-9 relative step):
//!     sqrt(2) * 2^-9 / sqrt(3) = [`EPS_BF16`] = 1.6e-3;
//!   * the bf16 KV cache, read by every attention: 2^-9 / sqrt(3) = [`EPS_KV`] = 1.1e-3.
//!
//!   Along the deepest path of an n-layer model there are L = 8n + 1 GEMVs (q_a, q_b, k_b, v_b,
//!   o, gate/up, down per layer and the head) and n attentions; independent errors add in
//!   quadrature, and the bound taken is 4 standard deviations plus the exact path's:
//!   tol = 4 sqrt(L (EPS_Q8^2 + EPS_BF16^2) + n EPS_KV^2) + LOGIT_TOL (0.16 for 4 layers).
//!   Wrong kernels give errors of the order of the logits themselves, far above it; the tight
//!   check of the arithmetic is the exact path's.
//!
//! Top-1 must agree wherever the CPU's top-1/top-2 gap exceeds twice the tolerance (both
//! choices are correct inside it: a near tie, counted and reported).
//!
//! Discrete selections (the DSA indexer's top-k keys, the router's experts) are not smooth: a
//! rounding can swap the element at a selection boundary, which changes that step's outputs by
//! far more than any rounding bound, and every later step through the cache. [`compare`]
//! therefore observes both models' selections every step, in forward order: equal sets continue
//! the comparison; at the first selection that differs, rows that differ by a near-tie swap (at
//! most 2 + |set|/50 elements of their symmetric difference per row) end it at that step as a
//! "selection flip" (reported, not a failure: both models computed a valid state; later layers'
//! selections of that step are downstream of the swap and not judged); anything larger is a
//! failure (a kernel selecting wrongly).

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::glm::{Activation, GlmModel};
use crate::lm::{LanguageModel, SeqStep, SequenceState};
use crate::RuntimeError;

use super::{CudaBackend, CudaOptions};

/// Allowed max |logit difference| relative to max |logit| on the exact path.
pub const LOGIT_TOL: f32 = 1e-3;
/// Relative output error (std) of one GEMV on q8 activations.
pub const EPS_Q8: f64 = 3.0 / (127.0 * 3.464_101_615_137_754);
/// Relative output error (std) of one GEMM on bf16 operands.
pub const EPS_BF16: f64 = std::f64::consts::SQRT_2 * (1.0 / 512.0) / 1.732_050_807_568_877_2;
/// Relative error (std) of values read from the bf16 KV cache.
pub const EPS_KV: f64 = (1.0 / 512.0) / 1.732_050_807_568_877_2;

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
        if opts.kv_bf16 { EPS_KV * EPS_KV } else { 0.0 },
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
    /// (the comparison ends there, see the module docs), and the selection's name.
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

/// Selection activations of one step: (name, rows as sorted sets).
type Selections = Vec<(String, Vec<Vec<i64>>)>;

/// One forward step, collecting the indexer's and the router's selections.
fn step_observed<B: Backend>(
    m: &GlmModel<B>,
    seq: &mut Box<dyn SequenceState>,
    tokens: &[u32],
) -> Result<(Vec<f32>, Selections), RuntimeError> {
    let mut sel: Selections = Vec::new();
    let mut obs = |name: &str, a: Activation<'_>| {
        if let Activation::Index { rows, cols, data } = a {
            if name.ends_with("indexer.topk_indices") || name.ends_with("router.experts") {
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
                sel.push((name.to_string(), sets));
            }
        }
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
    Ok((out.remove(0), sel))
}

/// Symmetric difference of two sorted sets.
fn sym_diff(a: &[i64], b: &[i64]) -> usize {
    let (mut i, mut j, mut d) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Equal => {
                i += 1;
                j += 1;
            }
            std::cmp::Ordering::Less => {
                d += 1;
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                d += 1;
                j += 1;
            }
        }
    }
    d + (a.len() - i) + (b.len() - j)
}

/// How two steps' selections relate: equal, a near-tie swap (named), or a real difference.
enum SelCmp {
    Equal,
    Flip(String),
    Differ(String),
}

fn compare_selections(c: &Selections, g: &Selections) -> SelCmp {
    if c.len() != g.len() {
        return SelCmp::Differ(format!("{} vs {} selections", g.len(), c.len()));
    }
    // Selections come in forward order. The first one that differs is judged (each of its rows
    // on its own: rows of one selection are computed from the same inputs); every later one is
    // downstream of it (a swapped expert or key changes the next layers' inputs, so at prefill
    // one near-tie swap in layer l can move many choices in layer l + 1 of the same step) and
    // says nothing more about the kernels.
    for ((nc, sc), (ng, sg)) in c.iter().zip(g) {
        if nc != ng || sc.len() != sg.len() {
            return SelCmp::Differ(format!("{ng} vs {nc}"));
        }
        let mut differs = false;
        for (a, b) in sc.iter().zip(sg) {
            let d = sym_diff(a, b);
            if d > 2 + a.len() / 50 {
                return SelCmp::Differ(format!("{nc}: {d} of {} entries differ", a.len()));
            }
            differs |= d > 0;
        }
        if differs {
            return SelCmp::Flip(nc.clone());
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
    let mut r = new_check(steps, tol_rel);
    for n in 0..=steps {
        match compare_selections(&xa, &xb) {
            SelCmp::Equal => {}
            SelCmp::Flip(name) => {
                r.selection_flip = Some((n, name));
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
        let t = logit_tolerance(kv_only, 4);
        assert!(t > LOGIT_TOL && t < 0.02, "{t}");
    }

    #[test]
    fn selection_flips_are_near_tie_swaps() {
        let sel = |v: Vec<i64>| vec![("blk.1.indexer.topk_indices".to_string(), vec![v])];
        let a = sel((0..100).collect());
        assert!(matches!(compare_selections(&a, &a), SelCmp::Equal));
        let mut swapped: Vec<i64> = (0..99).collect();
        swapped.push(100);
        assert!(matches!(
            compare_selections(&a, &sel(swapped)),
            SelCmp::Flip(_)
        ));
        let far: Vec<i64> = (50..150).collect();
        assert!(matches!(
            compare_selections(&a, &sel(far)),
            SelCmp::Differ(_)
        ));
        assert_eq!(sym_diff(&[1, 2, 3], &[2, 3, 4]), 2);
    }

    /// Only the first differing selection of a step is judged: what follows it is downstream.
    #[test]
    fn selections_after_the_first_swap_are_downstream() {
        let two = |l0: Vec<i64>, l1: Vec<i64>| {
            vec![
                ("blk.0.router.experts".to_string(), vec![l0]),
                ("blk.1.router.experts".to_string(), vec![l1]),
            ]
        };
        let base = two(vec![0, 1, 2, 3], vec![0, 1, 2, 3]);
        // Layer 0 swaps one expert; layer 1 then differs completely: a flip at layer 0.
        let cascade = two(vec![0, 1, 2, 4], vec![5, 6, 7, 8]);
        match compare_selections(&base, &cascade) {
            SelCmp::Flip(name) => assert_eq!(name, "blk.0.router.experts"),
            _ => panic!("a near-tie swap followed by its consequences is a flip"),
        }
        // Layer 0 equal, layer 1 wholly different: a kernel selecting wrongly.
        let wrong = two(vec![0, 1, 2, 3], vec![5, 6, 7, 8]);
        assert!(matches!(
            compare_selections(&base, &wrong),
            SelCmp::Differ(_)
        ));
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
