//! Production kernels, already validated on the GPU, run under emulation against the same CPU
//! oracles the GPU tests use (kernels/tests/common/oracle.rs), with the launch configurations
//! of the Rust wrappers: agreement validates the emulator, and the pattern is the one new
//! kernels follow. Arithmetic differs from the GPU only where the GPU contracts a product into
//! an FMA (one rounding fewer); every tolerance below is the GPU test's, derived for either.
//! Without a C++ compiler every test prints "skipped: no C++ compiler" and passes.

mod common;
#[path = "../../tests/common/oracle.rs"]
mod oracle;

use common::*;
use gguf::GgmlType;
use kernels::{Op, QType};
use kernels_emu::Module;
use oracle::*;

// ---------------------------------------------------------------------------------------------
// quantize.cu

type QuantizeFn = unsafe extern "C" fn(*const f32, i64, i64, i32, *mut i8, *mut u64);

/// Runs quantize_q8a over `rows` rows of `k` (`x_stride` apart) with `grid` blocks of 256
/// threads; returns (codes, per-block d, per-half sums).
fn quantize(
    x: &[f32],
    rows: usize,
    k: usize,
    x_stride: usize,
    grid: u32,
) -> (Vec<i8>, Vec<f32>, Vec<i16>) {
    let m = module(Op::Quantize);
    let f: QuantizeFn = unsafe { m.entry("quantize_q8a") }.unwrap();
    let xb = Buf::new(x);
    let mut qs = Buf::filled(rows * k, 0x55i8);
    let mut ds = Buf::filled(rows * k / 32, u64::MAX);
    let (xp, qp, dp) = (xb.ptr(), qs.mut_ptr(), ds.mut_ptr());
    m.launch("quantize_q8a", [grid, 1, 1], [256, 1, 1], 0, &|| unsafe {
        f(xp, x_stride as i64, rows as i64, k as i32, qp, dp)
    })
    .unwrap();
    let recs = ds.to_vec();
    let d = recs.iter().map(|r| f32::from_bits(*r as u32)).collect();
    let s = recs
        .iter()
        .flat_map(|r| [(*r >> 32) as u16 as i16, (*r >> 48) as u16 as i16])
        .collect();
    (qs.to_vec(), d, s)
}

#[test]
fn quantize_q8a_equals_the_cpu_emulation_bit_for_bit() {
    if !compiler("quantize_q8a_equals_the_cpu_emulation_bit_for_bit") {
        return;
    }
    let mut r = Rng::new("emu quantize_q8a");
    let (rows, k, stride) = (3usize, 2048usize, 2048 + 96);
    let mut x = activations(&mut r, rows, k);
    x[64 + 3] = f32::NAN; // block 2 of row 0
    x[k + 7 * 32 + 9] = f32::INFINITY; // block 7 of row 1
    let mut xs = vec![f32::NAN; (rows - 1) * stride + k];
    for rr in 0..rows {
        xs[rr * stride..rr * stride + k].copy_from_slice(&x[rr * k..(rr + 1) * k]);
    }
    let (cq, cd, cs) = q8_cpu(&x);
    let bad_blocks = [2usize, k / 32 + 7];
    let blocks = rows * k / 32;
    // The wrapper's grid (one warp per block of 32), then a small grid that strides.
    for grid in [blocks.div_ceil(8) as u32, 5] {
        let (q, d, s) = quantize(&xs, rows, k, stride, grid);
        let mut bad = 0usize;
        for b in 0..blocks {
            if bad_blocks.contains(&b) {
                assert!(d[b].is_nan(), "block {b} holds a NaN or inf: d = NaN");
                assert!(q[32 * b..32 * b + 32].iter().all(|&c| c == 0), "block {b}");
                assert_eq!((s[2 * b], s[2 * b + 1]), (0, 0), "block {b}");
                continue;
            }
            bad += usize::from(d[b].to_bits() != cd[b].to_bits());
            bad += usize::from(s[2 * b] != cs[2 * b] || s[2 * b + 1] != cs[2 * b + 1]);
            bad += (32 * b..32 * b + 32).filter(|&i| q[i] != cq[i]).count();
        }
        assert_eq!(bad, 0, "grid {grid}: codes, scales and sums differ");
    }
}

// ---------------------------------------------------------------------------------------------
// gemvq.cu

/// `struct Q8A` of gemvq.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Q8AParams {
    qs: *const i8,
    ds: *const u64,
    rows: i64,
}

/// `struct GemvQ` of gemvq.cu, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvQParams {
    w: *const u8,
    w2: *const u8,
    nblk: i64,
    nrows: i32,
    k: i32,
    n_slabs: i32,
    lpr: i32,
    count: i32,
    ncols: i32,
    ids: *const i32,
    xidx: *const i32,
    x_div: i32,
    ctopk: i32,
    x: Q8AParams,
    y: *mut f32,
    yidx: *const i32,
    y_stride: i64,
    y_rows: i64,
    cw: *const f32,
    ksplit: i32,
    accum: i32,
    ws: *const u8,
    ws2: *const u8,
    ws_nblk: i64,
    nseg: i32,
    seg_row: [i32; 2],
    seg_w: [*const u8; 2],
    seg_y: [*mut f32; 2],
    seg_nblk: [i64; 2],
}

/// `struct QTables` of quant.cuh (eight table pointers; the gemvq kernels read only `kvalues`,
/// the seventh, for the IQ4 types).
#[repr(C)]
#[derive(Clone, Copy)]
struct QTables {
    t: [*const u8; 8],
}

type GemvqFn = unsafe extern "C" fn(GemvQParams, QTables);

/// kernels/src/gemv.rs's lanes per row: the largest power of two <= 32 dividing `tasks`.
fn lanes_for_tasks(tasks: usize) -> usize {
    let mut l = 32;
    while l > 1 && !tasks.is_multiple_of(l) {
        l /= 2;
    }
    l
}

/// A plain one-channel launch's parameters (one slab, no ids, maps, shared expert or stack):
/// every harness below starts from it and sets what its launch differs in.
#[allow(clippy::too_many_arguments)]
fn gemvq_params(
    w: *const u8,
    nblk: usize,
    rows: usize,
    k: usize,
    lpr: usize,
    ks: usize,
    x: Q8AParams,
    y: *mut f32,
) -> GemvQParams {
    GemvQParams {
        w,
        w2: std::ptr::null(),
        nblk: nblk as i64,
        nrows: rows as i32,
        k: k as i32,
        n_slabs: 1,
        lpr: lpr as i32,
        count: 1,
        ncols: 1,
        ids: std::ptr::null(),
        xidx: std::ptr::null(),
        x_div: 1,
        ctopk: 0,
        x,
        y,
        yidx: std::ptr::null(),
        y_stride: rows as i64,
        y_rows: 1,
        cw: std::ptr::null(),
        ksplit: ks as i32,
        accum: 0,
        ws: std::ptr::null(),
        ws2: std::ptr::null(),
        ws_nblk: 0,
        nseg: 1,
        seg_row: [0; 2],
        seg_w: [std::ptr::null(); 2],
        seg_y: [std::ptr::null_mut(); 2],
        seg_nblk: [0; 2],
    }
}

/// The q8a block records as the device holds them (d, then the two half sums as i16), from
/// the quantize kernel's host output.
fn q8_records(qd: &[f32], qsum: &[i16]) -> Vec<u64> {
    qd.iter()
        .enumerate()
        .map(|(b, d)| {
            u64::from(d.to_bits())
                | u64::from(qsum[2 * b] as u16) << 32
                | u64::from(qsum[2 * b + 1] as u16) << 48
        })
        .collect()
}

