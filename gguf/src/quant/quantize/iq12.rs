//! The 2-bit grid quantizers with 16-value sub-blocks (IQ2_XS, IQ2_S) and the ternary-grid
//! ones (IQ1_S, IQ1_M): ggml's `quantize_row_iq2_xs_impl`, `quantize_row_iq2_s_impl`,
//! `quantize_row_iq1_s_impl` and `quantize_row_iq1_m_impl`, with the float operations in the
//! same order (see the parent module on why that matters).

use super::*;

/// The IQ2 search of a 16-value sub-block: codes 0..3 (magnitudes 1, 3, 5), 19 scales 0.1
/// apart, off-grid groups re-snapped.
const IQ2_16: GridSearch = GridSearch {
    kmaxq: 3,
    steps: 9,
    step: 0.1,
    on_grid_init: true,
    skip_on_grid: true,
};

/// One IQ2 grid from its dequantization table (levels 0x08, 0x19, 0x2b), searched with
/// `nwant` distance levels of neighbours as `iq2xs_init_impl` does for its type.
pub(super) fn iq2_grid(
    cell: &'static std::sync::OnceLock<Result<Iq2Grid, String>>,
    rows: &[[u8; 8]],
    nwant: usize,
) -> Result<&'static Iq2Grid, QuantError> {
    cell.get_or_init(|| Iq2Grid::from_levels(rows, &[0x08, 0x19, 0x2b], nwant, IQ2_MAP_SIZE))
        .as_ref()
        .map_err(|e| QuantError::Tables(e.clone()))
}

pub(super) fn iq2xs_grid() -> Result<&'static Iq2Grid, QuantError> {
    static CELL: std::sync::OnceLock<Result<Iq2Grid, String>> = std::sync::OnceLock::new();
    iq2_grid(&CELL, &tables()?.iq2xs[..], 2)
}

pub(super) fn iq2s_grid() -> Result<&'static Iq2Grid, QuantError> {
    static CELL: std::sync::OnceLock<Result<Iq2Grid, String>> = std::sync::OnceLock::new();
    iq2_grid(&CELL, &tables()?.iq2s[..], 1)
}

/// IQ1_S/IQ1_M's 2048-point grid: its table holds -1, 0, 1, which are codes 0, 1, 2.
pub(super) fn iq1s_grid() -> Result<&'static Iq2Grid, QuantError> {
    static CELL: std::sync::OnceLock<Result<Iq2Grid, String>> = std::sync::OnceLock::new();
    let t = tables()?;
    CELL.get_or_init(|| {
        let rows: Vec<[u8; 8]> = t
            .iq1s
            .iter()
            .map(|r| r.map(|v| v.wrapping_add(1) as u8))
            .collect();
        Iq2Grid::from_levels(&rows, &[0, 1, 2], 3, IQ2_MAP_SIZE)
    })
    .as_ref()
    .map_err(|e| QuantError::Tables(e.clone()))
}

/// The 4-bit sub-block scales of IQ2_XS/IQ2_S relative to `d = max_scale / 31`, two per byte.
fn iq2_scale_nibbles(scales: &[f32; 16], d: f32) -> [u8; 8] {
    let id = 1.0 / d;
    let mut out = [0u8; 8];
    for ib in 0..16 {
        let l = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 15) as u8;
        if ib % 2 == 0 {
            out[ib / 2] = l;
        } else {
            out[ib / 2] |= l << 4;
        }
    }
    out
}

/// Weights `w(i)` of a 16-value sub-block and their square roots.
fn iq2_weights(w: impl Fn(usize) -> f32) -> ([f32; 16], [f32; 16]) {
    let weight: [f32; 16] = std::array::from_fn(w);
    let mut waux = [0.0f32; 16];
    for i in 0..16 {
        waux[i] = weight[i].sqrt();
    }
    (weight, waux)
}

