//! CUDA backend against the CPU reference backend: the tiny-glm5 fixtures (every GGUF type, the
//! public and the long prompts, which are longer than index_topk, so DSA sparse attention is
//! active) on the exact and the fast path, and a model with GLM-5's attention shapes (64 heads,
//! 576-wide latent, Q8_0 `attn_k_b` of 192-long rows) on prompts past 1,023 tokens (64 heads x
//! tokens rows exceeded the 65,535 grid-y limit there) and past 4,096. Tolerances: see
//! `check.rs`. Without a CUDA device every test prints "skipped: no CUDA device" and passes.
//! `GGUFTOOL_FIXTURES` points at the fixture folder when the test binary runs away from the
//! checkout (the GPU machine).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use gguf::{GgmlType, Metadata, Value};

use super::check::{compare_models, compare_with, logit_tolerance, reference_prompts, PromptCheck};
use super::{CudaBackend, CudaOptions, Fusions};
use crate::glm::GlmModel;
use crate::spec::ModelSpec;
use crate::weights::HostWeight;

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

fn fixtures() -> PathBuf {
    std::env::var_os("GGUFTOOL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
}

const EXACT: CudaOptions = CudaOptions {
    exact: true,
    kv_bf16: false,
};
const FAST: CudaOptions = CudaOptions {
    exact: false,
    kv_bf16: true,
};

fn report(what: &str, id: &str, n: usize, r: &PromptCheck, failures: &mut Vec<String>) {
    say(&format!(
        "| {what} | {id} ({n} tok) | {:.2e} | tol {:.2e} | {}/{} |{}{}",
        r.max_rel_diff,
        r.tolerance,
        r.greedy_identical,
        r.steps,
        if r.near_ties.is_empty() {
            String::new()
        } else {
            format!(" near ties at {:?}", r.near_ties)
        },
        r.selection_flip
            .as_ref()
            .map(|(s, n)| format!(" selection flip at step {s} ({n}): compared up to it"))
            .unwrap_or_default()
    ));
    if let Some(f) = &r.failure {
        failures.push(format!("{what} {id}: {f}"));
    }
}

#[test]
fn cuda_matches_cpu_on_fixtures() {
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_matches_cpu_on_fixtures)");
        return;
    }
    let mut prompts = Vec::new();
    for f in ["refs/hf-tiny-glm5.json", "refs/hf-tiny-glm5-long.json"] {
        let text = std::fs::read_to_string(fixtures().join(f)).expect("reference prompts");
        prompts.extend(reference_prompts(&text).expect("reference JSON"));
    }
    assert!(!prompts.is_empty());
    let mut failures = Vec::new();
    for file in [
        "tiny-glm5-BF16.gguf",
        "tiny-glm5-Q8_0.gguf",
        "tiny-glm5-Q6_K.gguf",
        "tiny-glm5-Q4_K_M.gguf",
    ] {
        let path = fixtures().join("gguf").join(file);
        let model = Arc::new(gguf::Model::open(&path).expect("open fixture"));
        let cpu = crate::glm::load_cpu(model.clone()).expect("load on CPU");
        for (mode, opts) in [("exact", EXACT), ("fast", FAST)] {
            let gpu = super::load_cuda_with(model.clone(), 0, opts).expect("load on CUDA");
            let tol = logit_tolerance(opts, gpu.spec().n_layer);
            for (id, ids) in &prompts {
                let r = compare_models(&cpu, &gpu, ids, 16, tol).expect("forward");
                report(&format!("{file} {mode}"), id, ids.len(), &r, &mut failures);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// xorshift64 stream for the synthetic weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Random blocks of `ty` (Q4_K / Q8_0) with finite, small f16 scales.
fn random_blocks(ty: GgmlType, n: usize, r: &mut Rng) -> Vec<u8> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let mut out: Vec<u8> = (0..n / bs * ts).map(|_| r.next() as u8).collect();
    // Where each type keeps its f16 scales (random bits there would give NaN/inf weights): Q6_K
    // stores d last, after ql, qh and the scales.
    let q6k = [ts - 2];
    let scale_offsets: &[usize] = match ty {
        GgmlType::Q4_K => &[0, 2],
        GgmlType::Q6_K => &q6k,
        _ => &[0],
    };
    for b in out.chunks_exact_mut(ts) {
        for &o in scale_offsets {
            let v = half::f16::from_f32(1e-4 + 2e-3 * r.unit());
            b[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// The random weights of the GPU tests decode to finite values for every type they use: a
/// random f16 scale (Q6_K keeps d last) made whole rows NaN, and NaN never equals NaN (the
/// bitwise accumulate test failed on the H200 for that reason). Runs without a GPU.
#[test]
fn random_blocks_decode_to_finite_weights() {
    let mut r = Rng(0x5eed_0000_b10c_0001);
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        let n = 256 * 64;
        let w = gguf::quant::dequantize_to_vec(ty, &random_blocks(ty, n, &mut r)).expect("dequant");
        assert_eq!(w.len(), n);
        assert!(w.iter().all(|v| v.is_finite()), "{ty}: non-finite weights");
    }
}

/// GLM-5's attention shapes (64 heads, kv_lora 512, nope 192, rope 64, v_head 256; indexer
/// 128-wide keys) at a small hidden size: layer 0 dense, layer 1 MoE (8 experts, 2 used + one
/// shared), DSA top-k 256 so long prompts attend sparsely.
fn glm5_heads_weights() -> (Metadata, HashMap<String, HostWeight>) {
    glm5_heads_weights_with(GgmlType::Q4_K)
}

/// [`glm5_heads_weights`] with the shared expert's down projection in `shexp_down` (GLM-5's
/// files: Q6_K, against the routed experts' Q4_K).
fn glm5_heads_weights_with(shexp_down: GgmlType) -> (Metadata, HashMap<String, HostWeight>) {
    let mut md = Metadata::new("glm5-heads (synthetic)");
    let a = "glm-dsa";
    md.set("general.architecture", Value::String(a.into()));
    let u = |v: u32| Value::U32(v);
    for (k, v) in [
        ("block_count", u(2)),
        ("context_length", u(8192)),
        ("embedding_length", u(256)),
        ("feed_forward_length", u(512)),
        ("attention.head_count", u(64)),
        ("attention.head_count_kv", u(1)),
        ("rope.freq_base", Value::F32(1e6)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("expert_count", u(8)),
        ("expert_used_count", u(2)),
        ("expert_group_count", u(1)),
        ("expert_group_used_count", u(1)),
        ("expert_gating_func", u(2)),
        ("attention.key_length", u(576)),
        ("attention.value_length", u(512)),
        ("leading_dense_block_count", u(1)),
        ("vocab_size", u(512)),
        ("attention.q_lora_rank", u(256)),
        ("attention.kv_lora_rank", u(512)),
        ("attention.key_length_mla", u(256)),
        ("attention.value_length_mla", u(256)),
        ("expert_feed_forward_length", u(256)),
        ("expert_shared_count", u(1)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_weights_norm", Value::Bool(true)),
        ("rope.dimension_count", u(64)),
        ("attention.indexer.head_count", u(4)),
        ("attention.indexer.key_length", u(128)),
        ("attention.indexer.top_k", u(256)),
    ] {
        md.set(&format!("{a}.{k}"), v);
    }
    let spec = ModelSpec::from_metadata(&md).expect("synthetic spec");
    let mut r = Rng(0x5eed_1234_abcd_0001);
    let mut w = HashMap::new();
    // The table marks the indexer optional; the forward requires it on every full layer.
    for t in spec
        .tensor_specs()
        .iter()
        .filter(|t| t.required || t.role.starts_with("indexer"))
    {
        let n: usize = t.dims.iter().product();
        let float = t.dims.len() == 1
            || t.name.contains("ffn_gate_inp")
            || t.name.contains("indexer.proj")
            || t.name.contains("exp_probs_b");
        let hw = if float {
            let (base, amp) = if t.name.contains("norm.weight") {
                (1.0, 0.1)
            } else {
                (0.0, 0.05)
            };
            let v: Vec<f32> = (0..n)
                .map(|_| base + amp * (2.0 * r.unit() - 1.0))
                .collect();
            HostWeight::from_f32(t.name.clone(), t.dims.clone(), &v)
        } else {
            let ty = if t.name.contains("ffn_down_shexp") {
                shexp_down
            } else if t.dims[0].is_multiple_of(256) {
                GgmlType::Q4_K
            } else {
                GgmlType::Q8_0
            };
            HostWeight::from_bytes(
                t.name.clone(),
                ty,
                t.dims.clone(),
                random_blocks(ty, n, &mut r),
            )
        }
        .expect("synthetic weight");
        w.insert(t.name.clone(), hw);
    }
    (md, w)
}

#[test]
fn glm5_heads_prompts_past_1023_and_4096_tokens() {
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (glm5_heads_prompts_past_1023_and_4096_tokens)");
        return;
    }
    let (md, w) = glm5_heads_weights();
    let get = |name: &str| Ok(w.get(name).cloned());
    let cpu = GlmModel::from_weights(
        crate::cpu::CpuBackend,
        ModelSpec::from_metadata(&md).unwrap(),
        &get,
    )
    .expect("CPU model");
    let mut failures = Vec::new();
    // "fast+prefill-gemm": prefill MoE and per-head matmuls as bf16 GEMMs
    // (GGUFTOOL_PREFILL_GEMM=1); the other two off whatever the environment says.
    for (mode, opts, gemm) in [
        ("fast", FAST, false),
        ("fast+prefill-gemm", FAST, true),
        ("exact", EXACT, false),
    ] {
        let gpu = GlmModel::from_weights(
            CudaBackend::with_options(0, opts)
                .expect("CUDA backend")
                .with_prefill_gemm(gemm),
            ModelSpec::from_metadata(&md).unwrap(),
            &get,
        )
        .expect("CUDA model");
        let tol = logit_tolerance(opts, 2);
        // The third mode differs from "fast" in prefill only: one long prompt suffices.
        let lens: &[usize] = if gemm { &[1100] } else { &[1100, 4200] };
        for &n in lens {
            let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 512).collect();
            let r = compare_with(&cpu, &gpu, &ids, 3, tol).expect("forward");
            report(&format!("glm5-heads {mode}"), "long", n, &r, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The 64-head model with `fuse` on the fast path, the GEMVs' row split forced to 1 warp: a
/// 20-token prefill then 3 decode steps; each step's logits and the launches of the last one.
fn fused_decode_logits(
    md: &Metadata,
    w: &HashMap<String, HostWeight>,
    fuse: Fusions,
) -> (Vec<Vec<f32>>, f64) {
    use crate::lm::{LanguageModel, SeqStep};
    let get = |name: &str| Ok(w.get(name).cloned());
    let be = CudaBackend::with_options(0, FAST)
        .expect("CUDA backend")
        .with_fusions(fuse);
    let gpu = GlmModel::from_weights(be, ModelSpec::from_metadata(md).unwrap(), &get)
        .expect("CUDA model");
    let _split = ForcedSplit::set(gpu.backend().gpu(), Some(1));
    let mut seq = gpu.new_sequence();
    let mut toks: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % 512).collect();
    let mut out = Vec::new();
    let mut per_step = 0.0;
    for step in 0..4 {
        let (l, prof) = launches(gpu.backend(), || {
            gpu.forward(&mut [SeqStep {
                seq: seq.as_mut(),
                tokens: &toks,
                all_logits: false,
            }])
            .expect("forward")
            .remove(0)
        });
        if step == 3 {
            per_step = prof.iter().map(|k| k.1).sum();
        }
        toks = vec![(step as u32 * 101 + 7) % 512];
        out.push(l);
    }
    (out, per_step)
}

/// The fused launches of a decode step against the launches they replace, end to end on the
/// GLM-5-shaped model (layer 0 dense, layer 1 MoE with a shared expert): a 20-token prefill,
/// then decode steps. With the GEMVs' row split forced (1 warp) for every configuration:
/// - every fusion but the GLU and the shared expert's against none: bitwise the same logits at
///   every step (each is bitwise the ops it replaces), and per decode step exactly the launches
///   they remove (`matmul_add`: 1; the residual add in the next norm: 1 per block; the MLA
///   queries: 4 per block, and their quantize and RoPE as one launch: 1 more; the cache rows
///   and indexer keys: 2 + 2 per block; q_a, kv_a and the indexer keys as one stacked GEMV: 2
///   per block; the attention output's q8 from the combine launch: 1 per block, the steps'
///   21-24 keys taking 6 splits of 4; q_a's norm, the cache rows and the indexer keys as one
///   launch: 2 per block);
/// - with the GLU: it removes 2 launches per FFN (dense, shared expert); its logits stay within
///   the fast path's tolerance against the unfused ones (`check::logit_tolerance`; they are
///   bitwise equal when the GLU sums in the plain GEMVs' order, which is reported);
/// - all of them: the shared expert riding the routed experts' launches removes its own GLU,
///   quantize and down launches (3 for the MoE layer); it sums its down projection into the
///   routed slots' per-lane sums before the lanes' reduction (a different f32 order), so again
///   within the tolerance, not bitwise.
#[test]
fn glm5_heads_decode_fusions_equal_the_launches_they_replace() {
    let _gpu = exclusive();
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (glm5_heads_decode_fusions_equal_the_launches_they_replace)");
        return;
    }
    let (md, w) = glm5_heads_weights();
    let run = |fuse: Fusions| fused_decode_logits(&md, &w, fuse);
    let (base, n_base) = run(Fusions::NONE);
    let (no_glu, n_no_glu) = run(Fusions {
        glu: false,
        shared: false,
        ..Fusions::ALL
    });
    let (no_shared, n_no_shared) = run(Fusions {
        shared: false,
        ..Fusions::ALL
    });
    let (all, n_all) = run(Fusions::ALL);
    let tol = logit_tolerance(FAST, 2);
    let off = |other: &[Vec<f32>]| {
        base.iter()
            .zip(other)
            .map(|(a, b)| {
                let max = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                a.iter()
                    .zip(b)
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs() / max))
            })
            .fold(0f32, f32::max)
    };
    let (worst, worst_ns) = (off(&all), off(&no_shared));
    say(&format!(
        "| decode fusions | launches per step {n_base} / {n_no_glu} (no GLU) / {n_no_shared} \
         (no shared) / {n_all} | no GLU bitwise {} | no shared: max rel {worst_ns:.2e} | all: \
         bitwise {}, max rel {worst:.2e} (tol {tol:.2e}) |",
        no_glu == base,
        all == base
    ));
    assert!(
        no_glu == base,
        "fusions other than the GLU changed the logits"
    );
    assert_eq!(
        n_base - n_no_glu,
        31.0,
        "matmul_add + 2 residual adds + 2 x (5 query + 4 cache-row + 2 stacked-GEMV + 1 \
         attention-q8 + 2 norm) launches per step"
    );
    assert!(worst_ns <= tol, "GLU logits off by {worst_ns}");
    assert!(worst <= tol, "GLU + shared-expert logits off by {worst}");
    assert_eq!(
        n_no_glu - n_no_shared,
        4.0,
        "the GLU: 2 per FFN (dense + shared)"
    );
    assert_eq!(
        n_no_shared - n_all,
        3.0,
        "the shared expert riding the routed launches: its GLU, quantize and down (1 MoE layer)"
    );
}

/// The shared expert's down projection in another type than the routed ones' (Q6_K against
/// Q4_K, as GLM-5's files ship it): its gate and up still ride the routed GLU launch and its
/// activations their quantize launch (2 launches fewer for the MoE layer than without the
/// shared-expert fusion), its down runs alone on that q8 row. Decode logits bitwise the unfused
/// ones: at the forced split the shared GLU channel sums as its own launch does, the quantize
/// works per 32-block (the same codes whatever rows share the launch), and the down projection
/// is the same accumulating GEMV on the same codes (H200, 2026-12-07: max rel 0).
#[test]
fn glm5_heads_shared_down_of_another_type_rides_the_glu() {
    let _gpu = exclusive();
    let (md, w) = glm5_heads_weights_with(GgmlType::Q6_K);
    assert_eq!(
        w.get("blk.1.ffn_down_shexp.weight").map(|t| t.ty()),
        Some(GgmlType::Q6_K),
        "the variant must hold a Q6_K shared down"
    );
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (glm5_heads_shared_down_of_another_type_rides_the_glu)");
        return;
    }
    let run = |fuse: Fusions| fused_decode_logits(&md, &w, fuse);
    let (apart, n_apart) = run(Fusions {
        shared: false,
        ..Fusions::ALL
    });
    let (riding, n_riding) = run(Fusions::ALL);
    say(&format!(
        "| shared Q6_K down | launches per step {n_apart} / {n_riding} riding | bitwise {} |",
        apart == riding
    ));
    assert_eq!(apart.len(), 4, "four steps");
    assert!(apart.iter().all(|l| !l.is_empty()), "no logits");
    assert!(apart == riding, "riding shared expert changed the logits");
    assert_eq!(
        n_apart - n_riding,
        2.0,
        "the shared GLU and its quantize ride the routed launches (1 MoE layer)"
    );
}

/// The int8 tensor-core product (`CudaBackend::with_mmq`, kernels::mmq) on the 64-head model,
/// against the CPU reference within the fast path's tolerance (`check::logit_tolerance`: its
/// error model is the integer GEMVs'): prefills of 2-64 tokens (one channel of 8-64 columns,
/// the MoE layer's grouped tiles of 8-64 columns, GLU and accumulating matmuls), 65 and 200
/// (past the dense range: bf16 GEMMs there, while the MoE experts stay on 64-column tiles up to
/// `with_mmq_moe_hi`), each followed by teacher-forced decode steps; then four sequences decoded
/// together (4-row steps). The launches of a 20-token prefill must include mmq's, so the check
/// cannot pass on the fallback paths.
#[test]
fn glm5_heads_mmq_steps_match_the_cpu() {
    // It counts launches on the process-wide profile: no other test may launch meanwhile.
    let _gpu = exclusive();
    use crate::lm::{LanguageModel, SeqStep};
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (glm5_heads_mmq_steps_match_the_cpu)");
        return;
    }
    let (md, w) = glm5_heads_weights();
    let get = |name: &str| Ok(w.get(name).cloned());
    let spec = || ModelSpec::from_metadata(&md).unwrap();
    let cpu = GlmModel::from_weights(crate::cpu::CpuBackend, spec(), &get).expect("CPU model");
    let be = CudaBackend::with_options(0, FAST)
        .expect("CUDA backend")
        .with_mmq(Some(super::MMQ_ROWS))
        .with_mmq_moe_hi(Some(4096));
    let gpu = GlmModel::from_weights(be, spec(), &get).expect("CUDA model");
    let tol = logit_tolerance(FAST, 2);
    let mut failures = Vec::new();
    for n in [2usize, 5, 8, 9, 20, 33, 64, 65, 200] {
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 512).collect();
        let r = compare_with(&cpu, &gpu, &ids, 3, tol).expect("forward");
        report("glm5-heads mmq", "prefill", n, &r, &mut failures);
    }
    let ((), kinds) = launches(gpu.backend(), || {
        let mut seq = gpu.new_sequence();
        let toks: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % 512).collect();
        gpu.forward(&mut [SeqStep {
            seq: seq.as_mut(),
            tokens: &toks,
            all_logits: false,
        }])
        .expect("forward");
    });
    let n_mmq: f64 = kinds
        .iter()
        .filter(|k| k.0.starts_with("mmq"))
        .map(|k| k.1)
        .sum();
    say(&format!(
        "| glm5-heads mmq | 20-token prefill | {n_mmq} mmq launches |"
    ));
    if n_mmq == 0.0 {
        failures.push(format!("no mmq launch in a 20-token prefill: {kinds:?}"));
    }

    // Four sequences decoded together: steps of 4 rows, each sequence's logits against the
    // CPU model stepping the same batch (fed the CPU's greedy tokens).
    let prompts: Vec<Vec<u32>> = [3u32, 7, 12, 20]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 53 + n) % 512).collect())
        .collect();
    let mut cs: Vec<_> = prompts.iter().map(|_| cpu.new_sequence()).collect();
    let mut gs: Vec<_> = prompts.iter().map(|_| gpu.new_sequence()).collect();
    let mut next: Vec<Vec<u32>> = prompts.clone();
    fn steps<'a>(
        seqs: &'a mut [Box<dyn crate::lm::SequenceState>],
        toks: &'a [Vec<u32>],
    ) -> Vec<SeqStep<'a>> {
        seqs.iter_mut()
            .zip(toks)
            .map(|(s, t)| SeqStep {
                seq: s.as_mut(),
                tokens: t,
                all_logits: false,
            })
            .collect()
    }
    for step in 0..4 {
        // The prompts go in one by one (prefill), the decode steps as one batch.
        let (lc, lg): (Vec<Vec<f32>>, Vec<Vec<f32>>) = if step == 0 {
            let mut lc = Vec::new();
            let mut lg = Vec::new();
            for (i, t) in next.iter().enumerate() {
                let one = std::slice::from_ref(t);
                lc.push(
                    cpu.forward(&mut steps(&mut cs[i..i + 1], one))
                        .expect("cpu")
                        .remove(0),
                );
                lg.push(
                    gpu.forward(&mut steps(&mut gs[i..i + 1], one))
                        .expect("gpu")
                        .remove(0),
                );
            }
            (lc, lg)
        } else {
            (
                cpu.forward(&mut steps(&mut cs, &next)).expect("cpu"),
                gpu.forward(&mut steps(&mut gs, &next)).expect("gpu"),
            )
        };
        for (i, (c, g)) in lc.iter().zip(&lg).enumerate() {
            let max = c.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
            let off = c
                .iter()
                .zip(g)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs() / max));
            say(&format!(
                "| glm5-heads mmq batch | step {step} seq {i} | {off:.2e} | tol {tol:.2e} |"
            ));
            // f32::max skips NaN: a non-finite logit fails on its own.
            if off > tol || !g.iter().all(|v| v.is_finite()) {
                failures.push(format!(
                    "batched step {step} seq {i}: {off:e} (tol {tol:e})"
                ));
            }
        }
        next = lc
            .iter()
            .map(|c| {
                let best = (0..c.len())
                    .max_by(|&a, &b| c[a].total_cmp(&c[b]).then(b.cmp(&a)))
                    .unwrap_or(0);
                vec![best as u32]
            })
            .collect();
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Programmatic dependent launch changes when kernels start, never what they compute: a
/// prefill of 20 tokens and 6 decode steps of the 64-head model (fast path, bf16 cache: every
/// fused decode launch, the MLA decode kernel) give bitwise the logits of serial launches. A
/// kernel that read its input before its `pdl_wait` would see a stale buffer and differ.
#[test]
fn glm5_heads_pdl_changes_no_logit() {
    let _gpu = exclusive();
    use crate::lm::{LanguageModel, SeqStep};
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (glm5_heads_pdl_changes_no_logit)");
        return;
    }
    let (md, w) = glm5_heads_weights();
    let get = |name: &str| Ok(w.get(name).cloned());
    let be = CudaBackend::with_options(0, FAST).expect("CUDA backend");
    let g = be.gpu().clone();
    if g.info().compute_capability.0 < 9 {
        say("skipped: programmatic dependent launch needs compute capability 9.0");
        return;
    }
    let model =
        GlmModel::from_weights(be, ModelSpec::from_metadata(&md).unwrap(), &get).expect("model");
    let run = |pdl: bool| -> Vec<Vec<f32>> {
        g.set_pdl(pdl);
        let mut seq = model.new_sequence();
        let mut toks: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % 512).collect();
        let mut out = Vec::new();
        for step in 0..7u32 {
            let l = model
                .forward(&mut [SeqStep {
                    seq: seq.as_mut(),
                    tokens: &toks,
                    all_logits: false,
                }])
                .expect("forward")
                .remove(0);
            toks = vec![(step * 101 + 7) % 512];
            out.push(l);
        }
        out
    };
    let serial = run(false);
    let pdl = run(true);
    g.set_pdl(true);
    say(&format!("| PDL | 7 steps | bitwise {} |", pdl == serial));
    assert!(serial.iter().all(|l| l.iter().all(|v| v.is_finite())));
    assert!(
        pdl == serial,
        "programmatic dependent launch changed the logits"
    );
}

