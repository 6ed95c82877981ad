//! The output layer every writing command goes through (merge, split, convert, synth, verify's
//! report, quantize, edit): an output appears under its final name only when complete, and
//! `--force` only ever replaces what this tool could have written.
//!
//! Rules (docs/ARCHITECTURE.md, "Invariants"):
//! - A file output is written to a unique temporary sibling (`NAME.<pid>.<n>.partial`, created
//!   with `O_EXCL`), fsynced and renamed over the target. Two concurrent writers never share a
//!   temporary; the last rename wins and the target is always one complete file. Without
//!   `--force` the rename itself refuses to replace (`RENAME_NOREPLACE`), so a race cannot
//!   clobber a file that appeared meanwhile.
//! - Only an absent path or a regular file is ever replaced. Directories, symlinks, FIFOs,
//!   sockets and device nodes (`/dev/full`) are refused up front, before any work is done, and
//!   checked again right before the rename.
//! - A directory output ([`AtomicDir`]) is written as `DIR.<pid>.<n>.partial/` holding a marker
//!   file ([`MARKER`]); `--force` replaces an existing `DIR` only when it carries that marker or is
//!   empty, and never `/`, the home directory, the working directory or one of its ancestors, nor
//!   a directory that contains an input. The swap is an atomic exchange (`RENAME_EXCHANGE`, or
//!   two renames where the filesystem lacks it); the old contents are deleted last.
//! - Every temporary is registered; SIGINT, SIGTERM and SIGHUP set a flag that long loops poll
//!   ([`check_interrupted`]) so they unwind and drop (delete) their temporaries. A second signal,
//!   or a loop that does not poll within [`GRACE`], removes the registered temporaries from the
//!   signal thread and exits with 128 + the signal number.

use anyhow::{bail, Context, Result};
use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Name of the file that marks a directory as written by gguftool (JSON: tool, version).
pub const MARKER: &str = ".gguftool-output";

/// How long the signal thread waits for the interrupted command to clean up by itself.
pub const GRACE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Temporaries and signals

static TEMPORARIES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static SIGNAL: AtomicI32 = AtomicI32::new(0);
static SEQ: AtomicU64 = AtomicU64::new(0);

fn register(p: &Path) {
    if let Ok(mut v) = TEMPORARIES.lock() {
        v.push(p.to_path_buf());
    }
}

fn unregister(p: &Path) {
    if let Ok(mut v) = TEMPORARIES.lock() {
        v.retain(|q| q != p);
    }
}

/// Delete every registered temporary (files and directories this process created with
/// `O_EXCL` / `mkdir`, so nothing else). Called on signals and on fatal broken pipes.
pub fn remove_temporaries() {
    let paths = match TEMPORARIES.lock() {
        Ok(mut v) => std::mem::take(&mut *v),
        Err(_) => return,
    };
    for p in paths {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {
                let _ = std::fs::remove_dir_all(&p);
            }
            Ok(_) => {
                let _ = std::fs::remove_file(&p);
            }
            Err(_) => {}
        }
    }
}

/// The command was stopped by a signal; `main` exits with 128 + `signal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted {
    pub signal: i32,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", signal_name(self.signal))
    }
}

impl std::error::Error for Interrupted {}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        libc::SIGPIPE => "SIGPIPE",
        _ => "a signal",
    }
}

/// Route SIGINT, SIGTERM and SIGHUP to a flag that long-running loops poll, so they can clean
/// up their temporaries; see the module doc for the second signal and the grace period.
pub fn install_interrupt_handler() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            return;
        };
        let _ = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut iter = signals.forever();
                let Some(first) = iter.next() else { return };
                SIGNAL.store(first, Ordering::SeqCst);
                // The command polls the flag and cleans up by itself; if it has not exited
                // after the grace period, or a second signal comes, do it from here.
                std::thread::spawn(move || {
                    std::thread::sleep(GRACE);
                    give_up(first);
                });
                if iter.next().is_some() {
                    give_up(first);
                }
            });
    });
}

fn give_up(signal: i32) -> ! {
    remove_temporaries();
    eprintln!("error: {}", Interrupted { signal });
    std::process::exit(128 + signal)
}