/// A matrix's bytes in its device layout (repacked where the type's blocks are not 16-byte
/// aligned).
fn device_layout(ty: GgmlType, bytes: Vec<u8>) -> Vec<u8> {
    if kernels::repack::is_packed(ty) {
        kernels::repack::repack(ty, &bytes).unwrap()
    } else {
        bytes
    }
}

/// One plain GEMV of `ncols` activation columns through `entry` (rows per lane group `rpg`,
/// k-split `ks` for one column), launched as `Gpu::gemv_q` launches it.
#[allow(clippy::too_many_arguments)]
fn gemvq(
    qt: QType,
    entry: &str,
    rpg: usize,
    ks: usize,
    w: &Buf<u8>,
    nblk: usize,
    rows: usize,
    k: usize,
    ncols: usize,
    q: &(Buf<i8>, Buf<u64>),
    tables: QTables,
) -> Vec<f32> {
    let m = module(Op::GemvQ(qt));
    let f: GemvqFn = unsafe { m.entry(entry) }.unwrap();
    let tw = if ncols == 1 { qt.task_weights() } else { 32 };
    let lpr = lanes_for_tasks(k / tw);
    let rows_per_block = (4 / ks) * (32 / lpr) * rpg;
    let mut y = Buf::filled(ncols * rows, f32::NAN);
    let x = Q8AParams {
        qs: q.0.ptr(),
        ds: q.1.ptr(),
        rows: ncols as i64,
    };
    let p = GemvQParams {
        ncols: ncols as i32,
        y_rows: ncols as i64,
        ..gemvq_params(w.ptr(), nblk, rows, k, lpr, ks, x, y.mut_ptr())
    };

    let t = tables;
    let grid = rows.div_ceil(rows_per_block) as u32;
    m.launch(entry, [grid, 1, 1], [128, 1, 1], 0, &|| unsafe { f(p, t) })
        .unwrap();
    y.to_vec()
}

#[test]
fn gemvq_q4_k_q6_k_q8_0_iq4_nl_match_f64_within_the_gpu_bound() {
    if !compiler("gemvq_q4_k_q6_k_q8_0_iq4_nl_match_f64_within_the_gpu_bound") {
        return;
    }
    let mut r = Rng::new("emu gemvq");
    // IQ4_NL decodes its nibbles through the 16-value table with prmt (gemvq.cu's lut4).
    let kvalues = Buf::new(gguf::quant::lookup_tables().unwrap().kvalues_iq4nl);
    let mut tables = QTables {
        t: [std::ptr::null(); 8],
    };
    tables.t[6] = kvalues.ptr() as *const u8;
    for (ty, qt) in [
        (GgmlType::Q4_K, QType::Q4K),
        (GgmlType::Q6_K, QType::Q6K),
        (GgmlType::Q8_0, QType::Q8_0),
        (GgmlType::IQ4_NL, QType::IQ4NL),
    ] {
        // One column (every k-split, 1, 2 and 4 rows per lane group), eight and five columns
        // (the 8-column kernels with several rows per lane group, and with one); K = 768 gives
        // 4 or 8 lanes per row; 129 and 42 rows leave the last group partial.
        for (rows, k, ncols) in [
            (129usize, 256usize, 1usize),
            (42, 768, 1),
            (64, 512, 8),
            (33, 768, 5),
        ] {
            let bytes = sane_blocks(ty, rows * k, &mut r);
            let w = dequant_cpu(ty, &bytes);
            let wb = Buf::new(&device_layout(ty, bytes));
            let nblk = rows * k / ty.block_size();
            let x = activations(&mut r, ncols, k);
            let (qc, qd, qsum) = quantize(&x, ncols, k, k, (ncols * k / 32).div_ceil(8) as u32);
            // Codes and records as the device holds them, from the quantize kernel's output.
            let recs = q8_records(&qd, &qsum);
            let q = (Buf::new(&qc), Buf::new(&recs));
            let runs: Vec<(String, usize, usize)> = if ncols == 1 {
                [1, 2, 4]
                    .iter()
                    .flat_map(|&ks| {
                        [("gemvq1_", 1), ("gemvq1r2_", 2), ("gemvq1r4_", 4)]
                            .map(|(e, rpg)| (format!("{e}{}", qt.suffix()), rpg, ks))
                    })
                    .collect()
            } else {
                vec![
                    (format!("gemvq8r_{}", qt.suffix()), 2, 1),
                    (format!("gemvq8_{}", qt.suffix()), 1, 1),
                ]
            };
            let mut first: Option<Vec<f32>> = None;
            for (entry, rpg, ks) in runs {
                let y = gemvq(qt, &entry, rpg, ks, &wb, nblk, rows, k, ncols, &q, tables);
                let (ok, worst) = gemvq_verify(&w, &x, &qc, &qd, &y, rows, k, ncols);
                say(&format!(
                    "gemvq {ty} {rows}x{k} x{ncols} {entry} split {ks}: worst {worst:.3e} of tol"
                ));
                assert!(ok, "gemvq {ty} {rows}x{k} x{ncols} {entry} split {ks}");
                // The row-per-group variants sum the same products in the same order (one
                // column: at the same k-split): bitwise here, where nothing is contracted into
                // an FMA (on the GPU ptxas contracts per kernel: kernels-gpu checks bounds).
                if ncols > 1 || rpg > 1 {
                    if let Some(f) = &first {
                        let same = f.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{ty} {rows}x{k} x{ncols}: {entry} split {ks} differs bitwise"
                        );
                    }
                }
                if ncols > 1 || rpg == 1 {
                    first = Some(y);
                }
            }
        }
    }
}

/// One stacked launch (`Gpu::gemv_q_stacked`): matrices `mats` (device bytes, rows) of one
/// type and width over activation row 0, each into its own output, as the wrapper launches it.
#[allow(clippy::too_many_arguments)]
fn gemvq_stacked(
    ty: GgmlType,
    qt: QType,
    (prefix, rpg): (&str, usize),
    ks: usize,
    mats: &[(&Buf<u8>, usize)],
    k: usize,
    q: &(Buf<i8>, Buf<u64>),
    tables: QTables,
) -> Vec<Vec<f32>> {
    let entry = format!("{prefix}{}", qt.suffix());
    let m = module(Op::GemvQ(qt));
    let f: GemvqFn = unsafe { m.entry(&entry) }.unwrap();
    let lpr = lanes_for_tasks(k / qt.task_weights());
    let rows_per_block = (4 / ks) * (32 / lpr) * rpg;
    let bs = ty.block_size();
    let mut ys: Vec<Buf<f32>> = mats
        .iter()
        .map(|&(_, n)| Buf::filled(n, f32::NAN))
        .collect();
    let total: usize = mats.iter().map(|m| m.1).sum();
    let x = Q8AParams {
        qs: q.0.ptr(),
        ds: q.1.ptr(),
        rows: 1,
    };
    let mut p = GemvQParams {
        y_stride: mats[0].1 as i64,
        nseg: mats.len() as i32,
        ..gemvq_params(
            mats[0].0.ptr(),
            mats[0].1 * k / bs,
            total,
            k,
            lpr,
            ks,
            x,
            ys[0].mut_ptr(),
        )
    };

    let mut row0 = mats[0].1;
    for i in 1..mats.len() {
        p.seg_row[i - 1] = row0 as i32;
        p.seg_w[i - 1] = mats[i].0.ptr();
        p.seg_y[i - 1] = ys[i].mut_ptr();
        p.seg_nblk[i - 1] = (mats[i].1 * k / bs) as i64;
        row0 += mats[i].1;
    }
    let t = tables;
    let grid = total.div_ceil(rows_per_block) as u32;
    m.launch(&entry, [grid, 1, 1], [128, 1, 1], 0, &|| unsafe { f(p, t) })
        .unwrap();
    ys.iter().map(|y| y.to_vec()).collect()
}

