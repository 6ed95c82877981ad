//! GPU correctness tests: every kernel against a CPU computation (f64 unless stated), with the
//! tolerance derived next to each check. Without a CUDA device every test prints
//! "skipped: no CUDA device" and passes; on the GPU machine run them as docs/GPU.md says.
//!
//! Inputs are random and fresh per run (the seed is printed; `GGUFTOOL_TEST_SEED` replays one),
//! outputs are poisoned with NaN before each launch so unwritten elements fail.

// The oracles index several arrays by the same loop counters, written as in the math.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use gguf::GgmlType;
use kernels::{
    AttnShape, Channels, Gating, Gpu, IndexerShape, KeyLists, MatShape, NormRope, QaNorm,
    RopeLayout, RopeStyle, RouterConfig, Rows, Rows3,
};

mod common;
use common::oracle::*;

// ---------------------------------------------------------------------------------------------
// harness

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// One correctness line per check, printed as a table row (collected for the benchmark notes).
fn row(op: &str, shape: &str, err: f64, tol: f64, ok: bool) {
    say(&format!(
        "| {op} | {shape} | {err:.3e} | {tol:.3e} | {} |",
        if ok { "ok" } else { "FAIL" }
    ));
}

fn gpu(test: &str) -> Option<Arc<Gpu>> {
    if kernels::device_count() == 0 {
        say(&format!("skipped: no CUDA device ({test})"));
        return None;
    }
    match Gpu::get(0) {
        Ok(g) => Some(g),
        Err(e) => panic!("CUDA device present but unusable: {e}"),
    }
}

/// Tests share one device and one stream; serialize them so a fault is attributed clearly.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| Mutex::new(()))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn nan_buf(g: &Gpu, n: usize) -> kernels::CudaSlice<f32> {
    g.upload(&vec![f32::NAN; n]).expect("upload")
}

// ---------------------------------------------------------------------------------------------
// dequantization

