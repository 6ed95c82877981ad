//! Counters, gauges and histograms of the engine and the HTTP layer, rendered in the Prometheus
//! text exposition format. Names follow vLLM's and llama-server's so existing dashboards find
//! the usual series (`vllm:num_requests_waiting`, `llamacpp:kv_cache_usage_ratio`, ...).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds (seconds or counts).
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Debug, Default, Clone)]
struct HistInner {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            inner: Mutex::new(HistInner {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let mut h = lock(&self.inner);
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            h.counts[i] += 1;
        }
        h.sum += v;
        h.count += 1;
    }

    /// Number of observations so far.
    pub fn count(&self) -> u64 {
        lock(&self.inner).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = lock(&self.inner).clone();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (b, c) in self.bounds.iter().zip(&h.counts) {
            acc += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {acc}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

/// A poisoned lock only means another thread panicked while counting; the numbers stay usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const REQUEST_BOUNDS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0,
];
const BATCH_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

/// Everything `/metrics` reports. The engine thread and the HTTP handlers update it concurrently.
#[derive(Debug)]
pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Seconds spent in forward passes, split by what the step did (prefill-only steps vs others).
    prompt_micros: AtomicU64,
    decode_micros: AtomicU64,
    pub requests_waiting: AtomicU64,
    pub requests_running: AtomicU64,
    pub kv_cache_tokens: AtomicU64,
    pub kv_cache_bytes: AtomicU64,
    /// Token capacity the usage ratio is measured against (running slots x context length).
    pub kv_cache_capacity_tokens: AtomicU64,
    pub steps: AtomicU64,
    finished: Mutex<BTreeMap<&'static str, u64>>,
    rejected: Mutex<BTreeMap<&'static str, u64>>,
    http: Mutex<BTreeMap<(String, u16), u64>>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_latency: Histogram,
    pub queue_time: Histogram,
    pub step_tokens: Histogram,
    /// Added as a `model_name` label to every series (vLLM's convention), once a model is set.
    model_name: std::sync::OnceLock<String>,
    /// KV bytes per cached token, as last measured on running sequences (f64 bits; 0: never).
    kv_bytes_per_token_bits: AtomicU64,
    /// Speculative decoding counters over all sequences (`serve --draft mtp`).
    draft: Mutex<crate::speculative::DraftStats>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prompt_micros: AtomicU64::new(0),
            decode_micros: AtomicU64::new(0),
            requests_waiting: AtomicU64::new(0),
            requests_running: AtomicU64::new(0),
            kv_cache_tokens: AtomicU64::new(0),
            kv_cache_bytes: AtomicU64::new(0),
            kv_cache_capacity_tokens: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            finished: Mutex::new(BTreeMap::new()),
            rejected: Mutex::new(BTreeMap::new()),
            http: Mutex::new(BTreeMap::new()),
            time_to_first_token: Histogram::new(LATENCY_BOUNDS),
            inter_token_latency: Histogram::new(LATENCY_BOUNDS),
            request_latency: Histogram::new(REQUEST_BOUNDS),
            queue_time: Histogram::new(REQUEST_BOUNDS),
            step_tokens: Histogram::new(BATCH_BOUNDS),
            model_name: std::sync::OnceLock::new(),
            kv_bytes_per_token_bits: AtomicU64::new(0),
            draft: Mutex::new(Default::default()),
        }
    }
}

impl Metrics {
    /// A request left the engine: `stop`, `length`, `cancelled` or `error`.
    pub fn record_finished(&self, reason: &'static str) {
        *lock(&self.finished).entry(reason).or_default() += 1;
    }

    /// A request was refused before it ran: `queue_full`, `invalid`, ...
    pub fn record_rejected(&self, reason: &'static str) {
        *lock(&self.rejected).entry(reason).or_default() += 1;
    }

    /// One HTTP response, by route and status code.
    pub fn record_http(&self, route: &str, status: u16) {
        *lock(&self.http)
            .entry((route.to_string(), status))
            .or_default() += 1;
    }

