//! Runs the project's CUDA C kernels on the CPU, so their logic (indexing, warp collectives,
//! shared memory, barriers, quantized arithmetic) can be checked against CPU oracles on a machine
//! without a GPU.
//!
//! A [`Module`] is one kernel module's full source, exactly as NVRTC compiles it
//! ([`kernels::nvrtc::full_source`]), compiled by the host C++ compiler with the shim
//! `cuda_emu.h` force-included and `GGUFTOOL_EMU` defined (the few inline-assembly sites of the
//! kernels have a host alternative under it), linked with the scheduler `runtime.cpp` into a
//! shared library, cached on disk and loaded. [`Module::launch`] runs a grid: blocks one after
//! another, the threads of a block as fibers on the calling OS thread, switched only at barriers
//! and warp collectives, so a launch is deterministic. Undefined behaviour that the GPU would
//! hide (divergent warp collectives, shuffles reading exited lanes, deadlocks) is reported as
//! [`EmuError::Launch`] naming the kernel, block and thread.
//!
//! What it does not emulate: the GPU's speed and memory-model races (nothing runs concurrently),
//! waiting on other blocks or other GPUs (the blocks run one after another; `allreduce.cu` is
//! refused), FMA contraction (products are rounded separately here, the GPU may fuse them) and
//! the exact bits of transcendental functions (glibc's, not CUDA's). See docs/GPU.md.

use std::any::Any;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use kernels::ops::Op;
use sha2::{Digest, Sha256};

/// The shim that makes NVRTC-flavoured CUDA C compile as C++ on the host.
const SHIM: &str = include_str!("../cuda_emu.h");
/// The scheduler: fibers, barriers, warp collectives, fault reports.
const RUNTIME: &str = include_str!("../runtime.cpp");
/// Gathers the kernel object's shared variables into the section the runtime poisons.
const LINKER_SCRIPT: &str = include_str!("../emu.ld");

/// The runtime object's extra arguments (it needs system headers, not the kernel-facing shim).
const RUNTIME_ARGS: &[&str] = &["-c", "-DGGUFTOOL_EMU_RUNTIME"];
/// The kernel object's: each static in its own section, for emu.ld.
const KERNEL_ARGS: &[&str] = &["-c", "-fdata-sections"];

/// Flags of every compilation. -ffp-contract=off: the host never fuses a product into an FMA,
/// on any architecture (results do not depend on the build machine). -fno-strict-aliasing: the
/// kernels reinterpret byte buffers as wider words, as CUDA code does.
const FLAGS: &[&str] = &[
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fno-threadsafe-statics",
    "-DGGUFTOOL_EMU",
];

/// Everything that can fail between a source and a finished launch.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    #[error("no C++ compiler: set $CXX or install g++")]
    NoCompiler,
    #[error("could not run the C++ compiler `{cmd}`")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    /// The compiler rejected the source: its messages (file names and lines from the source's
    /// `#line` directives) are included.
    #[error("compiling `{name}` for the emulator failed:\n{log}")]
    Compile { name: String, log: String },
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not load the emulated module {}", path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: libloading::Error,
    },
    #[error("no symbol `{symbol}` in the emulated module `{module}`")]
    Symbol {
        symbol: String,
        module: String,
        #[source]
        source: libloading::Error,
    },
    #[error("`{symbol}`: an entry is taken as a function pointer, not a {size}-byte type")]
    NotAPointer { symbol: String, size: usize },
    #[error("a name with a NUL byte: {0:?}")]
    Nul(String),
    #[error("op `{op}` is not emulated: {why}")]
    Unsupported { op: &'static str, why: &'static str },
    /// A launch was refused (configuration) or stopped (misuse of a collective, deadlock): the
    /// emulator's message names the kernel, block and thread.
    #[error("{0}")]
    Launch(String),
}

/// The compiler command: `$CXX` (split on whitespace, so `ccache g++` works), else the first of
/// `c++`, `g++` that runs.
fn compiler() -> Option<&'static (Vec<String>, String)> {
    static CXX: OnceLock<Option<(Vec<String>, String)>> = OnceLock::new();
    CXX.get_or_init(|| {
        let mut candidates: Vec<Vec<String>> = Vec::new();
        if let Ok(cxx) = std::env::var("CXX") {
            let parts: Vec<String> = cxx.split_whitespace().map(str::to_string).collect();
            if !parts.is_empty() {
                candidates.push(parts);
            }
        }
        candidates.push(vec!["c++".to_string()]);
        candidates.push(vec!["g++".to_string()]);
        candidates.into_iter().find_map(|cmd| {
            let out = Command::new(&cmd[0])
                .args(&cmd[1..])
                .arg("--version")
                .output()
                .ok()?;
            // The version text is part of every cache key: another compiler never reuses a
            // library built by this one.
            out.status
                .success()
                .then(|| (cmd, String::from_utf8_lossy(&out.stdout).into_owned()))
        })
    })
    .as_ref()
}

