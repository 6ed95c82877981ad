//! Splitting text around special (control / user-defined) tokens before the model tokenizer runs.

use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, MatchKind};

use crate::ServingError;

/// Inserted into control-token text found in chat message content, so that the rendered prompt
/// no longer contains that token's text; a literal marker in content is doubled. U+FDD0 is a
/// Unicode noncharacter, reserved for exactly this kind of internal use.
pub(crate) const MARKER: char = '\u{FDD0}';

/// Undo [`SpecialMatcher::escape_control`] on text that is about to be tokenized as plain text:
/// a doubled marker becomes one literal marker, a single marker disappears.
pub(crate) fn unescape(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains(MARKER) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == MARKER {
            if chars.peek() == Some(&MARKER) {
                chars.next();
                out.push(MARKER);
            }
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A run of the input: plain text for the tokenizer, or an already-known token.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

pub(crate) struct SpecialMatcher {
    ac: Option<AhoCorasick>,
    /// Per pattern: token id, byte length, and whether it is split out only with `parse_special`.
    patterns: Vec<(u32, usize, bool)>,
}

impl SpecialMatcher {
    /// `tokens`: (id, text, needs_parse_special) for every control, unknown and user-defined token.
    pub(crate) fn new(tokens: Vec<(u32, &str, bool)>) -> Result<Self, ServingError> {
        let tokens: Vec<_> = tokens.into_iter().filter(|t| !t.1.is_empty()).collect();
        if tokens.is_empty() {
            return Ok(Self {
                ac: None,
                patterns: Vec::new(),
            });
        }
        let ac = AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .build(tokens.iter().map(|t| t.1))
            .map_err(|e| ServingError::Tokenizer(format!("special-token matcher: {e}")))?;
        let patterns = tokens.iter().map(|t| (t.0, t.1.len(), t.2)).collect();
        Ok(Self {
            ac: Some(ac),
            patterns,
        })
    }

    /// `text` (chat message content) with every occurrence of a control token's text broken by
    /// [`MARKER`] after its first character, and literal markers doubled, so that parsing the
    /// rendered prompt with `parse_special` cannot turn content into control tokens (a user
    /// message containing `<|assistant|>` stays text). `None` when nothing needs changing, which
    /// is every ordinary message: the template then sees the content unchanged.
    pub(crate) fn escape_control(&self, text: &str) -> Option<String> {
        let mut cuts: Vec<usize> = match &self.ac {
            Some(ac) => ac
                .find_overlapping_iter(text)
                .filter(|m| self.patterns[m.pattern().as_usize()].2)
                .filter_map(|m| {
                    let first = text[m.start()..].chars().next()?;
                    Some(m.start() + first.len_utf8())
                })
                .collect(),
            None => Vec::new(),
        };
        if cuts.is_empty() && !text.contains(MARKER) {
            return None;
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut out = String::with_capacity(text.len() + cuts.len() * 3 + 8);
        let mut pos = 0;
        let push = |out: &mut String, s: &str| {
            for c in s.chars() {
                out.push(c);
                if c == MARKER {
                    out.push(MARKER);
                }
            }
        };
        for cut in cuts {
            push(&mut out, &text[pos..cut]);
            out.push(MARKER);
            pos = cut;
        }
        push(&mut out, &text[pos..]);
        Some(out)
    }

    /// Splits `text` the way llama.cpp's `tokenizer_st_partition` does: special tokens are taken
    /// longest first (ties by lower id), each leftmost-first in what is still plain text. User-
    /// defined tokens are always split out; control tokens only when `parse_special` is set.
    /// Aho-Corasick finds every candidate occurrence in one pass so the cost does not grow with
    /// the number of special tokens (Gemma has thousands).
    pub(crate) fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let Some(ac) = &self.ac else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Fragment::Text(text)]
            };
        };
        let mut occ: Vec<(usize, usize, u32)> = ac
            .find_overlapping_iter(text)
            .filter_map(|m| {
                let (id, len, needs_parse) = self.patterns[m.pattern().as_usize()];
                (parse_special || !needs_parse).then_some((m.start(), len, id))
            })
            .collect();
        occ.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
        // Accepted matches, start -> (end, id); disjoint by construction.
        let mut taken: BTreeMap<usize, (usize, u32)> = BTreeMap::new();
        for (start, len, id) in occ {
            let end = start + len;
            let clashes = taken
                .range(..end)
                .next_back()
                .is_some_and(|(_, &(e, _))| e > start);
            if !clashes {
                taken.insert(start, (end, id));
            }
        }
        let mut out = Vec::with_capacity(taken.len() * 2 + 1);
        let mut pos = 0;
        for (start, (end, id)) in taken {
            if start > pos {
                out.push(Fragment::Text(&text[pos..start]));
            }
            out.push(Fragment::Token(id));
            pos = end;
        }
        if pos < text.len() {
            out.push(Fragment::Text(&text[pos..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Fragment::*;

    #[test]
    fn longest_first_then_leftmost() {
        let m = SpecialMatcher::new(vec![(1, "ab", true), (2, "bcd", true), (3, "<u>", false)])
            .unwrap();
        // "bcd" (longer) is carved out before "ab" is considered: llama.cpp order.
        assert_eq!(m.partition("abcd", true), vec![Text("a"), Token(2)]);
        // Control tokens stay text without parse_special; user-defined ones are still split.
        assert_eq!(
            m.partition("ab<u>x", false),
            vec![Text("ab"), Token(3), Text("x")]
        );
        assert_eq!(m.partition("abab", true), vec![Token(1), Token(1)]);
        assert_eq!(m.partition("", true), vec![]);
    }

    #[test]
    fn escaped_control_text_is_not_parsed_and_unescapes_to_itself() {
        let m = SpecialMatcher::new(vec![(1, "<|a|>", true), (2, "<u>", false)]).unwrap();
        assert_eq!(m.escape_control("plain"), None);
        for text in [
            "x<|a|>y",
            "<|a|><|a|>",
            "<|<|a|>|>",
            "m\u{FDD0}m<|a|>",
            "\u{FDD0}\u{FDD0}",
        ] {
            let e = m.escape_control(text).unwrap();
            // No control token survives; a user-defined one still does (always split).
            assert!(m.partition(&e, true).iter().all(|f| !matches!(f, Token(1))));
            assert_eq!(unescape(&e), text);
        }
        assert_eq!(m.escape_control("<u>"), None);
    }
}
