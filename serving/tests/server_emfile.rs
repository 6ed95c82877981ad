//! Out of file descriptors (issue 14 item 6): with the process limit lowered below what a flood
//! of half-open connections needs, the server keeps accepting (closing idle connections to free
//! descriptors) and `/health` still answers. The clients run in a child process (this same test
//! binary) so that they are not bound by the lowered limit. Own binary: `setrlimit` is
//! process-wide.

mod server_support;

use server_support::{start, Options};
use serving::server::ServerConfig;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::time::Duration;

const ADDR_VAR: &str = "GGUFTOOL_EMFILE_TEST_ADDR";

fn nofile() -> libc::rlimit {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) }, 0);
    rl
}

fn set_nofile(rl: &libc::rlimit) {
    // SAFETY: setrlimit reads the struct it is given.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, rl) }, 0);
}

#[test]
fn health_answers_after_the_descriptors_run_out() {
    let s = start(Options {
        server: ServerConfig {
            max_connections: 100_000,
            ..ServerConfig::default()
        },
        ..Options::default()
    });
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let before = nofile();
    let hard = before.rlim_max;
    // The child gets back the full limit in pre_exec (a lowered soft limit may be raised again
    // up to the hard one).
    let child = std::process::Command::new(std::env::current_exe().unwrap());
    let mut child = child;
    child
        .args(["--exact", "slowloris_client", "--ignored", "--nocapture"])
        .env(ADDR_VAR, s.addr.to_string());
    let restore = before;
    // SAFETY: setrlimit is async-signal-safe, as pre_exec requires.
    unsafe {
        child.pre_exec(move || {
            let rl = libc::rlimit {
                rlim_cur: restore.rlim_cur,
                rlim_max: hard,
            };
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
            Ok(())
        });
    }
    set_nofile(&libc::rlimit {
        rlim_cur: open + 48,
        rlim_max: hard,
    });
    let out = child.output().unwrap();
    set_nofile(&before);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("health ok 3/3"),
        "child: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The client side, run in the child process only.
#[test]
#[ignore = "run by health_answers_after_the_descriptors_run_out in a child process"]
fn slowloris_client() {
    let addr: std::net::SocketAddr = std::env::var(ADDR_VAR).unwrap().parse().unwrap();
    let held: Vec<TcpStream> = (0..300)
        .filter_map(|_| {
            let mut c = TcpStream::connect(addr).ok()?;
            c.write_all(b"GET /health HTTP/1.1\r\nHost: a\r\n").ok()?;
            Some(c)
        })
        .collect();
    assert!(held.len() > 200, "only {} connections", held.len());
    let mut ok = 0;
    for _ in 0..3 {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        c.write_all(b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        let _ = c.read_to_string(&mut resp);
        if resp.starts_with("HTTP/1.1 200") {
            ok += 1;
        }
    }
    println!("health ok {ok}/3");
    drop(held);
}
