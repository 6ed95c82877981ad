//! Tensor-parallel communication between CUDA ranks of one process: peer-access probing and the
//! one-shot all-reduce (`cuda/allreduce.cu`) over buffers every rank can read.
//!
//! Each rank owns exchange memory allocated with `cuMemAlloc` (outside the stream-ordered pools,
//! which peers could not map): a buffer of two halves of `cap` floats, one 32-bit flag per block
//! and one epoch counter per block. The ranks swap the addresses ([`OneShotHandles`]) once
//! through host memory and upload them as pointer tables; from then on every all-reduce is one
//! launch with the same arguments (fixed buffers, epochs kept on the device), so it may be
//! captured in a CUDA graph. Several ranks may share one GPU (separate streams, same-device
//! buffers): that is how the sharded path is tested on a one-GPU machine.

use std::sync::Arc;

use cudarc::driver::{result, sys, DevicePtrMut};

use crate::device::{to_i32, Gpu};
use crate::error::KernelError;
use crate::ops::Op;

/// Blocks of an all-reduce launch (fixed: the flags and epochs are per block index).
pub const BLOCKS: u32 = 8;
const THREADS: u32 = 512;
/// A rank that does not arrive within this time is reported instead of hanging the others.
const TIMEOUT_NS: u64 = 20_000_000_000;

/// Whether device `dev` can map memory of device `peer` (`cuDeviceCanAccessPeer`; a device can
/// always reach itself).
pub fn can_access_peer(dev: usize, peer: usize) -> Result<bool, KernelError> {
    if dev == peer {
        return Ok(true);
    }
    if !crate::driver_available() {
        return Err(KernelError::NoDriver);
    }
    result::init().map_err(KernelError::driver("cuInit"))?;
    let d = result::device::get(dev as i32).map_err(KernelError::driver("cuDeviceGet"))?;
    let p = result::device::get(peer as i32).map_err(KernelError::driver("cuDeviceGet"))?;
    let mut ok = 0i32;
    // SAFETY: plain out-parameter, valid device handles.
    unsafe { sys::cuDeviceCanAccessPeer(&mut ok, d, p) }
        .result()
        .map_err(KernelError::driver("cuDeviceCanAccessPeer"))?;
    Ok(ok != 0)
}

/// Let `gpu`'s context read and write `peer`'s memory (idempotent).
pub fn enable_peer_access(gpu: &Gpu, peer: &Gpu) -> Result<(), KernelError> {
    if gpu.info().ordinal == peer.info().ordinal {
        return Ok(());
    }
    gpu.context()
        .bind_to_thread()
        .map_err(KernelError::driver("cuCtxSetCurrent"))?;
    // SAFETY: both contexts are live (held by the Gpu handles).
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer.context().cu_ctx(), 0) };
    match r {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        e => Err(KernelError::Driver {
            what: "cuCtxEnablePeerAccess",
            source: result::DriverError(e),
        }),
    }
}

/// Device memory from `cuMemAlloc`, zeroed, freed on drop.
struct RawBuf {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
}

impl RawBuf {
    fn zeroed(gpu: &Arc<Gpu>, bytes: usize) -> Result<RawBuf, KernelError> {
        gpu.context()
            .bind_to_thread()
            .map_err(KernelError::driver("cuCtxSetCurrent"))?;
        // SAFETY: a fresh allocation, zeroed before any use.
        let ptr = unsafe { result::malloc_sync(bytes.max(4)) }
            .map_err(KernelError::driver("cuMemAlloc"))?;
        let buf = RawBuf {
            gpu: Arc::clone(gpu),
            ptr,
        };
        unsafe { result::memset_d8_sync(ptr, 0, bytes.max(4)) }
            .map_err(KernelError::driver("cuMemsetD8"))?;
        Ok(buf)
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        if self.gpu.context().bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync, freed once; nothing uses it after the group.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// The addresses a rank's peers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OneShotHandles {
    pub buf: u64,
    pub flags: u64,
}

/// One rank's side of a one-shot all-reduce group.
pub struct OneShotRank {
    gpu: Arc<Gpu>,
    rank: usize,
    world: usize,
    cap: usize,
    buf: RawBuf,
    flags: RawBuf,
    counter: RawBuf,
    error: RawBuf,
    tables: Option<(RawBuf, RawBuf)>,
}

impl OneShotRank {
    /// Exchange memory for messages of up to `cap` floats (longer ones go in pieces).
    pub fn new(gpu: &Arc<Gpu>, rank: usize, world: usize, cap: usize) -> Result<Self, KernelError> {
        if world == 0 || rank >= world || world > THREADS as usize || cap == 0 {
            return Err(KernelError::BadShape {
                op: "allreduce",
                msg: format!("rank {rank} of {world}, capacity {cap}"),
            });
        }
        let words = BLOCKS as usize * 4;
        let r = OneShotRank {
            gpu: Arc::clone(gpu),
            rank,
            world,
            cap,
            buf: RawBuf::zeroed(gpu, 2 * cap * 4)?,
            flags: RawBuf::zeroed(gpu, words)?,
            counter: RawBuf::zeroed(gpu, words)?,
            error: RawBuf::zeroed(gpu, 4)?,
            tables: None,
        };
        // The memsets ran on the legacy stream: done before any rank's kernel may read.
        gpu.context()
            .synchronize()
            .map_err(KernelError::driver("cuCtxSynchronize"))?;
        // Compile and load the kernel now: a module load inside a collective could wait for a
        // peer's kernel that is already spinning for this rank's flag.
        gpu.func(Op::AllReduce, "allreduce_oneshot_f32")?;
        Ok(r)
    }

