//! Sampling settings and their seeded random stream, shared by `generate` and `serve`, plus
//! what only the host can do to logits (grammar masks, repeat penalties, log-probabilities).
//!
//! The sampling rules themselves (temperature, top-k, min-p, top-p, inverse CDF) live once, in
//! [`runtime::sampling`]: the model applies them on its device in
//! `LanguageModel::forward_sample`, [`Sampler::sample`] on the host after the engine adjusted
//! the logits. Log-probabilities reported to users are always of the *raw* logits (OpenAI
//! semantics), independent of the sampling filters.

use runtime::sampling::{draw_kept, kept, sample_row, SampleParams, SampleRequest};

/// How to pick the next token. `temperature <= 0` is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the best one's; 0 disables.
    pub min_p: f32,
    /// Seed of the random stream; `None` draws one from the operating system's hasher keys.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (argmax, lowest id on ties).
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Greedy by the rules of [`runtime::sampling`]: `temperature <= 0`, NaN (rather than
    /// poisoning every probability), or `top_k == 1`.
    pub fn is_greedy(&self) -> bool {
        self.filters().is_greedy()
    }

    /// The filters as the model's sampler takes them (the seed stays with [`Sampler`]).
    pub fn filters(&self) -> SampleParams {
        SampleParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
        }
    }

    /// The one range check of sampling settings, for `generate` and `serve` alike (the server
    /// reads its JSON fields with these same [`SamplingRange`]s): NaN and infinities are refused
    /// with the rest.
    pub fn validate(&self) -> Result<(), InvalidSampling> {
        for (range, value) in [
            (TEMPERATURE, self.temperature),
            (TOP_P, self.top_p),
            (MIN_P, self.min_p),
        ] {
            range.check(f64::from(value))?;
        }
        Ok(())
    }
}

/// The accepted values of one sampling setting (OpenAI's ranges).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingRange {
    /// The name of the setting in an OpenAI request.
    pub field: &'static str,
    pub min: f64,
    pub max: f64,
}

impl SamplingRange {
    pub fn check(self, value: f64) -> Result<(), InvalidSampling> {
        if (self.min..=self.max).contains(&value) {
            Ok(())
        } else {
            Err(InvalidSampling { range: self, value })
        }
    }
}

/// 0 is greedy; 2 is OpenAI's maximum (beyond it sampling is close to uniform noise).
pub const TEMPERATURE: SamplingRange = SamplingRange {
    field: "temperature",
    min: 0.0,
    max: 2.0,
};
/// A probability mass: 1 disables the filter.
pub const TOP_P: SamplingRange = SamplingRange {
    field: "top_p",
    min: 0.0,
    max: 1.0,
};
/// A fraction of the best token's probability: 0 disables the filter.
pub const MIN_P: SamplingRange = SamplingRange {
    field: "min_p",
    min: 0.0,
    max: 1.0,
};

/// A sampling setting outside its [`SamplingRange`].
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("'{}' must be between {} and {}, got {value}", range.field, range.min, range.max)]
pub struct InvalidSampling {
    pub range: SamplingRange,
    pub value: f64,
}

/// A seeded sampler; one per generated sequence so that a seed reproduces that sequence alone.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Sampler {
            params,
            rng: Xoshiro256::new(seed),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next uniform number in [0, 1) of this sampler's stream: what a model sampling on the
    /// device (`LanguageModel::forward_sample`) takes in place of [`Sampler::sample`]'s draw.
    pub fn next_uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// This step's request for `LanguageModel::forward_sample`: the filters, the stream's next
    /// uniform number (none is drawn for greedy decoding, which needs none) and the
    /// log-probabilities wanted. [`Sampler::sample`] draws the same numbers, so a seed picks the
    /// same tokens whether the model or the host samples.
    pub fn request(&mut self, logprobs: Option<usize>) -> SampleRequest {
        let params = self.params.filters();
        let u = if params.is_greedy() {
            0.0
        } else {
            self.next_uniform()
        };
        SampleRequest {
            params,
            u,
            logprobs,
        }
    }

    /// Pick the next token id from (adjusted) logits on the host, by the rules of
    /// [`runtime::sampling`], the ones the model's own sampler applies. An empty slice yields 0;
    /// NaN never wins.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let r = self.request(None);
        sample_row(logits, &r.params, r.u)
    }

    /// The distribution [`Sampler::sample`] draws from (the rules of [`runtime::sampling`]:
    /// temperature and filters applied), renormalised, ids ascending; greedy: all mass on the
    /// argmax. Speculative decoding compares the draft's and the model's distributions in this
    /// form, so that its output follows this one.
    pub fn distribution(&self, logits: &[f32]) -> Dist {
        let mut d = kept(logits, &self.params.filters());
        let total: f64 = d.iter().map(|e| e.1).sum();
        for e in &mut d {
            e.1 /= total;
        }
        d.sort_unstable_by_key(|e| e.0);
        Dist(d)
    }

    /// Draw a token from `d` with this sampler's stream (no number is drawn for a single-token
    /// distribution).
    pub fn draw(&mut self, d: &Dist) -> u32 {
        if d.0.len() == 1 {
            return d.0[0].0;
        }
        let u = self.next_uniform();
        draw_kept(&d.0, u)
    }
}

