//! Per-tensor statistics of the dequantized values, computed in one pass fused with
//! dequantization: each rayon task dequantizes its block range a few thousand values at a time
//! into a small buffer (never the whole tensor), reduces that in f64, and the per-task partial
//! results are merged in tensor order with Chan et al.'s parallel update, so the result does not
//! depend on the thread count.
//!
//! Conventions: `mean`, `std` (population) and `sum_sq` are over all values, so a NaN or an
//! infinity shows up in them as numpy's float64 `mean`/`std` would show it; `min`, `max` and
//! `absmax` ignore NaNs (and are NaN only when every value is NaN); NaNs and infinities are also
//! counted.

use crate::quant::fast::{with_kernel, Kernel};
use crate::quant::tables::Tables;
use crate::quant::{n_elements, QuantError};
use crate::GgmlType;
use rayon::prelude::*;
use serde::Serialize;

/// Statistics of one tensor's values after dequantization to f32.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TensorStats {
    /// Number of values.
    pub count: u64,
    pub mean: f64,
    /// Population standard deviation (divides by `count`).
    pub std: f64,
    pub min: f64,
    pub max: f64,
    /// Largest magnitude.
    pub absmax: f64,
    /// Sum of squares.
    pub sum_sq: f64,
    /// Values equal to zero (either sign).
    pub n_zero: u64,
    pub zero_fraction: f64,
    pub n_nan: u64,
    pub n_inf: u64,
}

/// Statistics of `data`, whole blocks of `ty`, in parallel over block ranges.
pub fn tensor_stats(ty: GgmlType, data: &[u8]) -> Result<TensorStats, QuantError> {
    n_elements(ty, data.len())?;
    let tables = crate::quant::tables::tables()?;
    let task_bytes = crate::quant::task_blocks(ty) * ty.type_size();
    let partials: Vec<Partial> = data
        .par_chunks(task_bytes)
        .map(|chunk| with_kernel!(ty, task(ty, chunk, tables)))
        .collect();
    Ok(partials.into_iter().fold(Partial::EMPTY, merge).finish())
}

/// Statistics of plain f32 values (e.g. activations), with the same conventions.
pub fn f32_stats(values: &[f32]) -> TensorStats {
    let partials: Vec<Partial> = values
        .par_chunks(crate::quant::TASK_ELEMS)
        .map(|chunk| {
            chunk
                .chunks(SUB)
                .map(chunk_stats)
                .fold(Partial::EMPTY, merge)
        })
        .collect();
    partials.into_iter().fold(Partial::EMPTY, merge).finish()
}

/// Values dequantized and reduced at a time: small enough to stay in L1 between the two steps.
const SUB: usize = 4096;

/// Moments about the partial's own mean, plus the order statistics and counts.
#[derive(Debug, Clone, Copy)]
struct Partial {
    n: u64,
    mean: f64,
    /// Sum of squared deviations from `mean`.
    m2: f64,
    sum_sq: f64,
    /// NaN-ignoring extremes (+inf / -inf while no non-NaN value was seen).
    min: f32,
    max: f32,
    n_zero: u64,
    n_nan: u64,
    n_inf: u64,
}

impl Partial {
    const EMPTY: Partial = Partial {
        n: 0,
        mean: 0.0,
        m2: 0.0,
        sum_sq: 0.0,
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
        n_zero: 0,
        n_nan: 0,
        n_inf: 0,
    };

    fn finish(self) -> TensorStats {
        let n = self.n as f64;
        let (mean, std) = if self.n == 0 {
            (f64::NAN, f64::NAN)
        } else {
            (self.mean, (self.m2 / n).sqrt())
        };
        let (min, max) = if self.n == self.n_nan {
            (f64::NAN, f64::NAN)
        } else {
            (f64::from(self.min), f64::from(self.max))
        };
        TensorStats {
            count: self.n,
            mean,
            std,
            min,
            max,
            absmax: min.abs().max(max.abs()),
            sum_sq: self.sum_sq,
            n_zero: self.n_zero,
            zero_fraction: if self.n == 0 {
                f64::NAN
            } else {
                self.n_zero as f64 / n
            },
            n_nan: self.n_nan,
            n_inf: self.n_inf,
        }
    }
}

