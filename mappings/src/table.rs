//! The per-architecture YAML tables (`mappings/data/<arch>.yaml`, embedded at build time) and the
//! name-resolution engine derived from them. One entry describes one tensor kind in both naming
//! schemes at once, so HF -> GGUF and GGUF -> HF can never disagree.
//!
//! YAML schema (see `data/glm-dsa.yaml` for a complete example):
//! - `arch`, `hf.model_types`, `hf.architectures`, optional `hf.prefix_aliases` (`{alias, canonical}`:
//!   HF name prefixes a converter strips, e.g. multimodal wrappers).
//! - `vars`: name -> `{key: "{arch}.x", or_len: "array.key", default: "expr"}` (integer metadata),
//!   `{len: "array.key", default: "expr"}` (array length) or `{expr: "..."}` (derived).
//! - `required_keys`: non-integer keys the runtime reads (`type`: float, bool, int, string; `optional`).
//! - `checks`: `{expr, msg}` consistency rules over `vars`.
//! - `layers`: named block sets, expressions over `bid` and `vars`.
//! - `tensors`: entries with `kind` (plain [default], experts, kv_b, gguf_only, hf_only), `gguf`
//!   (one pattern; two for kv_b: k_b then v_b), `hf` (on-disk name pattern), `shape` (ggml `ne`
//!   expressions; a list per GGUF tensor for kv_b), `layers`, `when`, `optional`, `tied_to`,
//!   `reverse_only` (GGUF -> HF only: legacy spellings), `transform` (`rope_permute(expr)`,
//!   `add_one`), `tp` (colwise/rowwise in the HF tensor-parallel plan; on stacked experts the
//!   split of each expert's own matrix), `role` (the forward pass's name for the tensor: one per
//!   GGUF pattern, so the runtime never spells GGUF names itself), `note`.
//!   Patterns use `{bid}` (block), `{xid}` (expert) and, in hf_only entries, `{any}`.

use crate::expr::{Expr, ExprError};
use crate::MappingError;
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// Embedded table sources, in the order `architectures()` lists them.
const SOURCES: [(&str, &str); 7] = [
    ("glm-dsa", include_str!("../data/glm-dsa.yaml")),
    ("deepseek2", include_str!("../data/deepseek2.yaml")),
    ("glm4moe", include_str!("../data/glm4moe.yaml")),
    ("llama", include_str!("../data/llama.yaml")),
    ("qwen2", include_str!("../data/qwen2.yaml")),
    ("qwen3", include_str!("../data/qwen3.yaml")),
    ("gemma3", include_str!("../data/gemma3.yaml")),
];

/// The llama.cpp architecture names that have a table.
pub fn architectures() -> Vec<&'static str> {
    SOURCES.iter().map(|(a, _)| *a).collect()
}

fn all_tables() -> &'static Result<Vec<Table>, MappingError> {
    static TABLES: OnceLock<Result<Vec<Table>, MappingError>> = OnceLock::new();
    TABLES.get_or_init(|| {
        SOURCES
            .iter()
            .map(|(arch, src)| Table::from_yaml(arch, src))
            .collect()
    })
}

/// The table of a llama.cpp architecture name (`general.architecture`).
pub fn table(arch: &str) -> Result<&'static Table, MappingError> {
    let tables = all_tables().as_ref().map_err(Clone::clone)?;
    tables
        .iter()
        .find(|t| t.arch == arch)
        .ok_or_else(|| MappingError::UnknownArch {
            arch: arch.to_string(),
            known: architectures().join(", "),
        })
}

/// The table whose HF `model_type` (config.json) is `model_type`.
pub fn table_for_model_type(model_type: &str) -> Result<&'static Table, MappingError> {
    let tables = all_tables().as_ref().map_err(Clone::clone)?;
    tables
        .iter()
        .find(|t| t.hf_model_types.iter().any(|m| m == model_type))
        .ok_or_else(|| MappingError::UnknownModelType {
            model_type: model_type.to_string(),
        })
}

