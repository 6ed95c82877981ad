//! Tensor parallelism on the CPU (one OS thread per rank, collectives through host memory): the
//! sharded forward pass is the single-rank one up to f32 summation order. On the fixtures, TP 2
//! and 4 give the greedy tokens of transformers and of TP 1 on every reference prompt (the long
//! ones run the DSA indexer's sparse selection), with logits within the derived tolerance
//! (`runtime::tp::check::tp_tolerance`); quantized files split the same way (Q8_0 on whole
//! blocks, the K-quant files with their block-cutting shares held as exact F32); impossible
//! splits are refused naming what does not divide.

mod forward_util;

use forward_util::{greedy, ids, json};
use gguftool_tests::fixture;
use runtime::device::load_cpu_tp;
use runtime::tp::check::{compare_greedy, tp_tolerance, Summation};
use runtime::tp::{MoeSplit, TpModel};
use runtime::{LanguageModel, RuntimeError, SeqStep};
use serde_json::Value;
use std::sync::Arc;

/// Top-1/top-2 log-prob gap under which the transformers reference is a tie (as forward_hf.rs).
const TIE_GAP: f64 = 1e-3;

fn open(rel: &str) -> Arc<gguf::Model> {
    let p = fixture(rel);
    Arc::new(gguf::Model::open(&p).unwrap())
}

fn tp(m: &Arc<gguf::Model>, world: usize, moe: MoeSplit) -> TpModel {
    load_cpu_tp(Arc::clone(m), world, moe, None)
        .unwrap_or_else(|e| panic!("TP {world} {moe:?}: {e}"))
}

/// Greedy 16 of `lm` against the transformers reference of every prompt of `refs`.
fn check_refs(lm: &dyn LanguageModel, refs: &Value, what: &str) -> Vec<String> {
    let mut bad = Vec::new();
    for p in refs["prompts"].as_array().unwrap() {
        let id = p["id"].as_str().unwrap();
        let want = ids(&p["greedy_16"]["ids"]);
        let (got, _) = greedy(lm, &ids(&p["token_ids"]), want.len());
        if let Some(k) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let top = p["greedy_16"]["per_step_top5"][k].as_array().unwrap();
            let gap = top[0]["logprob"].as_f64().unwrap() - top[1]["logprob"].as_f64().unwrap();
            if gap > TIE_GAP {
                bad.push(format!(
                    "{what} {id}: greedy {got:?} != transformers {want:?}"
                ));
            }
        }
    }
    bad
}

