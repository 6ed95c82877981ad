//! Helpers shared by several commands: name filters, byte formatting, progress bars, Ctrl-C,
//! and output files that appear under their final name only when complete.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::File;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

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

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Route Ctrl-C to a flag that long-running loops poll, so they can clean up partial outputs.
pub fn install_interrupt_handler() {
    // A second install (tests, repeated calls) fails harmlessly; the first handler stays.
    let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
}

pub fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// An output written as `NAME.partial` next to its final path and renamed into place by
/// [`PartialFile::commit`] after an fsync. Dropped without commit, the partial file is removed.
pub struct PartialFile {
    pub file: File,
    partial: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl PartialFile {
    pub fn create(target: &Path, force: bool) -> Result<PartialFile> {
        if target.exists() && !force {
            bail!("{} exists (use --force to overwrite)", target.display());
        }
        let mut name = target
            .file_name()
            .with_context(|| format!("{} is not a file path", target.display()))?
            .to_os_string();
        name.push(".partial");
        let partial = target.with_file_name(name);
        let file = File::options()
            .write(true)
            .create(true)
            .truncate(true)
            .read(true)
            .open(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        Ok(PartialFile {
            file,
            partial,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    pub fn partial_path(&self) -> &Path {
        &self.partial
    }

    /// fsync the data, rename over the target, fsync the directory.
    pub fn commit(mut self) -> Result<()> {
        self.file
            .sync_all()
            .with_context(|| format!("fsync {}", self.partial.display()))?;
        std::fs::rename(&self.partial, &self.target).with_context(|| {
            format!(
                "rename {} -> {}",
                self.partial.display(),
                self.target.display()
            )
        })?;
        self.committed = true;
        if let Some(dir) = self.target.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
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

/// Same file on disk (device + inode), for refusing to overwrite an input.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
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
    fn sizes() {
        assert_eq!(parse_size("50G").unwrap(), 50_000_000_000);
        assert_eq!(parse_size("500M").unwrap(), 500_000_000);
        assert!(parse_size("x").is_err());
        assert!(parse_size("0").is_err());
    }
}
