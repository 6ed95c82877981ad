//! The CPU backend's ops on small synthetic inputs against the defining formulas evaluated
//! independently in f64 (the fixture tests in `tests/tests/forward_*.rs` check the whole forward
//! pass against transformers and llama.cpp).

use gguf::GgmlType;
use runtime::backend::{
    AttnParams, Backend, Gating, IndexerParams, RopeParams, RopeStyle, RouteParams,
};
use runtime::cpu::{CpuBackend, CpuIndex, CpuTensor};
use runtime::weights::HostWeight;

/// Inputs are O(1) and sums have at most a few dozen terms: f32 rounding stays below 1e-5.
const TOL: f64 = 1e-5;

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
        })
        .collect()
}

fn t(rows: usize, cols: usize, seed: u64) -> CpuTensor {
    CpuTensor {
        rows,
        cols,
        data: values(rows * cols, seed),
    }
}

fn close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: {g} vs {w}"
        );
    }
}

#[test]
fn matmul_of_float_weights_is_x_times_w_transposed() {
    let be = CpuBackend;
    let (n, k, m) = (3, 40, 7);
    let x = t(n, k, 1);
    let w = values(m * k, 2);
    let mut want = vec![0f64; n * m];
    for i in 0..n {
        for j in 0..m {
            want[i * m + j] = (0..k)
                .map(|e| x.data[i * k + e] as f64 * w[j * k + e] as f64)
                .sum();
        }
    }
    let f32w = HostWeight::from_f32("w", vec![k, m], &w).unwrap();
    close(&be.matmul(&x, &f32w).unwrap().data, &want, TOL);
    // F16 / BF16 storage of the same values: compare against the rounded weights.
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let bytes: Vec<u8> = w
            .iter()
            .flat_map(|&v| match ty {
                GgmlType::F16 => half::f16::from_f32(v).to_bits().to_le_bytes(),
                _ => half::bf16::from_f32(v).to_bits().to_le_bytes(),
            })
            .collect();
        let hw = HostWeight::from_bytes("w", ty, vec![k, m], bytes).unwrap();
        let wr = hw.to_f32().unwrap();
        let mut want = vec![0f64; n * m];
        for i in 0..n {
            for j in 0..m {
                want[i * m + j] = (0..k)
                    .map(|e| x.data[i * k + e] as f64 * wr[j * k + e] as f64)
                    .sum();
            }
        }
        close(&be.matmul(&x, &hw).unwrap().data, &want, TOL);
    }
    // A wrong inner size is an error, not a panic.
    assert!(be.matmul(&t(2, k + 1, 3), &f32w).is_err());
}

#[test]
fn matmul_heads_multiplies_each_head_by_its_slab() {
    let be = CpuBackend;
    let (n, k, m, h) = (2, 5, 3, 4);
    let x = t(n, h * k, 4);
    let w = values(h * m * k, 5);
    let hw = HostWeight::from_f32("w", vec![k, m, h], &w).unwrap();
    let mut want = vec![0f64; n * h * m];
    for i in 0..n {
        for hh in 0..h {
            for j in 0..m {
                want[i * h * m + hh * m + j] = (0..k)
                    .map(|e| {
                        x.data[i * h * k + hh * k + e] as f64 * w[hh * m * k + j * k + e] as f64
                    })
                    .sum();
            }
        }
    }
    close(&be.matmul_heads(&x, &hw).unwrap().data, &want, TOL);
}

#[test]
fn rms_norm_and_layer_norm_follow_their_definitions() {
    let be = CpuBackend;
    let x = t(3, 8, 6);
    let w = values(4, 7);
    let b = values(8, 8);
    let wn = HostWeight::from_f32("n", vec![4], &w).unwrap();
    // Groups of 4 columns (per-head norms use the same op).
    let got = be.rms_norm(&x, &wn, 1e-6).unwrap();
    let mut want = Vec::new();
    for g in x.data.chunks(4) {
        let ms: f64 = g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 4.0;
        let r = 1.0 / (ms + 1e-6).sqrt();
        want.extend(g.iter().zip(&w).map(|(&v, &wi)| v as f64 * r * wi as f64));
    }
    close(&got.data, &want, TOL);

    let w8 = values(8, 9);
    let ln = be
        .layer_norm(
            &x,
            &HostWeight::from_f32("w", vec![8], &w8).unwrap(),
            &HostWeight::from_f32("b", vec![8], &b).unwrap(),
            1e-6,
        )
        .unwrap();
    let mut want = Vec::new();
    for row in x.data.chunks(8) {
        let mean: f64 = row.iter().map(|&v| v as f64).sum::<f64>() / 8.0;
        let var: f64 = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 8.0;
        for e in 0..8 {
            want.push((row[e] as f64 - mean) / (var + 1e-6).sqrt() * w8[e] as f64 + b[e] as f64);
        }
    }
    close(&ln.data, &want, TOL);
}

