//! Checking a tensor-parallel model against the same model on one rank: logits within a
//! tolerance derived from f32 summation order ([`tp_tolerance`]), greedy tokens identical
//! wherever the reference's top-2 gap exceeds twice that, decoding teacher-forced on the
//! reference's tokens (so a near tie does not end the comparison). Used by the CPU tests and the
//! GPU checks (ranks sharing one GPU).

use crate::lm::{LanguageModel, SeqStep, SequenceState};
use crate::spec::{AttentionSpec, ModelSpec};
use crate::RuntimeError;

/// How a backend's dot products add their terms (the depth of the summation tree).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Summation {
    /// The CPU reference: 8 accumulators, then a fixed tree (`depth <= K/8 + 3`).
    Blocked8,
    /// Any order at all (a GPU GEMM may accumulate a thread's output over all of `K` in
    /// sequence): `depth <= K`, the worst case.
    Sequential,
}

/// Allowed `max |logit difference| / max(1, max |logit|)` between a model split over `world`
/// ranks and the same model on one rank, from the f32 summation order alone.
///
/// Derivation. Tensor parallelism changes the arithmetic in one way: a reduced matmul
/// (`attn_output`, the dense / shared-expert / routed-expert `down`) is summed as `world`
/// partial dot products over `K / world` terms each, added in rank order, where one rank sums
/// all `K` terms in one dot product (every split by rows, heads or vocabulary computes bitwise
/// the same values on its rank). Two f32 summation orders of the same `K` products differ by at
/// most `2 γ_d Σ|a_k w_k|`, `γ_d = d u / (1 - d u)`, `u = 2^-24`, `d` the depth of the summation
/// tree ([`Summation`]; the rank sum adds at most `world - 1` levels). Each trunk block
/// contributes two such reductions to the residual stream; the norms, attention softmax and SiLU
/// carry a relative perturbation of the stream on to the logits with a gain we allow to be 2 per
/// block, and the reductions' cancellation `Σ|a w| / |Σ a w|` is allowed to be 2. So
/// `tol = 2 L · 2 γ_d · 2 · 2` with `L` the trunk blocks and `K` the widest reduced dimension.
/// Tiny-glm5 (L = 3, K = 512): 2.0e-4 blocked, 1.5e-3 sequential; observed differences are
/// ~1e-6 (the bound is worst-case).
pub fn tp_tolerance(spec: &ModelSpec, world: usize, sum: Summation) -> f32 {
    let heads_out = match &spec.attention {
        AttentionSpec::Mla(m) => m.n_head * m.v_head,
        AttentionSpec::Gqa(g) => g.n_head * g.head_dim,
    };
    let k = [
        heads_out,
        spec.n_ff,
        spec.moe.map_or(0, |e| e.n_ff * e.n_shared.max(1)),
    ]
    .into_iter()
    .max()
    .unwrap_or(1);
    let depth = match sum {
        Summation::Blocked8 => k / 8 + 3,
        Summation::Sequential => k,
    };
    let d = (depth + world.saturating_sub(1)) as f64;
    let u = 2f64.powi(-24);
    let gamma = d * u / (1.0 - d * u);
    (2.0 * spec.n_layer as f64 * 2.0 * gamma * 2.0 * 2.0) as f32
}

/// Outcome of one prompt.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TpCheck {
    /// Greedy steps compared (after the prefill).
    pub steps: usize,
    /// Largest `max|Δlogit| / max(1, max|logit|)` over the prefill and every step.
    pub max_rel_diff: f32,
    /// Steps (prefill included) whose greedy token was identical.
    pub greedy_identical: usize,
    /// Steps where the top-1 differed inside the tolerance: (step, reference top-2 gap).
    pub near_ties: Vec<(usize, f32)>,
    /// The reference's greedy tokens (fed to both models).
    pub tokens: Vec<u32>,
    pub failure: Option<String>,
}

fn last_logits(
    m: &dyn LanguageModel,
    seq: &mut dyn SequenceState,
    tokens: &[u32],
) -> Result<Vec<f32>, RuntimeError> {
    let mut b = [SeqStep {
        seq,
        tokens,
        all_logits: false,
    }];
    m.forward(&mut b)?
        .pop()
        .ok_or_else(|| RuntimeError::Backend("forward returned no logits".into()))
}

/// The best id (lowest among equals) and its margin over the runner-up.
fn best(v: &[f32]) -> (u32, f32) {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    let second = v
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != b)
        .map(|(_, &x)| x)
        .fold(f32::NEG_INFINITY, f32::max);
    (b as u32, v.get(b).map_or(0.0, |&x| x - second))
}

/// Prefill `prompt` on both models, then `steps` greedy steps fed with the reference's tokens,
/// comparing logits at every step with tolerance `tol` (relative to `max(1, max|logit|)`).
pub fn compare_greedy(
    reference: &dyn LanguageModel,
    other: &dyn LanguageModel,
    prompt: &[u32],
    steps: usize,
    tol: f32,
) -> Result<TpCheck, RuntimeError> {
    let (mut sr, mut so) = (reference.new_sequence(), other.new_sequence());
    let mut lr = last_logits(reference, sr.as_mut(), prompt)?;
    let mut lo = last_logits(other, so.as_mut(), prompt)?;
    let mut c = TpCheck {
        steps,
        max_rel_diff: 0.0,
        greedy_identical: 0,
        near_ties: Vec::new(),
        tokens: Vec::with_capacity(steps + 1),
        failure: None,
    };
    for n in 0..=steps {
        if lr.len() != lo.len() {
            c.failure = Some(format!("step {n}: {} vs {} logits", lo.len(), lr.len()));
            break;
        }
        let scale = lr.iter().fold(1f32, |m, v| m.max(v.abs()));
        let diff = lr
            .iter()
            .zip(&lo)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, |m, d| {
                if d.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(d)
                }
            });
        let rel = diff / scale;
        c.max_rel_diff = if rel.is_nan() {
            f32::NAN
        } else {
            c.max_rel_diff.max(rel)
        };
        if rel.is_nan() || rel > tol {
            c.failure = Some(format!(
                "step {n}: logits differ by {rel:.2e} of max|logit| > {tol:.2e}"
            ));
            break;
        }
        let (tr, gap) = best(&lr);
        let (to, _) = best(&lo);
        if tr == to {
            c.greedy_identical += 1;
        } else if gap > 2.0 * tol * scale {
            c.failure = Some(format!(
                "step {n}: greedy token {to} vs reference {tr} with a top-2 gap of {gap:.2e}"
            ));
            break;
        } else {
            c.near_ties.push((n, gap));
        }
        c.tokens.push(tr);
        if n == steps {
            break;
        }
        lr = last_logits(reference, sr.as_mut(), &[tr])?;
        lo = last_logits(other, so.as_mut(), &[tr])?;
    }
    Ok(c)
}