/// The synthetic model itself is valid (runs without a GPU, so CI checks the builder).
#[test]
fn glm5_heads_model_runs_on_the_cpu() {
    let (md, w) = glm5_heads_weights();
    let get = |name: &str| Ok(w.get(name).cloned());
    let cpu = GlmModel::from_weights(
        crate::cpu::CpuBackend,
        ModelSpec::from_metadata(&md).unwrap(),
        &get,
    )
    .expect("CPU model");
    use crate::lm::{LanguageModel, SeqStep};
    let mut s = cpu.new_sequence();
    let out = cpu
        .forward(&mut [SeqStep {
            seq: s.as_mut(),
            tokens: &[1, 2, 3, 4],
            all_logits: false,
        }])
        .expect("forward");
    assert_eq!(out[0].len(), 512);
    assert!(out[0].iter().all(|v| v.is_finite()));
    let max = out[0].iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(max > 0.0 && max < 1e4, "logits of a sane scale: {max}");
}

/// `forward_sample` on the device against the same model's logits on the host: greedy ids equal
/// the host argmax of `forward`'s logits of an identical sequence (the kernels are run-to-run
/// deterministic, so the two steps see bitwise the same logits), sampled ids are valid picks of
/// the host rules (in the distribution; the same id as the host inverse CDF whenever the host's
/// pick is not within f32 rounding of a CDF boundary), log-probabilities equal the host's.
#[test]
fn cuda_forward_sample_matches_host_sampling() {
    use crate::lm::{LanguageModel, SeqStep};
    use crate::sampling::{finish_rows, sample_row, SampleParams, SampleRequest};
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_forward_sample_matches_host_sampling)");
        return;
    }
    let path = fixtures().join("gguf").join("tiny-glm5-Q4_K_M.gguf");
    let model = Arc::new(gguf::Model::open(&path).expect("open fixture"));
    let gpu = super::load_cuda_with(model, 0, FAST).expect("load on CUDA");
    let cases = [
        (SampleParams::GREEDY, 0.0),
        (
            SampleParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
            },
            0.37,
        ),
        (
            SampleParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
            },
            0.71,
        ),
    ];
    let mut failures = Vec::new();
    let mut a = gpu.new_sequence();
    let mut b = gpu.new_sequence();
    let mut toks = vec![3u32, 17, 101, 5];
    for step in 0..6 {
        let (p, u) = cases[step % cases.len()];
        let req = SampleRequest {
            params: p,
            u,
            logprobs: Some(3),
        };
        let got = gpu
            .forward_sample(
                &mut [SeqStep {
                    seq: a.as_mut(),
                    tokens: &toks,
                    all_logits: false,
                }],
                &[req],
            )
            .expect("forward_sample")
            .remove(0);
        let logits = gpu
            .forward(&mut [SeqStep {
                seq: b.as_mut(),
                tokens: &toks,
                all_logits: false,
            }])
            .expect("forward")
            .remove(0);
        let host_id = sample_row(&logits, &p, u);
        let host = finish_rows(&[(host_id, false)], &[req], Some(&logits), logits.len()).remove(0);
        // The same id unless u sits within f32 rounding of a CDF boundary (the device sums in
        // f32): then the neighbouring candidate is as valid.
        let near = |du: f64| sample_row(&logits, &p, (u + du).clamp(0.0, 0.999_999)) == got.id;
        let id_ok = got.id == host_id || (!p.is_greedy() && (near(1e-5) || near(-1e-5)));
        let lp_ok = match (got.logprob, host.logprob) {
            (Some(x), Some(y)) => x == y || (x - y).abs() <= 1e-6 * y.abs().max(1.0),
            _ => false,
        };
        say(&format!(
            "| forward_sample | step {step} {p:?} u {u} | device {} host {host_id} | logprob {:?} vs {:?} | {} |",
            got.id,
            got.logprob,
            host.logprob,
            id_ok && lp_ok && !got.non_finite && got.top == host.top
        ));
        if !(id_ok && lp_ok && !got.non_finite && got.top == host.top) {
            failures.push(format!("step {step}: {got:?} vs host {host:?}"));
        }
        toks = vec![got.id];
        // Keep the two sequences identical.
        if got.id != host_id {
            break;
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The fused residual add + RMSNorm is bitwise the two ops it replaces (same f32 sum, same
/// reduction order), on one row and on 1,100 rows.
#[test]
fn cuda_add_rms_norm_equals_add_then_rms_norm() {
    use crate::backend::Backend;
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_add_rms_norm_equals_add_then_rms_norm)");
        return;
    }
    let be = CudaBackend::with_options(0, FAST).expect("device");
    let mut r = Rng(0x5eed_0000_add0_0001);
    let d = 6144;
    let wv: Vec<f32> = (0..d).map(|_| 1.0 + 0.1 * (2.0 * r.unit() - 1.0)).collect();
    let w = be
        .upload(HostWeight::from_f32(String::from("norm.weight"), vec![d], &wv).expect("weight"))
        .expect("upload");
    for rows in [1usize, 1100] {
        let mk =
            |r: &mut Rng| -> Vec<f32> { (0..rows * d).map(|_| 4.0 * r.unit() - 2.0).collect() };
        let (hv, xv) = (mk(&mut r), mk(&mut r));
        let h = be.new_tensor(rows, d, &hv).expect("h");
        let x = be.new_tensor(rows, d, &xv).expect("x");
        let (fh, fy) = be.add_rms_norm(&h, &x, &w, 1e-5).expect("fused");
        let uh = be.add(&h, &x).expect("add");
        let uy = be.rms_norm(&uh, &w, 1e-5).expect("rms_norm");
        let same = be.to_host(&fh).unwrap() == be.to_host(&uh).unwrap()
            && be.to_host(&fy).unwrap() == be.to_host(&uy).unwrap();
        say(&format!("| add_rms_norm | {rows}x{d} | bitwise | {same} |"));
        assert!(
            same,
            "fused add+rms_norm differs from add, rms_norm at {rows} rows"
        );
    }
}

/// The in-place latent norm (`rms_norm_lead`, the MLA cache rows) is bitwise the slice, norm and
/// concatenation it replaces (same kernel, same block size, same reduction order), with the
/// rope columns untouched, at GLM-5's 512 + 64 widths.
#[test]
fn cuda_rms_norm_lead_equals_slice_norm_concat() {
    use crate::backend::Backend;
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_rms_norm_lead_equals_slice_norm_concat)");
        return;
    }
    let be = CudaBackend::with_options(0, FAST).expect("device");
    let mut r = Rng(0x5eed_0000_1ead_0001);
    let (n, cols) = (512, 576);
    let wv: Vec<f32> = (0..n).map(|_| 1.0 + 0.1 * (2.0 * r.unit() - 1.0)).collect();
    let w = be
        .upload(HostWeight::from_f32(String::from("kv_a_norm.weight"), vec![n], &wv).expect("w"))
        .expect("upload");
    for rows in [1usize, 1100] {
        let xv: Vec<f32> = (0..rows * cols).map(|_| 4.0 * r.unit() - 2.0).collect();
        let x = be.new_tensor(rows, cols, &xv).expect("x");
        let lead = be
            .rms_norm(&be.slice_cols(&x, 0, n).unwrap(), &w, 1e-6)
            .unwrap();
        let rest = be.slice_cols(&x, n, cols - n).unwrap();
        let want = be
            .to_host(&be.concat_cols(&[&lead, &rest]).unwrap())
            .unwrap();
        let got = be
            .to_host(&be.rms_norm_lead(x, &w, n, 1e-6).expect("rms_norm_lead"))
            .unwrap();
        let same = got == want;
        say(&format!(
            "| rms_norm_lead | {rows}x{cols} | bitwise | {same} |"
        ));
        assert!(same, "rms_norm_lead differs at {rows} rows");
    }
}

