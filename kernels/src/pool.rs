//! Device memory without a driver call per op: a caching pool of device buffers, pinned staging
//! for host -> device uploads of step inputs and for device -> host downloads.
//!
//! Every op of the forward pass needs fresh output buffers; `cuMemAllocAsync` + memset per op was
//! ~40 driver calls per MoE layer and token. The pool hands out uninitialized buffers from free
//! lists keyed by a size class and takes them back when a [`DevBuf`] drops. All work runs on the
//! device's one stream, so a buffer returned while kernels that use it are still queued is only
//! reused by work queued after them: stream order makes that safe without events. Free lists are
//! LIFO, so a decode step that allocates the same sizes in the same order as the last step gets
//! the same addresses (a precondition for capturing the step in a CUDA graph later).
//!
//! Uploads of small step inputs (token ids, positions) go through a ring of pinned host buffers
//! (`cuMemcpyHtoDAsync` from pageable memory is synchronous); each slot records an event after
//! its copy and is reused only once that event completed. Bulk uploads (weights at load) have a
//! ring of larger slots of their own ([`Bulk`]), so a load never waits on or evicts the step
//! inputs' ring, and the caller fills each slot in place: the read of chunk i + 1 (from a
//! memory-mapped file) overlaps the DMA of chunk i.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut,
    DeviceRepr, DeviceSlice, SyncOnDrop,
};

use crate::error::KernelError;

/// Size class of a request: exact multiples of 512 bytes below 1 MiB, above that 8 classes per
/// octave (at most 12.5% slack), so repeated requests of one size always share a class.
fn class_of(bytes: usize) -> usize {
    let b = bytes.max(1);
    if b <= 1 << 20 {
        return b.div_ceil(512) * 512;
    }
    let top = usize::BITS - 1 - b.leading_zeros(); // 2^top <= b < 2^(top+1)
    let step = 1usize << (top - 3);
    b.div_ceil(step) * step
}

struct PoolState {
    free: HashMap<usize, Vec<CudaSlice<u8>>>,
    cached_bytes: usize,
    /// Bytes handed out and not yet returned (for reports).
    live_bytes: usize,
    high_water: usize,
}

/// The caching allocator of one device.
pub(crate) struct Pool {
    stream: Arc<CudaStream>,
    state: Mutex<PoolState>,
    /// Cached (free) bytes kept at most; buffers returned beyond this are freed.
    cap: usize,
}

/// Allocator statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub cached_bytes: usize,
    pub live_bytes: usize,
    pub high_water_bytes: usize,
}