/// The signal that interrupted the command, if one did.
pub fn pending_signal() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `Err(Interrupted)` once a signal arrived (see [`install_interrupt_handler`]).
pub fn check_interrupted() -> Result<()> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => Ok(()),
        signal => Err(Interrupted { signal }.into()),
    }
}

/// Test hook for `cli/tests/output_safety.rs`: with `GGUFTOOL_TEST_HOLD_COMMIT=poll:MS` (or
/// `nopoll:MS`) a commit first waits MS milliseconds, polling for signals (or not), so a test can
/// deliver a signal, or run a second writer, while a temporary exists.
fn test_hold() -> Result<()> {
    let Some(v) = std::env::var("GGUFTOOL_TEST_HOLD_COMMIT").ok() else {
        return Ok(());
    };
    let (mode, ms) = v.split_once(':').unwrap_or((v.as_str(), "20000"));
    let ms: u64 = ms.parse().unwrap_or(20_000);
    eprintln!("holding before commit");
    for _ in 0..ms.div_ceil(10) {
        if mode == "poll" {
            check_interrupted()?;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// A unique sibling of `target`: `NAME.<pid>.<n>.<suffix>`.
fn unique_sibling(target: &Path, suffix: &str) -> Result<PathBuf> {
    let name = target
        .file_name()
        .with_context(|| format!("{} is not a file path", target.display()))?;
    let mut s: OsString = name.to_os_string();
    s.push(format!(
        ".{}.{}.{suffix}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    Ok(target.with_file_name(s))
}

use gguf::model::file_kind as kind_of;

/// Refuse an output that is one of the inputs (same device and inode, so hard links and other
/// spellings of the same path count).
pub fn refuse_input_as_output(output: &Path, inputs: &[&Path]) -> Result<()> {
    for i in inputs {
        if same_file(i, output) {
            bail!(
                "output {} is the input {}; write to another path",
                output.display(),
                i.display()
            );
        }
    }
    Ok(())
}

/// Same file on disk (device + inode).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Check that a file output may be written at `target`: absent, or (with `force`) a regular
/// file. Call it before expensive work so a bad target fails first; [`PartialFile::create`]
/// repeats it.
pub fn check_output_file(target: &Path, force: bool) -> Result<()> {
    match std::fs::symlink_metadata(target) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot inspect {}", target.display())),
        Ok(m) if m.file_type().is_file() => {
            if force {
                Ok(())
            } else {
                bail!("{} exists (use --force to overwrite)", target.display())
            }
        }
        Ok(m) => bail!(
            "{} is {}; only a regular file is ever replaced{}",
            target.display(),
            kind_of(&m.file_type()),
            if m.is_dir() {
                " (give a file path inside the directory)"
            } else {
                ""
            }
        ),
    }
}

/// `rename` that refuses to replace an existing target (`RENAME_NOREPLACE`), falling back to a
/// check + rename on filesystems without it.
fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    match renameat2(from, to, libc::RENAME_NOREPLACE) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
            if std::fs::symlink_metadata(to).is_ok() {
                return Err(std::io::Error::from(ErrorKind::AlreadyExists));
            }
            std::fs::rename(from, to)
        }
        r => r,
    }
}

fn renameat2(from: &Path, to: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    let a = CString::new(from.as_os_str().as_bytes())?;
    let b = CString::new(to.as_os_str().as_bytes())?;
    // SAFETY: both are valid NUL-terminated paths; AT_FDCWD resolves them like rename(2).
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn sync_parent(p: &Path) {
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

// ---------------------------------------------------------------------------------------------
// Files

/// A file output written to a unique temporary beside its final path and renamed into place by
/// [`PartialFile::commit`] after an fsync. Dropped without commit (error, interrupt), the
/// temporary is removed.
pub struct PartialFile {
    pub file: File,
    partial: PathBuf,
    target: PathBuf,
    force: bool,
    committed: bool,
}

impl PartialFile {
    /// Check `target` ([`check_output_file`]) and create the temporary.
    pub fn create(target: &Path, force: bool) -> Result<PartialFile> {
        check_output_file(target, force)?;
        let partial = unique_sibling(target, "partial")?;
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&partial)
            .with_context(|| format!("cannot create {}", partial.display()))?;
        register(&partial);
        Ok(PartialFile {
            file,
            partial,
            target: target.to_path_buf(),
            force,
            committed: false,
        })
    }

    pub fn partial_path(&self) -> &Path {
        &self.partial
    }

    /// fsync the data, re-check the target, rename over it, fsync the directory.
    pub fn commit(mut self) -> Result<()> {
        test_hold()?;
        check_interrupted()?;
        self.file
            .sync_all()
            .with_context(|| format!("fsync {}", self.partial.display()))?;
        // The target may have changed since `create` (a FIFO made meanwhile): check again.
        check_output_file(&self.target, self.force)?;
        let renamed = if self.force {
            std::fs::rename(&self.partial, &self.target)
        } else {
            rename_noreplace(&self.partial, &self.target)
        };
        renamed.map_err(|e| {
            if e.kind() == ErrorKind::AlreadyExists {
                anyhow::anyhow!(
                    "{} appeared while writing (use --force to overwrite)",
                    self.target.display()
                )
            } else {
                anyhow::Error::new(e).context(format!(
                    "rename {} -> {}",
                    self.partial.display(),
                    self.target.display()
                ))
            }
        })?;
        self.committed = true;
        unregister(&self.partial);
        sync_parent(&self.target);
        Ok(())
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.partial);
            unregister(&self.partial);
        }
    }
}

