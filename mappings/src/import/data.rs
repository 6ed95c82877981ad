//! The embedded conversion table `data/import.yaml` (recipes per HF architecture class, the
//! always-F32 tensor list, skipped HF suffixes, the pre-tokenizer names).

use super::params::Recipe;
use super::vocab::VocabKind;
use crate::MappingError;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::OnceLock;

const SOURCE: &str = include_str!("../../data/import.yaml");

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    recipes: BTreeMap<String, RawRecipe>,
    force_f32: Vec<String>,
    skip_suffixes: Vec<String>,
    pre_tokenizers: Vec<RawPre>,
    config_defaults: BTreeMap<String, BTreeMap<String, serde_json::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRecipe {
    arch: String,
    recipe: String,
    vocab: String,
    #[serde(default)]
    mtp: bool,
    #[serde(default)]
    drop_mtp: bool,
    #[serde(default)]
    skip_tied_head: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPre {
    name: String,
    archs: Vec<String>,
    splits: Vec<String>,
}

/// How one HF architecture class is converted.
#[derive(Debug, Clone)]
pub struct RecipeInfo {
    pub hf_class: String,
    pub arch: String,
    pub recipe: Recipe,
    pub vocab: VocabKind,
    pub mtp: bool,
    pub drop_mtp: bool,
    pub skip_tied_head: bool,
}

#[derive(Debug)]
pub struct ImportData {
    pub recipes: Vec<RecipeInfo>,
    pub force_f32: Vec<String>,
    pub skip_suffixes: Vec<String>,
    pre: Vec<RawPre>,
    /// model_type -> key -> default (literal, `{from: k}` or `{div: [a, b]}`).
    pub config_defaults: BTreeMap<String, BTreeMap<String, serde_json::Value>>,
}

impl std::fmt::Debug for RawPre {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.name, self.archs)
    }
}

fn parse() -> Result<ImportData, MappingError> {
    let bad = |msg: String| MappingError::BadTable {
        arch: "import".into(),
        msg,
    };
    let raw: Raw = serde_yaml::from_str(SOURCE).map_err(|e| bad(e.to_string()))?;
    let mut recipes = vec![];
    for (class, r) in raw.recipes {
        crate::table::table(&r.arch)?;
        recipes.push(RecipeInfo {
            recipe: Recipe::parse(&r.recipe)
                .ok_or_else(|| bad(format!("{class}: unknown recipe {}", r.recipe)))?,
            vocab: VocabKind::parse(&r.vocab)
                .ok_or_else(|| bad(format!("{class}: unknown vocab {}", r.vocab)))?,
            hf_class: class,
            arch: r.arch,
            mtp: r.mtp,
            drop_mtp: r.drop_mtp,
            skip_tied_head: r.skip_tied_head,
        });
    }
    for p in &raw.pre_tokenizers {
        for a in &p.archs {
            crate::table::table(a)?;
        }
    }
    Ok(ImportData {
        recipes,
        force_f32: raw.force_f32,
        skip_suffixes: raw.skip_suffixes,
        pre: raw.pre_tokenizers,
        config_defaults: raw.config_defaults,
    })
}

/// The parsed table (parsed once; an error is a bug caught by the crate's tests).
pub fn data() -> Result<&'static ImportData, MappingError> {
    static D: OnceLock<Result<ImportData, MappingError>> = OnceLock::new();
    D.get_or_init(parse).as_ref().map_err(Clone::clone)
}

impl ImportData {
    pub fn recipe(&self, hf_class: &str) -> Option<&RecipeInfo> {
        self.recipes.iter().find(|r| r.hf_class == hf_class)
    }

    /// llama.cpp's pre-tokenizer name for these split regexes on `arch`.
    pub fn pre_tokenizer(&self, splits: &[String], arch: &str) -> Option<&str> {
        self.pre
            .iter()
            .find(|p| p.splits == splits && p.archs.iter().any(|a| a == arch))
            .map(|p| p.name.as_str())
    }

    /// Whether the converter always stores this GGUF tensor as F32.
    pub fn forced_f32(&self, gguf_name: &str) -> bool {
        let tail = match gguf_name.strip_prefix("blk.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, t)| t),
            None => gguf_name,
        };
        self.force_f32.iter().any(|f| f == tail)
    }

    pub fn classes(&self) -> Vec<&str> {
        self.recipes.iter().map(|r| r.hf_class.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_parses_and_names_the_fixture_tokenizer_glm4() {
        let d = data().unwrap();
        let llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let s = vec![llama3.to_string()];
        assert_eq!(d.pre_tokenizer(&s, "glm-dsa"), Some("glm4"));
        assert_eq!(d.pre_tokenizer(&s, "llama"), Some("llama-bpe"));
        assert_eq!(d.pre_tokenizer(&s, "qwen2"), None);
        assert!(d.forced_f32("blk.3.indexer.proj.weight"));
        assert!(d.forced_f32("blk.1.ffn_gate_inp.weight"));
        assert!(!d.forced_f32("blk.1.ffn_gate_exps.weight"));
        assert!(d.recipe("GlmMoeDsaForCausalLM").is_some());
    }
}
