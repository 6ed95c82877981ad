//! Pre-tokenizers of byte-level BPE vocabularies, selected by `tokenizer.ggml.pre`.
//!
//! Each entry is the regex sequence of the model's own `tokenizer.json` (HF `Split` with
//! `Isolated` behaviour, one after another), which llama.cpp maps to the same pre-type. Names not
//! in the table are refused: guessing a regex silently changes token ids.

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

/// The suffix every table regex ends with: whitespace runs, except that a run followed by a
/// non-space gives its last character to the next piece (`"a  b"` -> `a`, ` `, ` b`). It is the
/// only construct of the table that needs a backtracking engine.
const WS_LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// One compiled regex of the sequence.
enum Matcher {
    /// No look-around: the `regex` crate, linear time in the input.
    Linear(regex::Regex),
    /// `HEAD|\s+(?!\S)|\s+` rewritten as `(?:HEAD)|(\s+)` for the `regex` crate, with the
    /// lookahead applied by hand (see [`Matcher::find_at`]): linear time, no stack, same matches.
    LinearWsTail(regex::Regex),
    /// Anything else: fancy-regex with a bounded backtrack budget (long inputs may be refused).
    Backtracking(fancy_regex::Regex),
}

/// fancy-regex's default backtrack budget (1e6) can be exhausted by long whitespace runs; this
/// bound still stops runaway patterns. Only used for patterns the linear engines cannot take.
const BACKTRACK_LIMIT: usize = 100_000_000;

fn compile(p: &str) -> Result<Matcher, ServingError> {
    let err = |e: &dyn std::fmt::Display| {
        ServingError::Tokenizer(format!("pre-tokenizer regex {p:?}: {e}"))
    };
    if let Ok(re) = regex::Regex::new(p) {
        return Ok(Matcher::Linear(re));
    }
    if let Some(head) = p.strip_suffix(WS_LOOKAHEAD_TAIL) {
        if let Ok(re) = regex::Regex::new(&format!(r"(?:{head})|(\s+)")) {
            return Ok(Matcher::LinearWsTail(re));
        }
    }
    fancy_regex::RegexBuilder::new(p)
        .backtrack_limit(BACKTRACK_LIMIT)
        .build()
        .map(Matcher::Backtracking)
        .map_err(|e| err(&e))
}

impl Matcher {
    /// The leftmost match starting at or after `at`, as the original pattern finds it.
    fn find_at(&self, text: &str, at: usize) -> Result<Option<(usize, usize)>, ServingError> {
        match self {
            Matcher::Linear(re) => Ok(re.find_at(text, at).map(|m| (m.start(), m.end()))),
            Matcher::Backtracking(re) => re
                .find_from_pos(text, at)
                .map(|m| m.map(|m| (m.start(), m.end())))
                .map_err(|e| ServingError::Tokenizer(format!("pre-tokenizer: {e}"))),
            Matcher::LinearWsTail(re) => {
                let Some(m) = re.find_at(text, at) else {
                    return Ok(None);
                };
                let (start, end) = (m.start(), m.end());
                // Only an all-whitespace match can come from the `\s+` branch; ask the capture
                // only then (captures are slower than a plain find).
                if !m.as_str().chars().all(char::is_whitespace) || end == text.len() {
                    return Ok(Some((start, end)));
                }
                let from_tail = re
                    .captures_at(text, start)
                    .and_then(|c| c.get(1))
                    .is_some_and(|g| g.start() == start);
                // `\s+(?!\S)` gives back the run's last char when a non-space follows (the
                // run is maximal, so one does); a one-char run falls to the plain `\s+`.
                if from_tail {
                    if let Some((last, _)) = m.as_str().char_indices().next_back() {
                        if last > 0 {
                            return Ok(Some((start, start + last)));
                        }
                    }
                }
                Ok(Some((start, end)))
            }
        }
    }
}

/// A compiled regex sequence.
pub(crate) struct PreTokenizer {
    regexes: Vec<Matcher>,
}

impl PreTokenizer {
    pub(crate) fn new(patterns: &[&str]) -> Result<Self, ServingError> {
        let regexes = patterns
            .iter()
            .map(|p| compile(p))
            .collect::<Result<_, _>>()?;
        Ok(Self { regexes })
    }

    /// Splits `text` into pieces: each regex splits every current piece into its matches and the
    /// text between them, all kept in order (HF `Split(behavior = Isolated)`).
    #[cfg(test)]
    pub(crate) fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>, ServingError> {
        let mut out = Vec::new();
        let _complete = self.for_each_piece(text, &mut |p| {
            out.push(p);
            std::ops::ControlFlow::Continue(())
        })?;
        Ok(out)
    }