#[test]
fn gemvq_stacked_matrices_equal_their_own_launches_bitwise() {
    if !compiler("gemvq_stacked_matrices_equal_their_own_launches_bitwise") {
        return;
    }
    let mut r = Rng::new("emu gemvq stacked");
    let tables = QTables {
        t: [std::ptr::null(); 8],
    };
    // Q4_K in the GGUF layout; Q8_0 repacked (scales after all of a matrix's blocks: each
    // segment's own block count must reach the kernel). Row counts that end mid-block of rows
    // and a segment shorter than a block's rows; the segments start at multiples of 4, so
    // the launches of 2 and 4 rows per lane group stack them too (the wrapper's rule).
    for (ty, qt) in [(GgmlType::Q4_K, QType::Q4K), (GgmlType::Q8_0, QType::Q8_0)] {
        let k = 768;
        let rows = [132usize, 40, 3];
        let x = activations(&mut r, 1, k);
        let (qc, qd, qsum) = quantize(&x, 1, k, k, (k / 32).div_ceil(8) as u32);
        let recs = q8_records(&qd, &qsum);
        let q = (Buf::new(&qc), Buf::new(&recs));
        let bufs: Vec<(Buf<u8>, Vec<f32>)> = rows
            .iter()
            .map(|&n| {
                let bytes = sane_blocks(ty, n * k, &mut r);
                let w = dequant_cpu(ty, &bytes);
                (Buf::new(&device_layout(ty, bytes)), w)
            })
            .collect();
        for n in [2usize, 3] {
            for (ks, v) in [1usize, 2, 4].into_iter().flat_map(|ks| {
                [("gemvq1_", 1), ("gemvq1r2_", 2), ("gemvq1r4_", 4)].map(|v| (ks, v))
            }) {
                let mats: Vec<(&Buf<u8>, usize)> = bufs[..n]
                    .iter()
                    .zip(&rows)
                    .map(|(b, &m)| (&b.0, m))
                    .collect();
                let ys = gemvq_stacked(ty, qt, v, ks, &mats, k, &q, tables);
                for (i, y) in ys.iter().enumerate() {
                    let nblk = rows[i] * k / ty.block_size();
                    let alone = gemvq(
                        qt,
                        &format!("gemvq1_{}", qt.suffix()),
                        1,
                        ks,
                        &bufs[i].0,
                        nblk,
                        rows[i],
                        k,
                        1,
                        &q,
                        tables,
                    );
                    let same = alone.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{ty} stack of {n}, split {ks}, {} rows a group: matrix {i} differs",
                        v.1
                    );
                    let (ok, worst) = gemvq_verify(&bufs[i].1, &x, &qc, &qd, y, rows[i], k, 1);
                    assert!(ok, "{ty} stack of {n}, split {ks}, matrix {i}: {worst:.3e}");
                }
                say(&format!(
                    "gemvq stacked {ty} x{n} split {ks}, {} rows a group: bitwise the lone launches",
                    v.1
                ));
            }
        }
    }
}

/// q8a activations as the device holds them: codes, block records.
type DevQ8 = (Buf<i8>, Buf<u64>);

/// One-column GLU (gate + up + SiLU over expert channels, the shared expert as the last) and
/// combine (down projections + weighted sum over a token's slots, the shared expert as one more
/// slot) launches of `prefix` (rows per lane group `rpg`) at k-split `ks`, as `Gpu::gemv_q_shared`
/// launches them. Returns (GLU outputs, `ids.len() + 1` channels of `rows`; combine outputs).
#[allow(clippy::too_many_arguments)]
fn gemvq_glu_combine(
    (glu, comb, rpg): (&str, &str, usize),
    ks: usize,
    (gate, up, down): (&Buf<u8>, &Buf<u8>, &Buf<u8>),
    (sgate, sup, sdown): (&Buf<u8>, &Buf<u8>, &Buf<u8>),
    (slabs, rows, k_glu, k_comb): (usize, usize, usize, usize),
    ids: &Buf<i32>,
    cw: &Buf<f32>,
    (xg, xc): (&DevQ8, &DevQ8),
) -> (Vec<f32>, Vec<f32>) {
    let qt = QType::Q4K;
    let m = module(Op::GemvQ(qt));
    let t = QTables {
        t: [std::ptr::null(); 8],
    };
    let topk = ids.to_vec().len();
    let bs = GgmlType::Q4_K.block_size();
    let launch = |entry: &str, p: GemvQParams, k: usize, channels: usize| {
        let f: GemvqFn = unsafe { m.entry(entry) }.unwrap();
        let lpr = lanes_for_tasks(k / qt.task_weights());
        let rows_per_block = (4 / ks) * (32 / lpr) * rpg;
        let grid = [rows.div_ceil(rows_per_block) as u32, channels as u32, 1];
        m.launch(entry, grid, [128, 1, 1], 0, &|| unsafe { f(p, t) })
            .unwrap();
    };
    let base = |k: usize| {
        let none = Q8AParams {
            qs: std::ptr::null(),
            ds: std::ptr::null(),
            rows: 0,
        };
        let lpr = lanes_for_tasks(k / qt.task_weights());
        GemvQParams {
            n_slabs: slabs as i32,
            ids: ids.ptr(),
            ws_nblk: (rows * k / bs) as i64,
            ..gemvq_params(
                std::ptr::null(),
                rows * k / bs,
                rows,
                k,
                lpr,
                ks,
                none,
                std::ptr::null_mut(),
            )
        }
    };

    let mut act = Buf::filled((topk + 1) * rows, f32::NAN);
    let p = GemvQParams {
        w: gate.ptr(),
        w2: up.ptr(),
        count: topk as i32 + 1,
        x_div: topk as i32 + 1,
        x: Q8AParams {
            qs: xg.0.ptr(),
            ds: xg.1.ptr(),
            rows: 1,
        },
        y: act.mut_ptr(),
        y_rows: topk as i64 + 1,
        ws: sgate.ptr(),
        ws2: sup.ptr(),
        ..base(k_glu)
    };
    launch(&format!("{glu}{}", qt.suffix()), p, k_glu, topk + 1);
    let mut y = Buf::filled(rows, f32::NAN);
    let p = GemvQParams {
        w: down.ptr(),
        ctopk: topk as i32,
        x: Q8AParams {
            qs: xc.0.ptr(),
            ds: xc.1.ptr(),
            rows: topk as i64 + 1,
        },
        y: y.mut_ptr(),
        y_rows: 1,
        cw: cw.ptr(),
        ws: sdown.ptr(),
        ..base(k_comb)
    };
    launch(&format!("{comb}{}", qt.suffix()), p, k_comb, 1);
    (act.to_vec(), y.to_vec())
}

