//! Properties of the CPU forward pass on the fixture model that must hold whatever the
//! reference says: decoding token by token through the KV cache gives the logits of one full
//! pass; a batch of sequences gives each sequence's own logits; absorbed MLA attention (over the
//! latent cache) equals transformers-style attention with keys and values expanded by `kv_b`.
//! The long prompt (121 tokens > index_topk 32) makes the incremental steps use the indexer's
//! sparse selection over cached indexer keys.

mod forward_util;

use forward_util::{ids, json, load, prefill_all, step};
use gguftool_tests::fixture;
use runtime::glm::AttnMode;
use runtime::{LanguageModel, SeqStep};

/// Same per-row arithmetic in both evaluations (every dot product, norm and softmax of a token
/// is computed the same way whether the token arrives alone or in a block), so they agree to f32
/// noise at most.
const SAME_MATH: f32 = 1e-5;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn long_prompt() -> Option<(std::path::PathBuf, Vec<u32>)> {
    let refs = fixture("refs/hf-tiny-glm5-long.json");
    let model = fixture("gguf/tiny-glm5-BF16.gguf");
    let r = json(&refs);
    let p = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == "long_counting")
        .unwrap();
    Some((model, ids(&p["token_ids"])))
}

#[test]
fn incremental_decoding_equals_full_recomputation() {
    let Some((path, prompt)) = long_prompt() else {
        return;
    };
    let m = load(&path);
    let v = m.vocab_size();
    let full = prefill_all(&m, &prompt);
    // A prefill of 20 tokens (dense), a block of 30 crossing index_topk, then single tokens.
    let mut seq = m.new_sequence();
    let mut got = step(&m, seq.as_mut(), &prompt[..20], true);
    got.extend(step(&m, seq.as_mut(), &prompt[20..50], true));
    for &t in &prompt[50..] {
        got.extend(step(&m, seq.as_mut(), &[t], false));
    }
    assert_eq!(seq.len(), prompt.len());
    assert!(seq.cache_bytes() > 0);
    let d = max_diff(&got, &full);
    println!(
        "incremental vs full: max abs logit diff {d:.2e} over {} positions",
        full.len() / v
    );
    assert!(d <= SAME_MATH, "{d}");
}

#[test]
fn batched_sequences_equal_single_runs() {
    let Some((path, prompt)) = long_prompt() else {
        return;
    };
    let m = load(&path);
    let v = m.vocab_size();
    let a = &prompt[..70];
    let b = &prompt[30..45];
    let c = &prompt[5..6];
    let single: Vec<Vec<f32>> = [a, b, c].iter().map(|p| prefill_all(&m, p)).collect();
    let mut s = [m.new_sequence(), m.new_sequence(), m.new_sequence()];
    let [s0, s1, s2] = &mut s;
    let mut batch = [
        SeqStep {
            seq: s0.as_mut(),
            tokens: a,
            all_logits: true,
        },
        SeqStep {
            seq: s1.as_mut(),
            tokens: b,
            all_logits: true,
        },
        SeqStep {
            seq: s2.as_mut(),
            tokens: c,
            all_logits: false,
        },
    ];
    let out = m.forward(&mut batch).unwrap();
    assert!(max_diff(&out[0], &single[0]) <= SAME_MATH);
    assert!(max_diff(&out[1], &single[1]) <= SAME_MATH);
    assert!(max_diff(&out[2], &single[2][single[2].len() - v..]) <= SAME_MATH);
    // Then one decode step for all three at once, continuing each sequence.
    let next = [prompt[70], prompt[45], prompt[6]];
    let mut batch = [
        SeqStep {
            seq: s0.as_mut(),
            tokens: &next[0..1],
            all_logits: false,
        },
        SeqStep {
            seq: s1.as_mut(),
            tokens: &next[1..2],
            all_logits: false,
        },
        SeqStep {
            seq: s2.as_mut(),
            tokens: &next[2..3],
            all_logits: false,
        },
    ];
    let out = m.forward(&mut batch).unwrap();
    for (i, (p, o)) in [&prompt[..71], &prompt[30..46], &prompt[5..7]]
        .iter()
        .zip(&out)
        .enumerate()
    {
        let full = prefill_all(&m, p);
        let d = max_diff(o, &full[full.len() - v..]);
        assert!(d <= SAME_MATH, "sequence {i}: {d}");
    }
}

/// Absorbed and naive MLA differ in summation order only: q.(W_UK c) vs (W_UK^T q).c and
/// (sum_t p_t c_t) W_UV vs sum_t p_t (W_UV c_t), f32 reassociation over 64-256 terms.
#[test]
fn absorbed_attention_equals_naive_attention() {
    let Some((path, prompt)) = long_prompt() else {
        return;
    };
    let mut m = load(&path);
    assert_eq!(m.attn_mode(), AttnMode::Absorbed);
    let absorbed = prefill_all(&m, &prompt);
    m.set_attn_mode(AttnMode::Naive).unwrap();
    let naive = prefill_all(&m, &prompt);
    let d = max_diff(&absorbed, &naive);
    println!("absorbed vs naive: max abs logit diff {d:.2e}");
    assert!(d <= 1e-4, "{d}");
    // Decode steps through the cache in naive mode too.
    let mut seq = m.new_sequence();
    step(&m, seq.as_mut(), &prompt[..100], false);
    let mut last = Vec::new();
    for &t in &prompt[100..] {
        last = step(&m, seq.as_mut(), &[t], false);
    }
    let v = m.vocab_size();
    let d = max_diff(&last, &absorbed[absorbed.len() - v..]);
    assert!(d <= 1e-4, "{d}");
}

#[test]
fn context_and_bad_tokens_are_errors() {
    let Some((path, prompt)) = long_prompt() else {
        return;
    };
    let m = load(&path);
    let mut seq = m.new_sequence();
    let bad = [m.vocab_size() as u32];
    let mut b = [SeqStep {
        seq: seq.as_mut(),
        tokens: &bad,
        all_logits: false,
    }];
    assert!(m.forward(&mut b).is_err());
    let long = vec![prompt[0]; m.context_length() + 1];
    let mut b = [SeqStep {
        seq: seq.as_mut(),
        tokens: &long,
        all_logits: false,
    }];
    assert!(matches!(
        m.forward(&mut b),
        Err(runtime::RuntimeError::ContextExceeded { .. })
    ));
    // The failed steps left the sequence usable.
    assert_eq!(seq.len(), 0);
    let ok = step(&m, seq.as_mut(), &prompt[..3], false);
    assert_eq!(ok.len(), m.vocab_size());
}
