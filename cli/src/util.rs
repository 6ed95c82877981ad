//! Helpers shared by several commands: name filters, byte formatting, progress bars, error
//! texts, quiet exits on a closed pipe, and (re-exported from [`crate::output`]) outputs that
//! appear under their final name only when complete, with signal handling.

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

pub use crate::output::{
    check_interrupted, check_output_file, install_interrupt_handler, refuse_input_as_output,
    same_file, AtomicDir, Interrupted, PartialFile, PartialSet,
};

/// Match a tensor name against a filter: a glob with `*` and `?` when it has either, otherwise
/// a substring (so `--filter attn_k_b` and `--filter 'blk.1.*'` both do what one expects).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    if !pattern.contains(['*', '?']) {
        return name.contains(pattern);
    }
    glob(pattern.as_bytes(), name.as_bytes())
}

fn glob(p: &[u8], s: &[u8]) -> bool {
    // Iterative matcher with single-star backtracking: linear in practice, no recursion depth.
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == s[si]) {
            pi += 1;
            si += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// `1.23 GiB`-style size.
pub fn human_bytes(n: u64) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

/// Parse `50G`, `500M`, `123` (decimal units as gguf-split: M = 10^6, G = 10^9).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1_000u64),
        Some('M' | 'm') => (&s[..s.len() - 1], 1_000_000),
        Some('G' | 'g') => (&s[..s.len() - 1], 1_000_000_000),
        Some('T' | 't') => (&s[..s.len() - 1], 1_000_000_000_000),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("invalid size {s:?} (examples: 50G, 500M, 1000000)"))?;
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .with_context(|| format!("invalid size {s:?}"))
}

/// A byte progress bar on a terminal, hidden otherwise or when `quiet`.
pub fn byte_progress(total: u64, quiet: bool, msg: &str) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A count progress bar (tensors), hidden off a terminal or when `quiet`.
pub fn count_progress(total: u64, quiet: bool, msg: &str) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {per_sec} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// Free bytes on the filesystem holding `path` (its directory when it does not exist yet).
pub fn free_space(path: &Path) -> Option<u64> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and st a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

/// One line for an error chain: each cause once. Library errors often repeat their cause in
/// their own text (`path: No such file (os error 2)` with the io::Error as `source`), and
/// contexts repeat the path their cause starts with; both are dropped.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut prev_last_word = String::new();
    for cause in e.chain() {
        let mut t = cause.to_string();
        if !prev_last_word.is_empty() {
            if let Some(rest) = t.strip_prefix(&format!("{prev_last_word}: ")) {
                t = rest.to_string();
            }
        }
        if t.is_empty() || out.contains(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
        prev_last_word = t.rsplit(' ').next().unwrap_or_default().to_string();
    }
    out
}

/// Whether the error comes from writing to a closed pipe (`gguftool info M | head -1`).
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// End the process the way a C tool ends on a closed pipe: removing temporaries first, then by
/// SIGPIPE with its default action (the shell reports 141).
pub fn exit_on_broken_pipe() -> ! {
    crate::output::remove_temporaries();
    // SAFETY: restoring the default disposition and raising a signal have no memory effects.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE)
}

/// `print!`/`println!` panic when stdout is a closed pipe; turn exactly that panic into a quiet
/// [`exit_on_broken_pipe`] for every command, and leave every other panic to the default hook.
pub fn quiet_broken_pipes() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to std")
            && (msg.contains("Broken pipe") || msg.contains("os error 32"))
        {
            exit_on_broken_pipe();
        }
        default(info);
    }));
}

/// llama.cpp's `general.file_type` (llama_ftype) names.
pub fn file_type_name(id: u64) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

/// A metadata value as JSON; arrays longer than `max_items` are summarized unless `max_items`
/// is `None`.
pub fn value_json(v: &gguf::Value, max_items: Option<usize>) -> serde_json::Value {
    use gguf::Value as V;
    match v {
        V::String(s) => s.clone().into(),
        V::Bool(b) => (*b).into(),
        V::F32(x) => serde_json::Number::from_f64(*x as f64)
            .map(Into::into)
            .unwrap_or_else(|| format!("{x}").into()),
        V::F64(x) => serde_json::Number::from_f64(*x)
            .map(Into::into)
            .unwrap_or_else(|| format!("{x}").into()),
        V::U64(x) => (*x).into(),
        V::Array(a) => match max_items {
            Some(m) if a.len() > m => serde_json::json!({
                "len": a.len(),
                "first": a.values.iter().take(m).map(|e| value_json(e, max_items)).collect::<Vec<_>>(),
            }),
            _ => a
                .values
                .iter()
                .map(|e| value_json(e, max_items))
                .collect::<Vec<_>>()
                .into(),
        },
        other => other
            .as_i64()
            .map(Into::into)
            .unwrap_or(serde_json::Value::Null),
    }
}

/// The type name of a value as gguf-py prints it (`UINT32`, `array[STRING]`).
pub fn value_type_json(v: &gguf::Value) -> String {
    match v {
        gguf::Value::Array(a) => format!("array[{}]", a.elem_type.name()),
        other => other.value_type().name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters() {
        assert!(name_matches("blk.1.*", "blk.1.attn_k_b.weight"));
        assert!(!name_matches("blk.1.*", "blk.10x"));
        assert!(name_matches("*exps*", "blk.2.ffn_up_exps.weight"));
        assert!(name_matches("attn_k_b", "blk.0.attn_k_b.weight"));
        assert!(name_matches("blk.?.ffn*", "blk.2.ffn_up_exps.weight"));
        assert!(!name_matches("blk.?.ffn*", "blk.12.ffn_up_exps.weight"));
    }

    #[test]
    fn error_chain_printed_once() {
        let io = std::io::Error::from_raw_os_error(2);
        #[derive(Debug)]
        struct Lib(std::io::Error);
        impl std::fmt::Display for Lib {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "/nope: {}", self.0)
            }
        }
        impl std::error::Error for Lib {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Lib(io)).context("cannot open /nope");
        assert_eq!(
            error_text(&e),
            "cannot open /nope: No such file or directory (os error 2)"
        );
        let plain = anyhow::anyhow!("x failed").context("step");
        assert_eq!(error_text(&plain), "step: x failed");
    }

    #[test]
    fn broken_pipe_detected_through_context() {
        let e = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
            .context("writing");
        assert!(is_broken_pipe(&e));
        assert!(!is_broken_pipe(&anyhow::anyhow!("other")));
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("50G").unwrap(), 50_000_000_000);
        assert_eq!(parse_size("500M").unwrap(), 500_000_000);
        assert!(parse_size("x").is_err());
        assert!(parse_size("0").is_err());
    }
}
