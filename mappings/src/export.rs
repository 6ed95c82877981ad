//! GGUF -> HF-layout safetensors: every GGUF tensor back under its HF on-disk name(s) (experts
//! unstacked, kv_b reassembled, converter transforms undone), sharded with an index, plus
//! config/tokenizer files rebuilt from metadata. Streams one HF tensor at a time; the output
//! directory appears atomically (written as `OUT.partial`, renamed at the end, removed on failure).

use crate::hfconfig;
use crate::kvb::{self, MlaDims};
use crate::table::{table, Env, Kind, Tp, Transform};
use crate::values;
use crate::MappingError;
use gguf::{GgmlType, Model};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Storage dtype requested for the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutDtype {
    /// bf16 wherever that is exact, else the narrowest exact float type of the source.
    Bf16,
    /// f16 wherever that is exact, else bf16 where exact, else f32.
    F16,
    F32,
    /// Every tensor bf16, values rounded to nearest even (lossy for f32 and dequantized data).
    Bf16Round,
}

/// Export settings.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub dtype: OutDtype,
    /// Upper bound of one shard's tensor bytes (a single larger tensor gets a shard of its own).
    pub max_shard_bytes: u64,
    /// Write only tensor-parallel rank `.1` of `.0` ranks for tensors with a TP plan.
    pub tp: Option<(usize, usize)>,
    /// Replace an existing output directory.
    pub overwrite: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: OutDtype::Bf16,
            max_shard_bytes: 5 << 30,
            tp: None,
            overwrite: false,
        }
    }
}

/// Progress callbacks; the callback returns `false` to stop the export (Ctrl-C).
#[derive(Debug, Clone)]
pub enum Progress<'a> {
    /// Planning done: what will be written.
    Start { tensors: usize, bytes: u64 },
    /// One HF tensor written.
    Tensor { name: &'a str, bytes: u64 },
}

/// What was written.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ExportSummary {
    pub out_dir: PathBuf,
    pub tensors: usize,
    pub shards: usize,
    pub bytes: u64,
    /// Tensor count per output dtype.
    pub dtypes: BTreeMap<String, usize>,
    /// Tensors kept wider than requested because narrowing would change values.
    pub kept_wide: Vec<String>,
    pub notes: Vec<String>,
}

/// Decoded elements, kept in their 16-bit storage where possible so copies stay bit-exact.
#[derive(Debug, Clone)]
enum Buf {
    Bf16(Vec<u16>),
    F16(Vec<u16>),
    F32(Vec<f32>),
}

impl Buf {
    fn len(&self) -> usize {
        match self {
            Buf::Bf16(v) | Buf::F16(v) => v.len(),
            Buf::F32(v) => v.len(),
        }
    }

    fn to_f32(&self) -> Vec<f32> {
        match self {
            Buf::Bf16(v) => v
                .iter()
                .map(|x| half::bf16::from_bits(*x).to_f32())
                .collect(),
            Buf::F16(v) => v
                .iter()
                .map(|x| half::f16::from_bits(*x).to_f32())
                .collect(),
            Buf::F32(v) => v.clone(),
        }
    }

    /// Applies an element permutation/selection to whichever storage this is.
    fn map(self, f: &dyn Fn(Elems) -> Result<Elems, MappingError>) -> Result<Buf, MappingError> {
        Ok(match self {
            Buf::Bf16(v) => Buf::Bf16(f(Elems::U16(v))?.u16()),
            Buf::F16(v) => Buf::F16(f(Elems::U16(v))?.u16()),
            Buf::F32(v) => Buf::F32(f(Elems::F32(v))?.f32()),
        })
    }
}

/// Element vector for type-agnostic permutations.
enum Elems {
    U16(Vec<u16>),
    F32(Vec<f32>),
}

impl Elems {
    fn u16(self) -> Vec<u16> {
        match self {
            Elems::U16(v) => v,
            Elems::F32(_) => Vec::new(),
        }
    }
    fn f32(self) -> Vec<f32> {
        match self {
            Elems::F32(v) => v,
            Elems::U16(_) => Vec::new(),
        }
    }
}

fn terr(tensor: &str, msg: impl Into<String>) -> MappingError {
    MappingError::Tensor {
        tensor: tensor.to_string(),
        msg: msg.into(),
    }
}