    /// Calls `f` on each piece in order, lazily (no list of pieces is built); `f` returning
    /// `Break` stops the split early, which is what bounds the work on over-long prompts.
    pub(crate) fn for_each_piece<'t>(
        &self,
        text: &'t str,
        f: &mut dyn FnMut(&'t str) -> std::ops::ControlFlow<()>,
    ) -> Result<std::ops::ControlFlow<()>, ServingError> {
        self.pieces_from(0, text, f)
    }

    fn pieces_from<'t>(
        &self,
        level: usize,
        piece: &'t str,
        f: &mut dyn FnMut(&'t str) -> std::ops::ControlFlow<()>,
    ) -> Result<std::ops::ControlFlow<()>, ServingError> {
        use std::ops::ControlFlow::{Break, Continue};
        let Some(re) = self.regexes.get(level) else {
            return Ok(f(piece));
        };
        let mut emit = |p: &'t str| -> Result<std::ops::ControlFlow<()>, ServingError> {
            self.pieces_from(level + 1, p, f)
        };
        let (mut last, mut at) = (0, 0);
        while at <= piece.len() {
            let Some((start, end)) = re.find_at(piece, at)? else {
                break;
            };
            if start > last && emit(&piece[last..start])? == Break(()) {
                return Ok(Break(()));
            }
            if end > start {
                if emit(&piece[start..end])? == Break(()) {
                    return Ok(Break(()));
                }
                at = end;
            } else {
                // An empty match: step over one char so the search advances.
                at = end + piece[end..].chars().next().map_or(1, char::len_utf8);
            }
            last = end;
        }
        if last < piece.len() && emit(&piece[last..])? == Break(()) {
            return Ok(Break(()));
        }
        Ok(Continue(()))
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

    /// The original patterns run by fancy-regex, as the oracle for the linear rewrite.
    fn oracle_split<'t>(res: &[fancy_regex::Regex], text: &'t str) -> Vec<&'t str> {
        let mut pieces = vec![text];
        for re in res {
            let mut next = Vec::new();
            for piece in pieces {
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let m = m.unwrap();
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
        pieces
    }

    struct Compiled {
        name: &'static str,
        linear: PreTokenizer,
        oracle: Vec<fancy_regex::Regex>,
    }

    /// Every table entry compiled once (Unicode classes make compilation the slow part).
    fn table() -> &'static [Compiled] {
        static T: std::sync::OnceLock<Vec<Compiled>> = std::sync::OnceLock::new();
        T.get_or_init(|| {
            KNOWN
                .split(", ")
                .map(|name| {
                    let s = lookup(name).unwrap();
                    Compiled {
                        name,
                        linear: PreTokenizer::new(s.regexes).unwrap(),
                        oracle: s
                            .regexes
                            .iter()
                            .map(|p| fancy_regex::Regex::new(p).unwrap())
                            .collect(),
                    }
                })
                .collect()
        })
    }

    #[test]
    fn no_table_entry_needs_the_backtracking_engine() {
        for c in table() {
            for m in &c.linear.regexes {
                assert!(
                    !matches!(m, Matcher::Backtracking(_)),
                    "{} would backtrack",
                    c.name
                );
            }
        }
    }

    #[test]
    fn linear_rewrite_equals_the_backtracking_oracle_on_edge_cases() {
        let cases = [
            "a  b",
            "a   b",
            "a \n b",
            " \n\n x",
            "x  ",
            "  ",
            " ",
            "\t\t\tx",
            "a \u{3000}\u{3000}b",
            "I'M here  now\r\n\r\n  ok",
            "12345 678  9",
            "日本語  のテキスト 123",
            "??  !!  x",
            "'s 'S 'll  'LL",
            "tab\t\tend\t",
            "\u{a0}\u{a0}a",
            "a\u{2028}\u{2028}b",
            "",
        ];
        for t in table() {
            for c in cases {
                assert_eq!(
                    t.linear.split(c).unwrap(),
                    oracle_split(&t.oracle, c),
                    "{}: {c:?}",
                    t.name
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        #[test]
        fn linear_rewrite_equals_the_backtracking_oracle(
            text in "[a-zA-Z0-9 \t\r\n'!?.,\u{a0}\u{3000}\u{2028}éß日本ー_-]{0,40}"
        ) {
            for t in table() {
                proptest::prop_assert_eq!(
                    t.linear.split(&text).unwrap(),
                    oracle_split(&t.oracle, &text),
                    "{}", t.name
                );
            }
        }
    }

    #[test]
    fn a_one_megabyte_word_and_whitespace_run_split_without_backtracking() {
        let p = PreTokenizer::new(lookup("glm4").unwrap().regexes).unwrap();
        let word = "a".repeat(1 << 20);
        assert_eq!(p.split(&word).unwrap(), vec![word.as_str()]);
        let ws = format!("{}x", " ".repeat(1 << 20));
        let got = p.split(&ws).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].len(), (1 << 20) - 1);
        assert_eq!(got[1], " x");
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
