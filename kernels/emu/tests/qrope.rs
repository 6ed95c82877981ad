//! The absorbed MLA queries' fused q8a quantization + RoPE (kernels/cuda/rope.cu `rope_q8_f32`)
//! under CPU emulation, before any GPU has run it, with the launch configuration of
//! `Gpu::rope_q8_to` (`kernels::rope::rope_q8_block`, one block per head, tokens in y): bit for
//! bit what the two launches it replaces in the runtime's `mla_queries` (quantize_q8a over
//! rows = tokens * heads, rope_f32 from the q_b layout into the absorbed query layout) write,
//! with their own wrappers' configurations, on GLM-5's shapes (64 heads, nope 192, rope 64,
//! latent 512), 1 and 3 tokens, every style, a NaN and an infinity planted in the quantized
//! columns; a shape beyond the block's warp caps (both roles loop); the rotated columns against
//! the f64 oracle of the GPU test `rope_interleaved_matches_f64` and the codes against the CPU
//! emulation of quantize.cu (`q8_cpu`). Without a C++ compiler every test prints
//! "skipped: no C++ compiler" and passes.

mod common;
#[path = "../../tests/common/oracle.rs"]
mod oracle;

use common::{compiler, module, say, Buf};
use kernels::rope::rope_q8_block;
use kernels::{rope_inv_freq, Op, RopeStyle};
use oracle::*;

type QuantizeFn = unsafe extern "C" fn(*const f32, i64, i64, i32, *mut i8, *mut u64);
type RopeFn = unsafe extern "C" fn(
    *const f32,
    i64,
    i64,
    i32,
    *mut f32,
    i64,
    i64,
    i32,
    i32,
    *const i32,
    *const f32,
    i32,
    i64,
);
type RopeQ8Fn = unsafe extern "C" fn(
    *const f32,
    i64,
    i64,
    i32,
    i32,
    i32,
    *mut i8,
    *mut u64,
    *mut f32,
    i64,
    i64,
    i32,
    i32,
    *const i32,
    *const f32,
    i32,
    i64,
);

/// The device's grid y limit (`cfg_rows` clamps the token count to it).
const MAX_Y: usize = 65535;

/// One case: `tokens` x `heads` groups of `nope + n_rot` floats (the q_b output), rotated into
/// groups of `lat + n_rot` (the absorbed queries, rope columns at `lat`).
#[derive(Clone, Copy)]
struct Shape {
    tokens: usize,
    heads: usize,
    nope: usize,
    n_rot: usize,
    lat: usize,
}

impl Shape {
    fn xh(&self) -> usize {
        self.nope + self.n_rot
    }
    fn yh(&self) -> usize {
        self.lat + self.n_rot
    }
    fn rows(&self) -> usize {
        self.tokens * self.heads
    }
}

fn code(style: RopeStyle) -> i32 {
    match style {
        RopeStyle::Interleaved => 0,
        RopeStyle::InterleavedHf => 1,
        RopeStyle::Neox => 2,
    }
}

/// (codes, records as the device holds them, y, x after the launches).
type Out = (Vec<i8>, Vec<u64>, Vec<f32>, Vec<f32>);

