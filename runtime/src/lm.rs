//! The one interface between a loaded model (any backend) and its users: `generate`, the engine
//! and the server. Object-safe so the server can hold a CPU or a CUDA model alike.

use crate::sampling::{finish_rows, sample_host, SampleRequest, Sampled};
use crate::tp::TpReport;
use crate::RuntimeError;
use std::any::Any;

/// A sequence's most likely next tokens with their natural-log softmax probabilities, best first,
/// lowest id among equals.
pub type TopTokens = Vec<(u32, f32)>;

/// Per-sequence state owned by the model (KV cache: latent + rope part + indexer keys).
pub trait SequenceState: Send {
    /// Tokens already in the cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of cache memory this sequence holds (for metrics).
    fn cache_bytes(&self) -> usize;
    /// Roll the sequence back to its first `len` tokens (rejected speculative tokens): the
    /// trunk's cache and, for a drafting sequence, the draft layer's rows past its committed
    /// ones. Calling a step afterwards continues from `len`.
    fn truncate(&mut self, len: usize) -> Result<(), RuntimeError> {
        let _ = len;
        Err(RuntimeError::Backend(
            "this sequence state cannot be rolled back".into(),
        ))
    }
    /// Size the cache for `tokens` tokens in all up front, so decoding up to there never
    /// reallocates or copies it (what a GPU decode step needs to stay allocation-free). A hint:
    /// the default, and the CPU, grow as they go.
    fn reserve(&mut self, _tokens: usize) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Backends downcast to their own cache type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// One sequence's part of a batched forward step.
pub struct SeqStep<'a> {
    pub seq: &'a mut dyn SequenceState,
    /// Tokens appended to the sequence in this step (the whole prompt, or one decoded token).
    pub tokens: &'a [u32],
    /// Return logits for every appended token (prompt logprobs / echo) instead of the last only.
    pub all_logits: bool,
}

/// A loaded causal language model.
pub trait LanguageModel: Send + Sync {
    fn new_sequence(&self) -> Box<dyn SequenceState>;
    fn vocab_size(&self) -> usize;
    /// Longest sequence (prompt + generated) the model accepts.
    fn context_length(&self) -> usize;
    /// Append each step's tokens to its sequence and return its logits, row-major
    /// (`tokens.len() * vocab` values when `all_logits`, else `vocab` values for the last token).
    /// Sequences in one call share the weight reads (continuous batching).
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError>;

