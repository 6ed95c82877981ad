//! Check 2, name mapping, from the headers only: every GGUF tensor maps to an HF name and back to
//! itself, every tensor the architecture needs is present with the shape its metadata implies
//! (a wrong shape is explained where it can be: two tensors swapped, a matrix stored
//! transposed), and with `--hf` the checkpoint's tensors and the GGUF's correspond one to one
//! with matching shapes.

use super::container::metadata_kinds;
use super::report::{CheckResult, Item};
use super::Ctx;
use mappings::arch_check::WrongShape;
use mappings::hf::HfDir;
use mappings::kvb::MlaDims;
use mappings::{map_gguf_names, map_hf_names, GgufName, Kind, Table};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

pub fn run(ctx: &Ctx, hf: Option<&Path>) -> CheckResult {
    let mut r = CheckResult::new(2, "mapping");
    let Some(table) = ctx.table else {
        r.skipped = Some(match ctx.arch_name() {
            Some(a) => format!("no mapping table for architecture {a:?}"),
            None => "the model has no architecture (check 1)".into(),
        });
        return r;
    };
    if ctx.tensors.is_empty() {
        r.skipped = Some("no tensor table could be read (check 1)".into());
        return r;
    }
    let inputs: Vec<GgufName<'_>> = ctx
        .tensors
        .iter()
        .map(|t| GgufName {
            name: &t.name,
            dims: Some(&t.dims),
        })
        .collect();
    let n_expert = ctx.meta_u64(&format!("{}.expert_count", table.arch));
    let fwd = map_gguf_names(table, &inputs, n_expert);
    for u in &fwd.unmapped {
        r.push(
            Item::finding(
                u.clone(),
                format!(
                    "not a {} tensor name ({}): no loader knows what it is",
                    table.arch,
                    ctx.locate(u)
                ),
            )
            .advice(
                "a converter for another architecture or version wrote it; reconvert the model",
            ),
        );
    }
    round_trip(ctx, table, &fwd, &mut r);

    let meta_kinds = metadata_kinds(ctx);
    let mut n_meta = 0;
    if let Some(rep) = &ctx.arch {
        for m in &rep.missing_tensors {
            r.push(
                Item::finding(
                    m.clone(),
                    "expected by the architecture but missing".to_string(),
                )
                .advice(
                    "the conversion dropped it or a shard is missing: reconvert or re-download",
                ),
            );
        }
        for u in &rep.unexpected_tensors {
            if fwd.unmapped.contains(&u.name) {
                continue;
            }
            r.push(Item::finding(
                u.name.clone(),
                format!("{} ({})", u.reason, ctx.locate(&u.name)),
            ));
        }
        for w in &rep.wrong_shapes {
            if meta_kinds.contains_key(&super::kind_of(&w.name)) {
                n_meta += 1;
                continue;
            }
            r.push(
                Item::finding(
                    w.name.clone(),
                    format!(
                        "ne {:?}, but the metadata implies {:?}{} ({})",
                        w.got,
                        w.expected,
                        explain_shape(w, &rep.wrong_shapes),
                        ctx.locate(&w.name)
                    ),
                )
                .advice(
                    "the converter wrote this tensor wrongly: reconvert from the HF checkpoint",
                ),
            );
        }
    }
    if let Some(dir) = hf {
        compare_hf(ctx, table, dir, &mut r);
    }
    let rows = fwd.rows.len();
    r.summary = format!(
        "{} GGUF tensors in {rows} name-table rows, {} mapped to HF and back{}{}",
        ctx.tensors.len(),
        ctx.tensors.len() - fwd.unmapped.len(),
        if n_meta > 0 {
            format!("; {n_meta} shape mismatches are the metadata's (check 1)")
        } else {
            String::new()
        },
        if hf.is_some() {
            "; compared with the --hf checkpoint's names and shapes"
        } else {
            ""
        }
    );
    r
}

/// HF names of the forward map must map back to exactly the GGUF names they came from.
fn round_trip(ctx: &Ctx, table: &Table, fwd: &mappings::NameMap, r: &mut CheckResult) {
    let hf_names: Vec<&str> = fwd
        .rows
        .iter()
        .flat_map(|row| row.hf.iter().map(String::as_str))
        .collect();
    let back = map_hf_names(table, &hf_names);
    let got: BTreeSet<&str> = back
        .rows
        .iter()
        .flat_map(|row| row.gguf.iter().map(String::as_str))
        .collect();
    for row in &fwd.rows {
        if row.kind == Kind::GgufOnly || row.hf.is_empty() {
            continue;
        }
        for g in &row.gguf {
            if !got.contains(g.as_str()) {
                r.push(Item::finding(
                    g.clone(),
                    format!(
                        "maps to HF {} but that does not map back to it ({})",
                        row.hf.join(", "),
                        ctx.locate(g)
                    ),
                ));
            }
        }
    }
    for u in &back.unmapped {
        r.push(Item::finding(
            u.clone(),
            "an HF name produced by the table that the table cannot read back".to_string(),
        ));
    }
}

