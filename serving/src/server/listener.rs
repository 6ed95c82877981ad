//! The accept loop and the HTTP/1.1 connections under the router: what stops a slow or hostile
//! client from taking the server down.
//!
//! - A request head must arrive within [`ServerConfig::header_timeout`], counted from the end of
//!   the previous response on a keep-alive connection (hyper's header-read timer), so a
//!   half-open or slowloris connection, or an idle keep-alive one, is closed after it.
//! - A request body must arrive within [`ServerConfig::body_timeout`] (`read_json`, 408).
//! - At most [`ServerConfig::max_connections`] connections are open (by default also at most
//!   the file-descriptor limit minus a reserve). A new connection beyond that first closes the
//!   longest-idle one (no request in flight, no response streaming), which is how `/health`
//!   keeps answering while hundreds of half-open connections sit there; only when every
//!   connection is busy is it answered 503 and closed.
//! - `accept` errors never end the loop: on EMFILE/ENFILE an idle connection is closed to free
//!   a descriptor and accepting resumes after a short pause.
//! - The errors hyper answers itself (431 for headers over the limit, 400 for a malformed
//!   request line, 414) are rewritten to the same OpenAI-shaped JSON as every other error
//!   ([`JsonErrors`]).

use super::{router, AppState, ServerConfig};
use axum::body::Body;
use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// Descriptors kept free for the model files, logs and the engine when the connection limit
/// is derived from `RLIMIT_NOFILE`.
const FD_RESERVE: u64 = 64;

/// Per-connection bookkeeping for idle eviction.
struct Conn {
    /// Requests being handled or responses still streaming.
    active: AtomicUsize,
    /// Milliseconds since the server started at which the connection last became idle.
    idle_since: AtomicU64,
    /// Close now (evicted while idle: at most a partial request head is lost).
    evict: Notify,
    /// Finish the response in progress, then close (server shutdown).
    shutdown: Notify,
}

/// The open connections.
struct Registry {
    start: Instant,
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    max: usize,
}

impl Registry {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn len(&self) -> usize {
        self.conns.lock().map(|c| c.len()).unwrap_or(0)
    }

    fn add(self: &Arc<Self>) -> (u64, Arc<Conn>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(Conn {
            active: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.now_ms()),
            evict: Notify::new(),
            shutdown: Notify::new(),
        });
        if let Ok(mut m) = self.conns.lock() {
            m.insert(id, Arc::clone(&c));
        }
        (id, c)
    }

    fn remove(&self, id: u64) {
        if let Ok(mut m) = self.conns.lock() {
            m.remove(&id);
        }
    }

    /// Close the connection that has been idle longest; false when every one is busy.
    fn evict_idle(&self) -> bool {
        let Ok(mut m) = self.conns.lock() else {
            return false;
        };
        let victim = m
            .iter()
            .filter(|(_, c)| c.active.load(Ordering::SeqCst) == 0)
            .min_by_key(|(_, c)| c.idle_since.load(Ordering::SeqCst))
            .map(|(&id, _)| id);
        match victim.and_then(|id| m.remove(&id)) {
            Some(c) => {
                c.evict.notify_one();
                true
            }
            None => false,
        }
    }

    fn close_all(&self) {
        if let Ok(m) = self.conns.lock() {
            for c in m.values() {
                c.shutdown.notify_one();
            }
        }
    }
}

/// Marks a connection busy while it lives; dropped when the response body is done.
struct Busy {
    conn: Arc<Conn>,
    registry: Arc<Registry>,
}

impl Busy {
    fn new(conn: &Arc<Conn>, registry: &Arc<Registry>) -> Self {
        conn.active.fetch_add(1, Ordering::SeqCst);
        Busy {
            conn: Arc::clone(conn),
            registry: Arc::clone(registry),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn
            .idle_since
            .store(self.registry.now_ms(), Ordering::SeqCst);
        self.conn.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its connection marked busy until it is finished or dropped
/// (an SSE stream may run for minutes after the handler returned).
struct BusyBody {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for BusyBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The connection limit in effect: the configured one, capped by the descriptor limit.
fn effective_max_connections(configured: usize) -> usize {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0;
    if !ok || rl.rlim_cur == libc::RLIM_INFINITY {
        return configured.max(1);
    }
    let by_fds = rl.rlim_cur.saturating_sub(FD_RESERVE).max(8);
    configured.min(by_fds as usize).max(1)
}

fn is_fd_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Run the router on `listener` until `shutdown` resolves, then close every connection
/// (streams in progress are cut after `ServerConfig::shutdown_grace`).
pub(crate) async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let cfg = state.config.clone();
    let app = router(state);
    let registry = Arc::new(Registry {
        start: Instant::now(),
        next_id: AtomicU64::new(0),
        conns: Mutex::new(HashMap::new()),
        max: effective_max_connections(cfg.max_connections),
    });
    let mut tasks = tokio::task::JoinSet::new();
    let mut last_fd_warning: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => r,
            // Reap finished connection tasks so the set does not grow.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) if is_fd_exhaustion(&e) => {
                if last_fd_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(
                        "accept: {e}; closing the longest-idle connection and continuing ({} open)",
                        registry.len()
                    );
                    last_fd_warning = Some(Instant::now());
                }
                // Free a few descriptors (the backlog may hold many more half-open clients).
                for _ in 0..4 {
                    registry.evict_idle();
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            Err(e) => {
                // ECONNABORTED and friends: the peer gave up before we accepted.
                tracing::debug!("accept: {e}");
                continue;
            }
        };
        if registry.len() >= registry.max && !registry.evict_idle() {
            tasks.spawn(refuse_busy(stream));
            continue;
        }
        let (id, conn) = registry.add();
        let (app, registry, cfg) = (app.clone(), Arc::clone(&registry), cfg.clone());
        tasks.spawn(async move {
            serve_connection(stream, app, &conn, &registry, &cfg).await;
            registry.remove(id);
        });
    }
    registry.close_all();
    let grace = cfg.shutdown_grace;
    let _ = tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
    Ok(())
}

/// Every connection is busy: say so in JSON and close.
async fn refuse_busy(mut stream: TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = super::ApiError::new(
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "unavailable_error",
        "too many open connections; retry shortly",
    )
    .body()
    .to_string();
    let resp = http_response(503, "Service Unavailable", &body);
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.write_all(&resp)).await;
}

