//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`): greedy merging of adjacent
//! pieces by vocabulary score, with `<0xXX>` byte fallback for what stays out of the vocabulary.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// One candidate merge. Ordered so the max-heap pops the highest score first and, among equal
/// scores, the leftmost pair (sentencepiece's and llama.cpp's tie rule).
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

/// What the SPM loop needs from the vocabulary.
pub(crate) struct SpmVocab<'a> {
    pub token_to_id: &'a HashMap<String, u32>,
    pub scores: &'a [f32],
    /// Whether a token may be produced by merging (sentencepiece never merges into control,
    /// unknown or unused pieces).
    pub mergeable: &'a [bool],
    pub byte_tokens: &'a [Option<u32>; 256],
}

/// Tokenizes `text` (already space-escaped with U+2581) and appends the ids to `out`.
pub(crate) fn tokenize(text: &str, vocab: &SpmVocab<'_>, out: &mut Vec<u32>) {
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let i = syms.len();
        syms.push(Sym {
            start,
            len: c.len_utf8(),
            prev: if i == 0 { NONE } else { i - 1 },
            next: i + 1,
        });
    }
    if let Some(last) = syms.last_mut() {
        last.next = NONE;
    }
    let lookup = |s: &str| -> Option<u32> {
        let id = *vocab.token_to_id.get(s)?;
        vocab
            .mergeable
            .get(id as usize)
            .copied()
            .unwrap_or(false)
            .then_some(id)
    };
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: usize, r: usize| {
        if l == NONE || r == NONE {
            return;
        }
        let (a, b) = (syms[l], syms[r]);
        let piece = &text[a.start..b.start + b.len];
        if let Some(id) = lookup(piece) {
            let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Bigram {
                score,
                left: l,
                right: r,
                size: piece.len(),
            });
        }
    };
    for i in 1..syms.len() {
        try_add(&mut heap, &syms, i - 1, i);
    }
    while let Some(bg) = heap.pop() {
        let (l, r) = (syms[bg.left], syms[bg.right]);
        // Stale if either side was consumed or grew since the candidate was queued.
        if l.len == 0 || r.len == 0 || l.next != bg.right || l.len + r.len != bg.size {
            continue;
        }
        syms[bg.left].len += r.len;
        syms[bg.left].next = r.next;
        syms[bg.right].len = 0;
        if r.next != NONE {
            syms[r.next].prev = bg.left;
        }
        try_add(&mut heap, &syms, syms[bg.left].prev, bg.left);
        try_add(&mut heap, &syms, bg.left, syms[bg.left].next);
    }
    let mut i = if syms.is_empty() { NONE } else { 0 };
    while i != NONE {
        let s = syms[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => {
                // Byte fallback; a byte without a <0xXX> token is dropped, as llama.cpp does.
                out.extend(piece.bytes().filter_map(|b| vocab.byte_tokens[b as usize]));
            }
        }
        i = s.next;
    }
}
