//! The in-process communicator: rank threads of one process meet in host memory. Each rank is
//! its own OS thread (never a rayon task: a rank blocked in a collective must not hold a pool
//! worker, so four ranks run on a two-core machine), so a rank waiting here sleeps on a condvar.
//!
//! [`HostGroup`] is the rendezvous: every rank hands in its value, the last one to arrive
//! combines them in rank order and every rank gets that one result, so a sum is bitwise the same
//! on every rank. [`HostComm`] builds the collectives on it for any backend by staging tensors
//! through host memory: exact and simple, the CPU reference's communicator and the CUDA fallback.

use super::backend::RankComm;
use crate::backend::Backend;
use crate::RuntimeError;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// A collective was cut short because another rank failed (or the group shut down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("another tensor-parallel rank failed during this step")]
pub struct GroupAborted;

struct State<T> {
    round: u64,
    slots: Vec<Option<T>>,
    arrived: usize,
    /// The combined value of round `.0`, kept until the next round completes: a rank of round r
    /// reads it before it can hand in its value for round r + 1, so it is never overwritten early.
    done: Option<(u64, Arc<T>)>,
    aborted: bool,
}

/// A reusable rendezvous of `world` ranks exchanging values of type `T`.
pub struct HostGroup<T> {
    world: usize,
    state: Mutex<State<T>>,
    cv: Condvar,
}

impl<T: Send> HostGroup<T> {
    pub fn new(world: usize) -> Arc<Self> {
        Arc::new(HostGroup {
            world,
            state: Mutex::new(State {
                round: 0,
                slots: (0..world).map(|_| None).collect(),
                arrived: 0,
                done: None,
                aborted: false,
            }),
            cv: Condvar::new(),
        })
    }

    pub fn world(&self) -> usize {
        self.world
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panicking rank poisons the lock; the state itself stays consistent (every update is
        // complete before anything can panic), so keep going and let abort report it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hand in rank `rank`'s value; once all ranks have, `combine` (run by the last to arrive,
    /// with the values in rank order) makes the result every rank gets.
    pub fn exchange(
        &self,
        rank: usize,
        value: T,
        combine: impl FnOnce(Vec<T>) -> T,
    ) -> Result<Arc<T>, GroupAborted> {
        let mut st = self.lock();
        if st.aborted || rank >= self.world || st.slots[rank].is_some() {
            return Err(GroupAborted);
        }
        let round = st.round;
        st.slots[rank] = Some(value);
        st.arrived += 1;
        if st.arrived == self.world {
            let values: Vec<T> = st.slots.iter_mut().filter_map(Option::take).collect();
            let out = Arc::new(combine(values));
            st.done = Some((round, Arc::clone(&out)));
            st.arrived = 0;
            st.round += 1;
            self.cv.notify_all();
            return Ok(out);
        }
        loop {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            if let Some((r, v)) = &st.done {
                if *r == round {
                    return Ok(Arc::clone(v));
                }
            }
            if st.aborted {
                return Err(GroupAborted);
            }
        }
    }

    /// Fail every pending and future exchange until [`HostGroup::reset`].
    pub fn abort(&self) {
        self.lock().aborted = true;
        self.cv.notify_all();
    }

    /// Start over after an abort. Only while no rank is inside [`HostGroup::exchange`].
    pub fn reset(&self) {
        let mut st = self.lock();
        st.aborted = false;
        st.arrived = 0;
        st.done = None;
        st.round += 1;
        for s in st.slots.iter_mut() {
            *s = None;
        }
    }
}

/// A barrier of `world` rank threads that spins (then yields) instead of sleeping: microseconds,
/// for the launch of a device collective. Abortable like [`HostGroup`].
pub struct SpinBarrier {
    world: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
    aborted: AtomicBool,
}

impl SpinBarrier {
    pub fn new(world: usize) -> Arc<Self> {
        Arc::new(SpinBarrier {
            world,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
        })
    }

    /// Wait until every rank has called `wait` for this round.
    pub fn wait(&self) -> Result<(), GroupAborted> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(GroupAborted);
        }
        let gen = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.world {
            self.arrived.store(0, Ordering::Release);
            self.generation.fetch_add(1, Ordering::AcqRel);
            return Ok(());
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == gen {
            if self.aborted.load(Ordering::Acquire) {
                return Err(GroupAborted);
            }
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }

    /// Start over after an abort. Only while no rank is inside [`SpinBarrier::wait`].
    pub fn reset(&self) {
        self.arrived.store(0, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.aborted.store(false, Ordering::Release);
    }
}

fn aborted(world: usize) -> impl Fn(GroupAborted) -> RuntimeError {
    move |e| RuntimeError::Tp {
        world,
        msg: e.to_string(),
    }
}

/// `values` summed element by element in rank order: `((v0 + v1) + v2) + ...`, the order every
/// backend's all-reduce uses so that its results equal this one bitwise.
pub fn sum_in_rank_order(mut values: Vec<Vec<f32>>) -> Vec<f32> {
    if values.is_empty() {
        return Vec::new();
    }
    let mut out = values.remove(0);
    for v in &values {
        for (o, x) in out.iter_mut().zip(v) {
            *o += x;
        }
    }
    out
}

/// Row `r` of every rank's `[rows, c_i]` block side by side.
fn concat_cols(values: Vec<Vec<f32>>, rows: usize) -> Vec<f32> {
    let widths: Vec<usize> = values.iter().map(|v| v.len() / rows.max(1)).collect();
    let mut out = Vec::with_capacity(values.iter().map(Vec::len).sum());
    for r in 0..rows {
        for (v, &w) in values.iter().zip(&widths) {
            out.extend_from_slice(&v[r * w..(r + 1) * w]);
        }
    }
    out
}

/// One value per rank, each taken once by its rank's setup (the rank threads start together).
pub struct RankSlots<T>(Mutex<Vec<Option<T>>>);

impl<T> RankSlots<T> {
    pub fn new(values: Vec<T>) -> Self {
        RankSlots(Mutex::new(values.into_iter().map(Some).collect()))
    }

    /// Rank `rank`'s value (an error on a second take).
    pub fn take(&self, rank: usize) -> Result<T, RuntimeError> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let world = v.len();
        v.get_mut(rank)
            .and_then(Option::take)
            .ok_or_else(|| RuntimeError::Tp {
                world,
                msg: format!("rank {rank} set up twice"),
            })
    }
}

/// Collectives through host memory for any backend (download, combine, upload).
pub struct HostComm {
    rank: usize,
    group: Arc<HostGroup<Vec<f32>>>,
}

impl HostComm {
    /// Another handle of the same rank in the same group.
    pub fn clone_rank(&self) -> HostComm {
        HostComm {
            rank: self.rank,
            group: Arc::clone(&self.group),
        }
    }

    /// One communicator per rank of a group.
    pub fn group(world: usize) -> Vec<HostComm> {
        let g = HostGroup::new(world);
        (0..world)
            .map(|rank| HostComm {
                rank,
                group: Arc::clone(&g),
            })
            .collect()
    }
}

impl<B: Backend> RankComm<B> for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.group.world()
    }

