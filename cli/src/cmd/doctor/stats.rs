//! Check 3, tensor statistics over the dequantized values, in one pass per tensor (parallel over
//! block ranges): NaN/Inf (located to the first bad block), all-zero and constant tensors are
//! findings; a block whose magnitude is absurd for its tensor is located too. Statistical
//! outliers against the same tensor in other layers are warnings only: healthy models have them.
//! `--quick` reads a sample of blocks per tensor (the first, the last and evenly spaced ones).

use super::report::{CheckResult, Item};
use super::{kind_of, Ctx};
use crate::util;
use gguf::{GgmlType, Model, TensorRef};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// Values one parallel task dequantizes.
const TASK_ELEMS: usize = 1 << 16;
/// Elements per magnitude group for float tensors (block types use their own blocks).
const FLOAT_GROUP: usize = 256;
/// `--quick`: sampled ranges per tensor and bytes per range.
const SAMPLES: u64 = 8;
const SAMPLE_BYTES: u64 = 32 << 10;
/// A block whose largest magnitude exceeds the tensor's median block by this factor is beyond
/// what a trained weight distribution holds (outlier weights reach ~100x): a damaged block.
const BLOCK_FINDING: f64 = 65536.0;
/// Above this factor a block is reported as a warning.
const BLOCK_WARNING: f64 = 1024.0;
/// Fewest blocks for a median block magnitude.
const MIN_BLOCKS: u64 = 16;
/// Same-kind tensors in other layers: a std this far from their median is an outlier (warning).
const OUTLIER_RATIO: f64 = 8.0;
/// Fewest same-kind tensors for a median.
const MIN_SIBLINGS: usize = 3;
/// log2 histogram of block magnitudes: bucket `floor(log2 x) + HIST_BIAS`.
const HIST_BIAS: i32 = 160;
const HIST: usize = 320;

/// Per-range accumulator, merged in tensor order.
#[derive(Clone)]
struct Acc {
    n: u64,
    mean: f64,
    m2: f64,
    min: f32,
    max: f32,
    zeros: u64,
    nan: u64,
    inf: u64,
    groups: u64,
    bad_groups: u64,
    first_bad: Option<u64>,
    /// (largest group magnitude, its group index)
    max_group: (f32, u64),
    zero_groups: u64,
    hist: Vec<u64>,
}

impl Acc {
    fn new() -> Acc {
        Acc {
            n: 0,
            mean: 0.0,
            m2: 0.0,
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            zeros: 0,
            nan: 0,
            inf: 0,
            groups: 0,
            bad_groups: 0,
            first_bad: None,
            max_group: (0.0, 0),
            zero_groups: 0,
            hist: vec![0; HIST],
        }
    }

    /// Adds the values of groups `g0..` (each `group` values long).
    fn add(&mut self, values: &[f32], group: usize, g0: u64) {
        for (gi, g) in values.chunks(group).enumerate() {
            let idx = g0 + gi as u64;
            let mut amax = 0f32;
            let mut bad = false;
            for &v in g {
                if v.is_nan() {
                    self.nan += 1;
                    bad = true;
                    continue;
                }
                if v.is_infinite() {
                    self.inf += 1;
                    bad = true;
                }
                amax = amax.max(v.abs());
                self.min = self.min.min(v);
                self.max = self.max.max(v);
                if v == 0.0 {
                    self.zeros += 1;
                }
            }
            self.groups += 1;
            if bad {
                self.bad_groups += 1;
                self.first_bad.get_or_insert(idx);
            } else if amax == 0.0 {
                self.zero_groups += 1;
            } else {
                let b = (amax.log2().floor() as i32 + HIST_BIAS).clamp(0, HIST as i32 - 1);
                self.hist[b as usize] += 1;
                if amax > self.max_group.0 {
                    self.max_group = (amax, idx);
                }
            }
            // Moments of the group's finite values, merged in (Chan et al.): NaN/Inf are
            // counted, not averaged, so one bad value does not hide the others' spread.
            let (mut gn, mut sum) = (0u64, 0f64);
            for &v in g.iter().filter(|v| v.is_finite()) {
                gn += 1;
                sum += f64::from(v);
            }
            if gn > 0 {
                let gm = sum / gn as f64;
                let m2: f64 = g
                    .iter()
                    .filter(|v| v.is_finite())
                    .map(|&v| (f64::from(v) - gm).powi(2))
                    .sum();
                self.moments(gn, gm, m2);
            }
        }
    }

    /// Chan et al.'s pairwise update of count, mean and squared deviations.
    fn moments(&mut self, n: u64, mean: f64, m2: f64) {
        if n == 0 {
            return;
        }
        let total = self.n + n;
        let d = mean - self.mean;
        self.mean += d * n as f64 / total as f64;
        self.m2 += m2 + d * d * (self.n as f64 * n as f64 / total as f64);
        self.n = total;
    }

