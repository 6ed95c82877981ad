//! CPU oracles and test data shared by the GPU tests (gpu.rs) and the emulator's kernel tests
//! (kernels/emu/tests/kernels.rs): one definition of what each kernel must compute.

// Each including test crate uses a subset; the oracles index several arrays by the same loop
// counters, written as in the math.
#![allow(dead_code, clippy::needless_range_loop, clippy::too_many_arguments)]

use std::io::Write;

use gguf::quant::reference;
use gguf::GgmlType;

pub const U32: f64 = 1.0 / (1u64 << 24) as f64; // f32 unit roundoff 2^-24

/// xorshift64*: fast, seedable, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn new(test: &str) -> Self {
        let seed = std::env::var("GGUFTOOL_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        let _ = writeln!(std::io::stderr().lock(), "{test}: seed {seed}");
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        (2.0 * self.unit() - 1.0) * a
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
}

pub fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// `n_blocks` blocks of `ty` with random payload but finite, realistic scales, so dot products
/// are finite. (Raw random bytes, NaN scales included, are used for the bit-exact dequant test.)
pub fn sane_blocks(ty: GgmlType, n_elems: usize, r: &mut Rng) -> Vec<u8> {
    use GgmlType::*;
    let bs = ty.block_size();
    let ts = ty.type_size();
    let nb = n_elems / bs;
    match ty {
        F32 => {
            return r
                .vec(n_elems, 1.0)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        }
        F16 => {
            return r
                .vec(n_elems, 1.0)
                .iter()
                .flat_map(|&v| f16_bits(v))
                .collect()
        }
        BF16 => {
            return r
                .vec(n_elems, 1.0)
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect()
        }
        F64 => {
            return r
                .vec(n_elems, 1.0)
                .iter()
                .flat_map(|&v| f64::from(v).to_le_bytes())
                .collect()
        }
        _ => {}
    }
    let mut out: Vec<u8> = (0..nb * ts).map(|_| r.byte()).collect();
    for b in out.chunks_exact_mut(ts) {
        let mut put = |off: usize, v: f32| b[off..off + 2].copy_from_slice(&f16_bits(v));
        let d = 0.002 + 0.01 * r.unit();
        let m = 0.002 + 0.01 * r.unit();
        match ty {
            Q4_0 | Q5_0 | Q8_0 | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S
            | IQ4_XS | Q1_0 => put(0, d),
            Q4_1 | Q5_1 | Q8_1 | Q4_K | Q5_K => {
                put(0, d);
                put(2, m);
            }
            Q2_K => {
                put(80, d);
                put(82, m);
            }
            Q3_K => put(108, d),
            Q6_K => put(208, d),
            TQ1_0 => put(52, d),
            TQ2_0 => put(64, d),
            Q8_K => b[0..4].copy_from_slice(&d.to_le_bytes()),
            MXFP4 => b[0] = 118 + (r.byte() % 12),
            IQ1_M => {
                let bits = half::f16::from_f32(d).to_bits();
                for i in 0..4 {
                    let nib = ((bits >> (4 * i)) & 0xF) as u8;
                    b[49 + 2 * i] = (b[49 + 2 * i] & 0x0F) | (nib << 4);
                }
            }
            _ => {}
        }
    }
    out
}

pub fn dequant_cpu(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let n = gguf::quant::n_elements(ty, bytes.len()).expect("whole blocks");
    let mut out = vec![0f32; n];
    reference::dequantize(ty, bytes, &mut out).expect("reference dequantize");
    out
}

pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Activations with block-to-block magnitude changes (a few blocks large, one all zero), as
/// real hidden states have.
pub fn activations(r: &mut Rng, rows: usize, k: usize) -> Vec<f32> {
    let mut x = r.vec(rows * k, 1.0);
    for (b, blk) in x.chunks_mut(32).enumerate() {
        let scale = match b % 7 {
            0 => 8.0,
            3 => 0.01,
            _ => 1.0,
        };
        for v in blk.iter_mut() {
            *v *= scale;
        }
        if b == 5 {
            blk.fill(0.0);
        }
    }
    x
}