/// The one-column GLU and combine kernels with two rows per lane group (`gemvq_glu1r_`,
/// `gemvq_comb_r_`) against the f64 products (kernels/tests/gpu.rs's bounds: mmq_dot's (A) per
/// product, mmq_glu_want through silu(g) * u) and bitwise against the one-row kernels at every
/// k-split; an odd row count leaves the last group half used, an empty slot (-1) its GLU
/// channel untouched and the combine without it, the shared expert rides both.
#[test]
fn gemvq_glu_and_combine_two_rows_per_group_match_f64_and_one_row_bitwise() {
    if !compiler("gemvq_glu_and_combine_two_rows_per_group_match_f64_and_one_row_bitwise") {
        return;
    }
    let mut r = Rng::new("emu gemvq glu combine rows");
    let ty = GgmlType::Q4_K;
    let (ne, rows, kg, kc) = (5usize, 133usize, 512usize, 256usize);
    let mat = |r: &mut Rng, slabs: usize, k: usize| {
        let b = sane_blocks(ty, slabs * rows * k, r);
        (dequant_cpu(ty, &b), Buf::new(&b))
    };
    let (gw, gb) = mat(&mut r, ne, kg);
    let (uw, ub) = mat(&mut r, ne, kg);
    let (dw, db) = mat(&mut r, ne, kc);
    let (sgw, sgb) = mat(&mut r, 1, kg);
    let (suw, sub) = mat(&mut r, 1, kg);
    let (sdw, sdb) = mat(&mut r, 1, kc);
    let ids_h: Vec<i32> = vec![4, 0, -1, 2];
    let topk = ids_h.len();
    let cw_h: Vec<f32> = (0..topk).map(|_| 0.2 + r.unit()).collect();
    let (ids, cw) = (Buf::new(&ids_h), Buf::new(&cw_h));
    let q8 = |r: &mut Rng, n: usize, k: usize| {
        let x = activations(r, n, k);
        let (qc, qd, qs) = quantize(&x, n, k, k, (n * k / 32).div_ceil(8) as u32);
        let recs = q8_records(&qd, &qs);
        let dev = (Buf::new(&qc), Buf::new(&recs));
        (x, qc, qd, dev)
    };
    let (xg, gqc, gqd, xgb) = q8(&mut r, 1, kg);
    let (xc, cqc, cqd, xcb) = q8(&mut r, topk + 1, kc);
    for ks in [1usize, 2, 4] {
        let run = |v: (&str, &str, usize)| {
            gemvq_glu_combine(
                v,
                ks,
                (&gb, &ub, &db),
                (&sgb, &sub, &sdb),
                (ne, rows, kg, kc),
                &ids,
                &cw,
                (&xgb, &xcb),
            )
        };
        let (a1, y1) = run(("gemvq_glu1_", "gemvq_comb_", 1));
        let (a2, y2) = run(("gemvq_glu1r_", "gemvq_comb_r_", 2));
        let same = |u: &[f32], v: &[f32]| u.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same(&a1, &a2),
            "GLU split {ks}: 2 rows a group differ from 1"
        );
        assert!(
            same(&y1, &y2),
            "combine split {ks}: 2 rows a group differ from 1"
        );
        // GLU: channel c = slot c's expert, the last the shared expert's; the empty slot's
        // channel is never written.
        for c in 0..=topk {
            for rr in 0..rows {
                let got = a2[c * rows + rr];
                let (e, g, u) = match ids_h.get(c) {
                    Some(&e) if e < 0 => {
                        assert!(got.is_nan(), "GLU split {ks}: empty channel {c} written");
                        continue;
                    }
                    Some(&e) => (e as usize, &gw, &uw),
                    None => (0, &sgw, &suw),
                };
                let (gv, _, tg, _) = mmq_dot(g, e * rows + rr, kg, &xg, &gqc, &gqd, 0);
                let (uv, _, tu, _) = mmq_dot(u, e * rows + rr, kg, &xg, &gqc, &gqd, 0);
                let (want, tol) = mmq_glu_want(gv, tg, uv, tu);
                assert!(
                    (f64::from(got) - want).abs() <= tol,
                    "GLU split {ks} channel {c} row {rr}: {got} vs {want} (tol {tol:.2e})"
                );
            }
        }
        // Combine: slots in order (the empty one skipped), then the shared expert's row.
        for (rr, &got) in y2.iter().enumerate() {
            let (mut want, mut tol, mut mag) = (0f64, 0f64, 0f64);
            for (k, &e) in ids_h.iter().enumerate() {
                if e < 0 {
                    continue;
                }
                let (v, _, t, _) = mmq_dot(&dw, e as usize * rows + rr, kc, &xc, &cqc, &cqd, k);
                want += f64::from(cw_h[k]) * v;
                tol += f64::from(cw_h[k]) * t;
                mag += (f64::from(cw_h[k]) * v).abs();
            }
            let (v, _, t, _) = mmq_dot(&sdw, rr, kc, &xc, &cqc, &cqd, topk);
            want += v;
            tol += t;
            mag += v.abs();
            // The slot products' f32 scaling and their sum over topk + 1 slots.
            tol += (topk as f64 + 2.0) * U32 * mag;
            let got = f64::from(got);
            assert!(
                got.is_finite() && (got - want).abs() <= tol,
                "combine split {ks} row {rr}: {got} vs {want} (tol {tol:.2e})"
            );
        }
        say(&format!(
            "gemvq glu + combine split {ks}: 2 rows a group bitwise 1, within the f64 bounds"
        ));
    }
}

// ---------------------------------------------------------------------------------------------
// gemv.cu

/// `struct GemvF` of gemv.cu (its `WMat` inlined), field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvFParams {
    w: *const u8,
    nblk: i64,
    nrows: i32,
    k: i32,
    n_slabs: i32,
    lpr: i32,
    ids: *const i32,
    x: *const f32,
    x_stride: i64,
    x_div: i32,
    count: i32,
    y: *mut f32,
    y_stride: i64,
}

type GemvFn = unsafe extern "C" fn(GemvFParams, QTables);