/// What an entry describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// One HF tensor is one GGUF tensor (rename only; values may carry a `transform`).
    Plain,
    /// Per-expert HF tensors stacked along ne2 into one GGUF tensor.
    Experts,
    /// HF `kv_b_proj` split into GGUF `attn_k_b` + `attn_v_b` (spec §2.5).
    KvB,
    /// A GGUF tensor with no HF tensor (computed from config at conversion).
    GgufOnly,
    /// An HF tensor the converter drops.
    HfOnly,
    /// Output head absent on both sides: it shares the token embedding.
    Tied,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Experts => "experts",
            Kind::KvB => "kv_b",
            Kind::GgufOnly => "gguf_only",
            Kind::HfOnly => "hf_only",
            Kind::Tied => "tied",
        }
    }
}

/// Tensor-parallel split direction of an HF linear weight `[out, in]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tp {
    /// Output rows split evenly across ranks.
    Colwise,
    /// Input columns split evenly across ranks.
    Rowwise,
}

/// A value transform the converter applied on top of the rename.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transform {
    /// Llama q/k rows permuted from rotate-half to interleaved RoPE order, per `heads` heads.
    RopePermute(Expr),
    /// Gemma norms stored as `w + 1`.
    AddOne,
}

/// A name pattern with `{bid}`, `{xid}` and `{any}` placeholders.
#[derive(Debug, Clone)]
pub struct Pattern {
    pub template: String,
    re: Regex,
    pub has_bid: bool,
    pub has_xid: bool,
    pub has_any: bool,
}

/// Indices captured by a pattern match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Indices {
    pub bid: Option<u64>,
    pub xid: Option<u64>,
}

impl Pattern {
    fn compile(template: &str) -> Result<Pattern, String> {
        let mut re = String::from("^");
        let mut rest = template;
        let (mut has_bid, mut has_xid, mut has_any) = (false, false, false);
        while let Some(open) = rest.find('{') {
            re.push_str(&regex::escape(&rest[..open]));
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("unclosed '{{' in {template:?}"))?;
            let name = &rest[open + 1..open + close];
            // Indices without leading zeros, so that every name has exactly one spelling
            // and the two directions stay a bijection.
            let (flag, group) = match name {
                "bid" => (&mut has_bid, "(?P<bid>0|[1-9][0-9]*)"),
                "xid" => (&mut has_xid, "(?P<xid>0|[1-9][0-9]*)"),
                "any" => (&mut has_any, "(?:.+)"),
                _ => return Err(format!("unknown placeholder {{{name}}} in {template:?}")),
            };
            if *flag {
                return Err(format!("placeholder {{{name}}} twice in {template:?}"));
            }
            *flag = true;
            re.push_str(group);
            rest = &rest[open + close + 1..];
        }
        re.push_str(&regex::escape(rest));
        re.push('$');
        let re = Regex::new(&re).map_err(|e| format!("pattern {template:?}: {e}"))?;
        Ok(Pattern {
            template: template.to_string(),
            re,
            has_bid,
            has_xid,
            has_any,
        })
    }

    /// Matches a full name and returns its indices (`None` when it does not match or an index
    /// does not fit u64).
    pub fn matches(&self, name: &str) -> Option<Indices> {
        let caps = self.re.captures(name)?;
        let num = |g: &str| match caps.name(g) {
            None => Ok(None),
            Some(m) => m.as_str().parse::<u64>().map(Some).map_err(|_| ()),
        };
        Some(Indices {
            bid: num("bid").ok()?,
            xid: num("xid").ok()?,
        })
    }

    /// Renders the pattern; a missing index leaves its placeholder (e.g. `{xid}`) visible.
    pub fn render(&self, idx: Indices) -> String {
        let mut s = self.template.clone();
        if let Some(b) = idx.bid {
            s = s.replace("{bid}", &b.to_string());
        }
        if let Some(x) = idx.xid {
            s = s.replace("{xid}", &x.to_string());
        }
        s
    }
}

/// A variable read from metadata or derived.
#[derive(Debug, Clone)]
pub enum VarDef {
    Key {
        key: String,
        or_len: Option<String>,
        default: Option<Expr>,
    },
    Len {
        key: String,
        default: Option<Expr>,
    },
    Derived(Expr),
}

