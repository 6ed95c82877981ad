//! Choosing the backend a model runs on: the CPU reference or a CUDA GPU (the default when one is
//! present), on one device or split over tensor-parallel ranks, behind the same `LanguageModel`
//! interface.

use crate::cuda::CudaBackend;
use crate::glm::GlmModel;
use crate::tp::model::rank_report;
use crate::tp::{HostComm, MoeSplit, RankReport, RankSetup, RankSlots, Ranked, TpModel, TpReport};
use crate::{LanguageModel, RuntimeError};
use std::sync::Arc;
use std::time::Instant;

/// Where to run the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// CUDA GPU 0 when a driver and a device are present, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// CUDA GPU by ordinal.
    Cuda(usize),
}

impl Device {
    /// The concrete device `Auto` stands for on this machine.
    pub fn resolve(self) -> Device {
        match self {
            Device::Auto if kernels::device_count() > 0 => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
        }
    }

    pub fn name(self) -> String {
        match self {
            Device::Auto => "auto".into(),
            Device::Cpu => "cpu".into(),
            Device::Cuda(i) => format!("cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    /// `auto`, `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?} (auto, cpu, cuda, cuda:N)")),
        }
    }
}

/// Tensor-parallel world size: a number, or every visible GPU (`auto`; 1 on the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TpSize {
    #[default]
    Auto,
    Ranks(usize),
}

impl std::str::FromStr for TpSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(TpSize::Auto),
            _ => match s.parse::<usize>() {
                Ok(n) if (1..=1024).contains(&n) => Ok(TpSize::Ranks(n)),
                _ => Err(format!(
                    "--tp {s:?}: expected a rank count 1..=1024 or auto"
                )),
            },
        }
    }
}

/// The all-reduce of CUDA ranks (see `crate::cuda::comm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllReduce {
    /// One-shot over peer-mapped buffers where every pair of ranks can reach each other (or
    /// shares a GPU), else NCCL, else through host memory; timed when several work.
    #[default]
    Auto,
    OneShot,
    Nccl,
    /// Through host memory (always available; slow).
    Host,
}

impl std::str::FromStr for AllReduce {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(AllReduce::Auto),
            "oneshot" | "one-shot" => Ok(AllReduce::OneShot),
            "nccl" => Ok(AllReduce::Nccl),
            "host" => Ok(AllReduce::Host),
            _ => Err(format!(
                "unknown all-reduce {s:?} (auto, oneshot, nccl, host)"
            )),
        }
    }
}

/// How to load a model.
#[derive(Clone, Default)]
pub struct LoadOptions {
    pub device: Device,
    /// Ranks; `Ranks(1)` and `Auto` on the CPU are the single-device path.
    pub tp: Option<TpSize>,
    /// CUDA ordinal of each rank (several ranks may share one GPU); default rank r on GPU r.
    pub tp_devices: Option<Vec<usize>>,
    pub moe_split: MoeSplit,
    pub allreduce: AllReduce,
    /// Told the bytes of every weight as it is uploaded (a progress bar).
    pub progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
}

/// A loaded model and how it was placed.
pub struct Loaded {
    pub lm: Arc<dyn LanguageModel>,
    pub device: Device,
    /// The split, for a tensor-parallel model.
    pub tp: Option<TpReport>,
    /// The same model as its ranks, when it has more than one (doctor observes rank 0).
    pub sharded: Option<Arc<TpModel>>,
    /// Bytes of weights loaded (over all ranks) and the load's wall time.
    pub weight_bytes: u64,
    pub load_s: f64,
}

fn no_gpu(what: &str, i: usize) -> RuntimeError {
    let n = kernels::device_count();
    RuntimeError::Backend(format!(
        "{what} cuda:{i}: {} CUDA device(s) found{}",
        n,
        if kernels::driver_available() {
            ""
        } else {
            " (no NVIDIA driver library could be loaded)"
        }
    ))
}

/// The CUDA ordinals of `world` ranks.
pub fn rank_devices(world: usize, given: Option<&[usize]>) -> Result<Vec<usize>, RuntimeError> {
    let n = kernels::device_count();
    let devs: Vec<usize> = match given {
        Some(d) if d.len() != world => {
            return Err(RuntimeError::Tp {
                world,
                msg: format!("--tp-devices lists {} devices for {world} ranks", d.len()),
            })
        }
        Some(d) => d.to_vec(),
        None if world > n => {
            return Err(RuntimeError::Tp {
                world,
                msg: format!(
                    "{n} CUDA device(s) found; to put several ranks on one GPU, list them: --tp-devices {}",
                    vec!["0"; world].join(",")
                ),
            })
        }
        None => (0..world).collect(),
    };
    if let Some(&bad) = devs.iter().find(|&&d| d >= n) {
        return Err(no_gpu("--tp-devices", bad));
    }
    Ok(devs)
}