/// RoPE rotates pair j by angle pos * theta^(-2j/n_rot): as complex numbers
/// `(x_a + i x_b) * exp(i * angle)`, with pairs adjacent (interleaved) or half apart (NeoX),
/// and leaves the other columns alone.
#[test]
fn rope_rotates_the_right_pairs() {
    let be = CpuBackend;
    let (groups, dim, offset, n_rot) = (2, 12, 4, 8);
    let positions = [0u32, 5, 37];
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        let x0 = t(3, groups * dim, 10);
        let mut x = x0.clone();
        let p = RopeParams {
            n_groups: groups,
            group_dim: dim,
            offset,
            n_rot,
            theta: 10000.0,
            style,
        };
        be.rope(&mut x, &positions, &p).unwrap();
        let mut want: Vec<f64> = x0.data.iter().map(|&v| v as f64).collect();
        for (r, &pos) in positions.iter().enumerate() {
            for g in 0..groups {
                let base = r * groups * dim + g * dim + offset;
                for j in 0..n_rot / 2 {
                    let (a, b) = match style {
                        RopeStyle::Interleaved => (base + 2 * j, base + 2 * j + 1),
                        RopeStyle::Neox => (base + j, base + j + n_rot / 2),
                    };
                    let ang = pos as f64 * 10000f64.powf(-((2 * j) as f64) / n_rot as f64);
                    let (xa, xb) = (x0.data[a] as f64, x0.data[b] as f64);
                    want[a] = xa * ang.cos() - xb * ang.sin();
                    want[b] = xb * ang.cos() + xa * ang.sin();
                }
            }
        }
        close(&x.data, &want, TOL);
    }
    let mut bad = t(2, 12, 1);
    let p = RopeParams {
        n_groups: 1,
        group_dim: 12,
        offset: 8,
        n_rot: 8,
        theta: 1e4,
        style: RopeStyle::Interleaved,
    };
    assert!(be.rope(&mut bad, &[0, 1], &p).is_err());
}