/// A 2-D weight `{k, m}` of random `ty` blocks (Q4_K: GGUF layout; Q8_0: repacked on upload).
fn random_weight(
    be: &CudaBackend,
    name: &str,
    ty: GgmlType,
    k: usize,
    m: usize,
    r: &mut Rng,
) -> super::CudaWeight {
    use crate::backend::Backend;
    let bytes = random_blocks(ty, k * m, r);
    be.upload(HostWeight::from_bytes(name, ty, vec![k, m], bytes).expect("weight"))
        .expect("upload")
}

/// The GEMVs' row split forced to `ks` warps (`None`: automatic) until dropped, also when a
/// check panics, so later tests of the binary see the automatic split.
/// Tests that compare GPU results bitwise run one at a time: the process shares one `Gpu` per
/// device, and the launch choices they force on it (the GEMVs' warp split, programmatic
/// dependent launch) would otherwise change a concurrently running test's summation
/// order between its two runs.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

struct ForcedSplit(Arc<kernels::Gpu>);

impl ForcedSplit {
    fn set(g: &Arc<kernels::Gpu>, ks: Option<usize>) -> Self {
        g.force_gemvq_ksplit(ks).expect("split");
        ForcedSplit(g.clone())
    }
}

impl Drop for ForcedSplit {
    fn drop(&mut self) {
        let _ = self.0.force_gemvq_ksplit(None);
    }
}

