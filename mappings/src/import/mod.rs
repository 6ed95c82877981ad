//! HF checkpoint (config.json, tokenizer files, safetensors shards) -> GGUF, the way llama.cpp's
//! `convert_hf_to_gguf.py` writes it: same metadata keys in the same order with the same value
//! types (duplicates included), the same tensors in the same order with the same dtype rules
//! (spec §2.7), experts stacked and MLA kv_b split with the mapping tables' names.
//!
//! [`plan`] reads only headers and JSON and fixes every byte of the output headers;
//! [`Plan::write_shard`] then streams tensor data in one read pass: plain tensors in bounded
//! chunks, stacked experts one expert at a time, and only permuted tensors (kv_b split, llama's
//! q/k RoPE rows) whole. Memory is bounded by the largest single HF tensor that needs a permutation,
//! not by the model. Where the files go (atomic `.partial` + rename) is the caller's business.

pub mod data;
pub mod kv;
pub mod naming;
pub mod params;
pub mod spm;
pub mod vocab;

use crate::hf::{read_header, HfTensor};
use crate::kvb::{self, MlaDims};
use crate::table::{table, Env, Kind, MetaSource, MetaVal, Table, Transform};
use crate::MappingError;
use data::RecipeInfo;
use gguf::writer::Layout;
use gguf::{GgmlType, TensorInfo, Value};
use kv::Kv;
use params::{HParams, Recipe};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub(crate) fn ierr(path: &Path, msg: impl Into<String>) -> MappingError {
    MappingError::File {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

fn terr(t: &str, msg: impl Into<String>) -> MappingError {
    MappingError::Tensor {
        tensor: t.to_string(),
        msg: msg.into(),
    }
}

/// `--outtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    Bf16,
    Q8_0,
    /// The 16-bit type of the first 2-D tensor (bf16 or f16), else f16.
    Auto,
}

/// llama.cpp's `general.file_type` of a conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum FileType {
    F32,
    F16,
    Q8_0,
    Bf16,
}

impl FileType {
    pub fn id(self) -> u64 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q8_0 => 7,
            FileType::Bf16 => 32,
        }
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            FileType::F32 => GgmlType::F32,
            FileType::F16 => GgmlType::F16,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Bf16 => GgmlType::BF16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::F16 => "F16",
            FileType::Q8_0 => "Q8_0",
            FileType::Bf16 => "BF16",
        }
    }
}

/// Conversion settings.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    pub outtype: OutType,
    /// `general.name` instead of the directory-derived one.
    pub model_name: Option<String>,
    /// Start a new shard after this many tensors (gguf-py's rule).
    pub split_max_tensors: Option<usize>,
    /// Start a new shard when the next tensor would push the shard's tensor bytes past this.
    pub split_max_bytes: Option<u64>,
}

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            outtype: OutType::Auto,
            model_name: None,
            split_max_tensors: None,
            split_max_bytes: None,
        }
    }
}

/// Source element type (safetensors dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    Bf16,
    F16,
    F32,
    F64,
}

impl Src {
    fn of(t: &HfTensor) -> Result<Src, MappingError> {
        Ok(match t.dtype.as_str() {
            "BF16" => Src::Bf16,
            "F16" => Src::F16,
            "F32" => Src::F32,
            "F64" => Src::F64,
            d => {
                return Err(terr(
                    &t.name,
                    format!(
                        "safetensors dtype {d} is not supported (float checkpoints only; FP8/int \
                         checkpoints need dequantizing first)"
                    ),
                ))
            }
        })
    }
    fn size(self) -> usize {
        match self {
            Src::Bf16 | Src::F16 => 2,
            Src::F32 => 4,
            Src::F64 => 8,
        }
    }
}

/// Where an output tensor's values come from.
#[derive(Debug, Clone)]
enum Source {
    /// One HF tensor, optionally with its rows permuted (llama q/k), +1 (gemma norms) or cut to
    /// the first `rows` rows (gemma's embedding beyond the tokenizer).
    Plain {
        t: HfTensor,
        permute_heads: Option<usize>,
        add_one: bool,
        rows: Option<usize>,
    },
    /// Per-expert HF tensors stacked along the slowest dimension.
    Stack(Vec<HfTensor>),
    /// attn_k_b (`k: true`) or attn_v_b of an MLA kv_b_proj.
    KvB { t: HfTensor, d: MlaDims, k: bool },
    /// Values computed from config.json (llama3 rope_freqs).
    Computed(Vec<f32>),
}

/// One GGUF tensor of the output.
#[derive(Debug, Clone)]
pub struct OutTensor {
    pub name: String,
    /// ggml `ne`.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    pub bytes: u64,
    src: Source,
}

