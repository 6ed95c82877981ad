//! Split shards as llama.cpp names and keys them (spec §3): `PREFIX-%05d-of-%05d.gguf`,
//! `split.no` (u16, 0-based), `split.count` (u16), `split.tensors.count` (i32); plus gguftool's
//! optional set identifier.
//!
//! Shards 2..N of a llama.cpp split carry only the three `split.*` keys, so nothing in them says
//! which model they belong to: a shard of another model with the same layout passes every count
//! check. `gguftool split --set-id` adds [`KEY_SET_ID`] (a string llama.cpp ignores) to every
//! shard; readers check it whenever any shard has it ([`check_set_ids`]), and `merge` drops it.
//! Without it, only what the headers say can be compared (tensor names and shapes against shard
//! 1's hyper-parameters, tensor types against its file type): two quantizations of one model in
//! the same type, or two fine-tunes of one base, are indistinguishable.

use crate::metadata::Metadata;
use crate::reader::TensorInfo;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub const KEY_NO: &str = "split.no";
pub const KEY_COUNT: &str = "split.count";
pub const KEY_TENSORS_COUNT: &str = "split.tensors.count";
/// gguftool's split-set identifier (STRING, 32 hex digits), in every shard of a set written
/// with `split --set-id`.
pub const KEY_SET_ID: &str = "split.set_id";

/// Bytes of each tensor's start and end hashed into a derived set id: enough to tell two
/// fine-tunes or quantizations apart without reading 400 GB.
const SET_ID_SAMPLE: usize = 4096;