#[test]
fn dequant_every_type_bit_exact() {
    let Some(g) = gpu("dequant_every_type_bit_exact") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("dequant_every_type_bit_exact");
    let mut bad = Vec::new();
    for ty in GgmlType::ALL {
        // Raw random bytes: NaN/inf/subnormal scales included. Plain types end in a partial
        // 32-value chunk to exercise the element-wise tail.
        let n_bytes = if ty.block_size() == 1 {
            (32 * 50 + 7) * ty.type_size()
        } else {
            997 * ty.type_size()
        };
        let bytes: Vec<u8> = (0..n_bytes).map(|_| r.byte()).collect();
        let cpu = dequant_cpu(ty, &bytes);
        let d = kernels::compare_tensor(&g, ty, &bytes, &cpu).expect("compare");
        // Same operations in the same order without FMA contraction: expect bit equality.
        let ok = d.ok() && d.differing == 0;
        row(
            &format!("dequant {ty}"),
            &format!("{} values", d.n),
            d.max_abs,
            d.tolerance,
            ok,
        );
        if !ok {
            bad.push(format!("{ty}: {d:?}"));
        }
    }
    // bf16 output: round-to-nearest-even of the same f32 values.
    for ty in [GgmlType::Q4_K, GgmlType::F32, GgmlType::IQ4_XS] {
        let bytes = sane_blocks(ty, 256 * 40, &mut r);
        let cpu = dequant_cpu(ty, &bytes);
        let src = g.upload(&bytes).expect("upload");
        let mut dst = g.upload(&vec![0xFFFFu16; cpu.len()]).expect("upload");
        g.dequantize_bf16(ty, &src, &mut dst).expect("dequant bf16");
        let got = g.download(&dst).expect("download");
        let diff = got
            .iter()
            .zip(&cpu)
            .filter(|(a, c)| **a != half::bf16::from_f32(**c).to_bits())
            .count();
        row(
            &format!("dequant_bf16 {ty}"),
            &format!("{} values", cpu.len()),
            diff as f64,
            0.0,
            diff == 0,
        );
        if diff != 0 {
            bad.push(format!("bf16 {ty}: {diff} values differ"));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn get_rows_gathers_and_poisons_bad_ids() {
    let Some(g) = gpu("get_rows_gathers_and_poisons_bad_ids") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("get_rows");
    let (rows, k) = (37usize, 512usize);
    for ty in [
        GgmlType::Q6_K,
        GgmlType::Q4_K,
        GgmlType::BF16,
        GgmlType::F32,
        GgmlType::Q8_0,
    ] {
        let bytes = sane_blocks(ty, rows * k, &mut r);
        let cpu = dequant_cpu(ty, &bytes);
        let ids: Vec<i32> = vec![3, 0, 36, 37, -1, 5];
        let src = g.upload(&bytes).unwrap();
        let dids = g.upload(&ids).unwrap();
        let mut dst = g.zeros::<f32>(ids.len() * k).unwrap();
        g.get_rows(ty, false, &src, k, &dids, &mut dst).unwrap();
        let got = g.download(&dst).unwrap();
        let mut ok = true;
        for (i, &id) in ids.iter().enumerate() {
            let out = &got[i * k..(i + 1) * k];
            if (0..rows as i32).contains(&id) {
                let want = &cpu[id as usize * k..(id as usize + 1) * k];
                ok &= out
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            } else {
                ok &= out.iter().all(|v| v.is_nan());
            }
        }
        row(
            &format!("get_rows {ty}"),
            &format!("{rows}x{k}, 6 ids (2 invalid)"),
            0.0,
            0.0,
            ok,
        );
        assert!(ok, "get_rows {ty}");
    }
}

// ---------------------------------------------------------------------------------------------
// GEMV / matmul

/// f64 oracle `W x` and the per-row bound `gamma * sum |w_i x_i|`: each lane sums at most k/32
/// products sequentially, the warp tree adds 5 and the 4-warp sum 3 roundings, the dequantized
/// weight may be one rounding off when its `d*q - m` is contracted into an FMA (+2):
/// gamma = (k/32 + 10) * 2^-24.
fn gemv_oracle(w: &[f32], x: &[f32], rows: usize, k: usize) -> (Vec<f64>, Vec<f64>) {
    let gamma = (k as f64 / 32.0 + 10.0) * U32;
    (0..rows)
        .map(|r| {
            let wr = &w[r * k..(r + 1) * k];
            let dot: f64 = wr
                .iter()
                .zip(x)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let mag: f64 = wr
                .iter()
                .zip(x)
                .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                .sum();
            (dot, gamma * mag + 1e-30)
        })
        .unzip()
}

/// The few-row kernel choices of `g.gemv`: one row per lane group, the k-split over a block's
/// warps (`Gpu::set_gemv_ksplit`), and for F32 the coalesced one-row-a-block kernel
/// (`Gpu::set_gemv_coalesced`).
const GEMV_MODES: [&str; 3] = ["one row", "k-split", "coalesced"];

/// `g.gemv` in mode `mode` of [`GEMV_MODES`] (the settings back to their defaults after), its
/// output downloaded.
fn gemv_in_mode(
    g: &Gpu,
    mode: usize,
    shape: MatShape,
    dw: &kernels::CudaSlice<u8>,
    dx: &kernels::CudaSlice<f32>,
) -> Vec<f32> {
    g.set_gemv_ksplit(mode > 0);
    g.set_gemv_coalesced(mode == 2);
    let mut dy = nan_buf(g, shape.rows);
    let res = g.gemv(shape, dw, dx, &mut dy);
    g.set_gemv_ksplit(true);
    g.set_gemv_coalesced(true);
    res.unwrap();
    g.download(&dy).unwrap()
}

#[test]
fn gemv_every_type_matches_f64() {
    let Some(g) = gpu("gemv_every_type_matches_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemv");
    // 129 rows (one row per block) and 2049 rows (4 rows per block, a partial last block);
    // k = 768 = 3 superblocks, so the 4 warps of a block get unequal shares of the row.
    let mut bad = Vec::new();
    for (rows, k) in [(129usize, 768usize), (2049, 768)] {
        for ty in GgmlType::ALL {
            let bytes = sane_blocks(ty, rows * k, &mut r);
            let w = dequant_cpu(ty, &bytes);
            let x = r.vec(k, 1.0);
            let (want, tol) = gemv_oracle(&w, &x, rows, k);
            let dw = g.upload(&bytes).unwrap();
            let dx = g.upload(&x).unwrap();
            // 129 rows: one-row blocks, and with the k-split on, 4 warps a row (33 blocks);
            // F32: one row a block, coalesced.
            for (mode, name) in GEMV_MODES.iter().enumerate() {
                let y = gemv_in_mode(&g, mode, MatShape::new(ty, rows, k), &dw, &dx);
                let mut worst = 0f64;
                let mut ok = true;
                for i in 0..rows {
                    let e = (f64::from(y[i]) - want[i]).abs();
                    ok &= y[i].is_finite() && e <= tol[i];
                    worst = worst.max(e / tol[i]);
                }
                row(
                    &format!("gemv {ty}"),
                    &format!("{rows}x{k} {name}"),
                    worst,
                    1.0,
                    ok,
                );
                if !ok {
                    bad.push((ty, rows, *name));
                }
            }
        }
    }
    assert!(bad.is_empty(), "gemv failed for {bad:?}");
}

#[test]
fn gemv_glm5_shapes() {
    let Some(g) = gpu("gemv_glm5_shapes") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemv_glm5_shapes");
    // q_a (Q4_K 2048x6144), kv_a_mqa (576x6144), attn_output (Q4_K 6144x16384 cut to 512 rows),
    // indexer.proj (F32 32x6144), attn_k_b head (Q8_0 512x192), down expert (Q6_K 6144x2048 cut).
    let cases = [
        (GgmlType::Q4_K, 2048usize, 6144usize),
        (GgmlType::Q5_K, 576, 6144),
        (GgmlType::Q4_K, 512, 16384),
        (GgmlType::F32, 32, 6144),
        (GgmlType::Q8_0, 512, 192),
        (GgmlType::Q6_K, 512, 2048),
        (GgmlType::IQ4_XS, 256, 6144),
        (GgmlType::BF16, 256, 6144),
    ];
    for (ty, rows, k) in cases {
        let bytes = sane_blocks(ty, rows * k, &mut r);
        let w = dequant_cpu(ty, &bytes);
        let x = r.vec(k, 1.0);
        let (want, tol) = gemv_oracle(&w, &x, rows, k);
        let dw = g.upload(&bytes).unwrap();
        let dx = g.upload(&x).unwrap();
        for (mode, name) in GEMV_MODES.iter().enumerate() {
            let y = gemv_in_mode(&g, mode, MatShape::new(ty, rows, k), &dw, &dx);
            let worst = (0..rows)
                .map(|i| (f64::from(y[i]) - want[i]).abs() / tol[i])
                .fold(0f64, f64::max);
            let ok = y.iter().all(|v| v.is_finite()) && worst <= 1.0;
            row(
                &format!("gemv {ty}"),
                &format!("{rows}x{k} {name}"),
                worst,
                1.0,
                ok,
            );
            assert!(ok, "gemv {ty} {rows}x{k} {name}");
        }
    }
}

#[test]
fn gemv_batched_experts_and_heads() {
    let Some(g) = gpu("gemv_batched_experts_and_heads") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemv_batched");
    // MoE: 6 experts of 64x256 Q4_K; 3 tokens x top-2 slots; slot inputs shared per token.
    let (ne, rows, k, tokens, top_k) = (6usize, 64usize, 256usize, 3usize, 2usize);
    let ty = GgmlType::Q4_K;
    let bytes = sane_blocks(ty, ne * rows * k, &mut r);
    let w = dequant_cpu(ty, &bytes);
    let x = r.vec(tokens * k, 1.0);
    let ids: Vec<i32> = vec![5, 0, 2, 2, 1, 7]; // 7 is out of range -> NaN row
    let dw = g.upload(&bytes).unwrap();
    let dx = g.upload(&x).unwrap();
    let dids = g.upload(&ids).unwrap();
    let dids_v = dids.as_view();
    let mut dy = nan_buf(&g, ids.len() * rows);
    let shape = MatShape {
        ty,
        rows,
        k,
        slabs: ne,
        packed: false,
    };
    let ch = Channels {
        count: ids.len(),
        ids: Some(&dids_v),
        x_stride: k,
        x_div: top_k,
        y_stride: rows,
    };
    g.gemv_batched(shape, &dw, ch, &dx, &mut dy).unwrap();
    let y = g.download(&dy).unwrap();
    let mut worst = 0f64;
    let mut ok = true;
    for (c, &e) in ids.iter().enumerate() {
        let out = &y[c * rows..(c + 1) * rows];
        if e as usize >= ne {
            ok &= out.iter().all(|v| v.is_nan());
            continue;
        }
        let slab = &w[e as usize * rows * k..(e as usize + 1) * rows * k];
        let xt = &x[(c / top_k) * k..(c / top_k + 1) * k];
        let (want, tol) = gemv_oracle(slab, xt, rows, k);
        for i in 0..rows {
            let err = (f64::from(out[i]) - want[i]).abs();
            ok &= err <= tol[i];
            worst = worst.max(err / tol[i]);
        }
    }
    row(
        "gemv ids (MoE)",
        "6 experts 64x256 Q4_K, 6 slots",
        worst,
        1.0,
        ok,
    );
    assert!(ok, "batched expert gemv");

    // Absorption: 4 heads of 128x64 Q8_0 (attn_k_b-like rows of 64), one input per head.
    let (heads, rows, k) = (4usize, 128usize, 64usize);
    let ty = GgmlType::Q8_0;
    let bytes = sane_blocks(ty, heads * rows * k, &mut r);
    let w = dequant_cpu(ty, &bytes);
    let x = r.vec(heads * k, 1.0);
    let dw = g.upload(&bytes).unwrap();
    let dx = g.upload(&x).unwrap();
    let mut dy = nan_buf(&g, heads * rows);
    let shape = MatShape {
        ty,
        rows,
        k,
        slabs: heads,
        packed: false,
    };
    let ch = Channels {
        count: heads,
        ids: None,
        x_stride: k,
        x_div: 1,
        y_stride: rows,
    };
    g.gemv_batched(shape, &dw, ch, &dx, &mut dy).unwrap();
    let y = g.download(&dy).unwrap();
    let mut worst = 0f64;
    let mut ok = true;
    for h in 0..heads {
        let (want, tol) = gemv_oracle(
            &w[h * rows * k..(h + 1) * rows * k],
            &x[h * k..(h + 1) * k],
            rows,
            k,
        );
        for i in 0..rows {
            let err = (f64::from(y[h * rows + i]) - want[i]).abs();
            ok &= err <= tol[i];
            worst = worst.max(err / tol[i]);
        }
    }
    row("gemv per head", "4 heads 128x64 Q8_0", worst, 1.0, ok);
    assert!(ok, "per-head gemv");
}

#[test]
fn matmul_dequant_cublas_matches_f64() {
    let Some(g) = gpu("matmul_dequant_cublas_matches_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("matmul");
    let (rows, k, tokens) = (300usize, 512usize, 17usize);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
        GgmlType::Q5_0,
    ] {
        let bytes = sane_blocks(ty, rows * k, &mut r);
        let w = dequant_cpu(ty, &bytes);
        let x = r.vec(tokens * k, 1.0);
        let dw = g.upload(&bytes).unwrap();
        let dx = g.upload(&x).unwrap();
        let mut dy = nan_buf(&g, tokens * rows);
        g.matmul(MatShape::new(ty, rows, k), &dw, &dx, tokens, &mut dy)
            .unwrap();
        let y = g.download(&dy).unwrap();
        // cuBLAS' summation order is unspecified: the general bound gamma_k = k * 2^-24.
        let mut worst = 0f64;
        let mut ok = true;
        for t in 0..tokens {
            for i in 0..rows {
                let wr = &w[i * k..(i + 1) * k];
                let xt = &x[t * k..(t + 1) * k];
                let dot: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                    .sum();
                let tol = (k as f64 + 2.0) * U32 * mag + 1e-30;
                let e = (f64::from(y[t * rows + i]) - dot).abs();
                ok &= e <= tol;
                worst = worst.max(e / tol);
            }
        }
        row(
            &format!("matmul {ty}"),
            &format!("{tokens}x{k} * ({rows}x{k})^T"),
            worst,
            1.0,
            ok,
        );
        assert!(ok, "matmul {ty}");
    }
}

// ---------------------------------------------------------------------------------------------
// norms, RoPE, element-wise, sampling

#[test]
fn rms_norm_and_layer_norm_match_f64() {
    let Some(g) = gpu("rms_norm_and_layer_norm_match_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("norms");
    for n in [64usize, 256, 576, 6144] {
        let rows = 5;
        let x = r.vec(rows * n, 2.0);
        let res = r.vec(rows * n, 1.0);
        let w = r.vec(n, 1.5);
        let b = r.vec(n, 0.5);
        let eps = 1e-5f32;
        let dx = g.upload(&x).unwrap();
        let dw = g.upload(&w).unwrap();
        let db = g.upload(&b).unwrap();
        let dwv = dw.as_view();
        let dbv = db.as_view();
        // The mean of n squares in f32 (per-thread partial sums + tree): error <= (n/64 + 16)
        // roundings relative; 1/sqrt and two products add 4; the bound is taken normwise.
        let tol_rel = (n as f64 / 64.0 + 24.0) * U32;

        let mut dy = nan_buf(&g, rows * n);
        g.rms_norm(&dx, Some(&dwv), &mut dy, Rows::dense(rows, n), eps)
            .unwrap();
        let y = g.download(&dy).unwrap();
        let mut worst = 0f64;
        for rr in 0..rows {
            let xr = &x[rr * n..(rr + 1) * n];
            let ms: f64 = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            let want: Vec<f64> = xr
                .iter()
                .zip(&w)
                .map(|(a, ww)| f64::from(*a) * inv * f64::from(*ww))
                .collect();
            let scale = max_abs(&want);
            for i in 0..n {
                worst = worst.max((f64::from(y[rr * n + i]) - want[i]).abs() / scale);
            }
        }
        let ok = worst <= tol_rel;
        row("rms_norm", &format!("{rows}x{n}"), worst, tol_rel, ok);
        assert!(ok, "rms_norm n={n}");

        // Fused residual add: res <- x + res (exact f32 add), y = rms_norm(res).
        let mut dres = g.upload(&res).unwrap();
        let mut dy = nan_buf(&g, rows * n);
        g.add_rms_norm(
            &dx,
            &mut dres,
            Some(&dwv),
            &mut dy,
            Rows::dense(rows, n),
            eps,
        )
        .unwrap();
        let h = g.download(&dres).unwrap();
        let y = g.download(&dy).unwrap();
        let exact = h
            .iter()
            .zip(x.iter().zip(&res))
            .all(|(a, (p, q))| a.to_bits() == (p + q).to_bits());
        let mut worst = 0f64;
        for rr in 0..rows {
            let hr: Vec<f32> = (0..n).map(|i| x[rr * n + i] + res[rr * n + i]).collect();
            let ms: f64 = hr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            let want: Vec<f64> = hr
                .iter()
                .zip(&w)
                .map(|(a, ww)| f64::from(*a) * inv * f64::from(*ww))
                .collect();
            let scale = max_abs(&want);
            for i in 0..n {
                worst = worst.max((f64::from(y[rr * n + i]) - want[i]).abs() / scale);
            }
        }
        let ok = exact && worst <= tol_rel;
        row("add_rms_norm", &format!("{rows}x{n}"), worst, tol_rel, ok);
        assert!(ok, "add_rms_norm n={n} (residual exact: {exact})");

        // A decode row in parts (`set_rms_parts`, one block per register slot): the residual
        // sum, the output and its q8 activations bitwise the one-block launch's.
        let one_row = |parts: bool| {
            g.set_rms_parts(parts);
            let dres = g.upload(&res[..n]).unwrap();
            let mut dh = nan_buf(&g, n);
            let mut dy = nan_buf(&g, n);
            let q = g
                .add_rms_norm_to_q8(
                    &dx,
                    &dres,
                    &mut dh,
                    Some(&dwv),
                    &mut dy,
                    Rows::dense(1, n),
                    eps,
                )
                .unwrap();
            g.set_rms_parts(false);
            let (qc, qd, qs) = q.to_host(&g).unwrap();
            (
                g.download(&dh).unwrap(),
                g.download(&dy).unwrap(),
                qc,
                qd,
                qs,
            )
        };
        let (one, split) = (one_row(false), one_row(true));
        let bits = |u: &[f32], v: &[f32]| u.iter().zip(v).all(|(p, q)| p.to_bits() == q.to_bits());
        let same = bits(&one.0, &split.0)
            && bits(&one.1, &split.1)
            && one.2 == split.2
            && bits(&one.3, &split.3)
            && one.4 == split.4;
        row("add_rms_norm parts", &format!("1x{n}"), 0.0, 0.0, same);
        assert!(same, "add_rms_norm n={n}: parts differ from one block");

        // LayerNorm: two-pass mean/variance, same error budget.
        let mut dy = nan_buf(&g, rows * n);
        g.layer_norm(
            &dx,
            Some(&dwv),
            Some(&dbv),
            &mut dy,
            Rows::dense(rows, n),
            1e-6,
        )
        .unwrap();
        let y = g.download(&dy).unwrap();
        let mut worst = 0f64;
        for rr in 0..rows {
            let xr: Vec<f64> = x[rr * n..(rr + 1) * n]
                .iter()
                .map(|v| f64::from(*v))
                .collect();
            let mean = xr.iter().sum::<f64>() / n as f64;
            let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
            let inv = 1.0 / (var + 1e-6).sqrt();
            let want: Vec<f64> = (0..n)
                .map(|i| (xr[i] - mean) * inv * f64::from(w[i]) + f64::from(b[i]))
                .collect();
            let scale = max_abs(&want);
            for i in 0..n {
                worst = worst.max((f64::from(y[rr * n + i]) - want[i]).abs() / scale);
            }
        }
        let ok = worst <= tol_rel;
        row("layer_norm", &format!("{rows}x{n}"), worst, tol_rel, ok);
        assert!(ok, "layer_norm n={n}");
    }
}

#[test]
fn rope_interleaved_matches_f64() {
    let Some(g) = gpu("rope_interleaved_matches_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("rope");
    // GLM-5 q layout: 256 per head, rope dims 192..256; and the indexer: 128 per head, rope first.
    for (head, off, n_rot, theta) in [
        (256usize, 192usize, 64usize, 1e6f32),
        (128, 0, 64, 1e6),
        (96, 64, 32, 1e4),
    ] {
        let pos: Vec<i32> = vec![0, 1, 5, 100, 1000, 4095, 65535, 131071];
        let (tokens, heads) = (pos.len(), 3usize);
        let x = r.vec(tokens * heads * head, 1.0);
        let inv = kernels::rope_inv_freq(theta, n_rot);
        let dpos = g.upload(&pos).unwrap();
        let dinv = g.upload(&inv).unwrap();
        let layout = RopeLayout {
            tokens,
            heads,
            tok_stride: heads * head,
            head_stride: head,
            offset: off,
            n_rot,
        };
        for style in [
            RopeStyle::Interleaved,
            RopeStyle::InterleavedHf,
            RopeStyle::Neox,
        ] {
            let mut dx = g.upload(&x).unwrap();
            g.rope(&mut dx, layout, &dpos, &dinv, style).unwrap();
            let y = g.download(&dx).unwrap();
            // Oracle: the f32 angle pos * inv_freq (as HF and the kernel form it), then f64
            // sin/cos. sincosf is within 2 ulps; two products and a sum add 3 roundings.
            let mut worst = 0f64;
            let mut untouched = true;
            for s in 0..tokens {
                for h in 0..heads {
                    let base = s * heads * head + h * head;
                    for j in 0..n_rot / 2 {
                        let ang = f64::from(pos[s] as f32 * inv[j]);
                        let (sn, cs) = ang.sin_cos();
                        let (i1, i2) = match style {
                            RopeStyle::Neox => (j, j + n_rot / 2),
                            _ => (2 * j, 2 * j + 1),
                        };
                        let x1 = f64::from(x[base + off + i1]);
                        let x2 = f64::from(x[base + off + i2]);
                        let (o1, o2) = (x1 * cs - x2 * sn, x2 * cs + x1 * sn);
                        let (g1, g2) = match style {
                            RopeStyle::InterleavedHf => {
                                (y[base + off + j], y[base + off + n_rot / 2 + j])
                            }
                            _ => (y[base + off + i1], y[base + off + i2]),
                        };
                        worst = worst
                            .max((f64::from(g1) - o1).abs())
                            .max((f64::from(g2) - o2).abs());
                    }
                    for i in (0..head).filter(|i| *i < off || *i >= off + n_rot) {
                        untouched &= y[base + i].to_bits() == x[base + i].to_bits();
                    }
                }
            }
            let tol = 8.0 * U32 * 2.0; // |x| <= 1: 5 roundings + 2 ulps of sin/cos, doubled
            let ok = untouched && worst <= tol;
            row(
                &format!("rope {style:?}"),
                &format!("{tokens} tok x {heads} heads, {n_rot} of {head} at {off}"),
                worst,
                tol,
                ok,
            );
            assert!(ok, "rope head={head} {style:?} untouched={untouched}");
        }
    }
}

/// RoPE out of place (`rope_to`): the MLA queries' rope columns (64 of every 256-wide head, at
/// 192) rotated into the absorbed query rows (576 per head, at 512) equal, bitwise, the in-place
/// rotation of the same values (the same kernel arithmetic), every other output element keeps
/// its NaN poison and the input is unchanged; every style.
#[test]
fn rope_to_equals_rope_in_place() {
    let Some(g) = gpu("rope_to_equals_rope_in_place") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("rope_to");
    let pos: Vec<i32> = vec![0, 1, 5, 1000, 4095, 131071];
    let (tokens, heads, n_rot) = (pos.len(), 64usize, 64usize);
    let (xh, xo, yh, yo) = (256usize, 192usize, 576usize, 512usize);
    let x = r.vec(tokens * heads * xh, 2.0);
    let inv = kernels::rope_inv_freq(1e6, n_rot);
    let (dpos, dinv) = (g.upload(&pos).unwrap(), g.upload(&inv).unwrap());
    let lay = |head: usize, off: usize| RopeLayout {
        tokens,
        heads,
        tok_stride: heads * head,
        head_stride: head,
        offset: off,
        n_rot,
    };
    for style in [
        RopeStyle::Interleaved,
        RopeStyle::InterleavedHf,
        RopeStyle::Neox,
    ] {
        let mut din = g.upload(&x).unwrap();
        g.rope(&mut din, lay(xh, xo), &dpos, &dinv, style).unwrap();
        let want = g.download(&din).unwrap();
        let dx = g.upload(&x).unwrap();
        let mut dy = nan_buf(&g, tokens * heads * yh);
        g.rope_to(&dx, lay(xh, xo), &mut dy, lay(yh, yo), &dpos, &dinv, style)
            .unwrap();
        let y = g.download(&dy).unwrap();
        let mut ok = g.download(&dx).unwrap() == x;
        for s in 0..tokens {
            for h in 0..heads {
                let (xb, yb) = ((s * heads + h) * xh + xo, (s * heads + h) * yh);
                for i in 0..yh {
                    ok &= if (yo..yo + n_rot).contains(&i) {
                        y[yb + i].to_bits() == want[xb + i - yo].to_bits()
                    } else {
                        y[yb + i].is_nan()
                    };
                }
            }
        }
        row(
            &format!("rope_to {style:?}"),
            &format!("{tokens} tok x {heads} heads, {xh}@{xo} -> {yh}@{yo}"),
            0.0,
            0.0,
            ok,
        );
        assert!(ok, "rope_to {style:?} differs from the in-place rotation");
    }
}

/// The fused norm + RoPE + cache-write kernels against the launches they replace, bitwise: the
/// MLA cache rows (`rms_norm_rope`: RMSNorm of the 512 latent columns in place, RoPE on the 64
/// after them) against `rms_norm_in_place` + `rope`, and the indexer keys (`layer_norm_rope`:
/// LayerNorm of 128 columns, RoPE on the first 64) against `layer_norm` + `rope`; the rows written
/// back in place and into f32 and bf16 cache rows (against a copy / `to_bf16`), cache rows past
/// the written ones keeping their poison; 1 and 5 rows, interleaved and NeoX pairs.
#[test]
fn norm_rope_kernels_equal_the_launches_they_fuse() {
    let Some(g) = gpu("norm_rope_kernels_equal_the_launches_they_fuse") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("norm_rope");
    let mut bad = Vec::new();
    for rows in [1usize, 5] {
        let pos: Vec<i32> = (0..rows as i32).map(|i| 4093 + 3 * i).collect();
        let inv = kernels::rope_inv_freq(1e6, 64);
        let (dpos, dinv) = (g.upload(&pos).unwrap(), g.upload(&inv).unwrap());
        let (pv, fv) = (dpos.as_view(), dinv.as_view());
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            // (name, columns, normalised lead, rope offset, LayerNorm?)
            for (what, cols, n, off, ln) in [
                ("mla kv rows", 576usize, 512usize, 512usize, false),
                ("indexer keys", 128, 128, 0, true),
            ] {
                let x: Vec<f32> = (0..rows * cols).map(|_| r.sym(3.0)).collect();
                let w: Vec<f32> = (0..n).map(|_| 1.0 + r.sym(0.2)).collect();
                let b: Vec<f32> = (0..n).map(|_| r.sym(0.2)).collect();
                let (dw, db) = (g.upload(&w).unwrap(), g.upload(&b).unwrap());
                let (wv, bv) = (dw.as_view(), db.as_view());
                let rl = RopeLayout {
                    tokens: rows,
                    heads: 1,
                    tok_stride: cols,
                    head_stride: cols,
                    offset: off,
                    n_rot: 64,
                };
                // The launches fused.
                let want = if ln {
                    let dx = g.upload(&x).unwrap();
                    let mut dy = nan_buf(&g, rows * cols);
                    g.layer_norm(
                        &dx,
                        Some(&wv),
                        Some(&bv),
                        &mut dy,
                        Rows::dense(rows, cols),
                        1e-6,
                    )
                    .unwrap();
                    g.rope(&mut dy, rl, &dpos, &dinv, style).unwrap();
                    g.download(&dy).unwrap()
                } else {
                    let mut dx = g.upload(&x).unwrap();
                    let l = Rows {
                        rows,
                        n,
                        x_stride: cols,
                        y_stride: cols,
                    };
                    g.rms_norm_in_place(&mut dx, Some(&wv), l, 1e-6).unwrap();
                    g.rope(&mut dx, rl, &dpos, &dinv, style).unwrap();
                    g.download(&dx).unwrap()
                };
                let dwant = g.upload(&want).unwrap();
                let mut dwb = g.alloc::<u16>(rows * cols).unwrap();
                g.to_bf16(&dwant, &mut dwb, rows * cols).unwrap();
                let want_bf = g.download(&dwb).unwrap();
                for bf16 in [false, true] {
                    let mut dx = g.upload(&x).unwrap();
                    // One spare row past the written ones: it must keep its poison.
                    let spare = (rows + 1) * cols;
                    // Pool buffers, as a backend's caches.
                    let mut cf = g.upload_async(&vec![f32::NAN; spare]).unwrap();
                    let mut cb = g.upload_async(&vec![0x7fc1u16; spare]).unwrap();
                    let out = if bf16 {
                        CacheRows::Bf16(cb.slice_mut(0..rows * cols))
                    } else {
                        CacheRows::F32(cf.slice_mut(0..rows * cols))
                    };
                    let rope = RowRope {
                        offset: off,
                        n_rot: 64,
                        pos: &pv,
                        inv_freq: &fv,
                        style,
                    };
                    if ln {
                        let l = Rows::dense(rows, cols);
                        g.layer_norm_rope(&mut dx, Some(&wv), Some(&bv), l, 1e-6, rope, Some(out))
                            .unwrap();
                    } else {
                        let l = Rows {
                            rows,
                            n,
                            x_stride: cols,
                            y_stride: cols,
                        };
                        g.rms_norm_rope(&mut dx, cols, Some(&wv), l, 1e-6, rope, Some(out))
                            .unwrap();
                    }
                    let got = g.download(&dx).unwrap();
                    let mut ok = got.len() == want.len()
                        && got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                    if bf16 {
                        let c = g.download(&cb).unwrap();
                        ok &= c[..rows * cols] == want_bf[..];
                        ok &= c[rows * cols..].iter().all(|&v| v == 0x7fc1);
                    } else {
                        let c = g.download(&cf).unwrap();
                        ok &= c[..rows * cols]
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        ok &= c[rows * cols..].iter().all(|v| v.is_nan());
                    }
                    let cache = if bf16 { "bf16" } else { "f32" };
                    row(
                        &format!("{what} {style:?}"),
                        &format!("{rows}x{cols}, {cache} cache"),
                        0.0,
                        0.0,
                        ok,
                    );
                    if !ok {
                        bad.push(format!("{what} {style:?} {rows} rows {cache}"));
                    }
                }
            }
        }
    }
    assert!(bad.is_empty(), "fused norm + rope differs: {bad:?}");
}

/// An MLA block's three norms as one launch (`mla_norms`) against the three launches it
/// replaces, bitwise: q_a's RMSNorm (2,048 wide, with its q8 activations, in parts for one row)
/// by `rms_norm_q8`, the latent cache rows (576 columns, 512 normalised, RoPE on the rest) by
/// `rms_norm_rope`, the indexer keys (128 columns, RoPE on the first 64) by `layer_norm_rope`;
/// 1 and 3 rows, both pair styles, f32 and bf16 cache rows, the q_a job or the indexer job
/// absent. Cache rows past the written ones keep their poison.
#[test]
fn mla_norms_launch_equals_the_three_launches_it_replaces() {
    let Some(g) = gpu("mla_norms_launch_equals_the_three_launches_it_replaces") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mla_norms");
    let (qa, kv_cols, kv_n, ix_cols) = (2048usize, 576usize, 512usize, 128usize);
    let mut bad = Vec::new();
    let mut checked = 0;
    for rows in [1usize, 3] {
        let pos: Vec<i32> = (0..rows as i32).map(|i| 2047 + 5 * i).collect();
        let inv = kernels::rope_inv_freq(1e6, 64);
        let (dpos, dinv) = (g.upload(&pos).unwrap(), g.upload(&inv).unwrap());
        let (pv, fv) = (dpos.as_view(), dinv.as_view());
        let q_x = activations(&mut r, rows, qa);
        let kv_x: Vec<f32> = (0..rows * kv_cols).map(|_| r.sym(3.0)).collect();
        let ix_x: Vec<f32> = (0..rows * ix_cols).map(|_| r.sym(3.0)).collect();
        let q_w: Vec<f32> = (0..qa).map(|_| 1.0 + r.sym(0.2)).collect();
        let kv_w: Vec<f32> = (0..kv_n).map(|_| 1.0 + r.sym(0.2)).collect();
        let ix_w: Vec<f32> = (0..ix_cols).map(|_| 1.0 + r.sym(0.2)).collect();
        let ix_b: Vec<f32> = (0..ix_cols).map(|_| r.sym(0.2)).collect();
        let (dqx, dqw, dkw, diw, dib) = (
            g.upload(&q_x).unwrap(),
            g.upload(&q_w).unwrap(),
            g.upload(&kv_w).unwrap(),
            g.upload(&ix_w).unwrap(),
            g.upload(&ix_b).unwrap(),
        );
        let (qwv, kwv, iwv, ibv) = (dqw.as_view(), dkw.as_view(), diw.as_view(), dib.as_view());
        let kv_l = Rows {
            rows,
            n: kv_n,
            x_stride: kv_cols,
            y_stride: kv_cols,
        };
        let ix_l = Rows::dense(rows, ix_cols);
        let q_l = Rows::dense(rows, qa);
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let rope = |offset: usize| RowRope {
                offset,
                n_rot: 64,
                pos: &pv,
                inv_freq: &fv,
                style,
            };
            for (bf16, with_q, with_ix) in [
                (false, true, true),
                (true, true, true),
                (true, false, true),
                (false, true, false),
            ] {
                // Caches with one spare row that must keep its poison.
                let caches = |cols: usize| {
                    let spare = (rows + 1) * cols;
                    (
                        g.upload_async(&vec![f32::NAN; spare]).unwrap(),
                        g.upload_async(&vec![0x7fc1u16; spare]).unwrap(),
                    )
                };
                fn rows_of(
                    c: &mut (kernels::DevBuf<f32>, kernels::DevBuf<u16>),
                    n: usize,
                    bf16: bool,
                ) -> CacheRows<'_> {
                    if bf16 {
                        CacheRows::Bf16(c.1.slice_mut(0..n))
                    } else {
                        CacheRows::F32(c.0.slice_mut(0..n))
                    }
                }
                // The three launches.
                let (mut wkc, mut wic) = (caches(kv_cols), caches(ix_cols));
                let mut wy = nan_buf(&g, rows * qa);
                let mut wkx = g.upload(&kv_x).unwrap();
                let mut wix = g.upload(&ix_x).unwrap();
                let wq8 = if with_q {
                    Some(g.rms_norm_q8(&dqx, Some(&qwv), &mut wy, q_l, 1e-6).unwrap())
                } else {
                    None
                };
                let kc = rows_of(&mut wkc, rows * kv_cols, bf16);
                g.rms_norm_rope(
                    &mut wkx,
                    kv_cols,
                    Some(&kwv),
                    kv_l,
                    1e-6,
                    rope(kv_n),
                    Some(kc),
                )
                .unwrap();
                if with_ix {
                    let ic = rows_of(&mut wic, rows * ix_cols, bf16);
                    g.layer_norm_rope(
                        &mut wix,
                        Some(&iwv),
                        Some(&ibv),
                        ix_l,
                        1e-6,
                        rope(0),
                        Some(ic),
                    )
                    .unwrap();
                }
                // One launch.
                let (mut gkc, mut gic) = (caches(kv_cols), caches(ix_cols));
                let mut gy = nan_buf(&g, rows * qa);
                let mut gkx = g.upload(&kv_x).unwrap();
                let mut gix = g.upload(&ix_x).unwrap();
                let q = with_q.then_some(QaNorm {
                    x: &dqx,
                    w: Some(&qwv),
                    y: &mut gy,
                    l: q_l,
                    eps: 1e-6,
                    q8: true,
                });
                let kv = NormRope {
                    x: &mut gkx,
                    cols: kv_cols,
                    w: Some(&kwv),
                    bias: None,
                    l: kv_l,
                    eps: 1e-6,
                    rope: rope(kv_n),
                    cache: Some(rows_of(&mut gkc, rows * kv_cols, bf16)),
                };
                let ix = with_ix.then(|| NormRope {
                    x: &mut gix,
                    cols: ix_cols,
                    w: Some(&iwv),
                    bias: Some(&ibv),
                    l: ix_l,
                    eps: 1e-6,
                    rope: rope(0),
                    cache: Some(rows_of(&mut gic, rows * ix_cols, bf16)),
                });
                let gq8 = g.mla_norms(q, kv, ix).unwrap();
                let same = |a: &[f32], b: &[f32]| {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                };
                let mut ok = true;
                ok &= same(&g.download(&gy).unwrap(), &g.download(&wy).unwrap());
                ok &= same(&g.download(&gkx).unwrap(), &g.download(&wkx).unwrap());
                ok &= same(&g.download(&gix).unwrap(), &g.download(&wix).unwrap());
                ok &= match (&gq8, &wq8) {
                    (Some(a), Some(b)) => a.to_host(&g).unwrap() == b.to_host(&g).unwrap(),
                    (None, None) => true,
                    _ => false,
                };
                if bf16 {
                    ok &= g.download(&gkc.1).unwrap() == g.download(&wkc.1).unwrap();
                    ok &= g.download(&gic.1).unwrap() == g.download(&wic.1).unwrap();
                } else {
                    ok &= same(&g.download(&gkc.0).unwrap(), &g.download(&wkc.0).unwrap());
                    ok &= same(&g.download(&gic.0).unwrap(), &g.download(&wic.0).unwrap());
                }
                // The spare cache row keeps its poison, and the jobs wrote (not NaN).
                let kcf = g.download(&gkc.0).unwrap();
                ok &= bf16 || kcf[..rows * kv_cols].iter().all(|v| v.is_finite());
                ok &= kcf[rows * kv_cols..].iter().all(|v| v.is_nan());
                let y = g.download(&gy).unwrap();
                ok &= y.iter().all(|v| v.is_finite()) == with_q;
                row(
                    &format!("mla_norms {style:?}"),
                    &format!("{rows} rows, bf16 {bf16}, q {with_q}, indexer {with_ix}"),
                    0.0,
                    0.0,
                    ok,
                );
                if !ok {
                    bad.push(format!(
                        "{style:?} {rows} rows bf16 {bf16} q {with_q} ix {with_ix}"
                    ));
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 16);
    assert!(
        bad.is_empty(),
        "mla_norms differs from its three launches: {bad:?}"
    );
}

#[test]
fn elementwise_ops_match_f64() {
    let Some(g) = gpu("elementwise_ops_match_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("elementwise");
    let (rows, n) = (3usize, 2048usize);
    let gate = r.vec(rows * n, 8.0);
    let up = r.vec(rows * n, 2.0);
    let dg = g.upload(&gate).unwrap();
    let du = g.upload(&up).unwrap();
    let mut dout = nan_buf(&g, rows * n);
    g.silu_mul(&dg, &du, &mut dout, Rows3::dense(rows, n))
        .unwrap();
    let out = g.download(&dout).unwrap();
    // expf (<= 2 ulps), one add, one division, one product: relative 6 ulps.
    let tol = 6.0 * U32;
    let worst = (0..rows * n)
        .map(|i| {
            let gv = f64::from(gate[i]);
            let want = gv / (1.0 + (-gv).exp()) * f64::from(up[i]);
            (f64::from(out[i]) - want).abs() / want.abs().max(1e-30)
        })
        .fold(0f64, f64::max);
    row("silu_mul", &format!("{rows}x{n}"), worst, tol, worst <= tol);
    assert!(worst <= tol);

    // add / add_assign / scale are single IEEE operations: bit-exact with the CPU.
    let a = r.vec(5000, 3.0);
    let b = r.vec(5000, 3.0);
    let da = g.upload(&a).unwrap();
    let db = g.upload(&b).unwrap();
    let mut dy = nan_buf(&g, 5000);
    g.add(&da, &db, &mut dy, 5000).unwrap();
    let y = g.download(&dy).unwrap();
    let ok_add = y
        .iter()
        .zip(a.iter().zip(&b))
        .all(|(v, (p, q))| v.to_bits() == (p + q).to_bits());
    let mut dacc = g.upload(&a).unwrap();
    g.add_assign(&mut dacc, &db, 5000).unwrap();
    let acc = g.download(&dacc).unwrap();
    let ok_acc = acc
        .iter()
        .zip(a.iter().zip(&b))
        .all(|(v, (p, q))| v.to_bits() == (p + q).to_bits());
    g.scale(&da, 0.37, &mut dy, 5000).unwrap();
    let y = g.download(&dy).unwrap();
    let ok_scale = y
        .iter()
        .zip(&a)
        .all(|(v, p)| v.to_bits() == (p * 0.37).to_bits());
    let mut dc = nan_buf(&g, 4 * 10);
    g.copy_rows(&da, 100, &mut dc, 10, 4, 10).unwrap();
    let c = g.download(&dc).unwrap();
    let ok_copy =
        (0..4).all(|rr| (0..10).all(|i| c[rr * 10 + i].to_bits() == a[rr * 100 + i].to_bits()));
    let mut dbf = g.upload(&vec![0u16; 5000]).unwrap();
    g.to_bf16(&da, &mut dbf, 5000).unwrap();
    let bf = g.download(&dbf).unwrap();
    let ok_bf = bf
        .iter()
        .zip(&a)
        .all(|(v, p)| *v == half::bf16::from_f32(*p).to_bits());
    // add_bias (row broadcast) and gather_rows: single operations / copies, bit-exact.
    let bias = r.vec(100, 1.0);
    let dbias = g.upload(&bias).unwrap();
    let mut dab = nan_buf(&g, 5000);
    g.add_bias(&da, &dbias, &mut dab, 50, 100).unwrap();
    let ab = g.download(&dab).unwrap();
    let ok_bias = (0..5000).all(|i| ab[i].to_bits() == (a[i] + bias[i % 100]).to_bits());
    let rows_idx = [49usize, 0, 7, 7, 23];
    let mut dgr = nan_buf(&g, rows_idx.len() * 100);
    g.gather_rows(&da, 50, 100, &rows_idx, &mut dgr).unwrap();
    let gr = g.download(&dgr).unwrap();
    let ok_gather = rows_idx
        .iter()
        .enumerate()
        .all(|(j, &rr)| (0..100).all(|i| gr[j * 100 + i].to_bits() == a[rr * 100 + i].to_bits()));
    let ok_gather = ok_gather && g.gather_rows(&da, 50, 100, &[50], &mut dgr).is_err();
    let ok = ok_add && ok_acc && ok_scale && ok_copy && ok_bf && ok_bias && ok_gather;
    row(
        "add/add_assign/scale/copy_rows/to_bf16/add_bias/gather_rows",
        "5000",
        0.0,
        0.0,
        ok,
    );
    assert!(
        ok,
        "add {ok_add} add_assign {ok_acc} scale {ok_scale} copy {ok_copy} bf16 {ok_bf} bias {ok_bias} gather {ok_gather}"
    );
}

#[test]
fn argmax_ties_nan_and_vocab_size() {
    let Some(g) = gpu("argmax_ties_nan_and_vocab_size") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("argmax");
    let n = 154_880usize; // GLM-5 vocabulary
    let rows = 4;
    let mut x = r.vec(rows * n, 10.0);
    // row 0: a tie at 70000 and 12: the lower index wins.
    x[12] = 50.0;
    x[70000] = 50.0;
    // row 1: NaNs everywhere but one finite maximum; NaN never wins.
    for i in 0..n {
        if i % 3 != 0 {
            x[n + i] = f32::NAN;
        }
    }
    x[n + 99_999] = 100.0;
    // row 2: all -inf -> index 0.
    for v in &mut x[2 * n..3 * n] {
        *v = f32::NEG_INFINITY;
    }
    let dx = g.upload(&x).unwrap();
    let mut dout = g.upload(&vec![-7i32; rows]).unwrap();
    g.argmax(&dx, rows, n, n, &mut dout).unwrap();
    let got = g.download(&dout).unwrap();
    let mut want = vec![12, 99_999, 0, 0];
    let r3 = &x[3 * n..4 * n];
    want[3] = (0..n).fold(0, |b, i| if r3[i] > r3[b] { i } else { b }) as i32;
    let ok = got == want;
    row(
        "argmax",
        &format!("{rows}x{n} (ties, NaN, -inf)"),
        0.0,
        0.0,
        ok,
    );
    assert_eq!(got, want);
}

// ---------------------------------------------------------------------------------------------
// MoE routing and combination

#[test]
fn moe_local_ids_rebases_on_the_device() {
    let Some(g) = gpu("moe_local_ids_rebases_on_the_device") else {
        return;
    };
    let _s = serial();
    // Ids of every kind: below, inside and above the rank's range, empty slots, the bounds.
    let ids: Vec<i32> = (0..5000).map(|i| (i * 37 % 263) - 3).collect();
    for (first, count) in [(0usize, 32usize), (64, 32), (224, 32), (0, 256), (100, 1)] {
        let mut d = g.upload(&ids).unwrap();
        g.moe_local_ids(&mut d, ids.len(), first, count).unwrap();
        let got = g.download(&d).unwrap();
        let want: Vec<i32> = ids
            .iter()
            .map(|&e| {
                if e >= first as i32 && e < (first + count) as i32 {
                    e - first as i32
                } else {
                    -1
                }
            })
            .collect();
        assert_eq!(got, want, "first {first} count {count}");
    }
}

#[test]
fn moe_router_matches_cpu() {
    let Some(g) = gpu("moe_router_matches_cpu") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("moe_router");
    let configs = [
        // GLM-5: 256 experts, 8 per token, no group limit (n_group = topk_group = 1).
        RouterConfig {
            gating: Gating::Sigmoid,
            n_experts: 256,
            n_group: 1,
            topk_group: 1,
            top_k: 8,
            norm: true,
            scale: 2.5,
        },
        // DeepSeek-V3 style group limit.
        RouterConfig {
            gating: Gating::Sigmoid,
            n_experts: 256,
            n_group: 8,
            topk_group: 4,
            top_k: 8,
            norm: true,
            scale: 2.5,
        },
        // tiny-glm5 fixture: 6 experts, 2 groups, top-1 group, top-2 experts.
        RouterConfig {
            gating: Gating::Sigmoid,
            n_experts: 6,
            n_group: 2,
            topk_group: 1,
            top_k: 2,
            norm: true,
            scale: 2.5,
        },
        // Softmax gating (Mixtral / Qwen-MoE style), no bias effect on weights.
        RouterConfig {
            gating: Gating::Softmax,
            n_experts: 64,
            n_group: 1,
            topk_group: 1,
            top_k: 4,
            norm: false,
            scale: 1.0,
        },
    ];
    for c in configs {
        let tokens = 64;
        let e = c.n_experts;
        let mut logits = r.vec(tokens * e, 4.0);
        let bias = r.vec(e, 0.05);
        // Planted exact ties: expert e-1 copies expert 0's logit and bias-free score, so their
        // biased scores tie only when the biases do; make bias equal too on token 0.
        let mut bias_t = bias.clone();
        bias_t[e - 1] = bias_t[0];
        logits[e - 1] = logits[0];
        let dl = g.upload(&logits).unwrap();
        let db = g.upload(&bias_t).unwrap();
        let dbv = db.as_view();
        let mut dids = g.upload(&vec![-1i32; tokens * c.top_k]).unwrap();
        let mut dw = nan_buf(&g, tokens * c.top_k);
        g.moe_route(&dl, tokens, e, Some(&dbv), c, &mut dids, &mut dw)
            .unwrap();
        let ids = g.download(&dids).unwrap();
        let w = g.download(&dw).unwrap();
        let (ids_ok, worst) = route_check(&ids, &w, &logits, &bias_t, tokens, c);
        let tol = ROUTE_W_TOL;
        let ok = ids_ok && worst <= tol;
        row(
            "moe_router",
            &format!(
                "{} experts, groups {}/{}, top-{}",
                e, c.topk_group, c.n_group, c.top_k
            ),
            worst,
            tol,
            ok,
        );
        assert!(ok, "router {c:?}");
    }
}

#[test]
fn moe_combine_matches_f64() {
    let Some(g) = gpu("moe_combine_matches_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("moe_combine");
    let (tokens, top_k, d) = (5usize, 8usize, 700usize);
    let y = r.vec(tokens * top_k * d, 1.0);
    let w = r.vec(tokens * top_k, 1.0);
    let base = r.vec(tokens * d, 1.0);
    let dw = g.upload(&w).unwrap();
    let mut dout = g.upload(&base).unwrap();
    // Every third slot is empty (expert id -1): skipped even though its y row is NaN.
    let ids: Vec<i32> = (0..tokens * top_k)
        .map(|i| if i % 3 == 2 { -1 } else { (i % 7) as i32 })
        .collect();
    let mut y = y;
    for (slot, &id) in ids.iter().enumerate() {
        if id < 0 {
            y[slot * d..(slot + 1) * d].fill(f32::NAN);
        }
    }
    let dy = g.upload(&y).unwrap();
    let dids = g.upload(&ids).unwrap();
    let dids_v = dids.as_view();
    g.moe_combine(
        &dy,
        d,
        &dw,
        tokens,
        top_k,
        d,
        &mut dout,
        d,
        true,
        Some(&dids_v),
    )
    .unwrap();
    let out = g.download(&dout).unwrap();
    let mut worst = 0f64;
    for t in 0..tokens {
        for i in 0..d {
            let mut mag = f64::from(base[t * d + i]).abs();
            let mut want = f64::from(base[t * d + i]);
            for k in (0..top_k).filter(|k| ids[t * top_k + k] >= 0) {
                let p = f64::from(w[t * top_k + k]) * f64::from(y[(t * top_k + k) * d + i]);
                want += p;
                mag += p.abs();
            }
            worst = worst.max((f64::from(out[t * d + i]) - want).abs() / (mag * U32));
        }
    }
    // top_k FMAs plus the final add: (top_k + 2) roundings of the magnitude sum.
    let tol = top_k as f64 + 2.0;
    row(
        "moe_combine",
        &format!("{tokens} tok x top-{top_k} x {d}"),
        worst,
        tol,
        worst <= tol,
    );
    assert!(worst <= tol);
}

// ---------------------------------------------------------------------------------------------
// MLA attention, DSA indexer, top-k

/// f64 attention for one (token, head): softmax over the allowed keys of its kv group.
fn attn_cpu(q: &[f32], k: &[f32], v: &[f32], m: &AttnShape, g: usize, keys: &[usize]) -> Vec<f64> {
    if keys.is_empty() {
        return vec![0.0; m.d_v];
    }
    let scores: Vec<f64> = keys
        .iter()
        .map(|&t| {
            let kr = &k[t * m.k_stride + g * m.d_k..t * m.k_stride + (g + 1) * m.d_k];
            q.iter()
                .zip(kr)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
                * f64::from(m.scale)
        })
        .collect();
    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
    let z: f64 = p.iter().sum();
    let mut o = vec![0f64; m.d_v];
    for (pi, &t) in p.iter().zip(keys) {
        for (d, ov) in o.iter_mut().enumerate() {
            *ov += pi / z * f64::from(v[t * m.v_stride + g * m.d_v + d]);
        }
    }
    o
}

#[test]
fn attention_dense_sparse_mla_and_gqa() {
    let Some(g) = gpu("attention_dense_sparse_mla_and_gqa") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("attention");
    // (label, heads, kv_heads, d_k, d_v, T, values share the key rows):
    // absorbed MLA of the tiny fixture (one 288-wide latent head, values = its first 256) and of
    // GLM-5 (576/512); unabsorbed MLA (96/64, not a multiple of 32); GQA 8 heads over 2;
    // a long decode (T 3000: several key splits).
    let cases = [
        (
            "mla tiny", 4usize, 1usize, 288usize, 256usize, 70usize, true,
        ),
        ("mla glm5", 64, 1, 576, 512, 300, true),
        ("mla naive", 4, 4, 96, 64, 70, false),
        ("gqa", 8, 2, 128, 128, 90, false),
        ("mla long", 16, 1, 576, 512, 3000, true),
    ];
    for (name, heads, kv_heads, d_k, d_v, t_len, shared) in cases {
        let k_stride = kv_heads * d_k;
        let v_stride = if shared { k_stride } else { kv_heads * d_v };
        let kbuf = r.vec(t_len * k_stride, 1.0);
        let vbuf = if shared {
            kbuf.clone()
        } else {
            r.vec(t_len * v_stride, 1.0)
        };
        let scale = 1.0 / (d_k as f32).sqrt();
        let dk = g.upload(&kbuf).unwrap();
        let dv = g.upload(&vbuf).unwrap();
        // prefill: every position from 0; decode: the last position only.
        let phases: Vec<(&str, usize, usize)> = if t_len > 1000 {
            vec![("decode", t_len - 1, 1)]
        } else {
            vec![("prefill", 0, t_len), ("decode", t_len - 1, 1)]
        };
        for (label, pos0, s_len) in phases {
            let q = r.vec(s_len * heads * d_k, 1.0);
            let dq = g.upload(&q).unwrap();
            let shape = AttnShape {
                tokens: s_len,
                heads,
                kv_heads,
                d_k,
                d_v,
                q_tok_stride: heads * d_k,
                q_head_stride: d_k,
                k_stride,
                v_stride,
                kv_len: t_len,
                o_tok_stride: heads * d_v,
                o_head_stride: d_v,
                scale,
                pos0,
            };
            // Sparse lists: 32 slots per query; some -1, some in the future (must stay masked).
            let n_keys = 32usize;
            let mut idx = vec![-1i32; s_len * n_keys];
            let mut allowed: Vec<Vec<usize>> = Vec::new();
            for s in 0..s_len {
                let mut chosen: Vec<usize> = Vec::new();
                for j in 0..n_keys {
                    let cand = r.below(t_len);
                    if j % 7 == 3 || chosen.contains(&cand) {
                        continue;
                    }
                    idx[s * n_keys + j] = cand as i32;
                    chosen.push(cand);
                }
                allowed.push(chosen.into_iter().filter(|&t| t <= pos0 + s).collect());
            }
            let didx = g.upload(&idx).unwrap();
            let didx_v = didx.as_view();
            for sparse in [false, true] {
                let mut dout = nan_buf(&g, s_len * heads * d_v);
                let keys = sparse.then_some(KeyLists {
                    idx: &didx_v,
                    n_keys,
                    stride: n_keys,
                });
                g.attention(&dq, &dk, &dv, keys, &mut dout, shape).unwrap();
                let out = g.download(&dout).unwrap();
                let mut worst = 0f64;
                for s in 0..s_len {
                    let keys_cpu: Vec<usize> = if sparse {
                        allowed[s].clone()
                    } else {
                        (0..=pos0 + s).collect()
                    };
                    for h in 0..heads {
                        let qh = &q[(s * heads + h) * d_k..(s * heads + h + 1) * d_k];
                        let want =
                            attn_cpu(qh, &kbuf, &vbuf, &shape, h / (heads / kv_heads), &keys_cpu);
                        let got = &out[(s * heads + h) * d_v..(s * heads + h + 1) * d_v];
                        let sc = max_abs(&want).max(1e-30);
                        for d in 0..d_v {
                            worst = worst.max((f64::from(got[d]) - want[d]).abs() / sc);
                        }
                    }
                }
                // Scores: d_k/32 sequential products per lane + 5 tree adds; |score| <= ~3 with
                // these inputs, so exp() turns an absolute score error e into a relative weight
                // error e; the split sums, their rescaling and the value sums add ~T roundings:
                // (d_k/32 + T + 16) * 2^-24, times 8 for the magnitudes, normwise.
                let tol = (d_k as f64 / 32.0 + t_len as f64 + 16.0) * U32 * 8.0;
                let ok = out.iter().all(|v| v.is_finite()) && worst <= tol;
                row(
                    &format!(
                        "attention {name} {label}{}",
                        if sparse { " sparse" } else { "" }
                    ),
                    &format!("{heads}/{kv_heads} heads, d {d_k}/{d_v}, T {t_len}, S {s_len}"),
                    worst,
                    tol,
                    ok,
                );
                assert!(ok, "attention {name} {label} sparse={sparse}");
            }
        }
    }
}

#[test]
fn indexer_scores_and_topk() {
    let Some(g) = gpu("indexer_scores_and_topk") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("indexer");
    // (heads, dim, T, top-k, query positions): the fixture (4 x 64, top-32) and GLM-5 (32 x 128,
    // top-2048) with contexts crossing 2048 and 4096.
    for (heads, dim, t_len, k, pos) in [
        (4usize, 64usize, 121usize, 32usize, vec![120i32, 31, 10]),
        (32, 128, 5000, 2048, vec![4999, 4096, 2048, 2047, 1000]),
    ] {
        let s_len = pos.len();
        let q = r.vec(s_len * heads * dim, 1.0);
        let kc = r.vec(t_len * dim, 1.0);
        let w: Vec<f32> = r
            .vec(s_len * heads, 1.0)
            .iter()
            .map(|v| v / (heads as f32).sqrt())
            .collect();
        let scale = 1.0 / (dim as f32).sqrt();
        let dq = g.upload(&q).unwrap();
        let dk = g.upload(&kc).unwrap();
        let dw = g.upload(&w).unwrap();
        let dpos = g.upload(&pos).unwrap();
        let mut dsc = nan_buf(&g, s_len * t_len);
        let sh = IndexerShape {
            tokens: s_len,
            heads,
            dim,
            q_stride: heads * dim,
            k_stride: dim,
            kv_len: t_len,
            w_stride: heads,
            out_stride: t_len,
            scale,
        };
        g.indexer_scores(&dq, &dk, &dw, &dpos, &mut dsc, sh)
            .unwrap();
        let sc = g.download(&dsc).unwrap();
        let mut worst = 0f64;
        let mut masks_ok = true;
        let mut cpu_scores = Vec::new();
        for s in 0..s_len {
            let want = indexer_cpu(
                &q[s * heads * dim..],
                &kc,
                &w[s * heads..],
                heads,
                dim,
                t_len,
                pos[s],
                scale,
            );
            let finite: Vec<f64> = want.iter().cloned().filter(|v| v.is_finite()).collect();
            let mag = max_abs(&finite).max(1e-30);
            for t in 0..t_len {
                let gv = sc[s * t_len + t];
                if want[t].is_finite() {
                    worst = worst.max((f64::from(gv) - want[t]).abs() / mag);
                } else {
                    masks_ok &= gv == f32::NEG_INFINITY;
                }
            }
            cpu_scores.push((want, mag));
        }
        // Per head: dim/32 products per lane + 5 tree adds, then H weighted terms summed in
        // order: (dim/32 + heads + 8) roundings of the magnitude, taken normwise (x4 margin for
        // the head sum's magnitude exceeding the result's).
        let tol = (dim as f64 / 32.0 + heads as f64 + 8.0) * U32 * 4.0;
        let ok = masks_ok && worst <= tol;
        row(
            "indexer_scores",
            &format!("{heads}x{dim}, T {t_len}, S {s_len}"),
            worst,
            tol,
            ok,
        );
        assert!(ok, "indexer scores (masks ok: {masks_ok})");

        // Top-k on the GPU's own scores must equal the reference selection exactly.
        let mut dsel = g.upload(&vec![-7i32; s_len * k]).unwrap();
        let mut dcnt = g.upload(&vec![-7i32; s_len]).unwrap();
        let mut dcnt_v = dcnt.as_view_mut();
        g.topk(&dsc, s_len, t_len, t_len, k, &mut dsel, Some(&mut dcnt_v))
            .unwrap();
        let sel = g.download(&dsel).unwrap();
        let cnt = g.download(&dcnt).unwrap();
        let mut ok = true;
        let mut near_tie_diffs = 0usize;
        for s in 0..s_len {
            let want = topk_cpu(&sc[s * t_len..(s + 1) * t_len], k);
            let got = &sel[s * k..(s + 1) * k];
            ok &= got == want.as_slice();
            ok &= cnt[s] as usize == want.iter().filter(|v| **v >= 0).count();
            // Against the f64 scores: the sets may differ only where a score is within the
            // scoring tolerance of the k-th largest.
            let (cpu, mag) = &cpu_scores[s];
            let cpu32: Vec<f32> = cpu.iter().map(|v| *v as f32).collect();
            let want64 = topk_cpu(&cpu32, k);
            let mut vals: Vec<f64> = cpu.iter().cloned().filter(|v| v.is_finite()).collect();
            vals.sort_by(|a, b| b.total_cmp(a));
            let kth = vals
                .get(k.saturating_sub(1))
                .cloned()
                .unwrap_or(f64::NEG_INFINITY);
            for i in got.iter().chain(&want64) {
                if *i >= 0 && (got.contains(i) != want64.contains(i)) {
                    near_tie_diffs += 1;
                    ok &= (cpu[*i as usize] - kth).abs() <= tol * mag;
                }
            }
        }
        row(
            "topk",
            &format!("T {t_len}, k {k}, S {s_len} ({near_tie_diffs} near-tie swaps)"),
            0.0,
            0.0,
            ok,
        );
        assert!(ok, "topk");
    }

    // Heavy ties: values from a set of 5, n crossing 4096, k = 2048: ties go to lower indices.
    let n = 4103usize;
    let rows = 3usize;
    let mut x: Vec<f32> = (0..rows * n).map(|_| (r.below(5) as f32) - 2.0).collect();
    for i in 0..n {
        if i % 11 == 0 {
            x[n + i] = f32::NEG_INFINITY;
        }
        if i % 13 == 0 {
            x[2 * n + i] = f32::NAN;
        }
    }
    let dx = g.upload(&x).unwrap();
    let mut dsel = g.upload(&vec![-7i32; rows * 2048]).unwrap();
    g.topk(&dx, rows, n, n, 2048, &mut dsel, None).unwrap();
    let sel = g.download(&dsel).unwrap();
    let ok = (0..rows)
        .all(|s| sel[s * 2048..(s + 1) * 2048] == topk_cpu(&x[s * n..(s + 1) * n], 2048)[..]);
    row(
        "topk ties",
        &format!("{rows}x{n}, k 2048, 5 distinct values, -inf/NaN"),
        0.0,
        0.0,
        ok,
    );
    assert!(ok, "topk with ties");
}

// ---------------------------------------------------------------------------------------------
// Repacked layouts, q8 activations, integer-dot GEMV, MLA latent kernel, expert grouping,
// bf16 prefill GEMM, launches past the grid's y limit

use kernels::{gemvq_supported, repack, CacheElem, MlaShape, QChannels, QMode, MOE_TILE};
use kernels::{CacheRows, RowRope};

#[test]
fn repacked_layouts_decode_bit_exact() {
    let Some(g) = gpu("repacked_layouts_decode_bit_exact") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("repacked");
    for ty in GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| repack::is_packed(t))
    {
        let (rows, k) = (37usize, 256usize);
        // Raw random bytes: NaN, infinite and subnormal scales included.
        let bytes: Vec<u8> = (0..rows * k / ty.block_size() * ty.type_size())
            .map(|_| r.byte())
            .collect();
        let cpu = dequant_cpu(ty, &bytes);
        let packed = repack::repack(ty, &bytes).unwrap();
        let src = g.upload(&packed).unwrap();
        let mut dst = nan_buf(&g, rows * k);
        g.dequantize_layout(ty, true, &src, &mut dst).unwrap();
        let got = g.download(&dst).unwrap();
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let ok_all = got.iter().zip(&cpu).all(|(a, b)| same(*a, *b));
        let ids: Vec<i32> = vec![36, 0, 7, -1, 40];
        let dids = g.upload(&ids).unwrap();
        let mut rows_out = nan_buf(&g, ids.len() * k);
        g.get_rows(ty, true, &src, k, &dids, &mut rows_out).unwrap();
        let got_rows = g.download(&rows_out).unwrap();
        let mut ok_rows = true;
        for (i, &id) in ids.iter().enumerate() {
            let out = &got_rows[i * k..(i + 1) * k];
            ok_rows &= if (0..rows as i32).contains(&id) {
                let want = &cpu[id as usize * k..(id as usize + 1) * k];
                out.iter().zip(want).all(|(a, b)| same(*a, *b))
            } else {
                out.iter().all(|v| v.is_nan())
            };
        }
        row(
            &format!("dequant repacked {ty}"),
            &format!("{rows}x{k} + get_rows"),
            0.0,
            0.0,
            ok_all && ok_rows,
        );
        assert!(
            ok_all && ok_rows,
            "repacked {ty}: dequant {ok_all}, get_rows {ok_rows}"
        );
    }
}

/// The norms' fused q8 epilogue gives exactly the codes and records a separate quantize launch
/// of the same f32 output gives (widths of the decode norms: 6144 hidden, 2048 q_lora, 512).
#[test]
fn fused_norm_q8_equals_a_separate_quantize() {
    let Some(g) = gpu("fused_norm_q8_equals_a_separate_quantize") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("norm_q8");
    for (rows, n) in [(1usize, 6144usize), (3, 2048), (5, 512), (2, 96)] {
        let mut x = activations(&mut r, rows, n);
        let res = activations(&mut r, rows, n);
        let w = activations(&mut r, 1, n);
        x[40] = 0.0;
        let (dx, dres, dw) = (
            g.upload(&x).unwrap(),
            g.upload(&res).unwrap(),
            g.upload(&w).unwrap(),
        );
        let dwv = dw.as_view();
        let l = Rows::dense(rows, n);
        // rms_norm
        let mut y = g.upload(&vec![0f32; rows * n]).unwrap();
        let fused = g.rms_norm_q8(&dx, Some(&dwv), &mut y, l, 1e-5).unwrap();
        let sep = g.quantize_q8(&y, rows, n, n).unwrap();
        let mut y2 = g.upload(&vec![0f32; rows * n]).unwrap();
        g.rms_norm(&dx, Some(&dwv), &mut y2, l, 1e-5).unwrap();
        assert_eq!(
            g.download(&y).unwrap(),
            g.download(&y2).unwrap(),
            "{rows}x{n}: the f32 output is unchanged by the epilogue"
        );
        assert_eq!(
            fused.to_host(&g).unwrap(),
            sep.to_host(&g).unwrap(),
            "rms_norm {rows}x{n}"
        );
        // add + rms_norm
        let mut h = g.upload(&vec![0f32; rows * n]).unwrap();
        let mut y = g.upload(&vec![0f32; rows * n]).unwrap();
        let fused = g
            .add_rms_norm_to_q8(&dx, &dres, &mut h, Some(&dwv), &mut y, l, 1e-5)
            .unwrap();
        let sep = g.quantize_q8(&y, rows, n, n).unwrap();
        assert_eq!(
            fused.to_host(&g).unwrap(),
            sep.to_host(&g).unwrap(),
            "add_rms_norm {rows}x{n}"
        );
    }
    // Rows that are not whole q8 blocks are refused, not silently misquantized.
    let dx = g.upload(&[1f32; 40]).unwrap();
    let mut y = g.upload(&[0f32; 40]).unwrap();
    assert!(g
        .rms_norm_q8(&dx, None, &mut y, Rows::dense(1, 40), 1e-5)
        .is_err());
}

#[test]
fn quantize_q8_matches_cpu_emulation() {
    let Some(g) = gpu("quantize_q8_matches_cpu_emulation") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("quantize_q8");
    let (rows, k) = (3usize, 6144usize);
    let mut x = activations(&mut r, rows, k);
    x[64 + 3] = f32::NAN; // block 2 of row 0
    let dx = g.upload(&x).unwrap();
    let q = g.quantize_q8(&dx, rows, k, k).unwrap();
    let (gq, gd, gs) = q.to_host(&g).unwrap();
    let (cq, cd, cs) = q8_cpu(&x);
    let mut bad = 0usize;
    for b in 0..rows * k / 32 {
        if b == 2 {
            assert!(gd[b].is_nan(), "a block with NaN gets d = NaN");
            continue;
        }
        bad += usize::from(gd[b].to_bits() != cd[b].to_bits());
        bad += usize::from(gs[2 * b] != cs[2 * b] || gs[2 * b + 1] != cs[2 * b + 1]);
        bad += (32 * b..32 * b + 32).filter(|&i| gq[i] != cq[i]).count();
    }
    row(
        "quantize q8",
        &format!("{rows}x{k}"),
        bad as f64,
        0.0,
        bad == 0,
    );
    assert_eq!(
        bad, 0,
        "codes, scales and sums equal the CPU emulation exactly"
    );
}

/// GPU integer-dot GEMV against (A) the f64 product of the dequantized weights with the
/// quantized activations d*q (what the kernel computes exactly, up to f32 rounding of the
/// per-block scale products and the sums over blocks) and (B) the f64 product with the f32
/// activations, allowed the activation rounding |x - d q| <= d/2 on top.
fn check_gemvq(
    g: &Gpu,
    r: &mut Rng,
    ty: GgmlType,
    rows: usize,
    k: usize,
    ncols: usize,
) -> (bool, f64) {
    let (shape, dw, w) = device_matrix(g, r, ty, 1, rows, k);
    assert!(gemvq_supported(&shape));
    let x = activations(r, ncols, k);
    let dx = g.upload(&x).unwrap();
    let q = g.quantize_q8(&dx, ncols, k, k).unwrap();
    let (qc, qd, _) = q.to_host(g).unwrap();
    let mut dy = nan_buf(g, ncols * rows);
    g.gemv_q(
        shape,
        &dw,
        QMode::Plain,
        QChannels::dense(ncols, rows),
        &q,
        &mut dy,
    )
    .unwrap();
    let y = g.download(&dy).unwrap();
    // Several columns run the several-rows-per-group kernel by default; the one-row kernel sums
    // the same products in the same order per output: bitwise equal.
    let mut ok = true;
    if ncols > 1 {
        g.set_gemvq_multirow(false);
        let mut d1 = nan_buf(g, ncols * rows);
        let r1 = g.gemv_q(
            shape,
            &dw,
            QMode::Plain,
            QChannels::dense(ncols, rows),
            &q,
            &mut d1,
        );
        g.set_gemvq_multirow(true);
        r1.unwrap();
        let y1 = g.download(&d1).unwrap();
        let same = y.iter().zip(&y1).all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            say(&format!(
                "gemvq {ty} {rows}x{k} x{ncols}: rows-per-group kernels differ"
            ));
        }
        ok &= same;
    }
    // One column: every rows-per-group setting (the default's, 1 and 4) sums the same products
    // in the same order per output, but ptxas contracts a product and a sum into one FMA as
    // each kernel's schedule allows (H100, 2026-12-07: not bitwise), so each is held to the
    // oracle's bound (which allows for the contraction) and only reported when it differs.
    if ncols == 1 {
        for rpg in [1usize, 4] {
            g.set_gemvq1_rows(rpg).unwrap();
            let mut d1 = nan_buf(g, rows);
            let r1 = g.gemv_q(
                shape,
                &dw,
                QMode::Plain,
                QChannels::dense(1, rows),
                &q,
                &mut d1,
            );
            g.set_gemvq1_rows(kernels::GEMVQ1_ROWS).unwrap();
            r1.unwrap();
            let y1 = g.download(&d1).unwrap();
            if y.iter().zip(&y1).any(|(a, b)| a.to_bits() != b.to_bits()) {
                say(&format!(
                    "gemvq {ty} {rows}x{k}: {rpg} rows per group not bitwise {} (FMA contraction)",
                    kernels::GEMVQ1_ROWS
                ));
            }
            let (ok_r, worst_r) = gemvq_verify(&w, &x, &qc, &qd, &y1, rows, k, 1);
            if !ok_r {
                say(&format!(
                    "gemvq {ty} {rows}x{k}: {rpg} rows per group off the bound ({worst_r:.3e})"
                ));
            }
            ok &= ok_r;
        }
    }
    let (ok_y, worst) = gemvq_verify(&w, &x, &qc, &qd, &y, rows, k, ncols);
    (ok && ok_y, worst)
}

#[test]
fn gemvq_every_type_matches_emulation_and_error_bound() {
    let Some(g) = gpu("gemvq_every_type_matches_emulation_and_error_bound") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemvq");
    let mut bad = Vec::new();
    for qt in kernels::QType::ALL {
        let ty = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_NL,
            GgmlType::IQ4_XS,
        ]
        .into_iter()
        .find(|&t| kernels::QType::of(t) == Some(qt))
        .unwrap();
        let mut shapes = vec![
            (129usize, 256usize, 1usize),
            (31, 6144, 3),
            (576, 2048, 8),
            (64, 512, 2),
            (576, 6144, 1),  // kv_a: four warps per row by default
            (2048, 6144, 1), // q_a: two
        ];
        if ty.block_size() == 32 {
            shapes.push((512, 192, 1)); // attn_k_b rows (K = 192): 2 lanes per row
            shapes.push((33, 192, 5));
        }
        for (rows, k, nc) in shapes {
            // One-column launches: the launch's own choice, then every k-split forced.
            let splits: &[Option<usize>] = if nc == 1 {
                &[None, Some(1), Some(2), Some(4)]
            } else {
                &[None]
            };
            for &ks in splits {
                g.force_gemvq_ksplit(ks).unwrap();
                let (ok, worst) = check_gemvq(&g, &mut r, ty, rows, k, nc);
                row(
                    &format!("gemvq {ty}"),
                    &format!("{rows}x{k} x{nc} split {ks:?}"),
                    worst,
                    1.0,
                    ok,
                );
                if !ok {
                    bad.push(format!("{ty} {rows}x{k} x{nc} split {ks:?}"));
                }
            }
            g.force_gemvq_ksplit(None).unwrap();
        }
    }
    assert!(bad.is_empty(), "gemvq failed: {bad:?}");
}

/// The accumulating GEMV (`QMode::Accumulate`: y += W x in the epilogue) equals the plain GEMV's
/// output added on the host, bitwise: same kernel, same launch shape (so the same row split and
/// summation order), then one f32 addition per output, which is exactly rounded on both sides.
/// `slabs` random `rows x k` matrices of `ty` with sane scales on the device in their layout
/// (repacked where the type needs it): their shape, device bytes and the f32 weights they
/// decode to.
fn device_matrix(
    g: &Gpu,
    r: &mut Rng,
    ty: GgmlType,
    slabs: usize,
    rows: usize,
    k: usize,
) -> (MatShape, kernels::CudaSlice<u8>, Vec<f32>) {
    let bytes = sane_blocks(ty, slabs * rows * k, r);
    let w = dequant_cpu(ty, &bytes);
    let packed = repack::is_packed(ty);
    let dev = if packed {
        repack::repack(ty, &bytes).unwrap()
    } else {
        bytes
    };
    let shape = MatShape {
        ty,
        rows,
        k,
        slabs,
        packed,
    };
    (shape, g.upload(&dev).unwrap(), w)
}

/// A stacked launch (`Gpu::gemv_q_stacked`) at GLM-5's q_a / kv_a / indexer-keys shapes
/// (Q4_K, K = 6,144: 2,048 + 576 + 128 rows) and a repacked type (Q8_0, whose scales follow
/// each matrix's blocks): every output bitwise what its matrix's own launch gives at the same
/// k-split, at each split; then the wrapper's own choice of split within the GEMV bound.
#[test]
fn gemvq_stacked_equals_each_matrix_alone() {
    let Some(g) = gpu("gemvq_stacked_equals_each_matrix_alone") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemvq_stacked");
    let mut bad = Vec::new();
    for (ty, rows, k) in [
        (GgmlType::Q4_K, [2048usize, 576, 128], 6144usize),
        (GgmlType::Q8_0, [512, 64, 40], 1024),
    ] {
        let mats: Vec<_> = rows
            .iter()
            .map(|&n| device_matrix(&g, &mut r, ty, 1, n, k))
            .collect();
        let x = activations(&mut r, 1, k);
        let dx = g.upload(&x).unwrap();
        let q = g.quantize_q8(&dx, 1, k, k).unwrap();
        let (qc, qd, _) = q.to_host(&g).unwrap();
        for ks in [Some(1), Some(2), Some(4), None] {
            g.force_gemvq_ksplit(ks).unwrap();
            let refs: Vec<(MatShape, &_)> = mats.iter().map(|(s, w, _)| (*s, w)).collect();
            let mut ys: Vec<_> = rows.iter().map(|&n| nan_buf(&g, n)).collect();
            let mut yr: Vec<_> = ys.iter_mut().collect();
            g.gemv_q_stacked(&refs, &q, &mut yr).unwrap();
            for (i, (shape, dw, w)) in mats.iter().enumerate() {
                let got = g.download(&ys[i]).unwrap();
                let (ok_bound, worst) = gemvq_verify(w, &x, &qc, &qd, &got, shape.rows, k, 1);
                // Bitwise against the lone launch where the split is the same (forced).
                let same = match ks {
                    Some(_) => {
                        let mut dy = nan_buf(&g, shape.rows);
                        let ch = QChannels::dense(1, shape.rows);
                        g.gemv_q(*shape, dw, QMode::Plain, ch, &q, &mut dy).unwrap();
                        let alone = g.download(&dy).unwrap();
                        alone
                            .iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits())
                    }
                    None => true,
                };
                let ok = ok_bound && same;
                row(
                    &format!("gemvq stacked {ty}"),
                    &format!("matrix {i} ({}x{k}) split {ks:?}", shape.rows),
                    worst,
                    1.0,
                    ok,
                );
                if !ok {
                    bad.push(format!(
                        "{ty} matrix {i} split {ks:?}: bitwise {same}, worst {worst}"
                    ));
                }
            }
        }
        g.force_gemvq_ksplit(None).unwrap();
    }
    assert!(bad.is_empty(), "stacked GEMV: {bad:?}");
}

/// One to eight columns, the shared expert's down projection (Q6_K 2,048 -> 6,144) and
/// GLM-5-like Q4_K / Q8_0 shapes.
#[test]
fn gemvq_accumulate_adds_onto_the_output_bitwise() {
    let Some(g) = gpu("gemvq_accumulate_adds_onto_the_output_bitwise") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemvq_accumulate");
    let mut bad = Vec::new();
    for (ty, rows, k, ncols) in [
        (GgmlType::Q6_K, 6144usize, 2048usize, 1usize),
        (GgmlType::Q4_K, 6144, 2048, 1),
        (GgmlType::Q4_K, 576, 6144, 3),
        (GgmlType::Q8_0, 512, 192, 8),
    ] {
        let (shape, dw, _) = device_matrix(&g, &mut r, ty, 1, rows, k);
        let dx = g.upload(&activations(&mut r, ncols, k)).unwrap();
        let q = g.quantize_q8(&dx, ncols, k, k).unwrap();
        let ch = QChannels::dense(ncols, rows);
        let mut dy = nan_buf(&g, ncols * rows);
        g.gemv_q(shape, &dw, QMode::Plain, ch, &q, &mut dy).unwrap();
        let plain = g.download(&dy).unwrap();
        let y0 = r.vec(ncols * rows, 3.0);
        let mut dacc = g.upload(&y0).unwrap();
        g.gemv_q(shape, &dw, QMode::Accumulate, ch, &q, &mut dacc)
            .unwrap();
        let got = g.download(&dacc).unwrap();
        let ok = plain.iter().all(|v| v.is_finite())
            && got
                .iter()
                .zip(y0.iter().zip(&plain))
                .all(|(a, (b, c))| a.to_bits() == (b + c).to_bits());
        row(
            &format!("gemvq accumulate {ty}"),
            &format!("{rows}x{k} x{ncols}"),
            0.0,
            0.0,
            ok,
        );
        if !ok {
            bad.push(format!("{ty} {rows}x{k} x{ncols}"));
        }
    }
    assert!(
        bad.is_empty(),
        "accumulating GEMV differs from plain + add: {bad:?}"
    );
}

#[test]
fn gemvq_glu_combine_and_grouped_experts() {
    let Some(g) = gpu("gemvq_glu_combine_and_grouped_experts") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemvq_moe");
    let (ne, ff, d) = (6usize, 256usize, 512usize);
    let gate_b = sane_blocks(GgmlType::Q4_K, ne * ff * d, &mut r);
    let up_b = sane_blocks(GgmlType::Q4_K, ne * ff * d, &mut r);
    let down_b = sane_blocks(GgmlType::Q6_K, ne * d * ff, &mut r);
    let (gw, uw, dwf) = (
        dequant_cpu(GgmlType::Q4_K, &gate_b),
        dequant_cpu(GgmlType::Q4_K, &up_b),
        dequant_cpu(GgmlType::Q6_K, &down_b),
    );
    let gs = MatShape {
        ty: GgmlType::Q4_K,
        rows: ff,
        k: d,
        slabs: ne,
        packed: false,
    };
    let ds = MatShape {
        ty: GgmlType::Q6_K,
        rows: d,
        k: ff,
        slabs: ne,
        packed: true,
    };
    let (dg, du) = (g.upload(&gate_b).unwrap(), g.upload(&up_b).unwrap());
    let ddn = g
        .upload(&repack::repack(GgmlType::Q6_K, &down_b).unwrap())
        .unwrap();
    // 5 tokens x 2 slots; token 3 has an empty slot (-1).
    let (n, kk) = (5usize, 2usize);
    let ids: Vec<i32> = vec![2, 0, 5, 2, 1, 2, 4, -1, 0, 5];
    let wts: Vec<f32> = (0..n * kk).map(|_| 0.2 + r.unit()).collect();
    let x = activations(&mut r, n, d);
    let dx = g.upload(&x).unwrap();
    let q = g.quantize_q8(&dx, n, d, d).unwrap();
    let (qc, qd, _) = q.to_host(&g).unwrap();
    let xq = |t: usize, i: usize| f64::from(qc[t * d + i]) * f64::from(qd[(t * d + i) / 32]);
    let dot =
        |w: &[f32], e: usize, rows: usize, kk_: usize, row: usize, xv: &dyn Fn(usize) -> f64| {
            let wr = &w[(e * rows + row) * kk_..(e * rows + row + 1) * kk_];
            let (mut s, mut m) = (0f64, 0f64);
            for (i, &wv) in wr.iter().enumerate() {
                s += f64::from(wv) * xv(i);
                m += f64::from(wv.abs()) * xv(i).abs();
            }
            (s, m)
        };
    let silu = |v: f64| v / (1.0 + (-v).exp());
    // The grouping maps: 8-column tiles only (the GEMVs'), and with a wide set of 16-64
    // columns (the tensor-core launches') for the experts with more than 8 pairs.
    let dids = g.upload(&ids).unwrap();
    for wide in [None, Some(16), Some(32), Some(64)] {
        let grp = g.moe_group(&dids, n * kk, kk, ne, wide).unwrap();
        let want = group_on_host(&ids, kk, ne, MOE_TILE, wide);
        let mut maps_ok = grp.sets.len() == want.len();
        for (set, w) in grp.sets.iter().zip(&want) {
            maps_ok &= set.width == w.width
                && set.max_tiles == w.tile_expert.len()
                && g.download(&set.tile_expert.view()).unwrap()[..set.max_tiles]
                    == w.tile_expert[..]
                && g.download(&set.tok.view()).unwrap()[..w.tok.len()] == w.tok[..]
                && g.download(&set.pos.view()).unwrap()[..w.pos.len()] == w.pos[..]
                && g.download(&set.pair.view()).unwrap()[..w.pair.len()] == w.pair[..];
        }
        row(
            "moe_group",
            &format!("{n} tokens x {kk} slots, {ne} experts, wide tiles {wide:?}"),
            0.0,
            0.0,
            maps_ok,
        );
        assert!(
            maps_ok,
            "grouping maps (wide {wide:?}) differ from the CPU grouping"
        );
    }
    let grp = g.moe_group(&dids, n * kk, kk, ne, None).unwrap();
    let grp = &grp.sets[0];
    let te = g.download(&grp.tile_expert.view()).unwrap();
    let (pos, pair) = (
        g.download(&grp.pos.view()).unwrap(),
        g.download(&grp.pair.view()).unwrap(),
    );
    // Grouped gate+up+SiLU: act rows in sorted order.
    let mut act = nan_buf(&g, n * kk * ff);
    let (tev, tokv, posv, pairv) = (
        grp.tile_expert.view(),
        grp.tok.view(),
        grp.pos.view(),
        grp.pair.view(),
    );
    let ch = QChannels {
        count: grp.max_tiles,
        ncols: MOE_TILE,
        ids: Some(&tev),
        xidx: Some(&tokv),
        x_div: 1,
        yidx: Some(&posv),
        y_stride: ff,
        y_rows: n * kk,
    };
    g.gemv_q(gs, &dg, QMode::Glu(&du), ch, &q, &mut act)
        .unwrap();
    let act_h = g.download(&act).unwrap();
    // The one-row-per-group GLU kernel: the same sums per output, bitwise.
    g.set_gemvq_multirow(false);
    let mut act1 = nan_buf(&g, n * kk * ff);
    let r1 = g.gemv_q(gs, &dg, QMode::Glu(&du), ch, &q, &mut act1);
    g.set_gemvq_multirow(true);
    r1.unwrap();
    let act1_h = g.download(&act1).unwrap();
    let same = act_h
        .iter()
        .zip(&act1_h)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    row(
        "gemvq glu rows per group 2 vs 1",
        &format!("{n} tokens x {kk}"),
        0.0,
        0.0,
        same,
    );
    assert!(
        same,
        "the grouped GLU differs between rows-per-group kernels"
    );
    let mut ok = true;
    let mut worst = 0f64;
    let gamma = (d as f64 / 32.0 + 16.0) * 4.0 * U32;
    for (i, &e) in te.iter().enumerate() {
        for j in 0..MOE_TILE {
            let p = pair[i * MOE_TILE + j];
            if e < 0 || p < 0 {
                continue;
            }
            let (t, sp) = (p as usize / kk, pos[i * MOE_TILE + j] as usize);
            for rr in 0..ff {
                let (gv, gm) = dot(&gw, e as usize, ff, d, rr, &|i| xq(t, i));
                let (uv, um) = dot(&uw, e as usize, ff, d, rr, &|i| xq(t, i));
                let want = silu(gv) * uv;
                // silu' <= 1.1; the q4_k scale-product bound 3 max|w| as above.
                let tol = 1.1 * 3.0 * gamma * gm * uv.abs()
                    + silu(gv).abs() * 3.0 * gamma * um
                    + 8.0 * U32 * want.abs()
                    + 1e-30;
                let got = f64::from(act_h[sp * ff + rr]);
                ok &= got.is_finite() && (got - want).abs() <= tol;
                worst = worst.max((got - want).abs() / tol);
            }
        }
    }
    row(
        "gemvq glu grouped",
        &format!("{ne} experts {ff}x{d}"),
        worst,
        1.0,
        ok,
    );
    assert!(ok, "grouped gate+up+silu");
    // Down per pair (grouped) and the fused combine of one token, against the CPU.
    let act_q = g.quantize_q8(&act, n * kk, ff, ff).unwrap();
    let (aq, ad, _) = act_q.to_host(&g).unwrap();
    let aqv =
        |row: usize, i: usize| f64::from(aq[row * ff + i]) * f64::from(ad[(row * ff + i) / 32]);
    let mut yd = nan_buf(&g, n * kk * d);
    let ch = QChannels {
        count: grp.max_tiles,
        ncols: MOE_TILE,
        ids: Some(&tev),
        xidx: Some(&posv),
        x_div: 1,
        yidx: Some(&pairv),
        y_stride: d,
        y_rows: n * kk,
    };
    g.gemv_q(ds, &ddn, QMode::Plain, ch, &act_q, &mut yd)
        .unwrap();
    let yd_h = g.download(&yd).unwrap();
    let gamma_f = (ff as f64 / 32.0 + 16.0) * 4.0 * U32;
    let mut ok = true;
    for (i, &e) in te.iter().enumerate() {
        for j in 0..MOE_TILE {
            let p = pair[i * MOE_TILE + j];
            if e < 0 || p < 0 {
                continue;
            }
            let sp = pos[i * MOE_TILE + j] as usize;
            for rr in 0..d {
                let (want, m) = dot(&dwf, e as usize, d, ff, rr, &|i| aqv(sp, i));
                let got = f64::from(yd_h[p as usize * d + rr]);
                ok &= (got - want).abs() <= 3.0 * gamma_f * m + 1e-30;
            }
        }
    }
    // The empty slot's output row is never written.
    ok &= yd_h[7 * d..8 * d].iter().all(|v| v.is_nan());
    row(
        "gemvq down grouped",
        &format!("{ne} experts {d}x{ff}"),
        0.0,
        0.0,
        ok,
    );
    assert!(ok, "grouped down");
    // Combine: token 0 as a decode step, its 2 slots' act rows quantized in slot order.
    let act0: Vec<f32> = (0..kk)
        .flat_map(|k| {
            let sp = (0..grp.max_tiles * MOE_TILE)
                .find(|&c| pair[c] == k as i32)
                .unwrap();
            act_h[pos[sp] as usize * ff..(pos[sp] as usize + 1) * ff].to_vec()
        })
        .collect();
    let da0 = g.upload(&act0).unwrap();
    let q0 = g.quantize_q8(&da0, kk, ff, ff).unwrap();
    let (q0c, q0d, _) = q0.to_host(&g).unwrap();
    let ids0 = g.upload(&ids[..kk]).unwrap();
    let w0 = g.upload(&wts[..kk]).unwrap();
    let (ids0v, w0v) = (ids0.as_view(), w0.as_view());
    let mut y0 = nan_buf(&g, d);
    let ch = QChannels {
        count: 1,
        ncols: 1,
        ids: Some(&ids0v),
        xidx: None,
        x_div: 1,
        yidx: None,
        y_stride: d,
        y_rows: 1,
    };
    g.gemv_q(
        ds,
        &ddn,
        QMode::Combine {
            weights: &w0v,
            topk: kk,
        },
        ch,
        &q0,
        &mut y0,
    )
    .unwrap();
    let y0h = g.download(&y0).unwrap();
    let mut ok = true;
    for rr in 0..d {
        let (mut want, mut m) = (0f64, 0f64);
        for k in 0..kk {
            let xv = |i: usize| f64::from(q0c[k * ff + i]) * f64::from(q0d[(k * ff + i) / 32]);
            let (v, mm) = dot(&dwf, ids[k] as usize, d, ff, rr, &xv);
            want += f64::from(wts[k]) * v;
            m += f64::from(wts[k]).abs() * mm;
        }
        ok &= (f64::from(y0h[rr]) - want).abs() <= 3.0 * gamma_f * m + 1e-30;
    }
    row(
        "gemvq combine",
        &format!("1 token x {kk} slots"),
        0.0,
        0.0,
        ok,
    );
    assert!(ok, "fused down + weighted sum");
}

/// Decode-shaped MoE launches (one column: the gate+up+SiLU of the routed experts, then the
/// down projection + weighted sum) with the rows' tasks (combine: expert slots) split over 1, 2
/// and 4 warps: each against the f64 product with the quantized activations.
#[test]
fn gemvq_glu_and_combine_split_over_warps() {
    let Some(g) = gpu("gemvq_glu_and_combine_split_over_warps") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("gemvq_ksplit");
    let (ne, ff, d, topk) = (5usize, 768usize, 2048usize, 4usize);
    let gate_b = sane_blocks(GgmlType::Q4_K, ne * ff * d, &mut r);
    let up_b = sane_blocks(GgmlType::Q4_K, ne * ff * d, &mut r);
    let down_b = sane_blocks(GgmlType::Q4_K, ne * d * ff, &mut r);
    let (gw, uw, dwf) = (
        dequant_cpu(GgmlType::Q4_K, &gate_b),
        dequant_cpu(GgmlType::Q4_K, &up_b),
        dequant_cpu(GgmlType::Q4_K, &down_b),
    );
    let shape = |rows, k| MatShape {
        ty: GgmlType::Q4_K,
        rows,
        k,
        slabs: ne,
        packed: false,
    };
    let (dg, du, ddn) = (
        g.upload(&gate_b).unwrap(),
        g.upload(&up_b).unwrap(),
        g.upload(&down_b).unwrap(),
    );
    // Slot 2 is empty (-1): skipped by the combine, its GLU channel never written.
    let ids: Vec<i32> = vec![4, 0, -1, 2];
    let wts: Vec<f32> = (0..topk).map(|_| 0.2 + r.unit()).collect();
    let x = activations(&mut r, 1, d);
    let dx = g.upload(&x).unwrap();
    let q = g.quantize_q8(&dx, 1, d, d).unwrap();
    let (qc, qd, _) = q.to_host(&g).unwrap();
    let dids = g.upload(&ids).unwrap();
    let dw = g.upload(&wts).unwrap();
    let (idv, wv) = (dids.as_view(), dw.as_view());
    let dot =
        |w: &[f32], e: usize, rows: usize, k: usize, row: usize, xv: &dyn Fn(usize) -> f64| {
            let wr = &w[(e * rows + row) * k..(e * rows + row + 1) * k];
            wr.iter().enumerate().fold((0f64, 0f64), |(s, m), (i, &w)| {
                (
                    s + f64::from(w) * xv(i),
                    m + f64::from(w.abs()) * xv(i).abs(),
                )
            })
        };
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let xq = |i: usize| f64::from(qc[i]) * f64::from(qd[i / 32]);
    let (gamma_d, gamma_f) = (
        (d as f64 / 32.0 + 16.0) * 4.0 * U32,
        (ff as f64 / 32.0 + 16.0) * 4.0 * U32,
    );
    let mut bad = Vec::new();
    // Every split, with one and two rows per lane group (`rpg`), each against the f64 products
    // (the two sum the same products in the same order, but ptxas may contract them into FMAs
    // differently: check_gemvq).
    for (ks, rpg) in [1usize, 2, 4]
        .into_iter()
        .flat_map(|ks| [(ks, 1usize), (ks, 2)])
    {
        g.force_gemvq_ksplit(Some(ks)).unwrap();
        g.set_gemvq1_rows(rpg).unwrap();
        let mut act = nan_buf(&g, topk * ff);
        let ch = QChannels {
            count: topk,
            ncols: 1,
            ids: Some(&idv),
            xidx: None,
            x_div: topk,
            yidx: None,
            y_stride: ff,
            y_rows: topk,
        };
        g.gemv_q(shape(ff, d), &dg, QMode::Glu(&du), ch, &q, &mut act)
            .unwrap();
        let act_h = g.download(&act).unwrap();
        let mut ok = act_h[2 * ff..3 * ff].iter().all(|v| v.is_nan());
        for (slot, &e) in ids.iter().enumerate() {
            if e < 0 {
                continue;
            }
            for rr in 0..ff {
                let (gv, gm) = dot(&gw, e as usize, ff, d, rr, &xq);
                let (uv, um) = dot(&uw, e as usize, ff, d, rr, &xq);
                let want = silu(gv) * uv;
                // silu' <= 1.1; the q4_k scale-product bound 3 max|w| (check_gemvq).
                let tol = 1.1 * 3.0 * gamma_d * gm * uv.abs()
                    + silu(gv).abs() * 3.0 * gamma_d * um
                    + 8.0 * U32 * want.abs()
                    + 1e-30;
                let got = f64::from(act_h[slot * ff + rr]);
                ok &= got.is_finite() && (got - want).abs() <= tol;
            }
        }
        row(
            "gemvq glu decode",
            &format!("{topk} slots {ff}x{d} split {ks}, {rpg} rows a group"),
            0.0,
            0.0,
            ok,
        );
        if !ok {
            bad.push(format!("glu split {ks} rows {rpg}"));
        }
        // The combine reads one q8 row per slot: the act rows (the empty one zeroed).
        let act_z: Vec<f32> = act_h
            .iter()
            .map(|v| if v.is_nan() { 0.0 } else { *v })
            .collect();
        let dz = g.upload(&act_z).unwrap();
        let qa = g.quantize_q8(&dz, topk, ff, ff).unwrap();
        let (ac, ad, _) = qa.to_host(&g).unwrap();
        let mut y = nan_buf(&g, d);
        let ch = QChannels {
            count: 1,
            ncols: 1,
            ids: Some(&idv),
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride: d,
            y_rows: 1,
        };
        let mode = QMode::Combine { weights: &wv, topk };
        g.gemv_q(shape(d, ff), &ddn, mode, ch, &qa, &mut y).unwrap();
        let yh = g.download(&y).unwrap();
        let mut ok = true;
        for rr in 0..d {
            let (mut want, mut m) = (0f64, 0f64);
            for (k, &e) in ids.iter().enumerate() {
                if e < 0 {
                    continue;
                }
                let xv = |i: usize| f64::from(ac[k * ff + i]) * f64::from(ad[(k * ff + i) / 32]);
                let (v, mm) = dot(&dwf, e as usize, d, ff, rr, &xv);
                want += f64::from(wts[k]) * v;
                m += f64::from(wts[k]).abs() * mm;
            }
            ok &= (f64::from(yh[rr]) - want).abs() <= 3.0 * gamma_f * m + 1e-30;
        }
        row(
            "gemvq combine decode",
            &format!("{topk} slots {d}x{ff} split {ks}, {rpg} rows a group"),
            0.0,
            0.0,
            ok,
        );
        if !ok {
            bad.push(format!("combine split {ks} rows {rpg}"));
        }
    }
    g.force_gemvq_ksplit(None).unwrap();
    g.set_gemvq1_rows(kernels::GEMVQ1_ROWS).unwrap();
    assert!(
        bad.is_empty(),
        "split launches differ from the f64 products: {bad:?}"
    );
}

/// One MLA call against the f64 oracle; `tc`: the tensor-core kernel took it (bf16 cache), whose
/// bound (`mla_tc_expect`) adds its bf16 rounding of q and of the softmax weights.
#[allow(clippy::too_many_arguments)]
fn check_mla<C: CacheElem>(
    g: &Gpu,
    r: &mut Rng,
    heads: usize,
    t_len: usize,
    s_n: usize,
    sparse: bool,
    bf16: bool,
    tc: bool,
) -> (bool, f64) {
    let (d, dv) = (576usize, 512usize);
    let c: Vec<f32> = r.vec(t_len * d, 1.0);
    // The bf16 cache holds rounded values; the oracle reads the same rounded values.
    let c_used: Vec<f32> = if bf16 {
        c.iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect()
    } else {
        c.clone()
    };
    let q = r.vec(s_n * heads * d, 1.0);
    let pos0 = t_len - s_n;
    let n_keys = 300.min(t_len + 2);
    let lists = mla_key_lists(r, s_n, n_keys, pos0);
    let dq = g.upload(&q).unwrap();
    let mut o = nan_buf(g, s_n * heads * dv);
    let m = MlaShape {
        tokens: s_n,
        heads,
        d,
        d_v: dv,
        q_tok_stride: heads * d,
        q_head_stride: d,
        kv_stride: d,
        kv_len: t_len,
        o_tok_stride: heads * dv,
        o_head_stride: dv,
        scale: 1.0 / 16.0,
        pos0,
    };
    let flat: Vec<i32> = lists.iter().flatten().copied().collect();
    let didx = g.upload(&flat).unwrap();
    let iv = didx.as_view();
    let keys = sparse.then_some(kernels::KeyLists {
        idx: &iv,
        n_keys,
        stride: n_keys,
    });
    if bf16 {
        let cb: Vec<u16> = c
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let dc = g.upload(&cb).unwrap();
        g.mla_attention(&dq, &dc, keys, &mut o, m).unwrap();
    } else {
        let dc = g.upload(&c).unwrap();
        g.mla_attention(&dq, &dc, keys, &mut o, m).unwrap();
    }
    let _ = std::marker::PhantomData::<C>;
    let got = g.download(&o).unwrap();
    let cmax = c_used.iter().fold(0f64, |a, v| a.max(f64::from(v.abs())));
    let cmax_raw = c.iter().fold(0f64, |a, v| a.max(f64::from(v.abs())));
    let mut ok = true;
    let mut worst = 0f64;
    for s in 0..s_n {
        let keys_s = mla_keys_of(sparse.then_some(&lists[..]), s, pos0);
        for h in 0..heads {
            let qh = &q[(s * heads + h) * d..(s * heads + h + 1) * d];
            if tc {
                let (want, tol) = mla_tc_expect(qh, &c_used, d, dv, &keys_s, 1.0 / 16.0);
                for j in 0..dv {
                    let gv = f64::from(got[(s * heads + h) * dv + j]);
                    let e = (gv - want[j]).abs();
                    ok &= gv.is_finite() && e <= tol[j];
                    worst = worst.max(e / tol[j]);
                }
                continue;
            }
            let (want, tol) = mla_f32_expect(qh, &c_used, d, dv, &keys_s, 1.0 / 16.0, cmax);
            // The bf16 cache itself, against the unrounded values: every value moves by <= 2^-8
            // of itself (the unit roundoff of an 8-bit significand), every score by
            // <= 2^-8 * scale * sum|q c|, so the output by
            // <= 2^-8 max|c| (1 + 2 * scale * max_t sum_i |q_i c_ti|).
            let raw = if bf16 {
                let (w_raw, _) = mla_cpu(qh, &c, d, dv, &keys_s, 1.0 / 16.0);
                let smax = keys_s
                    .iter()
                    .map(|&t| {
                        qh.iter()
                            .zip(&c[t * d..t * d + d])
                            .map(|(a, b)| f64::from(*a * *b).abs())
                            .sum::<f64>()
                            / 16.0
                    })
                    .fold(0f64, f64::max);
                Some((w_raw, (1.0 + 2.0 * smax) * cmax_raw / 256.0 + tol))
            } else {
                None
            };
            for j in 0..dv {
                let gv = f64::from(got[(s * heads + h) * dv + j]);
                let e = (gv - want[j]).abs();
                ok &= gv.is_finite() && e <= tol;
                worst = worst.max(e / tol);
                if let Some((w_raw, bound)) = &raw {
                    ok &= (gv - w_raw[j]).abs() <= *bound;
                }
            }
        }
    }
    (ok, worst)
}

#[test]
fn mla_latent_kernel_matches_f64() {
    let Some(g) = gpu("mla_latent_kernel_matches_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mla");
    let mut bad = Vec::new();
    for (heads, t_len, s_n, sparse) in [
        (64usize, 1usize, 1usize, false),
        (64, 63, 2, false),
        (64, 64, 1, false),
        (64, 65, 3, false),
        (64, 2047, 1, false),
        (64, 2048, 1, true),
        (64, 2049, 2, true),
        (8, 4097, 1, false),
        (8, 300, 4, true),
        (4, 77, 5, false),
        // More than 8 query tokens: q read from L1 instead of staged in shared memory.
        (64, 300, 12, false),
        (64, 2100, 9, true),
        // The decode kernel's plans: one split written directly (<= 32 keys), 16-key splits,
        // odd head counts, a long sparse list.
        (64, 20, 1, false),
        (64, 33, 1, false),
        (5, 100, 1, false),
        (64, 5000, 1, true),
        (64, 700, 3, false),
    ] {
        // Each case through the tile kernel, the decode kernel where it applies (<= 8 tokens)
        // and, with the bf16 cache, the tensor-core kernel.
        let kernels: &[Option<bool>] = if s_n <= 8 {
            &[Some(false), Some(true)]
        } else {
            &[None]
        };
        let runs = kernels
            .iter()
            .flat_map(|k| [false, true].into_iter().map(move |b| (*k, b, false)))
            .chain(std::iter::once((None, true, true)));
        for (kern, bf16, tc) in runs {
            kernels::force_mla_decode(kern);
            kernels::force_mla_tc(Some(tc));
            let (ok, worst) = check_mla::<f32>(&g, &mut r, heads, t_len, s_n, sparse, bf16, tc);
            kernels::force_mla_decode(None);
            kernels::force_mla_tc(None);
            let kname = match (kern, tc) {
                (_, true) => "tensor-core kernel",
                (Some(true), _) => "decode kernel",
                _ => "tile kernel",
            };
            row(
                &format!(
                    "mla {}, {kname}",
                    if bf16 { "bf16 cache" } else { "f32 cache" }
                ),
                &format!(
                    "{heads} heads, T {t_len}, {s_n} queries{}",
                    if sparse { ", sparse" } else { "" }
                ),
                worst,
                1.0,
                ok,
            );
            if !ok {
                bad.push(format!(
                    "H {heads} T {t_len} S {s_n} sparse {sparse} bf16 {bf16} {kname}"
                ));
            }
        }
    }
    assert!(bad.is_empty(), "mla failed: {bad:?}");
}

/// A batched step of several sequences in one launch (`Gpu::mla_attention_seqs`): each query
/// token against the f64 attention over its own sequence's keys, through the tile, decode and
/// (bf16 cache) tensor-core kernels; sequences of different lengths, dense and DSA-listed, one
/// and several query tokens, with the plan made for the longest (2,100 keys: split partials,
/// empty splits for the short ones merged by the combine).
#[test]
fn mla_batched_sequences_match_f64() {
    let Some(g) = gpu("mla_batched_sequences_match_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mla_seqs");
    let (d, dv, heads, scale) = (576usize, 512usize, 64usize, 1.0f32 / 16.0);
    let n_keys = 300usize;
    let mut bad = Vec::new();
    for seqs in [
        // decode-sized: 20 sequences of 1 token, up to 900 keys
        (0..20)
            .map(|i| (5 + 47 * i, 1usize, i % 3 == 2))
            .collect::<Vec<(usize, usize, bool)>>(),
        // long and short, several tokens each
        vec![
            (2100, 2, true),
            (700, 1, false),
            (20, 3, false),
            (301, 1, true),
        ],
    ] {
        let caches: Vec<Vec<f32>> = seqs.iter().map(|&(t, _, _)| r.vec(t * d, 1.0)).collect();
        let lists: Vec<Vec<Vec<i32>>> = seqs
            .iter()
            .map(|&(t, n, _)| mla_key_lists(&mut r, n, n_keys, t - n))
            .collect();
        let tokens: usize = seqs.iter().map(|s| s.1).sum();
        let q = r.vec(tokens * heads * d, 1.0);
        let dq = g.upload(&q).unwrap();
        let didx: Vec<_> = lists
            .iter()
            .map(|l| {
                g.upload(&l.iter().flatten().copied().collect::<Vec<i32>>())
                    .unwrap()
            })
            .collect();
        let iviews: Vec<_> = didx.iter().map(|b| b.as_view()).collect();
        let m = MlaShape {
            tokens,
            heads,
            d,
            d_v: dv,
            q_tok_stride: heads * d,
            q_head_stride: d,
            kv_stride: d,
            kv_len: 0,
            o_tok_stride: heads * dv,
            o_head_stride: dv,
            scale,
            pos0: 0,
        };
        for (bf16, kern, tc) in [
            (false, Some(false), false),
            (false, Some(true), false),
            (true, Some(true), false),
            (true, None, true),
        ] {
            let used: Vec<Vec<f32>> = caches
                .iter()
                .map(|c| {
                    if bf16 {
                        c.iter().map(|&v| bf16_round(v)).collect()
                    } else {
                        c.clone()
                    }
                })
                .collect();
            kernels::force_mla_decode(kern);
            kernels::force_mla_tc(Some(tc));
            let mut o = nan_buf(&g, tokens * heads * dv);
            let keys = |i: usize| {
                seqs[i].2.then_some(kernels::KeyLists {
                    idx: &iviews[i],
                    n_keys,
                    stride: n_keys,
                })
            };
            if bf16 {
                let bufs: Vec<_> = caches
                    .iter()
                    .map(|c| {
                        let b: Vec<u16> = c
                            .iter()
                            .map(|&v| half::bf16::from_f32(v).to_bits())
                            .collect();
                        g.upload(&b).unwrap()
                    })
                    .collect();
                let ms: Vec<kernels::MlaSeq<'_, u16>> = seqs
                    .iter()
                    .enumerate()
                    .map(|(i, &(t, n, _))| kernels::MlaSeq {
                        kv: bufs[i].as_view(),
                        kv_len: t,
                        tokens: n,
                        pos0: t - n,
                        keys: keys(i),
                    })
                    .collect();
                g.mla_attention_seqs(&dq, &ms, &mut o, m).unwrap();
            } else {
                let bufs: Vec<_> = caches.iter().map(|c| g.upload(c).unwrap()).collect();
                let ms: Vec<kernels::MlaSeq<'_, f32>> = seqs
                    .iter()
                    .enumerate()
                    .map(|(i, &(t, n, _))| kernels::MlaSeq {
                        kv: bufs[i].as_view(),
                        kv_len: t,
                        tokens: n,
                        pos0: t - n,
                        keys: keys(i),
                    })
                    .collect();
                g.mla_attention_seqs(&dq, &ms, &mut o, m).unwrap();
            }
            kernels::force_mla_decode(None);
            kernels::force_mla_tc(None);
            let got = g.download(&o).unwrap();
            let (mut ok, mut worst, mut at) = (true, 0f64, 0usize);
            for (i, &(t, n, sparse)) in seqs.iter().enumerate() {
                let c = &used[i];
                let cmax = c.iter().fold(0f64, |a, v| a.max(f64::from(v.abs())));
                for j in 0..n {
                    let keys_s = mla_keys_of(sparse.then_some(&lists[i][..]), j, t - n);
                    for h in 0..heads {
                        let qh = &q[(at * heads + h) * d..(at * heads + h + 1) * d];
                        let (want, tol) = if tc {
                            mla_tc_expect(qh, c, d, dv, &keys_s, scale)
                        } else {
                            let (w, t1) = mla_f32_expect(qh, c, d, dv, &keys_s, scale, cmax);
                            (w, vec![t1; dv])
                        };
                        for jj in 0..dv {
                            let gv = f64::from(got[(at * heads + h) * dv + jj]);
                            let e = (gv - want[jj]).abs();
                            ok &= gv.is_finite() && e <= tol[jj];
                            worst = worst.max(e / tol[jj]);
                        }
                    }
                    at += 1;
                }
            }
            let kname = match (kern, tc) {
                (_, true) => "tensor-core kernel",
                (Some(true), _) => "decode kernel",
                _ => "tile kernel",
            };
            let what = format!(
                "{} sequences, {tokens} tokens, {}",
                seqs.len(),
                if bf16 { "bf16 cache" } else { "f32 cache" }
            );
            row(&format!("mla batched, {kname}"), &what, worst, 1.0, ok);
            if !ok {
                bad.push(format!("{what}, {kname}"));
            }
        }
    }
    assert!(bad.is_empty(), "batched mla failed: {bad:?}");
}

/// `Gpu::scatter_rows`: each sequence's rows land at the end of its own buffer, bitwise the
/// rows (f32) or their bf16 rounding (`Gpu::to_bf16`'s), the rest of every buffer untouched.
#[test]
fn scatter_rows_writes_each_destination() {
    let Some(g) = gpu("scatter_rows_writes_each_destination") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("scatter_rows");
    let cols = 576usize;
    let counts = [1usize, 3, 0, 2];
    let rows: usize = counts.iter().sum();
    let x = r.vec(rows * cols, 4.0);
    let dx = g.upload(&x).unwrap();
    // Each destination: 5 rows already there, room for 4 more.
    let old = 5usize;
    let mut f32_bufs: Vec<_> = counts
        .iter()
        .map(|_| g.upload(&vec![7.0f32; (old + 4) * cols]).unwrap())
        .collect();
    let mut bf_bufs: Vec<_> = counts
        .iter()
        .map(|_| g.upload(&vec![0x3f80u16; (old + 4) * cols]).unwrap())
        .collect();
    {
        let mut v: Vec<_> = f32_bufs
            .iter_mut()
            .zip(counts)
            .map(|(b, n)| (b.slice_mut(old * cols..(old + n) * cols), n))
            .collect();
        g.scatter_rows(&dx, cols, &mut v).unwrap();
        let mut v: Vec<_> = bf_bufs
            .iter_mut()
            .zip(counts)
            .map(|(b, n)| (b.slice_mut(old * cols..(old + n) * cols), n))
            .collect();
        g.scatter_rows(&dx, cols, &mut v).unwrap();
    }
    let mut ok = true;
    let mut r0 = 0;
    for (i, &n) in counts.iter().enumerate() {
        let f = g.download(&f32_bufs[i]).unwrap();
        let b = g.download(&bf_bufs[i]).unwrap();
        for k in 0..(old + 4) * cols {
            let row = k / cols;
            let (wf, wb) = if row >= old && row < old + n {
                let v = x[(r0 + row - old) * cols + k % cols];
                (v, half::bf16::from_f32(v).to_bits())
            } else {
                (7.0, 0x3f80)
            };
            ok &= f[k].to_bits() == wf.to_bits() && b[k] == wb;
        }
        r0 += n;
    }
    row(
        "scatter_rows",
        "4 destinations, 6 rows of 576",
        0.0,
        0.0,
        ok,
    );
    assert!(ok, "scatter_rows wrote the wrong rows");
}

#[test]
fn matmul_bf16_matches_f64() {
    let Some(g) = gpu("matmul_bf16_matches_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("matmul_bf16");
    for (ty, rows, k, tokens) in [
        (GgmlType::Q4_K, 300usize, 512usize, 70usize),
        (GgmlType::Q6_K, 129, 2048, 65),
    ] {
        let bytes = sane_blocks(ty, rows * k, &mut r);
        let w = dequant_cpu(ty, &bytes);
        let packed = repack::is_packed(ty);
        let dev = if packed {
            repack::repack(ty, &bytes).unwrap()
        } else {
            bytes
        };
        let x = r.vec(tokens * k, 1.0);
        let (dw, dx) = (g.upload(&dev).unwrap(), g.upload(&x).unwrap());
        let mut dy = nan_buf(&g, tokens * rows);
        let shape = MatShape {
            ty,
            rows,
            k,
            slabs: 1,
            packed,
        };
        g.matmul_bf16(shape, &dw, &dx, tokens, &mut dy).unwrap();
        let y = g.download(&dy).unwrap();
        let mut ok = true;
        let mut worst = 0f64;
        for t in 0..tokens {
            for rr in 0..rows {
                let (mut s, mut m) = (0f64, 0f64);
                for i in 0..k {
                    let p = f64::from(w[rr * k + i]) * f64::from(x[t * k + i]);
                    s += p;
                    m += p.abs();
                }
                // Both operands rounded to bf16 (2^-9 each), f32 accumulation over k.
                let tol = (2.0 / 512.0 + (k as f64 + 16.0) * U32) * m + 1e-30;
                let e = (f64::from(y[t * rows + rr]) - s).abs();
                ok &= y[t * rows + rr].is_finite() && e <= tol;
                worst = worst.max(e / tol);
            }
        }
        row(
            &format!("matmul bf16 {ty}"),
            &format!("{rows}x{k} x {tokens} tokens"),
            worst,
            1.0,
            ok,
        );
        assert!(ok, "matmul_bf16 {ty}");
    }
}

/// One slab of a weight stack (an expert: `matmul_bf16_slab`) and every head of a 3-D weight
/// (`matmul_heads_bf16`, strided-batched) against the f64 products of the CPU dequantization, in
/// the GGUF (Q4_K) and the repacked (Q8_0) layout; same bound as `matmul_bf16_matches_f64`.
#[test]
fn matmul_bf16_slabs_and_heads_match_f64() {
    let Some(g) = gpu("matmul_bf16_slabs_and_heads_match_f64") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("matmul_bf16_slabs");
    let mut all_ok = true;
    // (type, rows, k, slabs, tokens, heads?): heads multiply every slab by its own x columns.
    for (ty, rows, k, slabs, tokens, heads) in [
        (GgmlType::Q4_K, 130usize, 512usize, 3usize, 70usize, false),
        (GgmlType::Q8_0, 97, 192, 4, 65, false),
        (GgmlType::Q8_0, 64, 192, 5, 67, true),
        (GgmlType::Q4_K, 40, 512, 3, 66, true),
    ] {
        let bytes = sane_blocks(ty, slabs * rows * k, &mut r);
        let w = dequant_cpu(ty, &bytes);
        let packed = repack::is_packed(ty);
        let dev = if packed {
            repack::repack(ty, &bytes).unwrap()
        } else {
            bytes
        };
        let shape = MatShape {
            ty,
            rows,
            k,
            slabs,
            packed,
        };
        let xk = if heads { slabs * k } else { k };
        let yr = if heads { slabs * rows } else { rows };
        let x = r.vec(tokens * xk, 1.0);
        let (dw, dx) = (g.upload(&dev).unwrap(), g.upload(&x).unwrap());
        let mut dy = nan_buf(&g, tokens * yr);
        let last = slabs - 1;
        if heads {
            g.matmul_heads_bf16(shape, &dw, &dx, tokens, &mut dy)
                .unwrap();
        } else {
            g.matmul_bf16_slab(shape, last, &dw, &dx, tokens, &mut dy)
                .unwrap();
        }
        let y = g.download(&dy).unwrap();
        let (mut ok, mut worst) = (true, 0f64);
        for t in 0..tokens {
            for c in 0..yr {
                // Output column c: head c / rows (or the last slab), weight row c % rows.
                let (h, rr) = if heads {
                    (c / rows, c % rows)
                } else {
                    (last, c)
                };
                let wrow = &w[(h * rows + rr) * k..(h * rows + rr + 1) * k];
                let xrow = &x[t * xk + if heads { h * k } else { 0 }..][..k];
                let (mut sum, mut mag) = (0f64, 0f64);
                for i in 0..k {
                    let p = f64::from(wrow[i]) * f64::from(xrow[i]);
                    sum += p;
                    mag += p.abs();
                }
                // Both operands rounded to bf16 (2^-9 each), f32 accumulation over k.
                let tol = (2.0 / 512.0 + (k as f64 + 16.0) * U32) * mag + 1e-30;
                let v = y[t * yr + c];
                let e = (f64::from(v) - sum).abs();
                ok &= v.is_finite() && e <= tol;
                worst = worst.max(e / tol);
            }
        }
        let what = if heads { "heads" } else { "slab" };
        row(
            &format!("matmul bf16 {what} {ty}"),
            &format!("{slabs} x {rows}x{k} x {tokens} tokens"),
            worst,
            1.0,
            ok,
        );
        all_ok &= ok;
    }
    assert!(all_ok, "a per-slab / per-head bf16 matmul is off");
}

#[test]
fn launches_past_the_grid_y_limit() {
    let Some(g) = gpu("launches_past_the_grid_y_limit") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("grid_y");
    let rows = 70_000usize; // > 65,535 (the failure at 64 heads x 1,024+ tokens)
    let mut all_ok = true;
    // copy_rows: 4 of every 8 values.
    let src = r.vec(rows * 8, 1.0);
    let ds = g.upload(&src).unwrap();
    let mut dd = nan_buf(&g, rows * 4);
    g.copy_rows(&ds, 8, &mut dd, 4, rows, 4).unwrap();
    let got = g.download(&dd).unwrap();
    let ok = (0..rows).all(|i| got[i * 4..i * 4 + 4] == src[i * 8..i * 8 + 4]);
    row("copy_rows", &format!("{rows} rows"), 0.0, 0.0, ok);
    all_ok &= ok;
    // silu_mul over rows.
    let (gt, up) = (r.vec(rows * 8, 2.0), r.vec(rows * 8, 1.0));
    let (dg, du) = (g.upload(&gt).unwrap(), g.upload(&up).unwrap());
    let mut dout = nan_buf(&g, rows * 8);
    g.silu_mul(&dg, &du, &mut dout, Rows3::dense(rows, 8))
        .unwrap();
    let got = g.download(&dout).unwrap();
    let ok = got.iter().zip(gt.iter().zip(&up)).all(|(o, (a, b))| {
        let w = f64::from(*a) / (1.0 + (-f64::from(*a)).exp()) * f64::from(*b);
        (f64::from(*o) - w).abs() <= 1e-5 * w.abs() + 1e-7
    });
    row("silu_mul", &format!("{rows} rows"), 0.0, 0.0, ok);
    all_ok &= ok;
    // get_rows with 70,000 ids from an F32 table.
    let table = r.vec(64 * 32, 1.0);
    let tb: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    let dt = g.upload(&tb).unwrap();
    let ids: Vec<i32> = (0..rows).map(|i| (i % 64) as i32).collect();
    let di = g.upload(&ids).unwrap();
    let mut de = nan_buf(&g, rows * 32);
    g.get_rows(GgmlType::F32, false, &dt, 32, &di, &mut de)
        .unwrap();
    let got = g.download(&de).unwrap();
    let ok =
        (0..rows).all(|i| got[i * 32..i * 32 + 32] == table[(i % 64) * 32..(i % 64) * 32 + 32]);
    row("get_rows", &format!("{rows} ids"), 0.0, 0.0, ok);
    all_ok &= ok;
    // rope over 70,000 tokens (1 head of 4 rope dims).
    let x0 = r.vec(rows * 4, 1.0);
    let mut dx = g.upload(&x0).unwrap();
    let pos: Vec<i32> = (0..rows as i32).collect();
    let dp = g.upload(&pos).unwrap();
    let inv = kernels::rope_inv_freq(10000.0, 4);
    let dinv = g.upload(&inv).unwrap();
    let layout = RopeLayout {
        tokens: rows,
        heads: 1,
        tok_stride: 4,
        head_stride: 4,
        offset: 0,
        n_rot: 4,
    };
    g.rope(&mut dx, layout, &dp, &dinv, RopeStyle::Interleaved)
        .unwrap();
    let got = g.download(&dx).unwrap();
    let ok = [0usize, 65_535, 65_536, rows - 1].iter().all(|&s| {
        (0..2).all(|j| {
            let a = f64::from(s as f32 * inv[j]);
            let (x1, x2) = (
                f64::from(x0[s * 4 + 2 * j]),
                f64::from(x0[s * 4 + 2 * j + 1]),
            );
            let (o1, o2) = (x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin());
            (f64::from(got[s * 4 + 2 * j]) - o1).abs() < 1e-3
                && (f64::from(got[s * 4 + 2 * j + 1]) - o2).abs() < 1e-3
        })
    });
    row("rope", &format!("{rows} tokens"), 0.0, 0.0, ok);
    all_ok &= ok;
    // A channel-batched GEMV and an integer-dot GEMV with 70,000 channels.
    let wq = sane_blocks(GgmlType::Q8_0, 32 * 32, &mut r);
    let w = dequant_cpu(GgmlType::Q8_0, &wq);
    let xs = r.vec(rows * 32, 1.0);
    let dxs = g.upload(&xs).unwrap();
    let dwr = g
        .upload(&repack::repack(GgmlType::Q8_0, &wq).unwrap())
        .unwrap();
    let shape = MatShape {
        ty: GgmlType::Q8_0,
        rows: 32,
        k: 32,
        slabs: 1,
        packed: true,
    };
    let mut dy = nan_buf(&g, rows * 32);
    let ch = Channels {
        count: rows,
        ids: None,
        x_stride: 32,
        x_div: 1,
        y_stride: 32,
    };
    g.gemv_batched(shape, &dwr, ch, &dxs, &mut dy).unwrap();
    let y = g.download(&dy).unwrap();
    let q = g.quantize_q8(&dxs, rows, 32, 32).unwrap();
    let mut dyq = nan_buf(&g, rows * 32);
    let chq = QChannels {
        count: rows,
        ncols: 1,
        ids: None,
        xidx: None,
        x_div: 1,
        yidx: None,
        y_stride: 32,
        y_rows: rows,
    };
    g.gemv_q(shape, &dwr, QMode::Plain, chq, &q, &mut dyq)
        .unwrap();
    let yq = g.download(&dyq).unwrap();
    let mut ok = true;
    for c in [0usize, 65_535, 65_536, rows - 1] {
        for rr in 0..32 {
            let (mut s, mut m) = (0f64, 0f64);
            for i in 0..32 {
                let p = f64::from(w[rr * 32 + i]) * f64::from(xs[c * 32 + i]);
                s += p;
                m += p.abs();
            }
            ok &= (f64::from(y[c * 32 + rr]) - s).abs() <= 64.0 * U32 * m + 1e-30;
            // q8: the activation rounding bound (amax/254 per value) dominates.
            let amax = xs[c * 32..c * 32 + 32]
                .iter()
                .fold(0f64, |a, v| a.max(f64::from(v.abs())));
            let wsum: f64 = (0..32).map(|i| f64::from(w[rr * 32 + i].abs())).sum();
            ok &= (f64::from(yq[c * 32 + rr]) - s).abs()
                <= wsum * amax / 254.0 * 1.001 + 64.0 * U32 * m;
        }
    }
    ok &= y.iter().chain(&yq).all(|v| v.is_finite());
    row("gemv + gemvq", &format!("{rows} channels"), 0.0, 0.0, ok);
    all_ok &= ok;
    // MLA with 70,000 query tokens, one listed key each (output = that key's value row).
    let (d, dv, h, t_len) = (576usize, 512usize, 4usize, 70_001usize);
    let cc: Vec<f32> = (0..t_len * d)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let dc = g.upload(&cc).unwrap();
    let dq = g.upload(&vec![0.01f32; rows * h * d]).unwrap();
    let lists: Vec<i32> = (0..rows).map(|s| (s % 1000) as i32).collect();
    let dl = g.upload(&lists).unwrap();
    let lv = dl.as_view();
    let mut o = nan_buf(&g, rows * h * dv);
    let m = MlaShape {
        tokens: rows,
        heads: h,
        d,
        d_v: dv,
        q_tok_stride: h * d,
        q_head_stride: d,
        kv_stride: d,
        kv_len: t_len,
        o_tok_stride: h * dv,
        o_head_stride: dv,
        scale: 0.0625,
        pos0: 1,
    };
    g.mla_attention(
        &dq,
        &dc,
        Some(kernels::KeyLists {
            idx: &lv,
            n_keys: 1,
            stride: 1,
        }),
        &mut o,
        m,
    )
    .unwrap();
    let got = g.download(&o).unwrap();
    let ok = [0usize, 65_535, 65_536, rows - 1].iter().all(|&s| {
        let t = s % 1000;
        (0..h).all(|hh| (0..dv).all(|j| got[(s * h + hh) * dv + j] == cc[t * d + j]))
    });
    row("mla", &format!("{rows} query tokens"), 0.0, 0.0, ok);
    all_ok &= ok;
    // The same through the tensor-core kernel (bf16 cache): one key of weight exp(0) = 1 (exact
    // in bf16), so the output is the cached bf16 row exactly.
    let cb: Vec<u16> = cc
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let dcb = g.upload(&cb).unwrap();
    let mut o = nan_buf(&g, rows * h * dv);
    kernels::force_mla_tc(Some(true));
    let res = g.mla_attention(
        &dq,
        &dcb,
        Some(kernels::KeyLists {
            idx: &lv,
            n_keys: 1,
            stride: 1,
        }),
        &mut o,
        m,
    );
    kernels::force_mla_tc(None);
    res.unwrap();
    let got = g.download(&o).unwrap();
    let ok = [0usize, 65_535, 65_536, rows - 1].iter().all(|&s| {
        let t = s % 1000;
        (0..h).all(|hh| (0..dv).all(|j| got[(s * h + hh) * dv + j] == bf16_round(cc[t * d + j])))
    });
    row(
        "mla tensor cores",
        &format!("{rows} query tokens"),
        0.0,
        0.0,
        ok,
    );
    all_ok &= ok;
    assert!(
        all_ok,
        "a launch past the grid's y limit computed wrong values"
    );
}

/// Whether `id` is a correct pick of sample.cu's rules for row `x` (f64 emulation): `id` is in
/// the distribution and its CDF interval, in the kernel's order, holds u * mass up to the f32
/// summation bound.
fn sample_ok(x: &[f32], p: kernels::SampleParams, id: usize) -> bool {
    let n = x.len();
    let argmax = (0..n).fold(0, |b, i| if x[i] > x[b] { i } else { b });
    if p.temperature <= 0.0 || p.top_k == 1 {
        return id == argmax;
    }
    let k = if p.top_k > 0 && (p.top_k as usize) < n {
        p.top_k as usize
    } else {
        n
    };
    if !(p.min_p > 0.0 && p.min_p <= 1.0) {
        return sample_ok_top(x, p, id, argmax, k);
    }
    // min-p lowers K to the entries >= max + temp * ln(min_p), computed in f32 on the device;
    // the device's logf may differ from Rust's ln by an ulp, so a logit within a few ulps of the
    // floor may fall on either side: both counts are valid.
    let floor = x[argmax] + p.temperature * p.min_p.ln();
    let slack = 4.0 * f32::EPSILON * floor.abs().max(1.0);
    let count = |f: f32| (0..n).filter(|&i| x[i] >= f).count().max(1);
    let (lo, hi) = (count(floor + slack).min(k), count(floor - slack).min(k));
    sample_ok_top(x, p, id, argmax, lo) || (hi != lo && sample_ok_top(x, p, id, argmax, hi))
}

/// [`sample_ok`] once top-k and min-p have fixed the candidate count `k`.
fn sample_ok_top(x: &[f32], p: kernels::SampleParams, id: usize, argmax: usize, k: usize) -> bool {
    let n = x.len();
    let mx = f64::from(x[argmax]);
    let w = |i: usize| ((f64::from(x[i]) - mx) / f64::from(p.temperature)).exp();
    let c = k.min(1024);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    let cands = &order[..c];
    let zc: f64 = cands.iter().map(|&i| w(i)).sum();
    let kth = x[order[k - 1]];
    let zref = if k > c {
        (0..n).filter(|&i| x[i] >= kth).map(w).sum()
    } else {
        zc
    };
    let nucleus = p.top_p < 1.0;
    let dist: Vec<usize> = if if nucleus {
        zc >= f64::from(p.top_p) * zref
    } else {
        k <= c
    } {
        let lim = f64::from(p.top_p) * zref;
        let mut cum = 0.0;
        let mut cut = c - 1;
        if nucleus {
            for (j, &i) in cands.iter().enumerate() {
                cum += w(i);
                if cum >= lim {
                    cut = j;
                    break;
                }
            }
        }
        cands[..=cut].to_vec()
    } else {
        let tau = if nucleus {
            // The largest value whose {x >= value} mass reaches the limit.
            let lim = f64::from(p.top_p) * zref;
            let mut cum = 0.0;
            let mut t = kth;
            for &i in &order[..k] {
                cum += w(i);
                if cum >= lim {
                    t = x[i];
                    break;
                }
            }
            t
        } else {
            kth
        };
        (0..n).filter(|&i| x[i] >= tau).collect()
    };
    let mass: f64 = dist.iter().map(|&i| w(i)).sum();
    let target = f64::from(p.u) * mass;
    let tol = (dist.len() as f64 + 64.0) * 4.0 * U32 * mass;
    let mut before = 0.0;
    for &i in &dist {
        if i == id {
            return before - tol <= target && target <= before + w(i) + tol;
        }
        before += w(i);
    }
    false
}

/// Greedy picks the CPU's argmax (larger wins, ties to the lower id, NaN never wins) on aligned
/// rows (the 16-byte path) and on rows that start unaligned or end mid-vector (the scalar path).
#[test]
fn greedy_sampling_is_the_argmax_on_any_row_alignment() {
    let Some(g) = gpu("greedy_sampling_is_the_argmax_on_any_row_alignment") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("greedy");
    let greedy = kernels::SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        u: 0.5,
        min_p: 0.0,
    };
    for (n, stride) in [
        (154_880usize, 154_880usize),
        (1001, 1003),
        (4099, 4100),
        (7, 9),
    ] {
        let rows = 4;
        let mut x: Vec<f32> = (0..rows * stride).map(|_| r.sym(2.0)).collect();
        // Row 1: a tie of the maximum at two ids; row 2: a NaN beside the maximum.
        let top = 100.0;
        x[stride + n / 3] = top;
        x[stride + n - 1] = top;
        x[2 * stride + n / 2] = top;
        x[2 * stride + n / 4] = f32::NAN;
        let dx = g.upload(&x).unwrap();
        let mut ids = g.upload(&vec![-7i32; rows]).unwrap();
        g.sample(&dx, rows, n, stride, &vec![greedy; rows], &mut ids)
            .unwrap();
        let got: Vec<u32> = g
            .download(&ids)
            .unwrap()
            .into_iter()
            .map(|v| kernels::sampled_id(v).0)
            .collect();
        for (row_i, &id) in got.iter().enumerate() {
            let xr = &x[row_i * stride..row_i * stride + n];
            let mut best = (f32::NEG_INFINITY, usize::MAX);
            for (i, &v) in xr.iter().enumerate() {
                if !v.is_nan() && (v > best.0 || best.1 == usize::MAX) {
                    best = (v, i);
                }
            }
            assert_eq!(id as usize, best.1, "V {n} stride {stride} row {row_i}");
        }
    }
}

#[test]
fn sampling_follows_temperature_top_k_top_p() {
    let Some(g) = gpu("sampling_follows_temperature_top_k_top_p") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("sample");
    use kernels::SampleParams as P;
    let cases = [
        P {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            u: 0.5,
            min_p: 0.0,
        },
        P {
            temperature: 0.7,
            top_k: 40,
            top_p: 1.0,
            u: 0.3,
            min_p: 0.0,
        },
        P {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.9,
            u: 0.95,
            min_p: 0.0,
        },
        P {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            u: 0.42,
            min_p: 0.0,
        },
        P {
            temperature: 1.3,
            top_k: 0,
            top_p: 1.0,
            u: 0.77,
            min_p: 0.0,
        },
        P {
            temperature: 1.0,
            top_k: 2000,
            top_p: 1.0,
            u: 0.12,
            min_p: 0.0,
        },
        P {
            temperature: 1.0,
            top_k: 5000,
            top_p: 0.5,
            u: 0.61,
            min_p: 0.0,
        },
        P {
            temperature: 0.5,
            top_k: 1,
            top_p: 0.3,
            u: 0.99,
            min_p: 0.0,
        },
        // generate's defaults (min-p after top-k, before top-p), and min-p alone.
        P {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            u: 0.37,
            min_p: 0.05,
        },
        P {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            u: 0.83,
            min_p: 0.01,
        },
        P {
            temperature: 1.5,
            top_k: 0,
            top_p: 0.9,
            u: 0.29,
            min_p: 0.2,
        },
    ];
    let mut ok_all = true;
    for (n, sigma) in [(154_880usize, 3.0f32), (154_880, 0.5), (1000, 2.0)] {
        let rows = cases.len();
        let x: Vec<f32> = (0..rows * n).map(|_| r.sym(sigma)).collect();
        let dx = g.upload(&x).unwrap();
        let mut ids = g.upload(&vec![-7i32; rows]).unwrap();
        g.sample(&dx, rows, n, n, &cases, &mut ids).unwrap();
        let got = g.download(&ids).unwrap();
        for (i, p) in cases.iter().enumerate() {
            let ok = got[i] >= 0 && sample_ok(&x[i * n..(i + 1) * n], *p, got[i] as usize);
            row(
                "sample",
                &format!("V {n} sigma {sigma} {p:?}"),
                0.0,
                0.0,
                ok,
            );
            ok_all &= ok;
        }
    }
    assert!(ok_all, "a sampled id is not a valid pick");
    // A non-finite logit is reported (the id carries SAMPLE_NONFINITE) whatever the mode; a
    // finite row is not flagged.
    let n = 5000;
    let mut x: Vec<f32> = (0..3 * n).map(|_| r.sym(2.0)).collect();
    x[n + 17] = f32::NAN;
    x[2 * n + 4000] = f32::INFINITY;
    let dx = g.upload(&x).unwrap();
    let ps = [cases[0], cases[1], cases[2]];
    let mut ids = g.upload(&[-7i32; 3]).unwrap();
    g.sample(&dx, 3, n, n, &ps, &mut ids).unwrap();
    let got: Vec<(u32, bool)> = g
        .download(&ids)
        .unwrap()
        .into_iter()
        .map(kernels::sampled_id)
        .collect();
    let flags_ok = !got[0].1 && got[1].1 && got[2].1 && (got[0].0 as usize) < n;
    row("sample", "non-finite flag", 0.0, 0.0, flags_ok);
    assert!(flags_ok, "non-finite rows not flagged: {got:?}");
}

/// Staged bulk uploads (weights at load): 20 MiB + 3 bytes of a pattern arrive bytewise equal
/// through chunks of odd sizes (each filled at the offset it was asked for, the last one
/// short), in the default 8 MiB slots too, one after another so the slot ring wraps; a `fill`
/// that fails halfway returns its error (with the offset), leaves the device usable and the
/// next upload correct.
#[test]
fn upload_staged_chunks_arrive_whole_and_fill_errors_return() {
    let Some(g) = gpu("upload_staged") else {
        return;
    };
    let _s = serial();
    let len = (20 << 20) + 3;
    let pattern = |i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (i as u8);
    let want: Vec<u8> = (0..len).map(pattern).collect();
    for chunk in [kernels::pool::BULK_SLOT, 1_000_003, 65_537, 4_099] {
        let mut next = 0usize;
        let mut calls = 0usize;
        let d = g
            .upload_staged_chunks(len, chunk, |at, buf: &mut [u8]| {
                // Chunks come in order, back to back, each as long as asked but the last.
                if at != next || (at + buf.len() < len && buf.len() != chunk) {
                    return Err(format!(
                        "chunk at {at} of {} bytes, expected {next}",
                        buf.len()
                    ));
                }
                buf.copy_from_slice(&want[at..at + buf.len()]);
                next = at + buf.len();
                calls += 1;
                Ok(())
            })
            .unwrap_or_else(|e| panic!("chunk {chunk}: {e}"));
        let got = g.download(&d).unwrap();
        let ok = got == want && next == len && calls == len.div_ceil(chunk);
        row(
            "upload_staged",
            &format!("{len} B in {calls} chunks of {chunk}"),
            0.0,
            0.0,
            ok,
        );
        assert!(ok, "chunk {chunk}: downloaded bytes differ");
    }
    // A fill failing halfway: its error comes back with the offset of the failing chunk.
    let fail_at = 10 << 20;
    let r = g.upload_staged_chunks(len, 1 << 20, |at, buf: &mut [u8]| {
        if at >= fail_at {
            return Err("disk went away");
        }
        buf.fill(0xEE);
        Ok(())
    });
    let ok = match r {
        Err(kernels::pool::StagedError::Fill { offset, source }) => {
            offset == fail_at && source == "disk went away"
        }
        Err(e) => panic!("a fill error came back as {e}"),
        Ok(_) => panic!("a failing fill uploaded"),
    };
    row("upload_staged", "fill error halfway", 0.0, 0.0, ok);
    assert!(ok, "wrong offset or error");
    g.synchronize()
        .expect("device usable after a failed upload");
    let d = g
        .upload_staged(len, |at, buf: &mut [u8]| {
            buf.copy_from_slice(&want[at..at + buf.len()]);
            Ok::<(), String>(())
        })
        .expect("upload after a failed one");
    assert!(
        g.download(&d).unwrap() == want,
        "upload after a failed one differs"
    );
}

// ---------------------------------------------------------------------------------------------
// Rows split over blocks: greedy sampling / arg-max and the DSA top-k (issue 12)

use kernels::sample::{split_chunks, Split};

/// The CPU greedy rule: the largest non-NaN value, ties to the lower id (0 when every value is
/// NaN), and whether the row holds a NaN or an infinity.
fn greedy_cpu(x: &[f32]) -> (i32, bool) {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i));
        }
    }
    (
        best.map_or(0, |(_, i)| i as i32),
        x.iter().any(|v| !v.is_finite()),
    )
}