/// A planned output file.
pub struct Shard {
    pub layout: Layout,
    /// Indices into [`Plan::tensors`].
    pub range: std::ops::Range<usize>,
}

/// Progress of [`Plan::write_shard`]; the callback returns `false` to stop (Ctrl-C).
#[derive(Debug, Clone)]
pub enum Progress<'a> {
    Tensor { name: &'a str, bytes: u64 },
}

/// What was planned, for the summary.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ImportSummary {
    pub arch: String,
    pub hf_architecture: String,
    pub name: Option<String>,
    pub size_label: Option<String>,
    pub file_type: String,
    pub tensors: usize,
    pub bytes: u64,
    pub shards: usize,
    pub metadata_keys: usize,
    /// Tensor count per ggml type.
    pub types: BTreeMap<String, usize>,
    pub parameters: u64,
    pub tokenizer: String,
    pub pre_tokenizer: String,
    pub n_vocab: usize,
    /// Keys written twice by the converter's recipe (last value kept, as llama.cpp's writer does).
    pub duplicated_keys: Vec<String>,
    pub notes: Vec<String>,
}

/// The whole conversion, fixed before any tensor byte is read.
pub struct Plan {
    pub tensors: Vec<OutTensor>,
    pub shards: Vec<Shard>,
    pub metadata: gguf::Metadata,
    pub summary: ImportSummary,
}

/// The converter's tensor order: shard files sorted by name (from the index when there is one,
/// else every `model*.safetensors`), names sorted within each file.
fn source_tensors(dir: &Path) -> Result<Vec<HfTensor>, MappingError> {
    let index = dir.join("model.safetensors.index.json");
    let mut files: Vec<String> = if index.is_file() {
        let s = std::fs::read_to_string(&index).map_err(|e| ierr(&index, e.to_string()))?;
        let j: Json =
            serde_json::from_str(&s).map_err(|e| ierr(&index, format!("invalid JSON: {e}")))?;
        let map = j
            .get("weight_map")
            .and_then(Json::as_object)
            .ok_or_else(|| ierr(&index, "no weight_map object"))?;
        let mut f = vec![];
        for (name, file) in map {
            let file = file
                .as_str()
                .filter(|f| !f.contains('/') && !f.contains('\\') && *f != "..")
                .ok_or_else(|| ierr(&index, format!("{name}: shard is not a plain file name")))?;
            if !f.iter().any(|x| x == file) {
                f.push(file.to_string());
            }
        }
        let mut listed: Vec<&String> = map.keys().collect();
        listed.sort();
        f.sort();
        let mut all = vec![];
        for file in &f {
            all.extend(read_header(&dir.join(file))?);
        }
        let mut have: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
        have.sort();
        have.dedup();
        if have.len() != listed.len() || have.iter().zip(&listed).any(|(a, b)| *a != b.as_str()) {
            let missing: Vec<&&String> = listed
                .iter()
                .filter(|n| have.binary_search(&n.as_str()).is_err())
                .take(5)
                .collect();
            return Err(ierr(
                &index,
                format!("weight map and shard files disagree (e.g. missing {missing:?}); incomplete download?"),
            ));
        }
        f
    } else {
        let mut f: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| ierr(dir, e.to_string()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("model") && n.ends_with(".safetensors"))
            .collect();
        f.sort();
        f
    };
    if files.is_empty() {
        return Err(ierr(dir, "no model*.safetensors files"));
    }
    files.dedup();
    let mut out: Vec<HfTensor> = vec![];
    let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for f in files {
        let mut ts = read_header(&dir.join(&f))?;
        ts.sort_by(|a, b| a.name.cmp(&b.name));
        for t in ts {
            // a later file's tensor of the same name replaces the earlier one in place
            match at.get(&t.name) {
                Some(&i) => out[i] = t,
                None => {
                    at.insert(t.name.clone(), out.len());
                    out.push(t);
                }
            }
        }
    }
    Ok(out)
}

fn block_of(name: &str) -> Option<u64> {
    name.split('.')
        .find(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|p| p.parse().ok())
}

fn rows_cols(t: &HfTensor) -> (usize, usize) {
    let rows = t.shape.first().copied().unwrap_or(1) as usize;
    let cols = t.shape.iter().skip(1).product::<u64>() as usize;
    (rows, cols.max(1))
}

/// Metadata as the tables read it (for the shape checks of the mapping table).
struct KvSource<'a>(&'a gguf::Metadata);