/// Chan, Golub & LeVeque's pairwise update of count, mean and squared deviations.
fn merge(a: Partial, b: Partial) -> Partial {
    if a.n == 0 {
        return b;
    }
    if b.n == 0 {
        return a;
    }
    let n = a.n + b.n;
    let (wa, wb) = (a.n as f64 / n as f64, b.n as f64 / n as f64);
    let (mean, m2) = if a.mean.is_finite() && b.mean.is_finite() {
        let delta = b.mean - a.mean;
        (
            a.mean + delta * wb,
            a.m2 + b.m2 + delta * delta * (a.n as f64 * wb),
        )
    } else {
        // An infinite or NaN part: the weighted mean keeps inf (or inf - inf = NaN) as a plain
        // sum would, and the spread is undefined, as numpy's std is.
        (a.mean * wa + b.mean * wb, f64::NAN)
    };
    Partial {
        n,
        mean,
        m2,
        sum_sq: a.sum_sq + b.sum_sq,
        min: if b.min < a.min { b.min } else { a.min },
        max: if b.max > a.max { b.max } else { a.max },
        n_zero: a.n_zero + b.n_zero,
        n_nan: a.n_nan + b.n_nan,
        n_inf: a.n_inf + b.n_inf,
    }
}

/// One task: dequantize `data` SUB values at a time into a stack buffer and reduce.
fn task<K: Kernel>(ty: GgmlType, data: &[u8], t: &Tables) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the running CPU supports AVX2, checked just above.
        return unsafe { task_avx2::<K>(ty, data, t) };
    }
    task_generic::<K>(ty, data, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn task_avx2<K: Kernel>(ty: GgmlType, data: &[u8], t: &Tables) -> Partial {
    task_generic::<K>(ty, data, t)
}

#[inline(always)]
fn task_generic<K: Kernel>(ty: GgmlType, data: &[u8], t: &Tables) -> Partial {
    let blocks = (SUB / ty.block_size()).max(1);
    let mut buf = [0.0f32; SUB];
    let mut acc = Partial::EMPTY;
    for chunk in data.chunks(blocks * ty.type_size()) {
        let n = chunk.len() / ty.type_size() * ty.block_size();
        let Some(values) = buf.get_mut(..n) else {
            break; // unreachable: block sizes divide SUB
        };
        K::row(ty, chunk, values, t);
        acc = merge(acc, chunk_stats(values));
    }
    acc
}

/// Lanes of independent accumulators: breaks the add dependency chains and lets the loop
/// vectorise; the lane layout is fixed, so every build sums in the same order.
const LANES: usize = 8;

/// Statistics of one buffer. Sums are taken of `x - k` with `k` the first finite value, so the
/// squared deviations come out as `S2 - S1^2/n` without the cancellation of `sum(x^2) - n*mean^2`
/// when the mean is large against the spread (norm weights near 1).
#[inline(always)]
fn chunk_stats(x: &[f32]) -> Partial {
    if x.is_empty() {
        return Partial::EMPTY;
    }
    let k = f64::from(x.iter().copied().find(|v| v.is_finite()).unwrap_or(0.0));
    let mut s1 = [0.0f64; LANES];
    let mut s2 = [0.0f64; LANES];
    let mut min = [f32::INFINITY; LANES];
    let mut max = [f32::NEG_INFINITY; LANES];
    let mut zeros = [0u32; LANES];
    let mut nonfinite = [0u32; LANES];
    let mut lanes = x.chunks_exact(LANES);
    for c in &mut lanes {
        for i in 0..LANES {
            let v = c[i];
            let d = f64::from(v) - k;
            s1[i] += d;
            s2[i] += d * d;
            min[i] = if v < min[i] { v } else { min[i] };
            max[i] = if v > max[i] { v } else { max[i] };
            zeros[i] += u32::from(v == 0.0);
            nonfinite[i] += u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000);
        }
    }
    for &v in lanes.remainder() {
        let d = f64::from(v) - k;
        s1[0] += d;
        s2[0] += d * d;
        min[0] = if v < min[0] { v } else { min[0] };
        max[0] = if v > max[0] { v } else { max[0] };
        zeros[0] += u32::from(v == 0.0);
        nonfinite[0] += u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000);
    }
    let n = x.len() as f64;
    let s1: f64 = s1.iter().sum();
    let s2: f64 = s2.iter().sum();
    let nonfinite: u64 = nonfinite.iter().map(|&c| u64::from(c)).sum();
    // Rare: only then tell NaNs from infinities.
    let n_nan = if nonfinite == 0 {
        0
    } else {
        x.iter().filter(|v| v.is_nan()).count() as u64
    };
    let m2 = s2 - s1 * s1 / n;
    Partial {
        n: x.len() as u64,
        mean: k + s1 / n,
        m2: if m2 < 0.0 { 0.0 } else { m2 },
        sum_sq: s2 + 2.0 * k * s1 + n * k * k,
        min: min
            .iter()
            .copied()
            .fold(f32::INFINITY, |a, b| if b < a { b } else { a }),
        max: max
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a }),
        n_zero: zeros.iter().map(|&c| u64::from(c)).sum(),
        n_nan,
        n_inf: nonfinite - n_nan,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn hand_computed_small() {
        // 1, 2, 3, 4, 0: mean 2, population variance (1+0+1+4+4)/5 = 2, sum_sq 30.
        let s = tensor_stats(GgmlType::F32, &bytes(&[1.0, 2.0, 3.0, 4.0, 0.0]))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.count, 5);
        assert_eq!(s.mean, 2.0);
        assert_eq!(s.std, 2f64.sqrt());
        assert_eq!((s.min, s.max, s.absmax), (0.0, 4.0, 4.0));
        assert_eq!(s.sum_sq, 30.0);
        assert_eq!((s.n_zero, s.zero_fraction), (1, 0.2));
        assert_eq!((s.n_nan, s.n_inf), (0, 0));
    }

    #[test]
    fn constant_tensor_has_zero_spread() {
        // Large mean against zero spread: a naive sum_sq/n - mean^2 would not give 0 here.
        let v = vec![1.1f32; 300_000];
        let s = f32_stats(&v);
        assert_eq!(s.mean, f64::from(1.1f32));
        assert_eq!(s.std, 0.0);
        assert_eq!(s.min, s.max);
    }

    #[test]
    fn nan_and_inf_are_counted_and_extremes_skip_nan() {
        let s = f32_stats(&[1.0, f32::NAN, -3.0, f32::INFINITY, 0.0, -0.0]);
        assert_eq!((s.n_nan, s.n_inf, s.n_zero), (1, 1, 2));
        assert_eq!(
            (s.min, s.max, s.absmax),
            (-3.0, f64::INFINITY, f64::INFINITY)
        );
        assert!(s.mean.is_nan() && s.std.is_nan());
        let s = f32_stats(&[f32::NAN; 3]);
        assert!(s.min.is_nan() && s.max.is_nan() && s.absmax.is_nan());
        let s = f32_stats(&[2.0, f32::INFINITY]);
        assert_eq!(s.mean, f64::INFINITY);
        assert!(s.std.is_nan());
    }

    #[test]
    fn chunking_does_not_change_the_result_beyond_rounding() {
        // Values k/7 for k in -N..N: exact mean 0, exact population variance from the closed
        // form sum k^2 = N(N-1)(2N-1)/3 (+ the endpoint), independent of how the work is split.
        let n: i64 = 100_000;
        let v: Vec<f32> = (-n..n).map(|k| k as f32 / 7.0).collect();
        let s = f32_stats(&v);
        let exact_mean: f64 = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let exact_var: f64 = v
            .iter()
            .map(|&x| (f64::from(x) - exact_mean).powi(2))
            .sum::<f64>()
            / v.len() as f64;
        // Both are f64 sums of the same 2e5 values in different orders: |error| <= n * eps * sum|x|.
        let bound = v.len() as f64 * f64::EPSILON * (n as f64 / 7.0);
        assert!(
            (s.mean - exact_mean).abs() <= bound,
            "{} vs {}",
            s.mean,
            exact_mean
        );
        assert!(
            (s.std - exact_var.sqrt()).abs() <= bound,
            "{} vs {}",
            s.std,
            exact_var.sqrt()
        );
    }

    #[test]
    fn partial_block_is_an_error() {
        assert!(tensor_stats(GgmlType::Q4_K, &[0u8; 145]).is_err());
        let s = tensor_stats(GgmlType::Q4_K, &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.count, 0);
    }
}
