//! Check 4, the MLA kv_b split (spec §2.5): per layer, `attn_k_b` `{qk_nope, kv_lora, n_head}` and
//! `attn_v_b` `{kv_lora, v_head, n_head}` agree with each other and with the metadata (a swap or
//! an untransposed key part is named as such), agree with q_b and attn_output on the head count,
//! and hold no all-zero or duplicated head (what a bad tensor-parallel merge leaves). With
//! `--hf`, the reassembled kv_b equals the checkpoint's `kv_b_proj` within the rounding of the
//! stored type; a mismatch is explained where one of the usual mistakes fits (k_b/v_b swapped,
//! key part not transposed, heads reordered).

use super::report::{CheckResult, Item};
use super::tolerance::{rel_rms, weight_tolerance};
use super::{Ctx, QUICK_LAYERS};
use gguf::Model;
use mappings::hf::HfDir;
use mappings::kvb::{self, MlaDims};
use mappings::Kind;
use std::collections::HashMap;
use std::path::Path;

pub fn run(ctx: &Ctx, model: &Model, hf: Option<&Path>, quick: bool) -> CheckResult {
    let mut r = CheckResult::new(4, "kv_b");
    let Some(table) = ctx.table else {
        r.skipped = Some("no mapping table for this architecture".into());
        return r;
    };
    if !table.entries.iter().any(|e| e.kind == Kind::KvB) {
        r.skipped = Some(format!("{} has no MLA kv_b split", table.arch));
        return r;
    }
    let mla = ctx.spec.as_ref().and_then(|s| match &s.attention {
        runtime::spec::AttentionSpec::Mla(m) => Some(*m),
        _ => None,
    });
    let n_block = ctx
        .meta_u64(&format!("{}.block_count", table.arch))
        .unwrap_or(0);
    let hf_dir = match hf.map(HfDir::open) {
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => {
            r.push(Item::warning(
                hf.map(|p| p.display().to_string()),
                format!("--hf checkpoint cannot be read, kv_b not compared: {e}"),
            ));
            None
        }
        None => None,
    };
    let limit = if quick {
        QUICK_LAYERS.min(n_block)
    } else {
        n_block
    };
    let (mut checked, mut compared) = (0, 0);
    for bid in 0..limit {
        let kn = format!("blk.{bid}.attn_k_b.weight");
        let vn = format!("blk.{bid}.attn_v_b.weight");
        let (k, v) = (model.tensor(&kn), model.tensor(&vn));
        let (k, v) = match (k, v) {
            (Some(k), Some(v)) => (k, v),
            (None, None) => {
                if model
                    .tensor(&format!("blk.{bid}.attn_kv_b.weight"))
                    .is_some()
                {
                    r.summary = "legacy unsplit attn_kv_b (its shape is checked by check 2)".into();
                }
                continue;
            }
            (k, _) => {
                let missing = if k.is_none() { &kn } else { &vn };
                r.push(Item::finding(
                    missing.clone(),
                    "missing while the other half of the kv_b split is present".to_string(),
                ));
                continue;
            }
        };
        checked += 1;
        let (kd, vd) = (&k.info.dims, &v.info.dims);
        if let Some(m) = mla {
            let h = m.n_head as u64;
            let (nope, lora, vh) = (m.qk_nope as u64, m.kv_lora_rank as u64, m.v_head as u64);
            let kw = vec![nope, lora, h];
            let vw = vec![lora, vh, h];
            if *kd != kw || *vd != vw {
                let why = if *kd == vw && *vd == kw {
                    format!("{kn} has the shape of attn_v_b {vw:?} and {vn} that of attn_k_b {kw:?}: the two are swapped")
                } else if *kd == vec![lora, nope, h] {
                    format!("{kn} has ne {kd:?}: the key part of kv_b_proj stored per head as [qk_nope][kv_lora] without the transpose the split needs (expected {kw:?})")
                } else if *vd == vec![vh, lora, h] {
                    format!("{vn} has ne {vd:?}: transposed (expected {vw:?})")
                } else {
                    format!(
                        "{kn} ne {kd:?} and {vn} ne {vd:?}, the metadata implies {kw:?} and {vw:?}"
                    )
                };
                r.push(
                    Item::finding(kn.clone(), why)
                        .advice("the converter split kv_b_proj wrongly: reconvert with a current llama.cpp converter or gguftool"),
                );
                continue;
            }
            heads_agree(model, bid, &m, &mut r);
        }
        let d = match MlaDims::from_ne(kd, vd) {
            Ok(d) => d,
            Err(e) => {
                r.push(Item::finding(kn.clone(), e.to_string()));
                continue;
            }
        };
        heads_sound(model, &kn, d.n_head, &mut r);
        heads_sound(model, &vn, d.n_head, &mut r);
        if let Some(dir) = &hf_dir {
            if compare_hf(model, dir, bid, d, &kn, &mut r) {
                compared += 1;
            }
        }
    }
    let mut s = format!(
        "attn_k_b/attn_v_b of {checked} layers{}: shapes, head counts and head slabs consistent",
        if quick && limit < n_block {
            format!(" (--quick: the first {limit})")
        } else {
            String::new()
        }
    );
    if hf_dir.is_some() {
        s.push_str(&format!("; {compared} compared with the --hf kv_b_proj"));
    } else {
        s.push_str("; values not compared (needs --hf)");
    }
    if r.summary.is_empty() {
        r.summary = s;
    }
    if checked == 0 && r.items.is_empty() && r.summary.starts_with("attn_k_b") {
        r.skipped = Some("no attn_k_b/attn_v_b tensors".into());
    }
    r
}