/// Several files that appear together or not at all (split's shards): each is written as a
/// [`PartialFile`]; [`PartialSet::commit`] renames them only once every one is complete.
#[derive(Default)]
pub struct PartialSet {
    files: Vec<PartialFile>,
}

impl PartialSet {
    pub fn push(&mut self, f: PartialFile) -> &PartialFile {
        self.files.push(f);
        &self.files[self.files.len() - 1]
    }

    /// Rename every file into place. A failure part-way leaves the ones already renamed (they
    /// are complete files) and removes the rest.
    pub fn commit(self) -> Result<()> {
        for f in self.files {
            f.commit()?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Directories

/// A directory output: written into a unique temporary directory (holding [`MARKER`]) and
/// swapped into place by [`AtomicDir::commit`]; see the module doc for what `force` may replace.
pub struct AtomicDir {
    tmp: PathBuf,
    target: PathBuf,
    force: bool,
    committed: bool,
}

impl AtomicDir {
    /// Check `target` against `inputs` ([`check_output_dir`]) and create the temporary directory.
    pub fn create(target: &Path, force: bool, inputs: &[&Path]) -> Result<AtomicDir> {
        check_output_dir(target, force, inputs)?;
        let tmp = unique_sibling(target, "partial")?;
        std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        register(&tmp);
        let d = AtomicDir {
            tmp,
            target: target.to_path_buf(),
            force,
            committed: false,
        };
        let marker = serde_json::json!({
            "tool": "gguftool",
            "version": env!("CARGO_PKG_VERSION"),
            "note": "written by gguftool; `--force` may replace this directory",
        });
        std::fs::write(d.tmp.join(MARKER), format!("{marker}\n"))
            .with_context(|| format!("cannot write {}", d.tmp.join(MARKER).display()))?;
        Ok(d)
    }

    /// The directory to write into (the temporary until commit).
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// Swap the finished directory into place; the replaced one (if any) is deleted last.
    pub fn commit(mut self) -> Result<()> {
        test_hold()?;
        check_interrupted()?;
        if let Ok(d) = File::open(&self.tmp) {
            let _ = d.sync_all();
        }
        // Whatever is at the target now must still be replaceable.
        check_output_dir(&self.target, self.force, &[])?;
        let exists = std::fs::symlink_metadata(&self.target).is_ok();
        if !exists {
            rename_noreplace(&self.tmp, &self.target).with_context(|| {
                format!("rename {} -> {}", self.tmp.display(), self.target.display())
            })?;
        } else {
            match renameat2(&self.tmp, &self.target, libc::RENAME_EXCHANGE) {
                Ok(()) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                    // No atomic exchange here: move the old one aside, the new one in, and put
                    // the old one back if that fails.
                    let old = unique_sibling(&self.target, "old")?;
                    std::fs::rename(&self.target, &old).with_context(|| {
                        format!("rename {} -> {}", self.target.display(), old.display())
                    })?;
                    register(&old);
                    if let Err(e) = std::fs::rename(&self.tmp, &self.target) {
                        unregister(&old);
                        let _ = std::fs::rename(&old, &self.target);
                        return Err(e).with_context(|| {
                            format!("rename {} -> {}", self.tmp.display(), self.target.display())
                        });
                    }
                    unregister(&self.tmp);
                    self.tmp = old;
                    register(&self.tmp);
                }
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!(
                            "exchange {} <-> {}",
                            self.tmp.display(),
                            self.target.display()
                        )
                    })
                }
            }
        }
        self.committed = true;
        sync_parent(&self.target);
        if exists {
            // `self.tmp` now names the replaced directory: it was ours (marker) or empty.
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
        unregister(&self.tmp);
        Ok(())
    }
}

