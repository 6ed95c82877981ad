//! attn_combine_f32's fused q8 epilogue (kernels/cuda/attention.cu) under CPU emulation: the
//! split merge after MLA attention also writes the output's q8 activations (the next per-head
//! GEMV's input), which saves the quantize launch of every decode layer. With codes and records
//! set, the f32 output must be bit for bit that of the same kernel without them, and the q8
//! output bit for bit what quantize_q8a writes for that output as `rows = tokens * H` rows of
//! `k = Dv` (`Gpu::quantize_q8(o, tokens * heads, Dv, Dv)`), at GLM-5's shapes (64 heads,
//! Dv 512), one and three query tokens, 1, 4 and 37 key splits, launched as `Gpu::mla_attention`
//! launches the combine (grid (H, tokens), 256 threads) and with fewer grid rows than tokens
//! (the kernel strides over tokens), and with NaN, infinite and all-empty rows. Without a C++
//! compiler every test prints "skipped: no C++ compiler" and passes.

mod common;
#[path = "../../tests/common/oracle.rs"]
mod oracle;

use common::{compiler, module, say, Buf};
use kernels::Op;
use oracle::*;

type CombineFn =
    unsafe extern "C" fn(*const f32, i32, i32, i32, *mut f32, i64, i64, i64, *mut i8, *mut u64);
type QuantizeFn = unsafe extern "C" fn(*const f32, i64, i64, i32, *mut i8, *mut u64);

/// GLM-5's query heads and value width.
const H: usize = 64;
const DV: usize = 512;
/// Partial row: {max, sum of exponentials, DV weighted sums}.
const ROW: usize = DV + 2;

/// q8 activations as the device holds them: codes, 8-byte block records {f32 d, i16, i16}.
type Q8 = (Vec<i8>, Vec<u64>);

/// Split partials as the MLA kernels write them, `[tokens, H, n_split]` rows: a split's max
/// score, its sum of exponentials (>= 1: the max itself contributes e^0) and weighted value sums
/// bounded by that sum times the values' range; every fifth split of a multi-split row empty
/// (max -inf, nothing summed), as a split past a short sequence's keys is.
fn partials(r: &mut Rng, tokens: usize, n_split: usize) -> Vec<f32> {
    let mut part = vec![0f32; tokens * H * n_split * ROW];
    for (i, pr) in part.chunks_mut(ROW).enumerate() {
        let (row, p) = (i / n_split, i % n_split);
        if n_split > 1 && p % 5 == 3 {
            pr[0] = f32::NEG_INFINITY;
            continue;
        }
        // Head-dependent value ranges, so block scales differ between rows.
        let range = [0.01f32, 1.0, 8.0][row % 3];
        pr[0] = r.sym(4.0);
        pr[1] = 1.0 + 20.0 * r.unit();
        let z = pr[1];
        for v in &mut pr[2..] {
            *v = r.sym(z * range);
        }
    }
    part
}

/// f64 merge of one (token, head) row's splits: `sum_p acc_p e^(m_p - M) / sum_p z_p e^(m_p - M)`
/// (zeros when every split is empty), and per value its f32 rounding bound: the kernel's sums of
/// n terms, its split weights (expf, a few ulps) and its normalisation each move it by a few
/// units of roundoff of `sum_p |acc_p| e^(m_p - M) / Z`; (2n + 8) of them covers all.
fn merge_f64(pr: &[f32], n_split: usize) -> (Vec<f64>, Vec<f64>) {
    let m = (0..n_split)
        .map(|p| f64::from(pr[p * ROW]))
        .fold(f64::NEG_INFINITY, f64::max);
    let mut z = 0f64;
    let mut acc = vec![0f64; DV];
    let mut mag = vec![0f64; DV];
    for p in 0..n_split {
        let mp = f64::from(pr[p * ROW]);
        if mp == f64::NEG_INFINITY {
            continue;
        }
        let e = (mp - m).exp();
        z += f64::from(pr[p * ROW + 1]) * e;
        for ((a, g), v) in acc
            .iter_mut()
            .zip(&mut mag)
            .zip(&pr[p * ROW + 2..(p + 1) * ROW])
        {
            *a += f64::from(*v) * e;
            *g += f64::from(v.abs()) * e;
        }
    }
    if z > 0.0 {
        acc.iter_mut().for_each(|a| *a /= z);
    }
    let units = (2 * n_split + 8) as f64 * U32;
    let tol = mag.iter().map(|g| units * g / z.max(1.0) + 1e-30).collect();
    (acc, tol)
}