impl MetaSource for KvSource<'_> {
    fn meta(&self, key: &str) -> Option<MetaVal> {
        let v = self.0.get(key)?;
        Some(match v {
            Value::Array(a) => MetaVal::Array(a.len() as u64),
            Value::String(_) => MetaVal::Str,
            Value::Bool(b) => MetaVal::Bool(*b),
            Value::F32(x) => MetaVal::Float(f64::from(*x)),
            Value::F64(x) => MetaVal::Float(*x),
            other => match other.as_i64() {
                Some(i) => MetaVal::Int(i),
                None => MetaVal::HugeInt,
            },
        })
    }
}

/// The output type of one tensor (prepare_tensors' rules).
fn tensor_type(name: &str, ne: &[u64], ftype: FileType, d: &data::ImportData) -> GgmlType {
    if ne.len() <= 1
        || name.ends_with("_norm.weight")
        || d.forced_f32(name)
        || !name.ends_with(".weight")
    {
        return GgmlType::F32;
    }
    let t = ftype.ggml();
    // gguf-py raises QuantError when a row does not split into blocks; the converter falls back
    if t == GgmlType::Q8_0 && !ne[0].is_multiple_of(32) {
        return GgmlType::F16;
    }
    t
}

fn llama3_rope_freqs(hp: &HParams) -> Result<Option<Vec<f32>>, MappingError> {
    let rp = hp.rope_parameters();
    let p = rp
        .get("full_attention")
        .and_then(Json::as_object)
        .unwrap_or(&rp);
    if !p
        .get("rope_type")
        .and_then(Json::as_str)
        .is_some_and(|t| t.eq_ignore_ascii_case("llama3"))
    {
        return Ok(None);
    }
    let f = |k: &str, d: f64| -> Result<f64, MappingError> {
        match p.get(k).filter(|v| !v.is_null()) {
            Some(v) => hp.float_of(k, v),
            None => Ok(d),
        }
    };
    let base = f("rope_theta", 10000.0)? as f32;
    let dim = match hp.int("head_dim")? {
        Some(d) => d,
        None => hp.req_int("hidden_size")? / hp.req_int("num_attention_heads")?.max(1),
    };
    let factor = f("factor", 8.0)? as f32;
    let low = f("low_freq_factor", 1.0)? as f32;
    let high = f("high_freq_factor", 4.0)? as f32;
    let old = f("original_max_position_embeddings", 8192.0)? as f32;
    let (low_wl, high_wl) = (old / low, old / high);
    // torch float32 arithmetic, as the converter computes it
    let out = (0..dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0f32 / base.powf(i as f32 / dim as f32);
            let wl = 2.0 * std::f32::consts::PI / freq;
            if wl < high_wl {
                1.0
            } else if wl > low_wl {
                factor
            } else {
                let smooth = (old / wl - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect();
    Ok(Some(out))
}

/// Plans the conversion of the HF checkpoint in `dir` (its name as given feeds `general.name`).
pub fn plan(dir: &Path, opts: &ImportOptions) -> Result<Plan, MappingError> {
    let d = data::data()?;
    let mut hp = HParams::load(dir)?;
    hp.apply_defaults(&d.config_defaults);
    let class = hp
        .raw
        .get("architectures")
        .and_then(Json::as_array)
        .and_then(|a| a.first())
        .and_then(Json::as_str)
        .ok_or_else(|| ierr(&hp.path, "no architectures list"))?
        .to_string();
    let r: RecipeInfo = d.recipe(&class).cloned().ok_or_else(|| {
        ierr(
            &hp.path,
            format!(
                "architecture {class} is not supported (supported: {})",
                d.classes().join(", ")
            ),
        )
    })?;
    let t = table(&r.arch)?;
    let sources = source_tensors(dir)?;
    let mut notes = vec![];

    let ftype = match opts.outtype {
        OutType::F32 => FileType::F32,
        OutType::F16 => FileType::F16,
        OutType::Bf16 => FileType::Bf16,
        OutType::Q8_0 => FileType::Q8_0,
        OutType::Auto => sources
            .iter()
            .filter(|s| s.shape.len() >= 2)
            .find_map(|s| match s.dtype.as_str() {
                "BF16" => Some(FileType::Bf16),
                "F16" => Some(FileType::F16),
                _ => None,
            })
            .unwrap_or(FileType::F16),
    };

    let n_layers = hp
        .find(&["n_layers", "num_hidden_layers", "n_layer", "num_layers"])
        .map(|v| hp.int_of("num_hidden_layers", v))
        .transpose()?
        .ok_or_else(|| ierr(&hp.path, "missing num_hidden_layers"))?;
    let nextn = hp.int("num_nextn_predict_layers")?.unwrap_or(0);
    let block_count = if r.mtp { n_layers + nextn } else { n_layers };

    let mut params_kv = Kv::default();
    params::write_params(
        &mut params_kv,
        &hp,
        &r.arch,
        r.recipe,
        block_count,
        ftype,
        &mut notes,
    )?;
    let mut vocab_kv = Kv::default();
    let vocab = vocab::write_vocab(&mut vocab_kv, dir, &hp, &r.arch, r.vocab, d)?;

    // the tables' view of the metadata: shapes are checked against the names' table
    let mut check_meta = params_kv.meta.clone();
    for (k, v) in vocab_kv.meta.entries() {
        check_meta.set(k, v.clone());
    }
    let src = KvSource(&check_meta);
    let env = Env::new(t, &src);

    let tensors = plan_tensors(
        t,
        &env,
        &r,
        &hp,
        &sources,
        block_count,
        n_layers,
        ftype,
        vocab.n_tokens,
        d,
    )?;

    // gguf-py's parameter count: experts counted once per expert for the size label
    let (mut total, mut shared, mut expert, mut exp_sum, mut exp_n) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    for o in &tensors {
        let size: u64 = o.ne.iter().product();
        total += size;
        if o.name.contains("_exps.") && o.ne.len() >= 3 {
            let count = if o.name.contains(".bias") {
                o.ne[1]
            } else {
                o.ne[2]
            };
            expert += size / count.max(1);
            exp_sum += count;
            exp_n += 1;
        } else {
            shared += size;
        }
    }
    let exp_count = exp_sum.checked_div(exp_n).unwrap_or(0);

    let mut info =
        naming::ModelInfo::load(dir, Some(&hp.raw), opts.model_name.as_deref(), total as i64);
    if info.size_label.is_none() && total > 0 {
        info.size_label = Some(naming::size_label(total, shared, expert, exp_count));
    }

    let mut kv = Kv::default();
    kv.string("general.architecture", &r.arch);
    kv.string("general.type", "model");
    info.write(&mut kv);
    kv.extend(params_kv);
    kv.u32("general.quantization_version", 2);
    kv.extend(vocab_kv);

    let shards = plan_shards(&kv.meta, &tensors, opts)?;
    let mut types = BTreeMap::new();
    for o in &tensors {
        *types.entry(o.ty.name().to_string()).or_insert(0) += 1;
    }
    let summary = ImportSummary {
        arch: r.arch.clone(),
        hf_architecture: class,
        name: info.name.clone(),
        size_label: info.size_label.clone(),
        file_type: ftype.name().into(),
        tensors: tensors.len(),
        bytes: tensors.iter().map(|o| o.bytes).sum(),
        shards: shards.len(),
        metadata_keys: kv.meta.len(),
        types,
        parameters: total,
        tokenizer: vocab.model.into(),
        pre_tokenizer: vocab.pre.clone(),
        n_vocab: vocab.n_tokens,
        duplicated_keys: kv.duplicated.clone(),
        notes,
    };
    Ok(Plan {
        tensors,
        shards,
        metadata: kv.meta,
        summary,
    })
}

#[allow(clippy::too_many_arguments)]
fn plan_tensors(
    t: &Table,
    env: &Env,
    r: &RecipeInfo,
    hp: &HParams,
    sources: &[HfTensor],
    block_count: u64,
    n_layers: u64,
    ftype: FileType,
    n_tokens: usize,
    d: &data::ImportData,
) -> Result<Vec<OutTensor>, MappingError> {
    let mut out: Vec<OutTensor> = vec![];
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut push = |name: String, ne: Vec<u64>, src: Source| -> Result<(), MappingError> {
        let ty = tensor_type(&name, &ne, ftype, d);
        let row = ty
            .row_bytes(ne[0])
            .ok_or_else(|| terr(&name, format!("ne0 {} does not fit {}", ne[0], ty.name())))?;
        let bytes = ne
            .iter()
            .skip(1)
            .try_fold(row, |a, x| a.checked_mul(*x))
            .ok_or_else(|| terr(&name, "size overflows"))?;
        if !seen.insert(name.clone()) {
            return Err(terr(&name, "produced twice (duplicated HF tensors?)"));
        }
        out.push(OutTensor {
            name,
            ne,
            ty,
            bytes,
            src,
        });
        Ok(())
    };
    if r.recipe == Recipe::Llama {
        if let Some(f) = llama3_rope_freqs(hp)? {
            push(
                "rope_freqs.weight".into(),
                vec![f.len() as u64],
                Source::Computed(f),
            )?;
        }
    }
    let tied = hp.get("tie_word_embeddings").and_then(Json::as_bool) == Some(true);
    let n_expert = env.var("n_expert").ok().and_then(|n| u64::try_from(n).ok());
    let expert_entries: Vec<usize> = t
        .entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.kind == Kind::Experts)
        .map(|(i, _)| i)
        .collect();
    // per block: (entry index, expert) -> tensor
    let mut pending: BTreeMap<u64, BTreeMap<(usize, u64), HfTensor>> = BTreeMap::new();
    let check =
        |e: &crate::table::Entry, part: usize, bid: Option<u64>, name: &str, ne: &[u64]| match env
            .shape(e, part, bid)
        {
            Ok(want) if want != ne => Err(terr(
                name,
                format!("ne {ne:?} but the {} table expects {want:?}", t.arch),
            )),
            _ => Ok(()),
        };
    let hp_int = |k: &str| hp.req_int(k);
    for s in sources {
        if d.skip_suffixes.iter().any(|x| s.name.ends_with(x.as_str())) {
            continue;
        }
        let bid = block_of(&s.name);
        if r.drop_mtp && s.name.starts_with("model.layers.") && bid.is_some_and(|b| b >= n_layers) {
            continue;
        }
        if r.skip_tied_head
            && tied
            && (s.name == "lm_head.weight" || s.name == "model.lm_head.weight")
        {
            continue;
        }
        let hit = t.match_hf(&s.name).ok_or_else(|| {
            terr(
                &s.name,
                format!("cannot map this tensor with the {} table", t.arch),
            )
        })?;
        let e = hit.entry;
        let idx = hit.idx;
        if let Some(b) = idx.bid {
            if b >= block_count {
                return Err(terr(
                    &s.name,
                    format!("block {b} beyond block_count {block_count}"),
                ));
            }
        }
        match e.kind {
            Kind::HfOnly | Kind::Tied | Kind::GgufOnly => continue,
            Kind::Plain => {
                Src::of(s)?;
                let name = e.gguf[0].render(idx);
                let mut rows = None;
                if r.recipe == Recipe::Gemma3 && name == "token_embd.weight" {
                    rows = Some(n_tokens.min(s.shape.first().copied().unwrap_or(0) as usize));
                }
                let mut ne: Vec<u64> = s.shape.iter().rev().copied().collect();
                if ne.is_empty() {
                    ne.push(1);
                }
                if let (Some(n), Some(last)) = (rows, ne.last_mut()) {
                    *last = n as u64;
                }
                check(e, 0, idx.bid, &name, &ne)?;
                let permute_heads = match &e.transform {
                    Some(Transform::RopePermute(h)) => {
                        let h = env
                            .eval(h, idx.bid)
                            .map_err(|x| terr(&s.name, x.to_string()))?;
                        Some(usize::try_from(h).map_err(|_| terr(&s.name, "bad head count"))?)
                    }
                    _ => None,
                };
                push(
                    name,
                    ne,
                    Source::Plain {
                        t: s.clone(),
                        permute_heads,
                        add_one: matches!(e.transform, Some(Transform::AddOne)),
                        rows,
                    },
                )?;
            }
            Kind::KvB => {
                Src::of(s)?;
                let n_head = hp_int("num_key_value_heads")? as usize;
                let qk_nope = hp_int("qk_nope_head_dim")? as usize;
                let v_head = hp_int("v_head_dim")? as usize;
                let [rows, lora] = s.shape[..] else {
                    return Err(terr(
                        &s.name,
                        format!("kv_b_proj must be 2-D, shape {:?}", s.shape),
                    ));
                };
                let dm = MlaDims {
                    n_head,
                    qk_nope,
                    v_head,
                    kv_lora: lora as usize,
                };
                if rows as usize != n_head * (qk_nope + v_head) {
                    return Err(terr(
                        &s.name,
                        format!("{rows} rows, expected num_key_value_heads * (qk_nope_head_dim + v_head_dim) = {}", n_head * (qk_nope + v_head)),
                    ));
                }
                let names = e.gguf_names(idx.bid);
                let ne_k = vec![qk_nope as u64, lora, n_head as u64];
                let ne_v = vec![lora, v_head as u64, n_head as u64];
                check(e, 0, idx.bid, &names[0], &ne_k)?;
                check(e, 1, idx.bid, &names[1], &ne_v)?;
                push(
                    names[0].clone(),
                    ne_k,
                    Source::KvB {
                        t: s.clone(),
                        d: dm,
                        k: true,
                    },
                )?;
                push(
                    names[1].clone(),
                    ne_v,
                    Source::KvB {
                        t: s.clone(),
                        d: dm,
                        k: false,
                    },
                )?;
            }
            Kind::Experts => {
                Src::of(s)?;
                let (Some(b), Some(x)) = (idx.bid, idx.xid) else {
                    return Err(terr(&s.name, "expert tensor without block/expert index"));
                };
                let n = n_expert.ok_or_else(|| {
                    terr(
                        &s.name,
                        "per-expert tensors but no expert count in config.json",
                    )
                })?;
                if x >= n {
                    return Err(terr(&s.name, format!("expert {x} beyond expert_count {n}")));
                }
                let layer = pending.entry(b).or_default();
                layer.insert((hit.entry_index, x), s.clone());
                if layer.len() as u64 >= n * expert_entries.len() as u64 {
                    let layer = pending.remove(&b).unwrap_or_default();
                    // stacked in the order of their HF names (down, gate, up)
                    let mut kinds: Vec<usize> = expert_entries.clone();
                    kinds.sort_by_key(|i| t.entries[*i].hf.as_ref().map(|p| p.template.clone()));
                    for ei in kinds {
                        let entry = &t.entries[ei];
                        let parts: Vec<HfTensor> = (0..n)
                            .map(|x| {
                                layer.get(&(ei, x)).cloned().ok_or_else(|| {
                                    terr(
                                        &entry.hf_name(Some(b), Some(x)).unwrap_or_default(),
                                        "missing expert tensor",
                                    )
                                })
                            })
                            .collect::<Result<_, _>>()?;
                        let first = &parts[0];
                        if parts
                            .iter()
                            .any(|p| p.shape != first.shape || p.shape.len() != 2)
                        {
                            return Err(terr(
                                &first.name,
                                "experts of one layer differ in shape or are not 2-D",
                            ));
                        }
                        let ne = vec![first.shape[1], first.shape[0], n];
                        let name = entry.gguf[0].render(crate::table::Indices {
                            bid: Some(b),
                            xid: None,
                        });
                        check(entry, 0, Some(b), &name, &ne)?;
                        push(name, ne, Source::Stack(parts))?;
                    }
                }
            }
        }
    }
    if let Some((b, l)) = pending.iter().next() {
        return Err(terr(
            &format!("block {b}"),
            format!(
                "{} of the layer's per-expert tensors arrived, not all (incomplete checkpoint?)",
                l.len()
            ),
        ));
    }
    Ok(out)
}

/// gguf-py's split rule: a new shard when the current one has `max_tensors` tensors or when the
/// next tensor would take its (unpadded) tensor bytes past `max_bytes`; shard 1 carries the
/// metadata plus split.no/count/tensors.count, the others only the split keys.
fn plan_shards(
    meta: &gguf::Metadata,
    tensors: &[OutTensor],
    opts: &ImportOptions,
) -> Result<Vec<Shard>, MappingError> {
    let mut ranges: Vec<std::ops::Range<usize>> = vec![];
    let (mut start, mut acc) = (0usize, 0u64);
    for (i, o) in tensors.iter().enumerate() {
        if i > start {
            let by_n = opts
                .split_max_tensors
                .is_some_and(|n| n > 0 && i - start >= n);
            let by_b = opts
                .split_max_bytes
                .is_some_and(|m| m > 0 && acc + o.bytes > m);
            if by_n || by_b {
                ranges.push(start..i);
                start = i;
                acc = 0;
            }
        }
        acc += o.bytes;
    }
    ranges.push(start..tensors.len());
    let n = ranges.len();
    if n > u16::MAX as usize {
        return Err(terr(
            "split",
            format!("{n} shards exceed split.count's u16"),
        ));
    }
    let werr = |e: gguf::Error| terr("header", e.to_string());
    ranges
        .into_iter()
        .enumerate()
        .map(|(i, range)| {
            let mut m = if i == 0 {
                meta.clone()
            } else {
                gguf::Metadata::new(meta.file())
            };
            if n > 1 {
                m.set(gguf::split::KEY_NO, Value::U16(i as u16));
                m.set(gguf::split::KEY_COUNT, Value::U16(n as u16));
                m.set(
                    gguf::split::KEY_TENSORS_COUNT,
                    Value::I32(tensors.len() as i32),
                );
            }
            let infos = tensors[range.clone()]
                .iter()
                .map(|o| TensorInfo {
                    name: o.name.clone(),
                    dims: o.ne.clone(),
                    ty: o.ty,
                    offset: 0,
                })
                .collect();
            Ok(Shard {
                layout: Layout::new(3, &m, infos).map_err(werr)?,
                range,
            })
        })
        .collect()
}

/// Output file names: `OUT` for one shard, else gguf-py's `{stem}-00001-of-0000N.gguf` beside it.
pub fn shard_paths(out: &Path, n: usize) -> Vec<PathBuf> {
    if n <= 1 {
        return vec![out.to_path_buf()];
    }
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    (0..n)
        .map(|i| out.with_file_name(format!("{stem}-{:05}-of-{n:05}.gguf", i + 1)))
        .collect()
}

/// Elements per chunk when streaming a tensor (a multiple of every block size used).
const CHUNK_ELEMS: usize = 4 << 20;

struct Reader {
    files: BTreeMap<PathBuf, std::fs::File>,
}

impl Reader {
    fn read(
        &mut self,
        t: &HfTensor,
        off: u64,
        buf: &mut Vec<u8>,
        len: usize,
    ) -> Result<(), MappingError> {
        if !self.files.contains_key(&t.file) {
            let f = std::fs::File::open(&t.file).map_err(|e| ierr(&t.file, e.to_string()))?;
            self.files.insert(t.file.clone(), f);
        }
        let f = &self.files[&t.file];
        buf.resize(len, 0);
        f.read_exact_at(buf, t.start + off)
            .map_err(|e| ierr(&t.file, format!("tensor {}: {e}", t.name)))
    }
}

fn decode(src: Src, raw: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match src {
        Src::Bf16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)),
        ),
        Src::F16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        Src::F32 => out.extend(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        Src::F64 => {
            out.extend(raw.chunks_exact(8).map(|c| {
                f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32
            }))
        }
    }
}