/// Greedy rows through the split path (`Split::Blocks`), the one-block kernels and `Auto`, for
/// sample and argmax: every id equals the CPU rule, flags included, on GLM-5's vocabulary and
/// odd sizes, aligned and unaligned rows, equal maxima in two chunks, NaN / inf rows.
#[test]
fn greedy_split_over_blocks_equals_one_block_and_cpu() {
    let Some(g) = gpu("greedy_split_over_blocks_equals_one_block_and_cpu") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("greedy_split");
    let sms = g.info().sm_count;
    let greedy = kernels::SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        u: 0.5,
        min_p: 0.0,
    };
    // top_k = 1 with a temperature is greedy too.
    let greedy_k1 = kernels::SampleParams {
        temperature: 0.7,
        top_k: 1,
        top_p: 0.9,
        u: 0.25,
        min_p: 0.0,
    };
    let rows = 6usize;
    let mut all_ok = true;
    for (n, stride) in [
        (154_880usize, 154_880usize),
        (154_880, 154_883),
        (1, 1),
        (31, 33),
        (1_025, 1_025),
        (200_001, 200_001),
        (200_001, 200_004),
    ] {
        let (chunk, chunks) = split_chunks(n, rows, sms);
        let mut x: Vec<f32> = (0..rows * stride).map(|_| r.sym(4.0)).collect();
        let top = 1000.0f32;
        // Row 0: equal maxima on both sides of the first chunk boundary and in a later chunk.
        for i in [chunk - 1, chunk, 3 * chunk + 5] {
            if i < n {
                x[i] = top;
            }
        }
        // Row 1: equal maxima in the last chunk and a middle one (the middle one wins).
        if n > 1 {
            x[stride + n - 1] = top;
            x[stride + n / 2] = top;
        }
        // Row 2: NaN at the start of every chunk and beside the maximum: NaN never wins.
        for c in 0..chunks {
            if c * chunk < n {
                x[2 * stride + c * chunk] = f32::NAN;
            }
        }
        x[2 * stride + n - 1] = f32::NAN;
        if n > 2 {
            x[2 * stride + n - 2] = top;
        }
        // Row 3: +inf wins over everything (and flags the row); a -inf elsewhere.
        x[3 * stride + (n / 3)] = f32::INFINITY;
        x[3 * stride + n - 1] = f32::NEG_INFINITY;
        // Row 4: only NaN -> id 0, flagged.
        for v in &mut x[4 * stride..4 * stride + n] {
            *v = f32::NAN;
        }
        // Row 5: only -inf -> id 0 (the lowest of equal values), flagged.
        for v in &mut x[5 * stride..5 * stride + n] {
            *v = f32::NEG_INFINITY;
        }
        let want: Vec<(i32, bool)> = (0..rows)
            .map(|i| greedy_cpu(&x[i * stride..i * stride + n]))
            .collect();
        let dx = g.upload(&x).unwrap();
        let params: Vec<kernels::SampleParams> = (0..rows)
            .map(|i| if i % 2 == 0 { greedy } else { greedy_k1 })
            .collect();
        let mut outs = Vec::new();
        for split in [Split::Blocks, Split::OneBlock, Split::Auto] {
            let mut ids = g.upload(&vec![-7i32; rows]).unwrap();
            g.sample_split(&dx, rows, n, stride, &params, &mut ids, split)
                .unwrap();
            let got: Vec<(i32, bool)> = g
                .download(&ids)
                .unwrap()
                .into_iter()
                .map(|v| {
                    let (id, bad) = kernels::sampled_id(v);
                    (id as i32, bad)
                })
                .collect();
            let ok = got == want;
            row(
                "sample greedy",
                &format!("{rows}x{n} stride {stride} {split:?} ({chunks} chunks of {chunk})"),
                0.0,
                0.0,
                ok,
            );
            all_ok &= ok;
            if !ok {
                say(&format!("  got {got:?}\n  want {want:?}"));
            }
            outs.push(got);
            let mut am = g.upload(&vec![-7i32; rows]).unwrap();
            g.argmax_split(&dx, rows, n, stride, &mut am, split)
                .unwrap();
            let got_am = g.download(&am).unwrap();
            let want_am: Vec<i32> = want.iter().map(|w| w.0).collect();
            let ok = got_am == want_am;
            row(
                "argmax",
                &format!("{rows}x{n} stride {stride} {split:?}"),
                0.0,
                0.0,
                ok,
            );
            all_ok &= ok;
            if !ok {
                say(&format!("  got {got_am:?}\n  want {want_am:?}"));
            }
        }
        all_ok &= outs.windows(2).all(|w| w[0] == w[1]);
    }
    assert!(
        all_ok,
        "a split greedy id differs from the one-block kernel or the CPU"
    );
}

