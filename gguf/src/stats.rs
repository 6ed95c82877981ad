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
        .map(f32_task)
        .collect();
    partials.into_iter().fold(Partial::EMPTY, merge).finish()
}

fn f32_task(values: &[f32]) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the running CPU supports AVX2, checked just above.
        return unsafe { f32_task_avx2(values) };
    }
    values
        .chunks(SUB)
        .map(chunk_stats::<false>)
        .fold(Partial::EMPTY, merge)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn f32_task_avx2(values: &[f32]) -> Partial {
    values
        .chunks(SUB)
        .map(chunk_stats::<true>)
        .fold(Partial::EMPTY, merge)
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
    task_generic::<K, false>(ty, data, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn task_avx2<K: Kernel>(ty: GgmlType, data: &[u8], t: &Tables) -> Partial {
    task_generic::<K, true>(ty, data, t)
}

/// `AVX2` is true only when inlined into [`task_avx2`], i.e. after the CPU check.
#[inline(always)]
fn task_generic<K: Kernel, const AVX2: bool>(ty: GgmlType, data: &[u8], t: &Tables) -> Partial {
    let blocks = (SUB / ty.block_size()).max(1);
    let mut buf = [0.0f32; SUB];
    let mut acc = Partial::EMPTY;
    for chunk in data.chunks(blocks * ty.type_size()) {
        let n = chunk.len() / ty.type_size() * ty.block_size();
        let Some(values) = buf.get_mut(..n) else {
            break; // unreachable: block sizes divide SUB
        };
        K::row::<AVX2>(ty, chunk, values, t);
        acc = merge(acc, chunk_stats::<AVX2>(values));
    }
    acc
}

/// Lanes of independent accumulators: element i of every LANES-wide step goes to lane i. This
/// breaks the add dependency chains, maps one-to-one onto AVX2 registers, and fixes the
/// summation order, so the portable and the AVX2 loop give identical bits.
const LANES: usize = 8;

/// Per-lane partial sums of one buffer's whole LANES-wide steps.
struct Lanes {
    s1: [f64; LANES],
    s2: [f64; LANES],
    min: [f32; LANES],
    max: [f32; LANES],
    zeros: [u32; LANES],
}

impl Lanes {
    const EMPTY: Lanes = Lanes {
        s1: [0.0; LANES],
        s2: [0.0; LANES],
        min: [f32::INFINITY; LANES],
        max: [f32::NEG_INFINITY; LANES],
        zeros: [0; LANES],
    };

    /// Adds one value to lane `i`: the definition the AVX2 loop reproduces.
    #[inline(always)]
    fn add(&mut self, i: usize, v: f32, k: f64) {
        let d = f64::from(v) - k;
        self.s1[i] += d;
        self.s2[i] += d * d;
        // `v < min ? v : min` (NaN never replaces), which is exactly what vminps computes.
        self.min[i] = if v < self.min[i] { v } else { self.min[i] };
        self.max[i] = if v > self.max[i] { v } else { self.max[i] };
        self.zeros[i] += u32::from(v == 0.0);
    }
}

#[inline(always)]
fn lanes_portable(steps: &[f32], k: f64) -> Lanes {
    let mut l = Lanes::EMPTY;
    for c in steps.chunks_exact(LANES) {
        for (i, &v) in c.iter().enumerate() {
            l.add(i, v, k);
        }
    }
    l
}

/// [`lanes_portable`] with AVX2 intrinsics (the compiler does not vectorise the lane loop on
/// its own): same lanes, same IEEE operations, no FMA, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lanes_avx2(steps: &[f32], k: f64) -> Lanes {
    use std::arch::x86_64::*;
    let mut l = Lanes::EMPTY;
    let kv = _mm256_set1_pd(k);
    let zero = _mm256_setzero_ps();
    let mut s1_lo = _mm256_setzero_pd();
    let mut s1_hi = _mm256_setzero_pd();
    let mut s2_lo = _mm256_setzero_pd();
    let mut s2_hi = _mm256_setzero_pd();
    let mut min = _mm256_set1_ps(f32::INFINITY);
    let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut zeros = _mm256_setzero_si256();
    for c in steps.chunks_exact(LANES) {
        // SAFETY: `c` is exactly LANES = 8 f32s; loadu has no alignment requirement.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        let lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), kv);
        let hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)), kv);
        s1_lo = _mm256_add_pd(s1_lo, lo);
        s1_hi = _mm256_add_pd(s1_hi, hi);
        s2_lo = _mm256_add_pd(s2_lo, _mm256_mul_pd(lo, lo));
        s2_hi = _mm256_add_pd(s2_hi, _mm256_mul_pd(hi, hi));
        min = _mm256_min_ps(v, min);
        max = _mm256_max_ps(v, max);
        // The all-ones mask is -1: subtracting it counts.
        zeros = _mm256_sub_epi32(
            zeros,
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_EQ_OQ>(v, zero)),
        );
    }
    // SAFETY: each destination is an array of exactly the stored width (4 f64, 8 f32, 8 i32).
    unsafe {
        _mm256_storeu_pd(l.s1.as_mut_ptr(), s1_lo);
        _mm256_storeu_pd(l.s1.as_mut_ptr().add(4), s1_hi);
        _mm256_storeu_pd(l.s2.as_mut_ptr(), s2_lo);
        _mm256_storeu_pd(l.s2.as_mut_ptr().add(4), s2_hi);
        _mm256_storeu_ps(l.min.as_mut_ptr(), min);
        _mm256_storeu_ps(l.max.as_mut_ptr(), max);
        _mm256_storeu_si256(l.zeros.as_mut_ptr().cast(), zeros);
    }
    l
}