/// A metadata key the runtime needs that is not an integer shape variable.
#[derive(Debug, Clone)]
pub struct RequiredKey {
    pub key: String,
    pub ty: KeyType,
    pub optional: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyType {
    Int,
    Float,
    Bool,
    String,
}

/// A consistency rule over the variables.
#[derive(Debug, Clone)]
pub struct Check {
    pub expr: Expr,
    pub src: String,
    pub msg: String,
}

/// One tensor kind, in both naming schemes.
#[derive(Debug, Clone)]
pub struct Entry {
    pub kind: Kind,
    /// GGUF patterns: one, or two for kv_b (k_b, v_b); none for hf_only.
    pub gguf: Vec<Pattern>,
    /// HF on-disk name pattern; none for gguf_only.
    pub hf: Option<Pattern>,
    /// Expected ggml `ne` per GGUF pattern.
    pub shapes: Vec<Vec<Expr>>,
    /// Named block set the entry lives in (entries with `{bid}` only).
    pub layers: Option<String>,
    /// Extra condition (over `vars`, and `bid` for block entries).
    pub when: Option<Expr>,
    pub optional: bool,
    /// GGUF name of the tensor that stands in when this one is absent (tied embeddings).
    pub tied_to: Option<String>,
    pub reverse_only: bool,
    pub transform: Option<Transform>,
    pub tp: Option<Tp>,
    /// The runtime's role name of each GGUF pattern (empty: the runtime does not use the entry).
    pub roles: Vec<String>,
    pub note: Option<String>,
}

/// A compiled architecture table.
#[derive(Debug)]
pub struct Table {
    pub arch: String,
    pub hf_model_types: Vec<String>,
    pub hf_architectures: Vec<String>,
    prefix_aliases: Vec<(String, String)>,
    pub vars: BTreeMap<String, VarDef>,
    pub required_keys: Vec<RequiredKey>,
    pub checks: Vec<Check>,
    pub layers: BTreeMap<String, Expr>,
    pub entries: Vec<Entry>,
}

// ---- raw YAML ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTable {
    arch: String,
    hf: RawHf,
    vars: BTreeMap<String, RawVar>,
    #[serde(default)]
    required_keys: Vec<RawReqKey>,
    #[serde(default)]
    checks: Vec<RawCheck>,
    #[serde(default)]
    layers: BTreeMap<String, String>,
    tensors: Vec<RawEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHf {
    model_types: Vec<String>,
    architectures: Vec<String>,
    #[serde(default)]
    prefix_aliases: Vec<RawPrefixAlias>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrefixAlias {
    alias: String,
    canonical: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVar {
    key: Option<String>,
    or_len: Option<String>,
    len: Option<String>,
    default: Option<String>,
    expr: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReqKey {
    key: String,
    #[serde(rename = "type")]
    ty: String,
    #[serde(default)]
    optional: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheck {
    expr: String,
    msg: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    kind: Option<Kind>,
    gguf: Option<OneOrMany>,
    hf: Option<String>,
    shape: Option<serde_yaml::Value>,
    layers: Option<String>,
    when: Option<String>,
    #[serde(default)]
    optional: bool,
    tied_to: Option<String>,
    #[serde(default)]
    reverse_only: bool,
    transform: Option<String>,
    tp: Option<String>,
    role: Option<OneOrMany>,
    note: Option<String>,
}

fn scalar_expr(v: &serde_yaml::Value) -> Result<Expr, String> {
    let src = match v {
        serde_yaml::Value::String(s) => s.clone(),
        serde_yaml::Value::Number(n) => n.to_string(),
        other => return Err(format!("shape element {other:?} is not an expression")),
    };
    Expr::parse(&src).map_err(|e| e.to_string())
}

fn parse_shapes(v: &serde_yaml::Value, n: usize) -> Result<Vec<Vec<Expr>>, String> {
    let seq = v.as_sequence().ok_or("shape must be a list")?;
    let nested = seq.iter().all(|x| x.is_sequence()) && !seq.is_empty();
    let shapes: Vec<Vec<Expr>> = if nested {
        seq.iter()
            .map(|s| {
                s.as_sequence()
                    .into_iter()
                    .flatten()
                    .map(scalar_expr)
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<_, _>>()?
    } else {
        vec![seq.iter().map(scalar_expr).collect::<Result<_, _>>()?]
    };
    if shapes.len() != n {
        return Err(format!("{} shapes for {n} GGUF tensors", shapes.len()));
    }
    if shapes.iter().any(|s| s.is_empty() || s.len() > 4) {
        return Err("a shape needs 1 to 4 dimensions".into());
    }
    Ok(shapes)
}

impl Table {
    /// Parses and validates one table; every error names the architecture and the entry.
    pub fn from_yaml(arch: &str, src: &str) -> Result<Table, MappingError> {
        let bad = |msg: String| MappingError::BadTable {
            arch: arch.to_string(),
            msg,
        };
        let raw: RawTable = serde_yaml::from_str(src).map_err(|e| bad(e.to_string()))?;
        if raw.arch != arch {
            return Err(bad(format!("file declares arch {:?}", raw.arch)));
        }
        let pexpr = |s: &str| Expr::parse(s).map_err(|e| bad(e.to_string()));

        let mut vars = BTreeMap::new();
        for (name, v) in &raw.vars {
            let default = v.default.as_deref().map(pexpr).transpose()?;
            let def = match (&v.key, &v.len, &v.expr) {
                (Some(k), None, None) => VarDef::Key {
                    key: k.clone(),
                    or_len: v.or_len.clone(),
                    default,
                },
                (None, Some(k), None) if v.or_len.is_none() => VarDef::Len {
                    key: k.clone(),
                    default,
                },
                (None, None, Some(e)) if v.or_len.is_none() && default.is_none() => {
                    VarDef::Derived(pexpr(e)?)
                }
                _ => {
                    return Err(bad(format!(
                        "var {name}: needs exactly one of key/len/expr"
                    )))
                }
            };
            vars.insert(name.clone(), def);
        }

        let required_keys = raw
            .required_keys
            .iter()
            .map(|r| {
                let ty = match r.ty.as_str() {
                    "int" => KeyType::Int,
                    "float" => KeyType::Float,
                    "bool" => KeyType::Bool,
                    "string" => KeyType::String,
                    t => return Err(bad(format!("required key {}: unknown type {t}", r.key))),
                };
                Ok(RequiredKey {
                    key: r.key.clone(),
                    ty,
                    optional: r.optional,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;

        let checks = raw
            .checks
            .iter()
            .map(|c| {
                Ok(Check {
                    expr: pexpr(&c.expr)?,
                    src: c.expr.clone(),
                    msg: c.msg.clone(),
                })
            })
            .collect::<Result<Vec<_>, MappingError>>()?;

        let mut layers = BTreeMap::new();
        for (name, e) in &raw.layers {
            layers.insert(name.clone(), pexpr(e)?);
        }

        let mut entries = Vec::new();
        for (i, r) in raw.tensors.iter().enumerate() {
            let label =
                r.hf.clone()
                    .or_else(|| match &r.gguf {
                        Some(OneOrMany::One(s)) => Some(s.clone()),
                        Some(OneOrMany::Many(v)) => v.first().cloned(),
                        None => None,
                    })
                    .unwrap_or_else(|| format!("#{i}"));
            let ebad = |m: String| bad(format!("tensor {label}: {m}"));
            let kind = r.kind.unwrap_or(Kind::Plain);
            let gguf_src: Vec<String> = match &r.gguf {
                None => vec![],
                Some(OneOrMany::One(s)) => vec![s.clone()],
                Some(OneOrMany::Many(v)) => v.clone(),
            };
            let gguf = gguf_src
                .iter()
                .map(|s| Pattern::compile(s).map_err(&ebad))
                .collect::<Result<Vec<_>, _>>()?;
            let hf =
                r.hf.as_deref()
                    .map(|s| Pattern::compile(s).map_err(&ebad))
                    .transpose()?;
            let (n_gguf, need_hf) = match kind {
                Kind::Plain | Kind::Experts => (1, true),
                Kind::KvB => (2, true),
                Kind::GgufOnly => (1, false),
                Kind::HfOnly => (0, true),
                Kind::Tied => return Err(ebad("kind tied is derived, not declared".into())),
            };
            if gguf.len() != n_gguf || hf.is_some() != need_hf {
                return Err(ebad(format!(
                    "kind {} needs {n_gguf} gguf pattern(s) and {} hf pattern",
                    kind.as_str(),
                    if need_hf { "one" } else { "no" }
                )));
            }
            let shapes = match (&r.shape, n_gguf) {
                (None, 0) => vec![],
                (Some(v), n) if n > 0 => parse_shapes(v, n).map_err(ebad)?,
                _ => return Err(ebad("shape must be given exactly for GGUF tensors".into())),
            };
            let has_bid = gguf.iter().any(|p| p.has_bid) || hf.as_ref().is_some_and(|p| p.has_bid);
            if gguf.iter().any(|p| p.has_bid != has_bid)
                || hf.as_ref().is_some_and(|p| p.has_bid != has_bid)
            {
                return Err(ebad("{bid} must appear in every pattern or in none".into()));
            }
            let xid_ok = gguf.iter().all(|p| !p.has_xid && !p.has_any)
                && hf.as_ref().is_none_or(|p| {
                    p.has_xid == (kind == Kind::Experts) && (!p.has_any || kind == Kind::HfOnly)
                });
            if !xid_ok {
                return Err(ebad(
                    "{xid} only in experts HF patterns, {any} only in hf_only".into(),
                ));
            }
            if has_bid != r.layers.is_some() {
                return Err(ebad(
                    "block entries need `layers`, global ones must not have it".into(),
                ));
            }
            if let Some(l) = &r.layers {
                if !layers.contains_key(l) {
                    return Err(ebad(format!("unknown layer set {l}")));
                }
            }
            let transform = match r.transform.as_deref() {
                None => None,
                Some("add_one") => Some(Transform::AddOne),
                Some(t) if t.starts_with("rope_permute(") && t.ends_with(')') => Some(
                    Transform::RopePermute(pexpr(&t["rope_permute(".len()..t.len() - 1])?),
                ),
                Some(t) => return Err(ebad(format!("unknown transform {t}"))),
            };
            let tp = match r.tp.as_deref() {
                None => None,
                Some("colwise") => Some(Tp::Colwise),
                Some("rowwise") => Some(Tp::Rowwise),
                Some(t) => return Err(ebad(format!("unknown tp plan {t}"))),
            };
            let roles: Vec<String> = match &r.role {
                None => vec![],
                Some(OneOrMany::One(s)) => vec![s.clone()],
                Some(OneOrMany::Many(v)) => v.clone(),
            };
            if !roles.is_empty() && roles.len() != gguf.len() {
                return Err(ebad(format!(
                    "{} role(s) for {} GGUF pattern(s)",
                    roles.len(),
                    gguf.len()
                )));
            }
            if let Some(dup) = roles.iter().find(|x| {
                entries
                    .iter()
                    .any(|e: &Entry| e.roles.iter().any(|y| y == *x))
            }) {
                return Err(ebad(format!("role {dup} is given to two entries")));
            }
            entries.push(Entry {
                kind,
                gguf,
                hf,
                shapes,
                layers: r.layers.clone(),
                when: r.when.as_deref().map(pexpr).transpose()?,
                optional: r.optional,
                tied_to: r.tied_to.clone(),
                reverse_only: r.reverse_only,
                transform,
                tp,
                roles,
                note: r.note.clone(),
            });
        }

        let table = Table {
            arch: raw.arch,
            hf_model_types: raw.hf.model_types,
            hf_architectures: raw.hf.architectures,
            prefix_aliases: raw
                .hf
                .prefix_aliases
                .into_iter()
                .map(|p| (p.alias, p.canonical))
                .collect(),
            vars,
            required_keys,
            checks,
            layers,
            entries,
        };
        table.validate_names().map_err(bad)?;
        Ok(table)
    }

    /// Every identifier in every expression must be a var (or `bid` where a block is bound).
    fn validate_names(&self) -> Result<(), String> {
        let known = |v: &str, bid_ok: bool| self.vars.contains_key(v) || (bid_ok && v == "bid");
        let check = |e: &Expr, bid_ok: bool, what: &str| -> Result<(), String> {
            let mut names = vec![];
            e.vars(&mut names);
            match names.iter().find(|n| !known(n, bid_ok)) {
                Some(n) => Err(format!("{what}: unknown variable {n}")),
                None => Ok(()),
            }
        };
        for (name, def) in &self.vars {
            match def {
                VarDef::Key {
                    default: Some(e), ..
                }
                | VarDef::Len {
                    default: Some(e), ..
                }
                | VarDef::Derived(e) => check(e, false, &format!("var {name}"))?,
                _ => {}
            }
        }
        for c in &self.checks {
            check(&c.expr, false, &format!("check {}", c.src))?;
        }
        for (name, e) in &self.layers {
            check(e, true, &format!("layer set {name}"))?;
        }
        for e in &self.entries {
            let what = e.label();
            let bid_ok = e.layers.is_some();
            for s in e.shapes.iter().flatten() {
                check(s, bid_ok, &what)?;
            }
            if let Some(w) = &e.when {
                check(w, bid_ok, &what)?;
            }
            if let Some(Transform::RopePermute(h)) = &e.transform {
                check(h, bid_ok, &what)?;
            }
            if let Some(t) = &e.tied_to {
                if !self
                    .entries
                    .iter()
                    .any(|o| o.gguf.iter().any(|p| &p.template == t))
                {
                    return Err(format!(
                        "{what}: tied_to {t} is not a GGUF name of this table"
                    ));
                }
            }
        }
        Ok(())
    }

    /// HF name with a known wrapper prefix rewritten to the canonical one.
    pub fn canonical_hf<'a>(&self, name: &'a str) -> std::borrow::Cow<'a, str> {
        for (alias, canon) in &self.prefix_aliases {
            if let Some(rest) = name.strip_prefix(alias.as_str()) {
                return format!("{canon}{rest}").into();
            }
        }
        name.into()
    }

    /// The entry (and which of its GGUF patterns) a GGUF tensor name belongs to.
    pub fn match_gguf(&self, name: &str) -> Option<Hit<'_>> {
        self.entries.iter().enumerate().find_map(|(ei, e)| {
            e.gguf.iter().enumerate().find_map(|(part, p)| {
                p.matches(name).map(|idx| Hit {
                    entry: e,
                    entry_index: ei,
                    part,
                    idx,
                })
            })
        })
    }

    /// The entry an HF tensor name belongs to (legacy reverse-only spellings excluded).
    pub fn match_hf(&self, name: &str) -> Option<Hit<'_>> {
        let name = self.canonical_hf(name);
        self.entries.iter().enumerate().find_map(|(ei, e)| {
            if e.reverse_only {
                return None;
            }
            e.hf.as_ref()?.matches(&name).map(|idx| Hit {
                entry: e,
                entry_index: ei,
                part: 0,
                idx,
            })
        })
    }

    /// The entry and GGUF part that play `role` in the runtime's forward pass.
    pub fn entry_by_role(&self, role: &str) -> Option<(&Entry, usize)> {
        self.entries
            .iter()
            .find_map(|e| e.roles.iter().position(|r| r == role).map(|part| (e, part)))
    }

    /// The entry whose first GGUF template is exactly `template` (globals like `output.weight`).
    pub fn entry_by_gguf_template(&self, template: &str) -> Option<&Entry> {
        self.entries
            .iter()
            .find(|e| e.gguf.iter().any(|p| p.template == template))
    }
}

impl Entry {
    /// A readable label for messages.
    pub fn label(&self) -> String {
        self.gguf
            .first()
            .or(self.hf.as_ref())
            .map_or_else(|| "?".into(), |p| p.template.clone())
    }

    /// The GGUF names of this entry for block `bid`.
    pub fn gguf_names(&self, bid: Option<u64>) -> Vec<String> {
        self.gguf
            .iter()
            .map(|p| p.render(Indices { bid, xid: None }))
            .collect()
    }

    /// The HF name for block `bid`, expert `xid`.
    pub fn hf_name(&self, bid: Option<u64>, xid: Option<u64>) -> Option<String> {
        self.hf.as_ref().map(|p| p.render(Indices { bid, xid }))
    }
}

/// A name matched against a table entry.
#[derive(Debug, Clone, Copy)]
pub struct Hit<'t> {
    pub entry: &'t Entry,
    pub entry_index: usize,
    /// Which GGUF pattern matched (0, or 1 for attn_v_b of kv_b).
    pub part: usize,
    pub idx: Indices,
}

// ---- metadata access ----

/// A metadata value as the tables see it.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaVal {
    Int(i64),
    /// An unsigned value above i64::MAX.
    HugeInt,
    Float(f64),
    Bool(bool),
    Str,
    Array(u64),
}

impl MetaVal {
    fn type_name(&self) -> &'static str {
        match self {
            MetaVal::Int(_) | MetaVal::HugeInt => "integer",
            MetaVal::Float(_) => "float",
            MetaVal::Bool(_) => "bool",
            MetaVal::Str => "string",
            MetaVal::Array(_) => "array",
        }
    }
}

/// What the tables read from a model's metadata.
pub trait MetaSource {
    fn meta(&self, key: &str) -> Option<MetaVal>;
}

impl MetaSource for BTreeMap<String, MetaVal> {
    fn meta(&self, key: &str) -> Option<MetaVal> {
        self.get(key).cloned()
    }
}

/// A problem with one metadata key, found while evaluating variables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyIssue {
    pub key: String,
    /// "missing" or "expected integer, found float", ...
    pub problem: String,
}

/// Variable values for one model: metadata lookups with defaults, memoized, with every key problem
/// recorded once.
pub struct Env<'a> {
    table: &'a Table,
    meta: &'a dyn MetaSource,
    cache: RefCell<BTreeMap<String, Result<i64, ExprError>>>,
    issues: RefCell<Vec<KeyIssue>>,
    busy: RefCell<Vec<String>>,
}

impl<'a> Env<'a> {
    pub fn new(table: &'a Table, meta: &'a dyn MetaSource) -> Env<'a> {
        Env {
            table,
            meta,
            cache: RefCell::new(BTreeMap::new()),
            issues: RefCell::new(Vec::new()),
            busy: RefCell::new(Vec::new()),
        }
    }

    pub fn table(&self) -> &'a Table {
        self.table
    }