    pub fn record_step(&self, tokens: usize, prefill_only: bool, micros: u64) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.step_tokens.observe(tokens as f64);
        let c = if prefill_only {
            &self.prompt_micros
        } else {
            &self.decode_micros
        };
        c.fetch_add(micros, Ordering::Relaxed);
    }

    /// Add one speculative round's counters.
    pub fn record_draft(&self, d: &crate::speculative::DraftStats) {
        lock(&self.draft).merge(d);
    }

    /// The speculative decoding counters so far.
    pub fn draft(&self) -> crate::speculative::DraftStats {
        lock(&self.draft).clone()
    }

    /// The served model's id, labelled on every series from now on (set once; later calls are
    /// ignored, as one server serves one model).
    pub fn set_model_name(&self, name: &str) {
        let _ = self.model_name.set(name.to_string());
    }

    /// The cache held by running sequences: updates the gauges and the per-token measurement.
    pub fn record_kv(&self, tokens: u64, bytes: u64) {
        self.kv_cache_tokens.store(tokens, Ordering::Relaxed);
        self.kv_cache_bytes.store(bytes, Ordering::Relaxed);
        if tokens > 0 {
            let per = bytes as f64 / tokens as f64;
            self.kv_bytes_per_token_bits
                .store(per.to_bits(), Ordering::Relaxed);
        }
    }

    /// KV cache bytes per token, measured on the last running sequences (`None` before any).
    pub fn kv_bytes_per_token(&self) -> Option<f64> {
        let b = self.kv_bytes_per_token_bits.load(Ordering::Relaxed);
        (b != 0).then(|| f64::from_bits(b))
    }

    pub fn finished_count(&self, reason: &str) -> u64 {
        lock(&self.finished).get(reason).copied().unwrap_or(0)
    }

    /// Prometheus text exposition (version 0.0.4).
    pub fn render(&self) -> String {
        let o = self.render_unlabelled();
        match self.model_name.get() {
            Some(name) => with_label(&o, "model_name", name),
            None => o,
        }
    }

    fn render_unlabelled(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut o = String::with_capacity(8192);
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let prompt = g(&self.prompt_tokens);
        let gen = g(&self.generation_tokens);
        let waiting = g(&self.requests_waiting);
        let running = g(&self.requests_running);
        let kv_tokens = g(&self.kv_cache_tokens);
        let cap = g(&self.kv_cache_capacity_tokens);
        let usage = if cap == 0 {
            0.0
        } else {
            kv_tokens as f64 / cap as f64
        };
        let prompt_s = g(&self.prompt_micros) as f64 / 1e6;
        let decode_s = g(&self.decode_micros) as f64 / 1e6;
        one(
            "gguftool_prompt_tokens_total",
            "counter",
            "Prompt tokens processed.",
            prompt.to_string(),
        );
        one(
            "gguftool_generation_tokens_total",
            "counter",
            "Tokens generated.",
            gen.to_string(),
        );
        one(
            "gguftool_num_requests_waiting",
            "gauge",
            "Requests in the queue, not yet running.",
            waiting.to_string(),
        );
        one(
            "gguftool_num_requests_running",
            "gauge",
            "Requests in the running batch.",
            running.to_string(),
        );
        one(
            "gguftool_kv_cache_tokens",
            "gauge",
            "Tokens held in the KV cache of running sequences.",
            kv_tokens.to_string(),
        );
        one(
            "gguftool_kv_cache_bytes",
            "gauge",
            "Bytes of KV cache held by running sequences.",
            g(&self.kv_cache_bytes).to_string(),
        );
        one(
            "gguftool_kv_cache_usage_ratio",
            "gauge",
            "KV cache tokens in use / (parallel slots x context length).",
            usage.to_string(),
        );
        one(
            "gguftool_engine_steps_total",
            "counter",
            "Batched forward passes run.",
            g(&self.steps).to_string(),
        );
        one(
            "gguftool_prompt_seconds_total",
            "counter",
            "Seconds in forward passes that only processed prompts.",
            prompt_s.to_string(),
        );
        one(
            "gguftool_decode_seconds_total",
            "counter",
            "Seconds in forward passes that generated tokens.",
            decode_s.to_string(),
        );
        // Speculative decoding (vLLM's spec_decode series): drafted and accepted tokens, overall
        // and per draft depth (a draft counts as accepted only when all before it were).
        let d = lock(&self.draft).clone();
        one(
            "gguftool_spec_decode_num_drafts_total",
            "counter",
            "Speculative rounds (draft + verification) run.",
            d.rounds.to_string(),
        );
        one(
            "gguftool_spec_decode_num_draft_tokens_total",
            "counter",
            "Tokens proposed by the draft (MTP) layer.",
            d.n_drafted().to_string(),
        );
        one(
            "gguftool_spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted by the verification step.",
            d.n_accepted().to_string(),
        );
        one(
            "gguftool_spec_decode_acceptance_rate",
            "gauge",
            "Accepted / drafted tokens since start (0 when nothing was drafted).",
            d.acceptance_rate().to_string(),
        );
        let per_pos = |o: &mut String, name: &str, help: &str, v: &dyn Fn(&(u64, u64)) -> u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for (i, p) in d.per_position.iter().enumerate() {
                let _ = writeln!(o, "{name}{{position=\"{}\"}} {}", i + 1, v(p));
            }
        };
        per_pos(
            &mut o,
            "gguftool_spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by draft depth (1 = first).",
            &|p| p.1,
        );
        per_pos(
            &mut o,
            "gguftool_spec_decode_num_draft_tokens_per_pos_total",
            "Draft tokens proposed, by draft depth (1 = first).",
            &|p| p.0,
        );
        let _ = writeln!(
            o,
            "# HELP gguftool_requests_finished_total Requests that left the engine, by reason.\n\
             # TYPE gguftool_requests_finished_total counter"
        );
        for (reason, n) in lock(&self.finished).iter() {
            let _ = writeln!(
                o,
                "gguftool_requests_finished_total{{reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(
            o,
            "# HELP gguftool_requests_rejected_total Requests refused before running, by reason.\n\
             # TYPE gguftool_requests_rejected_total counter"
        );
        for (reason, n) in lock(&self.rejected).iter() {
            let _ = writeln!(
                o,
                "gguftool_requests_rejected_total{{reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(
            o,
            "# HELP gguftool_http_requests_total HTTP responses by route and status.\n\
             # TYPE gguftool_http_requests_total counter"
        );
        for ((route, status), n) in lock(&self.http).iter() {
            let _ = writeln!(
                o,
                "gguftool_http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                escape_label(route)
            );
        }
        self.time_to_first_token.render(
            &mut o,
            "gguftool_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
        );
        self.inter_token_latency.render(
            &mut o,
            "gguftool_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a request.",
        );
        self.request_latency.render(
            &mut o,
            "gguftool_e2e_request_latency_seconds",
            "Seconds from arrival to the end of generation.",
        );
        self.queue_time.render(
            &mut o,
            "gguftool_request_queue_time_seconds",
            "Seconds a request waited before joining the batch.",
        );
        self.step_tokens.render(
            &mut o,
            "gguftool_iteration_tokens",
            "Tokens processed per batched forward pass.",
        );
        // The same numbers under llama-server's and vLLM's names.
        let mut alias = |name: &str, kind: &str, v: String| {
            let _ = writeln!(o, "# TYPE {name} {kind}\n{name} {v}");
        };
        alias(
            "llamacpp:prompt_tokens_total",
            "counter",
            prompt.to_string(),
        );
        alias(
            "llamacpp:tokens_predicted_total",
            "counter",
            gen.to_string(),
        );
        alias(
            "llamacpp:prompt_seconds_total",
            "counter",
            prompt_s.to_string(),
        );
        alias(
            "llamacpp:tokens_predicted_seconds_total",
            "counter",
            decode_s.to_string(),
        );
        alias("llamacpp:requests_processing", "gauge", running.to_string());
        alias("llamacpp:requests_deferred", "gauge", waiting.to_string());
        alias("llamacpp:kv_cache_usage_ratio", "gauge", usage.to_string());
        alias("llamacpp:kv_cache_tokens", "gauge", kv_tokens.to_string());
        alias("vllm:num_requests_running", "gauge", running.to_string());
        alias("vllm:num_requests_waiting", "gauge", waiting.to_string());
        alias("vllm:kv_cache_usage_perc", "gauge", usage.to_string());
        alias("vllm:prompt_tokens_total", "counter", prompt.to_string());
        alias("vllm:generation_tokens_total", "counter", gen.to_string());
        o
    }
}

