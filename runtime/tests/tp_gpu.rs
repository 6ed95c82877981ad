//! Tensor parallelism on CUDA with several ranks sharing one GPU (separate streams, the one-shot
//! all-reduce over same-device buffers): the all-reduce equals the CPU's rank-order sum bitwise
//! on every rank, and TP 2/4 (8 on the GLM-5-shaped model) on the exact path give TP 1's greedy tokens wherever
//! TP 1's top-2 gap exceeds twice the derived tolerance, with logits within it
//! (`runtime::tp::check`). Without a GPU every test prints "skipped: no CUDA device".
//! `GGUFTOOL_FIXTURES` points at the fixtures away from the checkout; `GGUFTOOL_TP_GLM5` names the
//! file of the GLM-5-shaped model these tests write (once) for the full-size checks.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Barrier, Mutex};

use kernels::{Gpu, OneShotHandles, OneShotRank};
use runtime::device::AllReduce;
use runtime::tp::check::{compare_greedy, tp_tolerance, Summation};
use runtime::tp::{sum_in_rank_order, MoeSplit};
use runtime::LanguageModel;

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

const EXACT: runtime::cuda::CudaOptions = runtime::cuda::CudaOptions {
    exact: true,
    kv_bf16: false,
};

fn no_gpu(test: &str) -> bool {
    if kernels::device_count() == 0 {
        say(&format!("skipped: no CUDA device ({test})"));
        return true;
    }
    false
}

fn fixtures() -> PathBuf {
    std::env::var_os("GGUFTOOL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Mixed magnitudes, so the summation order shows in the bits.
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * (1 << (s % 20)) as f32
        })
        .collect()
}

#[test]
fn peer_access_probe() {
    if no_gpu("peer_access_probe") {
        return;
    }
    let n = kernels::device_count();
    let mut rows = Vec::new();
    for a in 0..n {
        let r: Vec<String> = (0..n)
            .map(|b| match kernels::can_access_peer(a, b) {
                Ok(true) => "yes".into(),
                Ok(false) => "no".into(),
                Err(e) => format!("error: {e}"),
            })
            .collect();
        rows.push(format!("| {a} | {} |", r.join(" | ")));
    }
    say(&format!(
        "peer access (cuDeviceCanAccessPeer), {n} device(s); NCCL library: {}",
        if runtime::cuda::comm::nccl_available() {
            "found"
        } else {
            "not found"
        }
    ));
    for r in rows {
        say(&r);
    }
}

/// Per message size: (values, each iteration's result, median microseconds for the timing row).
type RankRuns = Vec<(usize, Vec<Vec<f32>>, f64)>;