impl Pool {
    pub(crate) fn new(stream: Arc<CudaStream>, cap: usize) -> Arc<Pool> {
        Arc::new(Pool {
            stream,
            state: Mutex::new(PoolState {
                free: HashMap::new(),
                cached_bytes: 0,
                live_bytes: 0,
                high_water: 0,
            }),
            cap,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let s = self.lock();
        PoolStats {
            cached_bytes: s.cached_bytes,
            live_bytes: s.live_bytes,
            high_water_bytes: s.high_water,
        }
    }

    /// Free every cached buffer (e.g. after a long prefill whose activations will not recur).
    pub(crate) fn trim(&self) {
        let mut s = self.lock();
        s.free.clear();
        s.cached_bytes = 0;
    }

    /// An uninitialized buffer of `n` elements of `T`; `cache`: returned to the free lists on
    /// drop (else freed: long-lived buffers such as KV caches would only pollute the lists).
    pub(crate) fn alloc<T: DeviceRepr>(
        self: &Arc<Self>,
        n: usize,
        cache: bool,
    ) -> Result<DevBuf<T>, KernelError> {
        let bytes = n
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(KernelError::BadShape {
                op: "alloc",
                msg: format!("{n} elements overflow"),
            })?;
        let class = if cache { class_of(bytes) } else { bytes.max(1) };
        let reused = if !cache {
            self.lock().live_bytes += class;
            None
        } else {
            let mut s = self.lock();
            let hit = s.free.get_mut(&class).and_then(Vec::pop);
            if hit.is_some() {
                s.cached_bytes -= class;
            }
            s.live_bytes += class;
            s.high_water = s.high_water.max(s.live_bytes + s.cached_bytes);
            hit
        };
        let raw = match reused {
            Some(r) => r,
            None => {
                // SAFETY: uninitialized device memory; every op writes its whole output before
                // anything reads it (the op wrappers' contract, checked by NaN-poisoned tests).
                match unsafe { self.stream.alloc::<u8>(class) } {
                    Ok(r) => r,
                    Err(e) => {
                        // Out of memory with buffers cached: release them and retry once.
                        self.trim();
                        unsafe { self.stream.alloc::<u8>(class) }.map_err(|_| {
                            self.lock().live_bytes -= class;
                            KernelError::Driver {
                                what: "cuMemAllocAsync",
                                source: e,
                            }
                        })?
                    }
                }
            }
        };
        Ok(DevBuf {
            raw: Some(raw),
            len: n,
            class,
            cache,
            pool: Arc::clone(self),
            _t: PhantomData,
        })
    }

    fn give_back(&self, raw: CudaSlice<u8>, class: usize, cache: bool) {
        let mut s = self.lock();
        s.live_bytes = s.live_bytes.saturating_sub(class);
        if cache && s.cached_bytes + class <= self.cap {
            s.cached_bytes += class;
            s.free.entry(class).or_default().push(raw);
        }
        // else: dropping `raw` frees it (stream-ordered cuMemFreeAsync).
    }
}

/// A pooled device buffer of `len` elements of `T` (uninitialized when allocated). Dropping it
/// returns the memory to the pool. Usable wherever the op wrappers take `DevicePtr` /
/// `DevicePtrMut`; [`DevBuf::slice`] / [`DevBuf::slice_mut`] give sub-ranges.
pub struct DevBuf<T> {
    raw: Option<CudaSlice<u8>>,
    len: usize,
    class: usize,
    cache: bool,
    pool: Arc<Pool>,
    _t: PhantomData<T>,
}

impl<T> DevBuf<T> {
    fn raw(&self) -> &CudaSlice<u8> {
        // Only `Drop` takes the slice out.
        self.raw.as_ref().expect("live DevBuf")
    }

    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        let (p, _g) = self.raw().device_ptr(self.raw().stream());
        p
    }

    /// The whole buffer as a view.
    pub fn view(&self) -> CudaView<'_, T> {
        // SAFETY: the class holds at least len * size_of::<T>() bytes; T is a plain device type.
        unsafe { self.raw().transmute::<T>(self.len) }.expect("pool class holds len elements")
    }

    /// The whole buffer, mutably.
    pub fn view_mut(&mut self) -> DevViewMut<'_, T> {
        let len = self.len;
        self.slice_mut(0..len)
    }

    pub fn slice(&self, r: impl RangeBounds<usize>) -> CudaView<'_, T> {
        self.view().slice(r)
    }

    /// A mutable sub-range (panics when out of bounds, like `CudaSlice::slice_mut`).
    pub fn slice_mut(&mut self, r: impl RangeBounds<usize>) -> DevViewMut<'_, T> {
        let (start, end) = bounds(r, self.len);
        assert!(
            start <= end && end <= self.len,
            "slice {start}..{end} of {}",
            self.len
        );
        let ptr = self.ptr() + (start * std::mem::size_of::<T>()) as u64;
        DevViewMut {
            ptr,
            len: end - start,
            stream: self.raw().stream(),
            _m: PhantomData,
        }
    }

    /// Bytes reserved (the size class).
    pub fn capacity_bytes(&self) -> usize {
        self.class
    }
}

fn bounds(r: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    use std::ops::Bound::*;
    let s = match r.start_bound() {
        Included(&s) => s,
        Excluded(&s) => s + 1,
        Unbounded => 0,
    };
    let e = match r.end_bound() {
        Included(&e) => e + 1,
        Excluded(&e) => e,
        Unbounded => len,
    };
    (s, e)
}

/// A mutable view of part of a [`DevBuf`] (cudarc's `CudaViewMut` cannot be re-sliced without
/// borrowing the intermediate view).
pub struct DevViewMut<'a, T> {
    ptr: u64,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _m: PhantomData<&'a mut T>,
}

impl<T> DeviceSlice<T> for DevViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for DevViewMut<'_, T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for DevViewMut<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.pool.give_back(raw, self.class, self.cache);
        }
    }
}

impl<T> DeviceSlice<T> for DevBuf<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.raw().stream()
    }
}

impl<T> DevicePtr<T> for DevBuf<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.raw().device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for DevBuf<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.raw
            .as_mut()
            .expect("live DevBuf")
            .device_ptr_mut(stream)
    }
}