/// The f32 GEMV's one-row kernel (`gemv_f32`) and its k-split over the block's warps
/// (`gemvs_f32`, what `Gpu::gemv_batched` takes for matrices of few rows: the MoE router) on
/// F32 weights: both within the f64 bound of kernels/tests/gpu.rs's `gemv_oracle` (k/32 + 10
/// roundings of sum |w x|), at widths giving 32 and 8 lanes a row and a row count that leaves
/// the last block partial; the coalesced kernel (`gemvc_f32`, one row a block: the router's
/// since 2026-12-07) too.
#[test]
fn gemv_f32_k_split_matches_f64() {
    if !compiler("gemv_f32_k_split_matches_f64") {
        return;
    }
    let mut r = Rng::new("emu gemv ks");
    let m = module(Op::Gemv);
    let tables = QTables {
        t: [std::ptr::null(); 8],
    };
    for (rows, k) in [(37usize, 6144usize), (21, 768)] {
        let w = r.vec(rows * k, 1.0);
        let x = r.vec(k, 1.0);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (wb, xb) = (Buf::new(&bytes), Buf::new(&x));
        let lpr = lanes_for_tasks(k / 32);
        for (entry, rows_per_block) in [
            ("gemv_f32", 4 * (32 / lpr)),
            ("gemvs_f32", 32 / lpr),
            ("gemvc_f32", 1),
        ] {
            let f: GemvFn = unsafe { m.entry(entry) }.unwrap();
            let mut y = Buf::filled(rows, f32::NAN);
            let p = GemvFParams {
                w: wb.ptr(),
                nblk: (rows * k) as i64,
                nrows: rows as i32,
                k: k as i32,
                n_slabs: 1,
                lpr: lpr as i32,
                ids: std::ptr::null(),
                x: xb.ptr(),
                x_stride: k as i64,
                x_div: 1,
                count: 1,
                y: y.mut_ptr(),
                y_stride: rows as i64,
            };
            let grid = rows.div_ceil(rows_per_block) as u32;
            m.launch(entry, [grid, 1, 1], [128, 1, 1], 0, &|| unsafe {
                f(p, tables)
            })
            .unwrap();
            let y = y.to_vec();
            let gamma = (k as f64 / 32.0 + 10.0) * 2f64.powi(-24);
            let mut worst = 0f64;
            for (i, yi) in y.iter().enumerate() {
                let wr = &w[i * k..(i + 1) * k];
                let dot: f64 = wr
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let mag: f64 = wr
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (f64::from(*a) * f64::from(*b)).abs())
                    .sum();
                assert!(yi.is_finite(), "{entry} {rows}x{k}: row {i} not written");
                worst = worst.max((f64::from(*yi) - dot).abs() / (gamma * mag + 1e-30));
            }
            say(&format!(
                "{entry} {rows}x{k}: worst {worst:.3e} of the bound"
            ));
            assert!(worst <= 1.0, "{entry} {rows}x{k}: {worst}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// indexer_scores.cu, topk.cu

type IndexerFn = unsafe extern "C" fn(
    *const f32,
    i64,
    i32,
    i32,
    *const u8,
    i64,
    *const f32,
    i64,
    *const i32,
    i32,
    f32,
    *mut f32,
    i64,
    i64,
);

type TopkFn = unsafe extern "C" fn(*const f32, i64, i32, i32, *mut i32, i64, *mut i32);

/// topk_f32 over `rows` rows of `n` (`stride` apart): one 1024-thread block per row, as
/// `Gpu::topk` launches it. Returns (selection, counts).
fn topk_one_block(
    x: &[f32],
    rows: usize,
    n: usize,
    stride: usize,
    k: usize,
) -> (Vec<i32>, Vec<i32>) {
    let m = module(Op::TopK);
    let f: TopkFn = unsafe { m.entry("topk_f32") }.unwrap();
    let xb = Buf::new(x);
    let mut out = Buf::filled(rows * k, -7i32);
    let mut cnt = Buf::filled(rows, -7i32);
    let (xp, op, cp) = (xb.ptr(), out.mut_ptr(), cnt.mut_ptr());
    m.launch(
        "topk_f32",
        [rows as u32, 1, 1],
        [1024, 1, 1],
        0,
        &|| unsafe { f(xp, stride as i64, n as i32, k as i32, op, k as i64, cp) },
    )
    .unwrap();
    (out.to_vec(), cnt.to_vec())
}

#[test]
fn indexer_scores_f32_and_bf16_and_topk_of_them() {
    if !compiler("indexer_scores_f32_and_bf16_and_topk_of_them") {
        return;
    }
    let mut r = Rng::new("emu indexer");
    let m = module(Op::IndexerScores);
    // (heads, dim, T, top-k, query positions): the fixture's shape, a width that is not a
    // multiple of 32, and T not a multiple of the 8 keys per block.
    for (heads, dim, t_len, k, pos) in [
        (4usize, 64usize, 121usize, 32usize, vec![120i32, 31, 10]),
        (3, 72, 77, 20, vec![76, 40, 0]),
        (8, 128, 300, 64, vec![299, 150, 299, 7]),
    ] {
        for bf16 in [false, true] {
            let s_len = pos.len();
            let q = r.vec(s_len * heads * dim, 1.0);
            let kc32 = r.vec(t_len * dim, 1.0);
            // bf16 keys: the oracle sees the widened bf16 values, exactly what the kernel reads.
            let kbits: Vec<u16> = kc32
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            let kc: Vec<f32> = if bf16 {
                kbits
                    .iter()
                    .map(|&b| half::bf16::from_bits(b).to_f32())
                    .collect()
            } else {
                kc32.clone()
            };
            let w: Vec<f32> = r
                .vec(s_len * heads, 1.0)
                .iter()
                .map(|v| v / (heads as f32).sqrt())
                .collect();
            let scale = 1.0 / (dim as f32).sqrt();
            let out_stride = t_len + 5;
            let (qb, wb, pb) = (Buf::new(&q), Buf::new(&w), Buf::new(&pos));
            let kb: Buf<u8> = if bf16 {
                Buf::new(
                    &kbits
                        .iter()
                        .flat_map(|b| b.to_le_bytes())
                        .collect::<Vec<u8>>(),
                )
            } else {
                Buf::new(
                    &kc32
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect::<Vec<u8>>(),
                )
            };
            let entry = if bf16 {
                "indexer_scores_bf16"
            } else {
                "indexer_scores_f32"
            };
            let f: IndexerFn = unsafe { m.entry(entry) }.unwrap();
            // The wrapper's grid, then fewer y blocks than tokens (the tokens grid-stride).
            for grid_y in [s_len, 2] {
                let mut out = Buf::filled(s_len * out_stride, f32::NAN);
                let (qp, kp, wp, pp, op) = (qb.ptr(), kb.ptr(), wb.ptr(), pb.ptr(), out.mut_ptr());
                m.launch(
                    entry,
                    [t_len.div_ceil(8) as u32, grid_y as u32, 1],
                    [256, 1, 1],
                    0,
                    &|| unsafe {
                        f(
                            qp,
                            (heads * dim) as i64,
                            heads as i32,
                            dim as i32,
                            kp,
                            dim as i64,
                            wp,
                            heads as i64,
                            pp,
                            t_len as i32,
                            scale,
                            op,
                            out_stride as i64,
                            s_len as i64,
                        )
                    },
                )
                .unwrap();
                let sc = out.to_vec();
                // Per head: dim/32 products per lane + 5 tree adds, then H weighted terms summed
                // in order: (dim/32 + heads + 8) roundings of the magnitude, taken normwise (x4
                // margin for the head sum's magnitude exceeding the result's) - gpu.rs's bound.
                let tol = (dim as f64 / 32.0 + heads as f64 + 8.0) * U32 * 4.0;
                let mut worst = 0f64;
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
                    assert!(!finite.is_empty());
                    let mag = max_abs(&finite).max(1e-30);
                    for t in 0..t_len {
                        let got = sc[s * out_stride + t];
                        if want[t].is_finite() {
                            worst = worst.max((f64::from(got) - want[t]).abs() / mag);
                        } else {
                            assert_eq!(got, f32::NEG_INFINITY, "s {s} t {t}: masked");
                        }
                    }
                    let pad = &sc[s * out_stride + t_len..(s + 1) * out_stride];
                    assert!(pad.iter().all(|v| v.is_nan()), "s {s}: padding written");
                }
                say(&format!(
                    "{entry} {heads}x{dim} T {t_len} grid.y {grid_y}: worst {worst:.3e} (tol {tol:.3e})"
                ));
                assert!(
                    worst <= tol,
                    "{entry} {heads}x{dim} T {t_len}: {worst:e} > {tol:e}"
                );

                // Top-k of the emulated scores equals the reference selection exactly.
                let (sel, cnt) = topk_one_block(&sc, s_len, t_len, out_stride, k);
                for s in 0..s_len {
                    let want = topk_cpu(&sc[s * out_stride..s * out_stride + t_len], k);
                    assert_eq!(&sel[s * k..(s + 1) * k], &want[..], "topk row {s}");
                    assert_eq!(cnt[s] as usize, want.iter().filter(|&&v| v >= 0).count());
                }
            }
        }
    }
}

/// One launch of a bf16-key scorer `entry` (grid `[x, y]`, `threads` a block) over `c`'s inputs
/// as `sh` lays them out: the `[S, out_stride]` scores, NaN where nothing was written.
fn run_indexer(
    entry: &str,
    c: &IndexerCase,
    sh: &kernels::IndexerShape,
    pos: &[i32],
    [gx, gy]: [u64; 2],
    threads: u32,
) -> Vec<f32> {
    let m = module(Op::IndexerScores);
    let f: IndexerFn = unsafe { m.entry(entry) }.unwrap();
    let kb: Buf<u16> = Buf::new(&c.kbits);
    let (qb, wb, pb) = (Buf::new(&c.q), Buf::new(&c.w), Buf::new(pos));
    let mut out = Buf::filled(sh.tokens * sh.out_stride, f32::NAN);
    let (qp, kp, wp, pp, op) = (
        qb.ptr(),
        kb.ptr() as *const u8,
        wb.ptr(),
        pb.ptr(),
        out.mut_ptr(),
    );
    m.launch(
        entry,
        [gx as u32, gy as u32, 1],
        [threads, 1, 1],
        0,
        &|| unsafe {
            f(
                qp,
                sh.q_stride as i64,
                sh.heads as i32,
                sh.dim as i32,
                kp,
                sh.k_stride as i64,
                wp,
                sh.w_stride as i64,
                pp,
                sh.kv_len as i32,
                sh.scale,
                op,
                sh.out_stride as i64,
                sh.tokens as i64,
            )
        },
    )
    .unwrap();
    out.to_vec()
}

/// The lane-per-key scorer (bf16 keys) with the wrapper's grid (`kernels::indexer::lanes_grid`
/// for an H200's 132 SMs) and with 2 y blocks (tokens grid-strided): one and two head groups
/// (H = 40: 32 + 8), widths 64 / 72 / 128, T not a multiple of 256, a causal prefill (whole
/// blocks past a token's position), keys read at a row stride wider than the width.
#[test]
fn indexer_lanes_kernel_matches_f64() {
    if !compiler("indexer_lanes_kernel_matches_f64") {
        return;
    }
    let mut r = Rng::new("emu indexer lanes");
    let entry = "indexer_scores_lanes_bf16";
    let causal = |n: usize| (0..n as i32).collect::<Vec<i32>>();
    for (heads, dim, k_stride, t_len, pos) in [
        (4usize, 64usize, 64usize, 121usize, vec![120i32, 31, 10, 0]),
        (40, 128, 136, 700, vec![699, 300, 255, 256]),
        (8, 72, 72, 300, vec![299, 5, 256]),
        (32, 128, 128, 2000, vec![1999, 0]),
        (32, 128, 128, 300, causal(300)),
    ] {
        let s_len = pos.len();
        let c = indexer_case(&mut r, heads, dim, k_stride, t_len, s_len);
        let sh = indexer_shape(&c, heads, dim, k_stride, t_len, s_len);
        let out_stride = sh.out_stride;
        assert!(kernels::indexer::lanes_fit(&sh, Buf::new(&c.kbits).addr()));
        let (gx, gy) = kernels::indexer::lanes_grid(&sh, 132, 65535);
        for grid_y in [gy, 2.min(s_len as u64)] {
            let out = run_indexer(
                entry,
                &c,
                &sh,
                &pos,
                [gx, grid_y],
                kernels::indexer::IXL_THREADS,
            );
            let (worst, layout_ok, scored) =
                indexer_check(&c, &out, out_stride, heads, dim, t_len, &pos);
            // Per head an 8-term FMA chain per 8-dim chunk and dim/8 chunk sums, then H
            // weighted terms in order and the scale and weight products: (dim/8 + 8 + heads +
            // 3) roundings, normwise with gpu.rs's x4 margin (its lane-kernel bound).
            let tol = (dim as f64 / 8.0 + 8.0 + heads as f64 + 3.0) * U32 * 4.0;
            say(&format!(
                "{entry} {heads}x{dim} T {t_len} S {s_len} grid ({gx}, {grid_y}): worst {worst:.3e} (tol {tol:.3e}), masks/padding ok {layout_ok}"
            ));
            assert!(scored > 0, "nothing scored");
            assert!(
                layout_ok,
                "{entry}: non-finite score, unmasked key or padding written"
            );
            assert!(
                worst <= tol,
                "{entry} {heads}x{dim} T {t_len}: {worst:e} > {tol:e}"
            );
        }
    }
}

/// The tensor-core scorer (bf16 keys, `indexer_scores_tc_bf16`) with the wrapper's grid
/// (`kernels::indexer::tc_grid` for 132 SMs) and with 2 y blocks (tokens grid-strided): one
/// and two head tiles (H = 4, 20, 32: the second tile partly empty), widths 64 / 96 / 128 (2, 3,
/// 4 loads of 16 bytes a key), T not a multiple of a block's 128 keys or a tile's 8, a causal
/// prefill (whole blocks past a token's position), keys read at a row stride wider than the
/// width; each score against the f64 oracle within the bound of its roundings
/// (`indexer_tc_worst`). The
/// instruction is the emulator's model (`emu_mma_m16n8k16_bf16`); the fragment permutation,
/// masking and head sums are the kernel's.
#[test]
fn indexer_tc_kernel_matches_f64() {
    if !compiler("indexer_tc_kernel_matches_f64") {
        return;
    }
    let mut r = Rng::new("emu indexer tc");
    let entry = "indexer_scores_tc_bf16";
    let causal = |n: usize| (0..n as i32).collect::<Vec<i32>>();
    for (heads, dim, k_stride, t_len, pos) in [
        (4usize, 64usize, 64usize, 121usize, vec![120i32, 31, 10, 0]),
        (20, 96, 104, 300, vec![299, 5, 256]),
        (32, 128, 136, 700, vec![699, 300, 255, 256]),
        (32, 128, 128, 100, causal(100)),
    ] {
        let s_len = pos.len();
        let c = indexer_case(&mut r, heads, dim, k_stride, t_len, s_len);
        let sh = indexer_shape(&c, heads, dim, k_stride, t_len, s_len);
        let out_stride = sh.out_stride;
        assert!(kernels::indexer::tc_fit(&sh, Buf::new(&c.kbits).addr()));
        let (gx, gy) = kernels::indexer::tc_grid(&sh, 132, 65535);
        for grid_y in [gy, 2.min(s_len as u64)] {
            let out = run_indexer(
                entry,
                &c,
                &sh,
                &pos,
                [gx, grid_y],
                kernels::indexer::IXT_THREADS,
            );
            let (_, layout_ok, scored) =
                indexer_check(&c, &out, out_stride, heads, dim, t_len, &pos);
            let worst = indexer_tc_worst(&c, &out, out_stride, heads, dim, t_len, &pos);
            say(&format!(
                "{entry} {heads}x{dim} T {t_len} S {s_len} grid ({gx}, {grid_y}): worst {worst:.3} of the bound, masks/padding ok {layout_ok}"
            ));
            assert!(scored > 0, "nothing scored");
            assert!(
                layout_ok,
                "{entry}: non-finite score, unmasked key or padding written"
            );
            assert!(
                worst <= 1.0,
                "{entry} {heads}x{dim} T {t_len}: {worst:.3} of the bound"
            );
        }
    }
}

/// Rows that stress the selection: clustered scores with a -inf tail and a NaN, 7 distinct
/// values (thousands of ties at the threshold), signed zeros / infinities / extremes, too few
/// candidates, exactly k + 1, and one value everywhere.
fn hard_rows(r: &mut Rng, n: usize, k: usize) -> Vec<Vec<f32>> {
    let mut rows = Vec::new();
    let mut a: Vec<f32> = (0..n).map(|_| r.unit() * 3.0).collect();
    for v in &mut a[n - n / 7..] {
        *v = f32::NEG_INFINITY;
    }
    a[n / 5] = f32::NAN;
    rows.push(a);
    rows.push(
        (0..n)
            .map(|i| {
                if i % 17 == 3 {
                    f32::NEG_INFINITY
                } else {
                    r.below(7) as f32 * 0.5 - 1.0
                }
            })
            .collect(),
    );
    rows.push(
        (0..n)
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
            .collect(),
    );
    for valid in [k / 3, k + 1] {
        let mut v = vec![f32::NEG_INFINITY; n];
        for j in 0..valid.min(n) {
            v[j * n / valid] = r.sym(2.0);
        }
        rows.push(v);
    }
    rows.push(vec![1.5f32; n]);
    rows
}

type TopkHistFn =
    unsafe extern "C" fn(*const f32, i64, i32, i32, i32, i32, *mut i32, *mut i32, *mut i32);
type TopkGatherFn = unsafe extern "C" fn(
    *const f32,
    i64,
    i32,
    i32,
    i32,
    *const i32,
    *const i32,
    *const i32,
    *mut i32,
    i64,
    *mut i32,
);

/// topk.cu's zeroed ints per row, threads per block and ints per chunk of the last-pass table.
const TKM_ZR: usize = 1056;
const TKM_G: usize = 257;

#[test]
fn topk_one_block_and_split_over_blocks_equal_the_reference() {
    if !compiler("topk_one_block_and_split_over_blocks_equal_the_reference") {
        return;
    }
    let mut r = Rng::new("emu topk");
    let m = module(Op::TopK);
    let hist: TopkHistFn = unsafe { m.entry("topk_mb_hist") }.unwrap();
    let gather: TopkGatherFn = unsafe { m.entry("topk_mb_gather") }.unwrap();
    let (n, k, stride) = (9000usize, 1024usize, 9003usize);
    let rows_x = hard_rows(&mut r, n, k);
    let rows = rows_x.len();
    let mut x = vec![f32::NAN; rows * stride];
    for (i, v) in rows_x.iter().enumerate() {
        x[i * stride..i * stride + n].copy_from_slice(v);
    }
    let want: Vec<Vec<i32>> = rows_x.iter().map(|v| topk_cpu(v, k)).collect();

    let (sel, cnt) = topk_one_block(&x, rows, n, stride, k);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&sel[i * k..(i + 1) * k], &w[..], "topk_f32 row {i}");
        assert_eq!(cnt[i] as usize, w.iter().filter(|&&v| v >= 0).count());
    }

    // The wrapper's split plan for an 8-SM GPU: several chunks per row, the last partial.
    let (chunk, chunks) = kernels::sample::split_chunks(n, rows, 8);
    assert!(chunks >= 3 && n % chunk != 0, "plan ({chunk}, {chunks})");
    let xb = Buf::new(&x);
    let mut zs = Buf::filled(rows * TKM_ZR, 0i32);
    let mut vc = Buf::filled(rows * chunks, -9i32);
    let mut gc = Buf::filled(rows * chunks * TKM_G, -9i32);
    let mut out = Buf::filled(rows * k, -7i32);
    let mut cnt = Buf::filled(rows, -7i32);
    let (xp, zp, vp, gp, op, cp) = (
        xb.ptr(),
        zs.mut_ptr(),
        vc.mut_ptr(),
        gc.mut_ptr(),
        out.mut_ptr(),
        cnt.mut_ptr(),
    );
    let grid = [chunks as u32, rows as u32, 1];
    for pass in 0..4 {
        m.launch("topk_mb_hist", grid, [256, 1, 1], 0, &|| unsafe {
            hist(
                xp,
                stride as i64,
                n as i32,
                k as i32,
                chunk as i32,
                pass,
                zp,
                vp,
                gp,
            )
        })
        .unwrap();
    }
    m.launch("topk_mb_gather", grid, [256, 1, 1], 0, &|| unsafe {
        gather(
            xp,
            stride as i64,
            n as i32,
            k as i32,
            chunk as i32,
            zp,
            vp,
            gp,
            op,
            k as i64,
            cp,
        )
    })
    .unwrap();
    let (sel, cnt) = (out.to_vec(), cnt.to_vec());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&sel[i * k..(i + 1) * k], &w[..], "split top-k row {i}");
        assert_eq!(cnt[i] as usize, w.iter().filter(|&&v| v >= 0).count());
    }
}