#[test]
fn oneshot_allreduce_equals_the_cpu_rank_order_sum() {
    if no_gpu("oneshot_allreduce_equals_the_cpu_rank_order_sum") {
        return;
    }
    for world in [2usize, 4, 8] {
        let handles = Mutex::new(vec![None; world]);
        let ready = Barrier::new(world);
        let results: Vec<RankRuns> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (handles, ready) = (&handles, &ready);
                    s.spawn(move || {
                        let gpu = Gpu::open_private(0).unwrap();
                        let mut r = OneShotRank::new(&gpu, rank, world, 1 << 18).unwrap();
                        handles.lock().unwrap()[rank] = Some(r.handles());
                        ready.wait();
                        let all: Vec<OneShotHandles> =
                            handles.lock().unwrap().iter().map(|h| h.unwrap()).collect();
                        r.connect(&all).unwrap();
                        ready.wait();
                        let mut out = Vec::new();
                        // Sizes: tiny, odd, GLM-5's hidden vector, more than one launch.
                        for (i, n) in [1usize, 7, 6144, (1 << 18) + 3].into_iter().enumerate() {
                            let mut got = Vec::new();
                            for it in 0..50u64 {
                                let v = values(n, (it * 131 + i as u64) * 17 + rank as u64);
                                let mut x = gpu.upload(&v).unwrap();
                                ready.wait();
                                r.all_reduce(&mut x, n).unwrap();
                                got.push(gpu.download(&x).unwrap());
                            }
                            out.push((n, got, 0.0));
                        }
                        // Latency of a 12 KiB (3072 f32) reduce, back to back, median of 200.
                        let mut x = gpu.upload(&values(3072, 99)).unwrap();
                        let mut t = Vec::new();
                        for _ in 0..200 {
                            ready.wait();
                            let ms = gpu.time_ms(|| r.all_reduce(&mut x, 3072)).unwrap();
                            t.push(ms as f64 * 1e3);
                        }
                        t.sort_by(|a, b| a.total_cmp(b));
                        out.push((3072, Vec::new(), t[t.len() / 2]));
                        assert!(!r.timed_out().unwrap(), "rank {rank} timed out");
                        out
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (k, &(n, _, _)) in results[0].iter().enumerate() {
            if results[0][k].1.is_empty() {
                say(&format!(
                    "| oneshot all-reduce | {world} ranks on GPU 0 | 12 KiB | median {:.1} us (rank 0) |",
                    results[0][k].2
                ));
                continue;
            }
            let i = k;
            for it in 0..50u64 {
                let inputs: Vec<Vec<f32>> = (0..world)
                    .map(|rank| values(n, (it * 131 + i as u64) * 17 + rank as u64))
                    .collect();
                let want = sum_in_rank_order(inputs);
                for (rank, r) in results.iter().enumerate() {
                    let got = &r[k].1[it as usize];
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same && got.len() == want.len(),
                        "{world} ranks, {n} values, iteration {it}: rank {rank} differs from the CPU sum"
                    );
                }
            }
            say(&format!(
                "| oneshot all-reduce | {world} ranks on GPU 0 | {n} f32 x 50 | bitwise = CPU rank-order sum on every rank |"
            ));
        }
    }
}

fn open(p: &std::path::Path) -> Arc<gguf::Model> {
    Arc::new(gguf::Model::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
}

/// TP 1 (the plain CUDA backend) against TP `world` ranks on GPU 0, greedy `steps` per prompt.
fn check_model(
    name: &str,
    model: &Arc<gguf::Model>,
    prompts: &[(String, Vec<u32>)],
    configs: &[(usize, MoeSplit)],
    steps: usize,
) -> Vec<String> {
    // The exact path (f32 activations and caches): its only difference from TP 1 is the f32
    // summation order, which `tp_tolerance` bounds. The fast path's q8 activations would turn
    // that order difference into whole-code rounding flips (a bound of its own, checked against
    // the CPU in runtime's cuda tests and by `doctor --tp`).
    let one = runtime::cuda::load_cuda_with(Arc::clone(model), 0, EXACT).unwrap();
    let mut bad = Vec::new();
    for &(world, moe) in configs {
        let tp = runtime::cuda::comm::load_cuda_tp(
            Arc::clone(model),
            &vec![0; world],
            moe,
            AllReduce::Auto,
            EXACT,
            None,
        )
        .unwrap_or_else(|e| panic!("{name} TP {world}: {e}"));
        let comm = tp.tp_report().map(|r| r.comm).unwrap_or_default();
        let tol = tp_tolerance(one.spec(), world, Summation::Sequential);
        for (id, ids) in prompts {
            let c = compare_greedy(&one, &tp, ids, steps, tol).unwrap();
            say(&format!(
                "| {name} | TP {world} {} ({comm}) | {id} | {:.2e} (tol {tol:.1e}) | {}/{} | {:?} |",
                moe.name(),
                c.max_rel_diff,
                c.greedy_identical,
                steps + 1,
                c.near_ties
            ));
            if let Some(f) = c.failure {
                bad.push(format!("{name} TP {world} {moe:?} {id}: {f}"));
            }
        }
    }
    bad
}

#[test]
fn cuda_ranks_on_one_gpu_match_tp1_on_fixtures() {
    if no_gpu("cuda_ranks_on_one_gpu_match_tp1_on_fixtures") {
        return;
    }
    let mut prompts = Vec::new();
    for f in ["refs/hf-tiny-glm5.json", "refs/hf-tiny-glm5-long.json"] {
        let text = std::fs::read_to_string(fixtures().join(f)).expect("reference prompts");
        prompts.extend(runtime::cuda::check::reference_prompts(&text).expect("reference JSON"));
    }
    say("| model | ranks | prompt | max rel diff | greedy identical | near ties |");
    say("|---|---|---|---|---|---|");
    let mut bad = Vec::new();
    for file in [
        "tiny-glm5-BF16.gguf",
        "tiny-glm5-Q8_0.gguf",
        "tiny-glm5-Q4_K_M.gguf",
    ] {
        let m = open(&fixtures().join("gguf").join(file));
        bad.extend(check_model(
            file,
            &m,
            &prompts,
            &[
                (2, MoeSplit::Columns),
                (4, MoeSplit::Columns),
                (4, MoeSplit::Experts),
            ],
            16,
        ));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Write a GLM-5-shaped model to `path`: GLM-5's dimensions (spec §2.3: hidden 6144, 64 heads,
/// q_lora 2048, kv_lora 512, qk 192 + 64, v 256, dense FFN 12288, expert FFN 2048, indexer
/// 32 x 128, vocabulary 154880) with 32 routed experts (8 used) instead of 256, one dense and one
/// MoE layer, the quant mix of bench-models.md and random contents with small finite scales.
/// Every row split is a whole number of Q4_K / Q6_K blocks at TP 8, as in GLM-5.
fn write_glm5_shaped(path: &std::path::Path) {
    write_glm5(path, true)
}

/// [`write_glm5_shaped`]'s header with the data left a hole (`with_data` false): all the
/// header-only plan needs, without writing 2.4 GB.
fn write_glm5(path: &std::path::Path, with_data: bool) {
    use gguf::writer::{array_of, Layout};
    use gguf::{GgmlType::*, Metadata, TensorInfo, Value, ValueType};
    let (d, ff, heads, q_lora, kv_lora, nope, rope, v_head) = (
        6144u64, 12288u64, 64u64, 2048u64, 512u64, 192u64, 64u64, 256u64,
    );
    let (experts, eff, ih, idim, vocab) = (32u64, 2048u64, 32u64, 128u64, 154880u64);
    let a = "glm-dsa";
    let mut m = Metadata::new(path);
    m.set("general.architecture", Value::String(a.into()));
    let u = |v: u64| Value::U32(v as u32);
    for (k, v) in [
        ("block_count", u(2)),
        ("context_length", u(4096)),
        ("embedding_length", u(d)),
        ("feed_forward_length", u(ff)),
        ("attention.head_count", u(heads)),
        ("attention.head_count_kv", u(1)),
        ("rope.freq_base", Value::F32(1e6)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("expert_count", u(experts)),
        ("expert_used_count", u(8)),
        ("expert_gating_func", u(2)),
        ("attention.key_length", u(kv_lora + rope)),
        ("attention.value_length", u(kv_lora)),
        ("leading_dense_block_count", u(1)),
        ("vocab_size", u(vocab)),
        ("attention.q_lora_rank", u(q_lora)),
        ("attention.kv_lora_rank", u(kv_lora)),
        ("attention.key_length_mla", u(nope + rope)),
        ("attention.value_length_mla", u(v_head)),
        ("expert_feed_forward_length", u(eff)),
        ("expert_shared_count", u(1)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_weights_norm", Value::Bool(true)),
        ("rope.dimension_count", u(rope)),
        ("attention.indexer.head_count", u(ih)),
        ("attention.indexer.key_length", u(idim)),
        ("attention.indexer.top_k", u(2048)),
    ] {
        m.set(&format!("{a}.{k}"), v);
    }
    m.set(
        &format!("{a}.attention.indexer.types"),
        array_of(ValueType::Bool, vec![Value::Bool(true); 2]),
    );
    let mut ts = Vec::new();
    let mut t = |name: String, dims: &[u64], ty: gguf::GgmlType| {
        ts.push(TensorInfo {
            name,
            dims: dims.to_vec(),
            ty,
            offset: 0,
        })
    };
    t("token_embd.weight".into(), &[d, vocab], Q4_K);
    t("output_norm.weight".into(), &[d], F32);
    t("output.weight".into(), &[d, vocab], Q6_K);
    for l in 0..2u64 {
        let b = |s: &str| format!("blk.{l}.{s}");
        t(b("attn_norm.weight"), &[d], F32);
        t(b("attn_q_a.weight"), &[d, q_lora], Q4_K);
        t(b("attn_q_a_norm.weight"), &[q_lora], F32);
        t(b("attn_q_b.weight"), &[q_lora, heads * (nope + rope)], Q4_K);
        t(b("attn_kv_a_mqa.weight"), &[d, kv_lora + rope], Q4_K);
        t(b("attn_kv_a_norm.weight"), &[kv_lora], F32);
        t(b("attn_k_b.weight"), &[nope, kv_lora, heads], Q8_0);
        t(b("attn_v_b.weight"), &[kv_lora, v_head, heads], Q4_K);
        t(b("attn_output.weight"), &[heads * v_head, d], Q4_K);
        t(b("ffn_norm.weight"), &[d], F32);
        t(b("indexer.k_norm.weight"), &[idim], F32);
        t(b("indexer.k_norm.bias"), &[idim], F32);
        t(b("indexer.proj.weight"), &[d, ih], F32);
        t(b("indexer.attn_k.weight"), &[d, idim], Q4_K);
        t(b("indexer.attn_q_b.weight"), &[q_lora, ih * idim], Q4_K);
        if l == 0 {
            t(b("ffn_gate.weight"), &[d, ff], Q4_K);
            t(b("ffn_up.weight"), &[d, ff], Q4_K);
            t(b("ffn_down.weight"), &[ff, d], Q6_K);
        } else {
            t(b("ffn_gate_inp.weight"), &[d, experts], F32);
            t(b("exp_probs_b.bias"), &[experts], F32);
            t(b("ffn_gate_exps.weight"), &[d, eff, experts], Q4_K);
            t(b("ffn_up_exps.weight"), &[d, eff, experts], Q4_K);
            t(b("ffn_down_exps.weight"), &[eff, d, experts], Q4_K);
            t(b("ffn_gate_shexp.weight"), &[d, eff], Q4_K);
            t(b("ffn_up_shexp.weight"), &[d, eff], Q4_K);
            t(b("ffn_down_shexp.weight"), &[eff, d], Q6_K);
        }
    }
    let layout = Layout::new(3, &m, ts).unwrap();
    if !with_data {
        let mut f = std::fs::File::create(path).unwrap();
        layout.write_header(&mut f).unwrap();
        f.set_len(layout.file_size()).unwrap();
        return;
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    layout.write_header(&mut f).unwrap();
    let mut pos = layout.data_offset;
    for (i, t) in layout.tensors.iter().enumerate() {
        let at = layout.data_offset + t.offset;
        f.write_all(&vec![0u8; (at - pos) as usize]).unwrap();
        let n = t.n_bytes() as usize;
        let mut buf = vec![0u8; n];
        let mut s = 0x2545_F491_4F6C_DD1Du64 ^ (i as u64) << 32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let small =
            |r: u64, base: f32, a: f32| base + ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * a;
        match t.ty {
            F32 => {
                let norm = t.name.contains("norm.weight");
                for c in buf.chunks_exact_mut(4) {
                    let v = if norm {
                        small(next(), 1.0, 0.2)
                    } else {
                        small(next(), 0.0, 0.1)
                    };
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
            ty => {
                for c in buf.chunks_mut(8) {
                    let r = next().to_le_bytes();
                    c.copy_from_slice(&r[..c.len()]);
                }
                // The f16 scales of every block: small, positive, finite.
                let fields: &[usize] = match ty {
                    Q4_K => &[0, 2],
                    Q6_K => &[208],
                    _ => &[0],
                };
                for blk in buf.chunks_exact_mut(ty.type_size()) {
                    for &o in fields {
                        let v = half::f16::from_f32(1e-4 + small(next(), 0.5, 1.0).abs() * 2e-3);
                        blk[o..o + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
        f.write_all(&buf).unwrap();
        pos = at + n as u64;
    }
    f.write_all(&vec![0u8; (layout.file_size() - pos) as usize])
        .unwrap();
    f.flush().unwrap();
}

fn glm5_path() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("GGUFTOOL_TP_GLM5")?);
    if !p.exists() {
        write_glm5_shaped(&p);
    }
    Some(p)
}

/// The writer's model is one the runtime accepts, and splits over 8 ranks without re-encoding.
/// With `GGUFTOOL_TP_GLM5` set it checks that file (the device script runs it first); without,
/// the same header over a sparse file (the plan reads headers only).
#[test]
fn a_glm5_shaped_model_splits_in_whole_blocks_at_tp8() {
    let dir = tempfile::tempdir().unwrap();
    let p = glm5_path().unwrap_or_else(|| {
        let p = dir.path().join("glm5-header-only.gguf");
        write_glm5(&p, false);
        p
    });
    let m = open(&p);
    let spec = runtime::spec::ModelSpec::from_model(&m).unwrap();
    let plan = runtime::tp::plan::weight_plan(&m, &spec, 8, MoeSplit::Columns).unwrap();
    assert!(plan.ranks.iter().all(|r| r.reencoded_f32.is_empty()));
    say(&format!(
        "| glm5-shaped | {:.2} GB of tensors | TP 8: {:.2} GB per rank |",
        m.tensors().map(|t| m.data(&t).len() as u64).sum::<u64>() as f64 / 1e9,
        plan.max_weight_bytes() as f64 / 1e9
    ));
}

#[test]
fn cuda_ranks_on_one_gpu_match_tp1_on_a_glm5_shaped_model() {
    if no_gpu("cuda_ranks_on_one_gpu_match_tp1_on_a_glm5_shaped_model") {
        return;
    }
    let Some(p) = glm5_path() else {
        say("skipped: GGUFTOOL_TP_GLM5 not set (cuda_ranks_on_one_gpu_match_tp1_on_a_glm5_shaped_model)");
        return;
    };
    let m = open(&p);
    let prompt: Vec<u32> = (0..32u32).map(|i| 100 + 7 * i).collect();
    let bad = check_model(
        "glm5-shaped",
        &m,
        &[("fixed-32".into(), prompt)],
        &[
            (2, MoeSplit::Columns),
            (4, MoeSplit::Columns),
            (8, MoeSplit::Columns),
            (8, MoeSplit::Experts),
        ],
        8,
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Greedy decode rate of the GLM-5-shaped model on ranks sharing GPU 0 (host-timed, one
/// warm-up step): the per-launch costs of each split; one GPU cannot show the imbalance of
/// expert parallelism (docs/TP.md).
#[test]
fn decode_rates_of_the_splits_on_one_gpu() {
    if no_gpu("decode_rates_of_the_splits_on_one_gpu") {
        return;
    }
    let Some(p) = glm5_path() else {
        say("skipped: GGUFTOOL_TP_GLM5 not set (decode_rates_of_the_splits_on_one_gpu)");
        return;
    };
    let m = open(&p);
    let prompt: Vec<u32> = (0..32u32).map(|i| 100 + 7 * i).collect();
    let rate = |lm: &dyn LanguageModel| -> f64 {
        let mut s = lm.new_sequence();
        let mut step = |t: &[u32]| {
            lm.forward_top_k(
                &mut [runtime::SeqStep {
                    seq: s.as_mut(),
                    tokens: t,
                    all_logits: false,
                }],
                1,
            )
            .unwrap()[0][0]
                .0
        };
        let mut t = step(&prompt);
        t = step(&[t]);
        let t0 = std::time::Instant::now();
        for _ in 0..32 {
            t = step(&[t]);
        }
        32.0 / t0.elapsed().as_secs_f64()
    };
    let one = runtime::cuda::load_cuda(Arc::clone(&m), 0).unwrap();
    say(&format!(
        "| decode | glm5-shaped | TP 1 | {:.1} tok/s |",
        rate(&one)
    ));
    drop(one);
    for (world, moe) in [
        (2, MoeSplit::Columns),
        (2, MoeSplit::Experts),
        (4, MoeSplit::Columns),
    ] {
        let tp = runtime::cuda::comm::load_cuda_tp(
            Arc::clone(&m),
            &vec![0; world],
            moe,
            AllReduce::Auto,
            runtime::cuda::CudaOptions::default(),
            None,
        )
        .unwrap();
        say(&format!(
            "| decode | glm5-shaped | TP {world} {} on GPU 0 | {:.1} tok/s |",
            moe.name(),
            rate(&tp)
        ));
    }
}

/// Load time of `GGUFTOOL_TP_LOAD` on `GGUFTOOL_TP_LOAD_WORLD` ranks of GPU 0 (the device script
/// evicts the file from the page cache first and measures `dd iflag=direct` as the baseline).
#[test]
fn load_speed() {
    if no_gpu("load_speed") {
        return;
    }
    let Some(p) = std::env::var_os("GGUFTOOL_TP_LOAD") else {
        say("skipped: GGUFTOOL_TP_LOAD not set (load_speed)");
        return;
    };
    let world: usize = std::env::var("GGUFTOOL_TP_LOAD_WORLD")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let t0 = std::time::Instant::now();
    let m = open(std::path::Path::new(&p));
    let file: u64 = m.tensors().map(|t| m.data(&t).len() as u64).sum();
    let opts = runtime::device::LoadOptions {
        device: runtime::device::Device::Cuda(0),
        tp: Some(runtime::device::TpSize::Ranks(world)),
        tp_devices: Some(vec![0; world]),
        ..Default::default()
    };
    let l = runtime::device::load(m, &opts).unwrap();
    let s = t0.elapsed().as_secs_f64();
    say(&format!(
        "| load | TP {world} on GPU 0 | {:.2} GB of tensor data, {:.2} GB uploaded | {s:.2} s | {:.2} GB/s of file data |",
        file as f64 / 1e9,
        l.weight_bytes as f64 / 1e9,
        file as f64 / 1e9 / s
    ));
}