/// attn_combine_f32 over `part`'s `n_split` partials of `tokens` x H rows into a dense
/// `[tokens, H, DV]` output (poisoned with NaN first), `grid_y` block rows, with the q8 outputs
/// (poisoned too) when `q8`.
fn combine(
    part: &[f32],
    n_split: usize,
    tokens: usize,
    grid_y: u32,
    q8: bool,
) -> (Vec<f32>, Option<Q8>) {
    let m = module(Op::Attention);
    let f: CombineFn = unsafe { m.entry("attn_combine_f32") }.unwrap();
    let pb = Buf::new(part);
    let mut o = Buf::filled(tokens * H * DV, f32::NAN);
    let mut qs = Buf::filled(tokens * H * DV, 0x55i8);
    let mut qd = Buf::filled(tokens * H * DV / 32, u64::MAX);
    let (pp, op) = (pb.ptr(), o.mut_ptr());
    let (qp, dp) = if q8 {
        (qs.mut_ptr(), qd.mut_ptr())
    } else {
        (std::ptr::null_mut(), std::ptr::null_mut())
    };
    m.launch(
        "attn_combine_f32",
        [H as u32, grid_y, 1],
        [256, 1, 1],
        0,
        &|| unsafe {
            f(
                pp,
                n_split as i32,
                H as i32,
                DV as i32,
                op,
                (H * DV) as i64,
                DV as i64,
                tokens as i64,
                qp,
                dp,
            )
        },
    )
    .unwrap();
    (o.to_vec(), q8.then(|| (qs.to_vec(), qd.to_vec())))
}

/// quantize_q8a over `rows` dense rows of DV, launched as `Gpu::quantize_q8` launches it.
fn quantize(x: &[f32], rows: usize) -> Q8 {
    let m = module(Op::Quantize);
    let f: QuantizeFn = unsafe { m.entry("quantize_q8a") }.unwrap();
    let xb = Buf::new(x);
    let mut qs = Buf::filled(rows * DV, 0x55i8);
    let mut qd = Buf::filled(rows * DV / 32, u64::MAX);
    let (xp, qp, dp) = (xb.ptr(), qs.mut_ptr(), qd.mut_ptr());
    let grid = (rows * DV / 32).div_ceil(8).min(1 << 16) as u32;
    m.launch("quantize_q8a", [grid, 1, 1], [256, 1, 1], 0, &|| unsafe {
        f(xp, DV as i64, rows as i64, DV as i32, qp, dp)
    })
    .unwrap();
    (qs.to_vec(), qd.to_vec())
}

/// Runs one case: the combine with and without q8, quantize_q8a of its output, the comparisons.
/// Returns the output and its q8 for the caller's extra checks.
fn check(part: &[f32], n_split: usize, tokens: usize, grid_y: u32, what: &str) -> (Vec<f32>, Q8) {
    let (plain, none) = combine(part, n_split, tokens, grid_y, false);
    assert!(none.is_none());
    let (o, q8) = combine(part, n_split, tokens, grid_y, true);
    let q8 = q8.expect("q8 asked for");
    let rows = tokens * H;
    let diff = o
        .iter()
        .zip(&plain)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        diff, 0,
        "{what}: the f32 output changed with the q8 epilogue"
    );
    let (wq, wd) = quantize(&o, rows);
    let codes = q8.0.iter().zip(&wq).filter(|(a, b)| a != b).count();
    let recs = q8.1.iter().zip(&wd).filter(|(a, b)| a != b).count();
    assert_eq!(
        (codes, recs),
        (0, 0),
        "{what}: codes / records differ from quantize_q8a of the output"
    );
    (o, q8)
}

