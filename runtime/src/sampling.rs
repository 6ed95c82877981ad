//! Token sampling inside the model step ([`crate::LanguageModel::forward_sample`]): the rules
//! the CUDA kernel (kernels/cuda/sample.cu) applies on the device, and their host form for the
//! CPU backend and for backends without a device sampler.
//!
//! Order (HF / vLLM): temperature, then top-k, min-p, top-p, then the inverse CDF at the
//! caller's uniform number. Greedy (`temperature <= 0`, NaN, or `top_k == 1`) is the argmax,
//! lowest id among equals, NaN never wins. The host form walks the candidates in sorted order
//! (value descending, id ascending); the device does too whenever the nucleus lies within its
//! 1,024 largest candidates, and otherwise walks the same distribution in id order: the same
//! distribution always, the same id for the same `u` in the first case.

use crate::lm::{local_top, merge_top, TopTokens};

/// The filters of one sequence's sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// <= 0 or NaN: greedy.
    pub temperature: f32,
    /// Keep the `top_k` largest logits; 0: all.
    pub top_k: usize,
    /// Keep the smallest prefix whose mass reaches `top_p` of what is left; >= 1: all.
    pub top_p: f32,
    /// Drop tokens whose tempered probability is below `min_p` times the best one's; outside
    /// (0, 1]: none.
    pub min_p: f32,
}

impl SampleParams {
    pub const GREEDY: SampleParams = SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }
}

/// What one sequence of a [`crate::LanguageModel::forward_sample`] step asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRequest {
    pub params: SampleParams,
    /// The step's uniform number in [0, 1), from the caller's seeded generator.
    pub u: f64,
    /// Also return the sampled token's log-probability and the `k` most likely tokens (of the
    /// raw logits, OpenAI semantics); this copies the logits to the host.
    pub logprobs: Option<usize>,
}

impl SampleRequest {
    /// Greedy, without log-probabilities.
    pub fn greedy() -> Self {
        SampleRequest {
            params: SampleParams::GREEDY,
            u: 0.0,
            logprobs: None,
        }
    }
}

/// One sequence's sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// The row held a NaN or infinite logit (the id is then meaningless).
    pub non_finite: bool,
    /// With [`SampleRequest::logprobs`]: the id's natural-log probability under the raw logits.
    pub logprob: Option<f32>,
    /// With [`SampleRequest::logprobs`] = `Some(k)`: the `k` best tokens, best first.
    pub top: TopTokens,
}

/// The token the rules pick from one row of logits at uniform `u`.
pub fn sample_row(logits: &[f32], p: &SampleParams, u: f64) -> u32 {
    draw_kept(&kept(logits, p), u)
}

/// The candidates the rules keep from one row of logits, in walking order (value descending,
/// id ascending), each with its unnormalised tempered weight (the best one's is 1): what
/// [`sample_row`] draws from, and the filtered distribution speculative decoding compares.
/// Where the answer is fixed (greedy, a row without a finite maximum, an empty row) it is the
/// one token `(argmax or 0, 1.0)`; never empty.
pub fn kept(logits: &[f32], p: &SampleParams) -> Vec<(u32, f64)> {
    let best = || vec![(local_top(logits, 1, 0).top.first().map_or(0, |t| t.0), 1.0)];
    if p.is_greedy() {
        return best();
    }
    let mut cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let Some(mx) = cands.iter().map(|c| c.1).max_by(f32::total_cmp) else {
        return vec![(0, 1.0)];
    };
    if mx == f32::NEG_INFINITY {
        return best();
    }
    let mut k = if p.top_k > 0 && p.top_k < cands.len() {
        p.top_k
    } else {
        cands.len()
    };
    if p.min_p > 0.0 && p.min_p <= 1.0 {
        // The device computes the floor in f32 the same way.
        let floor = mx + p.temperature * p.min_p.ln();
        k = k.min(cands.iter().filter(|c| c.1 >= floor).count().max(1));
    }
    if k < cands.len() {
        cands.select_nth_unstable_by(k - 1, order);
        cands.truncate(k);
    }
    cands.sort_unstable_by(order);
    let t = f64::from(p.temperature);
    let mut w: Vec<(u32, f64)> = cands
        .iter()
        .map(|c| (c.0, ((f64::from(c.1) - f64::from(mx)) / t).exp()))
        .collect();
    if p.top_p < 1.0 {
        let total: f64 = w.iter().map(|x| x.1).sum();
        let lim = f64::from(p.top_p) * total;
        let mut acc = 0.0;
        if let Some(i) = w.iter().position(|x| {
            acc += x.1;
            acc >= lim
        }) {
            w.truncate(i + 1);
        }
    }
    // The device sorts only its DEVICE_SORTED largest candidates and walks a wider
    // distribution in index order (kernels/cuda/sample.cu, step 3); the same order here keeps a
    // seed's tokens the same on both (the distribution is the same either way).
    if w.len() > DEVICE_SORTED {
        w.sort_unstable_by_key(|c| c.0);
    }
    w
}