fn softmax_attention(q: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f64) -> Vec<f64> {
    let s: Vec<f64> = keys
        .iter()
        .map(|k| {
            q.iter()
                .zip(*k)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let dv = vals[0].len();
    let mut o = vec![0f64; dv];
    for (w, v) in e.iter().zip(vals) {
        for d in 0..dv {
            o[d] += w / z * v[d] as f64;
        }
    }
    o
}

/// Causal grouped-query attention, dense and restricted to selected keys; values may be a
/// prefix of wider rows (the MLA latent cache read as values).
#[test]
fn attention_is_causal_softmax_over_allowed_keys() {
    let be = CpuBackend;
    let (n_head, n_kv, kd, vd, tlen, n, pos0) = (4, 2, 6, 4, 7, 3, 4);
    let q = t(n, n_head * kd, 11);
    let k = t(tlen, n_kv * kd, 12);
    let v = t(tlen, n_kv * vd + 3, 13); // 3 extra columns per row must be ignored
    let p = AttnParams {
        n_head,
        n_kv_head: n_kv,
        k_dim: kd,
        v_dim: vd,
        scale: 0.37,
        pos0,
    };
    let sel = CpuIndex {
        rows: n,
        cols: 3,
        data: vec![0, 2, -1, 1, 5, 3, 6, 0, 2],
    };
    for selected in [None, Some(&sel)] {
        let got = be.attention(&q, &k, &v, &p, selected).unwrap();
        let mut want = Vec::new();
        for i in 0..n {
            let allowed: Vec<usize> = match selected {
                None => (0..=pos0 + i).collect(),
                Some(s) => s.data[i * 3..i * 3 + 3]
                    .iter()
                    .filter(|&&j| j >= 0 && j as usize <= pos0 + i)
                    .map(|&j| j as usize)
                    .collect(),
            };
            for h in 0..n_head {
                let g = h / (n_head / n_kv);
                let qh = &q.data[i * n_head * kd + h * kd..][..kd];
                let ks: Vec<&[f32]> = allowed
                    .iter()
                    .map(|&j| &k.data[j * k.cols + g * kd..][..kd])
                    .collect();
                let vs: Vec<&[f32]> = allowed
                    .iter()
                    .map(|&j| &v.data[j * v.cols + g * vd..][..vd])
                    .collect();
                want.extend(softmax_attention(qh, &ks, &vs, 0.37));
            }
        }
        close(&got.data, &want, TOL);
    }
}

/// score[t] = sum_h w_h * relu(scale * q_h . k_t) over causal keys; top_k best, ascending;
/// a query with at most top_k causal keys selects all of them.
#[test]
fn indexer_selects_the_best_scoring_causal_keys() {
    let be = CpuBackend;
    let (hn, hd, tlen, top_k) = (2, 3, 6, 3);
    let q = t(tlen, hn * hd, 21);
    let w = t(tlen, hn, 22);
    let keys = t(tlen, hd, 23);
    let p = IndexerParams {
        n_head: hn,
        head_dim: hd,
        scale: 0.5,
        top_k,
        pos0: 0,
    };
    let got = be.indexer_topk(&q, &w, &keys, &p).unwrap();
    assert_eq!((got.rows, got.cols), (tlen, top_k));
    for i in 0..tlen {
        let row = &got.data[i * top_k..(i + 1) * top_k];
        if i < top_k {
            let want: Vec<i32> = (0..top_k as i32)
                .map(|j| if j <= i as i32 { j } else { -1 })
                .collect();
            assert_eq!(row, &want[..], "row {i}");
            continue;
        }
        let score = |tt: usize| -> f64 {
            (0..hn)
                .map(|h| {
                    let d: f64 = (0..hd)
                        .map(|e| {
                            q.data[i * hn * hd + h * hd + e] as f64 * keys.data[tt * hd + e] as f64
                        })
                        .sum();
                    (0.5 * d).max(0.0) * w.data[i * hn + h] as f64
                })
                .sum()
        };
        let mut order: Vec<usize> = (0..=i).collect();
        order.sort_by(|a, b| score(*b).total_cmp(&score(*a)));
        let mut want: Vec<i32> = order[..top_k].iter().map(|&j| j as i32).collect();
        want.sort();
        assert_eq!(row, &want[..], "row {i}");
    }
}

/// DeepSeek-V3 / GLM routing: sigmoid scores, the bias steers the choice only, groups ranked by
/// the sum of their two best biased scores, other groups excluded even where their scores are
/// higher, weights renormalised and scaled.
#[test]
fn router_uses_bias_for_choice_and_groups_to_limit_it() {
    let be = CpuBackend;
    // Two groups of three experts.
    let logits = CpuTensor {
        rows: 1,
        cols: 6,
        data: vec![2.0, 1.9, -3.0, 0.5, 0.4, 0.3],
    };
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    // Bias lifts group 1 (experts 3..5) above group 0 and prefers expert 5 over 4.
    let bias = HostWeight::from_f32("b", vec![6], &[0.0, 0.0, 0.0, 0.5, 0.2, 0.4]).unwrap();
    let p = RouteParams {
        n_expert: 6,
        n_used: 2,
        n_group: 2,
        n_group_used: 1,
        gating: Gating::Sigmoid,
        normalize: true,
        scale: 2.5,
    };
    // Group sums of the two best biased scores: g0 = s(2)+s(1.9) = 1.751; g1 = (s(.5)+.5)+(s(.3)+.4) = 2.097.
    let (w, e) = be.moe_route(&logits, Some(&bias), &p).unwrap();
    let mut pairs: Vec<(i32, f32)> = e.data.iter().copied().zip(w.data.iter().copied()).collect();
    pairs.sort_by_key(|p| p.0);
    assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), vec![3, 5]);
    let (s3, s5) = (sig(0.5), sig(0.3));
    let want = [2.5 * s3 / (s3 + s5), 2.5 * s5 / (s3 + s5)];
    close(&pairs.iter().map(|p| p.1).collect::<Vec<_>>(), &want, TOL);
    // Without groups or bias the two largest sigmoid scores win, unnormalised and unscaled.
    let p1 = RouteParams {
        n_group: 1,
        n_group_used: 1,
        normalize: false,
        scale: 1.0,
        ..p
    };
    let (w, e) = be.moe_route(&logits, None, &p1).unwrap();
    let mut pairs: Vec<(i32, f32)> = e.data.iter().copied().zip(w.data.iter().copied()).collect();
    pairs.sort_by_key(|p| p.0);
    assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
    close(
        &pairs.iter().map(|p| p.1).collect::<Vec<_>>(),
        &[sig(2.0), sig(1.9)],
        TOL,
    );
    // Softmax gating (DeepSeek-V2): probabilities over all experts, top-k of them.
    let p2 = RouteParams {
        gating: Gating::Softmax,
        ..p1
    };
    let (w, e) = be.moe_route(&logits, None, &p2).unwrap();
    let z: f64 = logits.data.iter().map(|&l| (l as f64).exp()).sum();
    let mut pairs: Vec<(i32, f32)> = e.data.iter().copied().zip(w.data.iter().copied()).collect();
    pairs.sort_by_key(|p| p.0);
    assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
    close(
        &pairs.iter().map(|p| p.1).collect::<Vec<_>>(),
        &[2f64.exp() / z, 1.9f64.exp() / z],
        TOL,
    );
}

