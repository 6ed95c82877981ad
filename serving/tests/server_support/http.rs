//! A minimal blocking HTTP/1.1 client for tests (loopback only): whole responses, or SSE events
//! one at a time so that a test can disconnect in the middle of a stream.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// Payloads of the `data:` lines of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    assert!(addr.ip().is_loopback(), "tests talk to loopback only");
    let s = TcpStream::connect(addr).expect("connect to the test server");
    // A bound on a hung server, not a timing assertion.
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

fn send_head(s: &mut TcpStream, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += "\r\n";
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
}

fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    })
}

/// Next chunk of a chunked body; `None` at the end.
fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(line.trim().split(';').next()?, 16).ok()?;
    if n == 0 {
        return None;
    }
    let mut buf = vec![0; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut s = connect(addr);
    send_head(&mut s, method, path, headers, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let mut body = Vec::new();
    if is_chunked(&headers) {
        while let Some(c) = read_chunk(&mut r) {
            body.extend(c);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Response {
        status,
        headers,
        body,
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Response {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

pub fn get(addr: SocketAddr, path: &str) -> Response {
    request(addr, "GET", path, &[], b"")
}

/// A streaming response read event by event.
pub struct EventStream {
    pub status: u16,
    reader: BufReader<TcpStream>,
    buf: String,
}

impl EventStream {
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> EventStream {
        let mut s = connect(addr);
        send_head(
            &mut s,
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        );
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader);
        assert!(is_chunked(&headers), "a stream is sent chunked");
        EventStream {
            status,
            reader,
            buf: String::new(),
        }
    }

    /// The next `data:` payload; `None` when the stream ends.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let ev: String = self.buf.drain(..i + 2).collect();
                if let Some(d) = ev.trim_end().strip_prefix("data: ") {
                    return Some(d.to_string());
                }
                continue;
            }
            let c = read_chunk(&mut self.reader)?;
            self.buf.push_str(&String::from_utf8_lossy(&c));
        }
    }
}