    fn all_reduce_sum(&self, be: &B, x: &mut B::Tensor) -> Result<(), RuntimeError> {
        if self.group.world() == 1 {
            return Ok(());
        }
        let (rows, cols) = be.shape(x);
        let out = self
            .group
            .exchange(self.rank, be.to_host(x)?, sum_in_rank_order)
            .map_err(aborted(self.group.world()))?;
        if out.len() != rows * cols {
            return Err(RuntimeError::Tp {
                world: self.group.world(),
                msg: format!("all-reduce of [{rows}, {cols}]: the ranks' tensors differ in size"),
            });
        }
        *x = be.new_tensor(rows, cols, &out)?;
        Ok(())
    }

    fn all_gather_cols(&self, be: &B, x: B::Tensor) -> Result<B::Tensor, RuntimeError> {
        if self.group.world() == 1 {
            return Ok(x);
        }
        let (rows, _) = be.shape(&x);
        let out = self
            .group
            .exchange(self.rank, be.to_host(&x)?, |v| concat_cols(v, rows))
            .map_err(aborted(self.group.world()))?;
        let cols = out.len().checked_div(rows).unwrap_or(0);
        be.new_tensor(rows, cols, &out)
    }

    fn abort(&self) {
        self.group.abort();
    }
    fn reset(&self) {
        self.group.reset();
    }
    fn kind(&self) -> String {
        "host".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_the_rank_order_sum_and_aborts_wake_waiters() {
        let g = HostGroup::<Vec<f32>>::new(3);
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let g = &g;
                    s.spawn(move || {
                        (0..50)
                            .map(|i| {
                                let v = vec![r as f32 + i as f32 * 0.1, 1e8, -1e8];
                                g.exchange(r, v, sum_in_rank_order).unwrap()[0]
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(out[0], out[1]);
        assert_eq!(out[1], out[2]);
        assert_eq!(out[0][3], (0.3f32 + 1.3) + 2.3);
        // A rank that never arrives: the others are released by abort.
        let g = HostGroup::<Vec<f32>>::new(2);
        std::thread::scope(|s| {
            let h = s.spawn(|| g.exchange(0, vec![1.0], sum_in_rank_order));
            std::thread::sleep(std::time::Duration::from_millis(20));
            g.abort();
            assert_eq!(h.join().unwrap(), Err(GroupAborted));
        });
        g.reset();
        let sums: Vec<f32> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let g = &g;
                    s.spawn(move || g.exchange(r, vec![r as f32 + 1.0], sum_in_rank_order))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap().unwrap()[0])
                .collect()
        });
        assert_eq!(sums, vec![3.0, 3.0]);
    }
}
