//! Check 6, forward-pass sanity on the CPU reference backend: the next-token distribution after a
//! count ("1 2 ... 10") and after one chat prompt must be finite and not flat. Flat means its
//! entropy is within ln 2 of ln(vocab), i.e. the model spreads its mass as if choosing among half
//! the vocabulary at random: what a model with scrambled weights prints. Whether the model
//! continues the count is shown as information only (an untrained model is not broken).

use super::report::{CheckResult, Item};
use runtime::{LanguageModel, SeqStep};
use serving::chat::{ChatMessage, ChatTemplate};
use serving::tokenizer::Tokenizer;

pub const COUNT_PROMPT: &str = "1 2 3 4 5 6 7 8 9 10";
const CHAT_PROMPT: &str = "What is the capital of France?";
/// Greedy tokens decoded after each prompt (shown, never judged).
const SHOW_TOKENS: usize = 6;

/// Entropy (nats) and the top token with its probability, in f64; `None` if a logit is not
/// finite.
pub fn distribution(logits: &[f32]) -> Option<(f64, usize, f64)> {
    if logits.is_empty() || logits.iter().any(|l| !l.is_finite()) {
        return None;
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let exps: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
    let z: f64 = exps.iter().sum();
    let h = -exps
        .iter()
        .map(|e| e / z)
        .filter(|&p| p > 0.0)
        .map(|p| p * p.ln())
        .sum::<f64>();
    let top = logits
        .iter()
        .enumerate()
        .fold(0, |b, (i, &l)| if l > logits[b] { i } else { b });
    Some((h, top, exps[top] / z))
}

fn forward(
    lm: &dyn LanguageModel,
    seq: &mut dyn runtime::SequenceState,
    ids: &[u32],
) -> Result<Vec<f32>, String> {
    let mut b = [SeqStep {
        seq,
        tokens: ids,
        all_logits: false,
    }];
    let mut out = lm.forward(&mut b).map_err(|e| e.to_string())?;
    out.pop()
        .ok_or_else(|| "the model returned no logits".to_string())
}

pub fn run(
    lm: &dyn LanguageModel,
    tok: &Tokenizer,
    meta: &gguf::Metadata,
    quick: bool,
) -> CheckResult {
    let mut r = CheckResult::new(6, "forward");
    let mut prompts = vec![("count", COUNT_PROMPT.to_string())];
    let mut notes = Vec::new();
    if !quick {
        match ChatTemplate::from_gguf(meta)
            .and_then(|t| t.render(&[ChatMessage::new("user", CHAT_PROMPT)], true))
        {
            Ok(text) => prompts.push(("chat", text)),
            Err(e) => notes.push(format!("chat prompt not run: {e}")),
        }
    } else {
        notes.push("--quick: the count prompt only".to_string());
    }
    let v = lm.vocab_size();
    let flat = (v as f64).ln() - 2f64.ln();
    for (id, text) in prompts {
        let ids = match tok.encode(&text, true) {
            Ok(i) if !i.is_empty() => i,
            Ok(_) => {
                notes.push(format!("{id}: the prompt tokenizes to nothing"));
                continue;
            }
            Err(e) => {
                r.push(Item::finding(
                    format!("prompt {id}"),
                    format!("the tokenizer fails on the prompt: {e}"),
                ));
                continue;
            }
        };
        let mut seq = lm.new_sequence();
        let logits = match forward(lm, seq.as_mut(), &ids) {
            Ok(l) => l,
            Err(e) => {
                r.push(Item::finding(
                    format!("prompt {id}"),
                    format!("the forward pass fails: {e}"),
                ));
                continue;
            }
        };
        let Some((h, top, p)) = distribution(&logits) else {
            let bad = logits.iter().filter(|l| !l.is_finite()).count();
            r.push(
                Item::finding(
                    format!("logits ({id} prompt)"),
                    format!("{bad} of {v} next-token logits are NaN or infinite"),
                )
                .advice("a tensor holds NaN/Inf (check 3) or a layer overflows: find the layer with check 7 (--activations or --hf)"),
            );
            continue;
        };
        let piece = |i: usize| tok.decode(&[i as u32], false).unwrap_or_default();
        let mut shown = vec![top as u32];
        let mut last = top as u32;
        for _ in 1..SHOW_TOKENS {
            match forward(lm, seq.as_mut(), &[last]) {
                Ok(l) => {
                    let Some((_, t, _)) = distribution(&l) else {
                        break;
                    };
                    last = t as u32;
                    shown.push(last);
                }
                Err(_) => break,
            }
        }
        let cont = tok.decode(&shown, false).unwrap_or_default();
        let mut line = format!(
            "{id} ({} tokens): entropy {h:.3} nats of at most ln({v}) = {:.3}, top-1 {:?} p={p:.3}; greedy continuation {cont:?}",
            ids.len(),
            (v as f64).ln(),
            piece(top)
        );
        if id == "count" {
            let counts = cont.trim_start().starts_with("11");
            line.push_str(if counts {
                " (continues the count)"
            } else {
                " (does not continue the count: information only)"
            });
        }
        if h >= flat {
            r.push(
                Item::finding(
                    format!("logits ({id} prompt)"),
                    format!(
                        "flat next-token distribution: entropy {h:.3} nats >= ln({v}) - ln 2 = {flat:.3} (top-1 p={p:.4})"
                    ),
                )
                .advice("the weights are scrambled somewhere (name map, kv_b, rope layout, expert order): find the first diverging layer with check 7 (--activations or --hf)"),
            );
        }
        notes.push(line);
    }
    r.summary = notes.join("; ");
    r
}