/// Whether a C++ compiler runs here (the emulator needs one to build modules).
pub fn available() -> bool {
    compiler().is_some()
}

fn hex_hash(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `$GGUFTOOL_EMU_CACHE`, else `emu-cache` in the cargo target directory the running binary
/// lives in (found by cargo's CACHEDIR.TAG), else the system temporary directory.
fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GGUFTOOL_EMU_CACHE").filter(|d| !d.is_empty()) {
        return d.into();
    }
    if let Ok(exe) = std::env::current_exe() {
        if let Some(t) = exe.ancestors().find(|a| a.join("CACHEDIR.TAG").is_file()) {
            return t.join("emu-cache");
        }
    }
    std::env::temp_dir().join("gguftool-emu-cache")
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EmuError {
    let path = path.to_path_buf();
    move |source| EmuError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// A name unique to this process and call, for files written aside and renamed into place (two
/// processes building the same module at once each rename a complete file).
fn aside(path: &Path) -> PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".tmp{}-{n}", std::process::id()));
    PathBuf::from(s)
}

fn write_once(path: &Path, text: &str) -> Result<(), EmuError> {
    if path.is_file() {
        return Ok(());
    }
    let tmp = aside(path);
    std::fs::write(&tmp, text).map_err(io_err("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("renaming into", path))
}

/// Runs the compiler with `args`, producing `out` (written aside, then renamed).
fn compile(name: &str, args: &[&str], out: &Path) -> Result<(), EmuError> {
    let (cmd, _) = compiler().ok_or(EmuError::NoCompiler)?;
    let tmp = aside(out);
    let result = Command::new(&cmd[0])
        .args(&cmd[1..])
        .args(FLAGS)
        .args(args)
        .arg("-o")
        .arg(&tmp)
        .output()
        .map_err(|source| EmuError::Spawn {
            cmd: cmd.join(" "),
            source,
        })?;
    if !result.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(EmuError::Compile {
            name: name.to_string(),
            log: String::from_utf8_lossy(&result.stderr).into_owned(),
        });
    }
    // Warnings the specific -Wno flags did not silence are worth seeing.
    if !result.stderr.is_empty() {
        let _ = std::io::stderr().write_all(&result.stderr);
    }
    std::fs::rename(&tmp, out).map_err(io_err("renaming into", out))
}

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    usize,
    extern "C" fn(*mut c_void),
    *mut c_void,
) -> c_int;
type ErrorFn = unsafe extern "C" fn() -> *const c_char;

/// One loaded library. Libraries stay loaded for the life of the process (the scheduler keeps
/// fiber stacks per library; a second `Module` of the same source shares them).
struct Loaded {
    lib: libloading::Library,
    launch: LaunchFn,
    last_error: ErrorFn,
}

/// One launch at a time in the process: the scheduler's state is per library, and its fault
/// report swaps the process-wide signal handlers for the launch's duration (two launches of
/// different libraries on two threads would restore each other's).
static LAUNCH: Mutex<()> = Mutex::new(());

fn load(path: &Path, name: &str) -> Result<Arc<Loaded>, EmuError> {
    static LOADED: OnceLock<Mutex<HashMap<PathBuf, Arc<Loaded>>>> = OnceLock::new();
    let mut map = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(l) = map.get(path) {
        return Ok(l.clone());
    }
    // SAFETY: the library is one this crate compiled; its initializers only zero globals.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|source| EmuError::Load {
        path: path.to_path_buf(),
        source,
    })?;
    let sym = |s: &str| {
        let s = s.to_string();
        move |source| EmuError::Symbol {
            symbol: s,
            module: name.to_string(),
            source,
        }
    };
    // SAFETY: both symbols are runtime.cpp's, with exactly these signatures.
    let (launch, last_error) = unsafe {
        (
            *lib.get::<LaunchFn>(b"emu_launch")
                .map_err(sym("emu_launch"))?,
            *lib.get::<ErrorFn>(b"emu_last_error")
                .map_err(sym("emu_last_error"))?,
        )
    };
    let l = Arc::new(Loaded {
        lib,
        launch,
        last_error,
    });
    map.insert(path.to_path_buf(), l.clone());
    Ok(l)
}

