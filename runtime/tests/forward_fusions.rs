//! The forward's launch-saving orderings change no value on the CPU reference: a block's
//! residual add left to the next block's norm (`GlmModel::set_residual_into_norm`, the order the
//! CUDA backend runs with one `add_rms_norm` launch) gives bitwise the same observed activations,
//! under the same names in the same order, and the same logits as the add done at once: on a
//! prefill that gathers the head's row, a decode step, and the draft layer's steps (several rows,
//! then one) of a drafting sequence.

use std::path::PathBuf;
use std::sync::Arc;

use runtime::cpu::CpuBackend;
use runtime::glm::{Activation, GlmModel, HeadOutput};
use runtime::SeqStep;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

/// One observation: name, shape and the value bits (f32 or index).
type Seen = (String, usize, usize, Vec<u64>);

fn record(seen: &mut Vec<Seen>) -> impl FnMut(&str, Activation<'_>) + '_ {
    move |name, a| {
        seen.push(match a {
            Activation::F32 { rows, cols, data } => (
                name.to_string(),
                rows,
                cols,
                data.iter().map(|v| u64::from(v.to_bits())).collect(),
            ),
            Activation::Index { rows, cols, data } => (
                name.to_string(),
                rows,
                cols,
                data.iter().map(|&v| v as u64).collect(),
            ),
        })
    }
}

/// Every observation and logit of a fixed script of steps.
fn script(model: &GlmModel<CpuBackend>) -> Vec<Seen> {
    let mut seen = Vec::new();
    let prompt = [3u32, 17, 101, 5, 42];
    // A plain sequence: the prefill's head takes its last row (gather), then one decode step.
    let mut plain = model.new_cache().expect("cache");
    for toks in [&prompt[..], &[7]] {
        let mut obs = record(&mut seen);
        let logits = model
            .forward_observed(
                &mut [SeqStep {
                    seq: &mut plain,
                    tokens: toks,
                    all_logits: false,
                }],
                Some(&mut obs),
            )
            .expect("forward");
        drop(obs);
        seen.push(bits("logits(host)", &logits[0]));
    }
    // A drafting sequence: the whole step normalised for the draft layer, which then runs on
    // the prompt's pending rows and on one decoded row.
    let mut drafting = model.new_draft_cache().expect("draft cache");
    for toks in [&prompt[..], &[7]] {
        let mut obs = record(&mut seen);
        model
            .forward_observed(
                &mut [SeqStep {
                    seq: &mut drafting,
                    tokens: toks,
                    all_logits: false,
                }],
                Some(&mut obs),
            )
            .expect("forward");
        let next: Vec<u32> = toks.iter().map(|t| t + 1).collect();
        let draft = model
            .forward_draft(&mut drafting, &next, HeadOutput::Gathered, Some(&mut obs))
            .expect("draft");
        drop(obs);
        seen.push(bits("draft logits(host)", &draft));
    }
    seen
}

fn bits(name: &str, v: &[f32]) -> Seen {
    (
        name.to_string(),
        1,
        v.len(),
        v.iter().map(|x| u64::from(x.to_bits())).collect(),
    )
}

#[test]
fn residual_add_in_the_next_norm_changes_no_activation() {
    let model = Arc::new(gguf::Model::open(fixture("gguf/tiny-glm5-Q4_K_M.gguf")).expect("open"));
    let mut m = runtime::glm::load_cpu(model).expect("load");
    assert!(!m.mtp_layers().is_empty(), "the fixture has a NextN layer");
    m.set_residual_into_norm(false);
    let at_once = script(&m);
    m.set_residual_into_norm(true);
    let in_norm = script(&m);
    let names = |s: &[Seen]| s.iter().map(|o| o.0.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&at_once),
        names(&in_norm),
        "observed names or order differ"
    );
    assert!(
        at_once.iter().any(|o| o.0 == "blk.3.out") && at_once.iter().any(|o| o.0 == "blk.2.out"),
        "block outputs observed, the draft layer's too"
    );
    for (a, b) in at_once.iter().zip(&in_norm) {
        assert!(a == b, "{} differs", a.0);
    }
}