    fn merge(mut self, o: Acc) -> Acc {
        self.moments(o.n, o.mean, o.m2);
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.zeros += o.zeros;
        self.nan += o.nan;
        self.inf += o.inf;
        self.groups += o.groups;
        self.bad_groups += o.bad_groups;
        self.first_bad = match (self.first_bad, o.first_bad) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if o.max_group.0 > self.max_group.0 {
            self.max_group = o.max_group;
        }
        self.zero_groups += o.zero_groups;
        for (a, b) in self.hist.iter_mut().zip(&o.hist) {
            *a += b;
        }
        self
    }

    fn std(&self) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            (self.m2 / self.n as f64).sqrt()
        }
    }

    /// Median group magnitude (lower edge of its power-of-two bucket).
    fn median_group(&self) -> Option<f64> {
        let total: u64 = self.hist.iter().sum();
        if total < MIN_BLOCKS {
            return None;
        }
        let mut seen = 0;
        for (b, &c) in self.hist.iter().enumerate() {
            seen += c;
            if seen * 2 >= total {
                return Some(2f64.powi(b as i32 - HIST_BIAS));
            }
        }
        None
    }
}

/// Values per magnitude group and bytes per group.
fn group_of(ty: GgmlType) -> (usize, usize) {
    if ty.is_quantized() {
        (ty.block_size(), ty.type_size())
    } else {
        (FLOAT_GROUP, FLOAT_GROUP * ty.type_size())
    }
}

/// Byte ranges of a tensor to read: all of it, or the `--quick` sample.
fn ranges(n_bytes: u64, group_bytes: u64, quick: bool) -> Vec<(u64, u64)> {
    let per = (SAMPLE_BYTES / group_bytes).max(1) * group_bytes;
    if !quick || n_bytes <= per * SAMPLES {
        return vec![(0, n_bytes)];
    }
    let groups = n_bytes / group_bytes;
    let per_g = per / group_bytes;
    (0..SAMPLES)
        .map(|i| {
            let g = i * (groups - per_g) / (SAMPLES - 1);
            (g * group_bytes, (g + per_g) * group_bytes)
        })
        .collect()
}

fn scan(t: &TensorRef<'_>, data: &[u8], quick: bool) -> Result<Acc, String> {
    let ty = t.info.ty;
    let (group, group_bytes) = group_of(ty);
    // A tensor shorter than one group (a 1-D norm of 64 values) is one group.
    if data.len() < group_bytes {
        let vals = gguf::quant::dequantize_to_vec(ty, data).map_err(|e| e.to_string())?;
        let mut a = Acc::new();
        a.add(&vals, group.max(1), 0);
        return Ok(a);
    }
    let task_groups = (TASK_ELEMS / group).max(1);
    let mut acc = Acc::new();
    for (start, end) in ranges(data.len() as u64, group_bytes as u64, quick) {
        let bytes = &data[start as usize..end as usize];
        let g0 = start / group_bytes as u64;
        let parts: Vec<Result<Acc, String>> = bytes
            .par_chunks(task_groups * group_bytes)
            .enumerate()
            .map(|(ci, chunk)| {
                let mut vals = vec![0f32; chunk.len() / group_bytes * group];
                gguf::quant::dequantize_row(ty, chunk, &mut vals).map_err(|e| e.to_string())?;
                let mut a = Acc::new();
                a.add(&vals, group, g0 + (ci * task_groups) as u64);
                Ok(a)
            })
            .collect();
        for p in parts {
            acc = acc.merge(p?);
        }
    }
    Ok(acc)
}

struct Scanned {
    name: String,
    dims: Vec<u64>,
    acc: Acc,
}

pub fn run(ctx: &Ctx, model: &Model, quick: bool, quiet: bool) -> CheckResult {
    let mut r = CheckResult::new(3, "statistics");
    let tensors: Vec<TensorRef<'_>> = model.tensors().collect();
    let total: u64 = tensors
        .iter()
        .map(|t| {
            let (_, gb) = group_of(t.info.ty);
            ranges(t.info.n_bytes(), gb as u64, quick)
                .iter()
                .map(|(a, b)| b - a)
                .sum::<u64>()
        })
        .sum();
    let pb = util::byte_progress(total, quiet, "doctor: statistics");
    let mut scanned = Vec::with_capacity(tensors.len());
    for t in &tensors {
        if util::check_interrupted().is_err() {
            r.skipped = Some("interrupted".into());
            break;
        }
        let data = model.data(t);
        match scan(t, data, quick) {
            Ok(acc) => {
                judge(ctx, model, t, &acc, quick, &mut r);
                scanned.push(Scanned {
                    name: t.info.name.clone(),
                    dims: t.info.dims.clone(),
                    acc,
                });
            }
            Err(e) => r.push(Item::finding(
                t.info.name.clone(),
                format!("cannot be dequantized: {e} ({})", ctx.locate(&t.info.name)),
            )),
        }
        pb.inc(
            ranges(t.info.n_bytes(), group_of(t.info.ty).1 as u64, quick)
                .iter()
                .map(|(a, b)| b - a)
                .sum(),
        );
    }
    pb.finish_and_clear();
    outliers(&scanned, &mut r);
    r.summary = format!(
        "{} tensors, {} {} dequantized{}",
        scanned.len(),
        util::human_bytes(total),
        if quick { "sampled and" } else { "read and" },
        if quick {
            format!(
                " (--quick: up to {SAMPLES} x {} KiB per tensor)",
                SAMPLE_BYTES >> 10
            )
        } else {
            String::new()
        }
    );
    r
}

