//! Check 1, container and split integrity, from the headers only (no tensor data is read): every
//! shard present and parseable, one split set (count, numbering, tensor count, no tensor twice),
//! no tensor beyond the end of its file, and the metadata consistent with the architecture and
//! with the tensor shapes (a hyper-parameter every block disagrees with is the metadata's fault).

use super::report::{CheckResult, Item};
use super::{file_name, kind_of, Ctx, Shard};
use gguf::split::{self, KEY_COUNT, KEY_NO, KEY_TENSORS_COUNT};
use gguf::{Header, Model};
use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const REDOWNLOAD: &str =
    "re-download this file (or copy it again) and compare its size and sha256 with the source";

/// Reads every shard's header and checks the set. `Err` only when `path` itself cannot be read
/// (missing, not a file): then nothing can be checked.
pub fn open(path: &Path) -> anyhow::Result<(Vec<Shard>, CheckResult)> {
    let meta = std::fs::metadata(path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{} is not a regular file", path.display());
    }
    let mut r = CheckResult::new(1, "container");
    let paths: Vec<PathBuf> = split::sibling_paths(path).unwrap_or_else(|| vec![path.into()]);
    let mut shards = Vec::with_capacity(paths.len());
    for p in &paths {
        shards.push(read_shard(p, &mut r));
    }
    check_split_set(&shards, &mut r);
    Ok((shards, r))
}

fn read_shard(p: &Path, r: &mut CheckResult) -> Shard {
    let name = file_name(p);
    let mut shard = Shard {
        path: p.to_path_buf(),
        size: 0,
        header: None,
    };
    let file = match std::fs::File::open(p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            r.push(
                Item::finding(name, "shard is missing".to_string())
                    .advice("download the missing shard next to the others (same name)"),
            );
            return shard;
        }
        Err(e) => {
            r.push(Item::finding(name, format!("cannot be read: {e}")));
            return shard;
        }
    };
    shard.size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let header = match Header::parse_reader(BufReader::new(file), Some(shard.size), p) {
        Ok(h) => h,
        Err(e) => {
            r.push(
                Item::finding(name, format!("header is damaged or truncated: {e}"))
                    .advice(REDOWNLOAD),
            );
            return shard;
        }
    };
    if header.check_data_layout(shard.size).is_err() {
        // Name the cut: how many tensors lie (partly) beyond the end, and the first of them.
        let ends: Vec<(u64, &str)> = header
            .tensors
            .iter()
            .map(|t| {
                (
                    header
                        .data_offset
                        .saturating_add(t.offset)
                        .saturating_add(t.n_bytes()),
                    t.name.as_str(),
                )
            })
            .collect();
        let need = ends.iter().map(|e| e.0).max().unwrap_or(0);
        let cut: Vec<&(u64, &str)> = ends.iter().filter(|e| e.0 > shard.size).collect();
        if need > shard.size {
            let first = cut.iter().min_by_key(|e| e.0).map(|e| e.1).unwrap_or("?");
            r.push(
                Item::finding(
                    name,
                    format!(
                        "truncated: {} bytes, but its tensors need {need} ({} bytes missing); {} of {} tensors lie beyond the end, the first {first}",
                        shard.size,
                        need - shard.size,
                        cut.len(),
                        header.tensors.len()
                    ),
                )
                .advice(REDOWNLOAD),
            );
        } else {
            let e = header
                .check_data_layout(shard.size)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            r.push(
                Item::finding(name, format!("tensor table is inconsistent: {e}"))
                    .advice(REDOWNLOAD),
            );
        }
    } else {
        for e in header.layout_findings().iter().take(3) {
            r.push(Item::warning(
                name.clone(),
                format!("{e} (gguftool reads it; llama.cpp expects each tensor right after the previous one)"),
            ));
        }
        let end = header.data_end();
        if shard.size > end.saturating_add(header.alignment) {
            r.push(Item::warning(
                name.clone(),
                format!(
                    "{} bytes after the last tensor (ends at {end}): something was appended to the file",
                    shard.size - end
                ),
            ));
        }
    }
    shard.header = Some(header);
    shard
}

