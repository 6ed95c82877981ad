//! The tensor-core MLA kernel (kernels/cuda/mla.cu `mla_tc_bf16`) under CPU emulation, before any
//! GPU has run it: dense causal and DSA-listed keys, one and several query tokens, head counts
//! that fill 1-4 head tiles or leave rows of a tile empty, one split written directly and several
//! merged by attn_combine_f32, launched with `kernels::mla_tc_plan` exactly as
//! `Gpu::mla_attention` launches, against the f64 oracle the GPU test uses
//! (kernels/tests/common/oracle.rs `mla_tc_expect`). The instruction itself is the emulator's
//! model (`emu_mma_m16n8k16_bf16`, checked against the PTX ISA's fragment formulas in the
//! emulator's self-tests); the GPU test `mla_latent_kernel_matches_f64` pins the hardware to the
//! same oracle. Without a C++ compiler every test prints "skipped: no C++ compiler" and passes.

mod common;
#[path = "../../tests/common/oracle.rs"]
mod oracle;

use common::{compiler, say, Buf};
use kernels::{mla_tc_plan, MlaParams, Op};
use oracle::*;

type MlaFn = unsafe extern "C" fn(MlaParams);
type CombineFn =
    unsafe extern "C" fn(*const f32, i32, i32, i32, *mut f32, i64, i64, i64, *mut i8, *mut u64);

/// GLM-5's key and value widths.
const D: usize = 576;
const DV: usize = 512;

struct Case {
    heads: usize,
    t_len: usize,
    tokens: usize,
    sparse: bool,
    /// SMs the plan is made for (few: several splits and a combine).
    sm: usize,
}