#[test]
fn tp2_and_tp4_match_transformers_and_tp1_on_every_reference_prompt() {
    let m = open("gguf/tiny-glm5-BF16.gguf");
    let one = runtime::glm::load_cpu(Arc::clone(&m)).unwrap();
    let tol = tp_tolerance(one.spec(), 4, Summation::Blocked8);
    let mut bad = Vec::new();
    let mut prompts = 0;
    for rel in ["refs/hf-tiny-glm5.json", "refs/hf-tiny-glm5-long.json"] {
        let refs = json(&fixture(rel));
        for world in [2, 4] {
            let lm = tp(&m, world, MoeSplit::Columns);
            bad.extend(check_refs(&lm, &refs, &format!("TP {world}")));
            for p in refs["prompts"].as_array().unwrap() {
                let id = p["id"].as_str().unwrap();
                let c = compare_greedy(&one, &lm, &ids(&p["token_ids"]), 16, tol).unwrap();
                println!(
                    "TP {world} {id}: max rel diff {:.2e} (tol {tol:.1e}), identical {}/17, near ties {:?}",
                    c.max_rel_diff, c.greedy_identical, c.near_ties
                );
                if let Some(f) = c.failure {
                    bad.push(format!("TP {world} {id}: {f}"));
                }
                prompts += 1;
            }
        }
    }
    assert_eq!(prompts, 2 * (3 + 3), "every reference prompt at TP 2 and 4");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn expert_parallel_and_uneven_experts_match_tp1() {
    let m = open("gguf/tiny-glm5-BF16.gguf");
    let one = runtime::glm::load_cpu(Arc::clone(&m)).unwrap();
    let refs = json(&fixture("refs/hf-tiny-glm5.json"));
    for world in [2, 4] {
        let lm = tp(&m, world, MoeSplit::Experts);
        let r = lm.tp_report().unwrap();
        // 6 experts over 4 ranks: 2, 2, 1, 1 whole experts.
        let counts: Vec<usize> = r.ranks.iter().map(|r| r.experts).collect();
        assert_eq!(counts.iter().sum::<usize>(), 6);
        if world == 4 {
            assert_eq!(counts, vec![2, 2, 1, 1]);
        }
        let tol = tp_tolerance(one.spec(), world, Summation::Blocked8);
        for p in refs["prompts"].as_array().unwrap() {
            let c = compare_greedy(&one, &lm, &ids(&p["token_ids"]), 16, tol).unwrap();
            assert!(
                c.failure.is_none(),
                "EP TP {world} {}: {:?}",
                p["id"],
                c.failure
            );
        }
    }
}

#[test]
fn quantized_files_split_and_match_tp1() {
    let refs = json(&fixture("refs/hf-tiny-glm5.json"));
    for (file, reencoded) in [
        ("gguf/tiny-glm5-Q8_0.gguf", false),
        ("gguf/tiny-glm5-Q4_K_M.gguf", true),
    ] {
        let m = open(file);
        let one = runtime::glm::load_cpu(Arc::clone(&m)).unwrap();
        for world in [2, 4] {
            let lm = tp(&m, world, MoeSplit::Columns);
            let r = lm.tp_report().unwrap();
            // Q8_0 blocks of 32 divide every split; Q4_K/Q6_K super-blocks of 256 do not for
            // attn_output, ffn_down_shexp (256 input columns) and the experts' down at TP >= 2.
            for rank in &r.ranks {
                assert_eq!(!rank.reencoded_f32.is_empty(), reencoded, "{file} {rank:?}");
                if reencoded {
                    assert!(rank
                        .reencoded_f32
                        .iter()
                        .any(|n| n == "blk.0.attn_output.weight"));
                    assert!(rank.reencoded_extra_bytes > 0);
                }
            }
            let tol = tp_tolerance(one.spec(), world, Summation::Blocked8);
            for p in refs["prompts"].as_array().unwrap() {
                let c = compare_greedy(&one, &lm, &ids(&p["token_ids"]), 16, tol).unwrap();
                println!(
                    "{file} TP {world} {}: max rel diff {:.2e}, identical {}/17, near ties {:?}",
                    p["id"], c.max_rel_diff, c.greedy_identical, c.near_ties
                );
                assert!(
                    c.failure.is_none(),
                    "{file} TP {world} {}: {:?}",
                    p["id"],
                    c.failure
                );
            }
        }
    }
}

#[test]
fn greedy_top_k_merges_rank_candidates_like_the_full_vocabulary() {
    let m = open("gguf/tiny-glm5-BF16.gguf");
    let lm = tp(&m, 4, MoeSplit::Columns);
    let prompt: Vec<u32> = vec![16, 220, 17, 220, 18, 220, 19];
    let (mut a, mut b) = (lm.new_sequence(), lm.new_sequence());
    let full = lm
        .forward(&mut [SeqStep {
            seq: a.as_mut(),
            tokens: &prompt,
            all_logits: false,
        }])
        .unwrap()
        .remove(0);
    let top = lm
        .forward_top_k(
            &mut [SeqStep {
                seq: b.as_mut(),
                tokens: &prompt,
                all_logits: false,
            }],
            5,
        )
        .unwrap()
        .remove(0);
    let want = runtime::lm::merge_top(&[runtime::lm::local_top(&full, 5, 0)], 5);
    assert_eq!(top.len(), 5);
    for ((i, lp), (j, lq)) in top.iter().zip(&want) {
        assert_eq!(i, j);
        // The merged log-sum-exp adds four partial sums in f64: equal to f32 rounding.
        assert!((lp - lq).abs() <= 1e-6 * lq.abs().max(1.0), "{lp} vs {lq}");
    }
    assert_eq!(a.len(), prompt.len());
    assert_eq!(b.len(), prompt.len());
}

#[test]
fn impossible_splits_are_refused_naming_the_dimension() {
    let m = open("gguf/tiny-glm5-BF16.gguf");
    for (world, moe) in [(8, MoeSplit::Columns), (3, MoeSplit::Experts)] {
        let e = load_cpu_tp(Arc::clone(&m), world, moe, None)
            .err()
            .unwrap_or_else(|| panic!("TP {world} of a 4-head model was accepted"));
        let s = e.to_string();
        assert!(
            matches!(e, RuntimeError::Tp { world: w, .. } if w == world),
            "{s}"
        );
        assert!(
            s.contains("4 attention heads") && s.contains(&format!("over {world} ranks")),
            "{s}"
        );
        assert!(s.contains("1, 2, 4"), "{s}");
    }
}

#[test]
fn a_refused_step_leaves_every_rank_consistent() {
    let m = open("gguf/tiny-glm5-BF16.gguf");
    let one = runtime::glm::load_cpu(Arc::clone(&m)).unwrap();
    let lm = tp(&m, 2, MoeSplit::Columns);
    let prompt = [16u32, 220, 17, 220, 18];
    let mut s = lm.new_sequence();
    let mut step = |t: &[u32]| {
        lm.forward(&mut [SeqStep {
            seq: s.as_mut(),
            tokens: t,
            all_logits: false,
        }])
    };
    step(&prompt).unwrap();
    assert!(step(&[5000]).is_err(), "token out of range");
    assert!(step(&[]).is_err(), "empty step");
    let got = step(&[220]).unwrap().remove(0);
    assert_eq!(s.len(), prompt.len() + 1);
    let mut r = one.new_sequence();
    let full: Vec<u32> = prompt.iter().copied().chain([220]).collect();
    let want = forward_util::step(&one, r.as_mut(), &full, false);
    let scale = want.iter().fold(1f32, |a, v| a.max(v.abs()));
    let diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(
        diff / scale <= tp_tolerance(one.spec(), 2, Summation::Blocked8),
        "{diff}"
    );
}