/// Pinned host memory (page-locked) of `bytes` bytes.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain host memory owned by this struct; access is serialized by the owning Mutex.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Pinned, KernelError> {
        ctx.bind_to_thread()
            .map_err(KernelError::driver("cuCtxSetCurrent"))?;
        // SAFETY: plain allocation; freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }
            .map_err(KernelError::driver("cuMemHostAlloc"))? as *mut u8;
        Ok(Pinned { ptr, bytes })
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes owned by this allocation.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host; users synchronize before dropping the owner.
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// A pinned upload slot and the event of the last copy queued from it.
struct Slot {
    buf: Pinned,
    done: Option<CudaEvent>,
}

impl Slot {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Slot, KernelError> {
        Ok(Slot {
            buf: Pinned::new(ctx, bytes)?,
            done: None,
        })
    }

    /// Block until the copy last queued from this slot has read it (the slot is then free).
    fn wait(&self, op: &'static str) -> Result<(), KernelError> {
        match &self.done {
            Some(e) => e
                .synchronize()
                .map_err(|source| KernelError::Launch { op, source }),
            None => Ok(()),
        }
    }

    /// Queue a copy of the slot's first `bytes` bytes to device address `dst` on `stream` and
    /// record the event [`Slot::wait`] waits for. The caller waited for the slot before
    /// writing it and `dst` holds `bytes` bytes.
    fn send(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        bytes: usize,
        dst: u64,
    ) -> Result<(), KernelError> {
        // The event first: once the copy is queued, nothing may fail without an event (or a
        // synchronization) that keeps the slot from being rewritten or freed under it.
        let e = match self.done.take() {
            Some(e) => e,
            None => ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(KernelError::driver("cuEventCreate"))?,
        };
        // SAFETY: `bytes` fits the slot and `dst` (callers); the slot is not written again
        // before the event recorded below completes.
        let r = unsafe {
            result::memcpy_htod_async(dst, &self.buf.bytes_mut()[..bytes], stream.cu_stream())
        }
        .map_err(KernelError::driver("cuMemcpyHtoDAsync"))
        .and_then(|()| {
            e.record(stream)
                .map_err(KernelError::driver("cuEventRecord"))
        });
        if r.is_err() {
            let _ = stream.synchronize();
        }
        self.done = Some(e);
        r
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The pinned memory must outlive the copy queued from it.
        let _ = self.wait("free staging");
    }
}

/// Ring of pinned upload slots, each reusable once the copy it last staged has completed.
pub(crate) struct Staging {
    ctx: Arc<CudaContext>,
    slots: Vec<Slot>,
    next: usize,
    /// Pinned buffer for downloads (grown on demand).
    down: Option<Pinned>,
}

/// Uploads up to this many bytes go through the pinned ring; larger ones are copied pageable.
pub(crate) const STAGING_SLOT: usize = 1 << 20;
const STAGING_SLOTS: usize = 8;
/// Largest download staged through pinned memory (logits of a batch are well below).
const DOWN_MAX: usize = 256 << 20;

impl Staging {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Staging {
        Staging {
            ctx,
            slots: Vec::new(),
            next: 0,
            down: None,
        }
    }

    /// Queue `host -> dst` on `stream` through a pinned slot (`host` fits [`STAGING_SLOT`]).
    pub(crate) fn upload<T: DeviceRepr>(
        &mut self,
        stream: &CudaStream,
        host: &[T],
        dst: u64,
    ) -> Result<(), KernelError> {
        let bytes = std::mem::size_of_val(host);
        debug_assert!(bytes <= STAGING_SLOT);
        if self.slots.len() < STAGING_SLOTS {
            self.slots.push(Slot::new(&self.ctx, STAGING_SLOT)?);
            self.next = self.slots.len() - 1;
        }
        let i = self.next;
        self.next = (self.next + 1) % STAGING_SLOTS.min(self.slots.len()).max(1);
        let slot = &mut self.slots[i];
        slot.wait("upload")?;
        // SAFETY: `host` is `bytes` bytes of plain data.
        let src = unsafe { std::slice::from_raw_parts(host.as_ptr() as *const u8, bytes) };
        slot.buf.bytes_mut()[..bytes].copy_from_slice(src);
        slot.send(&self.ctx, stream, bytes, dst)
    }