/// gguf-py's f32 -> bf16: NaNs quieted, round to nearest even.
pub fn f32_to_bf16(x: f32) -> u16 {
    let mut n = u64::from(x.to_bits());
    if n & 0x7fff_ffff > 0x7f80_0000 {
        n = (n & 0xffff_0000) | (64 << 16);
    }
    ((n + (0x7fff + ((n >> 16) & 1))) >> 16) as u16
}

/// numpy's f32 -> f16 (round to nearest even; NaN payload kept, never turned into infinity).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7f80_0000 == 0x7f80_0000 && b & 0x007f_ffff != 0 {
        let sign = ((b >> 16) & 0x8000) as u16;
        let mut r = 0x7c00u16 + ((b & 0x007f_ffff) >> 13) as u16;
        if r == 0x7c00 {
            r += 1;
        }
        return sign | r;
    }
    half::f16::from_f32(x).to_bits()
}

/// Encodes f32 values as `ty` (F32, F16, BF16 or Q8_0; Q8_0 needs whole 32-value blocks).
fn encode(ty: GgmlType, v: &[f32], out: &mut Vec<u8>) -> Result<(), MappingError> {
    out.clear();
    match ty {
        GgmlType::F32 => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        GgmlType::F16 => out.extend(v.iter().flat_map(|x| f32_to_f16(*x).to_le_bytes())),
        GgmlType::BF16 => out.extend(v.iter().flat_map(|x| f32_to_bf16(*x).to_le_bytes())),
        GgmlType::Q8_0 => {
            use rayon::prelude::*;
            // ggml's quantize_row_q8_0_ref (gguf-py's Q8_0 is bit-exact with it), 64 blocks a task
            let parts: Vec<Vec<u8>> = v
                .par_chunks(32 * 64)
                .map(gguf::quant::quantize_row_q8_0)
                .collect::<Result<_, _>>()
                .map_err(|e| terr("Q8_0", e.to_string()))?;
            for p in parts {
                out.extend_from_slice(&p);
            }
        }
        other => return Err(terr("encode", format!("no encoder for {}", other.name()))),
    }
    Ok(())
}