/// `quantize_row_iq2_xs_impl` for one super-block (needs importance weights).
pub(super) fn iq2_xs(x: &[f32], qw: &[f32], g: &Iq2Grid) -> BlockIq2Xs {
    let sigma2 = sum_squares(x) / QK_K as f32;
    let mut qs = [0u16; 32];
    let mut scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    for ib in 0..16 {
        let xb = &x[16 * ib..16 * ib + 16];
        let (weight, waux) = iq2_weights(|i| qw[16 * ib + i] * (sigma2 + xb[i] * xb[i]).sqrt());
        let Some((scale, l, signs)) =
            signed_sub_block::<8, 2, 16, 2>(g, xb, (&weight, &waux), GROUP_MAX_EPS, true, &IQ2_16)
        else {
            scales[ib] = 0.0;
            continue;
        };
        for k in 0..2 {
            // Every code here came from the grid or its neighbour lists (ggml aborts
            // otherwise); index 0 keeps the block decodable should it ever happen.
            let gi = g.map[Iq2Grid::code(&l[8 * k..8 * k + 8])].max(0) as u16;
            qs[2 * ib + k] = gi | u16::from(signs[k]) << 9;
        }
        scales[ib] = scale;
        max_scale = c_max(max_scale, scale);
    }
    if max_scale == 0.0 {
        return BlockIq2Xs {
            d: fp32_to_fp16(0.0),
            qs: [0; 32],
            scales: [0; 8],
        };
    }
    let d = max_scale / 31.0;
    BlockIq2Xs {
        d: fp32_to_fp16(d),
        qs,
        scales: iq2_scale_nibbles(&scales, d),
    }
}

/// `quantize_row_iq2_s_impl` for one super-block; without importance weights each value is
/// weighted by `sigma2 / 4 + x²`.
pub(super) fn iq2_s(x: &[f32], qw: Option<&[f32]>, g: &Iq2Grid) -> BlockIq2S {
    const EPS: f32 = 1e-8; // GROUP_MAX_EPS_IQ2_S
    let mut y = BlockIq2S {
        d: fp32_to_fp16(0.0),
        qs: [0; 32],
        signs: [0; 32],
        qh: [0; 8],
        scales: [0; 8],
    };
    let sigma2 = iq3_sigma2(x);
    let mut scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    for ib in 0..16 {
        let xb = &x[16 * ib..16 * ib + 16];
        let (weight, waux) = iq2_weights(|i| match qw {
            Some(q) => q[16 * ib + i] * (sigma2 + xb[i] * xb[i]).sqrt(),
            None => 0.25 * sigma2 + xb[i] * xb[i],
        });
        let Some((scale, l, signs)) =
            signed_sub_block::<8, 2, 16, 2>(g, xb, (&weight, &waux), EPS, false, &IQ2_16)
        else {
            scales[ib] = 0.0;
            continue;
        };
        for k in 0..2 {
            let gi = g.map[Iq2Grid::code(&l[8 * k..8 * k + 8])].max(0) as usize;
            let i8 = 2 * ib + k;
            y.qs[i8] = (gi & 255) as u8;
            y.qh[i8 / 4] |= ((gi >> 8) << (2 * (i8 % 4))) as u8;
            y.signs[i8] = signs[k];
        }
        scales[ib] = scale;
        max_scale = c_max(max_scale, scale);
    }
    if max_scale == 0.0 {
        return y;
    }
    let d = max_scale / 31.0;
    y.d = fp32_to_fp16(d * 0.9875);
    y.scales = iq2_scale_nibbles(&scales, d);
    y
}

// ---------------------------------------------------------------------------------------------
// IQ1: values -1, 0, 1 shifted by ±delta, groups of 8 on a 2048-point grid.

const IQ1_DELTA: f32 = 0.125; // IQ1S_DELTA = IQ1M_DELTA
/// The shifted levels for a positive and a negative delta.
const IQ1_XP: [f32; 3] = [-1.0 + IQ1_DELTA, IQ1_DELTA, 1.0 + IQ1_DELTA];
const IQ1_XM: [f32; 3] = [-1.0 - IQ1_DELTA, -IQ1_DELTA, 1.0 - IQ1_DELTA];

/// Indices of `xb` in ascending order of value, equal values in index order: glibc's `qsort`
/// (a merge sort for arrays this small) with ggml's `<`/`>` comparator. -0.0 and 0.0 compare
/// equal as in C; NaNs get some fixed place (ggml's comparator is no order for them).
fn ascending<const E: usize>(xb: &[f32]) -> [usize; E] {
    let key = |i: usize| if xb[i] == 0.0 { 0.0 } else { xb[i] };
    let mut idx: [usize; E] = std::array::from_fn(|i| i);
    idx.sort_by(|&a, &b| key(a).total_cmp(&key(b)));
    idx
}