/// The inverse CDF of weighted candidates ([`kept`]) at uniform `u`, walking them in order.
pub fn draw_kept(w: &[(u32, f64)], u: f64) -> u32 {
    let mass: f64 = w.iter().map(|x| x.1).sum();
    let target = u * mass;
    let mut acc = 0.0;
    for x in w {
        acc += x.1;
        if target < acc {
            return x.0;
        }
    }
    // Rounding can leave the target a hair above the sum: the last kept token.
    w.last().map_or(0, |x| x.0)
}

/// Candidates the device's sampler sorts (SAMPLE_CAND in kernels/cuda/sample.cu).
pub const DEVICE_SORTED: usize = 1024;

/// `Sampled` for each row of `logits` (`[rows, vocab]`, host) given the ids already chosen,
/// with the log-probabilities the requests ask for.
pub fn finish_rows(
    ids: &[(u32, bool)],
    reqs: &[SampleRequest],
    logits: Option<&[f32]>,
    vocab: usize,
) -> Vec<Sampled> {
    ids.iter()
        .zip(reqs)
        .enumerate()
        .map(|(r, (&(id, non_finite), q))| {
            let (logprob, top) = match (q.logprobs, logits) {
                (Some(k), Some(l)) => {
                    let row = &l[r * vocab..(r + 1) * vocab];
                    let lt = local_top(row, k, 0);
                    let lp = row
                        .get(id as usize)
                        .map(|&x| (f64::from(x) - lt.lse) as f32);
                    (lp, merge_top(&[lt], k))
                }
                _ => (None, Vec::new()),
            };
            Sampled {
                id,
                non_finite,
                logprob,
                top,
            }
        })
        .collect()
}