    /// The metadata key with `{arch}` substituted.
    pub fn key(&self, k: &str) -> String {
        k.replace("{arch}", &self.table.arch)
    }

    fn issue(&self, key: String, problem: String) {
        let mut v = self.issues.borrow_mut();
        if !v.iter().any(|i| i.key == key) {
            v.push(KeyIssue { key, problem });
        }
    }

    /// Key problems met so far (missing required keys, wrong types).
    pub fn issues(&self) -> Vec<KeyIssue> {
        self.issues.borrow().clone()
    }

    /// Records a problem found by a caller (e.g. a required non-integer key).
    pub fn note_issue(&self, key: String, problem: String) {
        self.issue(key, problem);
    }

    fn read_int(&self, key: &str) -> Option<Result<i64, ExprError>> {
        let v = self.meta.meta(key)?;
        Some(match v {
            MetaVal::Int(i) => Ok(i),
            other => {
                let p = format!("expected integer, found {}", other.type_name());
                self.issue(key.to_string(), p.clone());
                Err(ExprError::Unavailable(key.to_string(), p))
            }
        })
    }

    fn read_len(&self, key: &str) -> Option<Result<i64, ExprError>> {
        let v = self.meta.meta(key)?;
        Some(match v {
            MetaVal::Array(n) => i64::try_from(n).map_err(|_| ExprError::Overflow(key.into())),
            other => {
                let p = format!("expected array, found {}", other.type_name());
                self.issue(key.to_string(), p.clone());
                Err(ExprError::Unavailable(key.to_string(), p))
            }
        })
    }

