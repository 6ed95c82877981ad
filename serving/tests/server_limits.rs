//! The HTTP layer against slow and hostile clients (issue 14 items 6 and 9): JSON for the
//! errors hyper answers itself, header and body timeouts, a connection limit that evicts idle
//! connections so `/health` keeps answering under slowloris, and accepting after EMFILE.

mod server_support;

use server_support::{http, start, Options};
use serving::server::ServerConfig;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The server may answer and close before reading everything (431): a failed write is not
    // an error here; the answer is already in the receive queue.
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn json_body(resp: &str) -> serde_json::Value {
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {resp:?}"))
}

#[test]
fn oversized_headers_get_a_json_431() {
    let s = start(Options::default());
    let big = "x".repeat(100 << 10);
    let resp = raw(
        s.addr,
        format!("GET /health HTTP/1.1\r\nHost: a\r\nX-Big: {big}\r\n\r\n").as_bytes(),
    );
    assert!(resp.starts_with("HTTP/1.1 431"), "{resp:.200}");
    assert!(
        resp.contains("content-type: application/json"),
        "{resp:.300}"
    );
    let v = json_body(&resp);
    assert_eq!(v["error"]["code"], 431);
}

#[test]
fn malformed_request_lines_get_a_json_400() {
    let s = start(Options::default());
    for bad in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/9.9\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n",
    ] {
        let resp = raw(s.addr, bad);
        assert!(resp.starts_with("HTTP/1.1 400"), "{bad:?}: {resp:.200}");
        assert_eq!(json_body(&resp)["error"]["type"], "invalid_request_error");
    }
    // The server is fine afterwards.
    assert_eq!(http::get(s.addr, "/health").status, 200);
}

#[test]
fn a_half_open_connection_is_closed_after_the_header_timeout() {
    let s = start(Options {
        server: ServerConfig {
            header_timeout: Duration::from_secs(1),
            ..ServerConfig::default()
        },
        ..Options::default()
    });
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: a\r\n").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 64];
    // EOF (or a reset) well before the 20 s read timeout: the server closed it.
    match c.read(&mut buf) {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("unexpected answer {:?}", String::from_utf8_lossy(&buf[..n])),
    }
}

#[test]
fn a_trickling_body_gets_a_json_408() {
    let s = start(Options {
        server: ServerConfig {
            body_timeout: Duration::from_secs(1),
            ..ServerConfig::default()
        },
        ..Options::default()
    });
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    )
    .unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = c.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
            break;
        }
    }
    let resp = String::from_utf8_lossy(&out);
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp:.300}");
    assert_eq!(json_body(&resp)["error"]["code"], 408);
}

/// Half-open connections that never finish their head.
fn slowloris(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| {
            let mut c = TcpStream::connect(addr).ok()?;
            c.write_all(b"GET /health HTTP/1.1\r\nHost: a\r\n").ok()?;
            Some(c)
        })
        .collect()
}

#[test]
fn health_answers_while_the_connection_limit_is_full_of_half_open_connections() {
    let s = start(Options {
        server: ServerConfig {
            max_connections: 16,
            ..ServerConfig::default()
        },
        ..Options::default()
    });
    let held = slowloris(s.addr, 100);
    assert_eq!(held.len(), 100);
    for _ in 0..5 {
        let r = http::get(s.addr, "/health");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    drop(held);
}

#[test]
fn an_empty_api_key_is_refused() {
    let cfg = ServerConfig {
        api_key: Some(String::new()),
        ..ServerConfig::default()
    };
    assert!(cfg.validate().unwrap_err().contains("empty"));
    assert!(ServerConfig::default().validate().is_ok());
}
