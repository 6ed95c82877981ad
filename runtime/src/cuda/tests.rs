//! CUDA backend against the CPU reference backend on the tiny-glm5 fixtures: every GGUF type,
//! the public prompts and the long prompts (longer than index_topk, so DSA sparse attention is
//! active). Tolerances: see `check.rs`. Without a CUDA device the test prints
//! "skipped: no CUDA device" and passes. `GGUFTOOL_FIXTURES` points at the fixture folder when
//! the test binary runs away from the checkout (the GPU machine).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use super::check::{compare, reference_prompts};

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

fn fixtures() -> PathBuf {
    std::env::var_os("GGUFTOOL_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"))
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
        let gpu = super::load_cuda(model, 0).expect("load on CUDA");
        for (id, ids) in &prompts {
            let r = compare(&cpu, &gpu, ids, 16).expect("forward");
            say(&format!(
                "| {file} | {id} ({} tok) | {:.2e} | {}/{} |{}",
                ids.len(),
                r.max_rel_diff,
                r.greedy_identical,
                r.steps,
                r.near_tie
                    .map(|(s, g)| format!(" near tie at step {s} (gap {g:.2e})"))
                    .unwrap_or_default()
            ));
            if let Some(f) = r.failure {
                failures.push(format!("{file} {id}: {f}"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