impl Plan {
    /// Writes shard `i` (header, padding, tensor data) to `w`.
    pub fn write_shard(
        &self,
        i: usize,
        w: &mut dyn Write,
        progress: &mut dyn FnMut(Progress) -> bool,
    ) -> Result<(), MappingError> {
        let shard = &self.shards[i];
        let io = |e: std::io::Error| terr("<output>", e.to_string());
        let mut w = w;
        shard.layout.write_header(&mut w).map_err(io)?;
        let mut rd = Reader {
            files: BTreeMap::new(),
        };
        let (mut raw, mut vals, mut enc) = (Vec::new(), Vec::new(), Vec::new());
        for (k, (ti, pad)) in shard.layout.data_plan().into_iter().enumerate() {
            let o = &self.tensors[shard.range.start + ti];
            debug_assert_eq!(k, ti);
            gguf::writer::write_zeros(&mut w, pad).map_err(io)?;
            let mut written = 0u64;
            let mut emit = |bytes: &[u8], w: &mut dyn Write| -> Result<(), MappingError> {
                written += bytes.len() as u64;
                w.write_all(bytes).map_err(io)
            };
            match &o.src {
                Source::Computed(v) => {
                    encode(o.ty, v, &mut enc)?;
                    emit(&enc, w)?;
                }
                Source::Plain {
                    t,
                    permute_heads: None,
                    add_one,
                    rows,
                } => {
                    self.stream(
                        t,
                        *rows,
                        *add_one,
                        o,
                        &mut rd,
                        &mut raw,
                        &mut vals,
                        &mut enc,
                        &mut |b| emit(b, w),
                    )?;
                }
                Source::Stack(parts) => {
                    for t in parts {
                        self.stream(
                            t,
                            None,
                            false,
                            o,
                            &mut rd,
                            &mut raw,
                            &mut vals,
                            &mut enc,
                            &mut |b| emit(b, w),
                        )?;
                    }
                }
                Source::Plain {
                    t,
                    permute_heads: Some(h),
                    add_one,
                    ..
                } => {
                    let src = Src::of(t)?;
                    rd.read(t, 0, &mut raw, (t.end - t.start) as usize)?;
                    decode(src, &raw, &mut vals);
                    let (rows, cols) = rows_cols(t);
                    if *h == 0 || !rows.is_multiple_of(2 * h) {
                        return Err(terr(
                            &t.name,
                            format!("{rows} rows do not split into {h} rope heads"),
                        ));
                    }
                    let half = rows / h / 2;
                    let mut p = Vec::with_capacity(vals.len());
                    // GGUF row (head, j, s) <- HF row (head, s, j): rotate-half -> interleaved
                    for r in 0..rows {
                        let (head, rest) = (r / (2 * half), r % (2 * half));
                        let (j, s) = (rest / 2, rest % 2);
                        let src_row = head * 2 * half + s * half + j;
                        p.extend_from_slice(&vals[src_row * cols..(src_row + 1) * cols]);
                    }
                    if *add_one {
                        p.iter_mut().for_each(|x| *x += 1.0);
                    }
                    encode(o.ty, &p, &mut enc)?;
                    emit(&enc, w)?;
                }
                Source::KvB { t, d, k } => {
                    let src = Src::of(t)?;
                    rd.read(t, 0, &mut raw, (t.end - t.start) as usize)?;
                    decode(src, &raw, &mut vals);
                    let (kb, vb) =
                        kvb::split(&vals, *d).map_err(|e| terr(&t.name, e.to_string()))?;
                    encode(o.ty, if *k { &kb } else { &vb }, &mut enc)?;
                    emit(&enc, w)?;
                }
            }
            if written != o.bytes {
                return Err(terr(
                    &o.name,
                    format!("{written} bytes produced, {} planned", o.bytes),
                ));
            }
            if !progress(Progress::Tensor {
                name: &o.name,
                bytes: o.bytes,
            }) {
                return Err(MappingError::Interrupted);
            }
        }
        gguf::writer::write_zeros(&mut w, shard.layout.trailing_padding()).map_err(io)?;
        w.flush().map_err(io)
    }