/// A token distribution: `(id, probability)` with ascending ids, probabilities summing to 1.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Dist(pub Vec<(u32, f64)>);

impl Dist {
    /// Probability of `id` (0 outside the support).
    pub fn p(&self, id: u32) -> f64 {
        self.0
            .binary_search_by_key(&id, |e| e.0)
            .map_or(0.0, |i| self.0[i].1)
    }
}

/// A rule restricting which tokens may come next: a grammar (JSON schema, GBNF, Lark, a forced
/// tool call) compiled for the model's vocabulary. One instance per generated sequence; the
/// engine asks for the mask before sampling each token and commits the token it sampled.
pub trait TokenConstraint: Send {
    /// Compute the next mask ahead of [`TokenConstraint::allowed`] (the engine calls it on
    /// another thread while the forward pass runs); constraints with cheap masks need not.
    fn prepare(&mut self) {}
    /// The tokens allowed at the next position as a bit set over the vocabulary (bit `id % 32`
    /// of word `id / 32`; words past the end of the slice allow nothing). `Err` when the
    /// constraint failed (its message is reported to the client).
    fn allowed(&mut self) -> Result<&[u32], String>;
    /// Advance past the sampled token; `Err` when the constraint cannot accept it.
    fn commit(&mut self, id: u32) -> Result<(), String>;
    /// The constraint is complete: nothing more may be generated.
    fn is_finished(&self) -> bool;
}

/// Makes one [`TokenConstraint`] per sequence from a grammar compiled once per request (so
/// `n > 1` choices share the compilation).
pub trait ConstraintSource: Send + Sync {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String>;
}

/// Sets every token not in `mask` (a [`TokenConstraint::allowed`] bit set) to `-inf`. Words
/// that allow everything are skipped, so a mostly open mask costs a pass over the words only.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX && chunk.len() == 32 {
            continue;
        }
        if bits == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (i, x) in chunk.iter_mut().enumerate() {
            if bits & (1 << i) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// llama.cpp's `repeat_penalty` over its `repeat_last_n` window: the last N tokens of the
/// sequence (prompt included, as llama-server feeds the prompt to its sampler) are counted, and
/// the logit of every token in the window is divided by the penalty when positive and
/// multiplied by it otherwise (once per distinct token, whatever its count).
#[derive(Debug, Clone)]
pub struct RepeatWindow {
    penalty: f32,
    last_n: usize,
    ring: std::collections::VecDeque<u32>,
    counts: std::collections::HashMap<u32, u32>,
}

impl RepeatWindow {
    /// `None` when the penalty is disabled (1.0 or an empty window).
    pub fn new(penalty: f32, last_n: usize) -> Option<Self> {
        (penalty != 1.0 && last_n > 0).then(|| RepeatWindow {
            penalty,
            last_n,
            ring: std::collections::VecDeque::with_capacity(last_n),
            counts: std::collections::HashMap::with_capacity(last_n),
        })
    }

    /// One more token of the sequence; the oldest leaves the window when it is full.
    pub fn push(&mut self, id: u32) {
        if self.ring.len() == self.last_n {
            if let Some(old) = self.ring.pop_front() {
                if let Some(c) = self.counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
        self.ring.push_back(id);
        *self.counts.entry(id).or_default() += 1;
    }

    pub fn apply(&self, logits: &mut [f32]) {
        for &id in self.counts.keys() {
            if let Some(x) = logits.get_mut(id as usize) {
                if *x <= 0.0 {
                    *x *= self.penalty;
                } else {
                    *x /= self.penalty;
                }
            }
        }
    }
}

/// Index of the largest logit, lowest index on ties; NaN never wins. 0 for an empty slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if l <= b => {}
            _ => best = Some((i, l)),
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// `log(sum(exp(logits)))` in f64, ignoring NaN. `-inf` when nothing is finite.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    if !max.is_finite() {
        return max as f64;
    }
    let max = max as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    max + sum.ln()
}

/// Natural-log probability of token `id` under the softmax of the raw logits
/// (`-inf` for an id out of range).
pub fn logprob(logits: &[f32], id: u32) -> f32 {
    match logits.get(id as usize) {
        Some(&l) if !l.is_nan() => (l as f64 - log_sum_exp(logits)) as f32,
        _ => f32::NEG_INFINITY,
    }
}

/// The `k` most likely tokens with their natural-log softmax probabilities of the raw logits,
/// most likely first, lowest id among equals.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 || logits.is_empty() {
        return Vec::new();
    }
    let lse = log_sum_exp(logits);
    let mut cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k < cands.len() {
        cands.select_nth_unstable_by(k - 1, order);
        cands.truncate(k);
    }
    cands.sort_unstable_by(order);
    cands
        .into_iter()
        .map(|(i, l)| (i, (l as f64 - lse) as f32))
        .collect()
}