/// attn_combine_f32 over `part`'s `n_split` partials of `tokens` x `heads` rows into `o`
/// (dense `[tokens, heads, DV]`), as `Gpu::mla_attention` merges the splits (no q8 output).
fn combine(part: &mut Buf<f32>, n_split: usize, heads: usize, tokens: usize, o: &mut Buf<f32>) {
    let ma = common::module(Op::Attention);
    let fc: CombineFn = unsafe { ma.entry("attn_combine_f32") }.unwrap();
    let (pp, op) = (part.mut_ptr() as *const f32, o.mut_ptr());
    ma.launch(
        "attn_combine_f32",
        [heads as u32, tokens as u32, 1],
        [256, 1, 1],
        0,
        &|| unsafe {
            fc(
                pp,
                n_split as i32,
                heads as i32,
                DV as i32,
                op,
                (heads * DV) as i64,
                DV as i64,
                tokens as i64,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        },
    )
    .unwrap();
}

/// Runs one case; returns (splits used, worst error / bound).
fn run(case: &Case, r: &mut Rng) -> (usize, f64) {
    let Case {
        heads,
        t_len,
        tokens,
        sparse,
        sm,
    } = *case;
    let c_raw = r.vec(t_len * D, 1.0);
    let c: Vec<f32> = c_raw.iter().map(|&v| bf16_round(v)).collect();
    let cb: Vec<u16> = c_raw
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let q = r.vec(tokens * heads * D, 1.0);
    let pos0 = t_len - tokens;
    let n_keys = 70.min(t_len + 2);
    let lists = mla_key_lists(r, tokens, n_keys, pos0);
    let flat: Vec<i32> = lists.iter().flatten().copied().collect();
    let n_eff = if sparse { n_keys } else { t_len };
    let plan = mla_tc_plan(heads, tokens, n_eff, D, (sm, 227 << 10)).expect("plan");
    let scale = 1.0 / 16.0;
    let (qb, kvb, ib) = (Buf::new(&q), Buf::new(&cb), Buf::new(&flat));
    let mut o = Buf::filled(tokens * heads * DV, f32::NAN);
    let direct = plan.n_split == 1;
    let mut part = Buf::filled(tokens * heads * plan.n_split * (DV + 2), f32::NAN);
    let p = MlaParams {
        q: qb.addr(),
        q_tok: (heads * D) as i64,
        q_head: D as i64,
        kv: kvb.addr(),
        kv_stride: D as i64,
        d: D as i32,
        dv: DV as i32,
        h: heads as i32,
        t: t_len as i32,
        pos: 0,
        pos0: pos0 as i32,
        idx: if sparse { ib.addr() } else { 0 },
        idx_stride: n_keys as i64,
        n_keys: n_keys as i32,
        split_len: plan.split_len as i32,
        scale,
        n_split: plan.n_split as i32,
        heads_per_block: (16 * plan.tiles) as i32,
        stage_q: 0,
        part: if direct { 0 } else { part.mut_ptr() as u64 },
        o: if direct { o.mut_ptr() as u64 } else { 0 },
        o_tok: (heads * DV) as i64,
        o_head: DV as i64,
        rows: 0,
    };
    let m = common::module(Op::Mla);
    let f: MlaFn = unsafe { m.entry("mla_tc_bf16") }.unwrap();
    let grid = [plan.n_split as u32, tokens as u32, plan.head_groups as u32];
    m.launch(
        "mla_tc_bf16",
        grid,
        [plan.threads, 1, 1],
        plan.smem,
        &|| unsafe { f(p) },
    )
    .unwrap();
    if !direct {
        combine(&mut part, plan.n_split, heads, tokens, &mut o);
    }
    let got = o.to_vec();
    let mut worst = 0f64;
    let mut bad = Vec::new();
    for s in 0..tokens {
        let keys = mla_keys_of(sparse.then_some(&lists[..]), s, pos0);
        for h in 0..heads {
            let qh = &q[(s * heads + h) * D..(s * heads + h + 1) * D];
            let (want, tol) = mla_tc_expect(qh, &c, D, DV, &keys, scale);
            for j in 0..DV {
                let gv = f64::from(got[(s * heads + h) * DV + j]);
                let e = (gv - want[j]).abs();
                worst = worst.max(e / tol[j]);
                if !(gv.is_finite() && e <= tol[j]) && bad.len() < 5 {
                    bad.push(format!(
                        "token {s} head {h} col {j}: {gv} against {} (bound {:.3e})",
                        want[j], tol[j]
                    ));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "H {heads} T {t_len} S {tokens} sparse {sparse}: {bad:?}"
    );
    (plan.n_split, worst)
}

#[test]
fn mla_tc_matches_f64_dense_sparse_split_and_direct() {
    if !compiler("mla_tc_matches_f64_dense_sparse_split_and_direct") {
        return;
    }
    let mut r = Rng::new("emu mla_tc");
    let mut splits_seen = (false, false);
    for case in [
        // Decode: 64 heads (4 tiles), splits merged by the combine.
        Case {
            heads: 64,
            t_len: 100,
            tokens: 1,
            sparse: false,
            sm: 132,
        },
        // DSA key lists with empty (-1) and future slots, two tokens, one split.
        Case {
            heads: 64,
            t_len: 90,
            tokens: 2,
            sparse: true,
            sm: 1,
        },
        // 5 heads: one tile with 11 empty rows; several tokens of a causal prefill.
        Case {
            heads: 5,
            t_len: 40,
            tokens: 6,
            sparse: false,
            sm: 8,
        },
        // 20 heads: two tiles, the second partly empty; 33 keys (a partial chunk).
        Case {
            heads: 20,
            t_len: 33,
            tokens: 1,
            sparse: false,
            sm: 1,
        },
    ] {
        let (splits, worst) = run(&case, &mut r);
        splits_seen.0 |= splits == 1;
        splits_seen.1 |= splits > 1;
        say(&format!(
            "mla_tc H {} T {} S {} sparse {}: {splits} splits, worst {worst:.3} of the bound",
            case.heads, case.t_len, case.tokens, case.sparse
        ));
    }
    assert!(
        splits_seen.0 && splits_seen.1,
        "both the direct and the combined output must be exercised"
    );
}

type MlaKernel = (&'static str, u32, usize);

/// A batched step of three sequences in one launch (`MlaParams::rows`: each query token reads
/// its own sequence's cache, key list, length and position), through the tile, decode and
/// tensor-core kernels, each token against the f64 attention over its own sequence's keys. The
/// split length leaves the shorter sequences' last splits empty (their partials must merge to
/// nothing); one launch per kernel writes the output directly. A token reading another
/// sequence's cache, the wrong length or position, or a list row of another token fails.
#[test]
fn mla_rows_read_each_sequences_own_cache() {
    if !compiler("mla_rows_read_each_sequences_own_cache") {
        return;
    }
    let mut r = Rng::new("emu mla rows");
    let heads = 8usize;
    let scale = 1.0 / 16.0;
    // (cache rows, query tokens, sparse)
    let seqs = [(40usize, 1usize, false), (75, 2, true), (9, 1, false)];
    let n_keys = 50usize;
    let caches: Vec<(Vec<f32>, Vec<u16>)> = seqs
        .iter()
        .map(|&(t, _, _)| {
            let raw = r.vec(t * D, 1.0);
            let bits = raw
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            (raw.iter().map(|&v| bf16_round(v)).collect(), bits)
        })
        .collect();
    let lists: Vec<Vec<Vec<i32>>> = seqs
        .iter()
        .map(|&(t, n, _)| mla_key_lists(&mut r, n, n_keys, t - n))
        .collect();
    let tokens: usize = seqs.iter().map(|s| s.1).sum();
    let q = r.vec(tokens * heads * D, 1.0);
    let kv_bufs: Vec<Buf<u16>> = caches.iter().map(|c| Buf::new(&c.1)).collect();
    let idx_bufs: Vec<Buf<i32>> = lists
        .iter()
        .map(|l| Buf::new(&l.iter().flatten().copied().collect::<Vec<i32>>()))
        .collect();
    let mut rows = Vec::new();
    for (i, &(t, n, sparse)) in seqs.iter().enumerate() {
        for j in 0..n {
            rows.push(kernels::MlaRow {
                kv: kv_bufs[i].addr(),
                idx: if sparse {
                    idx_bufs[i].addr() + (j * n_keys * 4) as u64
                } else {
                    0
                },
                t: t as i32,
                pos: (t - n + j) as i32,
            });
        }
    }
    let rows_buf = Buf::new(&rows);
    let qb = Buf::new(&q);
    let cmax = caches
        .iter()
        .flat_map(|c| c.0.iter())
        .fold(0f64, |a, v| a.max(f64::from(v.abs())));
    // (kernel, threads, heads per block); the key splits below.
    let tile_smem = 4 * (32 * (D + 4) + 32 * 32 + 32);
    let tc = mla_tc_plan(heads, 1, 75, D, (1, 227 << 10)).expect("plan");
    let kernels: [MlaKernel; 3] = [
        ("mla_partial_bf16", 64, 8),
        ("mla_decode_bf16", 128, 8),
        ("mla_tc_bf16", tc.threads, 16 * tc.tiles),
    ];
    let m = common::module(Op::Mla);
    let mut bad = Vec::new();
    for (name, threads, hpb) in kernels {
        // 32-key splits (3 for the longest sequence) merged by the combine, then one direct split.
        for split_len in [32usize, 96] {
            let n_split = 75usize.div_ceil(split_len);
            let direct = n_split == 1;
            let mut o = Buf::filled(tokens * heads * DV, f32::NAN);
            let mut part = Buf::filled(tokens * heads * n_split * (DV + 2), f32::NAN);
            let p = MlaParams {
                q: qb.addr(),
                q_tok: (heads * D) as i64,
                q_head: D as i64,
                kv: 0,
                kv_stride: D as i64,
                d: D as i32,
                dv: DV as i32,
                h: heads as i32,
                t: 0,
                pos: 0,
                pos0: 0,
                idx: 0,
                idx_stride: 0,
                n_keys: n_keys as i32,
                split_len: split_len as i32,
                scale,
                n_split: n_split as i32,
                heads_per_block: hpb as i32,
                stage_q: 0,
                part: part.mut_ptr() as u64,
                o: if direct { o.mut_ptr() as u64 } else { 0 },
                o_tok: (heads * DV) as i64,
                o_head: DV as i64,
                rows: rows_buf.addr(),
            };
            let smem = match name {
                "mla_partial_bf16" => tile_smem,
                "mla_tc_bf16" => tc.smem,
                _ => 0,
            };
            let f: MlaFn = unsafe { m.entry(name) }.unwrap();
            let grid = [n_split as u32, tokens as u32, heads.div_ceil(hpb) as u32];
            m.launch(name, grid, [threads, 1, 1], smem, &|| unsafe { f(p) })
                .unwrap();
            // The tile kernel always writes partials.
            if !direct || name == "mla_partial_bf16" {
                combine(&mut part, n_split, heads, tokens, &mut o);
            }
            let got = o.to_vec();
            let mut worst = 0f64;
            let mut row = 0;
            for (i, &(t, n, sparse)) in seqs.iter().enumerate() {
                for j in 0..n {
                    let keys = mla_keys_of(sparse.then_some(&lists[i][..]), j, t - n);
                    for h in 0..heads {
                        let at = (row * heads + h) * D;
                        let qh = &q[at..at + D];
                        let c = &caches[i].0;
                        let (want, tol) = if name == "mla_tc_bf16" {
                            mla_tc_expect(qh, c, D, DV, &keys, scale)
                        } else {
                            let (w, t1) = mla_f32_expect(qh, c, D, DV, &keys, scale, cmax);
                            (w, vec![t1; DV])
                        };
                        for jj in 0..DV {
                            let gv = f64::from(got[(row * heads + h) * DV + jj]);
                            let e = (gv - want[jj]).abs();
                            worst = worst.max(e / tol[jj]);
                            if !(gv.is_finite() && e <= tol[jj]) && bad.len() < 5 {
                                bad.push(format!(
                                    "{name} split {split_len}: seq {i} token {j} head {h} col \
                                     {jj}: {gv} against {} (bound {:.3e})",
                                    want[jj], tol[jj]
                                ));
                            }
                        }
                    }
                    row += 1;
                }
            }
            say(&format!(
                "mla rows {name}, {n_split} splits: worst {worst:.3} of the bound"
            ));
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}