    /// One HF tensor converted element by element in bounded chunks (whole rows, so Q8_0 blocks
    /// never straddle a chunk).
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        t: &HfTensor,
        rows: Option<usize>,
        add_one: bool,
        o: &OutTensor,
        rd: &mut Reader,
        raw: &mut Vec<u8>,
        vals: &mut Vec<f32>,
        enc: &mut Vec<u8>,
        emit: &mut dyn FnMut(&[u8]) -> Result<(), MappingError>,
    ) -> Result<(), MappingError> {
        let src = Src::of(t)?;
        let es = src.size();
        let n_total = ((t.end - t.start) as usize) / es;
        let row = (o.ne[0] as usize).max(1);
        let n = match rows {
            Some(r) => (r * rows_cols(t).1).min(n_total),
            None => n_total,
        };
        let per = (CHUNK_ELEMS / row).max(1) * row;
        let mut off = 0usize;
        while off < n {
            let k = per.min(n - off);
            rd.read(t, (off * es) as u64, raw, k * es)?;
            let same = !add_one
                && matches!(
                    (src, o.ty),
                    (Src::F32, GgmlType::F32) | (Src::F16, GgmlType::F16)
                );
            if same {
                emit(raw)?;
            } else if src == Src::Bf16 && o.ty == GgmlType::BF16 && !add_one {
                // bf16 -> f32 -> bf16 is exact except that gguf-py quiets signalling NaNs
                for c in raw.chunks_exact_mut(2) {
                    let x = u16::from_le_bytes([c[0], c[1]]);
                    if x & 0x7fff > 0x7f80 {
                        c.copy_from_slice(&(x | 0x0040).to_le_bytes());
                    }
                }
                emit(raw)?;
            } else {
                decode(src, raw, vals);
                if add_one {
                    vals.iter_mut().for_each(|x| *x += 1.0);
                }
                encode(o.ty, vals, enc)?;
                emit(enc)?;
            }
            off += k;
        }
        Ok(())
    }
}