/// The CPU emulation of quantize.cu: d = max|x| / 127 (f32), q = round(x / d).
pub fn q8_cpu(x: &[f32]) -> (Vec<i8>, Vec<f32>, Vec<i16>) {
    let (mut q, mut d, mut s) = (Vec::new(), Vec::new(), Vec::new());
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dd = amax / 127.0;
        let codes: Vec<i8> = blk
            .iter()
            .map(|&v| if dd > 0.0 { (v / dd).round() as i8 } else { 0 })
            .collect();
        s.push(codes[..16].iter().map(|&c| i16::from(c)).sum());
        s.push(codes[16..].iter().map(|&c| i16::from(c)).sum());
        q.extend(codes);
        d.push(dd);
    }
    (q, d, s)
}

pub fn indexer_cpu(
    q: &[f32],
    k: &[f32],
    w: &[f32],
    heads: usize,
    dim: usize,
    t_len: usize,
    pos: i32,
    scale: f32,
) -> Vec<f64> {
    (0..t_len)
        .map(|t| {
            if t as i32 > pos {
                return f64::NEG_INFINITY;
            }
            (0..heads)
                .map(|h| {
                    let dot: f64 = (0..dim)
                        .map(|i| f64::from(q[h * dim + i]) * f64::from(k[t * dim + i]))
                        .sum();
                    f64::from(w[h]) * (dot * f64::from(scale)).max(0.0)
                })
                .sum()
        })
        .collect()
}

/// Reference selection: the k largest (ties to the lower index), ascending index order.
pub fn topk_cpu(x: &[f32], k: usize) -> Vec<i32> {
    let mut cand: Vec<usize> = (0..x.len())
        .filter(|&i| !x[i].is_nan() && x[i] != f32::NEG_INFINITY)
        .collect();
    if cand.len() > k {
        cand.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        cand.truncate(k);
        cand.sort();
    }
    let mut out: Vec<i32> = cand.into_iter().map(|i| i as i32).collect();
    out.resize(k, -1);
    out
}

/// Checks one integer-dot GEMV output `y` (`ncols` columns of `rows` outputs each) against
/// (A) the f64 product of the dequantized weights `w` with the quantized activations d*q (what
/// the kernel computes exactly, up to f32 rounding of the per-block scale products and the sums
/// over blocks) and (B) the f64 product with the f32 activations `x`, allowed the activation
/// rounding |x - d q| <= d/2 on top. Returns (all within, worst error over tolerance (A)).
pub fn gemvq_verify(
    w: &[f32],
    x: &[f32],
    qc: &[i8],
    qd: &[f32],
    y: &[f32],
    rows: usize,
    k: usize,
    ncols: usize,
) -> (bool, f64) {
    let mut ok = true;
    let mut worst = 0f64;
    for c in 0..ncols {
        let xq: Vec<f64> = (0..k)
            .map(|i| f64::from(qc[c * k + i]) * f64::from(qd[(c * k + i) / 32]))
            .collect();
        for rr in 0..rows {
            let wr = &w[rr * k..(rr + 1) * k];
            let (mut ya, mut yb, mut mag, mut qerr) = (0f64, 0f64, 0f64, 0f64);
            for (bi, wb) in wr.chunks(32).enumerate() {
                let wmax = wb.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
                for (j, &wv) in wb.iter().enumerate() {
                    let i = bi * 32 + j;
                    ya += f64::from(wv) * xq[i];
                    yb += f64::from(wv) * f64::from(x[c * k + i]);
                    // |d sc q| + |dmin m| <= 3 max|w| bounds the terms the kernel rounds.
                    mag += 3.0 * wmax * xq[i].abs();
                    qerr += f64::from(wv.abs()) * f64::from(qd[(c * k + i) / 32]) * (0.5 + 1e-5);
                }
            }
            let tol_a = (k as f64 / 32.0 + 16.0) * 4.0 * U32 * mag + 1e-30;
            let got = f64::from(y[c * rows + rr]);
            let ea = (got - ya).abs();
            let eb = (got - yb).abs();
            ok &= got.is_finite() && ea <= tol_a && eb <= qerr + tol_a;
            worst = worst.max(ea / tol_a);
        }
    }
    (ok, worst)
}

/// RMS norm of one row in f64: w * x / sqrt(mean(x^2) + eps).
pub fn rms_norm_f64(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + f64::from(eps)).sqrt();
    x.iter()
        .zip(w)
        .map(|(a, ww)| f64::from(*a) * inv * f64::from(*ww))
        .collect()
}