/// A batch mixing greedy and sampled rows: with the greedy rows split over blocks the sampled
/// rows still go through sample_rows and give the same ids as the one-block plan (same u), the
/// greedy ones the CPU's.
#[test]
fn greedy_split_in_a_mixed_batch() {
    let Some(g) = gpu("greedy_split_in_a_mixed_batch") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("greedy_split_mixed");
    use kernels::SampleParams as P;
    let gr = P {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        u: 0.5,
        min_p: 0.0,
    };
    let params = [
        P {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            u: 0.37,
            min_p: 0.05,
        },
        gr,
        P {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            u: 0.42,
            min_p: 0.0,
        },
        P {
            temperature: 0.5,
            top_k: 1,
            top_p: 1.0,
            u: 0.9,
            min_p: 0.0,
        },
        gr,
        P {
            temperature: 1.0,
            top_k: 2000,
            top_p: 1.0,
            u: 0.12,
            min_p: 0.0,
        },
    ];
    let rows = params.len();
    let n = 154_880usize;
    let mut x: Vec<f32> = (0..rows * n).map(|_| r.sym(3.0)).collect();
    // A NaN in a sampled row and in a greedy row: both flagged.
    x[2 * n + 77] = f32::NAN;
    x[4 * n + 100_000] = f32::NAN;
    // Equal maxima across chunks of a greedy row.
    x[n + 1023] = 50.0;
    x[n + 1024] = 50.0;
    x[n + 150_000] = 50.0;
    let dx = g.upload(&x).unwrap();
    let mut outs = Vec::new();
    let mut all_ok = true;
    for split in [Split::Blocks, Split::OneBlock, Split::Auto] {
        let mut ids = g.upload(&vec![-7i32; rows]).unwrap();
        g.sample_split(&dx, rows, n, n, &params, &mut ids, split)
            .unwrap();
        let got = g.download(&ids).unwrap();
        for (i, p) in params.iter().enumerate() {
            let xr = &x[i * n..(i + 1) * n];
            let (id, bad) = kernels::sampled_id(got[i]);
            let want_bad = xr.iter().any(|v| !v.is_finite());
            let ok = got[i] >= 0
                && bad == want_bad
                && if p.is_greedy() {
                    (id as i32, bad) == greedy_cpu(xr)
                } else {
                    // sample_ok's f64 emulation has no NaN rule: judge that row by its
                    // flag and range only (the equality with OneBlock below covers it).
                    want_bad || sample_ok(xr, *p, id as usize)
                };
            row(
                "sample mixed",
                &format!("V {n} {split:?} row {i} {p:?}"),
                0.0,
                0.0,
                ok,
            );
            all_ok &= ok && (id as usize) < n;
        }
        outs.push(got);
    }
    let same = outs.windows(2).all(|w| w[0] == w[1]);
    row("sample mixed", "plans agree", 0.0, 0.0, same);
    assert!(all_ok && same, "mixed batch: {outs:?}");
}

