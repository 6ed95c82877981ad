//! `tokenizer.*` keys: byte-level BPE from tokenizer.json (GLM, Llama 3, Qwen) and SentencePiece
//! from tokenizer.model (Gemma, Llama 2), then the special tokens, `add_*_token` flags and chat
//! template the way gguf-py's `SpecialVocab` collects them from tokenizer.json,
//! tokenizer_config.json and config.json. The BPE pre-tokenizer's llama.cpp name comes from the
//! data table keyed on (split regexes, architecture); unknown ones are refused.

use super::data::ImportData;
use super::kv::Kv;
use super::params::HParams;
use super::{ierr, spm};
use crate::MappingError;
use gguf::value::ValueType;
use gguf::Value;
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// ggml token types.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// Which vocabulary recipe (data/import.yaml `vocab`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabKind {
    Gpt2,
    Glm,
    SpmOrGpt2,
    Llama,
    Gemma3,
}

impl VocabKind {
    pub fn parse(s: &str) -> Option<VocabKind> {
        Some(match s {
            "gpt2" => VocabKind::Gpt2,
            "glm" => VocabKind::Glm,
            "spm_or_gpt2" => VocabKind::SpmOrGpt2,
            "llama" => VocabKind::Llama,
            "gemma3" => VocabKind::Gemma3,
            _ => return None,
        })
    }
}

fn read_json(path: &Path) -> Result<Option<Json>, MappingError> {
    if !path.is_file() {
        return Ok(None);
    }
    let s = std::fs::read_to_string(path).map_err(|e| ierr(path, e.to_string()))?;
    serde_json::from_str(&s)
        .map(Some)
        .map_err(|e| ierr(path, format!("invalid JSON: {e}")))
}

/// The converter's "looks special" rule for added tokens not flagged special.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// What the vocabulary step produced.
#[derive(Debug, Clone)]
pub struct VocabInfo {
    /// Number of tokens written (`tokenizer.ggml.tokens` length).
    pub n_tokens: usize,
    pub model: &'static str,
    pub pre: String,
}

/// Writes the tokenizer keys for `kind`. `n_vocab_hint` is config.json `vocab_size`.
pub fn write_vocab(
    kv: &mut Kv,
    dir: &Path,
    hp: &HParams,
    arch: &str,
    kind: VocabKind,
    data: &ImportData,
) -> Result<VocabInfo, MappingError> {
    let has_spm = dir.join("tokenizer.model").is_file();
    match kind {
        VocabKind::Llama => {
            if let Some(tc) = read_json(&dir.join("tokenizer_config.json"))? {
                if let Some(b) = tc.get("add_prefix_space").and_then(Json::as_bool) {
                    kv.bool("tokenizer.ggml.add_space_prefix", b);
                }
            }
            if has_spm {
                spm_vocab(kv, dir, hp)
            } else {
                gpt2_vocab(kv, dir, hp, arch, data, false)
            }
        }
        VocabKind::SpmOrGpt2 if has_spm => spm_vocab(kv, dir, hp),
        VocabKind::Gemma3 if has_spm => {
            let v = spm_vocab(kv, dir, hp)?;
            kv.bool("tokenizer.ggml.add_space_prefix", false);
            Ok(v)
        }
        VocabKind::Glm => gpt2_vocab(kv, dir, hp, arch, data, true),
        _ => gpt2_vocab(kv, dir, hp, arch, data, false),
    }
}

/// The Split regexes of a tokenizer.json pre_tokenizer, in order (`<gpt2>` for a ByteLevel that
/// applies GPT-2's own regex).
pub fn split_regexes(pre: &Json) -> Vec<String> {
    let mut out = vec![];
    let items: Vec<&Json> = match pre.get("pretokenizers").and_then(Json::as_array) {
        Some(a) => a.iter().collect(),
        None => vec![pre],
    };
    for p in items {
        match p.get("type").and_then(Json::as_str) {
            Some("Split") => {
                if let Some(r) = p
                    .get("pattern")
                    .and_then(|x| x.get("Regex").or_else(|| x.get("String")))
                    .and_then(Json::as_str)
                {
                    out.push(r.to_string());
                }
            }
            Some("ByteLevel") if p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) => {
                out.push("<gpt2>".into())
            }
            Some("Sequence") => out.extend(split_regexes(p)),
            _ => {}
        }
    }
    out
}