    /// The value of variable `name`.
    pub fn var(&self, name: &str) -> Result<i64, ExprError> {
        if let Some(v) = self.cache.borrow().get(name) {
            return v.clone();
        }
        if self.busy.borrow().iter().any(|b| b == name) {
            return Err(ExprError::Unavailable(
                name.into(),
                "defined in terms of itself".into(),
            ));
        }
        let def = self
            .table
            .vars
            .get(name)
            .ok_or_else(|| ExprError::Unknown(name.into()))?;
        self.busy.borrow_mut().push(name.to_string());
        let r = self.compute(name, def);
        self.busy.borrow_mut().pop();
        self.cache.borrow_mut().insert(name.to_string(), r.clone());
        r
    }

    fn compute(&self, name: &str, def: &VarDef) -> Result<i64, ExprError> {
        match def {
            VarDef::Derived(e) => self.eval(e, None),
            VarDef::Key {
                key,
                or_len,
                default,
            } => {
                let k = self.key(key);
                if let Some(r) = self.read_int(&k) {
                    return r;
                }
                if let Some(r) = or_len.as_ref().and_then(|l| self.read_len(&self.key(l))) {
                    return r;
                }
                self.default_or_missing(name, k, default.as_ref())
            }
            VarDef::Len { key, default } => {
                let k = self.key(key);
                if let Some(r) = self.read_len(&k) {
                    return r;
                }
                self.default_or_missing(name, k, default.as_ref())
            }
        }
    }