#[test]
fn combine_q8_equals_combine_then_quantize_bitwise() {
    if !compiler("combine_q8_equals_combine_then_quantize_bitwise") {
        return;
    }
    let mut r = Rng::new("emu combine_q8");
    for tokens in [1usize, 3] {
        for n_split in [1usize, 4, 37] {
            let part = partials(&mut r, tokens, n_split);
            // The wrapper's grid (one block row per token), then fewer rows than tokens.
            let grids: &[u32] = if tokens > 1 {
                &[tokens as u32, 2]
            } else {
                &[1]
            };
            for &gy in grids {
                let what = format!("{tokens} tokens, {n_split} splits, grid.y {gy}");
                let (o, (qs, qd)) = check(&part, n_split, tokens, gy, &what);
                // The merge itself, against f64 (the output is written, finite, and right).
                let mut worst = 0f64;
                for (row, orow) in o.chunks(DV).enumerate() {
                    let pr = &part[row * n_split * ROW..(row + 1) * n_split * ROW];
                    let (want, tol) = merge_f64(pr, n_split);
                    for ((g, w), t) in orow.iter().zip(&want).zip(&tol) {
                        assert!(g.is_finite(), "{what}: row {row} not written");
                        worst = worst.max((f64::from(*g) - w).abs() / t);
                    }
                }
                assert!(worst <= 1.0, "{what}: merge off by {worst:.2} of its bound");
                // And the q8 output against the CPU quantization of that output.
                let (cq, cd, cs) = q8_cpu(&o);
                for b in 0..qd.len() {
                    assert_eq!(qd[b] as u32, cd[b].to_bits(), "{what}: block {b} scale");
                    assert_eq!(
                        ((qd[b] >> 32) as u16 as i16, (qd[b] >> 48) as u16 as i16),
                        (cs[2 * b], cs[2 * b + 1]),
                        "{what}: block {b} sums"
                    );
                }
                assert_eq!(qs, cq, "{what}: codes against the CPU quantization");
                say(&format!(
                    "combine q8 {what}: f32 output and q8 bitwise, merge at {worst:.3} of its bound"
                ));
            }
        }
    }
}

#[test]
fn combine_q8_carries_nan_inf_and_empty_rows_as_quantize_does() {
    if !compiler("combine_q8_carries_nan_inf_and_empty_rows_as_quantize_does") {
        return;
    }
    let mut r = Rng::new("emu combine_q8 nan");
    let (tokens, n_split) = (3usize, 4usize);
    let mut part = partials(&mut r, tokens, n_split);
    let at = |s: usize, h: usize, p: usize| ((s * H + h) * n_split + p) * ROW;
    // Token 0, head 5: a NaN weighted sum at d = 70 (block 2 of its row) in a live split.
    part[at(0, 5, 2) + 2 + 70] = f32::NAN;
    // Token 1, head 63: an infinite one at d = 511 (block 15).
    part[at(1, 63, 0) + 2 + 511] = f32::INFINITY;
    // Token 2, head 0: every split empty (no visible key): zeros.
    for p in 0..n_split {
        let a = at(2, 0, p);
        part[a] = f32::NEG_INFINITY;
        part[a + 1] = 0.0;
    }
    for gy in [tokens as u32, 2] {
        let what = format!("NaN / inf / empty rows, grid.y {gy}");
        let (o, (qs, qd)) = check(&part, n_split, tokens, gy, &what);
        let nan_blk = (5 * DV + 70) / 32;
        let inf_blk = ((H + 63) * DV + 511) / 32;
        assert!(
            o[5 * DV + 70].is_nan(),
            "{what}: the NaN reaches the output"
        );
        assert!(o[(H + 63) * DV + 511].is_infinite(), "{what}: the inf too");
        for b in [nan_blk, inf_blk] {
            assert!(
                f32::from_bits(qd[b] as u32).is_nan(),
                "{what}: block {b} gets d = NaN"
            );
            assert_eq!(qd[b] >> 32, 0, "{what}: block {b} sums");
            assert!(
                qs[32 * b..32 * b + 32].iter().all(|&c| c == 0),
                "{what}: block {b}"
            );
        }
        let empty = 2 * H * DV;
        assert!(
            o[empty..empty + DV].iter().all(|&v| v == 0.0),
            "{what}: empty row"
        );
        let recs = &qd[empty / 32..(empty + DV) / 32];
        assert!(
            recs.iter().all(|&r| r == 0),
            "{what}: empty row's blocks: d = 0, sums 0"
        );
        assert!(
            qs[empty..empty + DV].iter().all(|&c| c == 0),
            "{what}: empty row's codes"
        );
        // Every other block is finite.
        let bad = (0..qd.len())
            .filter(|&b| b != nan_blk && b != inf_blk)
            .filter(|&b| !f32::from_bits(qd[b] as u32).is_finite())
            .count();
        assert_eq!(bad, 0, "{what}: other blocks stay finite");
        say(&format!(
            "combine q8 {what}: bitwise quantize_q8a of the output"
        ));
    }
}