fn gpt2_vocab(
    kv: &mut Kv,
    dir: &Path,
    hp: &HParams,
    arch: &str,
    data: &ImportData,
    glm: bool,
) -> Result<VocabInfo, MappingError> {
    let tpath = dir.join("tokenizer.json");
    let tok = read_json(&tpath)?.ok_or_else(|| {
        ierr(
            &tpath,
            "missing: a byte-level BPE tokenizer.json (or a SentencePiece tokenizer.model) is needed",
        )
    })?;
    let model = tok.get("model").cloned().unwrap_or(Json::Null);
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        return Err(ierr(&tpath, "tokenizer model is not BPE"));
    }
    if model.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(ierr(
            &tpath,
            "BPE with byte_fallback (a SentencePiece-style llama tokenizer without tokenizer.model) is not supported",
        ));
    }
    let regexes = tok
        .get("pre_tokenizer")
        .map(split_regexes)
        .unwrap_or_default();
    let pre = data.pre_tokenizer(&regexes, arch).ok_or_else(|| {
        ierr(
            &tpath,
            format!(
                "unknown BPE pre-tokenizer for {arch}: split regexes {regexes:?}. Add it to \
                 mappings/data/import.yaml (pre_tokenizers) with llama.cpp's name for it"
            ),
        )
    })?;

    // id -> content, the base vocabulary then the added tokens (as tokenizers' get_vocab)
    let mut by_id: BTreeMap<u64, String> = BTreeMap::new();
    if let Some(v) = model.get("vocab").and_then(Json::as_object) {
        for (t, id) in v {
            let id = id
                .as_u64()
                .ok_or_else(|| ierr(&tpath, format!("vocab id of {t:?} is not an integer")))?;
            by_id.insert(id, t.clone());
        }
    }
    let empty = vec![];
    let added = tok
        .get("added_tokens")
        .and_then(Json::as_array)
        .unwrap_or(&empty);
    let mut added_by_content: BTreeMap<String, (u64, bool, bool)> = BTreeMap::new();
    for a in added {
        let (Some(id), Some(c)) = (
            a.get("id").and_then(Json::as_u64),
            a.get("content").and_then(Json::as_str),
        ) else {
            return Err(ierr(&tpath, "added token without id/content"));
        };
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        let normalized = a
            .get("normalized")
            .and_then(Json::as_bool)
            .unwrap_or(!special);
        by_id.insert(id, c.to_string());
        added_by_content.insert(c.to_string(), (id, special, normalized));
    }
    let n = match hp.int("vocab_size")? {
        Some(n) => n,
        None => by_id.len() as u64,
    };
    if let Some((max, _)) = by_id.last_key_value() {
        if *max >= n {
            return Err(ierr(
                &tpath,
                format!("token id {max} is not below config.json vocab_size {n}"),
            ));
        }
    }
    let n = usize::try_from(n).map_err(|_| ierr(&tpath, "vocab_size too large"))?;
    let mut tokens = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for i in 0..n as u64 {
        match by_id.get(&i) {
            None => {
                tokens.push(Value::String(format!("[PAD{i}]")));
                types.push(Value::I32(UNUSED));
            }
            Some(t) => {
                let mut t = t.clone();
                let ty = match added_by_content.get(&t) {
                    Some((_, special, _)) if *special || looks_special(&t) => CONTROL,
                    Some(_) => {
                        t = t.replace('\u{2581}', " ");
                        USER_DEFINED
                    }
                    None => NORMAL,
                };
                tokens.push(Value::String(t));
                types.push(Value::I32(ty));
            }
        }
    }
    kv.string("tokenizer.ggml.model", "gpt2");
    kv.string("tokenizer.ggml.pre", pre);
    kv.array("tokenizer.ggml.tokens", ValueType::String, tokens);
    kv.array("tokenizer.ggml.token_type", ValueType::I32, types);

    let mut sv = SpecialVocab::load(dir, Some(&tok), None, true)?;
    if glm {
        for (typ, content) in [
            ("bos", "[gMASK]"),
            ("eot", "<|user|>"),
            ("unk", "<|endoftext|>"),
            ("eom", "<|observation|>"),
        ] {
            let id = added_by_content.get(content).map(|a| a.0).ok_or_else(|| {
                ierr(
                    &tpath,
                    format!("GLM tokenizer lacks the added token {content}"),
                )
            })?;
            sv.set(typ, id as i64)?;
        }
    }
    sv.write(kv);
    Ok(VocabInfo {
        n_tokens: n,
        model: "gpt2",
        pre: pre.to_string(),
    })
}