/// quantize_q8a with `Gpu::quantize_q8`'s grid (one warp per block of 32, 256 threads) over
/// rows = tokens * heads of `nope` (`nope + n_rot` apart), then rope_f32 with `Gpu::rope_to`'s
/// (one block per head, ceil(n_rot/2 / 32) warps, tokens in y).
fn separate(sh: Shape, x: &[f32], pos: &[i32], inv: &[f32], style: RopeStyle) -> Out {
    let mq = module(Op::Quantize);
    let fq: QuantizeFn = unsafe { mq.entry("quantize_q8a") }.unwrap();
    let mr = module(Op::Rope);
    let fr: RopeFn = unsafe { mr.entry("rope_f32") }.unwrap();
    let (rows, k) = (sh.rows(), sh.nope);
    let xb = Buf::new(x);
    let mut qs = Buf::filled(rows * k, 0x55i8);
    let mut ds = Buf::filled(rows * k / 32, u64::MAX);
    let mut y = Buf::filled(sh.tokens * sh.heads * sh.yh(), f32::NAN);
    let (pb, ib) = (Buf::new(pos), Buf::new(inv));
    let (xp, qp, dp, yp, pp, ip) = (
        xb.ptr(),
        qs.mut_ptr(),
        ds.mut_ptr(),
        y.mut_ptr(),
        pb.ptr(),
        ib.ptr(),
    );
    let blocks = (rows * k / 32).div_ceil(8).min(1 << 16) as u32;
    mq.launch("quantize_q8a", [blocks, 1, 1], [256, 1, 1], 0, &|| unsafe {
        fq(xp, sh.xh() as i64, rows as i64, k as i32, qp, dp)
    })
    .unwrap();
    let block = ((sh.n_rot / 2).div_ceil(32) * 32) as u32;
    let gy = sh.tokens.clamp(1, MAX_Y) as u32;
    mr.launch(
        "rope_f32",
        [sh.heads as u32, gy, 1],
        [block, 1, 1],
        0,
        &|| unsafe {
            fr(
                xp,
                (sh.heads * sh.xh()) as i64,
                sh.xh() as i64,
                sh.nope as i32,
                yp,
                (sh.heads * sh.yh()) as i64,
                sh.yh() as i64,
                sh.lat as i32,
                sh.n_rot as i32,
                pp,
                ip,
                code(style),
                sh.tokens as i64,
            )
        },
    )
    .unwrap();
    (qs.to_vec(), ds.to_vec(), y.to_vec(), xb.to_vec())
}

/// rope_q8_f32 with `Gpu::rope_q8_to`'s block (`rope_q8_block`) and `gy` blocks in y (the
/// wrapper's: min(tokens, 65535)).
fn fused(sh: Shape, x: &[f32], pos: &[i32], inv: &[f32], style: RopeStyle, gy: u32) -> Out {
    let m = module(Op::Rope);
    let f: RopeQ8Fn = unsafe { m.entry("rope_q8_f32") }.unwrap();
    let (rows, k) = (sh.rows(), sh.nope);
    let xb = Buf::new(x);
    let mut qs = Buf::filled(rows * k, 0x55i8);
    let mut ds = Buf::filled(rows * k / 32, u64::MAX);
    let mut y = Buf::filled(sh.tokens * sh.heads * sh.yh(), f32::NAN);
    let (pb, ib) = (Buf::new(pos), Buf::new(inv));
    let (xp, qp, dp, yp, pp, ip) = (
        xb.ptr(),
        qs.mut_ptr(),
        ds.mut_ptr(),
        y.mut_ptr(),
        pb.ptr(),
        ib.ptr(),
    );
    let (qw, block) = rope_q8_block(sh.nope, sh.n_rot);
    m.launch(
        "rope_q8_f32",
        [sh.heads as u32, gy, 1],
        [block, 1, 1],
        0,
        &|| unsafe {
            f(
                xp,
                (sh.heads * sh.xh()) as i64,
                sh.xh() as i64,
                sh.nope as i32,
                sh.nope as i32,
                qw as i32,
                qp,
                dp,
                yp,
                (sh.heads * sh.yh()) as i64,
                sh.yh() as i64,
                sh.lat as i32,
                sh.n_rot as i32,
                pp,
                ip,
                code(style),
                sh.tokens as i64,
            )
        },
    )
    .unwrap();
    (qs.to_vec(), ds.to_vec(), y.to_vec(), xb.to_vec())
}