fn decode(name: &str, ty: GgmlType, bytes: &[u8]) -> Result<Buf, MappingError> {
    Ok(match ty {
        GgmlType::BF16 => Buf::Bf16(values::u16_words(bytes)),
        GgmlType::F16 => Buf::F16(values::u16_words(bytes)),
        GgmlType::F32 => Buf::F32(values::to_f32("F32", bytes).unwrap_or_default()),
        _ => Buf::F32(
            gguf::quant::dequantize_to_vec(ty, bytes).map_err(|e| terr(name, e.to_string()))?,
        ),
    })
}

/// How one HF tensor is produced.
#[derive(Debug, Clone)]
enum Source {
    Plain {
        gguf: String,
        /// Expert index into a stacked tensor.
        expert: Option<u64>,
        /// Undo llama's q/k row permutation with this many heads.
        unpermute: Option<usize>,
        add_one: bool,
        tp: Option<(Tp, usize, usize)>,
    },
    KvB {
        k: String,
        v: String,
        dims: MlaDims,
        heads: Range<usize>,
    },
}

#[derive(Debug, Clone)]
struct Item {
    hf: String,
    shape: Vec<usize>,
    src: Source,
    dtype: safetensors::Dtype,
}

fn dims_usize(name: &str, dims: &[u64]) -> Result<Vec<usize>, MappingError> {
    dims.iter()
        .map(|d| usize::try_from(*d).map_err(|_| terr(name, "dimension too large")))
        .collect()
}

/// The HF tensors of a GGUF model with their sources, in GGUF order.
fn plan(
    model: &Model,
    tp: Option<(usize, usize)>,
    notes: &mut Vec<String>,
) -> Result<Vec<Item>, MappingError> {
    let arch = model.architecture().ok_or_else(|| MappingError::File {
        path: model.path().to_path_buf(),
        msg: "no general.architecture key".into(),
    })?;
    let t = table(arch)?;
    let env = Env::new(t, model.metadata());
    let mut items = Vec::new();
    let mut unmapped = Vec::new();
    let mut kv_seen: BTreeMap<(usize, Option<u64>), ()> = BTreeMap::new();
    let mut add_one = 0;
    for r in model.tensors() {
        let name = r.info.name.as_str();
        let Some(hit) = t.match_gguf(name) else {
            unmapped.push(name.to_string());
            continue;
        };
        let e = hit.entry;
        let bid = hit.idx.bid;
        let dims = dims_usize(name, &r.info.dims)?;
        let tp_of = |plan: Option<Tp>| match (plan, tp) {
            (Some(p), Some((n, rank))) => Some((p, n, rank)),
            _ => None,
        };
        match e.kind {
            Kind::GgufOnly => notes.push(format!(
                "{name}: not an HF tensor ({}), skipped",
                e.note.as_deref().unwrap_or("computed from config")
            )),
            Kind::HfOnly | Kind::Tied => {}
            Kind::Experts => {
                let [ne0, ne1, ne2] = dims[..] else {
                    return Err(terr(
                        name,
                        format!("stacked experts must be 3-D, ne {dims:?}"),
                    ));
                };
                // Each expert's own matrix follows the plan (gate/up colwise, down rowwise).
                let tp = tp_of(e.tp);
                let mut shape = vec![ne1, ne0];
                if let Some((p, n, rank)) = tp {
                    let axis = usize::from(p == Tp::Rowwise);
                    shape[axis] = kvb::tp_heads(shape[axis], n, rank)?.len();
                }
                for x in 0..ne2 as u64 {
                    let hf = e.hf_name(bid, Some(x)).unwrap_or_default();
                    items.push(Item {
                        hf,
                        shape: shape.clone(),
                        src: Source::Plain {
                            gguf: name.to_string(),
                            expert: Some(x),
                            unpermute: None,
                            add_one: false,
                            tp,
                        },
                        dtype: safetensors::Dtype::F32,
                    });
                }
            }
            Kind::KvB => {
                if kv_seen.insert((hit.entry_index, bid), ()).is_some() {
                    continue;
                }
                let names = e.gguf_names(bid);
                let (Some(k), Some(v)) = (model.tensor(&names[0]), model.tensor(&names[1])) else {
                    return Err(terr(
                        name,
                        format!("kv_b needs both {} and {}", names[0], names[1]),
                    ));
                };
                let d = MlaDims::from_ne(&k.info.dims, &v.info.dims)?;
                let heads = match tp_of(e.tp) {
                    Some((_, n, rank)) => kvb::tp_heads(d.n_head, n, rank)?,
                    None => 0..d.n_head,
                };
                items.push(Item {
                    hf: e.hf_name(bid, None).unwrap_or_default(),
                    shape: vec![heads.len() * d.head_rows(), d.kv_lora],
                    src: Source::KvB {
                        k: names[0].clone(),
                        v: names[1].clone(),
                        dims: d,
                        heads,
                    },
                    dtype: safetensors::Dtype::F32,
                });
            }
            Kind::Plain => {
                let unpermute = match &e.transform {
                    Some(Transform::RopePermute(h)) => {
                        let heads = env.eval(h, bid).map_err(|x| terr(name, x.to_string()))?;
                        Some(
                            usize::try_from(heads)
                                .map_err(|_| terr(name, "negative head count"))?,
                        )
                    }
                    _ => None,
                };
                let mut shape: Vec<usize> = dims.iter().rev().copied().collect();
                let tp = tp_of(e.tp);
                if let Some((p, n, rank)) = tp {
                    let axis = match (p, shape.len()) {
                        (Tp::Colwise, _) | (Tp::Rowwise, 1) => 0,
                        (Tp::Rowwise, _) => 1,
                    };
                    shape[axis] = kvb::tp_heads(shape[axis], n, rank)?.len();
                }
                items.push(Item {
                    hf: e.hf_name(bid, None).unwrap_or_default(),
                    shape,
                    src: Source::Plain {
                        gguf: name.to_string(),
                        expert: None,
                        unpermute,
                        add_one: matches!(e.transform, Some(Transform::AddOne)),
                        tp,
                    },
                    dtype: safetensors::Dtype::F32,
                });
                if matches!(e.transform, Some(Transform::AddOne)) {
                    add_one += 1;
                }
            }
        }
    }
    if add_one > 0 {
        notes.push(format!(
            "{add_one} norm tensors are stored as w + 1 by the converter; exported as (w + 1) - 1 in f32 \
             (exact only where that rounds back to w)"
        ));
    }
    if !unmapped.is_empty() {
        return Err(MappingError::Tensor {
            tensor: unmapped.join(", "),
            msg: format!("not in the {arch} table, cannot name them in HF layout"),
        });
    }
    Ok(items)
}