fn http_response(code: u16, reason: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn serve_connection(
    stream: TcpStream,
    app: axum::Router,
    conn: &Arc<Conn>,
    registry: &Arc<Registry>,
    cfg: &ServerConfig,
) {
    let _ = stream.set_nodelay(true);
    let io = hyper_util::rt::TokioIo::new(JsonErrors::new(stream));
    let svc = {
        let (conn, registry) = (Arc::clone(conn), Arc::clone(registry));
        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let busy = Busy::new(&conn, &registry);
            let mut app = app.clone();
            async move {
                use tower_service::Service;
                let resp = app.call(req.map(Body::new)).await;
                resp.map(|r| r.map(|inner| Body::new(BusyBody { inner, _busy: busy })))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(cfg.header_timeout)
        // The head limit is checked on the parsed head; the read buffer has room for it.
        .max_header_size(cfg.max_header_bytes)
        .max_buf_size(cfg.max_header_bytes.max(8192) + 8192)
        .keep_alive(true);
    let c = builder.serve_connection(io, svc);
    tokio::pin!(c);
    tokio::select! {
        _ = c.as_mut() => {}
        // Dropping the connection closes the socket at once.
        _ = conn.evict.notified() => {}
        _ = conn.shutdown.notified() => {
            // A busy connection finishes its response first.
            c.as_mut().graceful_shutdown();
            let _ = c.await;
        }
    }
}

/// The IO under hyper, rewriting the responses hyper writes on its own for requests it cannot
/// parse (an empty-bodied 400, 414 or 431) into JSON error objects. The router never sends an
/// empty-bodied 4xx, so only hyper's are matched.
pub(crate) struct JsonErrors<T> {
    inner: T,
    /// A replacement being written, and how many bytes of it are out.
    pending: Option<(Vec<u8>, usize, usize)>,
}

impl<T> JsonErrors<T> {
    pub(crate) fn new(inner: T) -> Self {
        JsonErrors {
            inner,
            pending: None,
        }
    }
}

/// If `buf` is one of hyper's automatic error responses, the JSON response to send instead.
pub(crate) fn rewrite_hyper_error(buf: &[u8]) -> Option<Vec<u8>> {
    let head = std::str::from_utf8(buf).ok()?;
    let rest = head.strip_prefix("HTTP/1.1 ")?;
    let code: u16 = rest.get(..3)?.parse().ok()?;
    let message = match code {
        400 => "the request line or a header could not be parsed",
        414 => "the request target is too long",
        431 => "the request headers are too large",
        _ => return None,
    };
    let lower = head.to_ascii_lowercase();
    if !head.ends_with("\r\n\r\n") || !lower.contains("\r\ncontent-length: 0\r\n") {
        return None;
    }
    let status = axum::http::StatusCode::from_u16(code).ok()?;
    let body = super::ApiError::new(status, "invalid_request_error", message)
        .body()
        .to_string();
    Some(http_response(
        code,
        status.canonical_reason().unwrap_or("Error"),
        &body,
    ))
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.pending.is_none() {
            match rewrite_hyper_error(buf) {
                Some(r) => this.pending = Some((r, 0, buf.len())),
                None => return Pin::new(&mut this.inner).poll_write(cx, buf),
            }
        }
        if let Some((r, done, claimed)) = &mut this.pending {
            while *done < r.len() {
                match Pin::new(&mut this.inner).poll_write(cx, &r[*done..]) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                    Poll::Ready(Ok(n)) => *done += n,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            let claimed = *claimed;
            this.pending = None;
            return Poll::Ready(Ok(claimed));
        }
        Poll::Ready(Ok(0))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    // Not vectored: hyper then hands each response head to `poll_write` in one buffer, which
    // is what the rewrite looks at.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hypers_empty_error_responses_are_rewritten() {
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Mon, 01 Dec 2026 00:00:00 GMT\r\n\r\n";
        let r = String::from_utf8(rewrite_hyper_error(hyper_431).unwrap()).unwrap();
        assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
        let body: serde_json::Value =
            serde_json::from_str(r.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            rewrite_hyper_error(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n").is_some()
        );
        // Our own JSON errors and successful responses pass through.
        assert!(rewrite_hyper_error(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 87\r\ncontent-type: application/json\r\n\r\n").is_none());
        assert!(rewrite_hyper_error(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(rewrite_hyper_error(b"data: {\"x\": 1}\n\n").is_none());
    }

    #[test]
    fn connection_limit_respects_the_descriptor_limit() {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit fills the struct it is given.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) }, 0);
        if rl.rlim_cur != libc::RLIM_INFINITY {
            let cap = effective_max_connections(usize::MAX) as u64;
            assert!(cap + FD_RESERVE <= rl.rlim_cur.max(FD_RESERVE + 8), "{cap}");
        }
        assert_eq!(effective_max_connections(3), 3);
    }
}
