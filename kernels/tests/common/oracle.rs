//! CPU oracles and test data shared by the GPU tests (gpu.rs) and the emulator's kernel tests
//! (kernels/emu/tests/kernels.rs): one definition of what each kernel must compute.

// Each including test crate uses a subset; the oracles index several arrays by the same loop
// counters, written as in the math.
#![allow(dead_code, clippy::needless_range_loop, clippy::too_many_arguments)]

use std::io::Write;

use gguf::quant::reference;
use gguf::GgmlType;
use kernels::{Gating, RouterConfig};

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

/// Random inputs of one indexer call over a bf16 key cache: queries `[S, H, D]`, key rows
/// `k_stride` apart as bf16 bits (the gaps NaN, which a kernel must never read) and their
/// widened values dense `[T, D]` for the oracle, per-head weights `[S, H]` (times H^-0.5 as
/// the model's), and the score scale D^-0.5.
pub struct IndexerCase {
    pub q: Vec<f32>,
    pub kbits: Vec<u16>,
    pub kc: Vec<f32>,
    pub w: Vec<f32>,
    pub scale: f32,
}

pub fn indexer_case(
    r: &mut Rng,
    heads: usize,
    dim: usize,
    k_stride: usize,
    t_len: usize,
    s_len: usize,
) -> IndexerCase {
    let q = r.vec(s_len * heads * dim, 1.0);
    let mut kbits = vec![half::bf16::from_f32(f32::NAN).to_bits(); t_len * k_stride];
    let mut kc = vec![0f32; t_len * dim];
    for t in 0..t_len {
        for d in 0..dim {
            let b = half::bf16::from_f32(r.sym(1.0)).to_bits();
            kbits[t * k_stride + d] = b;
            kc[t * dim + d] = half::bf16::from_bits(b).to_f32();
        }
    }
    let w = r
        .vec(s_len * heads, 1.0)
        .iter()
        .map(|v| v / (heads as f32).sqrt())
        .collect();
    IndexerCase {
        q,
        kbits,
        kc,
        w,
        scale: 1.0 / (dim as f32).sqrt(),
    }
}

/// The layout the scorer tests give a case: dense queries and weights, key rows `k_stride`
/// apart, score rows 3 wider than T (their padding must stay untouched).
pub fn indexer_shape(
    c: &IndexerCase,
    heads: usize,
    dim: usize,
    k_stride: usize,
    t_len: usize,
    s_len: usize,
) -> kernels::IndexerShape {
    kernels::IndexerShape {
        tokens: s_len,
        heads,
        dim,
        q_stride: heads * dim,
        k_stride,
        kv_len: t_len,
        w_stride: heads,
        out_stride: t_len + 3,
        scale: c.scale,
    }
}

/// [`indexer_cpu`] of token `s` of `c` (at position `p`).
fn indexer_want(
    c: &IndexerCase,
    s: usize,
    heads: usize,
    dim: usize,
    t_len: usize,
    p: i32,
) -> Vec<f64> {
    indexer_cpu(
        &c.q[s * heads * dim..],
        &c.kc,
        &c.w[s * heads..],
        heads,
        dim,
        t_len,
        p,
        c.scale,
    )
}

/// Scores `sc` (`[S, out_stride]`) of `c` against [`indexer_cpu`]: the worst error relative to
/// each token's largest unmasked |score|, whether every unmasked score is finite (f64::max
/// would skip a NaN), every masked key -inf and the padding past T untouched (NaN), and how
/// many scores were compared.
pub fn indexer_check(
    c: &IndexerCase,
    sc: &[f32],
    out_stride: usize,
    heads: usize,
    dim: usize,
    t_len: usize,
    pos: &[i32],
) -> (f64, bool, usize) {
    let (mut worst, mut layout_ok, mut scored) = (0f64, true, 0usize);
    for (s, &p) in pos.iter().enumerate() {
        let want = indexer_want(c, s, heads, dim, t_len, p);
        let finite: Vec<f64> = want.iter().cloned().filter(|v| v.is_finite()).collect();
        let mag = max_abs(&finite).max(1e-30);
        for (t, wv) in want.iter().enumerate() {
            let got = sc[s * out_stride + t];
            if wv.is_finite() {
                worst = worst.max((f64::from(got) - wv).abs() / mag);
                layout_ok &= got.is_finite();
                scored += 1;
            } else {
                layout_ok &= got == f32::NEG_INFINITY;
            }
        }
        layout_ok &= sc[s * out_stride + t_len..(s + 1) * out_stride]
            .iter()
            .all(|v| v.is_nan());
    }
    (worst, layout_ok, scored)
}

