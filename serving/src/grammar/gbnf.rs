//! llama.cpp's GBNF grammars, translated into the Lark dialect llguidance compiles.
//!
//! GBNF as llama.cpp parses it (`src/llama-grammar.cpp`, `grammars/README.md`): rules
//! `name ::= alternatives` with names of ASCII letters, digits and `-`; terminals as strings
//! (`"yes"`), character classes (`[a-z]`, `[^\n]`) and `.` (any character); grouping `( )`;
//! repetition `*` `+` `?` `{m}` `{m,}` `{m,n}`; comments from `#` to the end of the line; a rule
//! ends at a newline unless inside parentheses or right after `|`; escapes `\x..` `\u....`
//! `\U........` `\t` `\r` `\n` `\\` `\"` `\[` `\]` `\-`; tokens `<[id]>`, `<text>` and their
//! negations `!<[id]>`, `!<text>`. The start rule is `root`.
//!
//! The translation is one Lark rule per GBNF rule (names made injective: GBNF names have no
//! `_`, so an upper-case letter becomes `_` plus its lower-case form), strings as JSON-escaped
//! Lark strings, classes and `.` as one-character regexes, tokens as llguidance's `<[id]>` /
//! `<[^id]>` (a token given by text is looked up in the vocabulary, as llama.cpp does).

use std::collections::BTreeSet;
use std::fmt::Write;

/// Deepest nesting of parentheses accepted (hostile input must not exhaust the stack).
const MAX_DEPTH: usize = 128;
/// llama.cpp refuses repetition counts above this (`MAX_REPETITION_THRESHOLD`).
const MAX_REPETITION: u64 = 2000;

/// Why a GBNF grammar was refused: what and where (byte offset in the grammar text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("GBNF grammar, byte {offset}: {message}")]
pub struct GbnfError {
    pub offset: usize,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Atom {
    Literal(String),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Rule(String),
    Group(Vec<Vec<Item>>),
    Token {
        negated: bool,
        id: u32,
    },
}

#[derive(Debug, Clone, PartialEq)]
struct Item {
    atom: Atom,
    /// `(min, max)`; `max = None` is unbounded. `(1, Some(1))` when there is no operator.
    rep: (u64, Option<u64>),
}

struct Parser<'a, F> {
    src: &'a str,
    pos: usize,
    token_id: F,
}

/// The Lark name of GBNF's `root` rule.
pub const ROOT: &str = "r_root";

/// Translate `gbnf` into a Lark grammar whose `start` rule is GBNF's `root`. `token_id` finds
/// the id of a vocabulary entry written as `<text>` (a special token's text).
pub fn to_lark(gbnf: &str, token_id: impl Fn(&str) -> Option<u32>) -> Result<String, GbnfError> {
    Ok(format!("start: {ROOT}\n{}", to_lark_rules(gbnf, token_id)?))
}

/// The rules of [`to_lark`] without the `start` rule (the root is [`ROOT`]).
pub fn to_lark_rules(
    gbnf: &str,
    token_id: impl Fn(&str) -> Option<u32>,
) -> Result<String, GbnfError> {
    let mut p = Parser {
        src: gbnf,
        pos: 0,
        token_id,
    };
    let mut rules: Vec<(String, Vec<Vec<Item>>)> = Vec::new();
    p.skip_space(true);
    while !p.at_end() {
        let start = p.pos;
        let name = p.name()?;
        p.skip_space(false);
        if !p.rest().starts_with("::=") {
            return Err(p.err("expecting ::= after the rule name"));
        }
        p.pos += 3;
        p.skip_space(true);
        let alts = p.alternatives(false, 0)?;
        match p.peek() {
            None => {}
            Some('\n') | Some('\r') => p.pos += 1,
            Some(_) => return Err(p.err("expecting a newline or the end after a rule")),
        }
        p.skip_space(true);
        if rules.iter().any(|(n, _)| *n == name) {
            return Err(GbnfError {
                offset: start,
                message: format!("rule {name:?} is defined twice"),
            });
        }
        rules.push((name, alts));
    }
    let defined: BTreeSet<&str> = rules.iter().map(|(n, _)| n.as_str()).collect();
    if !defined.contains("root") {
        return Err(GbnfError {
            offset: 0,
            message: "the grammar has no 'root' rule".into(),
        });
    }
    let mut used = BTreeSet::new();
    for (_, alts) in &rules {
        collect_refs(alts, &mut used);
    }
    if let Some(missing) = used.iter().find(|r| !defined.contains(r.as_str())) {
        return Err(GbnfError {
            offset: 0,
            message: format!("rule {missing:?} is used but never defined"),
        });
    }
    let mut out = String::new();
    for (name, alts) in &rules {
        let _ = write!(out, "{}: ", lark_name(name));
        write_alts(&mut out, alts);
        out.push('\n');
    }
    Ok(out)
}