/// A lock per cache key, so threads of one process never compile the same file twice (other
/// processes may: every file is written aside and renamed into place).
fn build_lock(key: &str) -> Arc<Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<String, Arc<Mutex<()>>>>> = OnceLock::new();
    LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(key.to_string())
        .or_default()
        .clone()
}

/// The scheduler object file, built once per (shim, runtime, flags, compiler).
fn runtime_object(dir: &Path, shim: &Path, cxx_version: &str) -> Result<PathBuf, EmuError> {
    let key = hex_hash(&[
        SHIM.as_bytes(),
        RUNTIME.as_bytes(),
        FLAGS.join(" ").as_bytes(),
        RUNTIME_ARGS.join(" ").as_bytes(),
        cxx_version.as_bytes(),
    ]);
    let obj = dir.join(format!("runtime-{key}.o"));
    let building = build_lock(&key);
    let _one = building.lock().unwrap_or_else(|p| p.into_inner());
    if obj.is_file() {
        return Ok(obj);
    }
    let src = dir.join(format!("runtime-{key}.cpp"));
    write_once(&src, RUNTIME)?;
    let mut args = RUNTIME_ARGS.to_vec();
    args.extend(["-include", path_str(shim)?, "-x", "c++", path_str(&src)?]);
    compile("runtime.cpp", &args, &obj)?;
    Ok(obj)
}

fn path_str(p: &Path) -> Result<&str, EmuError> {
    p.to_str().ok_or_else(|| EmuError::Io {
        what: "a cache path that is not UTF-8:",
        path: p.to_path_buf(),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })
}

/// One kernel module compiled for the CPU and loaded.
pub struct Module {
    name: String,
    path: PathBuf,
    loaded: Arc<Loaded>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("name", &self.name)
            .field("path", &self.path)
            .finish()
    }
}

/// What the fibers of one launch share with the Rust side.
struct Body<'a> {
    body: &'a dyn Fn(),
    panic: Cell<Option<Box<dyn Any + Send>>>,
}