    pub fn handles(&self) -> OneShotHandles {
        OneShotHandles {
            buf: self.buf.ptr,
            flags: self.flags.ptr,
        }
    }

    /// Give this rank every rank's addresses (rank order). Peers on other GPUs must have peer
    /// access enabled first ([`enable_peer_access`]).
    pub fn connect(&mut self, all: &[OneShotHandles]) -> Result<(), KernelError> {
        if all.len() != self.world {
            return Err(KernelError::BadShape {
                op: "allreduce",
                msg: format!("{} handles for {} ranks", all.len(), self.world),
            });
        }
        let bufs: Vec<u64> = all.iter().map(|h| h.buf).collect();
        let flags: Vec<u64> = all.iter().map(|h| h.flags).collect();
        let tb = RawBuf::zeroed(&self.gpu, 8 * self.world)?;
        let tf = RawBuf::zeroed(&self.gpu, 8 * self.world)?;
        // SAFETY: destinations hold exactly world u64 each.
        unsafe {
            result::memcpy_htod_sync(tb.ptr, &bufs).map_err(KernelError::driver("cuMemcpyHtoD"))?;
            result::memcpy_htod_sync(tf.ptr, &flags)
                .map_err(KernelError::driver("cuMemcpyHtoD"))?;
        }
        self.tables = Some((tb, tf));
        Ok(())
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// Sum the first `n` values of `x` over the ranks, in place, on this rank's stream. Every
    /// rank must call it with the same `n`, in the same order as its other collectives.
    pub fn all_reduce(&self, x: &mut impl DevicePtrMut<f32>, n: usize) -> Result<(), KernelError> {
        const OP: &str = "allreduce";
        let Some((tb, tf)) = &self.tables else {
            return Err(KernelError::BadShape {
                op: OP,
                msg: "the group is not connected".into(),
            });
        };
        if x.len() < n {
            return Err(KernelError::BadLength {
                op: OP,
                arg: "x",
                need: n,
                got: x.len(),
            });
        }
        let f = self.gpu.func(Op::AllReduce, "allreduce_oneshot_f32")?;
        let cfg = self.gpu.cfg(OP, (BLOCKS as u64, 1, 1), THREADS)?;
        let (base, _g) = x.device_ptr_mut(self.gpu.stream());
        let (rank, world) = (
            to_i32(OP, "rank", self.rank)?,
            to_i32(OP, "world", self.world)?,
        );
        let cap = self.cap as i64;
        let (counter, error) = (self.counter.ptr, self.error.ptr);
        let timeout = TIMEOUT_NS;
        let mut done = 0usize;
        while done < n {
            let m = (n - done).min(self.cap);
            let p = base + (done * 4) as u64;
            let m64 = m as i64;
            let mut a = self.gpu.args(&f);
            a.arg(&p)
                .arg(&p)
                .arg(&m64)
                .arg(&tb.ptr)
                .arg(&tf.ptr)
                .arg(&counter)
                .arg(&error)
                .arg(&rank)
                .arg(&world)
                .arg(&cap)
                .arg(&timeout);
            // SAFETY: x holds n floats; the tables hold world valid buffer/flag addresses of
            // 2 * cap floats and BLOCKS flags each (every rank built its memory with `new`).
            unsafe { self.gpu.launch(OP, a, cfg)? };
            done += m;
        }
        Ok(())
    }

    /// Whether a wait timed out since the last call (waits for this rank's stream), clearing
    /// the flag: a timed-out launch returns with its output unreduced, so the step that ran it
    /// must be discarded.
    pub fn take_timeout(&self) -> Result<bool, KernelError> {
        // Once per step: through the pinned staging buffer, ordered after this rank's kernels.
        let v = self.gpu.download_word(self.error.ptr)?;
        if v != 0 {
            // SAFETY: the error word is 4 bytes; the stream is idle (the download waited for it).
            unsafe { result::memset_d8_sync(self.error.ptr, 0, 4) }
                .map_err(KernelError::driver("cuMemsetD8"))?;
        }
        Ok(v != 0)
    }

    /// Whether a wait timed out since the group was made (a rank that never arrived).
    pub fn timed_out(&self) -> Result<bool, KernelError> {
        self.gpu.synchronize()?;
        let mut v = [0u32];
        // SAFETY: the error word is 4 bytes.
        unsafe { result::memcpy_dtoh_sync(&mut v, self.error.ptr) }
            .map_err(KernelError::driver("cuMemcpyDtoH"))?;
        Ok(v[0] != 0)
    }
}