/// Rows `rows` of a row-major byte matrix with `row_bytes` per row, in the order given.
fn pick_rows(
    data: &[u8],
    row_bytes: usize,
    rows: impl Iterator<Item = usize>,
) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for r in rows {
        let s = r.checked_mul(row_bytes).ok_or("row offset overflows")?;
        let row = data
            .get(s..s + row_bytes)
            .ok_or("row outside the tensor data")?;
        out.extend_from_slice(row);
    }
    Ok(out)
}

/// The values of one HF tensor.
fn materialize(model: &Model, item: &Item) -> Result<Buf, MappingError> {
    match &item.src {
        Source::KvB { k, v, dims, heads } => {
            let load = |n: &str| -> Result<Buf, MappingError> {
                let t = model.tensor(n).ok_or_else(|| terr(n, "missing"))?;
                decode(n, t.info.ty, model.data(&t))
            };
            let (kb, vb) = (load(k)?, load(v)?);
            let err = |e: MappingError| terr(&item.hf, e.to_string());
            Ok(match (kb, vb) {
                (Buf::Bf16(a), Buf::Bf16(b)) => {
                    Buf::Bf16(kvb::reassemble_heads(&a, &b, *dims, heads.clone()).map_err(err)?)
                }
                (a, b) => Buf::F32(
                    kvb::reassemble_heads(&a.to_f32(), &b.to_f32(), *dims, heads.clone())
                        .map_err(err)?,
                ),
            })
        }
        Source::Plain {
            gguf,
            expert,
            unpermute,
            add_one,
            tp,
        } => {
            let t = model.tensor(gguf).ok_or_else(|| terr(gguf, "missing"))?;
            let dims = dims_usize(gguf, &t.info.dims)?;
            let data = model.data(&t);
            let ty = t.info.ty;
            let ne0 = dims.first().copied().unwrap_or(1);
            let row_bytes = ty
                .row_bytes(ne0 as u64)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| terr(gguf, format!("ne0 {ne0} does not fit {}", ty.name())))?;
            let bad = |m: String| terr(gguf, m);
            // Byte-level row operations first: whole rows never split a quant block.
            let (mut bytes, rows): (Cow<[u8]>, usize) = match expert {
                Some(x) => {
                    let ne1 = dims[1];
                    let s = (*x as usize) * ne1;
                    (
                        Cow::Owned(pick_rows(data, row_bytes, s..s + ne1).map_err(bad)?),
                        ne1,
                    )
                }
                None => (Cow::Borrowed(data), dims.iter().skip(1).product()),
            };
            if let Some(h) = unpermute {
                // converter: gguf = hf.reshape(h, 2, R/h/2, C).swapaxes(1, 2); invert per HF row
                if *h == 0 || !rows.is_multiple_of(2 * h) {
                    return Err(bad(format!("{rows} rows do not split into {h} rope heads")));
                }
                let half = rows / h / 2;
                let order = (0..rows).map(|r| {
                    let (head, rest) = (r / (2 * half), r % (2 * half));
                    let (s, j) = (rest / half, rest % half);
                    head * 2 * half + j * 2 + s
                });
                bytes = Cow::Owned(pick_rows(&bytes, row_bytes, order).map_err(bad)?);
            }
            let mut elem_tp = None;
            if let Some((p, n, rank)) = *tp {
                if p == Tp::Colwise && dims.len() >= 2 {
                    let r = kvb::tp_heads(rows, n, rank)?;
                    bytes = Cow::Owned(pick_rows(&bytes, row_bytes, r).map_err(bad)?);
                } else {
                    elem_tp = Some((p, n, rank));
                }
            }
            let mut buf = decode(gguf, ty, &bytes)?;
            drop(bytes);
            if let Some((_, n, rank)) = elem_tp {
                // rowwise on a matrix: columns; any split of a vector: elements
                let (r, c) = if dims.len() >= 2 {
                    (buf.len() / ne0, ne0)
                } else {
                    (1, buf.len())
                };
                buf = buf.map(&|e| {
                    Ok(match e {
                        Elems::U16(v) => Elems::U16(kvb::rowwise_slice(&v, r, c, n, rank)?),
                        Elems::F32(v) => Elems::F32(kvb::rowwise_slice(&v, r, c, n, rank)?),
                    })
                })?;
            }
            if *add_one {
                buf = Buf::F32(buf.to_f32().into_iter().map(|x| x - 1.0).collect());
            }
            Ok(buf)
        }
    }
}