/// Called by the scheduler once per emulated thread, on that thread's fiber.
extern "C" fn run_body(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Body` that `launch` keeps alive until emu_launch returns; every
    // fiber runs on the launching OS thread, one at a time.
    let b = unsafe { &*(ctx as *const Body<'_>) };
    // A panic must not unwind through the scheduler's C frames: it is kept and resumed after the
    // launch. Threads after it still run (and exit at once) so the launch can end.
    let earlier = b.panic.take();
    if earlier.is_some() {
        b.panic.set(earlier);
        return;
    }
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (b.body)())) {
        b.panic.set(Some(p));
    }
}

impl Module {
    /// An op's module: `defines` (`#define NAME VALUE` lines) followed by
    /// [`kernels::nvrtc::full_source`], compiled with -O2 -fPIC -DGGUFTOOL_EMU and the shim,
    /// linked with the runtime into a shared library. Cached on disk by a hash of (source,
    /// flags, shim, runtime, linker script, compiler).
    pub fn build(op: Op, defines: &[(&str, &str)]) -> Result<Module, EmuError> {
        if op == Op::AllReduce {
            return Err(EmuError::Unsupported {
                op: op.name(),
                why: "its blocks spin on flags written by other GPUs",
            });
        }
        let mut src = String::new();
        for (k, v) in defines {
            src.push_str(&format!("#define {k} {v}\n"));
        }
        src.push_str(&kernels::nvrtc::full_source(op));
        let name = match op {
            Op::GemvQ(q) => format!("{}_{}", op.name(), q.suffix()),
            _ => op.name().to_string(),
        };
        Self::from_source(&name, &src)
    }

    /// A module from any CUDA C source (the emulator's self-tests, experiments). `name` names
    /// the cached files and error messages.
    pub fn from_source(name: &str, src: &str) -> Result<Module, EmuError> {
        let (_, version) = compiler().ok_or(EmuError::NoCompiler)?;
        let dir = cache_dir();
        std::fs::create_dir_all(&dir).map_err(io_err("creating", &dir))?;
        let shim = dir.join(format!("cuda_emu-{}.h", hex_hash(&[SHIM.as_bytes()])));
        write_once(&shim, SHIM)?;
        let rt = runtime_object(&dir, &shim, version)?;
        let ld = dir.join(format!("emu-{}.ld", hex_hash(&[LINKER_SCRIPT.as_bytes()])));
        write_once(&ld, LINKER_SCRIPT)?;
        let key = hex_hash(&[
            src.as_bytes(),
            FLAGS.join(" ").as_bytes(),
            KERNEL_ARGS.join(" ").as_bytes(),
            SHIM.as_bytes(),
            RUNTIME.as_bytes(),
            LINKER_SCRIPT.as_bytes(),
            version.as_bytes(),
        ]);
        let stem: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let so = dir.join(format!("{stem}-{key}.so"));
        // Tests of one binary building the same module at once compile it once.
        let building = build_lock(&key);
        let _one = building.lock().unwrap_or_else(|p| p.into_inner());
        if !so.is_file() {
            // The source stays beside the library: compiler messages point into it.
            let cu = dir.join(format!("{stem}-{key}.cu"));
            write_once(&cu, src)?;
            // emu.ld selects the kernel's statics by this object name (`*.kernel.o`), unique to
            // this build: another process may be building the same module.
            let obj = PathBuf::from(format!(
                "{}.kernel.o",
                aside(&dir.join(format!("{stem}-{key}"))).display()
            ));
            let mut args = KERNEL_ARGS.to_vec();
            args.extend(["-include", path_str(&shim)?, "-x", "c++", path_str(&cu)?]);
            let built = compile(name, &args, &obj).and_then(|()| {
                let script = format!("-Wl,-T,{}", path_str(&ld)?);
                compile(
                    name,
                    &["-shared", path_str(&obj)?, path_str(&rt)?, &script],
                    &so,
                )
            });
            let _ = std::fs::remove_file(&obj);
            built?;
        }
        let loaded = load(&so, name)?;
        Ok(Module {
            name: name.to_string(),
            path: so,
            loaded,
        })
    }

    /// The module's name (an op's name, with the weight type for gemvq).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shared library the module was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The entry point `name`, as the caller's `extern "C" fn(...)` type `F`.
    ///
    /// # Safety
    /// `F` must be a function pointer type matching the kernel's parameters exactly (the C ABI
    /// of the host: structs by value as `#[repr(C)]` copies of the kernel's). The pointer stays
    /// valid for the life of the process (modules are never unloaded). Calling it outside
    /// [`Module::launch`]'s body is undefined (there is no block to run in).
    pub unsafe fn entry<F: Copy>(&self, name: &str) -> Result<F, EmuError> {
        if std::mem::size_of::<F>() != std::mem::size_of::<*const ()>() {
            return Err(EmuError::NotAPointer {
                symbol: name.to_string(),
                size: std::mem::size_of::<F>(),
            });
        }
        // SAFETY: the caller vouches for the type; the size matches a function pointer.
        let sym = unsafe { self.loaded.lib.get::<F>(name.as_bytes()) }.map_err(|source| {
            EmuError::Symbol {
                symbol: name.to_string(),
                module: self.name.clone(),
                source,
            }
        })?;
        Ok(*sym)
    }

    /// Runs `body` once per emulated thread of a `grid` of `block`s with `dyn_smem` bytes of
    /// dynamic shared memory (`DYN_SHARED` in the kernel); `body` calls the entry with its
    /// arguments. Blocks run one after another (x fastest); every thread runs on the calling OS
    /// thread, which is why `body` need not be `Sync` (it may capture raw pointers). Launches
    /// from several threads of the process run one at a time. A panic in `body` is resumed here
    /// after the launch ends.
    pub fn launch(
        &self,
        entry: &str,
        grid: [u32; 3],
        block: [u32; 3],
        dyn_smem: usize,
        body: &dyn Fn(),
    ) -> Result<(), EmuError> {
        // The entry must exist, so a misspelt name fails here and not in the body.
        // SAFETY: only the symbol's presence is checked.
        unsafe { self.loaded.lib.get::<*const c_void>(entry.as_bytes()) }.map_err(|source| {
            EmuError::Symbol {
                symbol: entry.to_string(),
                module: self.name.clone(),
                source,
            }
        })?;
        let c_entry = CString::new(entry).map_err(|_| EmuError::Nul(entry.to_string()))?;
        let ctx = Body {
            body,
            panic: Cell::new(None),
        };
        let failed = {
            let _one = LAUNCH.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: emu_launch's contract: `ctx` outlives the call, `run_body` matches it.
            let rc = unsafe {
                (self.loaded.launch)(
                    c_entry.as_ptr(),
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    dyn_smem,
                    run_body,
                    &ctx as *const Body<'_> as *mut c_void,
                )
            };
            // SAFETY: a NUL-terminated string owned by the library, valid until its next
            // launch, which the lock excludes until it is copied.
            (rc != 0).then(|| {
                unsafe { CStr::from_ptr((self.loaded.last_error)()) }
                    .to_string_lossy()
                    .into_owned()
            })
        };
        if let Some(p) = ctx.panic.take() {
            std::panic::resume_unwind(p);
        }
        if let Some(msg) = failed {
            return Err(EmuError::Launch(msg));
        }
        Ok(())
    }
}