fn spm_vocab(kv: &mut Kv, dir: &Path, hp: &HParams) -> Result<VocabInfo, MappingError> {
    let mpath = dir.join("tokenizer.model");
    let bytes = std::fs::read(&mpath).map_err(|e| ierr(&mpath, e.to_string()))?;
    let pieces = spm::parse_model(&bytes).map_err(|e| ierr(&mpath, e))?;
    let n = match hp.int("vocab_size")? {
        Some(n) => usize::try_from(n).map_err(|_| ierr(&mpath, "vocab_size too large"))?,
        None => pieces.len(),
    };
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-10000.0f32; n];
    let mut types = vec![UNUSED; n];
    for (i, p) in pieces.iter().enumerate().take(n) {
        tokens[i] = p.piece.clone();
        scores[i] = p.score;
        types[i] = match p.kind {
            spm::UNKNOWN => UNKNOWN,
            spm::CONTROL => CONTROL,
            spm::UNUSED => UNUSED,
            spm::BYTE => BYTE,
            _ => NORMAL,
        };
    }
    if let Some(Json::Object(added)) = read_json(&dir.join("added_tokens.json"))? {
        for (t, id) in added {
            let Some(id) = id.as_u64().map(|i| i as usize).filter(|i| *i < n) else {
                continue;
            };
            tokens[id] = t;
            scores[id] = -1000.0;
            types[id] = USER_DEFINED;
        }
    }
    if let Some(tc) = read_json(&dir.join("tokenizer_config.json"))? {
        if let Some(dec) = tc.get("added_tokens_decoder").and_then(Json::as_object) {
            for (id, t) in dec {
                let Some(id) = id.parse::<usize>().ok().filter(|i| *i < n) else {
                    continue;
                };
                let Some(content) = t.get("content").and_then(Json::as_str) else {
                    continue;
                };
                let special = t.get("special").and_then(Json::as_bool).unwrap_or(false);
                if special || looks_special(content) {
                    types[id] = CONTROL;
                    tokens[id] = content.to_string();
                } else {
                    types[id] = USER_DEFINED;
                    tokens[id] = content.replace('\u{2581}', " ");
                }
                scores[id] = -1000.0;
            }
        }
    }
    kv.string("tokenizer.ggml.model", "llama");
    kv.string("tokenizer.ggml.pre", "default");
    kv.array(
        "tokenizer.ggml.tokens",
        ValueType::String,
        tokens.into_iter().map(Value::String).collect(),
    );
    kv.array(
        "tokenizer.ggml.scores",
        ValueType::F32,
        scores.into_iter().map(Value::F32).collect(),
    );
    kv.array(
        "tokenizer.ggml.token_type",
        ValueType::I32,
        types.into_iter().map(Value::I32).collect(),
    );
    let tok = read_json(&dir.join("tokenizer.json"))?;
    let sv = SpecialVocab::load(dir, tok.as_ref(), Some(n), false)?;
    sv.write(kv);
    Ok(VocabInfo {
        n_tokens: n,
        model: "llama",
        pre: "default".into(),
    })
}

/// gguf-py's `SpecialVocab`: merges, special token ids, add_*_token flags, chat template,
/// normalizer flags, each list in the order it was filled.
#[derive(Debug, Default)]
struct SpecialVocab {
    merges: Vec<String>,
    ids: Vec<(String, i64)>,
    add: Vec<(String, bool)>,
    chat_template: Option<Json>,
    lowercase: Option<bool>,
    strip_accents: Option<bool>,
    n_vocab: Option<usize>,
    types: Vec<String>,
}