/// The q_b output of `sh`: the quantized columns with block-to-block magnitude changes
/// (`activations`: a zero block, large and small ones), a NaN in one block of the first group
/// and an infinity in one of the last (their indices into the q8 blocks returned), the rope
/// columns uniform in [-1, 1).
fn q_rows(sh: Shape, r: &mut Rng) -> (Vec<f32>, Vec<usize>) {
    let nope = activations(r, sh.rows(), sh.nope);
    let rope = r.vec(sh.rows() * sh.n_rot, 1.0);
    let mut x = Vec::with_capacity(sh.rows() * sh.xh());
    for g in 0..sh.rows() {
        x.extend_from_slice(&nope[g * sh.nope..(g + 1) * sh.nope]);
        x.extend_from_slice(&rope[g * sh.n_rot..(g + 1) * sh.n_rot]);
    }
    let nb = sh.nope / 32;
    let last = sh.rows() - 1;
    x[2 * 32 + 7] = f32::NAN;
    x[last * sh.xh() + (nb - 1) * 32 + 30] = f32::NEG_INFINITY;
    (x, vec![2, last * nb + nb - 1])
}

/// Worst |error| of the rotated columns of `y` against the f64 rotation of the f32 angle
/// (the GPU test's oracle), and whether every other column of `y` kept its NaN poison.
fn rope_oracle(
    sh: Shape,
    x: &[f32],
    y: &[f32],
    pos: &[i32],
    inv: &[f32],
    style: RopeStyle,
) -> (f64, bool) {
    let (half, mut worst, mut poison) = (sh.n_rot / 2, 0f64, true);
    for g in 0..sh.rows() {
        let s = g / sh.heads;
        let (xb, yb) = (g * sh.xh() + sh.nope, g * sh.yh() + sh.lat);
        for j in 0..half {
            let ang = f64::from(pos[s] as f32 * inv[j]);
            let (sn, cs) = ang.sin_cos();
            let (i1, i2) = match style {
                RopeStyle::Neox => (j, j + half),
                _ => (2 * j, 2 * j + 1),
            };
            let (x1, x2) = (f64::from(x[xb + i1]), f64::from(x[xb + i2]));
            let (o1, o2) = (x1 * cs - x2 * sn, x2 * cs + x1 * sn);
            let (g1, g2) = match style {
                RopeStyle::InterleavedHf => (y[yb + j], y[yb + half + j]),
                _ => (y[yb + i1], y[yb + i2]),
            };
            worst = worst
                .max((f64::from(g1) - o1).abs())
                .max((f64::from(g2) - o2).abs());
        }
        poison &= y[g * sh.yh()..yb].iter().all(|v| v.is_nan());
    }
    (worst, poison)
}