impl Iq2Grid {
    /// `iq1_find_best_neighbour2`: the candidate whose shifted levels `xg` at `scale` have the
    /// least weighted squared error to `xb` (first on ties); writes its codes to `l`. Should
    /// no distance be below `f32::MAX` (only with non-finite input, where ggml reads out of
    /// bounds) the first candidate is taken.
    fn best_shifted(
        &self,
        u: usize,
        xb: &[f32],
        weight: &[f32],
        scale: f32,
        xg: &[f32; 3],
        l: &mut [i8],
    ) -> usize {
        let start = (-self.map[u] - 1) as usize;
        let n = usize::from(self.neighbours[start]);
        let mut best_d2 = f32::MAX;
        let mut best = usize::from(self.neighbours[start + 1]);
        for &j in &self.neighbours[start + 1..start + 1 + n] {
            let pg = &self.points[usize::from(j)];
            let mut d2 = 0.0f32;
            for i in 0..8 {
                let q = xg[usize::from((pg[i] - 1) / 2)];
                let diff = scale * q - xb[i];
                d2 += weight[i] * diff * diff;
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = usize::from(j);
            }
        }
        for i in 0..8 {
            l[i] = ((self.points[best][i] - 1) / 2) as i8;
        }
        best
    }

    /// Grid indices of the `E / 8` groups of codes `l` (each snapped to its best shifted
    /// neighbour when off the grid, `xg(k)` giving group `k`'s levels), then the scale refitted
    /// if any group moved. Returns the indices and the scale.
    fn snap_iq1<const E: usize>(
        &self,
        xb: &[f32],
        weight: &[f32; E],
        mut scale: f32,
        xg: impl Fn(usize) -> &'static [f32; 3],
        l: &mut [i8; E],
    ) -> ([usize; 4], f32) {
        let mut index = [0usize; 4];
        let mut all_on_grid = true;
        for k in 0..E / 8 {
            let r = 8 * k..8 * k + 8;
            let u = Self::code(&l[r.clone()]);
            index[k] = if self.map[u] >= 0 {
                self.map[u] as usize
            } else {
                all_on_grid = false;
                self.best_shifted(
                    u,
                    &xb[r.clone()],
                    &weight[r.clone()],
                    scale,
                    xg(k),
                    &mut l[r],
                )
            };
        }
        if !all_on_grid {
            let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
            for k in 0..E / 8 {
                let pg = &self.points[index[k]];
                let xx = xg(k);
                for j in 0..8 {
                    let w = weight[8 * k + j];
                    let q = xx[usize::from((pg[j] - 1) / 2)];
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
            if sumqx > 0.0 && sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }
        (index, scale)
    }
}

/// The largest absolute value (ggml's `MAX` chain of `fabsf`).
fn abs_max(xb: &[f32]) -> f32 {
    let mut max = xb[0].abs();
    for v in &xb[1..] {
        max = c_max(max, v.abs());
    }
    max
}

/// Codes from the two split points of the ascending order: below `i1` 0, below `i2` 1, else 2.
/// A negative `scale` is made positive with the codes mirrored (`2 - l`); returns whether it
/// was (the delta signs flip too).
fn split_codes<const E: usize>(
    idx: &[usize; E],
    (i1, i2): (usize, usize),
    scale: &mut f32,
) -> ([i8; E], bool) {
    let mut l = [0i8; E];
    for (j, &i) in idx.iter().enumerate() {
        l[i] = if j < i1 {
            0
        } else if j < i2 {
            1
        } else {
            2
        };
    }
    let mirrored = *scale < 0.0;
    if mirrored {
        for v in l.iter_mut() {
            *v = 2 - *v;
        }
        *scale = -*scale;
    }
    (l, mirrored)
}

/// `quantize_row_iq1_s_impl` for one super-block (needs importance weights): 8 sub-blocks of
/// 32 with a 3-bit scale and a delta sign each.
pub(super) fn iq1_s(x: &[f32], qw: &[f32], g: &Iq2Grid) -> BlockIq1S {
    const EPS: f32 = 1e-12; // GROUP_MAX_EPS_IQ1_S
    let mut y = BlockIq1S {
        d: fp32_to_fp16(0.0),
        qs: [0; 32],
        qh: [0; 8],
    };
    let sigma2 = iq3_sigma2(x);
    let mut scales = [0.0f32; 8];
    let mut shifts = [1i8; 8];
    let mut max_scale = 0.0f32;
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let weight: [f32; 32] =
            std::array::from_fn(|i| qw[32 * ib + i] * (sigma2 + xb[i] * xb[i]).sqrt());
        let max = abs_max(xb);
        if max < EPS {
            scales[ib] = 0.0;
            shifts[ib] = 1;
            continue;
        }
        // Exhaustive search of the two boundaries splitting the sorted values into the three
        // levels, from prefix sums of w x and w.
        let idx = ascending::<32>(xb);
        let mut sumx = [0.0f32; 33];
        let mut sumw = [0.0f32; 33];
        for j in 0..32 {
            let i = idx[j];
            sumx[j + 1] = sumx[j] + weight[i] * xb[i];
            sumw[j + 1] = sumw[j] + weight[i];
        }
        let mut best_score = -f32::MAX;
        let mut scale = max;
        let mut besti = None;
        let mut best_shift = 0i8;
        for i1 in 0..=32 {
            for i2 in i1..=32 {
                for (xs, shift) in [(&IQ1_XP, 1i8), (&IQ1_XM, -1)] {
                    let sumqx = (sumx[i1] - sumx[0]) * xs[0]
                        + (sumx[i2] - sumx[i1]) * xs[1]
                        + (sumx[32] - sumx[i2]) * xs[2];
                    let sumq2 = (sumw[i1] - sumw[0]) * xs[0] * xs[0]
                        + (sumw[i2] - sumw[i1]) * xs[1] * xs[1]
                        + (sumw[32] - sumw[i2]) * xs[2] * xs[2];
                    if sumq2 > 0.0 && sumqx * sumqx > best_score * sumq2 {
                        scale = sumqx / sumq2;
                        best_score = scale * sumqx;
                        besti = Some((i1, i2));
                        best_shift = shift;
                    }
                }
            }
        }
        let Some(split) = besti else {
            scales[ib] = 0.0;
            shifts[ib] = 1;
            continue;
        };
        let (mut l, mirrored) = split_codes(&idx, split, &mut scale);
        if mirrored {
            best_shift = -best_shift;
        }
        let xx: &'static [f32; 3] = if best_shift == 1 { &IQ1_XP } else { &IQ1_XM };
        let (index, scale) = g.snap_iq1(xb, &weight, scale, |_| xx, &mut l);
        let mut h = 0u16;
        for k in 0..4 {
            y.qs[4 * ib + k] = (index[k] & 255) as u8;
            h |= ((index[k] >> 8) << (3 * k)) as u16;
        }
        y.qh[ib] = h;
        scales[ib] = scale;
        shifts[ib] = best_shift;
        max_scale = c_max(max_scale, scale);
    }
    if max_scale == 0.0 {
        return y;
    }
    let d = max_scale / 15.0;
    y.d = fp32_to_fp16(d * 1.125);
    let id = 1.0 / d;
    for ib in 0..8 {
        let mut l = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 7) as u16;
        if shifts[ib] == -1 {
            l |= 8;
        }
        y.qh[ib] |= l << 12;
    }
    y
}