// ---------------------------------------------------------------------------------------------
// rmsnorm.cu

/// kernels/src/norm.rs's threads per row.
fn block_for(n: usize) -> u32 {
    match n {
        4096.. => 1024,
        2048.. => 512,
        256.. => 256,
        _ => 64,
    }
}

#[test]
fn rmsnorm_matches_f64_with_residual_and_q8_epilogue() {
    if !compiler("rmsnorm_matches_f64_with_residual_and_q8_epilogue") {
        return;
    }
    let mut r = Rng::new("emu rmsnorm");
    let m = module(Op::RmsNorm);
    let f: RmsFn = unsafe { m.entry("rmsnorm_f32") }.unwrap();
    let rows = 3usize;
    let eps = 1e-5f32;
    // The wrapper's block sizes (register path), and a row wider than 8 values per thread
    // (the strided path).
    for (n, bd) in [
        (64usize, block_for(64)),
        (576, block_for(576)),
        (2048, block_for(2048)),
        (6144, block_for(6144)),
        (4096, 256),
    ] {
        let x = r.vec(rows * n, 2.0);
        let res = r.vec(rows * n, 1.0);
        let w = r.vec(n, 1.5);
        let (xb, rb, wb) = (Buf::new(&x), Buf::new(&res), Buf::new(&w));
        // One launch over `parts` blocks a row: (y, x + res, q8 codes, q8 records).
        let run = |parts: u32| {
            let mut y = Buf::filled(rows * n, f32::NAN);
            let mut xo = Buf::filled(rows * n, f32::NAN);
            let mut qs = Buf::filled(rows * n, 0x55i8);
            let mut qd = Buf::filled(rows * n / 32, u64::MAX);
            let (xp, rp, wp, yp, xop, qp, dp) = (
                xb.ptr(),
                rb.ptr(),
                wb.ptr(),
                y.mut_ptr(),
                xo.mut_ptr(),
                qs.mut_ptr(),
                qd.mut_ptr(),
            );
            m.launch(
                "rmsnorm_f32",
                [rows as u32, parts, 1],
                [bd, 1, 1],
                0,
                &|| unsafe {
                    f(
                        xp, n as i64, rp, n as i64, xop, n as i64, wp, yp, n as i64, n as i32, eps,
                        qp, dp,
                    )
                },
            )
            .unwrap();
            (y.to_vec(), xo.to_vec(), qs.to_vec(), qd.to_vec())
        };
        let (y, h, qs, qd) = run(1);
        // Parts (the register path: one block per register slot of the row, as the wrapper
        // launches a decode row, or fewer, as `GGUFTOOL_RMS_PARTS_MAX` caps them): every
        // output bitwise the one-block launch's.
        let slots = n.div_ceil(bd as usize);
        if slots <= 8 {
            for parts in [slots as u32, 3, 2] {
                let (py, ph, pq, pd) = run(parts);
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(u, v)| u.to_bits() == v.to_bits());
                assert!(same(&py, &y), "n {n}, {parts} parts: y");
                assert!(same(&ph, &h), "n {n}, {parts} parts: x + res");
                assert_eq!(pq, qs, "n {n}, {parts} parts: q8 codes");
                assert_eq!(pd, qd, "n {n}, {parts} parts: q8 records");
            }
        }
        // The residual sum is one exact f32 add per element.
        let hs: Vec<f32> = x.iter().zip(&res).map(|(a, b)| a + b).collect();
        assert!(
            h.iter().zip(&hs).all(|(a, b)| a.to_bits() == b.to_bits()),
            "n {n}: x + res"
        );
        // The mean of n squares in f32 (per-thread partial sums + tree): error <= (n/64 + 16)
        // roundings relative; 1/sqrt and two products add 4; the bound is taken normwise
        // (gpu.rs's).
        let tol = (n as f64 / 64.0 + 24.0) * U32;
        let mut worst = 0f64;
        for rr in 0..rows {
            let want = rms_norm_f64(&hs[rr * n..(rr + 1) * n], &w, eps);
            let scale = max_abs(&want);
            for i in 0..n {
                worst = worst.max((f64::from(y[rr * n + i]) - want[i]).abs() / scale);
            }
        }
        say(&format!(
            "rmsnorm {rows}x{n} ({bd} threads): worst {worst:.3e} (tol {tol:.3e})"
        ));
        assert!(worst <= tol, "rmsnorm n {n}: {worst:e} > {tol:e}");
        // The fused q8 epilogue quantizes y exactly as quantize.cu does.
        let (cq, cd, cs) = q8_cpu(&y);
        let recs = qd;
        assert_eq!(qs, cq, "n {n}: q8 codes");
        for (b, rec) in recs.iter().enumerate() {
            assert_eq!(*rec as u32, cd[b].to_bits(), "n {n}: block {b} scale");
            assert_eq!(
                ((*rec >> 32) as u16 as i16, (*rec >> 48) as u16 as i16),
                (cs[2 * b], cs[2 * b + 1]),
                "n {n}: block {b} sums"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// every module

/// Every module but the all-reduce builds for the emulator and exports every entry point its
/// wrapper launches: a kernel edit that breaks the host build (inline assembly without a
/// GGUFTOOL_EMU alternative, a CUDA built-in the shim lacks) fails here, not when someone
/// needs the emulator.
#[test]
fn every_module_builds_and_exports_its_entries() {
    if !compiler("every_module_builds_and_exports_its_entries") {
        return;
    }
    let mut checked = 0usize;
    for op in Op::ALL {
        if op == Op::AllReduce {
            assert!(matches!(
                Module::build(op, &[]),
                Err(kernels_emu::EmuError::Unsupported { .. })
            ));
            continue;
        }
        let m = module(op);
        let names = op.kernel_names();
        assert!(!names.is_empty(), "{op:?}");
        for name in names {
            let entry: Result<unsafe extern "C" fn(), _> = unsafe { m.entry(&name) };
            assert!(entry.is_ok(), "{}: no entry `{name}`", m.name());
            checked += 1;
        }
    }
    say(&format!("{checked} entry points"));
}

// ---------------------------------------------------------------------------------------------
// moe_router.cu

type RouterFn = unsafe extern "C" fn(
    *const f32,
    i64,
    i32,
    *const f32,
    i32,
    i32,
    i32,
    i32,
    f32,
    *mut i32,
    *mut f32,
    i32,
);

/// Runs moe_router_f32 over `tokens` rows of `c.n_experts` logits with the wrapper's block
/// (the experts rounded up to a warp); returns (ids, weights).
fn route(
    logits: &[f32],
    bias: &[f32],
    tokens: usize,
    c: kernels::RouterConfig,
) -> (Vec<i32>, Vec<f32>) {
    let m = module(Op::MoeRouter);
    let f: RouterFn = unsafe { m.entry("moe_router_f32") }.unwrap();
    let e = c.n_experts;
    let (lb, bb) = (Buf::new(logits), Buf::new(bias));
    let mut ids = Buf::filled(tokens * c.top_k, -7i32);
    let mut w = Buf::filled(tokens * c.top_k, f32::NAN);
    let (lp, bp, ip, wp) = (lb.ptr(), bb.ptr(), ids.mut_ptr(), w.mut_ptr());
    let gating = match c.gating {
        kernels::Gating::Sigmoid => 0,
        kernels::Gating::Softmax => 1,
    };
    let block = e.div_ceil(32) as u32 * 32;
    m.launch(
        "moe_router_f32",
        [tokens as u32, 1, 1],
        [block, 1, 1],
        0,
        &|| unsafe {
            f(
                lp,
                e as i64,
                e as i32,
                bp,
                c.n_group as i32,
                c.topk_group as i32,
                c.top_k as i32,
                i32::from(c.norm),
                c.scale,
                ip,
                wp,
                gating,
            )
        },
    )
    .unwrap();
    (ids.to_vec(), w.to_vec())
}

/// The router's two-phase top-k (each warp's candidates, then warp 0's picks) against the HF
/// routing oracle: the GPU test's configurations plus 40 experts (a partial warp of padding
/// threads), 1,024 experts with top-64 (more picks than a warp's candidates can hold), ids equal
/// but for swaps of biased scores within 2 ulps (expf may differ from Rust's exp by one), weights
/// within the GPU test's bound. Then the edge cases the one-phase loop defined: once only NaN
/// scores are left, every further pick is expert 0 (the lowest id, every expert being NaN by
/// then, or a padding thread, which maps to 0); all-NaN rows pick expert 0 throughout.
#[test]
fn moe_router_two_phase_top_k_equals_the_oracle() {
    use kernels::{Gating, RouterConfig};
    if !compiler("moe_router_two_phase_top_k_equals_the_oracle") {
        return;
    }
    let mut r = Rng::new("emu moe_router");
    let cfg =
        |e: usize, n_group: usize, topk_group: usize, top_k: usize, gating: Gating| RouterConfig {
            gating,
            n_experts: e,
            n_group,
            topk_group,
            top_k,
            norm: gating == Gating::Sigmoid,
            scale: if gating == Gating::Sigmoid { 2.5 } else { 1.0 },
        };
    let configs = [
        cfg(256, 1, 1, 8, Gating::Sigmoid),
        cfg(256, 8, 4, 8, Gating::Sigmoid),
        cfg(6, 2, 1, 2, Gating::Sigmoid),
        cfg(64, 1, 1, 4, Gating::Softmax),
        cfg(40, 1, 1, 8, Gating::Sigmoid),
        cfg(1024, 1, 1, 64, Gating::Sigmoid),
        cfg(96, 1, 1, 40, Gating::Sigmoid),
    ];
    for c in configs {
        let tokens = 6;
        let e = c.n_experts;
        let mut logits = r.vec(tokens * e, 4.0);
        let mut bias = r.vec(e, 0.05);
        // A planted exact tie: the lower id must win it.
        bias[e - 1] = bias[0];
        logits[e - 1] = logits[0];
        let (ids, w) = route(&logits, &bias, tokens, c);
        let (ids_ok, worst) = route_check(&ids, &w, &logits, &bias, tokens, c);
        let tol = ROUTE_W_TOL;
        say(&format!(
            "moe_router {c:?}: ids {ids_ok}, worst weight rel {worst:.2e} (tol {tol:.2e})"
        ));
        assert!(ids_ok, "{c:?}: ids {ids:?}");
        assert!(worst <= tol, "{c:?}: weights off by {worst}");
    }
    // NaN scores: 3 finite experts (ids 5, e/2 + 1 and e - 3; e - 3 the best, then 5), the
    // three first, then expert 0 for every further pick; 40 experts (padding threads) likewise;
    // then an all-NaN row: expert 0 throughout.
    for (e, top_k) in [(256usize, 8usize), (40, 8), (96, 40)] {
        let c = cfg(e, 1, 1, top_k, Gating::Sigmoid);
        let bias = vec![0.0f32; e];
        let mut logits = vec![f32::NAN; 2 * e];
        let finite = [(5usize, 1.0f32), (e / 2 + 1, 0.5), (e - 3, 2.0)];
        for (i, v) in finite {
            logits[i] = v;
        }
        let (ids, _) = route(&logits, &bias, 2, c);
        let mut want = vec![(e - 3) as i32, 5, (e / 2 + 1) as i32];
        want.resize(top_k, 0);
        assert_eq!(
            &ids[..top_k],
            want.as_slice(),
            "{e} experts, 3 finite scores"
        );
        assert_eq!(
            &ids[top_k..],
            vec![0; top_k].as_slice(),
            "{e} experts, all NaN"
        );
    }
}