fn collect_refs(alts: &[Vec<Item>], used: &mut BTreeSet<String>) {
    for item in alts.iter().flatten() {
        match &item.atom {
            Atom::Rule(r) => {
                used.insert(r.clone());
            }
            Atom::Group(g) => collect_refs(g, used),
            _ => {}
        }
    }
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

impl<F: Fn(&str) -> Option<u32>> Parser<'_, F> {
    fn rest(&self) -> &str {
        &self.src[self.pos..]
    }
    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }
    fn at_end(&self) -> bool {
        self.pos >= self.src.len()
    }
    fn err(&self, message: impl Into<String>) -> GbnfError {
        GbnfError {
            offset: self.pos,
            message: message.into(),
        }
    }

    /// Blanks and comments; newlines only where a rule may continue.
    fn skip_space(&mut self, newline_ok: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newline_ok => self.pos += 1,
                '#' => {
                    let end = self.rest().find(['\r', '\n']).unwrap_or(self.rest().len());
                    self.pos += end;
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let len = self
            .rest()
            .find(|c: char| !is_word(c))
            .unwrap_or(self.rest().len());
        if len == 0 {
            return Err(self.err("expecting a rule name"));
        }
        let n = self.rest()[..len].to_string();
        self.pos += len;
        Ok(n)
    }

    fn alternatives(&mut self, nested: bool, depth: usize) -> Result<Vec<Vec<Item>>, GbnfError> {
        let mut alts = vec![self.sequence(nested, depth)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.skip_space(true);
            alts.push(self.sequence(nested, depth)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool, depth: usize) -> Result<Vec<Item>, GbnfError> {
        let mut items: Vec<Item> = Vec::new();
        while let Some(c) = self.peek() {
            let atom = match c {
                '"' => {
                    self.pos += 1;
                    let mut s = String::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.err("unterminated string")),
                            Some('"') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => s.push(self.char()?),
                        }
                    }
                    Atom::Literal(s)
                }
                '[' => {
                    self.pos += 1;
                    let negated = self.peek() == Some('^');
                    if negated {
                        self.pos += 1;
                    }
                    let mut ranges = Vec::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.err("unterminated character class")),
                            Some(']') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => {
                                let lo = self.char()?;
                                let r = self.rest();
                                let hi =
                                    if r.starts_with('-') && !r.starts_with("-]") && r.len() > 1 {
                                        self.pos += 1;
                                        self.char()?
                                    } else {
                                        lo
                                    };
                                if hi < lo {
                                    return Err(self.err(format!(
                                        "character range {lo:?}-{hi:?} is reversed"
                                    )));
                                }
                                ranges.push((lo, hi));
                            }
                        }
                    }
                    Atom::Class { negated, ranges }
                }
                '.' => {
                    self.pos += 1;
                    Atom::Any
                }
                '<' | '!' => self.token()?,
                '(' => {
                    if depth >= MAX_DEPTH {
                        return Err(self.err(format!("parentheses nested deeper than {MAX_DEPTH}")));
                    }
                    self.pos += 1;
                    self.skip_space(true);
                    let inner = self.alternatives(true, depth + 1)?;
                    if self.peek() != Some(')') {
                        return Err(self.err("expecting ')'"));
                    }
                    self.pos += 1;
                    Atom::Group(inner)
                }
                '*' | '+' | '?' | '{' => {
                    let rep = self.repetition()?;
                    let Some(last) = items.last_mut() else {
                        return Err(self.err("a repetition operator needs something before it"));
                    };
                    // `x*?` and the like: llama.cpp nests the repetitions; the result is the
                    // product of the ranges.
                    last.rep = combine(last.rep, rep);
                    self.skip_space(nested);
                    continue;
                }
                c if is_word(c) => Atom::Rule(self.name()?),
                _ => break,
            };
            items.push(Item {
                atom,
                rep: (1, Some(1)),
            });
            self.skip_space(nested);
        }
        Ok(items)
    }

    fn repetition(&mut self) -> Result<(u64, Option<u64>), GbnfError> {
        let c = self.peek().unwrap_or(' ');
        self.pos += 1;
        let r = match c {
            '*' => (0, None),
            '+' => (1, None),
            '?' => (0, Some(1)),
            _ => {
                self.skip_space(false);
                let min = self.int()?;
                self.skip_space(false);
                let max = match self.peek() {
                    Some('}') => Some(min),
                    Some(',') => {
                        self.pos += 1;
                        self.skip_space(false);
                        if self.peek().is_some_and(|c| c.is_ascii_digit()) {
                            let m = self.int()?;
                            self.skip_space(false);
                            Some(m)
                        } else {
                            None
                        }
                    }
                    _ => return Err(self.err("expecting ',' or '}' in a repetition")),
                };
                if self.peek() != Some('}') {
                    return Err(self.err("expecting '}'"));
                }
                self.pos += 1;
                if min > MAX_REPETITION || max.is_some_and(|m| m > MAX_REPETITION) {
                    return Err(self.err(format!(
                        "repetition counts above {MAX_REPETITION} are not supported"
                    )));
                }
                if max.is_some_and(|m| m < min) {
                    return Err(self.err("repetition maximum below its minimum"));
                }
                (min, max)
            }
        };
        Ok(r)
    }

    fn int(&mut self) -> Result<u64, GbnfError> {
        let len = self
            .rest()
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(self.rest().len());
        if len == 0 {
            return Err(self.err("expecting an integer"));
        }
        let v = self.rest()[..len]
            .parse::<u64>()
            .map_err(|_| self.err("integer too large"))?;
        self.pos += len;
        Ok(v)
    }

    /// One character of a string or class, escapes decoded.
    fn char(&mut self) -> Result<char, GbnfError> {
        let Some(c) = self.peek() else {
            return Err(self.err("unexpected end of the grammar"));
        };
        if c != '\\' {
            self.pos += c.len_utf8();
            return Ok(c);
        }
        let esc = self.rest()[1..].chars().next();
        let simple = match esc {
            Some('t') => Some('\t'),
            Some('r') => Some('\r'),
            Some('n') => Some('\n'),
            Some(c @ ('\\' | '"' | '[' | ']' | '-')) => Some(c),
            _ => None,
        };
        if let Some(c) = simple {
            self.pos += 2;
            return Ok(c);
        }
        let digits = match esc {
            Some('x') => 2,
            Some('u') => 4,
            Some('U') => 8,
            _ => return Err(self.err("unknown escape")),
        };
        let hex = self.rest().get(2..2 + digits).unwrap_or("");
        let v = (hex.len() == digits && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(hex, 16).ok())
            .flatten()
            .ok_or_else(|| self.err(format!("expecting {digits} hex digits")))?;
        let c = char::from_u32(v).ok_or_else(|| self.err(format!("U+{v:X} is not a character")))?;
        self.pos += 2 + digits;
        Ok(c)
    }

    fn token(&mut self) -> Result<Atom, GbnfError> {
        let negated = self.peek() == Some('!');
        if negated {
            self.pos += 1;
        }
        if self.peek() != Some('<') {
            return Err(self.err("expecting '<' after '!'"));
        }
        let end = self
            .rest()
            .find('>')
            .ok_or_else(|| self.err("unterminated token"))?;
        let inner = &self.rest()[1..end];
        let id = if let Some(num) = inner.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            num.parse::<u32>()
                .map_err(|_| self.err(format!("bad token id {num:?}")))?
        } else {
            let text = &self.rest()[..=end];
            (self.token_id)(text).ok_or_else(|| {
                self.err(format!("{text} is not a single token of this vocabulary"))
            })?
        };
        self.pos += end + 1;
        Ok(Atom::Token { negated, id })
    }
}

