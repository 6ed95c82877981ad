//! The output layer through the binary (issue 14 items 1-3 and 9): `--force` never eats inputs
//! or foreign directories, only regular files are replaced, signals and concurrent writers leave
//! no temporaries, closed pipes end quietly, non-regular inputs are refused up front, and OS
//! errors are printed once.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
}

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn q4() -> PathBuf {
    fx("gguf/tiny-glm5-Q4_K_M.gguf")
}

fn shard1() -> PathBuf {
    fx("gguf/split/tiny-glm5-Q4_K_M-00001-of-00003.gguf")
}

fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut c = bin();
    for a in args {
        c.arg(a);
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

fn is_fifo(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(p)
        .map(|m| m.file_type().is_fifo())
        .unwrap_or(false)
}

/// The repro: `convert d/model.gguf d --force` deleted both files of `d`.
#[test]
fn convert_force_keeps_the_input_and_foreign_files() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("d");
    std::fs::create_dir(&d).unwrap();
    let model = d.join("model.gguf");
    std::fs::copy(q4(), &model).unwrap();
    std::fs::write(d.join("notes"), b"x\n").unwrap();
    let o = run(&[&"convert", &model, &d, &"--force", &"-q"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("inside it"), "{}", stderr(&o));
    assert_eq!(names(&d), vec!["model.gguf", "notes"]);
    assert_eq!(std::fs::read(&model).unwrap(), std::fs::read(q4()).unwrap());
    assert_eq!(names(t.path()), vec!["d"], "temporary left behind");
}

#[test]
fn convert_force_refuses_the_working_directory() {
    let t = tempfile::tempdir().unwrap();
    std::fs::write(t.path().join("keep"), b"k").unwrap();
    let o = bin()
        .current_dir(t.path())
        .args(["convert", q4().to_str().unwrap(), ".", "--force", "-q"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(names(t.path()), vec!["keep"]);
}

#[test]
fn convert_force_replaces_only_its_own_output() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("hf");
    let o = run(&[&"convert", &q4(), &out, &"-q"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join(".gguftool-output").is_file());
    assert!(out.join("config.json").is_file());
    // Again without --force: refused, untouched.
    let o = run(&[&"convert", &q4(), &out, &"-q"]);
    assert_eq!(o.status.code(), Some(2));
    // With --force: replaced (a stray file of the old output goes with it).
    std::fs::write(out.join("stale.txt"), b"old").unwrap();
    let o = run(&[&"convert", &q4(), &out, &"-q", &"--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!out.join("stale.txt").exists());
    assert!(out.join("config.json").is_file());
    assert_eq!(names(t.path()), vec!["hf"]);
    // A directory gguftool did not write is refused even with --force.
    let foreign = t.path().join("mine");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("thesis.tex"), b"years of work").unwrap();
    let o = run(&[&"convert", &q4(), &foreign, &"-q", &"--force"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("not written by gguftool"),
        "{}",
        stderr(&o)
    );
    assert_eq!(names(&foreign), vec!["thesis.tex"]);
}

#[test]
fn merge_force_never_replaces_a_fifo_device_or_directory() {
    let t = tempfile::tempdir().unwrap();
    let fifo = t.path().join("fifo");
    mkfifo(&fifo);
    let o = run(&[&"merge", &shard1(), &"-o", &fifo, &"--force"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(is_fifo(&fifo), "the FIFO was replaced");
    let o = run(&[&"merge", &shard1(), &"-o", &"/dev/full", &"--force"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("character device"), "{}", stderr(&o));
    // An existing directory is refused before anything is written.
    let dir = t.path().join("dir");
    std::fs::create_dir(&dir).unwrap();
    let o = run(&[&"merge", &shard1(), &"-o", &dir, &"--force"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("a directory"), "{}", stderr(&o));
    assert!(names(&dir).is_empty());
    assert_eq!(
        names(t.path()),
        vec!["dir", "fifo"],
        "temporary left behind"
    );
}

#[test]
fn split_force_never_replaces_a_fifo_shard() {
    let t = tempfile::tempdir().unwrap();
    let prefix = t.path().join("s");
    let fifo = t.path().join("s-00002-of-00003.gguf");
    mkfifo(&fifo);
    let o = run(&[
        &"split",
        &q4(),
        &"-o",
        &prefix,
        &"--max-tensors",
        &"32",
        &"--force",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(is_fifo(&fifo));
    assert_eq!(names(t.path()), vec!["s-00002-of-00003.gguf"]);
}

/// Spawn a merge that holds before its commit and wait until it says so (its temporary is
/// complete then and the signal lands in the hold).
fn held_merge(out: &Path, mode: &str) -> std::process::Child {
    let (s, o) = (shard1(), out.to_str().unwrap().to_string());
    held(
        &["merge", s.to_str().unwrap(), "-o", &o, "--quiet", "--force"],
        mode,
    )
}

fn held(args: &[&str], mode: &str) -> std::process::Child {
    use std::io::BufRead;
    let mut child = bin()
        .env("GGUFTOOL_TEST_HOLD_COMMIT", mode)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("holding before commit") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "merge ended early");
    }
    // Keep draining stderr so the child never blocks on it.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    child
}

fn kill(child: &std::process::Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

#[test]
fn sigterm_sighup_and_sigint_remove_the_temporary() {
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("m.gguf");
        let mut child = held_merge(&out, "poll:20000");
        kill(&child, sig);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(128 + sig), "signal {sig}: {status:?}");
        assert!(
            names(t.path()).is_empty(),
            "signal {sig}: {:?}",
            names(t.path())
        );
    }
}

#[test]
fn sigterm_during_convert_removes_the_temporary_directory() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("hf");
    let m = q4();
    let mut child = held(
        &["convert", m.to_str().unwrap(), out.to_str().unwrap(), "-q"],
        "poll:20000",
    );
    kill(&child, libc::SIGTERM);
    assert_eq!(child.wait().unwrap().code(), Some(128 + libc::SIGTERM));
    assert!(names(t.path()).is_empty(), "{:?}", names(t.path()));
}

#[test]
fn second_signal_cleans_up_even_when_the_command_does_not_poll() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("m.gguf");
    let mut child = held_merge(&out, "nopoll:20000");
    kill(&child, libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(100));
    kill(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
    assert!(names(t.path()).is_empty(), "{:?}", names(t.path()));
}

#[test]
fn concurrent_writers_use_separate_temporaries() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("m.gguf");
    let mut a = held_merge(&out, "poll:1500");
    let mut b = held_merge(&out, "poll:1500");
    let partials = names(t.path());
    assert_eq!(partials.len(), 2, "{partials:?}");
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
    assert_eq!(names(t.path()), vec!["m.gguf"]);
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 4881024);
}

/// `cmd | head -c 1`: the command must end with 0 or SIGPIPE (or its own code), never a panic.
fn closed_pipe(args: &[&str]) -> (Option<i32>, Option<i32>, String) {
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Read;
        let mut out = child.stdout.take().unwrap();
        let mut one = [0u8; 1];
        let _ = out.read(&mut one);
        // Dropping the read end closes the pipe.
    }
    let o = child.wait_with_output().unwrap();
    (o.status.code(), o.status.signal(), stderr(&o))
}

#[test]
fn closed_stdout_ends_every_printing_command_quietly() {
    let m = q4();
    let m = m.to_str().unwrap();
    for args in [
        vec!["info", m, "--tensors"],
        vec!["info", m, "--json", "--tensors"],
        vec!["verify", m],
        vec!["map", m],
        vec![
            "generate", "-m", m, "-p", "1 2 3", "-n", "24", "--temp", "0",
        ],
    ] {
        let (code, signal, err) = closed_pipe(&args);
        assert!(
            code == Some(0) || signal == Some(libc::SIGPIPE) || code == Some(141),
            "{args:?}: code {code:?} signal {signal:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
    }
}

#[test]
fn non_regular_inputs_are_refused_up_front() {
    let t = tempfile::tempdir().unwrap();
    let fifo = t.path().join("fifo");
    mkfifo(&fifo);
    let t0 = Instant::now();
    // Without the check, opening the FIFO blocks forever.
    let o = run(&[&"info", &fifo]);
    assert!(t0.elapsed() < Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("FIFO"), "{}", stderr(&o));
    let o = run(&[&"info", &"/dev/zero"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!stderr(&o).contains("truncated"), "{}", stderr(&o));
    assert!(stderr(&o).contains("character device"), "{}", stderr(&o));
}

#[test]
fn os_errors_are_printed_once() {
    for cmd in ["info", "verify", "convert"] {
        let mut c = bin();
        c.arg(cmd).arg("/nonexistent/model.gguf");
        if cmd == "convert" {
            c.arg("/nonexistent/out");
        }
        let o = c.output().unwrap();
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {e}");
        assert_eq!(
            e.matches("No such file or directory").count(),
            1,
            "{cmd}: {e}"
        );
        assert_eq!(e.lines().count(), 1, "{cmd}: {e}");
    }
}
