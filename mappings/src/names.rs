//! Name tables for a concrete model: the rows `gguftool map` prints, built from a list of tensor
//! names in either scheme. Composite tensors (stacked experts, kv_b split, tied embeddings) come out
//! as one row listing every name on both sides.

use crate::table::{Entry, Indices, Kind, Table};
use serde::Serialize;
use std::collections::BTreeMap;

/// Which way names are mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Direction {
    #[serde(rename = "hf-to-gguf")]
    HfToGguf,
    #[serde(rename = "gguf-to-hf")]
    GgufToHf,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::HfToGguf => "hf-to-gguf",
            Direction::GgufToHf => "gguf-to-hf",
        }
    }
}

/// One row: the HF tensors and GGUF tensors that are the same weights.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MapRow {
    pub kind: Kind,
    /// GGUF names (two for kv_b: attn_k_b, attn_v_b; none for hf_only).
    pub gguf: Vec<String>,
    /// HF on-disk names (one per expert for experts, in expert order; none for gguf_only).
    pub hf: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The name table of one model.
#[derive(Debug, Clone, Serialize)]
pub struct NameMap {
    pub arch: String,
    pub direction: Direction,
    pub rows: Vec<MapRow>,
    /// Input names no entry matches.
    pub unmapped: Vec<String>,
    /// Observations about the set as a whole (incomplete composites, tied embeddings, ...).
    pub notes: Vec<String>,
}

/// A GGUF tensor as `map` sees it: its name and, when known, its ggml `ne`.
#[derive(Debug, Clone, Copy)]
pub struct GgufName<'a> {
    pub name: &'a str,
    pub dims: Option<&'a [u64]>,
}

