//! Run-time compilation of the kernel sources with NVRTC, straight to CUBIN for one GPU architecture.
//!
//! cudarc's `compile_ptx_with_opts` only returns PTX, which the driver would JIT again at load; we
//! ask NVRTC for the CUBIN of the exact `sm_XY` of the device instead (no driver JIT, and the same
//! path compiles for any arch on a machine without a GPU, which the compile-check test uses).

use std::ffi::{c_char, CString};

use cudarc::nvrtc::{result, sys};

use crate::error::KernelError;
use crate::ops::Op;

/// Whether `libnvrtc` can be loaded. Every other function here needs it (cudarc panics otherwise).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen candidate library names.
    unsafe { sys::is_culib_present() }
}

fn nvrtc_err(what: &'static str) -> impl FnOnce(result::NvrtcError) -> KernelError {
    move |source| KernelError::Nvrtc { what, source }
}

/// The NVRTC library version, `(major, minor)`.
pub fn version() -> Result<(i32, i32), KernelError> {
    if !available() {
        return Err(KernelError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(nvrtc_err("nvrtcVersion"))?;
    Ok((major, minor))
}

/// The `sm_XY` numbers (`90`, `120`, ...) this NVRTC can produce CUBINs for.
pub fn supported_archs() -> Result<Vec<i32>, KernelError> {
    if !available() {
        return Err(KernelError::NoNvrtc);
    }
    let mut n = 0;
    // SAFETY: out-parameter, then a buffer of exactly the size NVRTC reported.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(nvrtc_err("nvrtcGetNumSupportedArchs"))?;
    let mut archs = vec![0i32; n.max(0) as usize];
    if !archs.is_empty() {
        unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(nvrtc_err("nvrtcGetSupportedArchs"))?;
    }
    Ok(archs)
}

/// The NVRTC architecture name for a compute capability: `sm_90` for 9.0, `sm_120` for 12.0.
pub fn arch_name(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// One op compiled for one architecture.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub op: Op,
    pub arch: String,
    /// Device code ready for `cuModuleLoadData`.
    pub cubin: Vec<u8>,
    /// The PTX of the same compilation (for inspection: entry names, instructions).
    pub ptx: String,
    /// NVRTC's log (warnings; with `verbose`, ptxas' register/spill report).
    pub log: String,
}

/// The options every op is compiled with. No `--use_fast_math`: approximate division, sqrt and
/// flush-to-zero would break agreement with the CPU oracle (gpu-kernels.md §8).
fn options(op: Op, arch: &str, verbose: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ];
    if !op.allow_fma() {
        // The dequantizers must reproduce the CPU oracle's `scale * q` products exactly.
        o.push("--fmad=false".to_string());
    }
    if verbose {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

/// The full source NVRTC sees for an op: the shared prelude, the headers the op needs, then
/// the op's own file, each under a `#line` directive so compiler messages name the real file.
pub fn full_source(op: Op) -> String {
    let mut s = String::new();
    for (name, text) in op.sections() {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(&text);
        s.push('\n');
    }
    s
}

/// 64-bit FNV-1a with a chosen basis (two bases give the 128-bit cache key).
fn fnv(basis: u64, parts: &[&[u8]]) -> u64 {
    let mut h = basis;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Directory of the on-disk CUBIN cache: `$GGUFTOOL_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/gguftool/kernels`, else `~/.cache/gguftool/kernels`; `None` when no home.
fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(d) = std::env::var_os("GGUFTOOL_KERNEL_CACHE") {
        return (!d.is_empty()).then(|| d.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?;
    Some(base.join("gguftool").join("kernels"))
}

const CACHE_MAGIC: &[u8; 8] = b"GGTKC001";

/// [`compile`] through the on-disk cache, keyed by the full source, the options, the arch and
/// the NVRTC version (a kernel edit, another GPU or another CUDA never hits a stale entry).
/// Cache I/O failures only cost a compilation.
pub fn compile_cached(op: Op, arch: &str) -> Result<Compiled, KernelError> {
    let src = full_source(op);
    let opts = options(op, arch, false).join(" ");
    let ver = version()
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_default();
    let parts: [&[u8]; 4] = [
        src.as_bytes(),
        opts.as_bytes(),
        arch.as_bytes(),
        ver.as_bytes(),
    ];
    let key = format!(
        "{}-{arch}-{:016x}{:016x}.bin",
        op.name(),
        fnv(0xcbf2_9ce4_8422_2325, &parts),
        fnv(0x6c62_272e_07bb_0142, &parts)
    );
    let path = cache_dir().map(|d| d.join(key));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if let Some(c) = decode_cache(op, arch, &bytes) {
                return Ok(c);
            }
        }
    }
    let c = compile(op, arch, false)?;
    if let Some(p) = &path {
        let mut out = Vec::with_capacity(16 + c.ptx.len() + c.cubin.len());
        out.extend_from_slice(CACHE_MAGIC);
        out.extend_from_slice(&(c.ptx.len() as u64).to_le_bytes());
        out.extend_from_slice(c.ptx.as_bytes());
        out.extend_from_slice(&c.cubin);
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // Written aside and renamed, so a concurrent reader never sees half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &out).is_ok() && std::fs::rename(&tmp, p).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(c)
}

fn decode_cache(op: Op, arch: &str, b: &[u8]) -> Option<Compiled> {
    if b.len() < 16 || &b[..8] != CACHE_MAGIC {
        return None;
    }
    let n = u64::from_le_bytes(b[8..16].try_into().ok()?) as usize;
    let ptx = std::str::from_utf8(b.get(16..16usize.checked_add(n)?)?).ok()?;
    let cubin = b.get(16 + n..)?;
    if cubin.is_empty() {
        return None;
    }
    Some(Compiled {
        op,
        arch: arch.to_string(),
        cubin: cubin.to_vec(),
        ptx: ptx.to_string(),
        log: String::new(),
    })
}

/// Compile one op's CUDA C for `arch` (`"sm_90"`, ...). `verbose` adds ptxas' resource report to the log.
pub fn compile(op: Op, arch: &str, verbose: bool) -> Result<Compiled, KernelError> {
    if !available() {
        return Err(KernelError::NoNvrtc);
    }
    let src = CString::new(full_source(op)).map_err(|_| KernelError::Compile {
        op: op.name(),
        arch: arch.to_string(),
        log: "kernel source contains a NUL byte".to_string(),
    })?;
    let name = CString::new(op.file_name()).unwrap_or_default();
    let prog =
        result::create_program(&src, Some(&name)).map_err(nvrtc_err("nvrtcCreateProgram"))?;
    let guard = ProgramGuard(prog);
    let opts = options(op, arch, verbose);
    // SAFETY: `prog` is a live program (dropped by `guard` after the last use below).
    let compiled = unsafe { result::compile_program(guard.0, &opts) };
    let log = program_log(guard.0);
    if let Err(e) = compiled {
        let log = if log.trim().is_empty() {
            format!("{e} (no log)")
        } else {
            log
        };
        return Err(KernelError::Compile {
            op: op.name(),
            arch: arch.to_string(),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: compiled program; the buffer has exactly the reported size.
    unsafe { sys::nvrtcGetCUBINSize(guard.0, &mut size) }
        .result()
        .map_err(nvrtc_err("nvrtcGetCUBINSize"))?;
    let mut cubin = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(guard.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(nvrtc_err("nvrtcGetCUBIN"))?;
    // SAFETY: compiled program.
    let ptx = unsafe { result::get_ptx(guard.0) }.map_err(nvrtc_err("nvrtcGetPTX"))?;
    let ptx: Vec<u8> = ptx
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(Compiled {
        op,
        arch: arch.to_string(),
        cubin,
        ptx: String::from_utf8_lossy(&ptx).into_owned(),
        log,
    })
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    // SAFETY: live program.
    match unsafe { result::get_program_log(prog) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(log unavailable: {e})"),
    }
}

struct ProgramGuard(sys::nvrtcProgram);

impl Drop for ProgramGuard {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed exactly once here; a failure to free
        // is not actionable in drop.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}