/// The output dtype for `buf`: the requested one where exact, else the narrowest exact one.
fn choose(buf: &Buf, want: OutDtype) -> safetensors::Dtype {
    use safetensors::Dtype as D;
    match (want, buf) {
        (OutDtype::F32, _) => D::F32,
        (OutDtype::Bf16Round, _) | (OutDtype::Bf16, Buf::Bf16(_)) => D::BF16,
        (OutDtype::F16, Buf::F16(_)) => D::F16,
        (w, b) => {
            let v = b.to_f32();
            let bf = values::fits_bf16(&v);
            let f16 = values::fits_f16(&v);
            match (w, bf, f16) {
                (OutDtype::Bf16, true, _) | (OutDtype::F16, true, false) => D::BF16,
                (OutDtype::F16, _, true) | (OutDtype::Bf16, false, true) => D::F16,
                _ => D::F32,
            }
        }
    }
}

fn encode(buf: Buf, dtype: safetensors::Dtype) -> Vec<u8> {
    use safetensors::Dtype as D;
    match (dtype, buf) {
        (D::BF16, Buf::Bf16(v)) | (D::F16, Buf::F16(v)) => values::u16_bytes(&v),
        (D::BF16, b) => values::f32_to_bf16_bytes(&b.to_f32()),
        (D::F16, b) => values::f32_to_f16_bytes(&b.to_f32()),
        (_, b) => values::f32_bytes(&b.to_f32()),
    }
}

fn dtype_size(d: safetensors::Dtype) -> usize {
    match d {
        safetensors::Dtype::F32 => 4,
        _ => 2,
    }
}

