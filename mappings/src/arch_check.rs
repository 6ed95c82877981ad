//! Architecture checks for `verify`: the tensors and shapes a model must have according to its
//! table (expected ggml `ne` as expressions over metadata), unexpected tensors, and missing or
//! inconsistent metadata keys.

use crate::expr::ExprError;
use crate::table::{table, Env, KeyIssue, Kind, MetaSource, MetaVal, Table};
use crate::MappingError;
use serde::Serialize;
use std::collections::BTreeSet;

/// More blocks than this is treated as corrupt metadata rather than enumerated.
const MAX_BLOCKS: i64 = 100_000;

impl MetaSource for gguf::Metadata {
    fn meta(&self, key: &str) -> Option<MetaVal> {
        use gguf::Value as V;
        let v = self.get(key)?;
        Some(match v {
            V::Bool(b) => MetaVal::Bool(*b),
            V::F32(x) => MetaVal::Float(f64::from(*x)),
            V::F64(x) => MetaVal::Float(*x),
            V::String(_) => MetaVal::Str,
            V::Array(a) => MetaVal::Array(a.len() as u64),
            other => other.as_i64().map_or(MetaVal::HugeInt, MetaVal::Int),
        })
    }
}

/// A tensor whose ggml `ne` differs from what the table expects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WrongShape {
    pub name: String,
    pub expected: Vec<u64>,
    pub got: Vec<u64>,
}

/// A tensor the architecture does not have (unknown name, or a block it does not belong in).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unexpected {
    pub name: String,
    pub reason: String,
}

/// What `check_architecture` found. Empty lists mean the model has exactly the expected layout.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ArchReport {
    pub arch: String,
    pub checked_tensors: usize,
    pub missing_tensors: Vec<String>,
    pub unexpected_tensors: Vec<Unexpected>,
    pub wrong_shapes: Vec<WrongShape>,
    /// Keys missing or of the wrong type.
    pub metadata_issues: Vec<KeyIssue>,
    /// Consistency rules that fail (message and rule).
    pub inconsistent_metadata: Vec<String>,
}

impl ArchReport {
    /// True when nothing was found.
    pub fn is_ok(&self) -> bool {
        self.missing_tensors.is_empty()
            && self.unexpected_tensors.is_empty()
            && self.wrong_shapes.is_empty()
            && self.metadata_issues.is_empty()
            && self.inconsistent_metadata.is_empty()
    }
}

/// Checks a whole (possibly split) model against the table of its `general.architecture`.
/// Errors only when there is no architecture key or no table for it; every finding about the
/// model itself goes into the report.
pub fn check_architecture(model: &gguf::Model) -> Result<ArchReport, MappingError> {
    let arch = model.architecture().ok_or_else(|| MappingError::File {
        path: model.path().to_path_buf(),
        msg: "no general.architecture key".into(),
    })?;
    let t = table(arch)?;
    let tensors: Vec<(&str, &[u64])> = model
        .tensors()
        .map(|r| (r.info.name.as_str(), r.info.dims.as_slice()))
        .collect();
    Ok(check_parts(t, model.metadata(), &tensors))
}

/// [`check_architecture`] over plain parts: metadata and `(name, ne)` pairs.
pub fn check_parts(t: &Table, meta: &dyn MetaSource, tensors: &[(&str, &[u64])]) -> ArchReport {
    let env = Env::new(t, meta);
    let mut rep = ArchReport {
        arch: t.arch.clone(),
        checked_tensors: tensors.len(),
        ..ArchReport::default()
    };
    for r in &t.required_keys {
        env.check_required(r);
    }
    // Evaluate every variable once so each missing or mistyped key is reported.
    for name in t.vars.keys() {
        let _ = env.var(name);
    }
    for c in &t.checks {
        match env.eval(&c.expr, None) {
            Ok(0) => rep
                .inconsistent_metadata
                .push(format!("{} ({})", c.msg, c.src)),
            Ok(_) | Err(ExprError::Unavailable(..)) => {}
            Err(e) => rep.inconsistent_metadata.push(format!("{}: {e}", c.msg)),
        }
    }

    // Expected tensors (required ones only) for the blocks the metadata declares.
    let n_blocks = match env.var("block_count") {
        Ok(n) if (0..=MAX_BLOCKS).contains(&n) => Some(n as u64),
        Ok(n) => {
            rep.inconsistent_metadata
                .push(format!("block_count {n} is outside 0..={MAX_BLOCKS}"));
            None
        }
        Err(_) => None,
    };
    let present: BTreeSet<&str> = tensors.iter().map(|(n, _)| *n).collect();
    for e in &t.entries {
        if e.optional || e.reverse_only || e.kind == Kind::HfOnly || e.gguf.is_empty() {
            continue;
        }
        let bids: Vec<Option<u64>> = match (&e.layers, n_blocks) {
            (None, _) => vec![None],
            (Some(_), Some(n)) => (0..n).map(Some).collect(),
            (Some(_), None) => vec![],
        };
        for bid in bids {
            if !env.entry_applies(e, bid).unwrap_or(false) {
                continue;
            }
            for name in e.gguf_names(bid) {
                if present.contains(name.as_str()) {
                    continue;
                }
                // a tied output head stands in for the missing tensor
                if e.tied_to
                    .as_ref()
                    .is_some_and(|t| present.contains(t.as_str()))
                {
                    continue;
                }
                rep.missing_tensors.push(name);
            }
        }
    }

    for (name, dims) in tensors {
        let Some(hit) = t.match_gguf(name) else {
            rep.unexpected_tensors.push(Unexpected {
                name: name.to_string(),
                reason: format!("not a {} tensor name", t.arch),
            });
            continue;
        };
        let e = hit.entry;
        let bid = hit.idx.bid;
        if let (Some(b), Some(n)) = (bid, n_blocks) {
            if b >= n {
                rep.unexpected_tensors.push(Unexpected {
                    name: name.to_string(),
                    reason: format!("block {b} but block_count is {n}"),
                });
                continue;
            }
        }
        match env.entry_applies(e, bid) {
            Ok(true) => {}
            Ok(false) => {
                let mut why = vec![];
                if let Some(l) = &e.layers {
                    why.push(format!("layer set {l}"));
                }
                if let Some(w) = &e.when {
                    why.push(format!("condition {w}"));
                }
                rep.unexpected_tensors.push(Unexpected {
                    name: name.to_string(),
                    reason: format!("does not belong here ({})", why.join(", ")),
                });
                continue;
            }
            // Undecidable without a missing key: already reported as a metadata issue.
            Err(_) => continue,
        }
        if let Ok(expected) = env.shape(e, hit.part, bid) {
            if expected.as_slice() != *dims {
                rep.wrong_shapes.push(WrongShape {
                    name: name.to_string(),
                    expected,
                    got: dims.to_vec(),
                });
            }
        }
    }
    rep.metadata_issues = env.issues();
    rep
}
