//! CUDA tensor-parallel ranks: each rank a [`CudaBackend`] with a stream of its own (several
//! ranks may share one GPU: `--tp 4 --tp-devices 0,0,0,0`), driven by its own OS thread, and a
//! communicator for the group:
//!
//! - `oneshot`: the one-shot all-reduce kernel (`kernels::comm`) over buffers every rank can
//!   read: all ranks on one GPU, or GPUs where `cuDeviceCanAccessPeer` holds for every pair.
//!   The decode case (one 12 KiB hidden vector per reduce for GLM-5) is one launch.
//! - `nccl`: NCCL through cudarc (one GPU per rank; NCCL cannot put two ranks on one GPU).
//! - `host`: through host memory ([`HostComm`]), always available, slow.
//!
//! `--allreduce auto` takes `oneshot` where it is possible, else `nccl` where the library loads,
//! else `host`; with both `oneshot` and `nccl` possible (several GPUs with peer access) it times
//! a 12 KiB all-reduce on each at start-up and keeps the faster (every rank keeps the same one:
//! the slowest rank's timings decide). The vocabulary gather of the head's logits goes through
//! host memory (the logits go to the host anyway).

use super::{not_f32, CudaBackend, CudaIndex, CudaOptions, CudaTensor};
use crate::backend::Backend;
use crate::device::AllReduce;
use crate::tp::{
    HostComm, HostGroup, MoeSplit, RankComm, RankSetup, RankSlots, Ranked, SpinBarrier, TpModel,
};
use crate::RuntimeError;
use kernels::comm::enable_peer_access;
use kernels::{Gpu, OneShotRank};
use std::sync::{Arc, Mutex};

/// Floats one one-shot launch reduces (1 MiB); longer messages (prefill) go in pieces.
const ONESHOT_CAP: usize = 1 << 18;
/// Elements of the start-up timing (12 KiB: GLM-5's hidden vector in f32 is 24 KiB, bf16 12).
const PROBE_ELEMS: usize = 3072;
const PROBE_ITERS: usize = 50;

fn kerr(what: &str) -> impl FnOnce(kernels::KernelError) -> RuntimeError + '_ {
    move |e| RuntimeError::Backend(format!("{what}: {e}"))
}

/// Expert ids re-based to `first .. first + count` (others -1) on the device, in place
/// (expert parallelism on CUDA; column split needs none): no host round trip in the step.
pub(crate) fn local_expert_ids(
    be: &CudaBackend,
    mut ids: CudaIndex,
    first: usize,
    count: usize,
) -> Result<CudaIndex, RuntimeError> {
    let n = ids.rows * ids.cols;
    be.gpu
        .moe_local_ids(&mut ids.buf, n, first, count)
        .map_err(kerr("local_expert_ids"))?;
    Ok(ids)
}

/// NCCL's communicator holds a raw handle; each rank's is used by that rank's thread only.
struct NcclComm(cudarc::nccl::safe::Comm);
// SAFETY: one rank thread uses its communicator at a time (a TpModel step is one call per
// rank thread); NCCL allows a communicator to be used from any one thread at a time.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

enum Reduce {
    /// Ranks sharing a GPU launch between two host barriers. A driver call may wait for the
    /// whole context: lazy loading of a kernel at its first launch (CUDA's default module
    /// loading), an allocation, a cuBLAS handle. Were a rank to make such a call while its own
    /// all-reduce kernel already spins for a peer whose launch has not been queued yet, the call
    /// would wait for the spin and the spin for the peer's flag: the kernel's 20 s timeout then
    /// ended it with its output unreduced (the first step of a fresh TP model, when every
    /// kernel is loaded for the first time). The barrier before the launch keeps a rank from
    /// spinning before its peers reach the collective; the one after keeps every rank from its
    /// next driver call until all ranks' kernels are queued. (A captured decode graph makes no
    /// such calls.)
    OneShot(OneShotRank, Option<Arc<SpinBarrier>>),
    Nccl(NcclComm),
    Host,
}

/// A CUDA rank's collectives.
pub struct CudaComm {
    reduce: Reduce,
    host: HostComm,
}

