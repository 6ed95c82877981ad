//! Non-finite numbers in a forward pass. Consumers (`generate`, the serving engine) check every
//! logits row with [`first_non_finite`] and never sample from NaN or infinity; to tell the user
//! where the values went bad, [`locate_non_finite`] re-runs the CPU reference with the activation
//! observer (`GlmModel::forward_observed`) and reports the first activation, in forward order,
//! that holds a NaN or an infinity.
//!
//! The re-run costs a CPU forward pass, so it is bounded: it starts with the first token and
//! doubles the prefix (bad hyper-parameters or weights show on any token; an overflow that needs
//! a long context shows only later) while `tokens x model bytes` stays within
//! [`LOCATE_BUDGET`]. Beyond that (GLM-5 itself) the error says to run `gguftool doctor`.

use crate::glm::Activation;
use crate::{LanguageModel, RuntimeError, SeqStep};
use std::sync::Arc;

/// Most `prefix tokens x model file bytes` one diagnosis may run through the CPU reference:
/// about a second or two of CPU time (64 GiB of weight reads).
pub const LOCATE_BUDGET: u128 = 64 << 30;

/// Index of the first NaN or infinity in `values`.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    values.iter().position(|x| !x.is_finite())
}

/// Where non-finite values first appeared.
#[derive(Debug, Clone, PartialEq)]
pub struct NonFiniteAt {
    /// Observer name, e.g. `blk.1.attn_q_b.out`.
    pub activation: String,
    /// The block number when the activation belongs to one.
    pub layer: Option<usize>,
    /// Token position (row) of the first non-finite value.
    pub position: usize,
    pub value: f32,
}

impl std::fmt::Display for NonFiniteAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(l) => write!(
                f,
                "layer {l} ({}) at token {}: {}",
                self.activation, self.position, self.value
            ),
            None => write!(
                f,
                "{} at token {}: {}",
                self.activation, self.position, self.value
            ),
        }
    }
}

/// What the bounded CPU re-run found.
#[derive(Debug, Clone, PartialEq)]
pub enum Diagnosis {
    Found(NonFiniteAt),
    /// The CPU reference stayed finite on the first `tokens` tokens.
    Clean {
        tokens: usize,
    },
    /// The model is too large to re-run within [`LOCATE_BUDGET`].
    TooLarge,
}

/// Re-run the CPU reference on growing prefixes of `tokens` and report the first non-finite
/// activation.
pub fn locate_non_finite(
    model: Arc<gguf::Model>,
    tokens: &[u32],
) -> Result<Diagnosis, RuntimeError> {
    let bytes = u128::from(model.total_file_size().max(1));
    let max_tokens = (LOCATE_BUDGET / bytes).min(tokens.len() as u128) as usize;
    if max_tokens == 0 {
        return Ok(Diagnosis::TooLarge);
    }
    let cpu = crate::glm::load_cpu(model)?;
    let mut n = 1;
    loop {
        let n_now = n.min(max_tokens);
        if let Some(at) = observe(&cpu, &tokens[..n_now])? {
            return Ok(Diagnosis::Found(at));
        }
        if n_now == max_tokens {
            return Ok(Diagnosis::Clean { tokens: n_now });
        }
        n *= 8;
    }
}

fn observe<B: crate::backend::Backend>(
    m: &crate::glm::GlmModel<B>,
    tokens: &[u32],
) -> Result<Option<NonFiniteAt>, RuntimeError> {
    let mut seq = m.new_sequence();
    let mut found: Option<NonFiniteAt> = None;
    let mut obs = |name: &str, a: Activation<'_>| {
        if found.is_some() {
            return;
        }
        if let Activation::F32 { cols, data, .. } = a {
            if let Some(i) = first_non_finite(data) {
                found = Some(NonFiniteAt {
                    activation: name.to_string(),
                    layer: layer_of(name),
                    position: i / cols.max(1),
                    value: data[i],
                });
            }
        }
    };
    let mut batch = [SeqStep {
        seq: seq.as_mut(),
        tokens,
        all_logits: false,
    }];
    let logits = m.forward_observed(&mut batch, Some(&mut obs))?;
    if found.is_none() {
        if let Some(row) = logits.first() {
            if let Some(i) = first_non_finite(row) {
                found = Some(NonFiniteAt {
                    activation: "logits".into(),
                    layer: None,
                    position: tokens.len() - 1,
                    value: row[i],
                });
            }
        }
    }
    Ok(found)
}

/// `blk.12.attn_q_b.out` -> 12.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The user-facing message for non-finite logits at sequence position `position` (a sampled
/// token would be garbage), with the CPU reference's diagnosis.
pub fn non_finite_message(device: &str, position: usize, diagnosis: &Diagnosis) -> String {
    let head = format!(
        "the model produced non-finite logits (NaN or infinity) at token {position} on {device}; nothing was sampled from them"
    );
    match diagnosis {
        Diagnosis::Found(at) => {
            format!("{head}. First non-finite activation (CPU reference): {at}")
        }
        Diagnosis::Clean { tokens } => format!(
            "{head}. The CPU reference stays finite on the first {tokens} tokens, so the {device} backend (or a long-context overflow) produced them; `gguftool doctor MODEL` compares the devices layer by layer"
        ),
        Diagnosis::TooLarge => format!(
            "{head}. The model is too large to re-run here; `gguftool doctor MODEL` locates the first bad layer"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nan_and_infinities() {
        assert_eq!(first_non_finite(&[0.0, 1.0, -2.0]), None);
        assert_eq!(first_non_finite(&[0.0, f32::NAN]), Some(1));
        assert_eq!(first_non_finite(&[f32::NEG_INFINITY, 0.0]), Some(0));
        assert_eq!(layer_of("blk.12.attn_q_b.out"), Some(12));
        assert_eq!(layer_of("output_norm.out"), None);
    }
}