    /// [`LanguageModel::forward`] for steps that want the last position only, returning each
    /// sequence's `k` most likely next tokens instead of its logits: all greedy decoding needs.
    /// A tensor-parallel model merges its ranks' candidates here instead of gathering the whole
    /// vocabulary.
    fn forward_top_k(
        &self,
        batch: &mut [SeqStep<'_>],
        k: usize,
    ) -> Result<Vec<TopTokens>, RuntimeError> {
        last_positions_only(batch)?;
        Ok(self
            .forward(batch)?
            .iter()
            .map(|l| merge_top(&[local_top(l, k, 0)], k))
            .collect())
    }

    /// NextN / multi-token-prediction draft layers the model can run (0: none).
    fn draft_layers(&self) -> usize {
        0
    }

    /// A sequence for speculative decoding: its trunk steps also keep the hidden states
    /// (after `output_norm`) that [`LanguageModel::draft_forward`] consumes.
    fn new_draft_sequence(&self) -> Result<Box<dyn SequenceState>, RuntimeError> {
        Err(RuntimeError::NoDraftLayer)
    }

    /// One step of the draft layer on a sequence from [`LanguageModel::new_draft_sequence`],
    /// returning the logits (whole vocabulary) of its last row: the draft distribution of the
    /// token two positions past that row.
    ///
    /// With trunk hidden states pending (after a trunk step), `tokens` must hold one token per
    /// pending state, the token that followed it (the last is the token the trunk has just
    /// produced and not yet been fed): those rows become committed draft rows. With none
    /// pending, `tokens` is the one token drafted last, and the row is built from the draft
    /// layer's own previous output (recursive drafting); such rows are dropped by the next
    /// [`SequenceState::truncate`].
    fn draft_forward(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Vec<f32>, RuntimeError> {
        let _ = (seq, tokens);
        Err(RuntimeError::NoDraftLayer)
    }

    /// Append `tokens` to `seq` and return the greedy choice after every one of them (the
    /// largest logit, lowest id among equals, with whether the row held a non-finite logit):
    /// the verification step of greedy speculative decoding. A GPU model picks on the device
    /// and copies back only the ids; the default copies every row's logits to the host.
    fn forward_greedy_rows(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Vec<Sampled>, RuntimeError> {
        let logits = self.forward(&mut [SeqStep {
            seq,
            tokens,
            all_logits: true,
        }])?;
        greedy_rows_host(logits.into_iter().next(), tokens.len(), self.vocab_size())
    }

    /// [`LanguageModel::draft_forward`] followed by the greedy choice on its logits (greedy
    /// drafting): only the id comes back from a GPU model.
    fn draft_forward_greedy(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Sampled, RuntimeError> {
        let logits = self.draft_forward(seq, tokens)?;
        greedy_rows_host(Some(logits), 1, self.vocab_size())?
            .pop()
            .ok_or_else(|| RuntimeError::Backend("draft step returned no logits".into()))
    }

    /// [`LanguageModel::forward`] for steps that want the last position only, returning each
    /// sequence's sampled token (`reqs[i]` for `batch[i]`, rules of [`crate::sampling`]): what
    /// `generate` and the server need per decode step. A GPU model samples on the device and
    /// copies the ids back, the logits only for requests that want log-probabilities. The
    /// default samples on the host; when every request is greedy it goes through
    /// [`LanguageModel::forward_top_k`] (a tensor-parallel model merges its ranks' candidates).
    fn forward_sample(
        &self,
        batch: &mut [SeqStep<'_>],
        reqs: &[SampleRequest],
    ) -> Result<Vec<Sampled>, RuntimeError> {
        check_requests(batch, reqs)?;
        if reqs.iter().all(|r| r.params.is_greedy()) {
            let k = reqs.iter().filter_map(|r| r.logprobs).max().unwrap_or(0);
            let tops = self.forward_top_k(batch, k.max(1))?;
            return Ok(tops
                .into_iter()
                .zip(reqs)
                .map(|(t, r)| {
                    let first = t.first().copied();
                    Sampled {
                        id: first.map_or(0, |f| f.0),
                        // No finite candidate, or a NaN/inf log-sum-exp: a non-finite row.
                        non_finite: first.is_none_or(|f| !f.1.is_finite()),
                        logprob: r.logprobs.and(first.map(|f| f.1)),
                        top: t.into_iter().take(r.logprobs.unwrap_or(0)).collect(),
                    }
                })
                .collect());
        }
        let logits = self.forward(batch)?;
        let v = self.vocab_size();
        logits
            .iter()
            .zip(reqs)
            .map(|(l, r)| {
                if l.len() != v {
                    return Err(RuntimeError::Backend(format!(
                        "forward_sample: {} logits for a vocabulary of {v}",
                        l.len()
                    )));
                }
                let one = std::slice::from_ref(r);
                Ok(finish_rows(&sample_host(l, v, one), one, Some(l), v).remove(0))
            })
            .collect()
    }

    /// How the model is split over tensor-parallel ranks; `None` on a single device.
    fn tp_report(&self) -> Option<TpReport> {
        None
    }

    /// Tokens of KV cache all sequences together may hold, when the device memory bounds it
    /// (sized from the memory left after the weights); `None`: only host memory bounds it.
    fn cache_capacity_tokens(&self) -> Option<usize> {
        None
    }
}

/// Greedy picks of `rows` rows of host logits (`[rows, vocab]`).
pub(crate) fn greedy_rows_host(
    logits: Option<Vec<f32>>,
    rows: usize,
    vocab: usize,
) -> Result<Vec<Sampled>, RuntimeError> {
    let flat = logits.filter(|l| l.len() == rows * vocab).ok_or_else(|| {
        RuntimeError::Backend(format!(
            "greedy rows: expected {rows} rows of {vocab} logits"
        ))
    })?;
    let reqs = vec![SampleRequest::greedy(); rows];
    let ids = sample_host(&flat, vocab, &reqs);
    Ok(finish_rows(&ids, &reqs, None, vocab))
}

/// `forward_top_k` answers for the last position of each step only.
pub(crate) fn last_positions_only(batch: &[SeqStep<'_>]) -> Result<(), RuntimeError> {
    if batch.iter().any(|s| s.all_logits) {
        return Err(RuntimeError::Backend(
            "forward_top_k: steps that want every position's logits need forward".into(),
        ));
    }
    Ok(())
}

/// `forward_sample` answers for the last position of each step, one request per step.
pub(crate) fn check_requests(
    batch: &[SeqStep<'_>],
    reqs: &[SampleRequest],
) -> Result<(), RuntimeError> {
    last_positions_only(batch)?;
    if reqs.len() != batch.len() {
        return Err(RuntimeError::Backend(format!(
            "forward_sample: {} requests for {} sequences",
            reqs.len(),
            batch.len()
        )));
    }
    Ok(())
}

/// The best `k` entries of one vocabulary slice (ids from `id0`) as raw logits, and the slice's
/// `log(sum(exp))` in f64: what one rank contributes to a merged top-k. A NaN logit is never a
/// candidate but makes `lse` NaN, so every merged log-probability is NaN and callers that check
/// for non-finite values see the broken step (greedy decoding never gathers the logits).
#[derive(Debug, Clone, PartialEq)]
pub struct LocalTop {
    pub top: Vec<(u32, f32)>,
    pub lse: f64,
}

/// Order of candidates: larger logit first, lower id among equals (greedy's tie rule).
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The `k` best of `logits` (ids `id0 ..`) and their log-sum-exp.
pub fn local_top(logits: &[f32], k: usize, id0: u32) -> LocalTop {
    let max = logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let lse = if logits.iter().any(|l| l.is_nan()) {
        f64::NAN
    } else if max.is_finite() {
        let m = max as f64;
        m + logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| (l as f64 - m).exp())
            .sum::<f64>()
            .ln()
    } else {
        max as f64
    };
    let mut c: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (id0 + i as u32, l))
        .collect();
    if k < c.len() && k > 0 {
        c.select_nth_unstable_by(k - 1, by_logit);
    }
    c.truncate(k);
    c.sort_unstable_by(by_logit);
    LocalTop { top: c, lse }
}

/// The `k` best over all slices with log-probabilities under the softmax of the whole vocabulary:
/// `log(sum(exp))` of the whole is combined from the slices' (exact up to f64 rounding).
pub fn merge_top(parts: &[LocalTop], k: usize) -> TopTokens {
    let m = parts
        .iter()
        .map(|p| p.lse)
        .fold(f64::NEG_INFINITY, f64::max);
    let lse = if parts.iter().any(|p| p.lse.is_nan()) {
        f64::NAN
    } else if m.is_finite() {
        m + parts.iter().map(|p| (p.lse - m).exp()).sum::<f64>().ln()
    } else {
        m
    };
    let mut all: Vec<(u32, f32)> = parts.iter().flat_map(|p| p.top.iter().copied()).collect();
    all.sort_unstable_by(by_logit);
    all.truncate(k);
    all.into_iter()
        .map(|(i, l)| (i, (l as f64 - lse) as f32))
        .collect()
}
