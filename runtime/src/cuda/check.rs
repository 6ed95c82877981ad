//! GPU-against-CPU comparison of a whole model: prefill logits, then greedy decoding, step by
//! step. Used by the fixture tests and by `gguftool doctor --model`.
//!
//! Tolerance: both backends compute in f32 and differ only in summation order. One dot product
//! of length k differs by at most k * 2^-24 * sum|a_i b_i| (k <= 512 on the fixtures: <= 3e-5
//! relative, typically ~1e-6); norms, softmax and the residual stream carry such differences
//! through the sequential ops of the model without amplifying them by more than a small factor.
//! Logits must agree to [`LOGIT_TOL`] of max|logit| (about 30x the per-op bound), top-1 must
//! agree wherever the CPU's top-1/top-2 gap exceeds twice that, and greedy continuations must be
//! identical except after such a near tie (where both choices are correct).

use crate::lm::{LanguageModel, SeqStep, SequenceState};
use crate::RuntimeError;

/// Allowed max |logit difference| relative to max |logit| (see the module docs).
pub const LOGIT_TOL: f32 = 1e-3;

/// Outcome for one prompt.
#[derive(Debug, Clone)]
pub struct PromptCheck {
    /// Largest `max|gpu - cpu| / max|cpu|` over the prefill and every decode step compared.
    pub max_rel_diff: f32,
    /// Decode steps whose greedy token was identical.
    pub greedy_identical: usize,
    pub steps: usize,
    /// A top-1 disagreement inside the tolerance: (step, CPU top-1/top-2 gap).
    pub near_tie: Option<(usize, f32)>,
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

/// Prefill `prompt` on both models, then greedy-decode `steps` tokens (the CPU's choice is fed
/// to both), comparing logits at every step.
pub fn compare(
    cpu: &dyn LanguageModel,
    gpu: &dyn LanguageModel,
    prompt: &[u32],
    steps: usize,
) -> Result<PromptCheck, RuntimeError> {
    let mut cs = cpu.new_sequence();
    let mut gs = gpu.new_sequence();
    let mut lc = step(cpu, &mut cs, prompt)?;
    let mut lg = step(gpu, &mut gs, prompt)?;
    let mut r = PromptCheck {
        max_rel_diff: 0.0,
        greedy_identical: 0,
        steps,
        near_tie: None,
        failure: None,
    };
    for n in 0..=steps {
        if lc.len() != lg.len() {
            r.failure = Some(format!("step {n}: {} vs {} logits", lg.len(), lc.len()));
            break;
        }
        let scale = lc.iter().fold(1f32, |m, v| m.max(v.abs()));
        let tol = LOGIT_TOL * scale;
        let diff = lc.iter().zip(&lg).fold(0f32, |m, (a, b)| {
            if (a - b).is_nan() {
                f32::NAN
            } else {
                m.max((a - b).abs())
            }
        });
        r.max_rel_diff = r.max_rel_diff.max(diff / scale);
        if diff.is_nan() || diff > tol {
            r.max_rel_diff = if diff.is_nan() {
                f32::NAN
            } else {
                r.max_rel_diff
            };
            r.failure = Some(format!("step {n}: max |dlogit| {diff} > {tol}"));
            break;
        }
        let (tc, gap) = top1(&lc);
        let (tg, _) = top1(&lg);
        if tc != tg {
            if gap > 2.0 * tol {
                r.failure = Some(format!(
                    "step {n}: top-1 {tg} (GPU) vs {tc} (CPU), gap {gap}"
                ));
            } else {
                r.near_tie = Some((n, gap));
            }
            break;
        }
        if n == steps {
            break;
        }
        r.greedy_identical += 1;
        let t = tc as u32;
        lc = step(cpu, &mut cs, &[t])?;
        lg = step(gpu, &mut gs, &[t])?;
    }
    Ok(r)
}

/// Token ids of the prompts in a reference JSON (`{"prompts": [{"id", "token_ids"}]}`, the
/// format of the fixtures' `refs/hf-tiny-glm5*.json`).
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
    Ok(out)
}