impl CudaComm {
    fn kind_name(&self) -> &'static str {
        match self.reduce {
            Reduce::OneShot(..) => "oneshot",
            Reduce::Nccl(_) => "nccl",
            Reduce::Host => "host",
        }
    }
}

impl RankComm<CudaBackend> for CudaComm {
    fn rank(&self) -> usize {
        RankComm::<CudaBackend>::rank(&self.host)
    }
    fn world(&self) -> usize {
        RankComm::<CudaBackend>::world(&self.host)
    }
    fn all_reduce_sum(&self, be: &CudaBackend, x: &mut CudaTensor) -> Result<(), RuntimeError> {
        let n = x.rows * x.cols;
        if n == 0 || RankComm::<CudaBackend>::world(&self.host) == 1 {
            return Ok(());
        }
        match &self.reduce {
            Reduce::OneShot(r, barrier) => {
                let wait = |b: &SpinBarrier| {
                    b.wait().map_err(|e| RuntimeError::Tp {
                        world: r.world(),
                        msg: e.to_string(),
                    })
                };
                if let Some(b) = barrier {
                    wait(b)?;
                }
                let buf = x.f32_mut().ok_or_else(|| not_f32("all-reduce"))?;
                // On an error the rank's step fails and aborts the group (`tp::model::guarded`),
                // which releases the peers from the second barrier.
                r.all_reduce(&mut buf.slice_mut(0..n), n)
                    .map_err(kerr("all-reduce (oneshot)"))?;
                if let Some(b) = barrier {
                    wait(b)?;
                }
                Ok(())
            }
            Reduce::Nccl(c) => {
                let buf = x.f32_mut().ok_or_else(|| not_f32("all-reduce"))?;
                c.0.all_reduce_in_place(
                    &mut buf.slice_mut(0..n),
                    &cudarc::nccl::safe::ReduceOp::Sum,
                )
                .map(|_| ())
                .map_err(|e| RuntimeError::Backend(format!("all-reduce (nccl): {e:?}")))
            }
            Reduce::Host => self.host.all_reduce_sum(be, x),
        }
    }
    fn all_gather_cols(&self, be: &CudaBackend, x: CudaTensor) -> Result<CudaTensor, RuntimeError> {
        self.host.all_gather_cols(be, x)
    }
    fn abort(&self) {
        if let Reduce::OneShot(_, Some(b)) = &self.reduce {
            b.abort();
        }
        RankComm::<CudaBackend>::abort(&self.host);
    }
    fn reset(&self) {
        if let Reduce::OneShot(_, Some(b)) = &self.reduce {
            b.reset();
        }
        RankComm::<CudaBackend>::reset(&self.host);
    }
    fn kind(&self) -> String {
        self.kind_name().into()
    }
    fn check(&self) -> Result<(), RuntimeError> {
        if let Reduce::OneShot(r, _) = &self.reduce {
            if r.take_timeout().map_err(kerr("all-reduce (oneshot)"))? {
                return Err(RuntimeError::Tp {
                    world: r.world(),
                    msg: format!(
                        "rank {}: a one-shot all-reduce timed out waiting for a peer; \
                         this step's results are discarded",
                        r.rank()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Whether every pair of the ranks' devices can reach each other's memory.
pub fn peer_access_everywhere(devices: &[usize]) -> Result<bool, RuntimeError> {
    for &a in devices {
        for &b in devices {
            if !kernels::can_access_peer(a, b).map_err(kerr("cuDeviceCanAccessPeer"))? {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Whether the NCCL library can be loaded.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen candidate library names.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn distinct(devices: &[usize]) -> bool {
    let mut d = devices.to_vec();
    d.sort_unstable();
    d.dedup();
    d.len() == devices.len()
}

/// The all-reduce implementations `want` allows for these rank devices, best first.
fn candidates(devices: &[usize], want: AllReduce) -> Result<Vec<AllReduce>, RuntimeError> {
    let world = devices.len();
    let oneshot = peer_access_everywhere(devices)?;
    let nccl = distinct(devices) && nccl_available();
    let refuse = |msg: String| Err(RuntimeError::Tp { world, msg });
    match want {
        AllReduce::OneShot if !oneshot => refuse(
            "--allreduce oneshot: not every pair of the ranks' GPUs has peer access (cuDeviceCanAccessPeer)"
                .into(),
        ),
        AllReduce::Nccl if !distinct(devices) => refuse(
            "--allreduce nccl: NCCL needs one GPU per rank (two ranks share a GPU)".into(),
        ),
        AllReduce::Nccl if !nccl => refuse("--allreduce nccl: libnccl could not be loaded".into()),
        AllReduce::Auto => {
            let mut v = Vec::new();
            if oneshot {
                v.push(AllReduce::OneShot);
            }
            if nccl {
                v.push(AllReduce::Nccl);
            }
            v.push(AllReduce::Host);
            Ok(v)
        }
        w => Ok(vec![w]),
    }
}

/// Host-side rendezvous of the ranks' setup (addresses, NCCL id, timings).
type SetupGroup = Arc<HostGroup<Vec<u64>>>;

fn exchange(g: &SetupGroup, rank: usize, v: Vec<u64>) -> Result<Arc<Vec<u64>>, RuntimeError> {
    g.exchange(rank, v, |all| all.concat())
        .map_err(|e| RuntimeError::Tp {
            world: g.world(),
            msg: format!("setting up the ranks: {e}"),
        })
}

fn make_oneshot(
    gpu: &Arc<Gpu>,
    rank: usize,
    devices: &[usize],
    g: &SetupGroup,
) -> Result<OneShotRank, RuntimeError> {
    let world = devices.len();
    let mut r =
        OneShotRank::new(gpu, rank, world, ONESHOT_CAP).map_err(kerr("allreduce buffers"))?;
    let h = r.handles();
    let all = exchange(g, rank, vec![h.buf, h.flags])?;
    for &d in devices {
        if d != devices[rank] {
            let peer = Gpu::get(d).map_err(kerr("opening a peer GPU"))?;
            enable_peer_access(gpu, &peer).map_err(kerr("peer access"))?;
        }
    }
    let handles: Vec<kernels::OneShotHandles> = all
        .chunks(2)
        .map(|c| kernels::OneShotHandles {
            buf: c[0],
            flags: c[1],
        })
        .collect();
    r.connect(&handles).map_err(kerr("allreduce connect"))?;
    Ok(r)
}

fn make_nccl(
    gpu: &Arc<Gpu>,
    rank: usize,
    world: usize,
    g: &SetupGroup,
) -> Result<NcclComm, RuntimeError> {
    use cudarc::nccl::safe::{Comm, Id};
    let nerr = |e: cudarc::nccl::result::NcclError| RuntimeError::Tp {
        world,
        msg: format!("NCCL: {e:?}"),
    };
    // Rank 0's unique id, as 16 words, reaches every rank through the setup rendezvous.
    let mine: Vec<u64> = if rank == 0 {
        let id = Id::new().map_err(nerr)?;
        id.internal()
            .chunks(8)
            .map(|c| u64::from_le_bytes(std::array::from_fn(|i| c[i] as u8)))
            .collect()
    } else {
        vec![0; 16]
    };
    let all = exchange(g, rank, mine)?;
    let mut internal = [0 as std::ffi::c_char; 128];
    for (i, w) in all[..16].iter().enumerate() {
        for (j, b) in w.to_le_bytes().iter().enumerate() {
            internal[i * 8 + j] = *b as std::ffi::c_char;
        }
    }
    let comm = Comm::from_rank(Arc::clone(gpu.stream()), rank, world, Id::uninit(internal))
        .map_err(nerr)?;
    Ok(NcclComm(comm))
}

/// Median microseconds of a `PROBE_ELEMS` all-reduce on this rank.
fn time_reduce(be: &CudaBackend, comm: &CudaComm) -> Result<f64, RuntimeError> {
    let mut x = be.new_tensor(1, PROBE_ELEMS, &vec![1.0; PROBE_ELEMS])?;
    let mut times = Vec::with_capacity(PROBE_ITERS);
    for _ in 0..PROBE_ITERS {
        let ms = be
            .gpu
            .time_ms(|| {
                comm.all_reduce_sum(be, &mut x)
                    .map_err(|e| kernels::KernelError::BadShape {
                        op: "allreduce",
                        msg: e.to_string(),
                    })
            })
            .map_err(kerr("timing the all-reduce"))?;
        times.push(ms as f64 * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

fn setup_rank(
    rank: usize,
    devices: &[usize],
    choice: &[AllReduce],
    opts: CudaOptions,
    host: HostComm,
    g: &SetupGroup,
    barrier: Option<&Arc<SpinBarrier>>,
) -> Result<RankSetup<CudaBackend>, RuntimeError> {
    let world = devices.len();
    let ordinal = devices[rank];
    let gpu = Gpu::open_private(ordinal).map_err(kerr("opening the CUDA device"))?;
    let be = CudaBackend::on(Arc::clone(&gpu), opts);
    let build = |w: AllReduce, host: HostComm| -> Result<CudaComm, RuntimeError> {
        let reduce = match w {
            AllReduce::OneShot => {
                Reduce::OneShot(make_oneshot(&gpu, rank, devices, g)?, barrier.cloned())
            }
            AllReduce::Nccl => Reduce::Nccl(make_nccl(&gpu, rank, world, g)?),
            AllReduce::Host | AllReduce::Auto => Reduce::Host,
        };
        Ok(CudaComm { reduce, host })
    };
    let comm = if choice.len() > 2 {
        // Both device paths work: time them (every rank the same way) and keep the faster.
        let one = build(AllReduce::OneShot, host.clone_rank())?;
        let t_one = time_reduce(&be, &one)?;
        let nc = build(AllReduce::Nccl, host.clone_rank())?;
        let t_nccl = time_reduce(&be, &nc)?;
        let all = exchange(g, rank, vec![t_one.to_bits(), t_nccl.to_bits()])?;
        let worst = |i: usize| {
            all.chunks(2)
                .map(|c| f64::from_bits(c[i]))
                .fold(0.0, f64::max)
        };
        let keep = if worst(0) <= worst(1) { one } else { nc };
        CudaComm {
            reduce: keep.reduce,
            host,
        }
    } else {
        build(choice[0], host)?
    };
    // Ranks sharing a GPU share its free memory.
    let sharing = devices.iter().filter(|&&d| d == ordinal).count().max(1) as u64;
    let ctx = Arc::clone(gpu.context());
    Ok(RankSetup {
        backend: Ranked::new(be, Arc::new(comm)),
        device: format!("cuda:{ordinal}"),
        free_memory: Some(Box::new(move || {
            ctx.mem_get_info()
                .ok()
                .map(|(free, _)| free as u64 / sharing)
        })),
    })
}

/// Load `model` over one rank per entry of `devices` (CUDA ordinals; repeats put several ranks
/// on one GPU), every rank's backend with `opts`.
pub fn load_cuda_tp(
    model: Arc<gguf::Model>,
    devices: &[usize],
    moe: MoeSplit,
    want: AllReduce,
    opts: CudaOptions,
    progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
) -> Result<TpModel, RuntimeError> {
    let world = devices.len();
    let choice = candidates(devices, want)?;
    let hosts = RankSlots::new(HostComm::group(world));
    let g: SetupGroup = HostGroup::new(world);
    // Ranks sharing a GPU must all have queued their kernel before any may block the device.
    let barrier = (!distinct(devices)).then(|| SpinBarrier::new(world));
    let (g2, devs) = (Arc::clone(&g), devices.to_vec());
    let kinds = Arc::new(Mutex::new(Vec::<String>::new()));
    let kinds2 = Arc::clone(&kinds);
    let mut m = TpModel::load(
        model,
        world,
        moe,
        move |rank| {
            let host = hosts.take(rank)?;
            let s = setup_rank(rank, &devs, &choice, opts, host, &g2, barrier.as_ref())?;
            kinds2
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(s.backend.comm().kind());
            Ok(s)
        },
        progress,
        Some(Arc::new(move || g.abort())),
    )?;
    let k = kinds.lock().unwrap_or_else(|p| p.into_inner());
    m.set_comm_kind(k.first().cloned().unwrap_or_default());
    drop(k);
    Ok(m)
}