    /// The fallback once key `k` (for variable `name`) is absent from the metadata: the table's
    /// default, or an "unavailable" error that is also recorded as an issue for the report.
    fn default_or_missing(
        &self,
        name: &str,
        k: String,
        default: Option<&Expr>,
    ) -> Result<i64, ExprError> {
        match default {
            Some(d) => self.eval(d, None),
            None => {
                self.issue(k.clone(), "missing".into());
                Err(ExprError::Unavailable(
                    name.into(),
                    format!("metadata key {k} is missing"),
                ))
            }
        }
    }

    /// Evaluates `e` with `bid` bound when given.
    pub fn eval(&self, e: &Expr, bid: Option<u64>) -> Result<i64, ExprError> {
        e.eval(&mut |n| match (n, bid) {
            ("bid", Some(b)) => i64::try_from(b).map_err(|_| ExprError::Overflow("bid".into())),
            _ => self.var(n),
        })
    }

    /// Whether block `bid` belongs to the entry (layer set and `when` both hold).
    pub fn entry_applies(&self, e: &Entry, bid: Option<u64>) -> Result<bool, ExprError> {
        if let Some(l) = &e.layers {
            let set = self
                .table
                .layers
                .get(l)
                .ok_or_else(|| ExprError::Unknown(l.clone()))?;
            if self.eval(set, bid)? == 0 {
                return Ok(false);
            }
        }
        match &e.when {
            Some(w) => Ok(self.eval(w, bid)? != 0),
            None => Ok(true),
        }
    }