/// Why a shape may be wrong: exchanged with another tensor of the block, or stored transposed.
fn explain_shape(w: &WrongShape, all: &[WrongShape]) -> String {
    let block = |n: &str| n.split('.').take(2).collect::<Vec<_>>().join(".");
    if let Some(o) = all.iter().find(|o| {
        o.name != w.name
            && block(&o.name) == block(&w.name)
            && o.got == w.expected
            && o.expected == w.got
    }) {
        return format!(
            ": it has the shape {} should have, and {} has its shape: the two are swapped",
            o.name, o.name
        );
    }
    if w.got.len() >= 2 && w.expected.len() == w.got.len() {
        let mut t = w.expected.clone();
        t.swap(0, 1);
        if t == w.got {
            return ": ne0 and ne1 are exchanged, the matrix is stored transposed".into();
        }
    }
    String::new()
}

fn compare_hf(ctx: &Ctx, table: &Table, dir: &Path, r: &mut CheckResult) {
    let hf = match HfDir::open(dir) {
        Ok(h) => h,
        Err(e) => {
            r.push(Item::warning(
                dir.display().to_string(),
                format!("--hf checkpoint cannot be read, not compared: {e}"),
            ));
            return;
        }
    };
    let dims: HashMap<&str, &[u64]> = ctx
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dims.as_slice()))
        .collect();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    for t in &hf.tensors {
        let Some(hit) = table.match_hf(&t.name) else {
            r.push(
                Item::finding(
                    t.name.clone(),
                    format!(
                        "HF tensor {:?} has no GGUF counterpart in the {} table",
                        t.shape, table.arch
                    ),
                )
                .advice("the checkpoint is of another architecture or version than the GGUF"),
            );
            continue;
        };
        let e = hit.entry;
        if e.kind == Kind::HfOnly {
            continue;
        }
        let names = e.gguf_names(hit.idx.bid);
        covered.extend(names.iter().cloned());
        let present: Vec<Option<&[u64]>> = names
            .iter()
            .map(|n| dims.get(n.as_str()).copied())
            .collect();
        if present.iter().any(Option::is_none) {
            let missing: Vec<&str> = names
                .iter()
                .zip(&present)
                .filter(|(_, p)| p.is_none())
                .map(|(n, _)| n.as_str())
                .collect();
            r.push(Item::finding(
                missing.join(", "),
                format!("missing in the GGUF, though the checkpoint has {}", t.name),
            ));
            continue;
        }
        let hf_shape: Vec<u64> = t.shape.clone();
        let want: Option<Vec<u64>> = match (e.kind, present.as_slice()) {
            (Kind::KvB, [Some(k), Some(v)]) => MlaDims::from_ne(k, v)
                .ok()
                .map(|d| d.kv_b_shape().iter().map(|&x| x as u64).collect()),
            (Kind::Experts, [Some(d)]) if d.len() == 3 => {
                if hit.idx.xid.is_some_and(|x| x >= d[2]) {
                    r.push(Item::finding(
                        names[0].clone(),
                        format!("holds {} experts, but the checkpoint has {}", d[2], t.name),
                    ));
                    continue;
                }
                Some(vec![d[1], d[0]])
            }
            (_, [Some(d)]) => Some(d.iter().rev().copied().collect()),
            _ => None,
        };
        if let Some(w) = want {
            if w != hf_shape {
                r.push(Item::finding(
                    names.join(", "),
                    format!(
                        "corresponds to HF {} of shape {hf_shape:?}, but its ne implies {w:?} ({})",
                        t.name,
                        ctx.locate(&names[0])
                    ),
                ));
            }
        }
    }
    for t in &ctx.tensors {
        let Some(hit) = table.match_gguf(&t.name) else {
            continue;
        };
        if hit.entry.kind == Kind::GgufOnly || covered.contains(&t.name) {
            continue;
        }
        r.push(Item::finding(
            t.name.clone(),
            format!(
                "its HF counterpart {} is not in the --hf checkpoint",
                hit.entry.hf_name(hit.idx.bid, Some(0)).unwrap_or_default()
            ),
        ));
    }
}