/// q_b rows and attn_output columns must hold the same heads as k_b/v_b.
fn heads_agree(model: &Model, bid: u64, m: &runtime::spec::MlaSpec, r: &mut CheckResult) {
    let q = model
        .tensor(&format!("blk.{bid}.attn_q_b.weight"))
        .or_else(|| model.tensor(&format!("blk.{bid}.attn_q.weight")));
    let o = model.tensor(&format!("blk.{bid}.attn_output.weight"));
    if let Some(q) = q {
        let rows = q.info.dims.get(1).copied().unwrap_or(0);
        if rows != (m.n_head * m.qk_head()) as u64 {
            r.push(Item::finding(
                q.info.name.clone(),
                format!(
                    "{rows} query rows, but {} heads x {} (qk_head) are needed to match attn_k_b",
                    m.n_head,
                    m.qk_head()
                ),
            ));
        }
    }
    if let Some(o) = o {
        let cols = o.info.dims.first().copied().unwrap_or(0);
        if cols != (m.n_head * m.v_head) as u64 {
            r.push(Item::finding(
                o.info.name.clone(),
                format!(
                    "{cols} input columns, but {} heads x {} (v_head) come out of attn_v_b",
                    m.n_head, m.v_head
                ),
            ));
        }
    }
}

/// Heads are contiguous slabs along ne2: none may be all zero bytes or a copy of another.
fn heads_sound(model: &Model, name: &str, n_head: usize, r: &mut CheckResult) {
    let Ok(data) = model.tensor_data(name) else {
        return;
    };
    if n_head == 0 || !data.len().is_multiple_of(n_head) {
        return;
    }
    let slab = data.len() / n_head;
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    for (h, s) in data.chunks_exact(slab).enumerate() {
        if s.iter().all(|&b| b == 0) {
            r.push(
                Item::finding(name.to_string(), format!("head {h} of {n_head} is all zero"))
                    .advice("a head slab was lost (a bad tensor-parallel merge or a damaged file): reconvert"),
            );
            continue;
        }
        if let Some(&o) = seen.get(s) {
            r.push(
                Item::finding(
                    name.to_string(),
                    format!("head {h} is a byte-for-byte copy of head {o}"),
                )
                .advice("heads were duplicated (a tensor-parallel slice written twice): reconvert"),
            );
        } else {
            seen.insert(s, h);
        }
    }
}

fn dequant(model: &Model, name: &str) -> Option<Vec<f32>> {
    let t = model.tensor(name)?;
    gguf::quant::dequantize_to_vec(t.info.ty, model.data(&t)).ok()
}

/// kv_b_proj from key slabs read either as `{nope, lora}` (the split's layout) or `{lora, nope}`
/// per head (`transposed`: the HF rows stored without the transpose).
fn rebuild(k: &[f32], v: &[f32], d: MlaDims, transposed: bool) -> Option<Vec<f32>> {
    if !transposed {
        return kvb::reassemble(k, v, d).ok();
    }
    let (nope, vh, lora) = (d.qk_nope, d.v_head, d.kv_lora);
    if k.len() != nope * lora * d.n_head || v.len() != lora * vh * d.n_head {
        return None;
    }
    let mut w = Vec::with_capacity(d.kv_b_len().ok()?);
    for h in 0..d.n_head {
        w.extend_from_slice(&k[h * nope * lora..(h + 1) * nope * lora]);
        w.extend_from_slice(&v[h * lora * vh..(h + 1) * lora * vh]);
    }
    Some(w)
}