/// A set id derived from what is being split: shard 1's metadata (split keys excluded), every
/// tensor's name, type, shape and the first and last [`SET_ID_SAMPLE`] bytes of its data, and
/// the plan. Deterministic, so splitting the same model the same way gives the same bytes.
pub fn derive_set_id<'a>(
    meta: &Metadata,
    tensors: impl IntoIterator<Item = (&'a TensorInfo, &'a [u8])>,
    plan: &[std::ops::Range<usize>],
) -> String {
    let mut h = Sha256::new();
    for (k, v) in meta.iter() {
        if !k.starts_with("split.") {
            h.update(k.as_bytes());
            h.update(format!("={v:?};").as_bytes());
        }
    }
    for (t, data) in tensors {
        h.update(format!("{}:{}:{:?};", t.name, t.ty, t.dims).as_bytes());
        let n = data.len().min(SET_ID_SAMPLE);
        h.update(&data[..n]);
        h.update(&data[data.len() - n..]);
    }
    for r in plan {
        h.update(format!("{}..{};", r.start, r.end).as_bytes());
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Check the set ids of a shard set (`(path, split.set_id)` per shard, shard 1 first): when any
/// shard has one, all must have the same. Returns the offending shard and why.
pub fn check_set_ids(shards: &[(&Path, Option<&str>)]) -> Result<(), (PathBuf, String)> {
    let Some((first, first_id)) = shards.first() else {
        return Ok(());
    };
    let any = shards.iter().find_map(|(p, id)| id.map(|id| (p, id)));
    let Some((with, with_id)) = any else {
        return Ok(());
    };
    for (p, id) in shards {
        match (id, first_id) {
            (Some(a), Some(b)) if a != b => {
                return Err((
                    p.to_path_buf(),
                    format!(
                        "{KEY_SET_ID} is {a:?} but {} has {b:?}: shard of another split set",
                        first.display()
                    ),
                ))
            }
            (None, _) => {
                return Err((
                    p.to_path_buf(),
                    format!(
                        "no {KEY_SET_ID}, but {} has {with_id:?}: shard of another split set",
                        with.display()
                    ),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// `prefix-00001-of-00003.gguf` for `no = 0, count = 3` (names are 1-based).
pub fn shard_path(prefix: &str, no: u32, count: u32) -> PathBuf {
    PathBuf::from(format!("{prefix}-{:05}-of-{:05}.gguf", no + 1, count))
}

/// Parse a shard file name: `(prefix, no (0-based), count)` when it ends with
/// `-NNNNN-of-MMMMM.gguf` with 1 <= NNNNN <= MMMMM.
pub fn parse_shard_name(path: &Path) -> Option<(String, u32, u32)> {
    let s = path.to_str()?;
    let stem = s.strip_suffix(".gguf")?;
    // "-00001-of-00003" is 15 bytes.
    if stem.len() < 15 || !stem.is_char_boundary(stem.len() - 15) {
        return None;
    }
    let (prefix, tail) = stem.split_at(stem.len() - 15);
    let b = tail.as_bytes();
    if b[0] != b'-' || &tail[6..10] != "-of-" {
        return None;
    }
    let no: u32 = tail[1..6].parse().ok()?;
    let count: u32 = tail[10..15].parse().ok()?;
    if !tail[1..6].bytes().all(|c| c.is_ascii_digit())
        || !tail[10..15].bytes().all(|c| c.is_ascii_digit())
        || no == 0
        || no > count
    {
        return None;
    }
    Some((prefix.to_string(), no - 1, count))
}

/// The sibling paths of a shard by its name, in shard order.
pub fn sibling_paths(path: &Path) -> Option<Vec<PathBuf>> {
    let (prefix, _, count) = parse_shard_name(path)?;
    Some((0..count).map(|i| shard_path(&prefix, i, count)).collect())
}

/// Plan a split: the tensor index ranges of each shard. `max_tensors` starts a new shard every
/// N tensors; `max_bytes` when the running sum of 32-byte-padded tensor sizes would exceed it
/// (gguf-split's rule; metadata not counted). A shard never ends up empty.
pub fn plan(
    sizes: &[u64],
    max_tensors: Option<usize>,
    max_bytes: Option<u64>,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0usize;
    let mut cur = 0u64;
    for (i, &sz) in sizes.iter().enumerate() {
        let padded = sz.div_ceil(32) * 32;
        let by_count =
            max_tensors.is_some_and(|n| n > 0 && i > start && (i - start).is_multiple_of(n));
        let by_size = max_bytes.is_some_and(|m| i > start && cur + padded > m);
        if by_count || by_size {
            out.push(start..i);
            start = i;
            cur = 0;
        }
        cur += padded;
    }
    if start < sizes.len() || sizes.is_empty() {
        out.push(start..sizes.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_ids_must_agree_when_present() {
        let (a, b, c) = (Path::new("a"), Path::new("b"), Path::new("c"));
        assert!(check_set_ids(&[(a, None), (b, None)]).is_ok());
        assert!(check_set_ids(&[(a, Some("x")), (b, Some("x")), (c, Some("x"))]).is_ok());
        let e = check_set_ids(&[(a, Some("x")), (b, Some("y"))]).unwrap_err();
        assert_eq!(e.0, PathBuf::from("b"));
        // A shard without the id in a set that has one, either way round.
        assert_eq!(
            check_set_ids(&[(a, Some("x")), (b, None)]).unwrap_err().0,
            PathBuf::from("b")
        );
        assert_eq!(
            check_set_ids(&[(a, None), (b, Some("x"))]).unwrap_err().0,
            PathBuf::from("a")
        );
    }

    #[test]
    fn names_round_trip() {
        let p = shard_path("/x/model-Q4", 1, 10);
        assert_eq!(p, PathBuf::from("/x/model-Q4-00002-of-00010.gguf"));
        assert_eq!(parse_shard_name(&p), Some(("/x/model-Q4".into(), 1, 10)));
        assert_eq!(parse_shard_name(Path::new("m-00000-of-00003.gguf")), None);
        assert_eq!(parse_shard_name(Path::new("m-00004-of-00003.gguf")), None);
        assert_eq!(parse_shard_name(Path::new("m.gguf")), None);
        assert_eq!(parse_shard_name(Path::new("m-0001a-of-00003.gguf")), None);
    }

    #[test]
    fn plan_by_count_matches_gguf_split() {
        let sizes = vec![10u64; 94];
        let p = plan(&sizes, Some(32), None);
        assert_eq!(p, vec![0..32, 32..64, 64..94]);
    }

    #[test]
    fn plan_by_size() {
        let p = plan(&[64, 64, 64, 10], None, Some(128));
        assert_eq!(p, vec![0..2, 2..4]);
    }
}
