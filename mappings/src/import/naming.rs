//! `general.*` keys the way gguf-py's `Metadata` derives them: the model card's YAML front matter
//! (README.md), config.json `_name_or_path`, the directory's name as given (`tiny-glm5/` ->
//! "Tiny Glm5"), generation_config.json sampling defaults, and the size label from the parameter
//! counts of the written tensors ("6x4.8M" for 6 experts of 4.8M parameters each plus shared).

use super::kv::Kv;
use serde_json::Value as Json;
use std::path::Path;

/// The authorship and sampling fields gguf-py collects, in the order it writes them.
#[derive(Debug, Default, Clone)]
pub struct ModelInfo {
    pub sampling: Vec<(&'static str, Sampling)>,
    pub name: Option<String>,
    pub author: Option<String>,
    pub version: Option<String>,
    pub organization: Option<String>,
    pub finetune: Option<String>,
    pub basename: Option<String>,
    pub description: Option<String>,
    pub size_label: Option<String>,
    pub license: Option<String>,
    pub license_name: Option<String>,
    pub license_link: Option<String>,
    pub source_url: Option<String>,
    pub source_doi: Option<String>,
    pub source_uuid: Option<String>,
    pub source_repo_url: Option<String>,
    pub base_models: Option<Vec<Vec<(&'static str, String)>>>,
    pub datasets: Option<Vec<Vec<(&'static str, String)>>>,
    pub tags: Option<Vec<String>>,
    pub languages: Option<Vec<String>>,
}

/// A sampling default: gguf-py writes top_k, penalty_last_n and mirostat as INT32, the rest as
/// FLOAT32, and the sequence as a string.
#[derive(Debug, Clone)]
pub enum Sampling {
    Int(i64),
    Float(f64),
    Str(String),
}

/// Python's `str.islower()`: at least one cased character and no uppercase one.
fn py_islower(s: &str) -> bool {
    s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase)
}

/// Python's `str.title()`: the first cased character after an uncased one is uppercased, the
/// others lowercased.
fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        let cased = c.is_lowercase() || c.is_uppercase();
        if cased && !prev_cased {
            out.extend(c.to_uppercase());
        } else if cased {
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
        prev_cased = cased;
    }
    out
}

/// `Metadata.id_to_title`: words title-cased unless they carry capitals or look like versions.
pub fn id_to_title(s: &str) -> String {
    let version = regex::Regex::new(r"^(v\d+(?:\.\d+)*|\d.*)$").expect("static regex");
    s.trim()
        .replace('-', " ")
        .split_whitespace()
        .map(|w| {
            if py_islower(w) && !version.is_match(w) {
                py_title(w)
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What `Metadata.get_model_id_components` extracts from an `org/name-size-finetune-version` id.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct IdParts {
    pub full_name: Option<String>,
    pub org: Option<String>,
    pub basename: Option<String>,
    pub finetune: Option<String>,
    pub version: Option<String>,
    pub size_label: Option<String>,
}

fn re(p: &str) -> regex::Regex {
    regex::Regex::new(p).expect("static regex")
}

/// The name heuristics of gguf-py (version, quant type, size label, finetune words).
pub fn model_id_components(model_id: &str, total_params: i64) -> IdParts {
    if model_id.contains(' ') {
        return IdParts {
            full_name: Some(model_id.to_string()),
            ..Default::default()
        };
    }
    let (mut org, full) = match model_id.split_once('/') {
        Some((o, n)) => (Some(o.to_string()), n.to_string()),
        None => (None, model_id.to_string()),
    };
    if org.as_deref().is_some_and(|o| o.starts_with('.')) {
        org = None;
    }
    let mut parts: Vec<String> = full
        .split('-')
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect();
    let mut types: Vec<Vec<&str>> = vec![vec![]; parts.len()];
    let version_re = re(r"(?i)^(v|iter)?\d+([.]\d+)*$");
    let type_re = re(r"(?i)^(i?q\d(_\w)*|b?fp?(16|32))$");
    let size_re = re(r"(?i)^(([A]|\d+[x])?\d+([._]\d+)?[KMBT][\d]?|small|mini|medium|large|x?xl)$");
    let finetune_re = re(r"(?i)^(chat|instruct|vision|lora)$");
    for i in 0..parts.len() {
        let part = parts[i].clone();
        if version_re.is_match(&part) {
            types[i].push("version");
        } else if type_re.is_match(&part) {
            types[i].push("type");
            parts[i] = part.to_uppercase();
        } else if i > 0 && size_re.is_match(&part) {
            let mut p: Vec<char> = part.replace('_', ".").chars().collect();
            let n = p.len();
            // bloom-7b1 -> 7.1B
            if p[n - 1].is_ascii_digit() && n >= 2 {
                let last = p[n - 1];
                let unit = p[n - 2];
                p.truncate(n - 2);
                p.push('.');
                p.push(last);
                p.push(unit);
            }
            let n = p.len();
            if n > 1 && p[n - 2].is_ascii_digit() && "kmbt".contains(p[n - 1]) {
                p[n - 1] = p[n - 1].to_ascii_uppercase();
            }
            let mut part: String = p.iter().collect();
            if total_params != 0 {
                let unit = part.chars().last().unwrap_or(' ');
                let scale = " KMBT".find(unit);
                let num = part[..part.len() - unit.len_utf8()].parse::<f64>();
                if let (Ok(num), Some(scale)) = (num, scale) {
                    let label = num * 1000f64.powi(scale as i32);
                    let tp = total_params as f64;
                    let far = (total_params < 0 && label < (total_params.abs() / 8) as f64)
                        || (total_params > 0 && (label - tp).abs() > (7 * total_params / 8) as f64);
                    if far {
                        types[i].push("finetune");
                        let mut cs: Vec<char> = part.chars().collect();
                        if let Some(l) = cs.last_mut() {
                            *l = l.to_ascii_lowercase();
                        }
                        part = cs.into_iter().collect();
                    }
                }
            }
            if types[i].is_empty() {
                types[i].push("size_label");
            }
            parts[i] = part;
        } else if i > 0 && finetune_re.is_match(&part) {
            if total_params < 0 && part.eq_ignore_ascii_case("lora") {
                types[i].push("type");
            } else {
                types[i].push("finetune");
            }
        }
    }
    let numeric_size = parts
        .iter()
        .zip(&types)
        .any(|(n, t)| t.contains(&"size_label") && n.chars().any(|c| c.is_ascii_digit()));
    if numeric_size {
        for (n, t) in parts.iter().zip(types.iter_mut()) {
            if t.contains(&"size_label") && n.chars().all(char::is_alphabetic) {
                t.retain(|x| *x != "size_label");
            }
        }
    }
    let mut at_start = true;
    for (part, t) in parts.iter().zip(types.iter_mut()) {
        let alpha_first = part.chars().next().is_some_and(char::is_alphabetic);
        if at_start && ((t.is_empty() && alpha_first) || t.contains(&"version")) {
            t.push("basename");
        } else {
            at_start = false;
            if t.is_empty() {
                t.push("finetune");
            }
        }
    }
    for t in types.iter_mut().rev() {
        if t.contains(&"basename") && t.len() > 1 {
            t.retain(|x| *x != "basename");
        } else {
            break;
        }
    }
    let join = |want: &str, exclude: Option<&str>| -> Option<String> {
        let mut seen: Vec<&str> = vec![];
        for (n, t) in parts.iter().zip(&types) {
            if t.contains(&want) && exclude.is_none_or(|e| !t.contains(&e)) {
                // size labels are de-duplicated (order kept), the rest joined as they come
                if want != "size_label" || !seen.contains(&n.as_str()) {
                    seen.push(n);
                }
            }
        }
        (!seen.is_empty()).then(|| seen.join("-"))
    };
    let mut basename = join("basename", None);
    let size_label = join("size_label", None);
    let finetune = join("finetune", None);
    let version = join("version", Some("basename"));
    if size_label.is_none() && finetune.is_none() && version.is_none() {
        basename = None;
    }
    IdParts {
        full_name: Some(full),
        org,
        basename,
        finetune,
        version,
        size_label,
    }
}

/// gguf-py `model_weight_count_rounded_notation` (e.g. 4.8M, 22B).
pub fn rounded_count(n: u64, min_digits: usize) -> String {
    let x = n as f64;
    let (v, s) = if x > 1e12 {
        (x * 1e-12, "T")
    } else if x > 1e9 {
        (x * 1e-9, "B")
    } else if x > 1e6 {
        (x * 1e-6, "M")
    } else {
        (x * 1e-3, "K")
    };
    // Python's round() ties to even
    let int_digits = format!("{}", v.round_ties_even() as u64)
        .trim_start_matches('0')
        .len();
    let fix = min_digits.saturating_sub(int_digits);
    format!("{v:.fix$}{s}")
}

/// gguf-py `size_label`: `{experts}x{shared+per-expert}` for MoE models, else the total.
pub fn size_label(total: u64, shared: u64, expert: u64, expert_count: u64) -> String {
    if expert_count > 0 {
        format!("{expert_count}x{}", rounded_count(shared + expert, 2))
    } else {
        rounded_count(total, 2)
    }
}

fn yaml_front_matter(dir: &Path) -> Option<serde_yaml::Value> {
    let text = std::fs::read_to_string(dir.join("README.md")).ok()?;
    let mut lines = text.lines();
    if lines.next()? != "---" {
        return None;
    }
    let mut body = String::new();
    for l in lines {
        if l == "---" {
            break;
        }
        body.push_str(l);
        body.push('\n');
    }
    // gguf-py's fixes: the Norway problem and tabs
    let body = body.replace("- no\n", "- \"no\"\n").replace('\t', "  ");
    let v: serde_yaml::Value = serde_yaml::from_str(&body).ok()?;
    v.is_mapping().then_some(v)
}

fn yaml_str(v: &serde_yaml::Value) -> Option<String> {
    match v {
        serde_yaml::Value::String(s) => Some(s.clone()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::Bool(b) => Some(if *b { "True" } else { "False" }.into()),
        _ => None,
    }
}

fn yaml_list(v: &serde_yaml::Value) -> Vec<String> {
    match v {
        serde_yaml::Value::Sequence(s) => s.iter().filter_map(yaml_str).collect(),
        other => yaml_str(other).into_iter().collect(),
    }
}

/// A base model or data set reference from the model card: an HF id or a URL.
fn reference(id: &str, total_params: i64) -> Vec<(&'static str, String)> {
    let mut e = vec![];
    let hf = |s: &str| {
        re(r"^https?://huggingface.co/([^/]+/[^/]+)$")
            .captures(s)
            .map(|c| c[1].to_string())
    };
    if id.starts_with("http://") || id.starts_with("https://") || id.starts_with("ssh://") {
        e.push(("repo_url", id.to_string()));
        if let Some(mid) = id.contains("huggingface.co").then(|| hf(id)).flatten() {
            let p = model_id_components(&mid, total_params);
            if let Some(n) = p.full_name {
                e.insert(0, ("name", id_to_title(&n)));
            }
            if let Some(o) = p.org {
                e.push(("organization", id_to_title(&o)));
            }
            if let Some(v) = p.version {
                e.push(("version", v));
            }
        }
    } else {
        let p = model_id_components(id, total_params);
        if let Some(n) = &p.full_name {
            e.push(("name", id_to_title(n)));
        }
        if let Some(o) = &p.org {
            e.push(("organization", id_to_title(o)));
        }
        if let Some(v) = p.version {
            e.push(("version", v));
        }
        if let (Some(o), Some(n)) = (p.org, p.full_name) {
            e.push(("repo_url", format!("https://huggingface.co/{o}/{n}")));
        }
    }
    e
}

fn references(
    card: &serde_yaml::Value,
    keys: [&str; 3],
    total_params: i64,
) -> Option<Vec<Vec<(&'static str, String)>>> {
    let v = keys.iter().find_map(|k| card.get(*k))?;
    Some(
        yaml_list(v)
            .iter()
            .map(|id| reference(id, total_params))
            .collect(),
    )
}

impl ModelInfo {
    /// Collects everything from `dir` (the model directory as the user named it).
    pub fn load(
        dir: &Path,
        hf_config: Option<&Json>,
        model_name: Option<&str>,
        total_params: i64,
    ) -> ModelInfo {
        let mut m = ModelInfo::default();
        if let Some(card) = yaml_front_matter(dir) {
            let get = |k: &str| card.get(k).and_then(yaml_str);
            let first = |ks: &[&str]| ks.iter().find_map(|k| get(k));
            m.name = first(&["name", "model_name"]);
            m.author = first(&["author", "model_author", "model_creator"]);
            m.version = first(&["version", "model_version"]);
            m.organization = first(&["organization", "model_organization"]);
            m.description = first(&["description", "model_description"]);
            m.finetune = first(&["finetune", "model_finetune"]);
            m.basename = first(&["basename", "model_basename", "model_type"]);
            m.size_label = first(&["size_label", "model_size_label"]);
            m.source_url = first(&["url", "model_url"]);
            m.source_doi = first(&["doi", "model_doi"]);
            m.source_uuid = first(&["uuid", "model_uuid"]);
            m.source_repo_url = first(&["repo_url", "model_repo_url"]);
            m.base_models = references(
                &card,
                ["base_model", "base_models", "base_model_sources"],
                total_params,
            );
            m.datasets = references(
                &card,
                ["datasets", "dataset", "dataset_sources"],
                total_params,
            );
            m.license = card.get("license").map(|l| yaml_list(l).join(","));
            m.license_name = get("license_name");
            m.license_link = get("license_link");
            let mut tags: Option<Vec<String>> = None;
            for k in ["tags", "pipeline_tag"] {
                if let Some(v) = card.get(k) {
                    tags.get_or_insert_with(Vec::new).extend(yaml_list(v));
                }
            }
            m.tags = tags;
            let mut langs: Option<Vec<String>> = None;
            for k in ["languages", "language"] {
                if let Some(v) = card.get(k) {
                    langs.get_or_insert_with(Vec::new).extend(yaml_list(v));
                }
            }
            m.languages = langs;
        }
        let name_or_path = hf_config
            .and_then(|c| c.get("_name_or_path"))
            .and_then(Json::as_str)
            .filter(|s| s.matches('/').count() <= 1);
        for id in name_or_path
            .into_iter()
            .map(str::to_string)
            .chain(dir.file_name().map(|n| n.to_string_lossy().into_owned()))
        {
            let p = model_id_components(&id, total_params);
            fill(&mut m.name, p.full_name.map(|n| id_to_title(&n)));
            fill(&mut m.organization, p.org.map(|o| id_to_title(&o)));
            fill(&mut m.basename, p.basename);
            fill(&mut m.finetune, p.finetune);
            fill(&mut m.version, p.version);
            fill(&mut m.size_label, p.size_label);
        }
        m.sampling = sampling(dir);
        if let Some(n) = model_name {
            m.name = Some(n.to_string());
        }
        if m.name.is_none() {
            m.name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        }
        m
    }

    /// Writes the keys in gguf-py's order (`set_gguf_meta_model`).
    pub fn write(&self, kv: &mut Kv) {
        for (k, v) in &self.sampling {
            let key = format!("general.sampling.{k}");
            match v {
                Sampling::Int(i) => kv.i32(&key, *i as i32),
                Sampling::Float(f) => kv.f32(&key, *f),
                Sampling::Str(s) => kv.string(&key, s),
            }
        }
        let s = |kv: &mut Kv, k: &str, v: &Option<String>| {
            if let Some(v) = v {
                kv.string(&format!("general.{k}"), v);
            }
        };
        s(kv, "name", &self.name);
        s(kv, "author", &self.author);
        s(kv, "version", &self.version);
        s(kv, "organization", &self.organization);
        s(kv, "finetune", &self.finetune);
        s(kv, "basename", &self.basename);
        s(kv, "description", &self.description);
        s(kv, "size_label", &self.size_label);
        s(kv, "license", &self.license);
        s(kv, "license.name", &self.license_name);
        s(kv, "license.link", &self.license_link);
        s(kv, "source.url", &self.source_url);
        s(kv, "source.doi", &self.source_doi);
        s(kv, "source.uuid", &self.source_uuid);
        s(kv, "source.repo_url", &self.source_repo_url);
        for (what, list) in [
            ("base_model", &self.base_models),
            ("dataset", &self.datasets),
        ] {
            if let Some(list) = list {
                kv.u32(&format!("general.{what}.count"), list.len() as u64);
                for (i, e) in list.iter().enumerate() {
                    for field in [
                        "name",
                        "author",
                        "version",
                        "organization",
                        "description",
                        "url",
                        "doi",
                        "uuid",
                        "repo_url",
                    ] {
                        if let Some((_, v)) = e.iter().find(|(f, _)| *f == field) {
                            kv.string(&format!("general.{what}.{i}.{field}"), v);
                        }
                    }
                }
            }
        }
        if let Some(t) = &self.tags {
            kv.str_array("general.tags", t);
        }
        if let Some(l) = &self.languages {
            kv.str_array("general.languages", l);
        }
    }
}

fn fill(slot: &mut Option<String>, v: Option<String>) {
    if slot.is_none() {
        *slot = v;
    }
}

/// Sampling defaults from generation_config.json, in gguf-py's order.
fn sampling(dir: &Path) -> Vec<(&'static str, Sampling)> {
    let Some(cfg) = std::fs::read_to_string(dir.join("generation_config.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<Json>(&s).ok())
    else {
        return vec![];
    };
    let mut out = vec![];
    let fields: [(&str, &[&str], bool); 12] = [
        ("sequence", &["sequence"], false),
        ("top_k", &["top_k"], true),
        ("top_p", &["top_p"], false),
        ("min_p", &["min_p"], false),
        ("xtc_probability", &["xtc_probability"], false),
        ("xtc_threshold", &["xtc_threshold"], false),
        ("temp", &["temperature"], false),
        ("penalty_last_n", &["penalty_last_n"], true),
        (
            "penalty_repeat",
            &["penalty_repeat", "repetition_penalty"],
            false,
        ),
        ("mirostat", &["mirostat"], true),
        ("mirostat_tau", &["mirostat_tau"], false),
        ("mirostat_eta", &["mirostat_eta"], false),
    ];
    for (key, names, int) in fields {
        let Some(v) = names
            .iter()
            .find_map(|n| cfg.get(*n))
            .filter(|v| !v.is_null())
        else {
            continue;
        };
        let s = match (v, int) {
            (Json::String(s), _) if key == "sequence" => Sampling::Str(s.clone()),
            (v, true) => match v.as_i64() {
                Some(i) => Sampling::Int(i),
                None => continue,
            },
            (v, false) => match v.as_f64() {
                Some(f) => Sampling::Float(f),
                None => continue,
            },
        };
        out.push((key, s));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_like_gguf_py() {
        assert_eq!(id_to_title("tiny-glm5"), "Tiny Glm5");
        assert_eq!(id_to_title("Meta-Llama-3-8B"), "Meta Llama 3 8B");
        let p = model_id_components("meta-llama/Meta-Llama-3-8B-Instruct", 8_000_000_000);
        assert_eq!(p.org.as_deref(), Some("meta-llama"));
        assert_eq!(p.basename.as_deref(), Some("Meta-Llama-3"));
        assert_eq!(p.size_label.as_deref(), Some("8B"));
        assert_eq!(p.finetune.as_deref(), Some("Instruct"));
        let p = model_id_components("tiny-glm5", 7_780_370);
        assert_eq!(p.basename, None);
        assert_eq!(p.size_label, None);
        assert_eq!(rounded_count(4_832_256, 2), "4.8M");
        assert_eq!(rounded_count(22_000_000_000, 2), "22B");
        assert_eq!(size_label(0, 2_000_000, 2_800_000, 6), "6x4.8M");
    }
}