impl Drop for AtomicDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp);
            unregister(&self.tmp);
        }
    }
}

/// Absolute, lexically normalized form of `p` with symlinks of the existing prefix resolved.
fn resolve(p: &Path) -> Result<PathBuf> {
    if let Ok(c) = p.canonicalize() {
        return Ok(c);
    }
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .context("cannot read the working directory")?
            .join(p)
    };
    // The output may not exist yet: resolve its parent and re-attach the name.
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => Ok(resolve(parent)?.join(name)),
        _ => Ok(abs),
    }
}

/// Check that a directory output may be written at `target`: absent, or (with `force`) an empty
/// directory or one holding [`MARKER`]; never `/`, the home directory, the working directory or
/// an ancestor of it, and never a path that is or contains one of `inputs`.
pub fn check_output_dir(target: &Path, force: bool, inputs: &[&Path]) -> Result<()> {
    let shown = target.display();
    let abs = resolve(target)?;
    if abs.parent().is_none() {
        bail!("refusing to write the output directory {shown}: it is the filesystem root");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        if resolve(Path::new(&home)).is_ok_and(|h| h == abs) {
            bail!("refusing to write the output directory {shown}: it is the home directory");
        }
    }
    if let Ok(cwd) = std::env::current_dir().and_then(|c| c.canonicalize()) {
        if cwd.starts_with(&abs) {
            bail!(
                "refusing to write the output directory {shown}: it is the working directory or contains it"
            );
        }
    }
    for i in inputs {
        if let Ok(ri) = resolve(i) {
            if ri.starts_with(&abs) {
                bail!(
                    "refusing to write the output directory {shown}: the input {} is inside it",
                    i.display()
                );
            }
        }
    }
    let m = match std::fs::symlink_metadata(target) {
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {shown}")),
        Ok(m) => m,
    };
    if !m.is_dir() {
        bail!(
            "{shown} is {}; the output must be a directory",
            kind_of(&m.file_type())
        );
    }
    if !force {
        bail!("{shown} exists (use --force to replace it)");
    }
    let mut entries = std::fs::read_dir(target).with_context(|| format!("cannot read {shown}"))?;
    let empty = entries.next().is_none();
    if !empty && !target.join(MARKER).is_file() {
        bail!(
            "refusing to replace {shown}: it is not empty and was not written by gguftool (no {MARKER} file); remove it yourself or choose another directory"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    /// `remove_temporaries` removes every temporary of the process: tests that make temporaries
    /// run one at a time so one test's cleanup never deletes another's `.partial`.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static LOCK: Mutex<()> = Mutex::new(());
        LOCK.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn file_appears_only_on_commit_and_temporaries_are_unique() {
        let _serial = serial();
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("out.gguf");
        let a = PartialFile::create(&t, false).unwrap();
        let b = PartialFile::create(&t, false).unwrap();
        assert_ne!(a.partial_path(), b.partial_path());
        std::fs::write(a.partial_path(), b"a").unwrap();
        std::fs::write(b.partial_path(), b"b").unwrap();
        assert!(!t.exists());
        a.commit().unwrap();
        assert_eq!(std::fs::read(&t).unwrap(), b"a");
        // Without force the second writer must not replace what the first wrote.
        assert!(b.commit().is_err());
        assert_eq!(std::fs::read(&t).unwrap(), b"a");
        assert_eq!(names(d.path()), vec!["out.gguf"]);
    }

    #[test]
    fn dropped_file_leaves_nothing() {
        let _serial = serial();
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("x");
        drop(PartialFile::create(&t, false).unwrap());
        assert!(names(d.path()).is_empty());
    }

    #[test]
    fn only_regular_files_are_replaced() {
        let _serial = serial();
        let d = tempfile::tempdir().unwrap();
        let reg = d.path().join("reg");
        std::fs::write(&reg, b"old").unwrap();
        assert!(check_output_file(&reg, false).is_err());
        check_output_file(&reg, true).unwrap();
        let dir = d.path().join("dir");
        std::fs::create_dir(&dir).unwrap();
        let e = check_output_file(&dir, true).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let fifo = d.path().join("fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = check_output_file(&fifo, true).unwrap_err().to_string();
        assert!(e.contains("FIFO"), "{e}");
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&reg, &link).unwrap();
        assert!(check_output_file(&link, true).is_err());
        assert!(check_output_file(Path::new("/dev/null"), true).is_err());
        assert!(PartialFile::create(&fifo, true).is_err());
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
    }

    #[test]
    fn registered_temporaries_are_removed() {
        let _serial = serial();
        let d = tempfile::tempdir().unwrap();
        let f = PartialFile::create(&d.path().join("x"), false).unwrap();
        let dir = AtomicDir::create(&d.path().join("y"), false, &[]).unwrap();
        let (fp, dp) = (f.partial_path().to_path_buf(), dir.path().to_path_buf());
        remove_temporaries();
        assert!(!fp.exists() && !dp.exists());
        std::mem::forget(f);
        std::mem::forget(dir);
    }

    #[test]
    fn directory_swap_keeps_foreign_files_safe() {
        let _serial = serial();
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out");
        // First write: absent target.
        let w = AtomicDir::create(&out, false, &[]).unwrap();
        std::fs::write(w.path().join("a"), b"1").unwrap();
        w.commit().unwrap();
        assert_eq!(names(&out), vec![MARKER, "a"]);
        // Replacing our own output needs --force, and the old contents go.
        assert!(AtomicDir::create(&out, false, &[]).is_err());
        let w = AtomicDir::create(&out, true, &[]).unwrap();
        std::fs::write(w.path().join("b"), b"2").unwrap();
        w.commit().unwrap();
        assert_eq!(names(&out), vec![MARKER, "b"]);
        assert_eq!(names(d.path()), vec!["out"]);
        // A directory we did not write is refused even with --force...
        let foreign = d.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("notes"), b"keep").unwrap();
        let e = AtomicDir::create(&foreign, true, &[]).err().unwrap();
        assert!(e.to_string().contains("not written by gguftool"), "{e}");
        assert_eq!(names(&foreign), vec!["notes"]);
        // ...unless it is empty.
        let empty = d.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        AtomicDir::create(&empty, true, &[])
            .unwrap()
            .commit()
            .unwrap();
        assert_eq!(names(&empty), vec![MARKER]);
    }

    #[test]
    fn directory_containing_an_input_is_refused() {
        let _serial = serial();
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("d");
        std::fs::create_dir(&out).unwrap();
        let model = out.join("model.gguf");
        std::fs::write(&model, b"model").unwrap();
        std::fs::write(out.join(MARKER), b"{}").unwrap();
        let e = AtomicDir::create(&out, true, &[&model]).err().unwrap();
        assert!(e.to_string().contains("inside it"), "{e}");
        // A relative spelling of the same input is caught too.
        let rel = out.join("..").join("d").join("model.gguf");
        assert!(AtomicDir::create(&out, true, &[&rel]).is_err());
        assert_eq!(std::fs::read(&model).unwrap(), b"model");
    }

    #[test]
    fn special_directories_are_refused() {
        let _serial = serial();
        assert!(check_output_dir(Path::new("/"), true, &[]).is_err());
        assert!(check_output_dir(Path::new("."), true, &[]).is_err());
        let cwd = std::env::current_dir().unwrap();
        assert!(check_output_dir(cwd.parent().unwrap(), true, &[]).is_err());
        if let Some(h) = std::env::var_os("HOME") {
            assert!(check_output_dir(Path::new(&h), true, &[]).is_err());
        }
    }
}
