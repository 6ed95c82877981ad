//! Pre-tokenizers of byte-level BPE vocabularies, selected by `tokenizer.ggml.pre`.
//!
//! Each entry is the regex sequence of the model's own `tokenizer.json` (HF `Split` with
//! `Isolated` behaviour, one after another), which llama.cpp maps to the same pre-type. Names not
//! in the table are refused: guessing a regex silently changes token ids.

use fancy_regex::Regex;

use crate::ServingError;

/// GPT-2 / RoBERTa word splitter (HF ByteLevel `use_regex: true`).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama-3 / GLM-4 / GLM-5 splitter: digits in groups of up to three, case-insensitive
/// contractions. The `(?i:...)` form is the tokenizer.json spelling; llama.cpp's `'[sS]` rewrite
/// only differs on exotic case folds (e.g. U+017F), where this follows HF.
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2: like Llama-3 but single digits.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o / Llama-4 (o200k) splitter.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral Tekken.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// DeepSeek-V3 (three isolated splits: digit triples, CJK runs, then words/punctuation).
const DEEPSEEK3: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// How a known pre-tokenizer name behaves.
pub(crate) struct PreSpec {
    pub regexes: &'static [&'static str],
    /// Emit a whole piece directly when it is itself a vocabulary entry (HF BPE `ignore_merges`).
    pub ignore_merges: bool,
    /// Default of `tokenizer.ggml.add_bos_token` when the key is absent (llama.cpp's table).
    pub add_bos: bool,
}

const fn spec(regexes: &'static [&'static str], ignore_merges: bool, add_bos: bool) -> PreSpec {
    PreSpec {
        regexes,
        ignore_merges,
        add_bos,
    }
}

/// The table. `ignore_merges` follows the model families' tokenizer.json; for GLM-4/GLM-5 that
/// is `true` (llama.cpp leaves it off for "glm4", which only matters for a vocabulary entry its
/// own merges cannot rebuild; HF is the model's ground truth).
pub(crate) fn lookup(name: &str) -> Option<PreSpec> {
    static LLAMA3_SEQ: [&str; 1] = [LLAMA3];
    static GPT2_SEQ: [&str; 1] = [GPT2];
    static QWEN2_SEQ: [&str; 1] = [QWEN2];
    static DIGITS_GPT2: [&str; 2] = [r"\p{N}", GPT2];
    static GPT4O_SEQ: [&str; 1] = [GPT4O];
    static TEKKEN_SEQ: [&str; 1] = [TEKKEN];
    Some(match name {
        "glm4" | "chatglm-bpe" => spec(&LLAMA3_SEQ, true, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => spec(&LLAMA3_SEQ, true, true),
        "dbrx" | "smaug-bpe" => spec(&LLAMA3_SEQ, false, false),
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => spec(&QWEN2_SEQ, false, false),
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" => spec(&GPT2_SEQ, false, false),
        "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => {
            spec(&DIGITS_GPT2, false, false)
        }
        "deepseek-v3" => spec(&DEEPSEEK3, false, false),
        "gpt-4o" | "llama4" => spec(&GPT4O_SEQ, false, false),
        "tekken" => spec(&TEKKEN_SEQ, true, true),
        _ => return None,
    })
}

/// Names accepted by [`lookup`], for error messages.
pub(crate) const KNOWN: &str = "glm4, chatglm-bpe, llama3, llama-v3, llama-bpe, falcon3, dbrx, \
smaug-bpe, qwen2, deepseek-r1-qwen, megrez, stablelm2, gpt-2, phi-2, mpt, olmo, jais, smollm, \
starcoder, refact, codeshell, exaone, minerva-7b, deepseek-v3, gpt-4o, llama4, tekken";

/// A compiled regex sequence.
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
}

/// fancy-regex's default backtrack budget (1e6) can be exhausted by the `\s*[\r\n]+` branch on
/// very long whitespace runs; this bound still stops runaway patterns but covers any realistic
/// prompt (the work per match is linear in the run length).
const BACKTRACK_LIMIT: usize = 100_000_000;

impl PreTokenizer {
    pub(crate) fn new(patterns: &[&str]) -> Result<Self, ServingError> {
        let regexes = patterns
            .iter()
            .map(|p| {
                fancy_regex::RegexBuilder::new(p)
                    .backtrack_limit(BACKTRACK_LIMIT)
                    .build()
                    .map_err(|e| ServingError::Tokenizer(format!("pre-tokenizer regex {p:?}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { regexes })
    }

    /// Splits `text` into pieces: each regex splits every current piece into its matches and the
    /// text between them, all kept in order (HF `Split(behavior = Isolated)`).
    pub(crate) fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>, ServingError> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let m =
                        m.map_err(|e| ServingError::Tokenizer(format!("pre-tokenizer: {e}")))?;
                    if m.start() > last {
                        next.push(&piece[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push(&piece[last..]);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_splits_digits_and_spaces_like_the_fixture_readme() {
        let p = PreTokenizer::new(lookup("glm4").unwrap().regexes).unwrap();
        // README: "a space before a digit is its own token (`1 2` -> `1`,`Ġ`,`2`)"
        assert_eq!(p.split("1 2").unwrap(), vec!["1", " ", "2"]);
        assert_eq!(p.split("12345").unwrap(), vec!["123", "45"]);
        assert_eq!(p.split("I'M here").unwrap(), vec!["I", "'M", " here"]);
        assert_eq!(p.split("a  b").unwrap(), vec!["a", " ", " b"]);
    }

    #[test]
    fn every_table_entry_compiles() {
        for name in KNOWN.split(", ") {
            let s = lookup(name).unwrap_or_else(|| panic!("{name} listed but unknown"));
            PreTokenizer::new(s.regexes).unwrap();
        }
        assert!(lookup("default").is_none());
    }
}
