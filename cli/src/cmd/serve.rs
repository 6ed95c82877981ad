//! `gguftool serve`: the OpenAI-compatible HTTP server. The socket is bound first, so `/health`
//! answers 503 while the model loads and 200 once it is ready.

use anyhow::{Context, Result};
use serving::engine::Metrics;
use serving::server::{self, AppState, ServerConfig};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (any shard of a split model). Without it, the bundled tiny demo model.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Address to listen on. The default keeps the server private to this machine; use 0.0.0.0
    /// (with --api-key) to expose it.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every route except /health (not empty).
    #[arg(long, value_name = "KEY", value_parser = non_empty_key)]
    api_key: Option<String>,
    /// Requests allowed to wait for a free slot; beyond that new requests get 429.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_queue: u64,
    /// Sequences decoded together (continuous batching slots).
    #[arg(long, short = 'P', default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    parallel: u64,
    /// Context length per sequence (prompt + generated); default and maximum: the model's.
    #[arg(short = 'c', long, value_parser = clap::value_parser!(u64).range(1..))]
    ctx_size: Option<u64>,
    /// Compute device: auto (a CUDA GPU when present, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, default_value = "auto")]
    device: runtime::device::Device,
    /// Model id reported by /v1/models and in responses (no spaces; default: the file name
    /// without `.gguf` and split suffix).
    #[arg(long, value_parser = parse_model_id)]
    alias: Option<String>,
    /// Let browser pages from ORIGIN call the API (CORS; `*` for any origin; repeat for
    /// several). Off by default.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    /// Jinja chat template file replacing the model's own `tokenizer.chat_template`.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 8 << 20, value_parser = clap::value_parser!(u64).range(1024..=(1 << 30)))]
    max_body_bytes: u64,
    /// Worker threads of the forward pass (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    #[command(flatten)]
    tp: super::tp::TpArgs,
    #[command(flatten)]
    draft: super::draft::DraftArgs,
    /// Open connections at most (also capped by the descriptor limit); beyond it the
    /// longest-idle connection is closed, or the new one gets 503 when all are busy.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_connections: u64,
    /// Seconds a client has to send a request head; also closes idle keep-alive connections.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    header_timeout: u64,
    /// Seconds a client has to send a request body once its head is in.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    body_timeout: u64,
}

/// An empty `--api-key` would lock everyone out while looking protected (and silence the
/// warning for a public address).
fn non_empty_key(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("the API key is empty; give a non-empty key or leave --api-key out".into())
    } else {
        Ok(s.to_string())
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    // Engine and request errors go to stderr; RUST_LOG=info (or debug) shows more.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .context("setting up worker threads")?;
    }
    // The HTTP side is light (parsing, tokenizing, streaming); the model runs on the engine
    // thread and rayon's pool.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(args))
}

