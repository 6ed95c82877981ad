//! Speculative decoding with the model's own NextN / MTP draft layer (`generate --draft mtp`,
//! `serve --draft mtp`, `bench --draft mtp`).
//!
//! One round: the draft layer proposes `k` tokens one after another (each from its own
//! distribution `q_i`), the trunk scores the pending token and the `k` drafts in one batched
//! forward (`k + 1` positions, distributions `p_0 .. p_k`), and the drafts are accepted left to
//! right with the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023):
//! draft `d_i` is kept with probability `min(1, p_{i-1}(d_i) / q_i(d_i))`; at the first
//! rejection one token is drawn from `norm(max(0, p_{i-1} - q_i))` and the round ends; when all
//! `k` are kept a bonus token is drawn from `p_k`. The emitted tokens then follow exactly the
//! distribution non-speculative sampling would give (the same temperature and filters are
//! applied to both `p` and `q`, see [`Sampler::distribution`]); with greedy settings both are
//! one-hot, so the output is the non-speculative greedy output token for token.
//! Rejected positions are rolled back in the trunk's and the draft layer's caches; the draft
//! layer then catches up on the accepted positions with the trunk's own hidden states.

use crate::sampler::{Dist, Sampler};
use runtime::{LanguageModel, RuntimeError, SeqStep, SequenceState};

/// Most draft tokens per round.
pub const MAX_DRAFT: usize = 4;

/// Acceptance counters: `per_position[i] = (drafted, accepted)` at draft depth `i + 1`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftStats {
    pub per_position: Vec<(u64, u64)>,
    /// Verification rounds run.
    pub rounds: u64,
}