/// The tensor-core scorer's (indexer_scores.cu `indexer_scores_tc_bf16`) scores `sc` against
/// [`indexer_cpu`], each unmasked score against its own bound: the worst |error| / bound
/// (`<= 1` passes; the masks and padding are [`indexer_check`]'s). Per key, with
/// A = sum_h |w_h| scale sum_i |q_hi k_ti| (>= sum_h |w_h relu(scale q_h . k_t)|):
/// - the queries as two bf16 terms: |q - hi - lo| <= 2^-16 |q| (hi and lo each round to 8
///   significant bits, relative 2^-8), so every dot product moves by <= 2^-16 sum_i |q_i k_i|;
/// - the products are exact (bf16 x bf16), their f32 sums inside and across the two passes' mma
///   steps take at most 2D + 16 roundings of the magnitude sum (one pass: D + 16, as for the MLA
///   kernel's `mla_tc_expect`);
/// - the scale and weight products (2) and the heads' sum (4 terms a lane, a 3-level tree: 7).
pub fn indexer_tc_worst(
    c: &IndexerCase,
    sc: &[f32],
    out_stride: usize,
    heads: usize,
    dim: usize,
    t_len: usize,
    pos: &[i32],
) -> f64 {
    let mut worst = 0f64;
    let rel = 2f64.powi(-16) + (2.0 * dim as f64 + 16.0 + 9.0) * U32;
    for (s, &p) in pos.iter().enumerate() {
        let want = indexer_want(c, s, heads, dim, t_len, p);
        for (t, wv) in want.iter().enumerate() {
            if !wv.is_finite() {
                continue;
            }
            let a: f64 = (0..heads)
                .map(|h| {
                    let qh = &c.q[(s * heads + h) * dim..(s * heads + h + 1) * dim];
                    let m: f64 = qh
                        .iter()
                        .zip(&c.kc[t * dim..(t + 1) * dim])
                        .map(|(x, y)| (f64::from(*x) * f64::from(*y)).abs())
                        .sum();
                    f64::from(c.w[s * heads + h].abs()) * f64::from(c.scale) * m
                })
                .sum();
            let got = f64::from(sc[s * out_stride + t]);
            let e = (got - wv).abs() / (rel * a + 1e-30);
            worst = worst.max(if got.is_finite() { e } else { f64::INFINITY });
        }
    }
    worst
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

// ---------------------------------------------------------------------------------------------
// mmq (kernels/cuda/mmq.cu): the tensor-core matrix product over channels

/// The channels of one mmq launch as host data (kernels::QChannels with the maps on the host).
pub struct MmqCase<'a> {
    pub rows: usize,
    pub k: usize,
    pub slabs: usize,
    pub count: usize,
    pub ncols: usize,
    pub ids: Option<&'a [i32]>,
    pub xidx: Option<&'a [i32]>,
    pub x_div: usize,
    pub yidx: Option<&'a [i32]>,
    pub y_stride: usize,
    pub y_rows: usize,
}

/// What the launch computes (the dequantized second matrix for GLU).
pub enum MmqMode<'a> {
    Plain,
    Accumulate,
    Glu(&'a [f32]),
}

/// What one mmq check saw: `written` outputs within their bound (`worst` = the largest error
/// over its tolerance), `nan` outputs of bad expert ids, `untouched` elements left as they were.
#[derive(Debug, Default)]
pub struct MmqCheck {
    pub ok: bool,
    pub worst: f64,
    pub written: usize,
    pub nan: usize,
    pub untouched: usize,
    pub first_bad: Option<String>,
}