fn content_of(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(String::from),
        _ => None,
    }
}

impl SpecialVocab {
    fn set(&mut self, typ: &str, id: i64) -> Result<(), MappingError> {
        if id < 0 {
            return Err(ierr(
                Path::new("tokenizer"),
                format!("invalid value for special token type {typ}: {id}"),
            ));
        }
        if self.n_vocab.is_some_and(|n| id as u64 >= n as u64) {
            return Ok(());
        }
        if !self.ids.iter().any(|(t, _)| t == typ) {
            self.ids.push((typ.to_string(), id));
        }
        Ok(())
    }

    fn add_default(&mut self, typ: &str, v: bool) {
        if !self.add.iter().any(|(t, _)| t == typ) {
            self.add.push((typ.to_string(), v));
        }
    }

    fn add_set(&mut self, typ: &str, v: bool) {
        match self.add.iter_mut().find(|(t, _)| t == typ) {
            Some(e) => e.1 = v,
            None => self.add.push((typ.to_string(), v)),
        }
    }

    fn normalizer(&mut self, n: &Json) {
        match n.get("type").and_then(Json::as_str) {
            Some("Lowercase") => self.lowercase = Some(true),
            Some("StripAccents") => self.strip_accents = Some(true),
            Some("BertNormalizer") => {
                if let Some(b) = n.get("lowercase").and_then(Json::as_bool) {
                    self.lowercase = Some(b);
                }
                if let Some(b) = n.get("strip_accents").and_then(Json::as_bool) {
                    self.strip_accents = Some(b);
                }
            }
            Some("Sequence") => {
                for m in n
                    .get("normalizers")
                    .and_then(Json::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.normalizer(m);
                }
            }
            _ => {}
        }
    }