/// The host form for a whole `[rows, vocab]` block: what backends without a device sampler do.
pub fn sample_host(logits: &[f32], vocab: usize, reqs: &[SampleRequest]) -> Vec<(u32, bool)> {
    reqs.iter()
        .enumerate()
        .map(|(r, q)| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let bad = row.iter().any(|x| !x.is_finite());
            (sample_row(row, &q.params, q.u), bad)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SampleParams {
        SampleParams {
            temperature,
            top_k,
            top_p,
            min_p,
        }
    }

    #[test]
    fn greedy_is_argmax_lowest_id_nan_never_wins() {
        let l = [1.0, f32::NAN, 3.0, 3.0, -1.0];
        assert_eq!(sample_row(&l, &SampleParams::GREEDY, 0.5), 2);
        assert_eq!(sample_row(&l, &p(1.0, 1, 1.0, 0.0), 0.99), 2);
        assert_eq!(sample_row(&l, &p(f32::NAN, 0, 1.0, 0.0), 0.99), 2);
    }

    #[test]
    fn inverse_cdf_walks_sorted_candidates() {
        // Weights at T = 1: e^0, e^-ln2, e^-ln4 = 1, 0.5, 0.25 (mass 1.75), sorted ids 1, 0, 2.
        let l = [-(2f32.ln()), 0.0, -(4f32.ln())];
        let q = p(1.0, 0, 1.0, 0.0);
        assert_eq!(sample_row(&l, &q, 0.0), 1);
        assert_eq!(sample_row(&l, &q, 0.56), 1); // 0.98 < 1
        assert_eq!(sample_row(&l, &q, 0.58), 0); // 1.015 in [1, 1.5)
        assert_eq!(sample_row(&l, &q, 0.86), 2); // 1.505 in [1.5, 1.75)
    }

    #[test]
    fn top_k_min_p_and_top_p_cut_in_that_order() {
        let l = [-(2f32.ln()), 0.0, -(4f32.ln())];
        // top_k 2 keeps ids 1, 0: u near 1 picks 0, never 2.
        assert_eq!(sample_row(&l, &p(1.0, 2, 1.0, 0.0), 0.999), 0);
        // min_p 0.3: 0.25 < 0.3 drops id 2, 0.5 stays.
        assert_eq!(sample_row(&l, &p(1.0, 0, 1.0, 0.3), 0.999), 0);
        // min_p 0.6 keeps the best only.
        assert_eq!(sample_row(&l, &p(1.0, 0, 1.0, 0.6), 0.999), 1);
        // top_p 0.5 of 1.75: the first prefix reaching 0.875 is {1}.
        assert_eq!(sample_row(&l, &p(1.0, 0, 0.5, 0.0), 0.999), 1);
        // top_p 0.8 of 1.75 (1.4): {1, 0}.
        assert_eq!(sample_row(&l, &p(1.0, 0, 0.8, 0.0), 0.999), 0);
        // top_p after min_p: min_p 0.3 leaves mass 1.5; top_p 0.6 needs 0.9: {1}.
        assert_eq!(sample_row(&l, &p(1.0, 0, 0.6, 0.3), 0.999), 1);
    }

    #[test]
    fn finish_reports_logprobs_and_non_finite_rows() {
        let l = [0.0f32, 2f32.ln(), f32::NAN, 0.0];
        let reqs = [
            SampleRequest {
                params: SampleParams::GREEDY,
                u: 0.0,
                logprobs: Some(1),
            },
            SampleRequest {
                params: SampleParams::GREEDY,
                u: 0.0,
                logprobs: None,
            },
        ];
        let ids = sample_host(&l, 2, &reqs);
        assert_eq!(ids, vec![(1, false), (1, true)]);
        let s = finish_rows(&ids, &reqs, Some(&l), 2);
        // log(2 / 3) for id 1.
        let want = (2f64 / 3.0).ln() as f32;
        assert!((s[0].logprob.unwrap() - want).abs() < 1e-6);
        assert_eq!(s[0].top.len(), 1);
        assert_eq!(s[0].top[0].0, 1);
        assert_eq!(s[1].logprob, None);
        assert!(s[1].non_finite);
    }

    #[test]
    fn wide_distributions_are_walked_in_index_order_like_the_device() {
        // 5,000 tokens, no top-k/top-p: wider than DEVICE_SORTED, so the inverse CDF runs over
        // the ids in ascending order.
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| ((i * 7919) % 1000) as f32 / 200.0)
            .collect();
        let p = SampleParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        };
        let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits
            .iter()
            .map(|&l| (f64::from(l) - f64::from(mx)).exp())
            .collect();
        let total: f64 = w.iter().sum();
        for u in [0.0, 0.1, 0.37, 0.71, 0.999] {
            let mut acc = 0.0;
            let want = w
                .iter()
                .position(|x| {
                    acc += x;
                    u * total < acc
                })
                .unwrap() as u32;
            assert_eq!(sample_row(&logits, &p, u), want, "u {u}");
        }
    }
}