/// Whether `buf` is known to fit the requested dtype without looking at values.
fn known_dtype(model: &Model, item: &Item, want: OutDtype) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as D;
    match want {
        OutDtype::F32 => return Some(D::F32),
        OutDtype::Bf16Round => return Some(D::BF16),
        _ => {}
    }
    let ty = |n: &str| model.tensor(n).map(|t| t.info.ty);
    let all = match &item.src {
        Source::Plain {
            gguf,
            add_one: false,
            ..
        } => vec![ty(gguf)?],
        Source::Plain { .. } => return None,
        Source::KvB { k, v, .. } => vec![ty(k)?, ty(v)?],
    };
    match want {
        OutDtype::Bf16 if all.iter().all(|t| *t == GgmlType::BF16) => Some(D::BF16),
        OutDtype::F16 if all.iter().all(|t| *t == GgmlType::F16) => Some(D::F16),
        _ => None,
    }
}

struct Ctx<'a> {
    model: &'a Model,
    items: &'a [Item],
    error: RefCell<Option<MappingError>>,
    progress: RefCell<&'a mut dyn FnMut(Progress) -> bool>,
}

/// A tensor whose bytes are produced when the safetensors writer asks for them.
struct Lazy<'a> {
    ctx: &'a Ctx<'a>,
    item: usize,
    shape: Vec<usize>,
    len: usize,
}

impl safetensors::View for Lazy<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.ctx.items[self.item].dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let item = &self.ctx.items[self.item];
        // View::data cannot fail: an error is parked in the context, zeros keep the writer going,
        // and the caller discards the whole output directory afterwards.
        if self.ctx.error.borrow().is_some() {
            return Cow::Owned(vec![0; self.len]);
        }
        let r = materialize(self.ctx.model, item).and_then(|b| {
            let bytes = encode(b, item.dtype);
            if bytes.len() == self.len {
                Ok(bytes)
            } else {
                Err(terr(
                    &item.hf,
                    format!("{} bytes produced, {} planned", bytes.len(), self.len),
                ))
            }
        });
        match r {
            Ok(b) => {
                let go_on = (self.ctx.progress.borrow_mut())(Progress::Tensor {
                    name: &item.hf,
                    bytes: b.len() as u64,
                });
                if !go_on {
                    *self.ctx.error.borrow_mut() = Some(MappingError::Interrupted);
                }
                Cow::Owned(b)
            }
            Err(e) => {
                *self.ctx.error.borrow_mut() = Some(e);
                Cow::Owned(vec![0; self.len])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> MappingError {
    MappingError::File {
        path: path.to_path_buf(),
        msg: e.to_string(),
    }
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<(), MappingError> {
    let mut s = serde_json::to_string_pretty(v).map_err(|e| io(path, e))?;
    s.push('\n');
    std::fs::write(path, s).map_err(|e| io(path, e))
}

/// `OUT.partial` beside `OUT`.
pub fn partial_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_os_string();
    s.push(".partial");
    PathBuf::from(s)
}

/// Writes the HF checkpoint of `model` to `out`. Nothing is left at `out` or `out.partial` when
/// this fails. With `overwrite`, an existing `out` directory is swapped out only after the new
/// one is complete, and deleted last; a non-directory `out` or a leftover `out.partial` is
/// refused, never deleted. (The `gguftool` binary goes through its own output layer instead,
/// which also refuses directories it did not write: see [`export_safetensors_into`].)
pub fn export_safetensors(
    model: &Model,
    out: &Path,
    opts: &ExportOptions,
    progress: &mut dyn FnMut(Progress) -> bool,
) -> Result<ExportSummary, MappingError> {
    let exists = std::fs::symlink_metadata(out).ok();
    match &exists {
        Some(_) if !opts.overwrite => return Err(io(out, "already exists")),
        Some(m) if !m.is_dir() => return Err(io(out, "exists and is not a directory")),
        _ => {}
    }
    let part = partial_path(out);
    if std::fs::symlink_metadata(&part).is_ok() {
        return Err(io(
            &part,
            "already exists (left by an interrupted run?); remove it",
        ));
    }
    std::fs::create_dir_all(&part).map_err(|e| io(&part, e))?;
    let r = export_safetensors_into(model, &part, opts, progress).and_then(|mut s| {
        if exists.is_some() {
            let mut old = part.as_os_str().to_os_string();
            old.push(".old");
            let old = PathBuf::from(old);
            std::fs::rename(out, &old).map_err(|e| io(out, e))?;
            if let Err(e) = std::fs::rename(&part, out) {
                let _ = std::fs::rename(&old, out);
                return Err(io(out, e));
            }
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&part, out).map_err(|e| io(out, e))?;
        }
        s.out_dir = out.to_path_buf();
        Ok(s)
    });
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&part);
    }
    r
}