/// IQ1_M's levels of group `k` (0 or 1) of a sub-block with shift pattern `s`: bit 1 of `s`
/// negates the first group's delta, bit 0 the second's.
fn iq1m_levels(s: usize, k: usize) -> &'static [f32; 3] {
    let negative = if k == 0 { s >= 2 } else { s % 2 == 1 };
    if negative {
        &IQ1_XM
    } else {
        &IQ1_XP
    }
}

/// IQ1_M's weights of a 16-value sub-block.
fn iq1m_weights(xb: &[f32], qw: Option<&[f32]>, sigma2: f32) -> [f32; 16] {
    std::array::from_fn(|i| match qw {
        Some(q) => q[i] * (sigma2 + xb[i] * xb[i]).sqrt(),
        None => xb[i] * xb[i],
    })
}

/// `quantize_row_iq1_m_impl` for one super-block: 16 sub-blocks of 16, each half with its own
/// delta sign, 3-bit scales, the f16 super-scale spread over the scales' top nibbles.
pub(super) fn iq1_m(x: &[f32], qw: Option<&[f32]>, g: &Iq2Grid) -> BlockIq1M {
    const EPS: f32 = 1e-7; // GROUP_MAX_EPS_IQ1_M
    const MASKS: [u8; 4] = [0x00, 0x80, 0x08, 0x88];
    let mut qs = [0u8; 32];
    let mut qh = [0u8; 16];
    let sigma2 = iq3_sigma2(x);
    let mut scales = [0.0f32; 16];
    let mut shifts = [0usize; 16];
    let mut max_scale = 0.0f32;
    let (p2, m2) = (IQ1_XP[2], IQ1_XM[2]);
    let cp1 = IQ1_XP[0] * IQ1_XP[0] - IQ1_XP[1] * IQ1_XP[1];
    let cp2 = IQ1_XP[1] * IQ1_XP[1] - IQ1_XP[2] * IQ1_XP[2];
    let cm1 = IQ1_XM[0] * IQ1_XM[0] - IQ1_XM[1] * IQ1_XM[1];
    let cm2 = IQ1_XM[1] * IQ1_XM[1] - IQ1_XM[2] * IQ1_XM[2];
    for ib in 0..16 {
        let xb = &x[16 * ib..16 * ib + 16];
        let weight = iq1m_weights(xb, qw.map(|q| &q[16 * ib..16 * ib + 16]), sigma2);
        let max = abs_max(xb);
        if max < EPS {
            scales[ib] = 0.0;
            shifts[ib] = 0;
            continue;
        }
        // Prefix sums per half (each half has its own delta sign); since the levels are one
        // apart, a split's sums reduce to totals minus the two prefix sums.
        let idx = ascending::<16>(xb);
        let mut px = [[0.0f32; 17]; 2];
        let mut pw = [[0.0f32; 17]; 2];
        for j in 0..16 {
            let i = idx[j];
            let h = usize::from(i >= 8);
            px[h][j + 1] = px[h][j] + weight[i] * xb[i];
            px[1 - h][j + 1] = px[1 - h][j];
            pw[h][j + 1] = pw[h][j] + weight[i];
            pw[1 - h][j + 1] = pw[1 - h][j];
        }
        let txs = [px[0][16], px[1][16]];
        let tws = [pw[0][16], pw[1][16]];
        let mut best_score = -f32::MAX;
        let mut scale = max;
        let mut besti = None;
        let mut best_k = 0usize;
        for i1 in 0..=16 {
            for i2 in i1..=16 {
                let mut qx_p = [0.0f32; 2];
                let mut qx_m = [0.0f32; 2];
                let mut q2_p = [0.0f32; 2];
                let mut q2_m = [0.0f32; 2];
                for h in 0..2 {
                    let sx = px[h][i1] + px[h][i2];
                    qx_p[h] = txs[h] * p2 - sx;
                    qx_m[h] = txs[h] * m2 - sx;
                    q2_p[h] = tws[h] * p2 * p2 + pw[h][i1] * cp1 + pw[h][i2] * cp2;
                    q2_m[h] = tws[h] * m2 * m2 + pw[h][i1] * cm1 + pw[h][i2] * cm2;
                }
                let sumqx = [
                    qx_p[0] + qx_p[1],
                    qx_p[0] + qx_m[1],
                    qx_m[0] + qx_p[1],
                    qx_m[0] + qx_m[1],
                ];
                let sumq2 = [
                    q2_p[0] + q2_p[1],
                    q2_p[0] + q2_m[1],
                    q2_m[0] + q2_p[1],
                    q2_m[0] + q2_m[1],
                ];
                for k in 0..4 {
                    if sumq2[k] > 0.0 && sumqx[k] * sumqx[k] > best_score * sumq2[k] {
                        scale = sumqx[k] / sumq2[k];
                        best_score = scale * sumqx[k];
                        besti = Some((i1, i2));
                        best_k = k;
                    }
                }
            }
        }
        let Some(split) = besti else {
            scales[ib] = 0.0;
            shifts[ib] = 0;
            continue;
        };
        let (mut l, mirrored) = split_codes(&idx, split, &mut scale);
        if mirrored {
            best_k = 3 - best_k;
        }
        let (index, scale) = g.snap_iq1(xb, &weight, scale, |k| iq1m_levels(best_k, k), &mut l);
        qs[2 * ib] = (index[0] & 255) as u8;
        qs[2 * ib + 1] = (index[1] & 255) as u8;
        qh[ib] = ((index[0] >> 8) | ((index[1] >> 8) << 4)) as u8;
        scales[ib] = scale;
        shifts[ib] = best_k;
        max_scale = c_max(max_scale, scale);
    }
    let mut sc = [0u16; 4];
    if max_scale != 0.0 {
        // The super-scale is refitted to the chosen grid points and 3-bit scales.
        let mut d = max_scale / 15.0;
        let id = 1.0 / d;
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for ib in 0..16 {
            let l = nearest_int(0.5 * (id * scales[ib] - 1.0)).clamp(0, 7);
            sc[ib / 4] |= (l as u16) << (3 * (ib % 4));
            qh[ib] |= MASKS[shifts[ib]];
            let xb = &x[16 * ib..16 * ib + 16];
            let weight = iq1m_weights(xb, qw.map(|q| &q[16 * ib..16 * ib + 16]), sigma2);
            for k in 0..2 {
                let xx = iq1m_levels(shifts[ib], k);
                let gi =
                    usize::from(qs[2 * ib + k]) + ((usize::from(qh[ib]) << (8 - 4 * k)) & 0x700);
                let pg = &g.points[gi];
                for j in 0..8 {
                    let w = weight[8 * k + j];
                    let q = xx[usize::from((pg[j] - 1) / 2)] * (2 * l + 1) as f32;
                    sumqx += w * q * xb[8 * k + j];
                    sumq2 += w * q * q;
                }
            }
        }
        if sumq2 > 0.0 {
            d = sumqx / sumq2;
        }
        let s = fp32_to_fp16(d * 1.1125);
        sc[0] |= (s & 0x000f) << 12;
        sc[1] |= (s & 0x00f0) << 8;
        sc[2] |= (s & 0x0f00) << 4;
        sc[3] |= s & 0xf000;
    }
    let mut scales_bytes = [0u8; 8];
    for (o, v) in scales_bytes.chunks_exact_mut(2).zip(sc) {
        o.copy_from_slice(&v.to_le_bytes());
    }
    BlockIq1M {
        qs,
        qh,
        scales: scales_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml builds these grids from code lists in ascending order and its map indexes them by
    /// code; decoding the dequantization tables must give the same points in the same order,
    /// every point findable through the map.
    #[test]
    fn grids_decode_to_ascending_codes_that_the_map_finds() {
        for (name, g, n) in [
            ("IQ2_XS", iq2xs_grid(), 512),
            ("IQ2_S", iq2s_grid(), 1024),
            ("IQ1_S", iq1s_grid(), 2048),
        ] {
            let g = g.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(g.points.len(), n, "{name}");
            let codes: Vec<usize> = g
                .points
                .iter()
                .map(|p| Iq2Grid::code(&p.map(|v| ((v - 1) / 2) as i8)))
                .collect();
            assert!(codes.windows(2).all(|w| w[0] < w[1]), "{name}");
            for (i, &c) in codes.iter().enumerate() {
                assert_eq!(g.map[c], i as i32, "{name} point {i}");
            }
            // Every off-grid code has at least one candidate.
            for (u, &m) in g.map.iter().enumerate() {
                if m < 0 {
                    let start = (-m - 1) as usize;
                    assert!(g.neighbours[start] > 0, "{name} code {u}");
                }
            }
        }
    }

    #[test]
    fn ascending_is_stable_and_treats_signed_zeros_alike() {
        let x = [0.5f32, -0.0, 0.0, -1.0, 0.5, -0.0, 2.0, 0.0];
        assert_eq!(ascending::<8>(&x), [3, 1, 2, 5, 7, 0, 4, 6]);
    }

    /// Zero, tiny, huge and non-finite rows: the quantizers return blocks of the right size
    /// and never panic; an all-zero super-block is the all-zero block (as in ggml).
    #[test]
    fn hostile_rows_quantize_without_panicking() {
        let w = [1.0f32; QK_K];
        let rows: [Vec<f32>; 5] = [
            vec![0.0; QK_K],
            (0..QK_K).map(|i| (i as f32 - 128.0) * 1e-30).collect(),
            (0..QK_K)
                .map(|i| if i % 3 == 0 { 3e38 } else { -1e-3 })
                .collect(),
            (0..QK_K)
                .map(|i| if i == 7 { f32::NAN } else { i as f32 })
                .collect(),
            (0..QK_K)
                .map(|i| {
                    if i % 2 == 0 {
                        f32::INFINITY
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect(),
        ];
        for ty in [
            GgmlType::IQ2_XS,
            GgmlType::IQ2_S,
            GgmlType::IQ1_S,
            GgmlType::IQ1_M,
        ] {
            for (r, x) in rows.iter().enumerate() {
                let mut out = vec![0xa5u8; ty.type_size()];
                quantize_rows(ty, x, QK_K, Some(&w), &mut out)
                    .unwrap_or_else(|e| panic!("{ty} row {r}: {e}"));
                if r == 0 {
                    assert!(out.iter().all(|&b| b == 0), "{ty}: {out:?}");
                }
            }
        }
        for ty in [GgmlType::IQ2_XS, GgmlType::IQ1_S] {
            let mut out = vec![0u8; ty.type_size()];
            assert!(
                quantize_rows(ty, &rows[1], QK_K, None, &mut out).is_err(),
                "{ty}"
            );
        }
    }
}