    /// Copy `src` (device, `out.len()` elements) into `out` through pinned memory and wait.
    pub(crate) fn download<T: DeviceRepr>(
        &mut self,
        stream: &CudaStream,
        src: u64,
        out: &mut [T],
    ) -> Result<bool, KernelError> {
        let bytes = std::mem::size_of_val(out);
        if bytes > DOWN_MAX {
            return Ok(false);
        }
        if self.down.as_ref().is_none_or(|d| d.bytes < bytes) {
            self.down = None;
            self.down = Some(Pinned::new(
                &self.ctx,
                bytes.next_power_of_two().max(1 << 16),
            )?);
        }
        let d = self.down.as_mut().expect("allocated above");
        // SAFETY: pinned buffer of >= bytes; we synchronize before reading it.
        unsafe { result::memcpy_dtoh_async(&mut d.bytes_mut()[..bytes], src, stream.cu_stream()) }
            .map_err(KernelError::driver("cuMemcpyDtoHAsync"))?;
        stream.synchronize().map_err(|source| KernelError::Launch {
            op: "download",
            source,
        })?;
        // SAFETY: `out` is `bytes` bytes of plain data.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, bytes) };
        dst.copy_from_slice(&d.bytes_mut()[..bytes]);
        Ok(true)
    }
}

/// Bytes of one bulk staging slot: large enough that a copy's fixed cost (~10 us) is noise
/// next to its transfer, small enough that the first chunk's read is not a long wait.
pub const BULK_SLOT: usize = 8 << 20;
/// Bulk slots in the ring: the copies of up to three chunks may be in flight while the fourth
/// is being filled.
const BULK_SLOTS: usize = 4;

/// Why a staged upload failed: the caller's fill (its error, and where), or the device.
#[derive(Debug, thiserror::Error)]
pub enum StagedError<E> {
    /// `fill` failed for the chunk at byte `offset`; nothing of the upload is left in flight.
    #[error("filling bytes from {offset} of a staged upload: {source}")]
    Fill {
        offset: usize,
        #[source]
        source: E,
    },
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// The ring of pinned slots bulk uploads stream through (allocated on first use, kept for the
/// next upload, freed with the device once their copies completed).
pub(crate) struct Bulk {
    ctx: Arc<CudaContext>,
    slots: Vec<Slot>,
    next: usize,
}

impl Bulk {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Bulk {
        Bulk {
            ctx,
            slots: Vec::new(),
            next: 0,
        }
    }

    /// Fill device bytes `dst .. dst + len` chunk by chunk (`chunk` bytes each, at most
    /// [`BULK_SLOT`], the last one shorter): `fill(offset, slot)` writes bytes `offset ..
    /// offset + slot.len()` of the data into a free pinned slot, whose copy is then queued on
    /// `stream`. Returns with the last copies still in flight (stream order covers later work
    /// on `stream`); on an error, only once every queued copy has completed.
    pub(crate) fn upload<E>(
        &mut self,
        stream: &CudaStream,
        dst: u64,
        len: usize,
        chunk: usize,
        fill: &mut impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), StagedError<E>> {
        let r = self.upload_inner(stream, dst, len, chunk.clamp(1, BULK_SLOT), fill);
        if r.is_err() {
            // The caller frees (or reuses) the destination next; no copy may still write it.
            let _ = stream.synchronize();
        }
        r
    }

    fn upload_inner<E>(
        &mut self,
        stream: &CudaStream,
        dst: u64,
        len: usize,
        chunk: usize,
        fill: &mut impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), StagedError<E>> {
        let mut offset = 0;
        while offset < len {
            let n = chunk.min(len - offset);
            let i = self.next;
            if i == self.slots.len() {
                self.slots.push(Slot::new(&self.ctx, BULK_SLOT)?);
            }
            let slot = &mut self.slots[i];
            slot.wait("staged upload")?;
            fill(offset, &mut slot.buf.bytes_mut()[..n])
                .map_err(|source| StagedError::Fill { offset, source })?;
            slot.send(&self.ctx, stream, n, dst + offset as u64)?;
            self.next = (i + 1) % BULK_SLOTS;
            offset += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::class_of;

    #[test]
    fn classes_cover_requests_with_bounded_slack() {
        for b in [
            1usize,
            511,
            512,
            513,
            4096,
            1 << 20,
            (1 << 20) + 1,
            3 << 20,
            1 << 30,
            (1 << 30) + 7,
        ] {
            let c = class_of(b);
            assert!(c >= b, "{b} -> {c}");
            assert!(c as f64 <= b as f64 * 1.125 + 512.0, "{b} -> {c}");
            assert_eq!(class_of(c), c, "a class is its own class");
        }
    }
}