    fn load(
        dir: &Path,
        tok: Option<&Json>,
        n_vocab: Option<usize>,
        load_merges: bool,
    ) -> Result<SpecialVocab, MappingError> {
        let mut sv = SpecialVocab {
            n_vocab,
            types: ["bos", "eos", "unk", "sep", "pad", "cls", "mask"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ..Default::default()
        };
        let empty = vec![];
        let added = tok
            .and_then(|t| t.get("added_tokens"))
            .and_then(Json::as_array)
            .unwrap_or(&empty);
        if let Some(t) = tok {
            if load_merges {
                sv.merges = merges_of(t).map_err(|e| ierr(&dir.join("tokenizer.json"), e))?;
            }
            if let Some(n) = t.get("normalizer").filter(|n| !n.is_null()) {
                sv.normalizer(n);
            }
        }
        let mut cfg: Option<Map<String, Json>> =
            read_json(&dir.join("tokenizer_config.json"))?.and_then(|c| c.as_object().cloned());
        if let Some(t) = tok {
            sv.post_processor(t, &mut cfg);
        }
        if let Some(cfg) = &cfg {
            sv.chat_template = chat_template(dir, cfg)?;
            for typ in sv.types.clone() {
                if let Some(b) = cfg.get(&format!("add_{typ}_token")).and_then(Json::as_bool) {
                    sv.add_default(&typ, b);
                }
                let Some(content) = content_of(cfg.get(&format!("{typ}_token"))) else {
                    continue;
                };
                let id = added
                    .iter()
                    .find(|a| a.get("content").and_then(Json::as_str) == Some(content.as_str()))
                    .and_then(|a| a.get("id"))
                    .and_then(Json::as_i64);
                if let Some(id) = id {
                    sv.set(&typ, id)?;
                }
            }
        }
        if load_merges && sv.merges.is_empty() {
            sv.merges = merges_txt(&dir.join("merges.txt"));
        }
        if let Some(c) = read_json(&dir.join("config.json"))? {
            for typ in sv.types.clone() {
                let key = format!("{typ}_token_id");
                let v = c
                    .get(&key)
                    .filter(|v| !v.is_null())
                    .or_else(|| c.get("text_config").and_then(|t| t.get(&key)));
                // lists (several eos ids) are not ids
                if let Some(id) = v
                    .and_then(Json::as_i64)
                    .filter(|_| v.is_some_and(Json::is_i64))
                {
                    sv.set(&typ, id)?;
                }
            }
        }
        Ok(sv)
    }

    /// The post_processor rules of `_try_load_from_tokenizer_json` (ByteLevel, RobertaProcessing,
    /// TemplateProcessing).
    fn post_processor(&mut self, tok: &Json, cfg: &mut Option<Map<String, Json>>) {
        let get = |cfg: &Option<Map<String, Json>>, k: &str| {
            cfg.as_ref().and_then(|c| content_of(c.get(k)))
        };
        let mut bos = get(cfg, "bos_token");
        let mut cls = get(cfg, "cls_token");
        let mut eos = get(cfg, "eos_token");
        let sep = get(cfg, "sep_token");
        if let Some(c) = cfg.as_mut() {
            if bos.is_none() && cls.is_some() {
                bos = cls.clone();
                c.insert("bos_token".into(), Json::from(bos.clone()));
            }
            if eos.is_none() && sep.is_some() {
                eos = sep.clone();
                c.insert("eos_token".into(), Json::from(eos.clone()));
            }
        }
        let Some(pp) = tok.get("post_processor").filter(|p| !p.is_null()) else {
            return;
        };
        let procs: Vec<&Json> = match pp.get("processors").and_then(Json::as_array) {
            Some(a) => a.iter().collect(),
            None => vec![pp],
        };
        for p in procs {
            match p.get("type").and_then(Json::as_str) {
                Some("ByteLevel") => {
                    self.add_default("bos", false);
                    self.add_default("eos", false);
                }
                Some("RobertaProcessing") => {
                    self.add_set("bos", true);
                    self.add_set("eos", true);
                    self.add_set("sep", true);
                }
                Some("TemplateProcessing") => {
                    let special = |x: Option<&Json>| {
                        x.and_then(|e| e.get("SpecialToken"))
                            .and_then(|s| s.get("id"))
                            .and_then(Json::as_str)
                            .map(String::from)
                    };
                    let single = p
                        .get("single")
                        .and_then(Json::as_array)
                        .cloned()
                        .unwrap_or_default();
                    if single.len() > 1 {
                        if let Some(first) = special(single.first()) {
                            let known =
                                Some(&first) == bos.as_ref() || Some(&first) == cls.as_ref();
                            if cfg.is_none() {
                                bos = Some(first.clone());
                            } else if !known {
                                if let Some(c) = cfg.as_mut() {
                                    if bos.is_none() {
                                        bos = Some(first.clone());
                                        c.insert("bos_token".into(), Json::from(first.clone()));
                                    }
                                    if cls.is_none() {
                                        cls = Some(first.clone());
                                        c.insert("cls_token".into(), Json::from(first.clone()));
                                    }
                                }
                            }
                            let known =
                                Some(&first) == bos.as_ref() || Some(&first) == cls.as_ref();
                            self.add_set("bos", known);
                        }
                        if let Some(last) = special(single.last()) {
                            if cfg.is_none() {
                                eos = Some(last.clone());
                            } else if Some(&last) != eos.as_ref() {
                                if let Some(c) = cfg.as_mut() {
                                    for extra in ["eot", "eom"] {
                                        if !self.types.iter().any(|t| t == extra) {
                                            self.types.push(extra.into());
                                            c.insert(
                                                format!("{extra}_token"),
                                                Json::from(eos.clone()),
                                            );
                                            break;
                                        }
                                    }
                                    eos = Some(last.clone());
                                    c.insert("eos_token".into(), Json::from(last.clone()));
                                }
                            }
                            self.add_set("eos", Some(&last) == eos.as_ref());
                        }
                    }
                }
                _ => {}
            }
        }
    }

    fn write(&self, kv: &mut Kv) {
        if !self.merges.is_empty() {
            kv.str_array("tokenizer.ggml.merges", &self.merges);
        }
        for (typ, id) in &self.ids {
            let key = match typ.as_str() {
                "bos" => "bos_token_id",
                "eos" => "eos_token_id",
                "unk" => "unknown_token_id",
                "sep" => "seperator_token_id",
                "pad" => "padding_token_id",
                "mask" => "mask_token_id",
                "eot" => "eot_token_id",
                "eom" => "eom_token_id",
                _ => continue, // gguf-py has no handler (cls): skipped with a warning
            };
            kv.u32(&format!("tokenizer.ggml.{key}"), *id as u64);
        }
        for (typ, v) in &self.add {
            if matches!(typ.as_str(), "bos" | "eos" | "sep") {
                kv.bool(&format!("tokenizer.ggml.add_{typ}_token"), *v);
            }
        }
        match &self.chat_template {
            Some(Json::String(s)) => kv.string("tokenizer.chat_template", s),
            Some(Json::Array(list)) => {
                let mut default = None;
                let mut names = vec![];
                for c in list {
                    let name: String = c
                        .get("name")
                        .and_then(Json::as_str)
                        .unwrap_or("")
                        .chars()
                        .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' })
                        .collect();
                    let Some(t) = c.get("template").and_then(Json::as_str) else {
                        continue;
                    };
                    if name == "default" {
                        default = Some(t.to_string());
                    } else if !name.is_empty() {
                        kv.string(&format!("tokenizer.chat_template.{name}"), t);
                        if !names.contains(&name) {
                            names.push(name);
                        }
                    }
                }
                if !names.is_empty() {
                    kv.str_array("tokenizer.chat_templates", &names);
                }
                if let Some(d) = default {
                    kv.string("tokenizer.chat_template", &d);
                }
            }
            _ => {}
        }
        if let Some(b) = self.lowercase {
            kv.bool("tokenizer.ggml.normalizer.lowercase", b);
        }
        if let Some(b) = self.strip_accents {
            kv.bool("tokenizer.ggml.normalizer.strip_accents", b);
        }
    }
}

/// tokenizer.json merges as "a b" strings; pairs whose parts hold spaces get them as U+0120.
fn merges_of(tok: &Json) -> Result<Vec<String>, String> {
    let Some(m) = tok
        .get("model")
        .and_then(|m| m.get("merges"))
        .and_then(Json::as_array)
    else {
        return Ok(vec![]);
    };
    m.iter()
        .map(|e| match e {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) if p.len() == 2 => {
                let part = |x: &Json| {
                    x.as_str()
                        .map(|s| s.replace(' ', "\u{120}"))
                        .ok_or("merge part is not a string")
                };
                Ok(format!("{} {}", part(&p[0])?, part(&p[1])?))
            }
            _ => Err("unknown tokenizer merges format".to_string()),
        })
        .collect()
}

