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
//!   Along the deepest path of an n-layer model there are L = 8n + 1 GEMVs (q_a, q_b, k_b, v_b,
//!   o, gate/up, down per layer and the head) and n attentions; independent errors add in
//!   quadrature, and the bound taken is 4 standard deviations plus the exact path's:
//!   tol = 4 sqrt(L (EPS_Q8^2 + EPS_BF16^2) + n EPS_KV^2) + LOGIT_TOL (0.16 for 4 layers).
//!   Wrong kernels give errors of the order of the logits themselves, far above it; the tight
//!   check of the arithmetic is the exact path's.
//!
//! Top-1 must agree wherever the CPU's top-1/top-2 gap exceeds twice the tolerance (both
//! choices are correct inside it: a near tie, counted and reported).

use crate::cpu::CpuBackend;
use crate::glm::GlmModel;
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
        if opts.exact { 0.0 } else { EPS_Q8 * EPS_Q8 + EPS_BF16 * EPS_BF16 },
        if opts.kv_bf16 { EPS_KV * EPS_KV } else { 0.0 },
    );
    (4.0 * (l * q + n * kv).sqrt()) as f32 + LOGIT_TOL
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

/// Prefill `prompt` on both models, then teacher-forced greedy decoding of `steps` tokens (the
/// CPU's choice is fed to both), comparing logits at every step with the tolerance of the GPU
/// model's options.
pub fn compare(
    cpu: &GlmModel<CpuBackend>,
    gpu: &GlmModel<CudaBackend>,
    prompt: &[u32],
    steps: usize,
) -> Result<PromptCheck, RuntimeError> {
    let tol = logit_tolerance(gpu.backend().options(), gpu.spec().n_layer);
    compare_with(cpu, gpu, prompt, steps, tol)
}

/// [`compare`] with an explicit tolerance (relative to max |logit|), for any two models.
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
    let mut r = PromptCheck {
        max_rel_diff: 0.0,
        greedy_identical: 0,
        steps,
        near_tie: None,
        near_ties: Vec::new(),
        tolerance: tol_rel,
        failure: None,
    };
    for n in 0..=steps {
        if lc.len() != lg.len() {
            r.failure = Some(format!("step {n}: {} vs {} logits", lg.len(), lc.len()));
            break;
        }
        let scale = lc.iter().fold(1f32, |m, v| m.max(v.abs()));
        let tol = tol_rel * scale;
        let diff = lc.iter().zip(&lg).fold(0f32, |m, (a, b)| {
            if (a - b).is_nan() {
                f32::NAN
            } else {
                m.max((a - b).abs())
            }
        });
        if diff.is_nan() {
            r.max_rel_diff = f32::NAN;
            r.failure = Some(format!("step {n}: NaN in the logits"));
            break;
        }
        r.max_rel_diff = r.max_rel_diff.max(diff / scale);
        if diff > tol {
            r.failure = Some(format!("step {n}: max |dlogit| {diff} > {tol}"));
            break;
        }
        let (tc, gap) = top1(&lc);
        let (tg, _) = top1(&lg);
        if tc == tg {
            if n < steps {
                r.greedy_identical += 1;
            }
        } else if gap > 2.0 * tol {
            r.failure = Some(format!(
                "step {n}: top-1 {tg} (GPU) vs {tc} (CPU), gap {gap} > 2 x {tol}"
            ));
            break;
        } else {
            r.near_ties.push((n, gap));
            r.near_tie.get_or_insert((n, gap));
        }
        if n == steps {
            break;
        }
        // Teacher forcing: both continue with the CPU's token.
        let t = tc as u32;
        lc = step(cpu, &mut cs, &[t])?;
        lg = step(gpu, &mut gs, &[t])?;
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
    fn reference_prompts_reject_empty_lists() {
        assert!(reference_prompts(r#"{"prompts": []}"#).is_err());
        assert!(reference_prompts(r#"{"prompts": [{"id": "a", "token_ids": []}]}"#).is_err());
        let p = reference_prompts(r#"{"prompts": [{"id": "a", "token_ids": [1, 2]}]}"#).unwrap();
        assert_eq!(p, vec![("a".to_string(), vec![1, 2])]);
    }
}