/// The number of ranks `opts` asks for (`auto`: every visible GPU, or the listed devices; 1 on
/// the CPU).
pub fn world_size(opts: &LoadOptions) -> usize {
    match (opts.tp.unwrap_or(TpSize::Ranks(1)), opts.device.resolve()) {
        (TpSize::Ranks(n), _) => n,
        (TpSize::Auto, Device::Cuda(_)) => match &opts.tp_devices {
            Some(d) => d.len(),
            None => kernels::device_count().max(1),
        },
        (TpSize::Auto, _) => 1,
    }
}

/// Bytes of weights loading `model` as `opts` says puts on all ranks together (from the header;
/// a progress bar's length).
pub fn planned_bytes(model: &gguf::Model, opts: &LoadOptions) -> Result<u64, RuntimeError> {
    let spec = crate::spec::ModelSpec::from_model(model)?;
    let plan = crate::tp::plan::weight_plan(model, &spec, world_size(opts), opts.moe_split)?;
    Ok(plan.ranks.iter().map(|r| r.weight_bytes).sum())
}

/// Load `model` as `opts` says (device resolved first). A CUDA request on a machine without a
/// usable GPU is an error naming the cause, never a silent CPU fallback; an impossible split is
/// refused before anything is loaded, naming the dimension that does not divide.
pub fn load(model: Arc<gguf::Model>, opts: &LoadOptions) -> Result<Loaded, RuntimeError> {
    let t0 = Instant::now();
    let world = world_size(opts);
    let device = match (opts.device.resolve(), opts.tp_devices.as_deref()) {
        // One rank placed by --tp-devices.
        (Device::Cuda(_), Some(&[d])) if world == 1 => Device::Cuda(d),
        (d, _) => d,
    };
    if world == 1 {
        let progress = opts.progress.as_deref().map(|p| p as &(dyn Fn(u64) + Sync));
        let (lm, rank): (Arc<dyn LanguageModel>, RankReport) = match device {
            Device::Cpu | Device::Auto => {
                let m = GlmModel::load_view(crate::cpu::CpuBackend, model, None, progress)?;
                let r = rank_report(&m, "cpu".into());
                (Arc::new(m), r)
            }
            Device::Cuda(i) => {
                if i >= kernels::device_count() {
                    return Err(no_gpu("--device", i));
                }
                let m = GlmModel::load_view(CudaBackend::new(i)?, model, None, progress)?;
                let r = rank_report(&m, format!("cuda:{i}"));
                (Arc::new(m), r)
            }
        };
        let load_s = t0.elapsed().as_secs_f64();
        return Ok(Loaded {
            lm,
            device,
            weight_bytes: rank.weight_bytes,
            sharded: None,
            tp: Some(TpReport {
                world: 1,
                moe_split: opts.moe_split,
                comm: "none".into(),
                load_bytes: rank.weight_bytes,
                load_s,
                ranks: vec![rank],
            }),
            load_s,
        });
    }
    let tp = match device {
        Device::Cpu | Device::Auto => {
            load_cpu_tp(model, world, opts.moe_split, opts.progress.clone())?
        }
        Device::Cuda(_) => {
            let devs = rank_devices(world, opts.tp_devices.as_deref())?;
            crate::cuda::comm::load_cuda_tp(
                model,
                &devs,
                opts.moe_split,
                opts.allreduce,
                crate::cuda::CudaOptions::default(),
                opts.progress.clone(),
            )?
        }
    };
    let report = tp.tp_report();
    let tp = Arc::new(tp);
    Ok(Loaded {
        weight_bytes: report.as_ref().map_or(0, |r| r.load_bytes),
        tp: report,
        lm: Arc::clone(&tp) as Arc<dyn LanguageModel>,
        sharded: Some(tp),
        device,
        load_s: t0.elapsed().as_secs_f64(),
    })
}

/// `world` CPU ranks, one OS thread each, meeting in host memory: the exact test of the
/// sharding math (f32 everywhere, like the single-device reference).
pub fn load_cpu_tp(
    model: Arc<gguf::Model>,
    world: usize,
    moe: MoeSplit,
    progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
) -> Result<TpModel, RuntimeError> {
    let comms = RankSlots::new(HostComm::group(world));
    let mut m = TpModel::load(
        model,
        world,
        moe,
        move |rank| {
            let comm = comms.take(rank)?;
            Ok(RankSetup {
                backend: Ranked::new(crate::cpu::CpuBackend, Arc::new(comm)),
                device: "cpu".into(),
                free_memory: None,
            })
        },
        progress,
        None,
    )?;
    m.set_comm_kind("host".into());
    Ok(m)
}

/// Load `model` for inference on `device` (resolved first), on one device.
pub fn load_language_model(
    model: Arc<gguf::Model>,
    device: Device,
) -> Result<(Arc<dyn LanguageModel>, Device), RuntimeError> {
    let l = load(
        model,
        &LoadOptions {
            device,
            ..LoadOptions::default()
        },
    )?;
    Ok((l.lm, l.device))
}