/// One output of `w` (all slabs, `[slab][row][k]`) row `wr` against activation row `xr`:
/// (the f64 product with the quantized activations d*q, the one with the f32 activations, the
/// bound of the kernel's f32 rounding (A): (K/32 + 16) * 4 * 2^-24 * sum_b 3 max|w_b| |xq|, as
/// gemvq's tests, and the activation rounding sum |w| d/2 (B)).
pub fn mmq_dot(
    w: &[f32],
    wr: usize,
    k: usize,
    x: &[f32],
    qc: &[i8],
    qd: &[f32],
    xr: usize,
) -> (f64, f64, f64, f64) {
    let row = &w[wr * k..(wr + 1) * k];
    let (mut ya, mut yb, mut mag, mut qerr) = (0f64, 0f64, 0f64, 0f64);
    for (bi, wb) in row.chunks(32).enumerate() {
        // |d sc q| + |dmin m| <= 3 max|w| bounds the terms the kernel rounds (Q4_K/Q5_K; the
        // other types' terms are |w| themselves).
        let wmax = wb.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let d = f64::from(qd[(xr * k) / 32 + bi]);
        for (j, &wv) in wb.iter().enumerate() {
            let i = bi * 32 + j;
            let xq = f64::from(qc[xr * k + i]) * d;
            ya += f64::from(wv) * xq;
            yb += f64::from(wv) * f64::from(x[xr * k + i]);
            mag += 3.0 * wmax * xq.abs();
            qerr += f64::from(wv.abs()) * d * (0.5 + 1e-5);
        }
    }
    let tol_a = (k as f64 / 32.0 + 16.0) * 4.0 * U32 * mag + 1e-30;
    (ya, yb, tol_a, qerr)
}