/// The split top-k against the one-block kernel and the CPU selection, bit for bit (same set,
/// same order, -1 padding, counts): continuous scores with a causal -inf tail and NaN, heavy
/// duplicates straddling the threshold, ±0 and ±inf, n_valid < k, == k, k + 1, one value
/// everywhere.
#[test]
fn topk_split_over_blocks_equals_one_block_and_cpu() {
    let Some(g) = gpu("topk_split_over_blocks_equals_one_block_and_cpu") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("topk_split");
    let k = 2048usize;
    let mut all_ok = true;
    for (n, stride) in [
        (32_768usize, 32_768usize),
        (200_000, 200_003),
        (5_000, 5_000),
    ] {
        let mut rows_x: Vec<(&str, Vec<f32>)> = Vec::new();
        // Indexer-like scores (non-negative, clustered) with a causal -inf tail and NaN.
        let mut a: Vec<f32> = (0..n).map(|_| r.unit() * 3.0).collect();
        for v in &mut a[n - n / 7..] {
            *v = f32::NEG_INFINITY;
        }
        a[n / 5] = f32::NAN;
        rows_x.push(("scores, -inf tail, NaN", a));
        // Seven distinct values: thousands of ties at the threshold, across every chunk.
        let b: Vec<f32> = (0..n)
            .map(|i| {
                if i % 17 == 3 {
                    f32::NEG_INFINITY
                } else {
                    r.below(7) as f32 * 0.5 - 1.0
                }
            })
            .collect();
        rows_x.push(("7 distinct values", b));
        // Signed zeros, infinities and tiny / huge magnitudes (every digit of the keys).
        let c: Vec<f32> = (0..n)
            .map(|i| match i % 11 {
                0 => 0.0,
                1 => -0.0,
                2 => f32::INFINITY,
                3 => f32::NEG_INFINITY,
                4 => f32::MIN_POSITIVE * r.unit(),
                5 => -3.0e38 * r.unit(),
                6 => 3.0e38 * r.unit(),
                _ => r.sym(1.0),
            })
            .collect();
        rows_x.push(("±0, ±inf, extremes", c));
        // n_valid < k, == k, == k + 1 (valid entries scattered over the row).
        for valid in [k / 3, k, k + 1] {
            let mut v = vec![f32::NEG_INFINITY; n];
            let valid = valid.min(n);
            for j in 0..valid {
                let at = (j * n) / valid;
                v[at] = r.sym(2.0);
            }
            rows_x.push((
                match valid {
                    x if x < k => "n_valid < k",
                    x if x == k => "n_valid = k",
                    _ => "n_valid = k + 1",
                },
                v,
            ));
        }
        // One value everywhere: the first k.
        rows_x.push(("one value", vec![1.5f32; n]));
        let rows = rows_x.len();
        let mut x = vec![f32::NAN; rows * stride];
        for (i, (_, v)) in rows_x.iter().enumerate() {
            x[i * stride..i * stride + n].copy_from_slice(v);
        }
        let dx = g.upload(&x).unwrap();
        let want: Vec<Vec<i32>> = rows_x.iter().map(|(_, v)| topk_cpu(v, k)).collect();
        // Rows one at a time (decode) and all together (several rows in one grid).
        for (first, count) in [(0usize, rows)]
            .into_iter()
            .chain((0..rows).map(|i| (i, 1usize)))
        {
            let xs = dx.slice(first * stride..);
            let mut outs = Vec::new();
            for split in [Split::Blocks, Split::OneBlock, Split::Auto] {
                let mut dsel = g.upload(&vec![-7i32; count * k]).unwrap();
                let mut dcnt = g.upload(&vec![-7i32; count]).unwrap();
                let mut dcnt_v = dcnt.as_view_mut();
                g.topk_split(
                    &xs,
                    count,
                    n,
                    stride,
                    k,
                    &mut dsel,
                    Some(&mut dcnt_v),
                    split,
                )
                .unwrap();
                let sel = g.download(&dsel).unwrap();
                let cnt = g.download(&dcnt).unwrap();
                for j in 0..count {
                    let w = &want[first + j];
                    let got = &sel[j * k..(j + 1) * k];
                    let ok = got == w.as_slice()
                        && cnt[j] as usize == w.iter().filter(|v| **v >= 0).count();
                    if count == 1 || !ok {
                        row(
                            "topk split",
                            &format!(
                                "n {n} stride {stride} k {k} {split:?} {} ({} of {count} rows)",
                                rows_x[first + j].0,
                                j + 1
                            ),
                            0.0,
                            0.0,
                            ok,
                        );
                    }
                    all_ok &= ok;
                }
                outs.push((sel, cnt));
            }
            all_ok &= outs.windows(2).all(|w| w[0] == w[1]);
        }
    }
    assert!(
        all_ok,
        "split top-k differs from the one-block kernel or the CPU"
    );
}