impl<'a> GgufName<'a> {
    /// Every tensor of an opened model (all shards, file order), dims known.
    pub fn of_model(m: &'a gguf::Model) -> Vec<GgufName<'a>> {
        m.tensors()
            .map(|r| GgufName {
                name: &r.info.name,
                dims: Some(&r.info.dims),
            })
            .collect()
    }
}

fn composite_note(e: &Entry) -> Option<String> {
    let base = match e.kind {
        Kind::Experts => Some(
            "stacked experts: HF expert E is slice E along ggml ne2 (torch dim 0) of the GGUF tensor"
                .to_string(),
        ),
        Kind::HfOnly => Some("dropped by the converter".to_string()),
        Kind::GgufOnly => Some("no HF tensor".to_string()),
        _ => None,
    };
    match (base, &e.note) {
        (Some(b), Some(n)) => Some(format!("{b}; {n}")),
        (Some(b), None) => Some(b),
        (None, n) => n.clone(),
    }
}

/// Maps HF names (as stored on disk) to GGUF names.
pub fn map_hf_names(table: &Table, names: &[&str]) -> NameMap {
    let mut rows: Vec<MapRow> = Vec::new();
    // (entry, bid) -> row index, so the experts of one block gather into one row
    let mut groups: BTreeMap<(usize, Option<u64>), usize> = BTreeMap::new();
    let mut experts: BTreeMap<usize, Vec<(u64, String)>> = BTreeMap::new();
    let mut unmapped = Vec::new();
    for &name in names {
        let Some(hit) = table.match_hf(name) else {
            unmapped.push(name.to_string());
            continue;
        };
        let e = hit.entry;
        let key = (hit.entry_index, hit.idx.bid);
        match e.kind {
            Kind::Experts => {
                let row = *groups.entry(key).or_insert_with(|| {
                    rows.push(MapRow {
                        kind: e.kind,
                        gguf: e.gguf_names(hit.idx.bid),
                        hf: vec![],
                        note: composite_note(e),
                    });
                    rows.len() - 1
                });
                experts
                    .entry(row)
                    .or_default()
                    .push((hit.idx.xid.unwrap_or(0), name.to_string()));
            }
            _ => rows.push(MapRow {
                kind: e.kind,
                gguf: if e.kind == Kind::HfOnly {
                    vec![]
                } else {
                    e.gguf_names(hit.idx.bid)
                },
                hf: vec![name.to_string()],
                note: composite_note(e),
            }),
        }
    }
    let mut notes = Vec::new();
    for (row, mut list) in experts {
        list.sort();
        // Gaps mean the GGUF tensor cannot be stacked: say which experts are missing.
        let got: Vec<u64> = list.iter().map(|(x, _)| *x).collect();
        let max = got.last().copied().unwrap_or(0);
        let missing: Vec<u64> = (0..=max).filter(|x| !got.contains(x)).collect();
        if !missing.is_empty() {
            notes.push(format!(
                "{}: experts {missing:?} missing, cannot stack",
                rows[row].gguf.join(", ")
            ));
        }
        rows[row].hf = list.into_iter().map(|(_, n)| n).collect();
    }
    tied_note_hf(table, names, &mut rows);
    NameMap {
        arch: table.arch.clone(),
        direction: Direction::HfToGguf,
        rows,
        unmapped,
        notes,
    }
}

fn tied_note_hf(table: &Table, names: &[&str], rows: &mut Vec<MapRow>) {
    for e in table.entries.iter().filter(|e| e.tied_to.is_some()) {
        let (Some(hf), Some(target)) = (e.hf_name(None, None), e.tied_to.as_ref()) else {
            continue;
        };
        let Some(t) = table.entry_by_gguf_template(target) else {
            continue;
        };
        let Some(t_hf) = t.hf_name(None, None) else {
            continue;
        };
        let present = |n: &str| names.iter().any(|x| table.canonical_hf(x) == n);
        if !present(&hf) && present(&t_hf) {
            rows.push(MapRow {
                kind: Kind::Tied,
                gguf: vec![],
                hf: vec![],
                note: Some(format!(
                    "tie_word_embeddings: no {hf}, so no {}; the output head uses {target} ({t_hf})",
                    e.gguf_names(None).join(", ")
                )),
            });
        }
    }
}

/// Maps GGUF names to HF names. The expert count of a stacked tensor comes from its `ne[2]` when
/// known, else from `n_expert`; without either, the HF names keep an `{xid}` placeholder.
pub fn map_gguf_names(table: &Table, tensors: &[GgufName<'_>], n_expert: Option<u64>) -> NameMap {
    let mut rows: Vec<MapRow> = Vec::new();
    // (entry, block) -> (row index, the parts seen so far: attn_k_b, attn_v_b)
    type Parts = (usize, Vec<Option<String>>);
    let mut kvb: BTreeMap<(usize, Option<u64>), Parts> = BTreeMap::new();
    let mut unmapped = Vec::new();
    let mut notes = Vec::new();
    for t in tensors {
        let Some(hit) = table.match_gguf(t.name) else {
            unmapped.push(t.name.to_string());
            continue;
        };
        let e = hit.entry;
        let bid = hit.idx.bid;
        match e.kind {
            Kind::KvB => {
                let (row, parts) = kvb.entry((hit.entry_index, bid)).or_insert_with(|| {
                    rows.push(MapRow {
                        kind: e.kind,
                        gguf: vec![],
                        hf: e.hf_name(bid, None).into_iter().collect(),
                        note: composite_note(e),
                    });
                    (rows.len() - 1, vec![None; e.gguf.len()])
                });
                parts[hit.part] = Some(t.name.to_string());
                rows[*row].gguf = parts.iter().flatten().cloned().collect();
            }
            Kind::Experts => {
                let n = t
                    .dims
                    .and_then(|d| (d.len() == 3).then(|| d[2]))
                    .or(n_expert);
                let hf = match n {
                    Some(n) => (0..n).filter_map(|x| e.hf_name(bid, Some(x))).collect(),
                    None => {
                        notes.push(format!(
                            "{}: expert count unknown, HF names shown with {{xid}}",
                            t.name
                        ));
                        e.hf.as_ref()
                            .map(|p| p.render(Indices { bid, xid: None }))
                            .into_iter()
                            .collect()
                    }
                };
                rows.push(MapRow {
                    kind: e.kind,
                    gguf: vec![t.name.to_string()],
                    hf,
                    note: composite_note(e),
                });
            }
            _ => rows.push(MapRow {
                kind: e.kind,
                gguf: vec![t.name.to_string()],
                hf: e.hf_name(bid, None).into_iter().collect(),
                note: composite_note(e),
            }),
        }
    }
    for ((ei, bid), (_, parts)) in &kvb {
        if parts.iter().any(Option::is_none) {
            let missing: Vec<String> = table.entries[*ei]
                .gguf_names(*bid)
                .into_iter()
                .zip(parts)
                .filter(|(_, p)| p.is_none())
                .map(|(n, _)| n)
                .collect();
            notes.push(format!(
                "kv_b split incomplete: {} missing, kv_b_proj cannot be reassembled",
                missing.join(", ")
            ));
        }
    }
    // Tied output head: the GGUF has no output.weight but has token_embd.weight.
    for e in table.entries.iter().filter(|e| e.tied_to.is_some()) {
        let (Some(target), Some(own)) = (e.tied_to.as_ref(), e.gguf_names(None).first().cloned())
        else {
            continue;
        };
        let present = |n: &str| tensors.iter().any(|t| t.name == n);
        if !present(&own) && present(target) {
            let t_hf = table
                .entry_by_gguf_template(target)
                .and_then(|t| t.hf_name(None, None))
                .unwrap_or_default();
            rows.push(MapRow {
                kind: Kind::Tied,
                gguf: vec![],
                hf: vec![],
                note: Some(format!(
                    "tied embeddings: no {own} in the GGUF, so the HF checkpoint has no {} \
                     (tie_word_embeddings = true); the head uses {t_hf}",
                    e.hf_name(None, None).unwrap_or_default()
                )),
            });
        }
    }
    NameMap {
        arch: table.arch.clone(),
        direction: Direction::GgufToHf,
        rows,
        unmapped,
        notes,
    }
}
