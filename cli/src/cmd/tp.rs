//! The tensor-parallel flags shared by `generate`, `serve`, `bench` and `doctor`, and loading a
//! model with them (progress bar over every rank's weight bytes).

use anyhow::{bail, Result};
use runtime::device::{AllReduce, Device, LoadOptions, Loaded, TpSize};
use runtime::tp::MoeSplit;
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct TpArgs {
    /// Tensor-parallel ranks: N, or `auto` (every visible GPU; 1 on the CPU). The model's
    /// attention heads must divide by N.
    #[arg(long, default_value = "1")]
    pub tp: TpSize,
    /// CUDA device of each rank, comma-separated; repeats put several ranks on one GPU
    /// (`--tp 4 --tp-devices 0,0,0,0`). Default: rank r on GPU r.
    #[arg(long, value_delimiter = ',', value_name = "ORDINALS")]
    pub tp_devices: Option<Vec<usize>>,
    /// How routed experts are split over the ranks: `column` (every rank holds 1/N of every
    /// expert: balanced at batch 1, the default) or `expert` (whole experts per rank).
    #[arg(long, default_value = "column")]
    pub moe_split: MoeSplit,
    /// All-reduce between CUDA ranks: auto, oneshot (peer-mapped buffers), nccl, host.
    #[arg(long, default_value = "auto")]
    pub allreduce: AllReduce,
}

impl TpArgs {
    /// Load options for `device`; refuses flags that mean nothing there.
    pub fn options(&self, device: Device) -> Result<LoadOptions> {
        let cpu = matches!(device.resolve(), Device::Cpu);
        if cpu && self.tp_devices.is_some() {
            bail!("--tp-devices places CUDA ranks; the CPU runs every rank on the host (drop it or use --device cuda)");
        }
        if cpu && self.allreduce != AllReduce::Auto {
            bail!("--allreduce chooses how CUDA ranks reduce; CPU ranks always meet in host memory (drop it or use --device cuda)");
        }
        if let (Some(d), TpSize::Ranks(n)) = (&self.tp_devices, self.tp) {
            if d.len() != n {
                bail!("--tp {n} with {} --tp-devices entries", d.len());
            }
        }
        Ok(LoadOptions {
            device,
            tp: Some(self.tp),
            tp_devices: self.tp_devices.clone(),
            moe_split: self.moe_split,
            allreduce: self.allreduce,
            progress: None,
        })
    }
}

/// Load `model` as `opts` says, with a byte progress bar of the weights on a terminal (hidden
/// when `quiet`).
pub fn load(model: Arc<gguf::Model>, mut opts: LoadOptions, quiet: bool) -> Result<Loaded> {
    let total = runtime::device::planned_bytes(&model, &opts)?;
    let pb = crate::util::byte_progress(total, quiet, "loading");
    let bar = pb.clone();
    opts.progress = Some(Arc::new(move |n| bar.inc(n)));
    let l = runtime::device::load(model, &opts);
    pb.finish_and_clear();
    Ok(l?)
}