fn silu64(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// silu(g) * u for gate and up products `g`, `u` known within `tol_g`, `tol_u` (mmq_dot's (A)):
/// (the value, its bound) with silu' <= 1.1 and 8 f32 roundings of the result (expf, the add,
/// the division, the product).
pub fn mmq_glu_want(g: f64, tol_g: f64, u: f64, tol_u: f64) -> (f64, f64) {
    let want = silu64(g) * u;
    let tol = 1.1 * tol_g * (u.abs() + tol_u) + silu64(g).abs() * tol_u + 8.0 * U32 * want.abs();
    (want, tol + 1e-30)
}

/// Checks every element of an mmq output buffer `got` (initially `y0`) against the f64 oracle:
/// a live column (input row in `0..x_rows`, output row in `0..y_rows`) of a channel with a valid
/// expert gets its product within the bound of [`mmq_dot`] (Accumulate: plus one f32 rounding of
/// the add; GLU: the bound carried through silu(g) * u, silu' <= 1.1, plus 8 roundings of the
/// result for expf, the division and the products); a channel whose id is outside the slabs
/// writes NaN; everything else (id -1, dead columns, rows past the output) stays bitwise as it was.
pub fn mmq_verify(
    c: &MmqCase<'_>,
    w: &[f32],
    mode: &MmqMode<'_>,
    x: &[f32],
    x_rows: usize,
    qc: &[i8],
    qd: &[f32],
    y0: &[f32],
    got: &[f32],
) -> MmqCheck {
    #[derive(Clone, Copy)]
    enum Want {
        Nan,
        Val { slab: usize, xr: usize, r: usize },
    }
    let k = c.k;
    let mut want: Vec<Option<Want>> = vec![None; got.len()];
    for ch in 0..c.count {
        let e = match c.ids {
            Some(ids) => i64::from(ids[ch]),
            None => (ch % c.slabs) as i64,
        };
        if c.ids.is_some() && e == -1 {
            continue;
        }
        for j in 0..c.ncols {
            let xr = match c.xidx {
                Some(v) => i64::from(v[ch * c.ncols + j]),
                None => ((ch / c.x_div) * c.ncols + j) as i64,
            };
            let yr = match c.yidx {
                Some(v) => i64::from(v[ch * c.ncols + j]),
                None => (ch * c.ncols + j) as i64,
            };
            if xr < 0 || xr >= x_rows as i64 || yr < 0 || yr >= c.y_rows as i64 {
                continue;
            }
            for r in 0..c.rows {
                let at = yr as usize * c.y_stride + r;
                assert!(want[at].is_none(), "test maps two outputs to element {at}");
                want[at] = Some(if e < 0 || e >= c.slabs as i64 {
                    Want::Nan
                } else {
                    Want::Val {
                        slab: e as usize,
                        xr: xr as usize,
                        r,
                    }
                });
            }
        }
    }
    let mut out = MmqCheck {
        ok: true,
        ..Default::default()
    };
    let fail = |out: &mut MmqCheck, msg: String| {
        out.ok = false;
        out.first_bad.get_or_insert(msg);
    };
    for (at, wnt) in want.iter().enumerate() {
        let g = got[at];
        match wnt {
            None => {
                if g.to_bits() == y0[at].to_bits() || (g.is_nan() && y0[at].is_nan()) {
                    out.untouched += 1;
                } else {
                    fail(&mut out, format!("element {at} written: {g}"));
                }
            }
            Some(Want::Nan) => {
                if g.is_nan() {
                    out.nan += 1;
                } else {
                    fail(
                        &mut out,
                        format!("element {at}: {g}, a bad expert id gives NaN"),
                    );
                }
            }
            Some(Want::Val { slab, xr, r }) => {
                let wr = slab * c.rows + r;
                let (ya, yb, tol_a, qerr) = mmq_dot(w, wr, k, x, qc, qd, *xr);
                let gf = f64::from(g);
                let (err, tol, err_b, tol_b) = match mode {
                    MmqMode::Plain => ((gf - ya).abs(), tol_a, (gf - yb).abs(), qerr + tol_a),
                    MmqMode::Accumulate => {
                        let a0 = f64::from(y0[at]);
                        let round = U32 * (a0.abs() + ya.abs() + tol_a);
                        (
                            (gf - (a0 + ya)).abs(),
                            tol_a + round,
                            (gf - (a0 + yb)).abs(),
                            qerr + tol_a + round + U32 * qerr,
                        )
                    }
                    MmqMode::Glu(w2) => {
                        let (ua, _, tol_u, _) = mmq_dot(w2, wr, k, x, qc, qd, *xr);
                        let (wv, tol) = mmq_glu_want(ya, tol_a, ua, tol_u);
                        ((gf - wv).abs(), tol, 0.0, 0.0)
                    }
                };
                out.worst = out.worst.max(err / tol);
                if !(g.is_finite() && err <= tol && err_b <= tol_b) {
                    fail(
                        &mut out,
                        format!(
                            "element {at} (row {r}, x row {xr}, slab {slab}): {g}, error {err:.3e} \
                             > {tol:.3e} or {err_b:.3e} > {tol_b:.3e}"
                        ),
                    );
                }
                out.written += 1;
            }
        }
    }
    out
}

/// `mma.m16n8k32.s8` on the CPU: D = A B + C with A 16 x 32 row-major, column n of B at
/// `b[32 n ..]`, C and D 16 x 8 row-major (mmq.cu's `mma_s8_selftest` layout).
pub fn mma_s8_cpu(a: &[i8], b: &[i8], c: &[i32]) -> Vec<i32> {
    let mut d = c[..128].to_vec();
    for m in 0..16 {
        for n in 0..8 {
            for k in 0..32 {
                d[m * 8 + n] += i32::from(a[m * 32 + k]) * i32::from(b[n * 32 + k]);
            }
        }
    }
    d
}

/// One tile set of moe_sort.cu's grouping, as its device maps hold it (-1 = unused).
pub struct HostTiles {
    pub width: usize,
    pub tile_expert: Vec<i32>,
    pub tok: Vec<i32>,
    pub pos: Vec<i32>,
    pub pair: Vec<i32>,
}

/// moe_sort.cu's grouping on the host, from its contract (kernels/src/moe.rs `moe_group`): the
/// pairs of each expert in pair order, sorted positions running over the experts in id order;
/// without a wide width every expert in tiles of `narrow` columns (`ceil(n / narrow) + E`
/// tiles); with one, the experts of at most `narrow` pairs in one narrow tile each (`min(E, n)`
/// tiles) and the others in tiles of `wide` columns (`ceil(n / wide) + min(E, n / (narrow +
/// 1))` tiles); experts in id order within each set, then unused tiles.
pub fn group_on_host(
    ids: &[i32],
    top_k: usize,
    experts: usize,
    narrow: usize,
    wide: Option<usize>,
) -> Vec<HostTiles> {
    let n = ids.len();
    let mut sets: Vec<HostTiles> = match wide {
        None => vec![(narrow, n.div_ceil(narrow) + experts)],
        Some(w) => vec![
            (narrow, experts.min(n)),
            (w, n.div_ceil(w) + experts.min(n / (narrow + 1))),
        ],
    }
    .into_iter()
    .map(|(width, tiles)| HostTiles {
        width,
        tile_expert: vec![-1; tiles],
        tok: vec![-1; tiles * width],
        pos: vec![-1; tiles * width],
        pair: vec![-1; tiles * width],
    })
    .collect();
    let mut next_tile = vec![0usize; sets.len()];
    let mut off = 0usize;
    for e in 0..experts as i32 {
        let mine: Vec<usize> = (0..n).filter(|&p| ids[p] == e).collect();
        let si = usize::from(wide.is_some() && mine.len() > narrow);
        let set = &mut sets[si];
        let w = set.width;
        for (ri, &p) in mine.iter().enumerate() {
            let tile = next_tile[si] + ri / w;
            let c = tile * w + ri % w;
            set.tile_expert[tile] = e;
            set.tok[c] = (p / top_k) as i32;
            set.pos[c] = (off + ri) as i32;
            set.pair[c] = p as i32;
        }
        next_tile[si] += mine.len().div_ceil(w);
        off += mine.len();
    }
    sets
}

/// bf16 of an f32 by round-to-nearest-even (the kernels' `f32_to_bf16`), back as f32.
pub fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// f64 scores `scale * q . c[t]` of one query over the key rows `keys` of the cache `c` (row
/// width `d`), and the largest `scale * sum_i |q_i c_ti|` (the magnitude rounding bounds scale).
pub fn mla_scores(q: &[f32], c: &[f32], d: usize, keys: &[usize], scale: f32) -> (Vec<f64>, f64) {
    let dot = |t: usize, abs: bool| {
        q.iter()
            .zip(&c[t * d..t * d + d])
            .map(|(a, b)| {
                let p = f64::from(*a) * f64::from(*b);
                if abs {
                    p.abs()
                } else {
                    p
                }
            })
            .sum::<f64>()
            * f64::from(scale)
    };
    let s = keys.iter().map(|&t| dot(t, false)).collect();
    let smag = keys.iter().map(|&t| dot(t, true)).fold(0f64, f64::max);
    (s, smag)
}

/// f64 attention of one query over the latent rows `keys`, values = first `dv` columns, and the
/// bound of the f32 score error: (d + 8) roundings of the magnitude sum.
pub fn mla_cpu(
    q: &[f32],
    c: &[f32],
    d: usize,
    dv: usize,
    keys: &[usize],
    scale: f32,
) -> (Vec<f64>, f64) {
    let (s, smag) = mla_scores(q, c, d, keys, scale);
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
    let z: f64 = p.iter().sum();
    let mut o = vec![0f64; dv];
    for (pi, &t) in p.iter().zip(keys) {
        for (j, ov) in o.iter_mut().enumerate() {
            *ov += pi / z * f64::from(c[t * d + j]);
        }
    }
    (o, (d as f64 + 8.0) * U32 * smag)
}

/// What the f32 MLA kernels (mla.cu's tile and decode kernels) must give for one query head: the
/// f64 attention ([`mla_cpu`]) and one bound for every column, `cmax` bounding |c|. Softmax
/// weights move by <= 2 max|ds| + exp's 4 ulps relative; the weighted sum of up to T values
/// adds T + 8 roundings of max|c|, and each rescale of the running sums (one per 32-key tile,
/// or per 64-key chunk in the decode kernel) one more.
pub fn mla_f32_expect(
    q: &[f32],
    c: &[f32],
    d: usize,
    dv: usize,
    keys: &[usize],
    scale: f32,
    cmax: f64,
) -> (Vec<f64>, f64) {
    let (want, ds) = mla_cpu(q, c, d, dv, keys, scale);
    let n_k = keys.len() as f64;
    let tol = (2.0 * ds + 8.0 * U32 + (n_k + n_k / 32.0 + 9.0) * U32) * cmax + 1e-30;
    (want, tol)
}

/// What the tensor-core MLA kernel (mla.cu `mla_tc_bf16`) must give for one query head over the
/// key rows `keys` of the cache `c` (row width `d`, values its first `dv` columns, the values as
/// cached): the f64 attention of the query rounded to bf16 as the kernel rounds it, and a bound
/// per output column. Each bound term follows from one rounding of the kernel:
/// - scores: the products of bf16 values are exact in f32; their f32 sums inside and across the
///   mma (16 products a step, d/16 steps, then the scale) take at most d + 16 roundings of the
///   magnitude sum, so every score moves by at most ds = (d + 16) 2^-24 max_t scale sum|q c|,
///   and every softmax weight w_t by a factor within e^(+-2 ds);
/// - P: each unnormalised weight is rounded to bf16 for the value product (relative 2^-8, the
///   unit roundoff of an 8-bit significand) while the normaliser sums the f32 weights: the
///   output moves by at most 2^-8 sum_t w_t |v_t| (times e^(2 ds) for the moved weights);
/// - the f32 value sums, one rescale per 32-key chunk and the split combine: n + n/32 + 25
///   roundings of max |v|.
pub fn mla_tc_expect(
    q: &[f32],
    c: &[f32],
    d: usize,
    dv: usize,
    keys: &[usize],
    scale: f32,
) -> (Vec<f64>, Vec<f64>) {
    let qb: Vec<f32> = q.iter().map(|&v| bf16_round(v)).collect();
    let row = |t: usize| &c[t * d..t * d + d];
    let (s, smag) = mla_scores(&qb, c, d, keys, scale);
    let ds = (d as f64 + 16.0) * U32 * smag;
    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
    let z: f64 = p.iter().sum();
    let vmax = keys
        .iter()
        .flat_map(|&t| row(t)[..dv].iter())
        .fold(0f64, |a, v| a.max(f64::from(v.abs())));
    let n = keys.len() as f64;
    let grow = (2.0 * ds).exp();
    let mut o = vec![0f64; dv];
    let mut tol = vec![0f64; dv];
    for (pi, &t) in p.iter().zip(keys) {
        let w = pi / z;
        for j in 0..dv {
            let v = f64::from(c[t * d + j]);
            o[j] += w * v;
            tol[j] += w * v.abs();
        }
    }
    for tj in tol.iter_mut() {
        *tj = (grow - 1.0) * *tj + grow * *tj / 256.0 + (n + n / 32.0 + 25.0) * U32 * vmax + 1e-30;
    }
    (o, tol)
}

/// DSA-style key lists of `tokens` query tokens at positions `pos0..`, `n_keys` slots each:
/// random keys at or before the query's position, with empty (-1) slots and slots past the
/// position (which the kernels must mask) mixed in.
pub fn mla_key_lists(r: &mut Rng, tokens: usize, n_keys: usize, pos0: usize) -> Vec<Vec<i32>> {
    (0..tokens)
        .map(|s| {
            (0..n_keys)
                .map(|j| match j % 37 {
                    5 => -1,
                    9 => (pos0 + s + 1) as i32, // past the query's position: masked
                    _ => r.below(pos0 + s + 1) as i32,
                })
                .collect()
        })
        .collect()
}

/// The keys query token `s` (at `pos0 + s`) attends to: its list's valid entries, ascending,
/// or every key up to its position (dense causal).
pub fn mla_keys_of(lists: Option<&[Vec<i32>]>, s: usize, pos0: usize) -> Vec<usize> {
    match lists {
        Some(l) => {
            let mut k: Vec<usize> = l[s]
                .iter()
                .filter(|&&t| t >= 0 && (t as usize) <= pos0 + s)
                .map(|&t| t as usize)
                .collect();
            k.sort_unstable();
            k
        }
        None => (0..=pos0 + s).collect(),
    }
}

/// The router as HF computes it (spec §1.10), in f32; returns (ids, weights) per token.
pub fn route_cpu(logits: &[f32], bias: &[f32], c: RouterConfig) -> (Vec<i32>, Vec<f32>, Vec<f32>) {
    let e = c.n_experts;
    let s: Vec<f32> = match c.gating {
        Gating::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
        Gating::Softmax => {
            let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let ex: Vec<f32> = logits.iter().map(|l| (l - mx).exp()).collect();
            let z: f32 = ex.iter().sum();
            ex.iter().map(|v| v / z).collect()
        }
    };
    let mut choice: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let choice_unmasked = choice.clone();
    if c.n_group > 1 && c.topk_group < c.n_group {
        let gs = e / c.n_group;
        let gscore: Vec<f32> = (0..c.n_group)
            .map(|gi| {
                let mut v: Vec<f32> = choice[gi * gs..(gi + 1) * gs].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                if gs >= 2 {
                    v[0] + v[1]
                } else {
                    v[0]
                }
            })
            .collect();
        let mut keep = vec![false; c.n_group];
        for _ in 0..c.topk_group {
            let best =
                (0..c.n_group)
                    .filter(|gi| !keep[*gi])
                    .fold(None::<usize>, |b, gi| match b {
                        Some(bi) if gscore[bi] >= gscore[gi] => Some(bi),
                        _ => Some(gi),
                    });
            if let Some(bi) = best {
                keep[bi] = true;
            }
        }
        for (i, v) in choice.iter_mut().enumerate() {
            if !keep[i / gs] {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    let mut taken = vec![false; e];
    let mut ids = Vec::new();
    for _ in 0..c.top_k {
        let mut best: Option<usize> = None;
        for i in 0..e {
            if taken[i] {
                continue;
            }
            best = match best {
                Some(b) if choice[b] >= choice[i] => Some(b),
                _ => Some(i),
            };
        }
        let b = best.unwrap_or(0);
        taken[b] = true;
        ids.push(b as i32);
    }
    let sum: f32 = ids.iter().map(|&i| s[i as usize]).sum();
    let w = ids
        .iter()
        .map(|&i| {
            let v = s[i as usize];
            (if c.norm { v / (sum + 1e-20) } else { v }) * c.scale
        })
        .collect();
    (ids, w, choice_unmasked)
}

/// Router weights against [`route_cpu`]'s: sigmoid (expf within 2 ulps, an add, a division), the
/// sum of top_k of them, the normalising division and the scale: ~12 roundings of 2 ulps.
pub const ROUTE_W_TOL: f64 = 12.0 * U32 * 2.0;

/// A device router's `ids` and weights `w` (`tokens` x `c.top_k`) for `logits` (`tokens` x
/// `c.n_experts`) against [`route_cpu`]: whether every token's ids equal the oracle's but for
/// swaps of candidates whose biased scores are within 2 ulps (expf may differ from Rust's exp by
/// one), and the worst relative weight error over the tokens whose ids equal exactly.
pub fn route_check(
    ids: &[i32],
    w: &[f32],
    logits: &[f32],
    bias: &[f32],
    tokens: usize,
    c: RouterConfig,
) -> (bool, f64) {
    let (e, k) = (c.n_experts, c.top_k);
    let mut ok = ids.len() == tokens * k && w.len() == tokens * k && tokens > 0;
    let mut worst = 0f64;
    for t in 0..tokens.min(ids.len() / k.max(1)) {
        let (cid, cw, choice) = route_cpu(&logits[t * e..(t + 1) * e], bias, c);
        let got = &ids[t * k..(t + 1) * k];
        if got != cid.as_slice() {
            ok &= got.iter().zip(&cid).all(|(a, b)| {
                a == b
                    || (0..e as i32).contains(a)
                        && (choice[*a as usize] - choice[*b as usize]).abs()
                            <= 2.0 * f32::EPSILON * choice[*b as usize].abs()
            });
            continue;
        }
        for j in 0..k {
            let rel = (f64::from(w[t * k + j]) - f64::from(cw[j])).abs()
                / f64::from(cw[j]).abs().max(1e-30);
            worst = worst.max(rel);
        }
    }
    (ok, worst)
}
