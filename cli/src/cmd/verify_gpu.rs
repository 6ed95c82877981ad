//! `verify --gpu`: dequantize every selected tensor on the GPU and compare it with the CPU's
//! scalar reference dequantizer (the oracle), tensor by tensor, in bounded slices.
//!
//! Tolerance (stated in `kernels::verify`): exact for the plain types (F32/F16/BF16/...); for
//! block types both sides compute scale x quant in f32, so the difference must stay within
//! 4 f32 ulps of the slice's largest magnitude; NaN and infinities must match exactly.

use super::verify::Finding;
use crate::util;
use anyhow::{bail, Context, Result};
use gguf::{Model, TensorRef};
use serde_json::json;

/// Elements per slice: bounds host and device memory whatever the tensor size.
const SLICE_ELEMS: usize = 16 << 20;

pub fn run(
    model: &Model,
    tensors: &[TensorRef<'_>],
    quiet: bool,
) -> Result<(serde_json::Value, Vec<Finding>)> {
    if kernels::device_count() == 0 {
        bail!("--gpu: no CUDA device found");
    }
    let gpu = kernels::Gpu::get(0).context("opening CUDA device 0")?;
    let pb = util::count_progress(tensors.len() as u64, quiet, "gpu check");
    let mut rows = Vec::with_capacity(tensors.len());
    let mut findings = Vec::new();
    let (mut worst_abs, mut worst_rel) = (0f64, 0f64);
    for t in tensors {
        util::check_interrupted()?;
        let ty = t.info.ty;
        let data = model.data(t);
        let block_bytes = ty.type_size();
        let blocks_per_slice = (SLICE_ELEMS / ty.block_size()).max(1);
        let (mut max_abs, mut max_rel, mut max_ref, mut tol) = (0f64, 0f64, 0f64, 0f64);
        let (mut special, mut differing, mut ok) = (0usize, 0usize, true);
        for chunk in data.chunks(blocks_per_slice * block_bytes) {
            let n = chunk.len() / block_bytes * ty.block_size();
            let mut cpu = vec![0f32; n];
            gguf::quant::reference::dequantize(ty, chunk, &mut cpu)
                .with_context(|| format!("tensor {:?}: CPU dequantize", t.info.name))?;
            let d = kernels::compare_tensor(&gpu, ty, chunk, &cpu)
                .with_context(|| format!("tensor {:?}: GPU dequantize", t.info.name))?;
            ok &= d.ok();
            max_abs = max_abs.max(d.max_abs);
            max_ref = max_ref.max(d.max_ref);
            max_rel = max_rel.max(d.max_rel);
            tol = tol.max(d.tolerance);
            special += d.special_mismatches;
            differing += d.differing;
        }
        worst_abs = worst_abs.max(max_abs);
        worst_rel = worst_rel.max(max_rel);
        if !ok {
            findings.push(Finding {
                kind: "gpu".into(),
                tensor: Some(t.info.name.clone()),
                message: format!(
                    "GPU dequantization differs from the CPU reference: max abs {max_abs:e} (tolerance {tol:e}), {special} NaN/Inf mismatches"
                ),
            });
        }
        rows.push(json!({
            "tensor": t.info.name,
            "ggml_type": ty.name(),
            "max_abs": max_abs,
            "max_rel": max_rel,
            "max_ref": max_ref,
            "tolerance": tol,
            "differing": differing,
            "special_mismatches": special,
            "ok": ok,
        }));
        pb.inc(1);
    }
    pb.finish_and_clear();
    let info = gpu.info();
    let v = json!({
        "device": format!("{} ({}, cuda:{})", info.name, info.arch, info.ordinal),
        "checked": rows.len(),
        "failed": findings.len(),
        "max_abs": worst_abs,
        "max_rel": worst_rel,
        "tensors": rows,
    });
    Ok((v, findings))
}