fn merges_txt(path: &Path) -> Vec<String> {
    let Ok(s) = std::fs::read_to_string(path) else {
        return vec![];
    };
    let mut lines = s.lines().peekable();
    if lines.peek().is_some_and(|l| l.trim().starts_with('#')) {
        lines.next();
    }
    lines
        .filter_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            (parts.len() == 2).then(|| format!("{} {}", parts[0], parts[1]))
        })
        .collect()
}

/// tokenizer_config.json `chat_template`, else chat_template.jinja (+ additional templates), else
/// chat_template.json.
fn chat_template(dir: &Path, cfg: &Map<String, Json>) -> Result<Option<Json>, MappingError> {
    if let Some(t) = cfg.get("chat_template") {
        return Ok(match t {
            Json::String(_) | Json::Array(_) => Some(t.clone()),
            _ => None,
        });
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let main = std::fs::read_to_string(&jinja).map_err(|e| ierr(&jinja, e.to_string()))?;
        let extra_dir = dir.join("additional_chat_templates");
        let mut extra: Vec<_> = std::fs::read_dir(&extra_dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .collect();
        if extra.is_empty() {
            return Ok(Some(Json::String(main)));
        }
        extra.sort();
        let mut list = vec![serde_json::json!({"name": "default", "template": main})];
        for p in extra {
            let t = std::fs::read_to_string(&p).map_err(|e| ierr(&p, e.to_string()))?;
            let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned());
            list.push(serde_json::json!({"name": stem, "template": t}));
        }
        return Ok(Some(Json::Array(list)));
    }
    Ok(read_json(&dir.join("chat_template.json"))?
        .and_then(|j| j.get("chat_template").cloned())
        .filter(|t| t.is_string() || t.is_array()))
}