/// A seed from the standard library's per-process random hasher keys: enough for "seed not given"
/// without a dependency on an RNG crate.
fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// xoshiro256** (Blackman & Vigna): small, fast, and good enough for sampling; seeded through
/// SplitMix64 so that nearby seeds give unrelated streams.
#[derive(Debug, Clone)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn new(seed: u64) -> Self {
        let mut sm = seed;
        let mut next = || {
            sm = sm.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = sm;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_refuses_out_of_range_and_non_finite_values() {
        let ok = SamplingParams::default();
        ok.validate().unwrap();
        SamplingParams::greedy().validate().unwrap();
        for (p, field) in [
            (
                SamplingParams {
                    temperature: -1.0,
                    ..ok
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..ok
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..ok
                },
                "temperature",
            ),
            (SamplingParams { top_p: 5.0, ..ok }, "top_p"),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..ok
                },
                "top_p",
            ),
            (SamplingParams { min_p: -0.5, ..ok }, "min_p"),
        ] {
            assert_eq!(p.validate().unwrap_err().range.field, field, "{p:?}");
        }
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed: Some(seed),
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.0, 3.0, 1.0, 3.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, -1.0, -2.0]), 1);
        assert_eq!(s.sample(&[]), 0);
        assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn xoshiro_matches_reference_vector() {
        // Published reference values of the authors' generator seeded with s = {1, 2, 3, 4}
        // (e.g. the test of the C++ port github.com/Quuxplusone/Xoshiro256ss).
        let mut r = Xoshiro256 { s: [1, 2, 3, 4] };
        let got: Vec<u64> = (0..10).map(|_| r.next_u64()).collect();
        let want: [u64; 10] = [
            11520,
            0,
            1509978240,
            1215971899390074240,
            1216172134540287360,
            607988272756665600,
            16172922978634559625,
            8476171486693032832,
            10595114339597558777,
            2904607092377533576,
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn splitmix_seeding_matches_reference_vector() {
        // SplitMix64 from seed 0 gives 0xe220a8397b1dcdaf as its first output (Vigna's splitmix64.c).
        let r = Xoshiro256::new(0);
        assert_eq!(r.s[0], 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, seed));
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.5, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(params(5.0, 1, 1.0, 0.0, 1));
        for _ in 0..100 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn top_k_restricts_support() {
        let logits = [1.0, 0.9, 0.8, 0.7, 0.6];
        let mut s = Sampler::new(params(1.0, 2, 1.0, 0.0, 3));
        for _ in 0..500 {
            assert!(s.sample(&logits) < 2);
        }
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_mass() {
        // probabilities 0.5, 0.3, 0.2 (logits are their logs): top_p 0.7 needs tokens 0 and 1.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(params(1.0, 0, 0.7, 0.0, 11));
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 0 && seen[1] > 0);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // p = 0.6, 0.3, 0.1: min_p 0.25 keeps tokens with p >= 0.15, i.e. 0 and 1.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.25, 5));
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[1] > 0);
    }

    #[test]
    fn sampling_frequencies_follow_softmax() {
        // p = 0.7, 0.2, 0.1. With 20000 draws the binomial standard deviation of a frequency is
        // at most sqrt(0.25/20000) = 0.0035; 0.02 is more than 5 sigma.
        let p = [0.7f32, 0.2, 0.1];
        let logits: Vec<f32> = p.iter().map(|x| x.ln()).collect();
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 1234));
        let n = 20000;
        let mut seen = [0usize; 3];
        for _ in 0..n {
            seen[s.sample(&logits) as usize] += 1;
        }
        for i in 0..3 {
            let f = seen[i] as f32 / n as f32;
            assert!((f - p[i]).abs() < 0.02, "token {i}: {f} vs {}", p[i]);
        }
    }

    #[test]
    fn temperature_sharpens() {
        // At T = 0.5, p ∝ p_raw^2: 0.49 / 0.53 vs 0.04 / 0.53; token 1 share ≈ 0.075.
        let logits = [0.7f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(params(0.5, 0, 1.0, 0.0, 99));
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count();
        let f = ones as f32 / n as f32;
        assert!((f - 0.04 / 0.53).abs() < 0.02, "{f}");
    }

    #[test]
    fn logprobs_are_log_softmax_of_raw_logits() {
        // softmax([ln 0.5, ln 0.25, ln 0.25]) = [0.5, 0.25, 0.25] exactly.
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.25f32.ln()];
        let top = top_logprobs(&logits, 2);
        assert_eq!(top.len(), 2);
        assert_eq!(top[0].0, 0);
        assert_eq!(top[1].0, 1, "ties resolve to the lowest id");
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-6);
        assert!((top[1].1 - 0.25f32.ln()).abs() < 1e-6);
        assert!((logprob(&logits, 2) - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(logprob(&logits, 3), f32::NEG_INFINITY);
        assert_eq!(top_logprobs(&logits, 10).len(), 3);
        assert!(top_logprobs(&logits, 0).is_empty());
    }

    #[test]
    fn mask_bans_exactly_the_unset_bits() {
        // 70 tokens: word 0 allows 0 and 31, word 1 everything, word 2 (tokens 64..70) only 65.
        let mut logits = vec![1.0f32; 70];
        apply_mask(&mut logits, &[1 | 1 << 31, u32::MAX, 1 << 1]);
        for (i, x) in logits.iter().enumerate() {
            let allowed = i == 0 || i == 31 || (32..64).contains(&i) || i == 65;
            assert_eq!(x.is_finite(), allowed, "token {i}");
        }
        // A short mask allows nothing past its end.
        let mut logits = vec![1.0f32; 40];
        apply_mask(&mut logits, &[u32::MAX]);
        assert!(logits[32..].iter().all(|x| *x == f32::NEG_INFINITY));
        assert!(logits[..32].iter().all(|x| *x == 1.0));
    }

    #[test]
    fn repeat_penalty_follows_llama_cpp() {
        // Window of 3: after 5 6 5 7 the window holds 6 5 7 (the first 5 left it).
        let mut w = RepeatWindow::new(2.0, 3).unwrap();
        for t in [5, 6, 5, 7] {
            w.push(t);
        }
        let mut logits = vec![4.0f32; 8];
        logits[6] = -1.0;
        w.apply(&mut logits);
        // Positive logits are divided, negative ones multiplied, once per distinct token.
        assert_eq!(logits[5], 2.0);
        assert_eq!(logits[6], -2.0);
        assert_eq!(logits[7], 2.0);
        assert_eq!(logits[4], 4.0);
        w.push(8);
        w.push(8);
        w.push(8);
        let mut logits = vec![4.0f32; 9];
        w.apply(&mut logits);
        assert_eq!(logits[8], 2.0);
        assert!(logits[..8].iter().all(|x| *x == 4.0), "{logits:?}");
        assert!(RepeatWindow::new(1.0, 64).is_none());
        assert!(RepeatWindow::new(1.1, 0).is_none());
    }

    #[test]
    fn logprobs_stable_for_large_logits() {
        let logits = [1000.0f32, 1000.0];
        assert!((logprob(&logits, 0) - 0.5f32.ln()).abs() < 1e-6);
    }
}