/// `split.*` keys of one header (`None` when it has none, `Err` text when mistyped).
fn split_keys(h: &Header) -> Result<Option<(u64, u64, Option<u64>)>, String> {
    let m = &h.metadata;
    let get = |k: &str| -> Result<Option<u64>, String> {
        match m.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| format!("{k} is a {}, not an integer", v.value_type())),
        }
    };
    match (get(KEY_NO)?, get(KEY_COUNT)?) {
        (None, None) => Ok(None),
        (Some(no), Some(count)) => Ok(Some((no, count, get(KEY_TENSORS_COUNT)?))),
        _ => Err(format!("only one of {KEY_NO} and {KEY_COUNT} is present")),
    }
}

fn check_split_set(shards: &[Shard], r: &mut CheckResult) {
    let n = shards.len() as u64;
    let mut total = 0u64;
    let mut first_tc = None;
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut arch0: Option<&str> = None;
    for (i, s) in shards.iter().enumerate() {
        let Some(h) = &s.header else { continue };
        let name = file_name(&s.path);
        total += h.tensors.len() as u64;
        match split_keys(h) {
            Err(e) => r.push(Item::finding(name.clone(), e)),
            Ok(None) if n > 1 => r.push(
                Item::finding(
                    name.clone(),
                    "not a shard: it has no split.no / split.count keys (a whole model renamed into the set?)".to_string(),
                )
                .advice("use the shards of one upload only"),
            ),
            Ok(None) => {}
            Ok(Some((no, count, tc))) => {
                if n == 1 && count > 1 {
                    r.push(
                        Item::finding(
                            name.clone(),
                            format!(
                                "split.count is {count} but the file name has no -NNNNN-of-{count:05} part, so the other shards cannot be found"
                            ),
                        )
                        .advice("keep the shards under their original names"),
                    );
                } else if n > 1 && (count != n || no != i as u64) {
                    r.push(
                        Item::finding(
                            name.clone(),
                            format!(
                                "split.no {no} of split.count {count}, but its name says shard {} of {n}: a shard of another split",
                                i + 1
                            ),
                        )
                        .advice("replace it with the shard of the same upload as the others"),
                    );
                }
                if i == 0 {
                    first_tc = tc;
                } else if let (Some(t0), Some(t)) = (first_tc, tc) {
                    if t != t0 {
                        r.push(
                            Item::finding(
                                name.clone(),
                                format!(
                                    "split.tensors.count {t}, but the first shard says {t0}: a shard of another split"
                                ),
                            )
                            .advice("replace it with the shard of the same upload as the others"),
                        );
                    }
                }
            }
        }
        let arch = h.metadata.architecture();
        match (i, arch0, arch) {
            (0, _, a) => arch0 = a,
            (_, Some(a0), Some(a)) if a != a0 => r.push(Item::finding(
                name.clone(),
                format!("general.architecture is {a:?}, the first shard says {a0:?}: a shard of another model"),
            )),
            _ => {}
        }
        for t in &h.tensors {
            if let Some(&prev) = seen.get(t.name.as_str()) {
                r.push(
                    Item::finding(
                        name.clone(),
                        format!(
                            "tensor {} is also in {}: this shard belongs to another split of the model (different shard boundaries)",
                            t.name,
                            file_name(&shards[prev].path)
                        ),
                    )
                    .advice("replace it with the shard of the same upload as the others"),
                );
                break;
            }
            seen.insert(&t.name, i);
        }
    }
    let all_read = shards.iter().all(|s| s.header.is_some());
    if n > 1 && all_read {
        if let Some(t0) = first_tc {
            if t0 != total {
                r.push(Item::finding(
                    file_name(&shards[0].path),
                    format!("split.tensors.count is {t0} but the {n} shards hold {total} tensors"),
                ));
            }
        }
    }
}

/// Opens the model once check 1 found the set sound; a failure here is a finding too.
pub fn open_model(path: &Path, r: &mut CheckResult) -> Option<Arc<Model>> {
    match Model::open(path) {
        Ok(m) => Some(Arc::new(m)),
        Err(e) => {
            let subject = match &e {
                gguf::Error::Split { file, .. } if !file.as_os_str().is_empty() => file_name(file),
                _ => file_name(path),
            };
            r.push(Item::finding(
                subject,
                format!("cannot be opened as a model: {e}"),
            ));
            None
        }
    }
}