/// sum_k w_k * down_e(silu(gate_e x) * up_e x) with expert e's rows of the stacked weights.
#[test]
fn moe_ffn_applies_the_chosen_experts() {
    let be = CpuBackend;
    let (d, ff, ne) = (4, 3, 3);
    let x = t(2, d, 31);
    let g = values(ne * ff * d, 32);
    let u = values(ne * ff * d, 33);
    let dn = values(ne * d * ff, 34);
    let gw = HostWeight::from_f32("g", vec![d, ff, ne], &g).unwrap();
    let uw = HostWeight::from_f32("u", vec![d, ff, ne], &u).unwrap();
    let dw = HostWeight::from_f32("d", vec![ff, d, ne], &dn).unwrap();
    let wts = CpuTensor {
        rows: 2,
        cols: 2,
        data: vec![0.7, 1.3, 0.2, 0.9],
    };
    let ids = CpuIndex {
        rows: 2,
        cols: 2,
        data: vec![2, 0, 1, 2],
    };
    let got = be.moe_ffn(&x, &gw, &uw, &dw, &wts, &ids).unwrap();
    let mut want = vec![0f64; 2 * d];
    for r in 0..2 {
        for s in 0..2 {
            let e = ids.data[r * 2 + s] as usize;
            let xr = &x.data[r * d..(r + 1) * d];
            let a: Vec<f64> = (0..ff)
                .map(|j| {
                    let gv: f64 = (0..d)
                        .map(|c| g[e * ff * d + j * d + c] as f64 * xr[c] as f64)
                        .sum();
                    let uv: f64 = (0..d)
                        .map(|c| u[e * ff * d + j * d + c] as f64 * xr[c] as f64)
                        .sum();
                    gv / (1.0 + (-gv).exp()) * uv
                })
                .collect();
            for o in 0..d {
                let y: f64 = (0..ff)
                    .map(|j| dn[e * d * ff + o * ff + j] as f64 * a[j])
                    .sum();
                want[r * d + o] += wts.data[r * 2 + s] as f64 * y;
            }
        }
    }
    close(&got.data, &want, TOL);
    let bad = CpuIndex {
        rows: 2,
        cols: 2,
        data: vec![3, 0, 1, 2],
    };
    assert!(be.moe_ffn(&x, &gw, &uw, &dw, &wts, &bad).is_err());
}

#[test]
fn layout_ops_move_the_right_columns() {
    let be = CpuBackend;
    let x = CpuTensor {
        rows: 2,
        cols: 6,
        data: (0..12).map(|v| v as f32).collect(),
    };
    // Two heads of three columns.
    let s = be.head_slice(&x, 2, 3, 1, 2).unwrap();
    assert_eq!(s.data, vec![1., 2., 4., 5., 7., 8., 10., 11.]);
    let shared = CpuTensor {
        rows: 2,
        cols: 1,
        data: vec![-1., -2.],
    };
    let c = be.head_concat(&s, &shared, 2, true).unwrap();
    assert_eq!(
        c.data,
        vec![1., 2., -1., 4., 5., -1., 7., 8., -2., 10., 11., -2.]
    );
    let per_head = be.head_concat(&s, &s, 2, false).unwrap();
    assert_eq!(&per_head.data[..8], &[1., 2., 1., 2., 4., 5., 4., 5.]);
    let mut cache = be.empty(6).unwrap();
    be.append_rows(&mut cache, &x).unwrap();
    be.append_rows(&mut cache, &x).unwrap();
    assert_eq!(be.shape(&cache), (4, 6));
    be.truncate_rows(&mut cache, 1).unwrap();
    assert_eq!(cache.data, (0..6).map(|v| v as f32).collect::<Vec<_>>());
    assert!(be.append_rows(&mut cache, &s).is_err());
}