/// Compares one layer with the checkpoint; true when it could be compared.
fn compare_hf(
    model: &Model,
    dir: &HfDir,
    bid: u64,
    d: MlaDims,
    kn: &str,
    r: &mut CheckResult,
) -> bool {
    let hf_name = format!("model.layers.{bid}.self_attn.kv_b_proj.weight");
    let Some(t) = dir.tensor(&hf_name) else {
        return false;
    };
    let want = match dir.read_f32(t) {
        Ok(w) => w,
        Err(e) => {
            r.push(Item::warning(hf_name, format!("cannot be read: {e}")));
            return false;
        }
    };
    let vn = kn.replace("attn_k_b", "attn_v_b");
    let (Some(k), Some(v)) = (dequant(model, kn), dequant(model, &vn)) else {
        return false;
    };
    let Some(got) = rebuild(&k, &v, d, false) else {
        return false;
    };
    if got.len() != want.len() {
        r.push(Item::finding(
            kn.to_string(),
            format!(
                "kv_b reassembles to {} values, {hf_name} has {}",
                got.len(),
                want.len()
            ),
        ));
        return true;
    }
    let ty = [kn, &vn]
        .iter()
        .filter_map(|n| model.tensor(n))
        .map(|t| t.info.ty)
        .max_by(|a, b| {
            super::tolerance::weight_rel_rms(*a).total_cmp(&super::tolerance::weight_rel_rms(*b))
        })
        .unwrap_or(gguf::GgmlType::F32);
    let tol = weight_tolerance(ty);
    let err = rel_rms(&got, &want);
    if err <= tol {
        return true;
    }
    // Which part differs, and does a known mistake explain it?
    let rows = d.head_rows();
    let part_err = |key: bool| {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for h in 0..d.n_head {
            let (r0, r1) = if key {
                (0, d.qk_nope)
            } else {
                (d.qk_nope, rows)
            };
            let s = (h * rows + r0) * d.kv_lora;
            let e = (h * rows + r1) * d.kv_lora;
            a.extend_from_slice(&got[s..e]);
            b.extend_from_slice(&want[s..e]);
        }
        rel_rms(&a, &b)
    };
    let (ke, ve) = (part_err(true), part_err(false));
    let fits = |w: Option<Vec<f32>>| w.is_some_and(|w| rel_rms(&w, &want) <= tol);
    let why = if fits(rebuild(&k, &v, d, true)) {
        format!("{kn} holds the key rows of kv_b_proj per head without the transpose ([qk_nope][kv_lora] read as [kv_lora][qk_nope]); with the transpose it matches")
    } else if k.len() == v.len() && fits(rebuild(&v, &k, d, false)) {
        format!("{kn} and {vn} hold each other's values (swapped); exchanged they match")
    } else if let Some(p) = head_permutation(&got, &want, d, tol) {
        format!("the heads are reordered: GGUF head g holds HF head {p:?}[g]")
    } else if ke > tol && ve <= tol {
        format!("the key part ({kn}) differs: relative error {ke:.3e}, the value part matches")
    } else if ve > tol && ke <= tol {
        format!("the value part ({vn}) differs: relative error {ve:.3e}, the key part matches")
    } else {
        format!("both parts differ (key {ke:.3e}, value {ve:.3e})")
    };
    r.push(
        Item::finding(
            kn.to_string(),
            format!(
                "kv_b reassembled from {kn} + {vn} differs from {hf_name}: relative RMS error {err:.3e} > {tol:.1e} (2x the {ty} rounding estimate); {why}"
            ),
        )
        .advice("the converter wrote the kv_b split wrongly: reconvert this model"),
    );
    true
}

/// A head permutation that makes every GGUF head match an HF head, if one exists (not identity).
fn head_permutation(got: &[f32], want: &[f32], d: MlaDims, tol: f64) -> Option<Vec<usize>> {
    let n = d.head_rows() * d.kv_lora;
    let mut perm = Vec::with_capacity(d.n_head);
    for g in 0..d.n_head {
        let a = &got[g * n..(g + 1) * n];
        let p = (0..d.n_head).find(|&p| rel_rms(a, &want[p * n..(p + 1) * n]) <= tol)?;
        perm.push(p);
    }
    let mut sorted = perm.clone();
    sorted.sort_unstable();
    sorted.dedup();
    (sorted.len() == d.n_head && perm.iter().enumerate().any(|(i, &p)| i != p)).then_some(perm)
}