/// Repetition of a repetition: `(a..b)` times `(c..d)`.
fn combine(outer: (u64, Option<u64>), inner: (u64, Option<u64>)) -> (u64, Option<u64>) {
    let min = outer.0.saturating_mul(inner.0);
    let max = match (outer.1, inner.1) {
        (Some(0), _) | (_, Some(0)) => Some(0),
        (Some(a), Some(b)) => Some(a.saturating_mul(b)),
        _ => None,
    };
    (min, max)
}

/// GBNF names are `[a-zA-Z0-9-]+`; Lark rule names must be `[a-z][_a-z0-9-]*`.
fn lark_name(n: &str) -> String {
    let mut s = String::from("r_");
    for c in n.chars() {
        if c.is_ascii_uppercase() {
            s.push('_');
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

fn write_alts(out: &mut String, alts: &[Vec<Item>]) {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (j, item) in seq.iter().enumerate() {
            if j > 0 {
                out.push(' ');
            }
            write_item(out, item);
        }
    }
}

fn write_item(out: &mut String, item: &Item) {
    let (min, max) = item.rep;
    if max == Some(0) {
        out.push_str("\"\"");
        return;
    }
    // Repeated things go in a group so the operator applies to all of it.
    let grouped = item.rep != (1, Some(1));
    if grouped {
        out.push('(');
    }
    match &item.atom {
        Atom::Literal(s) if s.is_empty() => out.push_str("\"\""),
        Atom::Literal(s) => lark_string(out, s),
        Atom::Class { negated, ranges } => {
            out.push_str("/[");
            if *negated {
                out.push('^');
            }
            if ranges.is_empty() && !*negated {
                // `[]` matches nothing; Rust's regex needs a class with a member.
                out.push_str("^\\x{0}-\\x{10FFFF}");
            }
            for &(lo, hi) in ranges {
                regex_char(out, lo);
                if hi != lo {
                    out.push('-');
                    regex_char(out, hi);
                }
            }
            out.push_str("]/");
        }
        Atom::Any => out.push_str("/(?s:.)/"),
        Atom::Rule(r) => out.push_str(&lark_name(r)),
        Atom::Group(g) => {
            out.push('(');
            write_alts(out, g);
            out.push(')');
        }
        Atom::Token { negated, id } => {
            let _ = write!(out, "<[{}{id}]>", if *negated { "^" } else { "" });
        }
    }
    if grouped {
        out.push(')');
        match (min, max) {
            (0, None) => out.push('*'),
            (1, None) => out.push('+'),
            (0, Some(1)) => out.push('?'),
            (m, None) => {
                let _ = write!(out, "{{{m},}}");
            }
            (m, Some(n)) => {
                let _ = write!(out, "{{{m},{n}}}");
            }
        }
    }
}

/// A Lark string literal (JSON syntax).
fn lark_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One character inside a regex class, escaped unless it is an ASCII letter or digit.
fn regex_char(out: &mut String, c: char) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lark(g: &str) -> Result<String, GbnfError> {
        to_lark(g, |t| (t == "<think>").then_some(7))
    }

    #[test]
    fn translates_each_construct() {
        let l = lark(concat!(
            "# comment\n",
            "root ::= \"a\\\"b\" [a-z0-9_] [^\\n] . item* (x | \"y\")+ \"z\"? \"q\"{2} \"w\"{1,} \"e\"{0,3}\n",
            "item ::= | \"i\"   # empty first alternative\n",
            "x ::= \"\\x41\\u00e9\" <think> !<[12]> camelCase\n",
            "camelCase ::= \"c\"\n",
        ))
        .unwrap();
        let want = concat!(
            "start: r_root\n",
            "r_root: \"a\\\"b\" /[a-z0-9\\x{5f}]/ /[^\\x{a}]/ /(?s:.)/ (r_item)* ((r_x | \"y\"))+ (\"z\")? (\"q\"){2,2} (\"w\")+ (\"e\"){0,3}\n",
            "r_item: \"\" | \"i\"\n",
            "r_x: \"Aé\" <[7]> <[^12]> r_camel_case\n",
            "r_camel_case: \"c\"\n",
        );
        assert_eq!(l, want);
    }

    #[test]
    fn rules_continue_inside_parentheses_and_after_bars() {
        let l = lark("root ::= (\n  \"a\"\n  \"b\"\n) |\n  \"c\"\n").unwrap();
        assert_eq!(l, "start: r_root\nr_root: (\"a\" \"b\") | \"c\"\n");
    }

    #[test]
    fn refuses_bad_grammars_with_offsets() {
        for (g, offset, what) in [
            ("root ::= \"a", 11, "unterminated string"),
            ("root = \"a\"", 5, "expecting ::="),
            ("item ::= \"a\"", 0, "no 'root' rule"),
            ("root ::= other", 0, "never defined"),
            ("root ::= \"a\"\nroot ::= \"b\"", 13, "defined twice"),
            ("root ::= [b-a]", 13, "reversed"),
            ("root ::= \"a\"{3,1}", 17, "maximum below"),
            ("root ::= \"a\"{9999}", 18, "above 2000"),
            ("root ::= * \"a\"", 10, "needs something before"),
            ("root ::= \"\\q\"", 10, "unknown escape"),
            ("root ::= <nope>", 9, "not a single token"),
            ("root ::= (\"a\"", 13, "expecting ')'"),
            ("root ::= \"a\" )", 13, "expecting a newline"),
        ] {
            let e = lark(g).expect_err(g);
            assert_eq!(e.offset, offset, "{g}: {e}");
            assert!(e.message.contains(what), "{g}: {e}");
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let g = format!("root ::= {}\"a\"{}", "(".repeat(10_000), ")".repeat(10_000));
        assert!(lark(&g).unwrap_err().message.contains("nested deeper"));
    }
}
