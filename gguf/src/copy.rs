//! Streaming tensor bytes between files without holding them in memory: `copy_file_range` where
//! the kernel allows it (same filesystem, reflink-capable or not), a bounded pread/pwrite loop
//! otherwise. Memory stays at one buffer whatever the tensor size.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// Size of the fallback copy buffer.
pub const COPY_BUF: usize = 8 << 20;

/// How bytes were moved (reported by `merge --json`, useful when comparing with `cat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    CopyFileRange,
    Buffered,
}

/// Copies ranges between files, remembering whether `copy_file_range` works for this pair of
/// filesystems so the fallback decision is made once.
pub struct Copier {
    use_cfr: bool,
    buf: Vec<u8>,
}

impl Default for Copier {
    fn default() -> Self {
        Self::new()
    }
}

impl Copier {
    pub fn new() -> Self {
        Copier {
            use_cfr: true,
            buf: Vec::new(),
        }
    }

    pub fn method(&self) -> CopyMethod {
        if self.use_cfr {
            CopyMethod::CopyFileRange
        } else {
            CopyMethod::Buffered
        }
    }

    /// Copy `len` bytes from `src` at `src_off` to `dst` at `dst_off`, calling `progress` with
    /// the bytes done after each step (return `false` from it to abort with `Interrupted`).
    /// A source shorter than claimed is an `UnexpectedEof` error, never a silent short copy.
    pub fn copy(
        &mut self,
        src: &File,
        src_off: u64,
        dst: &File,
        dst_off: u64,
        len: u64,
        progress: &mut dyn FnMut(u64) -> bool,
    ) -> io::Result<()> {
        let mut done = 0u64;
        while done < len {
            let step = (len - done).min(1 << 30);
            let n = if self.use_cfr {
                match cfr(src, src_off + done, dst, dst_off + done, step) {
                    Ok(n) => n,
                    Err(e) if fallback_errno(&e) => {
                        self.use_cfr = false;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            } else {
                self.buffered(
                    src,
                    src_off + done,
                    dst,
                    dst_off + done,
                    step.min(COPY_BUF as u64),
                )?
            };
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "source ended at byte {} while {} more bytes were expected",
                        src_off + done,
                        len - done
                    ),
                ));
            }
            done += n;
            if !progress(n) {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "interrupted"));
            }
        }
        Ok(())
    }

    fn buffered(
        &mut self,
        src: &File,
        so: u64,
        dst: &File,
        doff: u64,
        len: u64,
    ) -> io::Result<u64> {
        if self.buf.len() < COPY_BUF {
            self.buf.resize(COPY_BUF, 0);
        }
        let buf = &mut self.buf[..len as usize];
        let mut got = 0;
        while got < buf.len() {
            match src.read_at(&mut buf[got..], so + got as u64) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        dst.write_all_at(&buf[..got], doff)?;
        Ok(got as u64)
    }
}

fn fallback_errno(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP | libc::EBADF)
    )
}

fn cfr(src: &File, so: u64, dst: &File, doff: u64, len: u64) -> io::Result<u64> {
    let mut off_in = so as libc::loff_t;
    let mut off_out = doff as libc::loff_t;
    loop {
        // SAFETY: both fds are open for the duration of the call; offsets are passed by pointer
        // so the files' own positions are untouched.
        let r = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                len as usize,
                0,
            )
        };
        if r >= 0 {
            return Ok(r as u64);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// sha256 of a byte range of a file, read in bounded pieces (no mmap, so hashing a 400 GB model
/// does not grow the resident set).
pub fn sha256_range(f: &File, offset: u64, len: u64) -> io::Result<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut buf = vec![0u8; (len as usize).min(COPY_BUF)];
    let mut done = 0u64;
    while done < len {
        let k = ((len - done) as usize).min(buf.len());
        f.read_exact_at(&mut buf[..k], offset + done)?;
        h.update(&buf[..k]);
        done += k as u64;
    }
    Ok(h.finalize().into())
}

/// Write `n` zero bytes at `offset`.
pub fn write_zeros_at(f: &File, offset: u64, n: u64) -> io::Result<()> {
    const Z: [u8; 4096] = [0; 4096];
    let mut done = 0;
    while done < n {
        let k = (n - done).min(Z.len() as u64) as usize;
        f.write_all_at(&Z[..k], offset + done)?;
        done += k as u64;
    }
    Ok(())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