async fn serve(args: Args) -> Result<ExitCode> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    // Read before binding: a missing template is an error at once, not after the model loads.
    let chat_template = match &args.chat_template {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading the chat template {}", p.display()))?,
        ),
        None => None,
    };
    let metrics = Arc::new(Metrics::default());
    let state = AppState::new(
        ServerConfig {
            api_key: args.api_key.clone(),
            max_body_bytes: args.max_body_bytes as usize,
            cors_origins: args.cors_origins.clone(),
            max_connections: args.max_connections as usize,
            header_timeout: std::time::Duration::from_secs(args.header_timeout),
            body_timeout: std::time::Duration::from_secs(args.body_timeout),
            ..ServerConfig::default()
        },
        metrics.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(server::serve(listener, state.clone(), async {
        let _ = stop_rx.await;
    }));
    println!("gguftool serve: listening on http://{addr} (loading the model; /health is 503 until it is ready)");
    if !addr.ip().is_loopback() && args.api_key.is_none() {
        eprintln!("warning: listening on {addr} without --api-key: anyone who can reach this address can use the model");
    }

    let (name, model) = (args.alias.clone(), args.model.clone());
    let (max_queue, parallel, ctx) = (args.max_queue, args.parallel, args.ctx_size);
    let opts = args.tp.options(args.device)?;
    let draft = args.draft.clone();
    let load_metrics = metrics.clone();
    let loading = tokio::task::spawn_blocking(move || -> Result<server::Backend> {
        let (gguf, default_name) = match &model {
            Some(p) => (
                gguf::Model::open(p).with_context(|| format!("opening {}", p.display()))?,
                model_id(p),
            ),
            None => (
                gguf::Model::from_static(
                    super::generate::DEMO_MODEL,
                    super::generate::DEMO_MODEL_NAME,
                )
                .context("opening the bundled demo model")?,
                DEMO_MODEL_ID.to_string(),
            ),
        };
        let name = name.unwrap_or(default_name);
        let gguf = Arc::new(gguf);
        let loaded = super::tp::load(Arc::clone(&gguf), opts, true)?;
        let lm = loaded.lm;
        let draft_k = draft.k_for(lm.as_ref())?;
        if let Some(k) = draft_k {
            eprintln!(
                "gguftool serve: speculative decoding with the MTP layer, {k} drafts per round"
            );
        }
        match loaded.tp.as_ref().filter(|t| t.world > 1) {
            Some(t) => eprintln!(
                "gguftool serve: running on {} over {} ranks ({}; all-reduce {})",
                loaded.device.name(),
                t.world,
                t.ranks
                    .iter()
                    .map(|r| r.device.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                t.comm
            ),
            None => eprintln!("gguftool serve: running on {}", loaded.device.name()),
        }
        if let Some(cap) = lm.cache_capacity_tokens() {
            eprintln!(
                "gguftool serve: KV cache budget {cap} tokens shared by all slots (free device memory after the weights)"
            );
        }
        let template = chat_template.as_deref();
        let backend = server::model_backend_with(&gguf, lm, &name, load_metrics, template, |c| {
            c.max_queue = max_queue as usize;
            c.max_running = parallel as usize;
            c.draft = draft_k;
            if let Some(n) = ctx {
                if n as usize > c.context_length {
                    eprintln!(
                        "warning: --ctx-size {n} is larger than the model's context {}; using {}",
                        c.context_length, c.context_length
                    );
                }
                c.context_length = c.context_length.min(n as usize);
            }
        })
        .context("loading the model")?;
        Ok(backend)
    });

    let backend = tokio::select! {
        r = loading => r.context("the loading task failed")??,
        _ = shutdown_signal() => {
            let _ = stop_tx.send(());
            return Ok(ExitCode::SUCCESS);
        }
    };
    println!(
        "gguftool serve: model {:?} ready (context {} tokens, {} slots, queue {}); chat page: http://{addr}/ ; try:\n  curl http://{addr}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \"1 2 3 4 5\", \"max_tokens\": 8, \"temperature\": 0}}'",
        backend.model_name,
        backend.engine.context_length(),
        backend.engine.config().max_running,
        backend.engine.config().max_queue,
    );
    state.set_ready(backend);

    tokio::select! {
        r = server => {
            r.context("the server task failed")?.context("serving")?;
        }
        _ = shutdown_signal() => {
            eprintln!("gguftool serve: shutting down");
            let _ = stop_tx.send(());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Model id of the bundled demo model.
const DEMO_MODEL_ID: &str = "tiny-glm5-Q4_K_M";

/// The model id of a GGUF path: its file name without `.gguf` and without a split suffix
/// (`-00001-of-00003`), whitespace replaced, so clients can send it back verbatim.
fn model_id(p: &std::path::Path) -> String {
    let name = p.file_name().map_or_else(
        || p.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    let mut stem = name.strip_suffix(".gguf").unwrap_or(&name).to_string();
    if let Some(i) = stem.rfind("-of-") {
        let (head, tail) = stem.split_at(i);
        let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        if digits(&tail[4..])
            && head.len() > 6
            && head.as_bytes()[head.len() - 6] == b'-'
            && digits(&head[head.len() - 5..])
        {
            stem.truncate(i - 6);
        }
    }
    stem.chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

fn parse_model_id(s: &str) -> Result<String, String> {
    if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("a model id must be non-empty, without spaces or control characters".into());
    }
    Ok(s.to_string())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_have_no_spaces_or_split_suffix() {
        let id = |p: &str| model_id(std::path::Path::new(p));
        assert_eq!(id("/m/tiny-glm5-Q4_K_M.gguf"), "tiny-glm5-Q4_K_M");
        assert_eq!(
            id("GLM-5-UD-Q4_K_XL-00003-of-00010.gguf"),
            "GLM-5-UD-Q4_K_XL"
        );
        assert_eq!(id("my model.gguf"), "my_model");
        assert_eq!(id("x-of-00002.gguf"), "x-of-00002");
        assert!(parse_model_id("a b").is_err());
        assert!(parse_model_id("").is_err());
        assert_eq!(parse_model_id("glm-5").unwrap(), "glm-5");
    }
}
