//! Shared helpers of the forward-pass tests: load the fixture models on the CPU backend, run
//! prompts, read the reference files.
#![allow(dead_code)]

use runtime::cpu::CpuBackend;
use runtime::glm::GlmModel;
use runtime::{LanguageModel, SeqStep, SequenceState};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

pub fn load(path: &Path) -> GlmModel<CpuBackend> {
    let m = gguf::Model::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    GlmModel::load(CpuBackend, Arc::new(m))
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

pub fn json(path: &Path) -> Value {
    let s = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&s).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits of every prompt position, `[n, vocab]` row-major, from one prefill call.
pub fn prefill_all(m: &dyn LanguageModel, prompt: &[u32]) -> Vec<f32> {
    let mut seq = m.new_sequence();
    step(m, seq.as_mut(), prompt, true)
}

pub fn step(
    m: &dyn LanguageModel,
    seq: &mut dyn SequenceState,
    tokens: &[u32],
    all: bool,
) -> Vec<f32> {
    let mut b = [SeqStep {
        seq,
        tokens,
        all_logits: all,
    }];
    m.forward(&mut b).unwrap().remove(0)
}

pub fn log_softmax(l: &[f32]) -> Vec<f64> {
    let mx = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = l.iter().map(|&x| (x as f64 - mx).exp()).sum();
    let lse = mx + s.ln();
    l.iter().map(|&x| x as f64 - lse).collect()
}

pub fn argmax(l: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[b] {
            b = i;
        }
    }
    b as u32
}

/// Greedy continuation of `n` tokens using the KV cache; returns ids and each step's logits.
pub fn greedy(m: &dyn LanguageModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut seq = m.new_sequence();
    let mut logits = step(m, seq.as_mut(), prompt, false);
    let mut out = Vec::new();
    let mut all = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        all.push(logits.clone());
        logits = step(m, seq.as_mut(), &[t], false);
    }
    (out, all)
}
