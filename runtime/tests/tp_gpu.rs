//! Tensor parallelism on CUDA with several ranks sharing one GPU (separate streams, the one-shot
//! all-reduce over same-device buffers): the all-reduce equals the CPU's rank-order sum bitwise
//! on every rank, and TP 2/4 (8 on the GLM-5-shaped model) give TP 1's greedy tokens wherever
//! TP 1's top-2 gap exceeds twice the derived tolerance, with logits within it
//! (`runtime::tp::check`). Without a GPU every test prints "skipped: no CUDA device".
//! `GGUFTOOL_FIXTURES` points at the fixtures away from the checkout; `GGUFTOOL_TP_SYNTH` at a
//! GLM-5-shaped model (`gguftool synth --preset glm5 --layers 2`) for the full-size check.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Barrier, Mutex};

use kernels::{Gpu, OneShotHandles, OneShotRank};
use runtime::device::AllReduce;
use runtime::tp::check::{compare_greedy, tp_tolerance};
use runtime::tp::{sum_in_rank_order, MoeSplit};
use runtime::LanguageModel;

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

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
    let one = runtime::cuda::load_cuda(Arc::clone(model), 0).unwrap();
    let mut bad = Vec::new();
    for &(world, moe) in configs {
        let tp = runtime::cuda::comm::load_cuda_tp(
            Arc::clone(model),
            &vec![0; world],
            moe,
            AllReduce::Auto,
            None,
        )
        .unwrap_or_else(|e| panic!("{name} TP {world}: {e}"));
        let comm = tp.tp_report().map(|r| r.comm).unwrap_or_default();
        let tol = tp_tolerance(one.spec(), world);
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

#[test]
fn cuda_ranks_on_one_gpu_match_tp1_on_a_glm5_shaped_model() {
    if no_gpu("cuda_ranks_on_one_gpu_match_tp1_on_a_glm5_shaped_model") {
        return;
    }
    let Some(p) = std::env::var_os("GGUFTOOL_TP_SYNTH") else {
        say("skipped: GGUFTOOL_TP_SYNTH not set (cuda_ranks_on_one_gpu_match_tp1_on_a_glm5_shaped_model)");
        return;
    };
    let m = open(std::path::Path::new(&p));
    let prompt: Vec<u32> = (0..32u32).map(|i| 100 + 7 * i).collect();
    let bad = check_model(
        "glm5-shaped (synth)",
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