/// The lane-per-key indexer scorer (bf16 keys) against the f64 oracle, the warp-per-key kernel
/// and, where it fits (<= 32 heads, width a multiple of 32), the tensor-core scorer on the same
/// inputs against the same oracle: every head count (one and two head groups), widths 64 / 72 /
/// 128, decode over 33,000 keys, and a causal prefill of 600 tokens (more tokens than the
/// grid's y extent, whole blocks past a token's position).
#[test]
fn indexer_lanes_kernel_matches_f64_and_the_warp_kernel() {
    let Some(g) = gpu("indexer_lanes_kernel_matches_f64_and_the_warp_kernel") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("indexer_lanes");
    let causal = |n: usize| (0..n as i32).collect::<Vec<i32>>();
    let cases: Vec<(usize, usize, usize, Vec<i32>)> = vec![
        (4, 64, 121, vec![120, 31, 10, 0]),
        (32, 128, 5000, vec![4999, 4096, 2048, 2047, 1000, 0]),
        (40, 128, 700, vec![699, 300]),
        (8, 72, 300, vec![299, 5, 256]),
        (32, 128, 33_000, vec![32_999]),
        (32, 128, 600, causal(600)),
    ];
    let mut all_ok = true;
    for (heads, dim, t_len, pos) in cases {
        let s_len = pos.len();
        let c = indexer_case(&mut r, heads, dim, dim, t_len, s_len);
        let dq = g.upload(&c.q).unwrap();
        let dk = g.upload(&c.kbits).unwrap();
        let dw = g.upload(&c.w).unwrap();
        let dpos = g.upload(&pos).unwrap();
        let sh = indexer_shape(&c, heads, dim, dim, t_len, s_len);
        let out_stride = sh.out_stride;
        // The tensor-core scorer where it fits (the default then: nothing forced).
        let tc_fits = kernels::indexer::tc_fit(&sh, 0);
        for kern in [Some(false), Some(true), None] {
            if kern.is_none() && !tc_fits {
                continue;
            }
            kernels::force_indexer_lanes(kern);
            let mut dsc = nan_buf(&g, s_len * out_stride);
            let res = g.indexer_scores(&dq, &dk, &dw, &dpos, &mut dsc, sh);
            kernels::force_indexer_lanes(None);
            res.unwrap();
            let sc = g.download(&dsc).unwrap();
            let (worst, layout_ok, scored) =
                indexer_check(&c, &sc, out_stride, heads, dim, t_len, &pos);
            if kern.is_none() {
                // Each score within the bound of its own roundings (`indexer_tc_worst`).
                let w = indexer_tc_worst(&c, &sc, out_stride, heads, dim, t_len, &pos);
                let ok = layout_ok && scored > 0 && w <= 1.0;
                row(
                    "indexer_scores tensor cores",
                    &format!("{heads}x{dim}, T {t_len}, S {s_len}"),
                    w,
                    1.0,
                    ok,
                );
                all_ok &= ok;
                continue;
            }
            let lanes = kern == Some(true);
            // Rounding depth per head: the warp kernel dim/32 products per lane + a 5-level
            // tree; the lane kernel an 8-term FMA chain per 8-dim chunk + dim/8 chunk sums.
            // Then H weighted terms in order and the scale and weight products (+3): for the
            // warp kernel exactly the bound of `indexer_scores_and_topk`, normwise, x4 margin.
            let depth = if lanes {
                dim as f64 / 8.0 + 8.0
            } else {
                dim as f64 / 32.0 + 5.0
            };
            let tol = (depth + heads as f64 + 3.0) * U32 * 4.0;
            let ok = layout_ok && scored > 0 && worst <= tol;
            row(
                if lanes {
                    "indexer_scores lanes"
                } else {
                    "indexer_scores warp"
                },
                &format!("{heads}x{dim}, T {t_len}, S {s_len}"),
                worst,
                tol,
                ok,
            );
            all_ok &= ok;
        }
    }
    assert!(all_ok, "indexer scores differ from the f64 oracle");
}