const DAMAGED: &str = "the stored bytes are damaged (a bad download, copy or disk) or the conversion overflowed: re-download the shard and compare its sha256; if the source is intact, reconvert";

fn judge(ctx: &Ctx, model: &Model, t: &TensorRef<'_>, a: &Acc, quick: bool, r: &mut CheckResult) {
    let name = &t.info.name;
    let ty = t.info.ty;
    let (group, group_bytes) = group_of(ty);
    let unit = if ty.is_quantized() { "block" } else { "group" };
    let shard = &model.shards()[t.shard];
    let at = |g: u64| shard.data_offset() + t.info.offset + g * group_bytes as u64;
    let shard_name = super::file_name(shard.path());
    let row_len = t.info.dims.first().copied().unwrap_or(1).max(1);
    let sampled = if quick { " of the sampled ones" } else { "" };
    if a.nan + a.inf > 0 {
        let g = a.first_bad.unwrap_or(0);
        let elem = g * group as u64;
        r.push(
            Item::finding(
                name.clone(),
                format!(
                    "{} NaN and {} Inf values in {} of {} {unit}s{sampled}; the first bad {unit} is {g} (element {elem}, row {}) at byte {} of {shard_name}",
                    a.nan,
                    a.inf,
                    a.bad_groups,
                    a.groups,
                    elem / row_len,
                    at(g)
                ),
            )
            .advice(DAMAGED),
        );
        return;
    }
    let count = a.n;
    if count > 0 && a.zeros == count {
        r.push(
            Item::finding(
                name.clone(),
                format!(
                    "every value{} is zero ({} bytes at byte {} of {shard_name})",
                    if quick { " read" } else { "" },
                    t.info.n_bytes(),
                    at(0)
                ),
            )
            .advice("zero-filled data is what an interrupted download, a sparse copy or a failed conversion leaves: re-download or reconvert"),
        );
        return;
    }
    if count > 1 && a.min == a.max {
        r.push(
            Item::finding(
                name.clone(),
                format!(
                    "every value{} equals {} ({})",
                    if quick { " read" } else { "" },
                    a.min,
                    ctx.locate(name)
                ),
            )
            .advice("a constant tensor carries no learned weights (overwritten, or never trained): reconvert from the checkpoint"),
        );
        return;
    }
    if let Some(m) = a.median_group() {
        let (amax, g) = a.max_group;
        let ratio = f64::from(amax) / m;
        if ratio >= BLOCK_WARNING {
            let text = format!(
                "{unit} {g} (element {}, row {}) at byte {} of {shard_name} reaches {amax:e}, {ratio:.0}x the median {unit} magnitude {m:.1e}",
                g * group as u64,
                g * group as u64 / row_len,
                at(g)
            );
            r.push(if ratio >= BLOCK_FINDING {
                Item::finding(name.clone(), format!("{text}: a damaged {unit}")).advice(DAMAGED)
            } else {
                Item::warning(
                    name.clone(),
                    format!("{text} (an outlier; damaged if the model misbehaves)"),
                )
            });
        }
    }
    let zf = a.zeros as f64 / count.max(1) as f64;
    if zf > 0.5 {
        r.push(Item::warning(
            name.clone(),
            format!(
                "{:.0}% of the values are zero ({} all-zero {unit}s{sampled}): partly overwritten?",
                zf * 100.0,
                a.zero_groups
            ),
        ));
    }
}

/// The same tensor kind across layers: a std far from the siblings' median is a warning.
fn outliers(scanned: &[Scanned], r: &mut CheckResult) {
    let mut groups: BTreeMap<String, Vec<&Scanned>> = BTreeMap::new();
    for s in scanned {
        if s.name.starts_with("blk.") {
            groups.entry(kind_of(&s.name)).or_default().push(s);
        }
    }
    for (kind, members) in groups {
        if members.len() < MIN_SIBLINGS {
            continue;
        }
        let mut stds: Vec<f64> = members
            .iter()
            .map(|s| s.acc.std())
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        if stds.len() < MIN_SIBLINGS {
            continue;
        }
        stds.sort_by(f64::total_cmp);
        let med = stds[stds.len() / 2];
        for s in &members {
            let v = s.acc.std();
            if !(v.is_finite() && v > 0.0) || s.dims.is_empty() {
                continue;
            }
            let ratio = if v > med { v / med } else { med / v };
            if ratio >= OUTLIER_RATIO {
                r.push(Item::warning(
                    s.name.clone(),
                    format!(
                        "std {v:.3e} is {ratio:.1}x {} the median {med:.3e} of the {} {kind} tensors (a statistical outlier: healthy models have some)",
                        if v > med { "above" } else { "below" },
                        members.len()
                    ),
                ));
            }
        }
    }
}
