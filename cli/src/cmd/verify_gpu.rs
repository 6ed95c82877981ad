//! `verify --gpu`: dequantize every tensor on the GPU and compare with the CPU reference.

use super::verify::Finding;
use anyhow::{bail, Result};
use gguf::{Model, TensorRef};

pub fn run(
    _model: &Model,
    _tensors: &[TensorRef<'_>],
    _quiet: bool,
) -> Result<(serde_json::Value, Vec<Finding>)> {
    bail!("--gpu: the CUDA comparison is not wired yet")
}
