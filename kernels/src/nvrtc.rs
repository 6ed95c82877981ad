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
        s.push_str(text);
        s.push('\n');
    }
    s
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