/// Writes the HF checkpoint of `model` into the existing directory `dir` (a caller's temporary
/// output directory; nothing in it is removed). The summary's `out_dir` is `dir`.
pub fn export_safetensors_into(
    model: &Model,
    dir: &Path,
    opts: &ExportOptions,
    progress: &mut dyn FnMut(Progress) -> bool,
) -> Result<ExportSummary, MappingError> {
    let mut s = write_all(model, dir, opts, progress)?;
    s.out_dir = dir.to_path_buf();
    Ok(s)
}

fn write_all(
    model: &Model,
    dir: &Path,
    opts: &ExportOptions,
    progress: &mut dyn FnMut(Progress) -> bool,
) -> Result<ExportSummary, MappingError> {
    let mut summary = ExportSummary::default();
    let mut items = plan(model, opts.tp, &mut summary.notes)?;
    for item in items.iter_mut() {
        item.dtype = match known_dtype(model, item, opts.dtype) {
            Some(d) => d,
            None => choose(&materialize(model, item)?, opts.dtype),
        };
        let want = match opts.dtype {
            OutDtype::Bf16 | OutDtype::Bf16Round => safetensors::Dtype::BF16,
            OutDtype::F16 => safetensors::Dtype::F16,
            OutDtype::F32 => safetensors::Dtype::F32,
        };
        if item.dtype != want {
            summary
                .kept_wide
                .push(format!("{} ({:?})", item.hf, item.dtype));
        }
        *summary
            .dtypes
            .entry(format!("{:?}", item.dtype))
            .or_default() += 1;
    }
    let sizes: Vec<usize> = items
        .iter()
        .map(|i| {
            i.shape
                .iter()
                .try_fold(dtype_size(i.dtype), |a, d| a.checked_mul(*d))
                .ok_or_else(|| terr(&i.hf, "size overflows"))
        })
        .collect::<Result<_, _>>()?;
    let total: u64 = sizes.iter().map(|s| *s as u64).sum();
    // consecutive items into shards of at most max_shard_bytes; a shard also ends where the
    // order readers see (names sorted within a file, as safetensors and llama.cpp's converter
    // list them) would differ from the GGUF order, so converting back gives the same tensor order
    let keys = emission_keys(&items);
    let mut shards: Vec<Range<usize>> = vec![];
    let mut start = 0;
    let mut acc = 0u64;
    for (i, s) in sizes.iter().enumerate() {
        if i > start && (acc + *s as u64 > opts.max_shard_bytes || keys[i] < keys[i - 1]) {
            shards.push(start..i);
            start = i;
            acc = 0;
        }
        acc += *s as u64;
    }
    if start < items.len() {
        shards.push(start..items.len());
    }
    if !progress(Progress::Start {
        tensors: items.len(),
        bytes: total,
    }) {
        return Err(MappingError::Interrupted);
    }
    let n = shards.len();
    let ctx = Ctx {
        model,
        items: &items,
        error: RefCell::new(None),
        progress: RefCell::new(progress),
    };
    let mut weight_map = BTreeMap::new();
    for (si, range) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", si + 1);
        let views: Vec<(String, Lazy)> = range
            .clone()
            .map(|i| {
                weight_map.insert(items[i].hf.clone(), serde_json::Value::from(file.clone()));
                (
                    items[i].hf.clone(),
                    Lazy {
                        ctx: &ctx,
                        item: i,
                        shape: items[i].shape.clone(),
                        len: sizes[i],
                    },
                )
            })
            .collect();
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let path = dir.join(&file);
        safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| io(&path, e))?;
        if let Some(e) = ctx.error.borrow_mut().take() {
            return Err(e);
        }
        // durable before the directory is renamed into place
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io(&path, e))?;
    }
    let params: u64 = items
        .iter()
        .map(|i| i.shape.iter().product::<usize>() as u64)
        .sum();
    write_json(
        &dir.join("model.safetensors.index.json"),
        &serde_json::json!({
            "metadata": {"total_parameters": params, "total_size": total},
            "weight_map": serde_json::Value::Object(weight_map.into_iter().collect()),
        }),
    )?;

    let meta = model.metadata();
    let arch = model.architecture().unwrap_or_default();
    let tied = model.tensor("output.weight").is_none();
    let torch_dtype = match opts.dtype {
        OutDtype::Bf16 | OutDtype::Bf16Round => "bfloat16",
        OutDtype::F16 => "float16",
        OutDtype::F32 => "float32",
    };
    write_json(
        &dir.join("config.json"),
        &hfconfig::config_json(meta, arch, tied, torch_dtype)?,
    )?;
    write_json(
        &dir.join("generation_config.json"),
        &hfconfig::generation_config_json(meta)?,
    )?;
    match hfconfig::tokenizer_files(meta, arch)? {
        Ok((tok, cfg)) => {
            write_json(&dir.join("tokenizer.json"), &tok)?;
            write_json(&dir.join("tokenizer_config.json"), &cfg)?;
        }
        Err(why) => summary
            .notes
            .push(format!("tokenizer files not written: {why}")),
    }
    if let Some(t) = meta
        .get("tokenizer.chat_template")
        .and_then(gguf::Value::as_str)
    {
        let p = dir.join("chat_template.jinja");
        std::fs::write(&p, t).map_err(|e| io(&p, e))?;
    }
    if let Some((n, r)) = opts.tp {
        summary.notes.push(format!(
            "tensor-parallel rank {r} of {n}: tensors with a TP plan hold only this rank's slice; config.json describes the full model"
        ));
    }
    summary.tensors = items.len();
    summary.shards = n;
    summary.bytes = total;
    Ok(summary)
}

