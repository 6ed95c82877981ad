//! Layer-by-layer activations of the CPU forward pass on tiny-glm5-BF16.gguf against the ones
//! transformers 5.24 recorded (fp32 eager, forward hooks, bf16 weights upcast) for the same
//! token ids: `refs/activations-counting.safetensors` (19 tokens, dense) and
//! `refs/activations-long_counting.safetensors` (121 tokens, DSA sparse attention active).

mod forward_util;

use gguftool_tests::fixture;
use runtime::glm::Activation;
use safetensors::SafeTensors;
use std::collections::{BTreeSet, HashMap};

/// Relative tolerance on float activations, against the largest |value| of the reference
/// tensor. The bf16 weights are exact in f32, so both sides compute the same f32 math and differ
/// only by accumulation order (our 8-lane dot products vs torch's BLAS): each dot over 256-512
/// terms carries ~1e-7 relative rounding, compounding over 3 layers to a few 1e-7 of the
/// magnitude (observed <= 8e-7); 1e-5 leaves an order of magnitude of margin while still
/// catching any real error (a wrong epsilon, RoPE pairing or mask moves values by >= 1e-3).
const REL_TOL: f32 = 1e-5;

#[derive(Debug)]
enum Got {
    F32(usize, usize, Vec<f32>),
    Idx(usize, usize, Vec<i64>),
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn i64s(b: &[u8]) -> Vec<i64> {
    b.chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32_of<'a>(got: &'a HashMap<String, Got>, name: &str) -> &'a [f32] {
    match got.get(name) {
        Some(Got::F32(_, _, d)) => d,
        _ => panic!("activation {name} not observed"),
    }
}

fn run(rel: &str) {
    let path = fixture(rel);
    let model_path = fixture("gguf/tiny-glm5-BF16.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = i64s(st.tensor("token_ids").unwrap().data())
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let model = forward_util::load(&model_path);
    let ix = model.spec().indexer.expect("glm-dsa has an indexer");
    let mut got: HashMap<String, Got> = HashMap::new();
    let mut obs = |name: &str, a: Activation<'_>| {
        let g = match a {
            Activation::F32 { rows, cols, data } => Got::F32(rows, cols, data.to_vec()),
            Activation::Index { rows, cols, data } => Got::Idx(rows, cols, data.to_vec()),
        };
        got.insert(name.to_string(), g);
    };
    let mut seq = model.new_cache().unwrap();
    let mut b = [runtime::SeqStep {
        seq: &mut seq,
        tokens: &ids,
        all_logits: true,
    }];
    model.forward_observed(&mut b, Some(&mut obs)).unwrap();

    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    let mut failures = Vec::new();
    let mut tie_rows = 0;
    for name in names.iter().filter(|n| *n != "token_ids") {
        let t = st.tensor(name).unwrap();
        let shape = t.shape().to_vec();
        match got.get(name) {
            Some(Got::F32(r, c, d)) => {
                assert_eq!(vec![*r, *c], shape, "{name} shape");
                let want = f32s(t.data());
                let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                let max = d
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                println!("{name}: max abs diff {max:.3e} (max |ref| {scale:.3})");
                if max > REL_TOL * scale {
                    failures.push(format!(
                        "{name}: max abs diff {max:.3e} > {:.3e}",
                        REL_TOL * scale
                    ));
                }
            }
            Some(Got::Idx(r, c, d)) => {
                assert_eq!(*r, shape[0], "{name} rows");
                let want = i64s(t.data());
                let is_indexer = name.ends_with("indexer.topk_indices");
                let mut differ = 0;
                for i in 0..*r {
                    // Entries past the query's own position are causally masked anyway (README).
                    let keep = |j: &&i64| **j >= 0 && (!is_indexer || **j <= i as i64);
                    let a: BTreeSet<i64> = want[i * shape[1]..(i + 1) * shape[1]]
                        .iter()
                        .filter(keep)
                        .copied()
                        .collect();
                    let b: BTreeSet<i64> =
                        d[i * c..(i + 1) * c].iter().filter(keep).copied().collect();
                    if a == b {
                        continue;
                    }
                    differ += 1;
                    if !is_indexer {
                        failures.push(format!("{name} row {i}: got {b:?}, want {a:?}"));
                        continue;
                    }
                    // torch.topk breaks ties arbitrarily. ReLU zeroes whole heads, so several keys
                    // often score exactly 0 at the top-k boundary: a selection may differ only among
                    // keys tied with the k-th best score. Recompute the scores in f64 from the
                    // indexer's observed inputs to check that.
                    let layer = name.split('.').nth(1).unwrap();
                    let q = f32_of(&got, &format!("blk.{layer}.indexer.q.out"));
                    let w = f32_of(&got, &format!("blk.{layer}.indexer.weights.out"));
                    let k = f32_of(&got, &format!("blk.{layer}.indexer.k.out"));
                    let (hn, hd) = (ix.n_head, ix.head_dim);
                    let score = |t: usize| -> f64 {
                        (0..hn)
                            .map(|h| {
                                let dot: f64 = (0..hd)
                                    .map(|e| {
                                        q[i * hn * hd + h * hd + e] as f64 * k[t * hd + e] as f64
                                    })
                                    .sum();
                                (dot / (hd as f64).sqrt()).max(0.0) * w[i * hn + h] as f64
                            })
                            .sum()
                    };
                    let mut all: Vec<f64> = (0..=i).map(score).collect();
                    all.sort_by(|x, y| y.total_cmp(x));
                    let kth = all[ix.top_k - 1];
                    for &j in a.symmetric_difference(&b) {
                        let s = score(j as usize);
                        if (s - kth).abs() > 1e-4 * (1.0 + kth.abs()) {
                            failures.push(format!(
                                "{name} row {i}: key {j} (score {s}) differs, k-th best {kth}"
                            ));
                        }
                    }
                    tie_rows += 1;
                }
                println!("{name}: {differ} of {r} rows differ as sets");
            }
            None => failures.push(format!("activation {name} not observed")),
        }
    }
    println!("{tie_rows} indexer rows differ only in tie-breaking");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn activations_counting_match_transformers() {
    run("refs/activations-counting.safetensors");
}

#[test]
fn activations_long_counting_match_transformers() {
    run("refs/activations-long_counting.safetensors");
}