/// Metadata against the architecture table (keys, consistency rules, the runtime's reading) and
/// against the tensor shapes: a tensor kind whose shape disagrees with the metadata in every
/// block points at the metadata, not at the tensors.
pub fn check_metadata(ctx: &Ctx, r: &mut CheckResult) {
    let Some(h) = ctx.shards.first().and_then(|s| s.header.as_ref()) else {
        return;
    };
    let md = &h.metadata;
    let Some(arch) = md.architecture() else {
        r.push(Item::finding(
            file_name(&ctx.shards[0].path),
            "no general.architecture key: no loader knows what model this is".to_string(),
        ));
        return;
    };
    let Some(rep) = &ctx.arch else {
        r.push(Item::warning(
            None,
            format!(
                "no mapping table for architecture {arch:?}: metadata and shapes are not checked (known: {})",
                mappings::architectures().join(", ")
            ),
        ));
        return;
    };
    for k in &rep.metadata_issues {
        r.push(Item::finding(
            format!("metadata {}", k.key),
            k.problem.clone(),
        ));
    }
    for m in &rep.inconsistent_metadata {
        r.push(Item::finding(None, format!("metadata: {m}")));
    }
    if rep.metadata_issues.is_empty() && rep.inconsistent_metadata.is_empty() {
        if let Err(e) = runtime::spec::ModelSpec::from_metadata(md) {
            if runtime::spec::Arch::from_name(arch).is_some() {
                r.push(Item::finding(
                    None,
                    format!("the runtime cannot read the hyper-parameters: {e}"),
                ));
            }
        }
    }
    foreign_shard(ctx, rep, r);
    for (kind, (wrong, total)) in metadata_kinds(ctx) {
        let w = &wrong[0];
        r.push(
            Item::finding(
                kind.clone(),
                format!(
                    "all {total} tensors {kind} have ne {:?} but the metadata implies {:?}: the hyper-parameters in the metadata do not describe these tensors",
                    w.got, w.expected
                ),
            )
            .advice("fix the metadata (or the converter that wrote it); see `gguftool info` for the keys"),
        );
    }
}

/// Tensor kinds (`blk.*.x`) whose shape is wrong in every block that has them (at least two),
/// with their wrong-shape records and instance counts.
pub fn metadata_kinds(
    ctx: &Ctx,
) -> BTreeMap<String, (Vec<mappings::arch_check::WrongShape>, usize)> {
    let mut out: BTreeMap<String, (Vec<mappings::arch_check::WrongShape>, usize)> = BTreeMap::new();
    let Some(rep) = &ctx.arch else {
        return out;
    };
    let mut count: HashMap<String, usize> = HashMap::new();
    for t in &ctx.tensors {
        *count.entry(kind_of(&t.name)).or_default() += 1;
    }
    for w in &rep.wrong_shapes {
        out.entry(kind_of(&w.name)).or_default().0.push(w.clone());
    }
    out.retain(|k, v| {
        let total = count.get(k).copied().unwrap_or(0);
        v.1 = total;
        total >= 2 && v.0.len() == total
    });
    out
}

/// A shard whose tensors (at least half of them) have shapes or names the metadata does not
/// account for, while every other shard fits: it comes from another model.
fn foreign_shard(ctx: &Ctx, rep: &mappings::ArchReport, r: &mut CheckResult) {
    if ctx.shards.len() < 2 {
        return;
    }
    let shard_of: HashMap<&str, usize> = ctx
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shard))
        .collect();
    let mut wrong = vec![0usize; ctx.shards.len()];
    let mut total = vec![0usize; ctx.shards.len()];
    for t in &ctx.tensors {
        total[t.shard] += 1;
    }
    let odd = rep
        .wrong_shapes
        .iter()
        .map(|w| w.name.as_str())
        .chain(rep.unexpected_tensors.iter().map(|u| u.name.as_str()));
    for n in odd {
        if let Some(&s) = shard_of.get(n) {
            wrong[s] += 1;
        }
    }
    let bad: Vec<usize> = (0..wrong.len()).filter(|&i| wrong[i] > 0).collect();
    if let [i] = bad[..] {
        if wrong[i] * 2 >= total[i] && total[i] > 0 {
            r.push(
                Item::finding(
                    file_name(&ctx.shards[i].path),
                    format!(
                        "{} of its {} tensors have shapes or names the model's metadata does not imply, while the other shards fit: a shard of another model",
                        wrong[i], total[i]
                    ),
                )
                .advice("replace it with the shard of the same upload as the others"),
            );
        }
    }
}