/// Where llama.cpp's converter emits each item's GGUF tensor while reading a shard in name order:
/// at its own name, except stacked experts, which appear once the layer's last expert tensor (in
/// name order) has been read.
fn emission_keys(items: &[Item]) -> Vec<String> {
    let layer = |it: &Item| match &it.src {
        Source::Plain {
            gguf,
            expert: Some(_),
            ..
        } => gguf.split('.').nth(1).map(str::to_string),
        _ => None,
    };
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    for it in items {
        if let Some(l) = layer(it) {
            let e = last.entry(l).or_default();
            if it.hf > *e {
                *e = it.hf.clone();
            }
        }
    }
    items
        .iter()
        .map(|it| match layer(it) {
            Some(l) => last[&l].clone(),
            None => it.hf.clone(),
        })
        .collect()
}

/// One layer's kv_b_proj rebuilt from the GGUF as f32 (dequantized first when quantized), with
/// the heads of a TP rank when given. Returns the HF name, HF shape and values.
pub fn kv_b_f32(
    model: &Model,
    bid: u64,
    tp: Option<(usize, usize)>,
) -> Result<(String, [usize; 2], Vec<f32>), MappingError> {
    let arch = model.architecture().unwrap_or_default();
    let t = table(arch)?;
    let e = t
        .entries
        .iter()
        .find(|e| e.kind == Kind::KvB)
        .ok_or_else(|| terr(arch, "architecture has no kv_b split"))?;
    let names = e.gguf_names(Some(bid));
    let load = |n: &str| -> Result<(Vec<u64>, Vec<f32>), MappingError> {
        let r = model.tensor(n).ok_or_else(|| terr(n, "missing"))?;
        Ok((
            r.info.dims.clone(),
            decode(n, r.info.ty, model.data(&r))?.to_f32(),
        ))
    };
    let (kd, k) = load(&names[0])?;
    let (vd, v) = load(&names[1])?;
    let d = MlaDims::from_ne(&kd, &vd)?;
    let heads = match tp {
        Some((n, r)) => kvb::tp_heads(d.n_head, n, r)?,
        None => 0..d.n_head,
    };
    let rows = heads.len() * d.head_rows();
    let w = kvb::reassemble_heads(&k, &v, d, heads)?;
    Ok((
        e.hf_name(Some(bid), None).unwrap_or_default(),
        [rows, d.kv_lora],
        w,
    ))
}