impl DraftStats {
    pub fn n_drafted(&self) -> u64 {
        self.per_position.iter().map(|p| p.0).sum()
    }
    pub fn n_accepted(&self) -> u64 {
        self.per_position.iter().map(|p| p.1).sum()
    }
    /// Accepted / drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.n_accepted(), self.n_drafted())
    }
    /// The acceptance rate at each draft depth.
    pub fn per_position_rates(&self) -> Vec<f64> {
        self.per_position
            .iter()
            .map(|&(d, a)| ratio(a, d))
            .collect()
    }
    /// What was counted after `before` (an earlier copy of these counters).
    pub fn since(&self, before: &DraftStats) -> DraftStats {
        DraftStats {
            per_position: self
                .per_position
                .iter()
                .enumerate()
                .map(|(i, &(d, a))| {
                    let (d0, a0) = before.per_position.get(i).copied().unwrap_or((0, 0));
                    (d - d0, a - a0)
                })
                .collect(),
            rounds: self.rounds - before.rounds,
        }
    }
    /// Add another sequence's counters.
    pub fn merge(&mut self, o: &DraftStats) {
        if self.per_position.len() < o.per_position.len() {
            self.per_position.resize(o.per_position.len(), (0, 0));
        }
        for (s, p) in self.per_position.iter_mut().zip(&o.per_position) {
            s.0 += p.0;
            s.1 += p.1;
        }
        self.rounds += o.rounds;
    }
    /// `{n_drafted, n_accepted, acceptance_rate, per_position}` (docs/JSON.md).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "n_drafted": self.n_drafted(),
            "n_accepted": self.n_accepted(),
            "acceptance_rate": self.acceptance_rate(),
            "per_position": self.per_position_rates(),
        })
    }
    fn record(&mut self, drafted: usize, accepted: usize) {
        if self.per_position.len() < drafted {
            self.per_position.resize(drafted, (0, 0));
        }
        for (i, p) in self.per_position.iter_mut().take(drafted).enumerate() {
            p.0 += 1;
            p.1 += u64::from(i < accepted);
        }
        self.rounds += 1;
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// One emitted token and the trunk's logits it was chosen from (for logprobs; empty when the
/// round was asked for ids only).
#[derive(Debug, Clone)]
pub struct Emitted {
    pub id: u32,
    pub logits: Vec<f32>,
    /// The trunk row it was chosen from held a NaN or infinite logit.
    pub non_finite: bool,
}

/// The acceptance rule on one round: `p` holds the `k + 1` target distributions, `q` the `k`
/// draft distributions, `drafts` the drafted tokens (each drawn from its `q`). Returns how many
/// drafts are kept and the token that follows them (the residual draw at a rejection, or the
/// bonus draw from `p[k]`). `uniform` yields draws in [0, 1).
pub fn accept(
    p: &[Dist],
    q: &[Dist],
    drafts: &[u32],
    uniform: &mut dyn FnMut() -> f64,
    draw: &mut dyn FnMut(&Dist) -> u32,
) -> (usize, u32) {
    let k = drafts.len();
    debug_assert!(p.len() == k + 1 && q.len() == k);
    for i in 0..k {
        let d = drafts[i];
        let (pd, qd) = (p[i].p(d), q[i].p(d));
        // q(d) > 0 for a token drawn from q; p(d) = 0 rejects without a draw, so a one-hot p
        // (greedy) keeps exactly its argmax and consumes no randomness.
        let keep = pd >= qd || (pd > 0.0 && uniform() < pd / qd);
        if !keep {
            return (i, draw(&residual(&p[i], &q[i])));
        }
    }
    (k, draw(&p[k]))
}

/// `norm(max(0, p - q))`; `p` itself when that has no mass (p = q up to rounding).
pub fn residual(p: &Dist, q: &Dist) -> Dist {
    let mut r: Vec<(u32, f64)> =
        p.0.iter()
            .map(|&(id, pp)| (id, (pp - q.p(id)).max(0.0)))
            .filter(|e| e.1 > 0.0)
            .collect();
    let total: f64 = r.iter().map(|e| e.1).sum();
    if !(total > 0.0 && total.is_finite()) {
        return p.clone();
    }
    for e in &mut r {
        e.1 /= total;
    }
    Dist(r)
}

/// The speculative state of one sequence (the sequence state itself lives with its owner, the
/// engine's slot or a [`SpecSequence`]): drafts per round, the tokens the draft layer has to
/// catch up on, the counters.
#[derive(Debug, Clone)]
pub struct Drafter {
    k: usize,
    /// Tokens the draft layer has to catch up on before it drafts (one per pending trunk state).
    catch_up: Vec<u32>,
    pub stats: DraftStats,
}

impl Drafter {
    /// Drafting `k` tokens per round (1 ..= [`MAX_DRAFT`]).
    pub fn new(k: usize) -> Result<Self, RuntimeError> {
        if !(1..=MAX_DRAFT).contains(&k) {
            return Err(RuntimeError::Backend(format!(
                "draft tokens per round must be 1..={MAX_DRAFT}, not {k}"
            )));
        }
        Ok(Drafter {
            k,
            catch_up: Vec::new(),
            stats: DraftStats::default(),
        })
    }

    /// The prompt went through the trunk (in one or several steps) of a sequence from
    /// [`LanguageModel::new_draft_sequence`].
    pub fn prefilled(&mut self, prompt: &[u32]) {
        // The draft layer pairs prompt position i with token i + 1; the last pairs with the
        // first generated token, supplied by `round`.
        self.catch_up = prompt.get(1..).unwrap_or_default().to_vec();
    }

    /// One round on `seq` after token `last` was chosen (and emitted): draft up to `k` tokens
    /// (fewer when only `max_new` more tokens are wanted), verify them with the trunk, and
    /// return the tokens that follow `last` (1 ..= k + 1 of them), each with the trunk logits it
    /// was chosen from when `want_logits` (for log-probabilities). `last` is fed to the trunk
    /// here.
    pub fn round(
        &mut self,
        lm: &dyn LanguageModel,
        seq: &mut dyn SequenceState,
        sampler: &mut Sampler,
        last: u32,
        max_new: usize,
        want_logits: bool,
    ) -> Result<Vec<Emitted>, RuntimeError> {
        let n0 = seq.len();
        // Room in the context for `last` and the drafts.
        let room = lm.context_length().saturating_sub(n0 + 1);
        let k = self.k.min(max_new.saturating_sub(1)).min(room);
        if sampler.params().is_greedy() && !want_logits {
            return self.round_greedy(lm, seq, last, k, n0);
        }
        let mut drafts = Vec::with_capacity(k);
        let mut q = Vec::with_capacity(k);
        if k > 0 {
            let mut feed = std::mem::take(&mut self.catch_up);
            feed.push(last);
            let mut logits = lm.draft_forward(seq, &feed)?;
            for i in 0..k {
                let qd = sampler.distribution(&logits);
                let d = sampler.draw(&qd);
                drafts.push(d);
                q.push(qd);
                if i + 1 < k {
                    logits = lm.draft_forward(seq, &[d])?;
                }
            }
        } else {
            // No draft this round: the draft layer still owes rows for these positions.
            self.catch_up.push(last);
        }
        let mut tokens = Vec::with_capacity(k + 1);
        tokens.push(last);
        tokens.extend_from_slice(&drafts);
        let logits = trunk(lm, seq, &tokens, true)?;
        let vocab = lm.vocab_size();
        let flat = logits
            .into_iter()
            .next()
            .filter(|l| l.len() == tokens.len() * vocab)
            .ok_or_else(|| RuntimeError::Backend("verification returned no logits".into()))?;
        let rows: Vec<&[f32]> = flat.chunks(vocab).collect();
        let p: Vec<Dist> = rows.iter().map(|r| sampler.distribution(r)).collect();
        let (n_acc, next) = {
            let s = std::cell::RefCell::new(&mut *sampler);
            accept(
                &p,
                &q,
                &drafts,
                &mut || s.borrow_mut().next_uniform(),
                &mut |d| s.borrow_mut().draw(d),
            )
        };
        if k > 0 {
            self.stats.record(k, n_acc);
            // Keep `last` and the accepted drafts; the rest of the trunk's rows go.
            seq.truncate(n0 + 1 + n_acc)?;
            self.catch_up = drafts[..n_acc].to_vec();
        }
        let mut out: Vec<Emitted> = drafts[..n_acc]
            .iter()
            .zip(&rows)
            .map(|(&id, r)| Emitted {
                id,
                logits: r.to_vec(),
                non_finite: false,
            })
            .collect();
        out.push(Emitted {
            id: next,
            logits: rows[n_acc].to_vec(),
            non_finite: false,
        });
        for e in &mut out {
            e.non_finite = runtime::numerics::first_non_finite(&e.logits).is_some();
        }
        Ok(out)
    }

    /// [`Drafter::round`] under greedy sampling without log-probabilities: drafts and trunk
    /// rows are picked where the logits are (on a GPU only ids come back), and a draft is kept
    /// exactly when it is the trunk's own greedy pick (what [`accept`] does with one-hot
    /// distributions).
    fn round_greedy(
        &mut self,
        lm: &dyn LanguageModel,
        seq: &mut dyn SequenceState,
        last: u32,
        k: usize,
        n0: usize,
    ) -> Result<Vec<Emitted>, RuntimeError> {
        let mut drafts = Vec::with_capacity(k);
        if k > 0 {
            let mut feed = std::mem::take(&mut self.catch_up);
            feed.push(last);
            let mut d = lm.draft_forward_greedy(seq, &feed)?.id;
            drafts.push(d);
            while drafts.len() < k {
                d = lm.draft_forward_greedy(seq, &[d])?.id;
                drafts.push(d);
            }
        } else {
            self.catch_up.push(last);
        }
        let mut tokens = Vec::with_capacity(k + 1);
        tokens.push(last);
        tokens.extend_from_slice(&drafts);
        let rows = lm.forward_greedy_rows(seq, &tokens)?;
        if rows.len() != tokens.len() {
            return Err(RuntimeError::Backend(format!(
                "verification returned {} rows for {} tokens",
                rows.len(),
                tokens.len()
            )));
        }
        let n_acc = drafts
            .iter()
            .zip(&rows)
            .take_while(|(d, r)| **d == r.id)
            .count();
        if k > 0 {
            self.stats.record(k, n_acc);
            seq.truncate(n0 + 1 + n_acc)?;
            self.catch_up = drafts[..n_acc].to_vec();
        }
        Ok(rows[..=n_acc]
            .iter()
            .map(|r| Emitted {
                id: r.id,
                logits: Vec::new(),
                non_finite: r.non_finite,
            })
            .collect())
    }
}

/// A sequence decoded speculatively from start to end (`generate`, `bench`): its drafting
/// sequence state and its [`Drafter`].
pub struct SpecSequence {
    seq: Box<dyn SequenceState>,
    drafter: Drafter,
    pub stats: DraftStats,
}

impl SpecSequence {
    /// A new sequence drafting `k` tokens per round (1 ..= [`MAX_DRAFT`]); fails with
    /// [`RuntimeError::NoDraftLayer`] for a model without one.
    pub fn new(lm: &dyn LanguageModel, k: usize) -> Result<Self, RuntimeError> {
        let drafter = Drafter::new(k)?;
        Ok(SpecSequence {
            seq: lm.new_draft_sequence()?,
            drafter,
            stats: DraftStats::default(),
        })
    }

    /// Tokens in the trunk's cache.
    pub fn len(&self) -> usize {
        self.seq.len()
    }
    pub fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }

    /// Run the prompt through the trunk; returns the logits of the first token to generate.
    pub fn prefill(
        &mut self,
        lm: &dyn LanguageModel,
        prompt: &[u32],
    ) -> Result<Vec<f32>, RuntimeError> {
        let l = trunk(lm, self.seq.as_mut(), prompt, false)?;
        self.drafter.prefilled(prompt);
        l.into_iter()
            .next()
            .ok_or_else(|| RuntimeError::Backend("the model returned no logits".into()))
    }

    /// [`Drafter::round`] on this sequence.
    pub fn step(
        &mut self,
        lm: &dyn LanguageModel,
        sampler: &mut Sampler,
        last: u32,
        max_new: usize,
        want_logits: bool,
    ) -> Result<Vec<Emitted>, RuntimeError> {
        let r = self
            .drafter
            .round(lm, self.seq.as_mut(), sampler, last, max_new, want_logits);
        self.stats = self.drafter.stats.clone();
        r
    }
}