// ---------------------------------------------------------------------------------------------
// mmq: the int8 tensor-core matrix product for 8..64 columns (kernels/cuda/mmq.cu). Every output
// buffer is checked element by element with the oracle the CPU emulator's tests use
// (common/oracle.rs `mmq_verify`: products within gemvq's f32 bound of the f64 product with the
// quantized activations and within the q8 rounding of the one with the f32 activations, NaN for
// bad expert ids, every other element untouched).

use kernels::{mmq_ks_allowed, mmq_supported};

const MMQ_TYPES: [GgmlType; 4] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
];

/// `slabs` matrices of `rows x k` of `ty` on the device (repacked where the type is) and
/// dequantized on the host.
fn mmq_weights(
    g: &Gpu,
    ty: GgmlType,
    slabs: usize,
    rows: usize,
    k: usize,
    r: &mut Rng,
) -> (kernels::CudaSlice<u8>, Vec<f32>, MatShape) {
    let (shape, dw, deq) = device_matrix(g, r, ty, slabs, rows, k);
    assert!(mmq_supported(&shape), "{shape:?}");
    (dw, deq, shape)
}

/// The instruction's fragment layout, the one mmq.cu's shuffle version (the CPU emulator's
/// mma) and the kernels assume: both equal a CPU product exactly (integer sums).
#[test]
fn mma_s8_selftest_matches_cpu() {
    let Some(g) = gpu("mma_s8_selftest_matches_cpu") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mma_s8_selftest");
    for trial in 0..8 {
        // Trial 0: the extremes (-128 * -128 products); then random codes.
        let (a, b): (Vec<i8>, Vec<i8>) = if trial == 0 {
            (
                vec![-128; 512],
                (0..256)
                    .map(|i| if i % 3 == 0 { 127 } else { -128 })
                    .collect(),
            )
        } else {
            (
                (0..512).map(|_| r.byte() as i8).collect(),
                (0..256).map(|_| r.byte() as i8).collect(),
            )
        };
        // Distinct C entries show any permutation of the outputs.
        let c: Vec<i32> = (0..128).map(|i| i * 1000 - 7 * trial).collect();
        let (hw, shfl) = g.mma_s8_selftest(&a, &b, &c).unwrap();
        let want = mma_s8_cpu(&a, &b, &c);
        let ok = hw == want && shfl == want;
        row(
            "mma m16n8k32 s8",
            &format!(
                "trial {trial}: instruction {}, shuffles {}",
                hw == want,
                shfl == want
            ),
            0.0,
            0.0,
            ok,
        );
        assert!(
            ok,
            "trial {trial}: the fragment layout differs from the CPU product"
        );
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum MmqTestMode {
    Plain,
    Accumulate,
    Glu,
}

/// A dense launch of `tokens` activation rows through the `nc`-column kernel (k-split `ks`
/// forced, or the plan's), every output checked with `mmq_verify`, then:
/// - Plain / GLU: against `gemv_q` of the same q8 activations (8-column channels). Both sum the
///   same exact integer block sums; only the f32 scaling and the order of the sums over blocks
///   differ, and each lies within the oracle's f32 bound (A) of the exact product, so they
///   differ by at most twice that bound.
/// - Plain: a second launch is bitwise the first (fixed summation order, no atomics).
/// - Accumulate: bitwise the plain output (same plan, same sums) plus the old value in one f32
///   addition.
///
/// Returns (all checks passed, worst oracle error over its bound).
fn mmq_dense_check(
    g: &Gpu,
    r: &mut Rng,
    ty: GgmlType,
    rows: usize,
    k: usize,
    nc: usize,
    tokens: usize,
    mode: MmqTestMode,
    (ks, kz): (Option<usize>, Option<usize>),
) -> Option<(bool, f64)> {
    let (dw, wq, shape) = mmq_weights(g, ty, 1, rows, k, r);
    if ks.is_some_and(|ks| !g.mmq_fits_ks(&shape, nc, mode == MmqTestMode::Glu, ks)) {
        return None;
    }
    let (dw2, wq2, _) = mmq_weights(g, ty, 1, rows, k, r);
    let x = activations(r, tokens, k);
    let dx = g.upload(&x).unwrap();
    let q = g.quantize_q8(&dx, tokens, k, k).unwrap();
    let (qc, qd, _) = q.to_host(g).unwrap();
    let ny = tokens * rows + 3;
    let y0: Vec<f32> = match mode {
        MmqTestMode::Accumulate => r.vec(ny, 2.0),
        _ => vec![f32::NAN; ny],
    };
    let ch = QChannels {
        count: 1,
        ncols: nc,
        ids: None,
        xidx: None,
        x_div: 1,
        yidx: None,
        y_stride: rows,
        y_rows: tokens,
    };
    // QMode<CudaSlice> is not Copy: one per launch.
    let qmode = || match mode {
        MmqTestMode::Plain => QMode::Plain,
        MmqTestMode::Accumulate => QMode::Accumulate,
        MmqTestMode::Glu => QMode::Glu(&dw2),
    };
    g.force_mmq_ksplit(ks).unwrap();
    let prev_kz = g.mmq_slices();
    g.force_mmq_slices(kz).unwrap();
    let launch = |y0: &[f32]| {
        let mut dy = g.upload(y0).unwrap();
        g.mmq(shape, &dw, qmode(), ch, &q, &mut dy).unwrap();
        g.download(&dy).unwrap()
    };
    let y = launch(&y0);
    let case = MmqCase {
        rows,
        k,
        slabs: 1,
        count: 1,
        ncols: nc,
        ids: None,
        xidx: None,
        x_div: 1,
        yidx: None,
        y_stride: rows,
        y_rows: tokens,
    };
    let om = match mode {
        MmqTestMode::Plain => MmqMode::Plain,
        MmqTestMode::Accumulate => MmqMode::Accumulate,
        MmqTestMode::Glu => MmqMode::Glu(&wq2),
    };
    let c = mmq_verify(&case, &wq, &om, &x, tokens, &qc, &qd, &y0, &y);
    let mut ok = c.ok && c.written == tokens * rows && c.untouched == 3;
    if let Some(m) = &c.first_bad {
        say(&format!(
            "mmq {ty} {rows}x{k} x{tokens}/{nc} {mode:?} {ks:?} {kz:?}: {m}"
        ));
    }
    match mode {
        MmqTestMode::Plain | MmqTestMode::Glu => {
            let mut dg = nan_buf(g, ny);
            let gch = QChannels {
                count: tokens.div_ceil(8),
                ncols: 8,
                ..ch
            };
            let gmode = if mode == MmqTestMode::Glu {
                QMode::Glu(&dw2)
            } else {
                QMode::Plain
            };
            g.gemv_q(shape, &dw, gmode, gch, &q, &mut dg).unwrap();
            let yg = g.download(&dg).unwrap();
            let mut pair_ok = true;
            for t in 0..tokens {
                for rr in 0..rows {
                    let (ya, _, tol_a, _) = mmq_dot(&wq, rr, k, &x, &qc, &qd, t);
                    let tol = if mode == MmqTestMode::Glu {
                        let (ua, _, tol_u, _) = mmq_dot(&wq2, rr, k, &x, &qc, &qd, t);
                        mmq_glu_want(ya, tol_a, ua, tol_u).1
                    } else {
                        tol_a
                    };
                    let (a, b) = (y[t * rows + rr], yg[t * rows + rr]);
                    pair_ok &= (f64::from(a) - f64::from(b)).abs() <= 2.0 * tol;
                }
            }
            if !pair_ok {
                say(&format!(
                    "mmq {ty} {rows}x{k} x{tokens} {mode:?}: differs from gemv_q"
                ));
            }
            ok &= pair_ok;
            if mode == MmqTestMode::Plain {
                let again = launch(&y0);
                let same = again
                    .iter()
                    .zip(&y)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    say(&format!(
                        "mmq {ty} {rows}x{k} x{tokens}: two launches differ"
                    ));
                }
                ok &= same;
            }
        }
        MmqTestMode::Accumulate => {
            let plain = {
                let mut dy = nan_buf(g, ny);
                g.mmq(shape, &dw, QMode::Plain, ch, &q, &mut dy).unwrap();
                g.download(&dy).unwrap()
            };
            let n = tokens * rows;
            let same = (0..n).all(|i| y[i].to_bits() == (y0[i] + plain[i]).to_bits());
            if !same {
                say(&format!(
                    "mmq {ty} {rows}x{k} x{tokens}: accumulate is not plain + add"
                ));
            }
            ok &= same;
        }
    }
    g.force_mmq_ksplit(None).unwrap();
    g.force_mmq_slices(prev_kz).unwrap();
    Some((ok, c.worst))
}

/// Dense launches (one channel, `ncols` >= the tokens): every type, width (with partial last
/// column groups), mode and allowed k-split on 300 x 1,024 (the last row tile partial), forced
/// k-slices (3 of 8 windows: uneven; and 2 with ks 2), and GLM-5 shapes with the plan's own
/// choice (k-slices): q_a / shared-expert gate-up 2,048 x 6,144 at 16 tokens, the MoE down
/// shape 6,144 x 2,048 at 40 of 64 columns.
#[test]
fn mmq_dense_every_type_width_mode_and_split() {
    let Some(g) = gpu("mmq_dense_every_type_width_mode_and_split") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mmq_dense");
    let mut bad = Vec::new();
    let mut n = 0usize;
    let mut unfit = 0usize;
    for ty in MMQ_TYPES {
        type Split = (Option<usize>, Option<usize>);
        let mut cases: Vec<(usize, usize, usize, usize, Split)> = Vec::new();
        for (nc, tokens) in [
            (8, 5),
            (8, 8),
            (16, 9),
            (16, 16),
            (32, 20),
            (32, 32),
            (64, 33),
            (64, 64),
        ] {
            for ks in [1, 2, 4, 8] {
                if mmq_ks_allowed(ks, 1024) {
                    cases.push((300, 1024, nc, tokens, (Some(ks), None)));
                }
            }
            cases.push((300, 1024, nc, tokens, (Some(1), Some(3))));
            cases.push((300, 1024, nc, tokens, (Some(2), Some(2))));
            cases.push((300, 1024, nc, tokens, (None, None)));
        }
        cases.push((2048, 6144, 16, 16, (None, None)));
        cases.push((6144, 2048, 64, 40, (None, None)));
        for (rows, k, nc, tokens, ks) in cases {
            for mode in [
                MmqTestMode::Plain,
                MmqTestMode::Accumulate,
                MmqTestMode::Glu,
            ] {
                // A forced split whose ring exceeds the device's shared memory has no launch
                // (the plan never picks it): counted, not run.
                let Some((ok, worst)) =
                    mmq_dense_check(&g, &mut r, ty, rows, k, nc, tokens, mode, ks)
                else {
                    unfit += 1;
                    continue;
                };
                row(
                    &format!("mmq {ty} {mode:?}"),
                    &format!("{rows}x{k} x{tokens} ({nc} columns) split {ks:?}"),
                    worst,
                    1.0,
                    ok,
                );
                n += 1;
                if !ok {
                    bad.push(format!(
                        "{ty} {rows}x{k} x{tokens}/{nc} {mode:?} split {ks:?}"
                    ));
                }
            }
        }
    }
    say(&format!(
        "mmq_dense: {n} cases run, {unfit} forced splits beyond the shared memory"
    ));
    assert!(n > 0);
    assert!(bad.is_empty(), "mmq failed: {bad:?}");
}

/// The grouped MoE launches as the runtime makes them, on `moe_group`'s device maps: gate, up
/// and SiLU from token rows into sorted rows, the down projection from sorted rows into pair rows
/// (unused tiles id -1, unused columns -1, empty slots); 8-column tiles only and with the wide
/// set of 64 columns (experts of more than 8 pairs), each set's launch on its own, every type,
/// the plan's split and a forced 1 and 2; against the oracle and, at 8 columns, against `gemv_q`
/// with the same channels (twice the f32 bound, as in the dense test). Together a grouping's
/// sets must write every live pair's rows.
#[test]
fn mmq_grouped_moe_tiles_match_f64_and_gemvq() {
    let Some(g) = gpu("mmq_grouped_moe_tiles_match_f64_and_gemvq") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mmq_grouped");
    let (ne, ff, d, tokens, top_k) = (8usize, 512usize, 1024usize, 24usize, 4usize);
    // Skewed routing: expert 0 takes a slot of every token (21 pairs: 3 narrow tiles or one
    // wide), experts 1 and 4 10 pairs each (wide), 2, 3, 6, 7 at most 8 (narrow), 5 none; every
    // seventh slot empty, and the last slot of two tokens in three.
    let ids: Vec<i32> = (0..tokens * top_k)
        .map(|p| match (p % top_k, p % 7, p / top_k) {
            (_, 6, _) => -1,
            (0, _, _) => 0,
            (3, _, t) if t % 3 != 0 => -1,
            (s, _, t) => [1, 2, 3, 4, 6, 7][(t + s) % 6],
        })
        .collect();
    let live = ids.iter().filter(|&&e| e >= 0).count();
    let dids = g.upload(&ids).unwrap();
    let mut bad = Vec::new();
    for wide in [None, Some(64)] {
        let groups = g.moe_group(&dids, tokens * top_k, top_k, ne, wide).unwrap();
        let want = group_on_host(&ids, top_k, ne, MOE_TILE, wide);
        assert_eq!(groups.sets.len(), want.len());
        let mut live_in_sets = 0;
        for (grp, w) in groups.sets.iter().zip(&want) {
            let tw = grp.width;
            let te = g.download(&grp.tile_expert.view()).unwrap();
            let (tok, pos, pair) = (
                g.download(&grp.tok.view()).unwrap(),
                g.download(&grp.pos.view()).unwrap(),
                g.download(&grp.pair.view()).unwrap(),
            );
            assert!(te.contains(&-1), "unused tiles");
            assert!(te == w.tile_expert && tok == w.tok && pos == w.pos && pair == w.pair);
            let set_live = tok.iter().filter(|&&t| t >= 0).count();
            assert!(set_live > 0, "every set of this routing holds pairs");
            live_in_sets += set_live;
            let (tev, tokv, posv, pairv) = (
                grp.tile_expert.view(),
                grp.tok.view(),
                grp.pos.view(),
                grp.pair.view(),
            );
            for ty in MMQ_TYPES {
                let (dg, gq, gs) = mmq_weights(&g, ty, ne, ff, d, &mut r);
                let (du, uq, _) = mmq_weights(&g, ty, ne, ff, d, &mut r);
                let (dd, dq, ds) = mmq_weights(&g, ty, ne, d, ff, &mut r);
                let x = activations(&mut r, tokens, d);
                let dx = g.upload(&x).unwrap();
                let q = g.quantize_q8(&dx, tokens, d, d).unwrap();
                let (qc, qd, _) = q.to_host(&g).unwrap();
                for ks in [None, Some(1), Some(2)] {
                    // A forced split whose GLU ring exceeds the shared memory has no launch
                    // (Q8_0 at 64 columns and ks = 2): said, not run.
                    if ks.is_some_and(|k| !g.mmq_fits_ks(&gs, tw, true, k)) {
                        say(&format!(
                            "mmq grouped {ty} tile {tw} split {ks:?}: does not fit"
                        ));
                        continue;
                    }
                    g.force_mmq_ksplit(ks).unwrap();
                    // gate + up + SiLU.
                    let ch = QChannels {
                        count: grp.max_tiles,
                        ncols: tw,
                        ids: Some(&tev),
                        xidx: Some(&tokv),
                        x_div: 1,
                        yidx: Some(&posv),
                        y_stride: ff,
                        y_rows: live,
                    };
                    let ny = live * ff + 3;
                    let mut act = nan_buf(&g, ny);
                    g.mmq(gs, &dg, QMode::Glu(&du), ch, &q, &mut act).unwrap();
                    let act_h = g.download(&act).unwrap();
                    // The GEMVs take at most 8 columns: compared at the 8-column width only.
                    let gemv = tw == MOE_TILE;
                    let mut actg = nan_buf(&g, ny);
                    if gemv {
                        g.gemv_q(gs, &dg, QMode::Glu(&du), ch, &q, &mut actg)
                            .unwrap();
                    }
                    let actg_h = g.download(&actg).unwrap();
                    let case = MmqCase {
                        rows: ff,
                        k: d,
                        slabs: ne,
                        count: grp.max_tiles,
                        ncols: tw,
                        ids: Some(&te),
                        xidx: Some(&tok),
                        x_div: 1,
                        yidx: Some(&pos),
                        y_stride: ff,
                        y_rows: live,
                    };
                    let nanv = vec![f32::NAN; ny];
                    let c = mmq_verify(
                        &case,
                        &gq,
                        &MmqMode::Glu(&uq),
                        &x,
                        tokens,
                        &qc,
                        &qd,
                        &nanv,
                        &act_h,
                    );
                    let mut ok = c.ok && c.written == set_live * ff;
                    // Against gemv_q's grouped GLU, output by output (sorted row p = pos of the pair).
                    for (i, &e) in te.iter().enumerate().filter(|_| gemv) {
                        for j in 0..tw {
                            let (t, p) = (tok[i * tw + j], pos[i * tw + j]);
                            if e < 0 || t < 0 {
                                continue;
                            }
                            for rr in 0..ff {
                                let wr = e as usize * ff + rr;
                                let (ya, _, ta, _) = mmq_dot(&gq, wr, d, &x, &qc, &qd, t as usize);
                                let (ua, _, tu, _) = mmq_dot(&uq, wr, d, &x, &qc, &qd, t as usize);
                                let tol = mmq_glu_want(ya, ta, ua, tu).1;
                                let at = p as usize * ff + rr;
                                ok &= (f64::from(act_h[at]) - f64::from(actg_h[at])).abs()
                                    <= 2.0 * tol;
                            }
                        }
                    }
                    row(
                        &format!("mmq grouped glu {ty}"),
                        &format!("{ne} experts {ff}x{d}, {set_live} of {live} pairs, tile {tw}, split {ks:?}"),
                        c.worst,
                        1.0,
                        ok,
                    );
                    if !ok {
                        bad.push(format!("glu {ty} tile {tw} {ks:?}: {:?}", c.first_bad));
                    }
                    // Down: sorted rows -> pair rows; the empty slots' rows stay NaN. Its input: the
                    // GLU's rows of this set (the other set's rows, NaN here, as zeros: not read).
                    let actx: Vec<f32> = act_h[..live * ff]
                        .iter()
                        .map(|&v| if v.is_nan() { 0.0 } else { v })
                        .collect();
                    let act_q = g
                        .quantize_q8(&g.upload(&actx).unwrap(), live, ff, ff)
                        .unwrap();
                    let (aq, ad, _) = act_q.to_host(&g).unwrap();
                    let ch = QChannels {
                        count: grp.max_tiles,
                        ncols: tw,
                        ids: Some(&tev),
                        xidx: Some(&posv),
                        x_div: 1,
                        yidx: Some(&pairv),
                        y_stride: d,
                        y_rows: tokens * top_k,
                    };
                    let ny = tokens * top_k * d + 3;
                    let mut yd = nan_buf(&g, ny);
                    g.mmq(ds, &dd, QMode::Plain, ch, &act_q, &mut yd).unwrap();
                    let yd_h = g.download(&yd).unwrap();
                    let mut ydg = nan_buf(&g, ny);
                    if gemv {
                        g.gemv_q(ds, &dd, QMode::Plain, ch, &act_q, &mut ydg)
                            .unwrap();
                    }
                    let ydg_h = g.download(&ydg).unwrap();
                    let case = MmqCase {
                        rows: d,
                        k: ff,
                        slabs: ne,
                        count: grp.max_tiles,
                        ncols: tw,
                        ids: Some(&te),
                        xidx: Some(&pos),
                        x_div: 1,
                        yidx: Some(&pair),
                        y_stride: d,
                        y_rows: tokens * top_k,
                    };
                    let nanv = vec![f32::NAN; ny];
                    let c = mmq_verify(
                        &case,
                        &dq,
                        &MmqMode::Plain,
                        &actx,
                        live,
                        &aq,
                        &ad,
                        &nanv,
                        &yd_h,
                    );
                    let others = tokens * top_k - set_live;
                    let mut ok = c.ok && c.written == set_live * d && c.untouched == others * d + 3;
                    for (i, &e) in te.iter().enumerate().filter(|_| gemv) {
                        for j in 0..tw {
                            let (p, pr) = (pos[i * tw + j], pair[i * tw + j]);
                            if e < 0 || p < 0 {
                                continue;
                            }
                            for rr in 0..d {
                                let wr = e as usize * d + rr;
                                let tol = mmq_dot(&dq, wr, ff, &actx, &aq, &ad, p as usize).2;
                                let at = pr as usize * d + rr;
                                ok &=
                                    (f64::from(yd_h[at]) - f64::from(ydg_h[at])).abs() <= 2.0 * tol;
                            }
                        }
                    }
                    row(
                        &format!("mmq grouped down {ty}"),
                        &format!("{ne} experts {d}x{ff}, {set_live} of {live} pairs, tile {tw}, split {ks:?}"),
                        c.worst,
                        1.0,
                        ok,
                    );
                    if !ok {
                        bad.push(format!("down {ty} tile {tw} {ks:?}: {:?}", c.first_bad));
                    }
                }
                g.force_mmq_ksplit(None).unwrap();
            }
        }
        assert_eq!(live_in_sets, live, "the sets hold every live pair once");
    }
    assert!(bad.is_empty(), "grouped mmq failed: {bad:?}");
}

/// Channels without maps (slab ch % slabs, input rows (ch / x_div) * ncols + j, a partial last
/// row group), output rows `y_stride` > rows apart (the gaps untouched), a bad expert id (NaN),
/// an unused one (-1: nothing written), a channel whose columns all lack an output row, dead
/// input and output rows, and the wrapper's refusals.
#[test]
fn mmq_channel_maps_bad_ids_and_refusals() {
    let Some(g) = gpu("mmq_channel_maps_bad_ids_and_refusals") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mmq_channels");
    let mut bad = Vec::new();
    for ty in MMQ_TYPES {
        let (rows, k, slabs) = (40usize, 512usize, 3usize);
        let (dw, wq, shape) = mmq_weights(&g, ty, slabs, rows, k, &mut r);
        let (dw2, wq2, _) = mmq_weights(&g, ty, slabs, rows, k, &mut r);
        let x = activations(&mut r, 19, k);
        let q = g.quantize_q8(&g.upload(&x).unwrap(), 19, k, k).unwrap();
        let (qc, qd, _) = q.to_host(&g).unwrap();
        let (y_stride, y_rows) = (rows + 5, 38usize);
        let ch = QChannels {
            count: 5,
            ncols: 8,
            ids: None,
            xidx: None,
            x_div: 2,
            yidx: None,
            y_stride,
            y_rows,
        };
        let ny = (y_rows - 1) * y_stride + rows + 3;
        for glu in [false, true] {
            let mut dy = nan_buf(&g, ny);
            let mode = if glu { QMode::Glu(&dw2) } else { QMode::Plain };
            g.mmq(shape, &dw, mode, ch, &q, &mut dy).unwrap();
            let y = g.download(&dy).unwrap();
            let case = MmqCase {
                rows,
                k,
                slabs,
                count: 5,
                ncols: 8,
                ids: None,
                xidx: None,
                x_div: 2,
                yidx: None,
                y_stride,
                y_rows,
            };
            let om = if glu {
                MmqMode::Glu(&wq2)
            } else {
                MmqMode::Plain
            };
            let c = mmq_verify(&case, &wq, &om, &x, 19, &qc, &qd, &vec![f32::NAN; ny], &y);
            // Channels 0-3 read rows 0..16 (8 live columns each), channel 4 rows 16..19.
            let ok = c.ok && c.written == 35 * rows && c.untouched > 0;
            row(
                &format!("mmq maps {ty}"),
                &format!("no maps, glu {glu}"),
                c.worst,
                1.0,
                ok,
            );
            if !ok {
                bad.push(format!("{ty} no maps glu {glu}: {:?}", c.first_bad));
            }
        }
        // Ids: a valid expert, a bad one (NaN), -1 (nothing), one with every y row -1.
        let ids = vec![2, 7, -1, 1];
        let xidx: Vec<i32> = (0..32)
            .map(|i| if i % 8 == 6 { -1 } else { i % 11 })
            .collect();
        let mut yidx: Vec<i32> = (0..32).map(|i| 31 - i).collect();
        yidx[24..32].fill(-1);
        yidx[3] = 40; // past y_rows
        let (di, dxi, dyi) = (
            g.upload(&ids).unwrap(),
            g.upload(&xidx).unwrap(),
            g.upload(&yidx).unwrap(),
        );
        let (div, dxv, dyv) = (di.as_view(), dxi.as_view(), dyi.as_view());
        let ch = QChannels {
            count: 4,
            ncols: 8,
            ids: Some(&div),
            xidx: Some(&dxv),
            x_div: 1,
            yidx: Some(&dyv),
            y_stride: rows,
            y_rows: 32,
        };
        let ny = 32 * rows + 3;
        let y0 = r.vec(ny, 2.0);
        let mut dy = g.upload(&y0).unwrap();
        g.mmq(shape, &dw, QMode::Accumulate, ch, &q, &mut dy)
            .unwrap();
        let y = g.download(&dy).unwrap();
        let case = MmqCase {
            rows,
            k,
            slabs,
            count: 4,
            ncols: 8,
            ids: Some(&ids),
            xidx: Some(&xidx),
            x_div: 1,
            yidx: Some(&yidx),
            y_stride: rows,
            y_rows: 32,
        };
        let c = mmq_verify(&case, &wq, &MmqMode::Accumulate, &x, 19, &qc, &qd, &y0, &y);
        let ok = c.ok && c.written == 6 * rows && c.nan == 7 * rows;
        row(
            &format!("mmq ids {ty}"),
            "bad, -1, dead columns",
            c.worst,
            1.0,
            ok,
        );
        if !ok {
            bad.push(format!("{ty} ids: {:?}", c.first_bad));
        }
        // Refusals before any launch: a width without a kernel, combine, K of the wrong type.
        let mut dy = nan_buf(&g, ny);
        let ch5 = QChannels::dense(5, rows);
        assert!(g.mmq(shape, &dw, QMode::Plain, ch5, &q, &mut dy).is_err());
        let w = g.upload(&[1f32]).unwrap();
        let wv = w.as_view();
        let comb = QMode::Combine {
            weights: &wv,
            topk: 1,
        };
        let ch8 = QChannels::dense(8, rows);
        assert!(g.mmq(shape, &dw, comb, ch8, &q, &mut dy).is_err());
        let q2 = g
            .quantize_q8(&g.upload(&x[..8 * 256]).unwrap(), 8, 256, 256)
            .unwrap();
        assert!(g.mmq(shape, &dw, QMode::Plain, ch8, &q2, &mut dy).is_err());
    }
    assert!(bad.is_empty(), "mmq channels: {bad:?}");
}

/// The absorbed MLA queries' fused q8a quantization + RoPE (`rope_q8_to`, one launch) against
/// the two it replaces (`quantize_q8` of the 192 nope columns of every 256-wide head, `rope_to`
/// of its 64 rope columns into the 576-wide absorbed rows at 512), bitwise: codes, scales (NaN
/// for the blocks holding the planted NaN and -inf), sums, every element of the NaN-poisoned
/// output, the input unchanged; GLM-5 shapes (64 heads), 1, 3 and 8 tokens, every style. Then
/// the shapes it refuses.
#[test]
fn rope_q8_equals_quantize_q8_and_rope_to() {
    let Some(g) = gpu("rope_q8_equals_quantize_q8_and_rope_to") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("rope_q8");
    let (heads, nope, n_rot, lat) = (64usize, 192usize, 64usize, 512usize);
    let (xh, yh) = (nope + n_rot, lat + n_rot);
    let inv = kernels::rope_inv_freq(1e6, n_rot);
    let dinv = g.upload(&inv).unwrap();
    for pos in [vec![4095i32], vec![0, 1000, 131071], (0..8).collect()] {
        let tokens = pos.len();
        let mut x = r.vec(tokens * heads * xh, 1.0);
        for (g_, grp) in x.chunks_mut(xh).enumerate() {
            // Block-to-block magnitudes as real activations have (activations()).
            for (b, blk) in grp[..nope].chunks_mut(32).enumerate() {
                let sc = [8.0, 1.0, 0.01, 1.0, 0.0, 1.0][(g_ + b) % 6];
                blk.iter_mut().for_each(|v| *v *= sc);
            }
        }
        x[2 * 32 + 7] = f32::NAN;
        x[(tokens * heads - 1) * xh + 5 * 32 + 30] = f32::NEG_INFINITY;
        let (dx, dpos) = (g.upload(&x).unwrap(), g.upload(&pos).unwrap());
        let lay = |head: usize, off: usize| RopeLayout {
            tokens,
            heads,
            tok_stride: heads * head,
            head_stride: head,
            offset: off,
            n_rot,
        };
        for style in [
            RopeStyle::Interleaved,
            RopeStyle::InterleavedHf,
            RopeStyle::Neox,
        ] {
            let sep = g.quantize_q8(&dx, tokens * heads, nope, xh).unwrap();
            let mut dy = nan_buf(&g, tokens * heads * yh);
            g.rope_to(
                &dx,
                lay(xh, nope),
                &mut dy,
                lay(yh, lat),
                &dpos,
                &dinv,
                style,
            )
            .unwrap();
            let mut dy2 = nan_buf(&g, tokens * heads * yh);
            let fused = g
                .rope_q8_to(
                    &dx,
                    lay(xh, nope),
                    nope,
                    &mut dy2,
                    lay(yh, lat),
                    &dpos,
                    &dinv,
                    style,
                )
                .unwrap();
            let ((fq, fd, fs), (sq, sd, ss)) =
                (fused.to_host(&g).unwrap(), sep.to_host(&g).unwrap());
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let (y, y2) = (g.download(&dy).unwrap(), g.download(&dy2).unwrap());
            let nan_d = fd.iter().filter(|d| d.is_nan()).count();
            let ok = (fused.rows, fused.k) == (tokens * heads, nope)
                && fq == sq
                && bits(&fd) == bits(&sd)
                && fs == ss
                && nan_d == 2
                && bits(&y) == bits(&y2)
                && g.download(&dx)
                    .unwrap()
                    .iter()
                    .zip(&x)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            row(
                &format!("rope_q8_to {style:?}"),
                &format!("{tokens} tok x {heads} heads, q8 {nope} of {xh}, rope -> {yh}@{lat}"),
                0.0,
                0.0,
                ok,
            );
            assert!(
                ok,
                "rope_q8_to {tokens} tokens {style:?} differs from quantize_q8 + rope_to"
            );
        }
    }
    // Refused: nope not a multiple of 32, zero, or past the rope offset; layouts that differ;
    // too short a buffer.
    let (tokens, pos) = (2usize, vec![0i32, 1]);
    let dpos = g.upload(&pos).unwrap();
    let lay = |head: usize, off: usize| RopeLayout {
        tokens,
        heads,
        tok_stride: heads * head,
        head_stride: head,
        offset: off,
        n_rot,
    };
    let dx = nan_buf(&g, tokens * heads * xh);
    let mut dy = nan_buf(&g, tokens * heads * yh);
    let st = RopeStyle::Interleaved;
    for bad_nope in [0usize, 48, 224] {
        assert!(g
            .rope_q8_to(
                &dx,
                lay(xh, nope),
                bad_nope,
                &mut dy,
                lay(yh, lat),
                &dpos,
                &dinv,
                st
            )
            .is_err());
    }
    let mut other = lay(yh, lat);
    other.heads = heads - 1;
    assert!(g
        .rope_q8_to(&dx, lay(xh, nope), nope, &mut dy, other, &dpos, &dinv, st)
        .is_err());
    let short = nan_buf(&g, tokens * heads * xh - 1);
    assert!(g
        .rope_q8_to(
            &short,
            lay(xh, nope),
            nope,
            &mut dy,
            lay(yh, lat),
            &dpos,
            &dinv,
            st
        )
        .is_err());
}

/// `Gpu::mla_attention_q8` / `mla_attention_seqs_q8` (o's q8 activations from the split
/// combine's epilogue, or from one quantize launch after a kernel that wrote o directly) against
/// `mla_attention` / `mla_attention_seqs` followed by `quantize_q8(o, tokens * heads, 512, 512)`,
/// bitwise: the f32 output, codes, scales and sums. GLM-5 shapes (64 heads, keys 576, values
/// 512) over a bf16 cache: a short decode (20 keys: one split, written directly by the decode
/// and tensor-core kernels), longer ones (700 keys: decode-kernel splits; 2,047 dense and 2,048
/// listed keys: tensor-core splits), a 3-token step, each by shape and forced through the tile,
/// decode and tensor-core kernels; then a batched step of sequences, and the refusal of a
/// non-dense output.
#[test]
fn mla_attention_q8_equals_mla_attention_then_quantize() {
    let Some(g) = gpu("mla_attention_q8_equals_mla_attention_then_quantize") else {
        return;
    };
    let _s = serial();
    let mut r = Rng::new("mla_q8");
    let (heads, d, dv) = (64usize, 576usize, 512usize);
    let bf16 = |c: &[f32]| -> Vec<u16> {
        c.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    };
    let shape = |tokens: usize, t_len: usize| MlaShape {
        tokens,
        heads,
        d,
        d_v: dv,
        q_tok_stride: heads * d,
        q_head_stride: d,
        kv_stride: d,
        kv_len: t_len,
        o_tok_stride: heads * dv,
        o_head_stride: dv,
        scale: 1.0 / 16.0,
        pos0: t_len - tokens,
    };
    // (decode kernel, tensor-core kernel) switches: by shape, tile, decode, tensor-core.
    let choices: [(&str, Option<bool>, Option<bool>); 4] = [
        ("by shape", None, None),
        ("tile kernel", Some(false), Some(false)),
        ("decode kernel", Some(true), Some(false)),
        ("tensor-core kernel", None, Some(true)),
    ];
    let mut bad = Vec::new();
    for (t_len, s_n, sparse) in [
        (20usize, 1usize, false),
        (700, 1, false),
        (2047, 1, false),
        (2048, 1, true),
        (65, 3, false),
    ] {
        let dc = g.upload(&bf16(&r.vec(t_len * d, 1.0))).unwrap();
        let dq = g.upload(&r.vec(s_n * heads * d, 1.0)).unwrap();
        let n_keys = 300.min(t_len + 2);
        let lists = mla_key_lists(&mut r, s_n, n_keys, t_len - s_n);
        let didx = g
            .upload(&lists.iter().flatten().copied().collect::<Vec<i32>>())
            .unwrap();
        let iv = didx.as_view();
        let keys = sparse.then_some(KeyLists {
            idx: &iv,
            n_keys,
            stride: n_keys,
        });
        let m = shape(s_n, t_len);
        for (kname, dec, tc) in choices {
            kernels::force_mla_decode(dec);
            kernels::force_mla_tc(tc);
            let mut o = nan_buf(&g, s_n * heads * dv);
            g.mla_attention(&dq, &dc, keys, &mut o, m).unwrap();
            let want = g.quantize_q8(&o, s_n * heads, dv, dv).unwrap();
            let mut o8 = nan_buf(&g, s_n * heads * dv);
            let got = g.mla_attention_q8(&dq, &dc, keys, &mut o8, m);
            kernels::force_mla_decode(None);
            kernels::force_mla_tc(None);
            let got = got.unwrap();
            let (of, o8f) = (g.download(&o).unwrap(), g.download(&o8).unwrap());
            let same_o = of.len() == o8f.len()
                && of.iter().zip(&o8f).all(|(a, b)| a.to_bits() == b.to_bits());
            let same_q8 = (got.rows, got.k) == (s_n * heads, dv)
                && got.to_host(&g).unwrap() == want.to_host(&g).unwrap();
            let finite = o8f.iter().all(|v| v.is_finite());
            let ok = same_o && same_q8 && finite;
            row(
                &format!("mla q8, {kname}"),
                &format!(
                    "64 heads, T {t_len}, {s_n} queries{}, bf16 cache",
                    if sparse { ", sparse" } else { "" }
                ),
                f64::from(u8::from(!ok)),
                0.0,
                ok,
            );
            if !ok {
                bad.push(format!(
                    "T {t_len} S {s_n} sparse {sparse} {kname}: o {same_o} q8 {same_q8} finite {finite}"
                ));
            }
        }
    }
    // A batched step: decode-sized sequences (one split for the shortest under the decode
    // kernel, splits for the others) and a 2-token one.
    let seqs = [(20usize, 1usize), (700, 1), (2047, 1), (65, 2)];
    let caches: Vec<_> = seqs
        .iter()
        .map(|&(t, _)| g.upload(&bf16(&r.vec(t * d, 1.0))).unwrap())
        .collect();
    let tokens: usize = seqs.iter().map(|s| s.1).sum();
    let dq = g.upload(&r.vec(tokens * heads * d, 1.0)).unwrap();
    let ms: Vec<kernels::MlaSeq<'_, u16>> = seqs
        .iter()
        .zip(&caches)
        .map(|(&(t, n), c)| kernels::MlaSeq {
            kv: c.as_view(),
            kv_len: t,
            tokens: n,
            pos0: t - n,
            keys: None,
        })
        .collect();
    let m = MlaShape {
        kv_len: 0,
        pos0: 0,
        ..shape(tokens, tokens)
    };
    for (kname, dec, tc) in choices {
        kernels::force_mla_decode(dec);
        kernels::force_mla_tc(tc);
        let mut o = nan_buf(&g, tokens * heads * dv);
        g.mla_attention_seqs(&dq, &ms, &mut o, m).unwrap();
        let want = g.quantize_q8(&o, tokens * heads, dv, dv).unwrap();
        let mut o8 = nan_buf(&g, tokens * heads * dv);
        let got = g.mla_attention_seqs_q8(&dq, &ms, &mut o8, m);
        kernels::force_mla_decode(None);
        kernels::force_mla_tc(None);
        let got = got.unwrap();
        let (of, o8f) = (g.download(&o).unwrap(), g.download(&o8).unwrap());
        let same_o = of.iter().zip(&o8f).all(|(a, b)| a.to_bits() == b.to_bits());
        let same_q8 = got.to_host(&g).unwrap() == want.to_host(&g).unwrap();
        let ok = same_o && same_q8 && o8f.iter().all(|v| v.is_finite());
        row(
            &format!("mla seqs q8, {kname}"),
            &format!("{} sequences, {tokens} tokens, bf16 cache", seqs.len()),
            f64::from(u8::from(!ok)),
            0.0,
            ok,
        );
        if !ok {
            bad.push(format!("seqs {kname}: o {same_o} q8 {same_q8}"));
        }
    }
    // o rows not dense (a padded head stride): refused, not misquantized.
    let dc = g.upload(&bf16(&r.vec(64 * d, 1.0))).unwrap();
    let dq = g.upload(&r.vec(heads * d, 1.0)).unwrap();
    let pad = MlaShape {
        o_head_stride: dv + 32,
        o_tok_stride: heads * (dv + 32),
        ..shape(1, 64)
    };
    let mut o = nan_buf(&g, heads * (dv + 32));
    assert!(g.mla_attention_q8(&dq, &dc, None, &mut o, pad).is_err());
    assert!(bad.is_empty(), "mla q8 differs: {bad:?}");
}
