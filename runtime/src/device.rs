//! Choosing the backend a model runs on: the CPU reference or a CUDA GPU (the default when one is
//! present), behind the same `LanguageModel` interface.

use crate::{LanguageModel, RuntimeError};
use std::sync::Arc;

/// Where to run the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// CUDA GPU 0 when a driver and a device are present, else the CPU.
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

/// Load `model` for inference on `device` (resolved first). A CUDA request on a machine without
/// a usable GPU is an error naming the cause, never a silent CPU fallback.
pub fn load_language_model(
    model: Arc<gguf::Model>,
    device: Device,
) -> Result<(Arc<dyn LanguageModel>, Device), RuntimeError> {
    let device = device.resolve();
    let lm: Arc<dyn LanguageModel> = match device {
        Device::Cpu | Device::Auto => Arc::new(crate::glm::load_cpu(model)?),
        Device::Cuda(i) => {
            let n = kernels::device_count();
            if i >= n {
                return Err(RuntimeError::Backend(format!(
                    "--device cuda:{i}: {} CUDA device(s) found{}",
                    n,
                    if kernels::driver_available() {
                        ""
                    } else {
                        " (no NVIDIA driver library could be loaded)"
                    }
                )));
            }
            Arc::new(crate::cuda::load_cuda(model, i)?)
        }
    };
    Ok((lm, device))
}