/// Runs every style of `sh` with the wrapper's grid and, where given, `extra_gy` blocks in y
/// (tokens grid-strided); returns the failures.
fn check(sh: Shape, pos: &[i32], theta: f32, extra_gy: Option<u32>, r: &mut Rng) -> Vec<String> {
    let mut bad = Vec::new();
    let inv = rope_inv_freq(theta, sh.n_rot);
    let (x, poisoned) = q_rows(sh, r);
    let (cq, cd, cs) = q8_cpu(
        &(0..sh.rows())
            .flat_map(|g| x[g * sh.xh()..g * sh.xh() + sh.nope].to_vec())
            .collect::<Vec<f32>>(),
    );
    let tag = format!(
        "{} tok x {} heads, nope {}, rope {} -> lat {}",
        sh.tokens, sh.heads, sh.nope, sh.n_rot, sh.lat
    );
    for style in [
        RopeStyle::Interleaved,
        RopeStyle::InterleavedHf,
        RopeStyle::Neox,
    ] {
        let want = separate(sh, &x, pos, &inv, style);
        let gys = [Some(sh.tokens.min(MAX_Y) as u32), extra_gy];
        for gy in gys.into_iter().flatten() {
            let got = fused(sh, &x, pos, &inv, style, gy);
            let what = format!("{tag} {style:?} grid.y {gy}");
            let ne_q = (0..want.0.len()).filter(|&i| got.0[i] != want.0[i]).count();
            let ne_d = (0..want.1.len()).filter(|&i| got.1[i] != want.1[i]).count();
            let ne_y = (0..want.2.len())
                .filter(|&i| got.2[i].to_bits() != want.2[i].to_bits())
                .count();
            let x_same = got
                .3
                .iter()
                .zip(&x)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            if ne_q + ne_d + ne_y > 0 || !x_same {
                bad.push(format!(
                    "{what}: {ne_q} codes, {ne_d} records, {ne_y} y values differ from \
                     quantize_q8a + rope_f32; x unchanged: {x_same}"
                ));
            }
        }
        // The separate launches themselves against the oracles (so the equality above is
        // one with the right answer): the planted blocks get d = NaN and zero codes / sums,
        // the others the CPU emulation's bits; the rotation is within the GPU test's bound.
        let (q, recs, y, _) = &want;
        for b in 0..recs.len() {
            let (d, s0, s1) = (
                f32::from_bits(recs[b] as u32),
                (recs[b] >> 32) as u16 as i16,
                (recs[b] >> 48) as u16 as i16,
            );
            let codes = &q[32 * b..32 * b + 32];
            let ok = if poisoned.contains(&b) {
                d.is_nan() && codes.iter().all(|&c| c == 0) && (s0, s1) == (0, 0)
            } else {
                d.to_bits() == cd[b].to_bits()
                    && (s0, s1) == (cs[2 * b], cs[2 * b + 1])
                    && codes == &cq[32 * b..32 * b + 32]
            };
            if !ok {
                bad.push(format!("{tag} {style:?}: q8 block {b} differs from q8_cpu"));
                break;
            }
        }
        let (worst, poison) = rope_oracle(sh, &x, y, pos, &inv, style);
        // |x| < 1: 5 roundings + 2 ulps of sin/cos, doubled (rope_interleaved_matches_f64).
        let tol = 8.0 * U32 * 2.0;
        say(&format!(
            "rope_q8 {tag} {style:?}: rotation error {worst:.3e} (tol {tol:.3e})"
        ));
        if worst > tol || !poison {
            bad.push(format!(
                "{tag} {style:?}: rotation error {worst:.3e} > {tol:.3e} or unrotated columns \
                 written (poison kept: {poison})"
            ));
        }
    }
    bad
}

#[test]
fn rope_q8_equals_quantize_q8a_and_rope_f32_bit_for_bit() {
    if !compiler("rope_q8_equals_quantize_q8a_and_rope_f32_bit_for_bit") {
        return;
    }
    let mut r = Rng::new("emu rope_q8_f32");
    let glm = |tokens| Shape {
        tokens,
        heads: 64,
        nope: 192,
        n_rot: 64,
        lat: 512,
    };
    let mut bad = Vec::new();
    // Decode (one token) and a small batch; with 3 tokens also 2 blocks in y (grid-strided).
    bad.extend(check(glm(1), &[4095], 1e6, None, &mut r));
    bad.extend(check(glm(3), &[0, 1000, 131071], 1e6, Some(2), &mut r));
    assert!(bad.is_empty(), "rope_q8_f32:\n{}", bad.join("\n"));
}

/// Beyond the block's warp caps: 20 blocks of 32 quantized by 16 warps, 545 pairs rotated by
/// 512 threads (both roles loop, the last rotating warp partly idle), 5 tokens over 2 y blocks.
#[test]
fn rope_q8_loops_past_its_warp_caps() {
    if !compiler("rope_q8_loops_past_its_warp_caps") {
        return;
    }
    let mut r = Rng::new("emu rope_q8_f32 caps");
    let sh = Shape {
        tokens: 5,
        heads: 3,
        nope: 640,
        n_rot: 1090,
        lat: 96,
    };
    assert_eq!(rope_q8_block(sh.nope, sh.n_rot), (16, 1024));
    let bad = check(sh, &[0, 7, 63, 4096, 65536], 1e4, Some(2), &mut r);
    assert!(bad.is_empty(), "rope_q8_f32:\n{}", bad.join("\n"));
}