    /// Expected ggml `ne` of GGUF part `part` of the entry at block `bid`.
    pub fn shape(&self, e: &Entry, part: usize, bid: Option<u64>) -> Result<Vec<u64>, ExprError> {
        let Some(s) = e.shapes.get(part) else {
            return Ok(vec![]);
        };
        s.iter()
            .map(|d| {
                let v = self.eval(d, bid)?;
                u64::try_from(v).map_err(|_| ExprError::Overflow(format!("{d} = {v} is negative")))
            })
            .collect()
    }

    /// Value of a non-integer key, checked against its expected type (for required_keys).
    pub fn check_required(&self, r: &RequiredKey) {
        let k = self.key(&r.key);
        match self.meta.meta(&k) {
            None if r.optional => {}
            None => self.issue(k, "missing".into()),
            Some(v) => {
                let ok = matches!(
                    (r.ty, &v),
                    (KeyType::Int, MetaVal::Int(_))
                        | (KeyType::Float, MetaVal::Float(_))
                        | (KeyType::Bool, MetaVal::Bool(_))
                        | (KeyType::String, MetaVal::Str)
                );
                if !ok {
                    let want = match r.ty {
                        KeyType::Int => "integer",
                        KeyType::Float => "float",
                        KeyType::Bool => "bool",
                        KeyType::String => "string",
                    };
                    self.issue(k, format!("expected {want}, found {}", v.type_name()));
                }
            }
        }
    }
}