/// Adds `key="value"` to the labels of every sample line of a rendered exposition.
fn with_label(text: &str, key: &str, value: &str) -> String {
    let label = format!("{key}=\"{}\"", escape_label(value));
    let mut out = String::with_capacity(text.len() + text.len() / 4);
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            out.push_str(line);
        } else if let Some(brace) = line.find('{') {
            out.push_str(&line[..=brace]);
            out.push_str(&label);
            out.push(',');
            out.push_str(&line[brace + 1..]);
        } else if let Some(space) = line.find(' ') {
            out.push_str(&line[..space]);
            out.push('{');
            out.push_str(&label);
            out.push('}');
            out.push_str(&line[space..]);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        h.observe(f64::NAN);
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"1\"} 1\n"));
        assert!(s.contains("x_bucket{le=\"2\"} 2\n"));
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_sum 11\n"));
        assert!(s.contains("x_count 3\n"));
    }

    #[test]
    fn render_has_types_and_labels() {
        let m = Metrics::default();
        m.record_http("/v1/completions", 200);
        m.record_finished("stop");
        let s = m.render();
        assert!(s.contains("# TYPE gguftool_prompt_tokens_total counter"));
        assert!(
            s.contains("gguftool_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1")
        );
        assert!(s.contains("gguftool_requests_finished_total{reason=\"stop\"} 1"));
        assert!(s.contains("llamacpp:kv_cache_usage_ratio 0"));
    }

    #[test]
    fn model_name_labels_every_series() {
        let m = Metrics::default();
        m.record_http("/v1/models", 200);
        m.time_to_first_token.observe(0.5);
        m.set_model_name("tiny \"glm\"");
        let s = m.render();
        let label = "model_name=\"tiny \\\"glm\\\"\"";
        assert!(
            s.contains(&format!("gguftool_prompt_tokens_total{{{label}}} 0\n")),
            "{s}"
        );
        assert!(s.contains(&format!(
            "gguftool_http_requests_total{{{label},route=\"/v1/models\",status=\"200\"}} 1"
        )));
        assert!(s.contains(&format!(
            "gguftool_time_to_first_token_seconds_bucket{{{label},le=\"0.5\"}} 1"
        )));
        assert!(s.contains(&format!("vllm:num_requests_running{{{label}}} 0")));
        for line in s.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.contains(label), "{line}");
        }
    }
}