fn trunk(
    lm: &dyn LanguageModel,
    seq: &mut dyn SequenceState,
    tokens: &[u32],
    all_logits: bool,
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    lm.forward(&mut [SeqStep {
        seq,
        tokens,
        all_logits,
    }])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    fn dist(p: &[f64]) -> Dist {
        Dist(p.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect())
    }

    /// Pearson's statistic of `counts` against probabilities `p`.
    fn chi2(counts: &[u64], p: &Dist) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let e = n as f64 * p.p(i as u32);
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The emitted tokens follow the target distributions, whatever the drafts' distributions:
    /// a context-free synthetic "model" (the same p_i and q_i whatever came before), two drafts
    /// per round. The first emitted token must follow p_0 and, when a second one is emitted
    /// (the first draft kept), that one p_1. Pearson's chi-square over 5 tokens has 4 degrees of
    /// freedom; its 1e-6 upper quantile is 33.38. Drafts drawn and accepted with `q` in place of
    /// `p` (no correction) give statistics in the thousands here.
    #[test]
    fn speculative_sampling_preserves_the_target_distribution() {
        let p = [
            dist(&[0.1, 0.4, 0.2, 0.25, 0.05]),
            dist(&[0.3, 0.05, 0.05, 0.3, 0.3]),
            dist(&[0.2, 0.2, 0.2, 0.2, 0.2]),
        ];
        let q = [
            dist(&[0.5, 0.1, 0.3, 0.05, 0.05]),
            dist(&[0.05, 0.6, 0.05, 0.1, 0.2]),
        ];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::default()
        });
        let (mut first, mut second) = ([0u64; 5], [0u64; 5]);
        let mut accepted = 0u64;
        let trials = 200_000;
        for _ in 0..trials {
            let drafts = [s.draw(&q[0]), s.draw(&q[1])];
            let cell = std::cell::RefCell::new(&mut s);
            let (a, next) = accept(
                &p,
                &q,
                &drafts,
                &mut || cell.borrow_mut().next_uniform(),
                &mut |d| cell.borrow_mut().draw(d),
            );
            let mut out = drafts[..a].to_vec();
            out.push(next);
            first[out[0] as usize] += 1;
            if out.len() > 1 {
                second[out[1] as usize] += 1;
            }
            accepted += a.min(1) as u64;
        }
        let (c1, c2) = (chi2(&first, &p[0]), chi2(&second, &p[1]));
        assert!(c1 < 33.38, "first token chi-square {c1}: {first:?}");
        assert!(c2 < 33.38, "second token chi-square {c2}: {second:?}");
        // The first draft is kept with probability sum(min(p_0, q_0)) = 0.5 here; 5 standard
        // deviations of the binomial count are 5 * sqrt(n 0.5 0.5) = 1118.
        let want = 0.5 * trials as f64;
        assert!(
            (accepted as f64 - want).abs() < 1118.0,
            "first drafts kept {accepted}, expected {want}"
        );
    }

    #[test]
    fn greedy_acceptance_keeps_exactly_the_matching_prefix() {
        let one = |i: u32| Dist(vec![(i, 1.0)]);
        let p = [one(3), one(5), one(9), one(2)];
        let q = [one(3), one(5), one(1)];
        let mut u = || panic!("greedy acceptance never draws");
        let mut draw = |d: &Dist| d.0[0].0;
        assert_eq!(accept(&p, &q, &[3, 5, 1], &mut u, &mut draw), (2, 9));
        let q = [one(3), one(5), one(9)];
        assert_eq!(accept(&p, &q, &[3, 5, 9], &mut u, &mut draw), (3, 2));
        let q = [one(4), one(5), one(9)];
        assert_eq!(accept(&p, &q, &[4, 5, 9], &mut u, &mut draw), (0, 3));
    }

    #[test]
    fn stats_report_rates_per_depth() {
        let mut s = DraftStats::default();
        s.record(3, 3);
        s.record(3, 1);
        s.record(2, 0);
        assert_eq!(s.per_position, vec![(3, 2), (3, 1), (2, 1)]);
        assert_eq!((s.n_drafted(), s.n_accepted()), (8, 4));
        assert_eq!(s.acceptance_rate(), 0.5);
        let j = s.to_json();
        assert_eq!(j["per_position"][0], serde_json::json!(2.0 / 3.0));
    }
}
