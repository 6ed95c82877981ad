//! Check 7 with `--hf`: activations of the HF checkpoint computed by transformers, through the
//! embedded `hf_activations.py` run by `python3` (or `$GGUFTOOL_PYTHON`). Without a Python that
//! can import torch, transformers and safetensors this side is skipped, with the import error.

use super::layers::{load_dump, Dump};
use std::path::{Path, PathBuf};
use std::process::Command;

const SCRIPT: &str = include_str!("hf_activations.py");

fn python() -> String {
    std::env::var("GGUFTOOL_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The interpreter to use, or why there is none.
pub fn python_transformers() -> Result<String, String> {
    let py = python();
    let out = Command::new(&py)
        .args(["-c", "import torch, transformers, safetensors"])
        .output()
        .map_err(|e| format!("{py} cannot be run: {e}"))?;
    if out.status.success() {
        return Ok(py);
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    Err(format!(
        "{py} cannot import torch, transformers and safetensors ({last})"
    ))
}

/// A fresh path in the system temp directory.
fn temp_path(ext: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gguftool-doctor-{}-{}.{ext}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ))
}

/// Removes the file when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs transformers on `ids` and reads back its activations.
pub fn run(py: &str, hf: &Path, ids: &[u32], layers: Option<usize>) -> Result<Dump, String> {
    let script = TempFile(temp_path("py"));
    std::fs::write(&script.0, SCRIPT).map_err(|e| format!("{}: {e}", script.0.display()))?;
    let out = TempFile(temp_path("safetensors"));
    let ids_arg: Vec<String> = ids.iter().map(u32::to_string).collect();
    let mut cmd = Command::new(py);
    cmd.arg(&script.0)
        .arg("--hf")
        .arg(hf)
        .arg("--ids")
        .arg(ids_arg.join(","))
        .arg("--out")
        .arg(&out.0);
    if let Some(n) = layers {
        cmd.arg("--layers").arg(n.to_string());
    }
    let res = cmd
        .output()
        .map_err(|e| format!("{py} cannot be run: {e}"))?;
    if !res.status.success() {
        let err = String::from_utf8_lossy(&res.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        return Err(format!(
            "transformers failed on {}: {}",
            hf.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        ));
    }
    let mut d = load_dump(&out.0)?;
    d.source = format!("transformers on {}", hf.display());
    d.truncated = layers.is_some();
    Ok(d)
}
