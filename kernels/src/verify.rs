//! `gguftool verify --gpu`: dequantize a tensor on the GPU and compare it with the CPU values.
//!
//! Tolerance, from the arithmetic: plain types (F32/F16/BF16/F64/I*) are conversions and must
//! match exactly. For block types both sides form `scale * quant` (and `- min`) in f32; the
//! dequant module is compiled without FMA contraction and in the reference's operation order, so
//! the expected difference is zero, and the bound allowed is 4 f32 ulps of the tensor's largest
//! magnitude (`4 * 2^-23 * max|x|`): an association or contraction difference in a two-term
//! expression moves a value by at most ~2 ulps of its largest term, which is <= 2 * max|x| for
//! `d*sc*q - dmin*m` (the min term is itself a value at q = 0). NaN must match NaN and infinities
//! must match exactly, anywhere.

use gguf::GgmlType;

use crate::device::Gpu;
use crate::error::KernelError;

/// Largest tensor slice dequantized at once (bytes of GPU f32 output), to bound device memory.
const CHUNK_VALUES: usize = 64 << 20;

/// Result of comparing one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuDiff {
    pub n: usize,
    /// max |gpu - cpu| over finite pairs.
    pub max_abs: f64,
    /// `max_abs / max|cpu|` (0 for an all-zero tensor).
    pub max_rel: f64,
    /// max |cpu| over finite values.
    pub max_ref: f64,
    /// The bound `max_abs` is held to (see the module docs).
    pub tolerance: f64,
    /// Values whose NaN / infinity status or sign of infinity differs.
    pub special_mismatches: usize,
    /// Values that differ at all (bitwise, NaN payloads ignored).
    pub differing: usize,
}

impl GpuDiff {
    pub fn ok(&self) -> bool {
        self.special_mismatches == 0 && self.max_abs <= self.tolerance
    }
}

/// Dequantize `bytes` (whole blocks of `ty`) on the GPU and compare with `cpu` (the CPU's
/// dequantized values of the same bytes).
pub fn compare_tensor(
    gpu: &Gpu,
    ty: GgmlType,
    bytes: &[u8],
    cpu: &[f32],
) -> Result<GpuDiff, KernelError> {
    const OP: &str = "verify";
    let n = crate::dequant::elements_of(OP, ty, bytes.len())?;
    if cpu.len() != n {
        return Err(KernelError::BadLength {
            op: OP,
            arg: "cpu",
            need: n,
            got: cpu.len(),
        });
    }
    // Whole blocks (and whole 32-value chunks for plain types) per slice.
    let (qb, bb) = crate::quant::decoder_block(ty);
    let per = (CHUNK_VALUES / qb).max(1) * qb;
    let mut d = GpuDiff {
        n,
        max_abs: 0.0,
        max_rel: 0.0,
        max_ref: 0.0,
        tolerance: 0.0,
        special_mismatches: 0,
        differing: 0,
    };
    let mut start = 0usize;
    while start < n {
        let len = per.min(n - start);
        let b0 = start / qb * bb;
        let b1 = b0 + len.div_ceil(qb) * bb;
        let b1 = b1.min(bytes.len());
        let dev_in = gpu.upload(&bytes[b0..b1])?;
        let mut dev_out = gpu.zeros::<f32>(len)?;
        gpu.dequantize(ty, &dev_in, &mut dev_out)?;
        let got = gpu.download(&dev_out)?;
        for (g, c) in got.iter().zip(&cpu[start..start + len]) {
            let (g, c) = (*g, *c);
            if g.is_nan() || c.is_nan() || g.is_infinite() || c.is_infinite() {
                let same = (g.is_nan() && c.is_nan()) || g.to_bits() == c.to_bits();
                if !same {
                    d.special_mismatches += 1;
                    d.differing += 1;
                }
                continue;
            }
            if g.to_bits() != c.to_bits() {
                d.differing += 1;
            }
            d.max_abs = d.max_abs.max((f64::from(g) - f64::from(c)).abs());
            d.max_ref = d.max_ref.max(f64::from(c).abs());
        }
        start += len;
    }
    d.max_rel = if d.max_ref > 0.0 {
        d.max_abs / d.max_ref
    } else {
        0.0
    };
    d.tolerance = if ty.is_quantized() {
        4.0 * f64::from(f32::EPSILON) * d.max_ref
    } else {
        0.0
    };
    Ok(d)
}
