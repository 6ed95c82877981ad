//! `bench -m M --draft mtp [--draft-n K]`: speculative decoding in the decode benchmark.
//! Times greedy decoding with MTP drafts (tokens/s, acceptance per depth), the cost of a
//! trunk step over `j = 1 ..= K + 1` tokens at the same context relative to a 1-token step (the
//! verification step is a small prefill), and a recursive draft-layer step; from those and the
//! acceptance (measured, or `--draft-rates` for a model whose draft layer is random, such as a
//! GLM-5-shaped synth model), the projected speed-up of one round over plain decoding:
//! `(1 + sum_i a_i) * t(1) / (t(K + 1) + K * t_draft)`, `a_i` the acceptance at depth i
//! (each counted only when every earlier draft was kept, as `DraftStats` does).

use anyhow::{Context, Result};
use runtime::{LanguageModel, SeqStep};
use serving::sampler::{Sampler, SamplingParams};
use serving::speculative::SpecSequence;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchDraftArgs {
    #[command(flatten)]
    pub draft: super::draft::DraftArgs,
    /// Acceptance per draft depth to project the speed-up with (comma-separated, 0..1), in
    /// place of the measured one (a synth model's random draft layer accepts nothing).
    #[arg(long, value_delimiter = ',', requires = "draft")]
    pub draft_rates: Option<Vec<f64>>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Run the draft benchmark on `m` (`plain_tok_s`: the plain greedy decode rate measured in the
/// same run, the baseline); prints its lines when `print` and returns its JSON.
pub fn run(
    args: &BenchDraftArgs,
    m: &dyn LanguageModel,
    prompt: &[u32],
    n_tokens: usize,
    plain_tok_s: f64,
    print: bool,
) -> Result<Option<serde_json::Value>> {
    let Some(k) = args.draft.k_for(m)? else {
        return Ok(None);
    };
    let greedy = || Sampler::new(SamplingParams::greedy());
    // Speculative greedy decode (one warm-up sequence first).
    let decode = |n: usize| -> Result<(f64, SpecSequence)> {
        let mut sp = SpecSequence::new(m, k)?;
        let mut s = greedy();
        let l = sp.prefill(m, prompt)?;
        let mut last = s.sample(&l);
        let mut done = 1;
        let t0 = Instant::now();
        while done < n {
            let got = sp.step(m, &mut s, last, n - done, false)?;
            done += got.len();
            last = got.last().context("empty round")?.id;
        }
        Ok((t0.elapsed().as_secs_f64(), sp))
    };
    decode(k + 2)?;
    let (secs, sp) = decode(n_tokens + 1)?;
    let tok_s = n_tokens as f64 / secs;
    let st = &sp.stats;

    // Step costs at the prompt's context: j trunk tokens, then rolled back.
    let mut seq = m.new_draft_sequence()?;
    m.forward(&mut [SeqStep {
        seq: seq.as_mut(),
        tokens: prompt,
        all_logits: false,
    }])?;
    let n0 = seq.len();
    let reps = 7;
    let mut step_ms = Vec::new();
    for j in 1..=k + 1 {
        let toks: Vec<u32> = prompt.iter().copied().cycle().take(j).collect();
        let mut t = Vec::with_capacity(reps);
        for _ in 0..reps {
            // As a greedy round verifies: the pick after every row, ids only.
            let t0 = Instant::now();
            m.forward_greedy_rows(seq.as_mut(), &toks)?;
            t.push(t0.elapsed().as_secs_f64() * 1e3);
            seq.truncate(n0)?;
        }
        step_ms.push(median(t));
    }
    // A recursive draft step (after the committed catch-up over the prompt).
    let mut ds = m.new_draft_sequence()?;
    m.forward(&mut [SeqStep {
        seq: ds.as_mut(),
        tokens: prompt,
        all_logits: false,
    }])?;
    let mut feed = prompt[1..].to_vec();
    feed.push(prompt[0]);
    m.draft_forward(ds.as_mut(), &feed)?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        m.draft_forward_greedy(ds.as_mut(), &prompt[..1])?;
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let draft_ms = median(t);
    let rates = args
        .draft_rates
        .clone()
        .unwrap_or_else(|| st.per_position_rates());
    let expected: f64 = 1.0 + rates.iter().take(k).sum::<f64>();
    let projected = expected * step_ms[0] / (step_ms[k] + k as f64 * draft_ms);
    if print {
        println!(
            "draft mtp, {k} per round: {tok_s:.1} tok/s ({:.2}x plain {plain_tok_s:.1}); accepted {}/{} ({:.3}), per depth {:?}",
            tok_s / plain_tok_s.max(1e-9),
            st.n_accepted(),
            st.n_drafted(),
            st.acceptance_rate(),
            st.per_position_rates()
                .iter()
                .map(|r| (r * 1000.0).round() / 1000.0)
                .collect::<Vec<_>>()
        );
        println!(
            "  trunk step ms by tokens 1..={}: {:?} (x of 1 token: {:?}); draft step {draft_ms:.3} ms; projected round speed-up at acceptance {:?}: {projected:.2}x",
            k + 1,
            step_ms.iter().map(|v| (v * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
            step_ms.iter().map(|v| (v / step_ms[0] * 100.0).round() / 100.0).collect::<Vec<_>>(),
            rates
        );
    }
    let mut d = st.to_json();
    d["n"] = serde_json::json!(k);
    d["decode_tok_s"] = serde_json::json!(tok_s);
    d["speedup_vs_plain"] = serde_json::json!(tok_s / plain_tok_s.max(1e-9));
    d["step_ms_by_tokens"] = serde_json::json!(step_ms);
    d["draft_step_ms"] = serde_json::json!(draft_ms);
    d["projection_rates"] = serde_json::json!(rates);
    d["projected_speedup"] = serde_json::json!(projected);
    Ok(Some(d))
}