/// Statistics of one buffer. Sums are taken of `x - k` with `k` the first finite value, so the
/// squared deviations come out as `S2 - S1^2/n` without the cancellation of `sum(x^2) - n*mean^2`
/// when the mean is large against the spread (norm weights near 1).
#[inline(always)]
fn chunk_stats<const AVX2: bool>(x: &[f32]) -> Partial {
    if x.is_empty() {
        return Partial::EMPTY;
    }
    let k = f64::from(x.iter().copied().find(|v| v.is_finite()).unwrap_or(0.0));
    let whole = x.len() / LANES * LANES;
    let (steps, rest) = x.split_at(whole);
    #[cfg(target_arch = "x86_64")]
    let mut l = if AVX2 {
        // SAFETY: AVX2 is only true inside `task_avx2`, which runs after the CPU check.
        unsafe { lanes_avx2(steps, k) }
    } else {
        lanes_portable(steps, k)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let mut l = lanes_portable(steps, k);
    for &v in rest {
        l.add(0, v, k);
    }
    let n = x.len() as f64;
    let s1: f64 = l.s1.iter().sum();
    let s2: f64 = l.s2.iter().sum();
    // A NaN or infinity makes the sums non-finite (finite f32 squares cannot overflow f64), so
    // only then are the values scanned again to count them.
    let (n_nan, n_inf) = if s1.is_finite() && s2.is_finite() {
        (0, 0)
    } else {
        let nan = x.iter().filter(|v| v.is_nan()).count() as u64;
        let inf = x.iter().filter(|v| v.is_infinite()).count() as u64;
        (nan, inf)
    };
    let m2 = s2 - s1 * s1 / n;
    Partial {
        n: x.len() as u64,
        mean: k + s1 / n,
        m2: if m2 < 0.0 { 0.0 } else { m2 },
        sum_sq: s2 + 2.0 * k * s1 + n * k * k,
        min: l
            .min
            .iter()
            .copied()
            .fold(f32::INFINITY, |a, b| if b < a { b } else { a }),
        max: l
            .max
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a }),
        n_zero: l.zeros.iter().map(|&c| u64::from(c)).sum(),
        n_nan,
        n_inf,
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
    fn avx2_lanes_give_the_portable_bits() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut values: Vec<f32> = (0..SUB - 3) // one chunk, with a remainder
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                f32::from_bits((state >> 32) as u32) // every class: NaN, inf, subnormal, zero
            })
            .collect();
        let finite: Vec<f32> = values
            .iter()
            .map(|v| if v.is_finite() { *v } else { 0.5 })
            .collect();
        values[7] = 0.0;
        for x in [&values[..], &finite[..], &finite[..13], &[-0.0f32, 0.0][..]] {
            let a = chunk_stats::<false>(x);
            let b = f32_task(x);
            // NaN payloads depend on operand order, which the compiler may swap (fadd commutes).
            let bits = |v: f64| if v.is_nan() { u64::MAX } else { v.to_bits() };
            let key = |p: &Partial| {
                (
                    p.n,
                    bits(p.mean),
                    bits(p.m2),
                    bits(p.sum_sq),
                    p.min.to_bits(),
                )
            };
            assert_eq!(key(&a), key(&b));
            assert_eq!(
                (a.max.to_bits(), a.n_zero, a.n_nan, a.n_inf),
                (b.max.to_bits(), b.n_zero, b.n_nan, b.n_inf)
            );
        }
    }

    #[test]
    fn partial_block_is_an_error() {
        assert!(tensor_stats(GgmlType::Q4_K, &[0u8; 145]).is_err());
        let s = tensor_stats(GgmlType::Q4_K, &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.count, 0);
    }
}
