//! What every emulator test binary shares: the skip rule, one compiled module per op for the
//! whole binary, and 16-byte-aligned host buffers standing in for device memory.

// Each test binary uses a different part of it.
#![allow(dead_code)]

use std::io::Write;
use std::marker::PhantomData;
use std::sync::{Mutex, OnceLock};

use kernels::Op;
use kernels_emu::Module;

pub fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// False (after printing "skipped: no C++ compiler") when no host compiler can build modules.
pub fn compiler(test: &str) -> bool {
    if !kernels_emu::available() {
        say(&format!("skipped: no C++ compiler ({test})"));
        return false;
    }
    true
}

/// One module per op for the whole binary (tests run in parallel; the first builds it).
pub fn module(op: Op) -> &'static Module {
    static MODS: OnceLock<Mutex<Vec<(Op, &'static Module)>>> = OnceLock::new();
    let mods = MODS.get_or_init(Default::default);
    let mut held = mods.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, m)) = held.iter().find(|(o, _)| *o == op) {
        return m;
    }
    let m: &'static Module = match Module::build(op, &[]) {
        Ok(m) => Box::leak(Box::new(m)),
        Err(e) => panic!("{e}"),
    };
    held.push((op, m));
    m
}

/// A 16-byte-aligned buffer of `T`: the kernels load int4 / uint4 / float4 vectors, which the
/// host compiler may turn into aligned vector loads (the device wrappers check the same
/// alignment).
pub struct Buf<T> {
    words: Vec<u128>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Copy> Buf<T> {
    pub fn new(v: &[T]) -> Self {
        let bytes = std::mem::size_of_val(v);
        let mut words = vec![0u128; bytes.div_ceil(16).max(1)];
        // SAFETY: `words` holds at least `bytes` bytes; T is plain data.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v.as_ptr() as *const u8,
                words.as_mut_ptr() as *mut u8,
                bytes,
            )
        };
        Buf {
            words,
            len: v.len(),
            _t: PhantomData,
        }
    }
    pub fn filled(n: usize, v: T) -> Self {
        Self::new(&vec![v; n])
    }
    pub fn ptr(&self) -> *const T {
        self.words.as_ptr() as *const T
    }
    pub fn mut_ptr(&mut self) -> *mut T {
        self.words.as_mut_ptr() as *mut T
    }
    /// The device-address form the kernels' struct parameters take.
    pub fn addr(&self) -> u64 {
        self.words.as_ptr() as u64
    }
    pub fn to_vec(&self) -> Vec<T> {
        // SAFETY: `len` values of T were written at the start of `words`.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }.to_vec()
    }
}

/// rmsnorm.cu's `rmsnorm_f32` (x, x_stride, res, res_stride, xo, xo_stride, w, y, y_stride, n,
/// eps, q8 codes, q8 records).
pub type RmsFn = unsafe extern "C" fn(
    *const f32,
    i64,
    *const f32,
    i64,
    *mut f32,
    i64,
    *const f32,
    *mut f32,
    i64,
    i32,
    f32,
    *mut i8,
    *mut u64,
);