/// `f()`'s result and the kernel launches it queued, by kind.
fn launches<R>(be: &CudaBackend, f: impl FnOnce() -> R) -> (R, Vec<(String, f64)>) {
    be.gpu().profile_begin();
    let r = f();
    let p = be.gpu().profile_end().expect("profile");
    (
        r,
        p.kinds.into_iter().map(|k| (k.kind, k.launches)).collect(),
    )
}

/// The fused gate+up+SiLU (`Backend::glu`: one GEMV launch reading both matrices) against the
/// two GEMVs and `silu_mul` it replaces, at the shared expert's shape (Q4_K, 6,144 -> 2,048)
/// and a repacked type (Q8_0), for 1, 3 and 8 tokens. With the rows' tasks split over the same
/// warps (forced 1, 2 and 4) both sum the same q8 products in the same order and form the same
/// f32 `g / (1 + exp(-g)) * u`: bitwise equal. The automatic split may differ between the two
/// kernels (their register counts differ), so the automatic fused result must equal the
/// unfused one at one of the three splits, bitwise.
#[test]
fn cuda_glu_equals_gemvs_then_silu_mul() {
    let _gpu = exclusive();
    use crate::backend::Backend;
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_glu_equals_gemvs_then_silu_mul)");
        return;
    }
    // The GEMV path's fusion is under test: steps of 3 and 8 rows would take the tensor-core
    // product by default (its GLU mode is checked against the oracle in kernels/tests/gpu.rs).
    let be = CudaBackend::with_options(0, FAST)
        .expect("device")
        .with_fusions(Fusions::ALL)
        .with_mmq(None);
    let g = be.gpu().clone();
    let mut r = Rng(0x5eed_0000_0910_0001);
    let mut failures = Vec::new();
    for (ty, k, ff) in [(GgmlType::Q4_K, 6144, 2048), (GgmlType::Q8_0, 512, 768)] {
        let gate = random_weight(&be, "ffn_gate", ty, k, ff, &mut r);
        let up = random_weight(&be, "ffn_up", ty, k, ff, &mut r);
        for rows in [1usize, 3, 8] {
            let xv: Vec<f32> = (0..rows * k).map(|_| 4.0 * r.unit() - 2.0).collect();
            let x = be.new_tensor(rows, k, &xv).expect("x");
            let unfused = || {
                let gt = be.matmul(&x, &gate).expect("gate");
                let ut = be.matmul(&x, &up).expect("up");
                be.to_host(&be.silu_mul(&gt, &ut).expect("silu_mul"))
                    .expect("download")
            };
            let mut by_split = Vec::new();
            for ks in [1usize, 2, 4] {
                let _split = ForcedSplit::set(&g, Some(ks));
                let want = unfused();
                let (got, l) = launches(&be, || be.glu(&x, &gate, &up).expect("glu"));
                let got = be.to_host(&got).expect("download");
                let one = l.len() == 1 && l[0].0.starts_with("gemvq glu") && l[0].1 == 1.0;
                let same = got == want;
                say(&format!(
                    "| glu {ty} | {rows}x{k} -> {ff} split {ks} | bitwise {same} | launches {l:?} |"
                ));
                if !(same && one) {
                    failures.push(format!("{ty} {rows} rows split {ks}: {same} {l:?}"));
                }
                by_split.push(want);
            }
            let got = be
                .to_host(&be.glu(&x, &gate, &up).expect("glu"))
                .expect("download");
            let ok = by_split.contains(&got) && got.iter().all(|v| v.is_finite());
            say(&format!(
                "| glu {ty} | {rows}x{k} -> {ff} automatic split | one of the unfused | {ok} |"
            ));
            if !ok {
                failures.push(format!("{ty} {rows} rows automatic split"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The accumulating GEMV (`Backend::matmul_add`: the shared expert's down projection added onto
/// the routed experts' sum in the GEMV's epilogue) is bitwise `add(acc, matmul(x, w))`: the
/// same GEMV launch, then the same single f32 add per output. One launch, no `add`; at the
/// shared expert's down shape (Q6_K 2,048 -> 6,144) and Q4_K, for 1 and 3 tokens.
#[test]
fn cuda_matmul_add_equals_matmul_then_add() {
    let _gpu = exclusive();
    use crate::backend::Backend;
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_matmul_add_equals_matmul_then_add)");
        return;
    }
    // The GEMV path's accumulate mode is under test (3-row steps take the tensor-core product
    // by default; its accumulate mode is checked against the oracle in kernels/tests/gpu.rs).
    let be = CudaBackend::with_options(0, FAST)
        .expect("device")
        .with_fusions(Fusions::ALL)
        .with_mmq(None);
    let mut r = Rng(0x5eed_0000_add0_0002);
    let mut failures = Vec::new();
    for (ty, k, m) in [(GgmlType::Q6_K, 2048, 6144), (GgmlType::Q4_K, 2048, 6144)] {
        let w = random_weight(&be, "ffn_down_shexp", ty, k, m, &mut r);
        for rows in [1usize, 3] {
            let xv: Vec<f32> = (0..rows * k).map(|_| 4.0 * r.unit() - 2.0).collect();
            let av: Vec<f32> = (0..rows * m).map(|_| 4.0 * r.unit() - 2.0).collect();
            let x = be.new_tensor(rows, k, &xv).expect("x");
            let sum = be
                .add(
                    &be.new_tensor(rows, m, &av).expect("acc"),
                    &be.matmul(&x, &w).expect("matmul"),
                )
                .expect("add");
            let want = be.to_host(&sum).expect("download");
            let acc = be.new_tensor(rows, m, &av).expect("acc");
            let (got, l) = launches(&be, || be.matmul_add(&x, &w, acc).expect("matmul_add"));
            let got = be.to_host(&got).expect("download");
            let one = l.len() == 1 && l[0].0.starts_with("gemvq add") && l[0].1 == 1.0;
            let same = got == want && got.iter().all(|v| v.is_finite());
            say(&format!(
                "| matmul_add {ty} | {rows}x{k} -> {m} | bitwise {same} | launches {l:?} |"
            ));
            if !(same && one) {
                failures.push(format!("{ty} {rows} rows: {same} {l:?}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The absorbed MLA queries (`Backend::mla_queries`) at GLM-5's shapes (64 heads of 192
/// position-free + 64 rope columns, `attn_k_b` Q8_0 `{192, 512, 64}`) for 1 and 3 tokens at
/// positions past 4,096: the fused path (quantize in place, per-head GEMV into the 576-wide
/// rows, RoPE out of place) is bitwise the composition it replaces (head slices, RoPE, per-head
/// matmul, concatenation) and takes 3 launches, no copies.
#[test]
fn cuda_mla_queries_equal_slices_rope_heads_concat() {
    let _gpu = exclusive();
    use crate::backend::{mla_queries_composed, Backend, RopeParams, RopeStyle};
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_mla_queries_equal_slices_rope_heads_concat)");
        return;
    }
    let be = CudaBackend::with_options(0, FAST)
        .expect("device")
        .with_fusions(Fusions::ALL);
    let mut r = Rng(0x5eed_0000_0a0e_0001);
    let (heads, nope, rope, lat) = (64usize, 192usize, 64usize, 512usize);
    let bytes = random_blocks(GgmlType::Q8_0, nope * lat * heads, &mut r);
    let k_b = be
        .upload(
            HostWeight::from_bytes("attn_k_b", GgmlType::Q8_0, vec![nope, lat, heads], bytes)
                .expect("weight"),
        )
        .expect("upload");
    let p = RopeParams {
        n_groups: heads,
        group_dim: rope,
        offset: 0,
        n_rot: rope,
        theta: 1e6,
        style: RopeStyle::Interleaved,
    };
    let mut failures = Vec::new();
    for rows in [1usize, 3] {
        let positions: Vec<u32> = (0..rows as u32).map(|i| 4100 + 7 * i).collect();
        let qv: Vec<f32> = (0..rows * heads * (nope + rope))
            .map(|_| 4.0 * r.unit() - 2.0)
            .collect();
        let q = be.new_tensor(rows, heads * (nope + rope), &qv).expect("q");
        let want = mla_queries_composed(&be, &q, &k_b, nope, &positions, &p).expect("composed");
        let want = be.to_host(&want).expect("download");
        let (got, l) = launches(&be, || {
            be.mla_queries(&q, &k_b, nope, &positions, &p)
                .expect("mla_queries")
        });
        let got = be.to_host(&got).expect("download");
        let n: f64 = l.iter().map(|k| k.1).sum();
        let same = got == want && got.iter().all(|v| v.is_finite());
        let copies = l.iter().any(|k| k.0.contains("copy"));
        say(&format!(
            "| mla_queries | {rows} tok x {heads} heads | bitwise {same} | launches {l:?} |"
        ));
        if !(same && n == 3.0 && !copies) {
            failures.push(format!("{rows} rows: {same} {l:?}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The MLA cache rows and the indexer keys of a one-sequence step (`mla_kv_rows`,
/// `indexer_keys` with the cache to append to) against their compositions (the latent norm /
/// LayerNorm, RoPE, `append_rows`), bitwise: the rows returned and every cached row, over a
/// 5-row step then a 1-row step, on the fast path's bf16 caches and the exact path's f32 ones;
/// one launch each.
#[test]
fn cuda_kv_rows_and_indexer_keys_equal_their_compositions() {
    let _gpu = exclusive();
    use crate::backend::{
        indexer_keys_composed, mla_kv_rows_composed, Backend, RopeParams, RopeStyle,
    };
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_kv_rows_and_indexer_keys_equal_their_compositions)");
        return;
    }
    let mut r = Rng(0x5eed_0000_00c4_0001);
    let mut failures = Vec::new();
    for (mode, opts) in [("fast", FAST), ("exact", EXACT)] {
        let be = CudaBackend::with_options(0, opts)
            .expect("device")
            .with_fusions(Fusions::ALL);
        let vector = |name: &str, n: usize, base: f32, r: &mut Rng| {
            let v: Vec<f32> = (0..n).map(|_| base + 0.2 * r.unit() - 0.1).collect();
            be.upload(HostWeight::from_f32(name.to_string(), vec![n], &v).expect("w"))
                .expect("upload")
        };
        let kv_norm = vector("attn_kv_a_norm.weight", 512, 1.0, &mut r);
        let (k_norm, k_bias) = (
            vector("indexer.k_norm.weight", 128, 1.0, &mut r),
            vector("indexer.k_norm.bias", 128, 0.0, &mut r),
        );
        let rope = |dim: usize, offset: usize| RopeParams {
            n_groups: 1,
            group_dim: dim,
            offset,
            n_rot: 64,
            theta: 1e6,
            style: RopeStyle::Interleaved,
        };
        let (kv_p, ix_p) = (rope(576, 512), rope(128, 0));
        let mut caches: Vec<super::CudaTensor> = [576, 576, 128, 128]
            .iter()
            .map(|&c| be.empty(c).expect("cache"))
            .collect();
        let mut pos0 = 0u32;
        for rows in [5usize, 1] {
            let positions: Vec<u32> = (pos0..pos0 + rows as u32).collect();
            pos0 += rows as u32;
            for (what, cols) in [("mla_kv_rows", 576usize), ("indexer_keys", 128)] {
                let xv: Vec<f32> = (0..rows * cols).map(|_| 6.0 * r.unit() - 3.0).collect();
                let (x1, x2) = (
                    be.new_tensor(rows, cols, &xv).expect("x"),
                    be.new_tensor(rows, cols, &xv).expect("x"),
                );
                let [cf, cc, kf, kc] = &mut caches[..] else {
                    unreachable!("four caches")
                };
                let ((got, l), want, (c_got, c_want)) = if cols == 576 {
                    let got = launches(&be, || {
                        be.mla_kv_rows(x1, &kv_norm, 512, 1e-6, &positions, &kv_p, Some(cf))
                            .expect("fused")
                    });
                    let want = mla_kv_rows_composed(
                        &be,
                        x2,
                        &kv_norm,
                        512,
                        1e-6,
                        &positions,
                        &kv_p,
                        Some(cc),
                    )
                    .expect("composed");
                    (got, want, (&*cf, &*cc))
                } else {
                    let got = launches(&be, || {
                        be.indexer_keys(x1, &k_norm, &k_bias, 1e-6, &positions, &ix_p, Some(kf))
                            .expect("fused")
                    });
                    let want = indexer_keys_composed(
                        &be,
                        x2,
                        &k_norm,
                        &k_bias,
                        1e-6,
                        &positions,
                        &ix_p,
                        Some(kc),
                    )
                    .expect("composed");
                    (got, want, (&*kf, &*kc))
                };
                let host = |t: &super::CudaTensor| be.to_host(t).expect("download");
                let same_rows = host(&got) == host(&want);
                let same_cache = c_got.rows == c_want.rows && host(c_got) == host(c_want);
                let n: f64 = l.iter().map(|k| k.1).sum();
                say(&format!(
                    "| {what} {mode} | {rows} rows, cache {} rows | rows bitwise {same_rows}, \
                     cache bitwise {same_cache} | launches {l:?} |",
                    c_got.rows
                ));
                if !(same_rows && same_cache && n == 1.0) {
                    failures.push(format!("{what} {mode} {rows} rows: {l:?}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A batched step's appends and attention in one launch each (`append_rows_seqs`,
/// `attention_seqs`) against their per-sequence compositions on the same caches: the caches
/// bitwise, the attention bitwise where every sequence sees at most 32 keys (then both take the
/// decode kernel's one-split plan: same arithmetic per token), and within the f32 kernels'
/// bound of each other past that (plans of different splits: summation order only). bf16 and
/// f32 caches; sequences of 1 and 3 rows; one sequence with a DSA key list.
#[test]
fn cuda_batched_appends_and_attention_equal_their_compositions() {
    let _gpu = exclusive();
    use crate::backend::{
        append_rows_seqs_composed, attention_seqs_composed, AttnParams, Backend, SeqAttn,
    };
    if kernels::device_count() == 0 {
        say(
            "skipped: no CUDA device (cuda_batched_appends_and_attention_equal_their_compositions)",
        );
        return;
    }
    let mut r = Rng(0x5eed_0000_00c4_00b7);
    let (heads, d, dv) = (64usize, 576usize, 512usize);
    let p = AttnParams {
        n_head: heads,
        n_kv_head: 1,
        k_dim: d,
        v_dim: dv,
        scale: 1.0 / 24.0,
        pos0: 0,
    };
    let mut failures = Vec::new();
    for (mode, opts) in [("fast", FAST), ("exact", EXACT)] {
        let be = CudaBackend::with_options(0, opts).expect("device");
        // Cached rows before the step, rows of the step.
        for (label, shape) in [
            (
                "<= 32 keys",
                vec![(4usize, 1usize), (20, 3), (9, 1), (30, 1)],
            ),
            // Up to 1,024 keys: the decode kernel either way (beyond, a bf16 cache takes the
            // tensor-core kernel, checked against f64 by kernels-gpu).
            ("past 32 keys", vec![(40, 1), (300, 3), (9, 1), (1000, 1)]),
        ] {
            let mut cache = |rows: usize| {
                let mut c = be.empty(d).expect("cache");
                // Room for the step: the batched append is then one launch, no regrowth copy.
                be.reserve_rows(&mut c, rows + 8).expect("reserve");
                if rows > 0 {
                    let v: Vec<f32> = (0..rows * d).map(|_| 2.0 * r.unit() - 1.0).collect();
                    be.append_rows(&mut c, &be.new_tensor(rows, d, &v).expect("rows"))
                        .expect("append");
                }
                c
            };
            let mut a: Vec<_> = shape.iter().map(|&(t, _)| cache(t)).collect();
            // The same caches again (bitwise copies) for the composition.
            let mut b: Vec<_> = a
                .iter()
                .map(|c| {
                    let mut n = be.empty(d).expect("cache");
                    be.reserve_rows(&mut n, c.rows + 8).expect("reserve");
                    let host = be.to_host(c).expect("download");
                    be.append_rows(&mut n, &be.new_tensor(c.rows, d, &host).expect("rows"))
                        .expect("append");
                    n
                })
                .collect();
            let counts: Vec<usize> = shape.iter().map(|s| s.1).collect();
            let n: usize = counts.iter().sum();
            let rows: Vec<f32> = (0..n * d).map(|_| 2.0 * r.unit() - 1.0).collect();
            let src = be.new_tensor(n, d, &rows).expect("rows");
            let ((), l) = launches(&be, || {
                let mut dst: Vec<&mut super::CudaTensor> = a.iter_mut().collect();
                be.append_rows_seqs(&mut dst, &src, &counts)
                    .expect("batched append")
            });
            {
                let mut dst: Vec<&mut super::CudaTensor> = b.iter_mut().collect();
                append_rows_seqs_composed(&be, &mut dst, &src, &counts).expect("composed append");
            }
            let same_caches = a.iter().zip(&b).all(|(x, y)| {
                x.rows == y.rows && be.to_host(x).expect("x") == be.to_host(y).expect("y")
            });
            let n_append: f64 = l.iter().map(|k| k.1).sum();
            // A key list for the second sequence: every other key up to its positions.
            let (t1, n1) = (a[1].rows, counts[1]);
            let width = t1.div_ceil(2);
            let list: Vec<i32> = (0..n1)
                .flat_map(|j| (0..width).map(move |k| (2 * k).min(t1 - n1 + j) as i32))
                .collect();
            let sel = super::CudaIndex {
                rows: n1,
                cols: width,
                buf: be.gpu.upload_async(&list).expect("list"),
            };
            let qv: Vec<f32> = (0..n * heads * d).map(|_| 2.0 * r.unit() - 1.0).collect();
            let q = be.new_tensor(n, heads * d, &qv).expect("q");
            fn seqs<'a>(
                cs: &'a [super::CudaTensor],
                counts: &[usize],
                sel: Option<&'a super::CudaIndex>,
            ) -> Vec<SeqAttn<'a, CudaBackend>> {
                cs.iter()
                    .zip(counts)
                    .enumerate()
                    .map(|(i, (c, &k))| SeqAttn {
                        rows: k,
                        pos0: c.rows - k,
                        k: c,
                        v: c,
                        selected: sel.filter(|_| i == 1),
                    })
                    .collect()
            }
            for sparse in [false, true] {
                let s = sparse.then_some(&sel);
                let (got, l) = launches(&be, || {
                    be.attention_seqs(&q, &seqs(&a, &counts, s), &p)
                        .expect("batched")
                });
                let want =
                    attention_seqs_composed(&be, &q, &seqs(&b, &counts, s), &p).expect("composed");
                let (g, w) = (be.to_host(&got).expect("g"), be.to_host(&want).expect("w"));
                let n_mla: f64 = l.iter().filter(|k| k.0 == "mla").map(|k| k.1).sum();
                // Values within [-1, 1]: each result is within the decode kernel's bound of
                // the exact attention (kernels' `mla_f32_expect`: score moves of
                // 2 (d + 8) 2^-24 scale sum|q c| with sum|q c| <= d, 8 + T + T/32 + 9
                // roundings of max|v| = 1), so the two within twice that.
                let t_max = shape.iter().map(|s| s.0 + s.1).max().unwrap_or(0) as f64;
                let u = f64::from(f32::EPSILON) / 2.0;
                let tol = if label == "<= 32 keys" {
                    0.0
                } else {
                    2.0 * ((8.0 + t_max + t_max / 32.0 + 9.0) * u
                        + 2.0 * (d as f64 + 8.0) * u * f64::from(p.scale) * d as f64)
                };
                let worst = g
                    .iter()
                    .zip(&w)
                    .fold(0f64, |m, (x, y)| m.max(f64::from((x - y).abs())));
                let ok = g.iter().all(|v| v.is_finite()) && worst <= tol && same_caches;
                say(&format!(
                    "| batched mla {mode} {label}{} | {} sequences | worst {worst:.3e} (tol \
                     {tol:.1e}), caches bitwise {same_caches} | {n_append} append and {n_mla} \
                     mla launches |",
                    if sparse { ", one sparse" } else { "" },
                    counts.len()
                ));
                // One launch for the batch (and the split combine past 32 keys).
                if !ok || n_append != 1.0 || !(1.0..=2.0).contains(&n_mla) {
                    failures.push(format!("{mode} {label} sparse {sparse}: {worst:e} > {tol:e}, caches {same_caches}, {l:?}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A cache reserved up front keeps its buffer (same device address, same capacity) while rows
/// are appended up to the reservation, and keeps every appended row (bf16 and f32 caches).
#[test]
fn cuda_reserved_cache_never_reallocates() {
    use super::Store;
    use crate::backend::Backend;
    use kernels::DeviceSlice;
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_reserved_cache_never_reallocates)");
        return;
    }
    for opts in [FAST, EXACT] {
        let be = CudaBackend::with_options(0, opts).expect("device");
        let cols = 576;
        let mut t = be.empty(cols).expect("empty");
        be.reserve_rows(&mut t, 3000).expect("reserve");
        let addr = |t: &super::CudaTensor| match &t.store {
            Store::F32(b) => (b.ptr(), b.len()),
            Store::Bf16(b) => (b.ptr(), b.len()),
        };
        let before = addr(&t);
        let mut want = Vec::new();
        for step in 0..30 {
            // 1,100 rows in steps crossing the 1,024 rows a growing cache would start with,
            // then single rows (decode).
            let n = if step == 0 { 1100 } else { 50 };
            let v: Vec<f32> = (0..n * cols)
                .map(|i| ((i + step) % 97) as f32 * 0.25)
                .collect();
            let src = be.new_tensor(n, cols, &v).expect("rows");
            be.append_rows(&mut t, &src).expect("append");
            want.extend_from_slice(&v);
            assert_eq!(addr(&t), before, "reallocated at step {step}");
        }
        // Multiples of 1/4 below 25 are exact in bf16.
        let ok = be.to_host(&t).expect("download") == want;
        say(&format!(
            "| reserved cache | {} rows, kv_bf16 {} | same buffer, rows kept | {ok} |",
            want.len() / cols,
            opts.kv_bf16
        ));
        assert!(ok, "appended rows changed");
    }
}

/// Weights uploaded through the pinned staging slots (several 8 MiB chunks each) download
/// equal to `HostWeight::bytes()`: whole weights, strided tensor-parallel shares gathered run
/// by run from the view, a share that is one run, and a repacked type (Q8_0) both whole and
/// as a strided share (compared in the device layout).
#[test]
fn cuda_staged_upload_of_shares_equals_their_bytes() {
    use crate::backend::Backend;
    if kernels::device_count() == 0 {
        say("skipped: no CUDA device (cuda_staged_upload_of_shares_equals_their_bytes)");
        return;
    }
    let be = CudaBackend::with_options(0, EXACT).expect("device");
    let patterned = |ty: GgmlType, dims: Vec<usize>| {
        let rows: usize = dims[1..].iter().product();
        let n = ty.row_bytes(dims[0] as u64).expect("whole blocks") as usize * rows;
        let bytes = (0..n)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8 ^ (i as u8))
            .collect();
        HostWeight::from_bytes("w", ty, dims, bytes).expect("weight")
    };
    // F16 [4096, 1500]: 12.3 MB; Q4_K [4096, 8000]: 18.4 MB; Q8_0 [4096, 2600]: 11.3 MB.
    let f16 = patterned(GgmlType::F16, vec![4096, 1500]);
    let q4k = patterned(GgmlType::Q4_K, vec![4096, 8000]);
    let q8 = patterned(GgmlType::Q8_0, vec![4096, 2600]);
    let cases: Vec<(&str, HostWeight)> = vec![
        ("f16 whole", f16.clone()),
        ("f16 cols", f16.shard(0, 1024..3072).expect("share").0),
        ("f16 rows", f16.shard(1, 100..1400).expect("share").0),
        ("q4_k cols", q4k.shard(0, 2048..4096).expect("share").0),
        ("q8_0 whole, packed", q8.clone()),
        ("q8_0 cols, packed", q8.shard(0, 0..2048).expect("share").0),
    ];
    let mut failures = Vec::new();
    for (what, w) in cases {
        let up = be.upload(w.clone()).expect("upload");
        let got = be.gpu.download(&up.bytes).expect("download");
        let want = if up.packed {
            kernels::repack::repack(w.ty(), w.bytes()).expect("whole blocks")
        } else {
            w.bytes().to_vec()
        };
        let ok = got == want && up.packed == (w.ty() == GgmlType::Q8_0);
        say(&format!(
            "| staged upload | {what} | {} B | {} |",
            want.len(),
            if ok { "equal" } else { "DIFFERS" }
        ));
        if !ok {
            failures.push(what);
        }
    }
    assert!(failures.is_empty(), "staged uploads differ: {failures:?}");
}
