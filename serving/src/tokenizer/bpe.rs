//! Byte-level BPE (GPT-2 family): the byte <-> printable-char alphabet and the rank-ordered merge
//! loop over one pre-tokenized piece.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// GPT-2's reversible byte -> char alphabet. Printable Latin-1 bytes stand for themselves; the
/// other 68 bytes get U+0100.. in increasing byte order. Computed rather than tabulated because
/// the rule is the definition (openai/gpt-2 `bytes_to_unicode`).
pub(crate) const ALPHABET: [char; 256] = byte_alphabet();

const fn byte_alphabet() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    let mut b = 0u32;
    while b < 256 {
        let printable =
            (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        let cp = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        // Both ranges are valid scalar values (< 0x200), so the fallback is unreachable.
        out[b as usize] = match char::from_u32(cp) {
            Some(c) => c,
            None => '\u{FFFD}',
        };
        b += 1;
    }
    out
}

/// Inverse of [`ALPHABET`]: char -> byte for the 256 alphabet chars.
pub(crate) fn char_to_byte_map() -> HashMap<char, u8> {
    ALPHABET
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// Decodes a byte-level token text back to raw bytes. Chars outside the alphabet (seen in added
/// tokens of some vocabularies) keep their own UTF-8 bytes, as the HF ByteLevel decoder does.
pub(crate) fn decode_byte_level(text: &str, map: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Merge table keyed by the pair of token ids: value = (rank, merged token id).
pub(crate) type MergeTable = HashMap<u64, (u32, u32)>;

#[inline]
pub(crate) fn pair_key(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

/// One symbol of the piece being merged. Indices are `u32` (a piece is at most the request
/// body, far below 4 GiB) to keep a long piece at 16 bytes per input byte: a 1 MB single "word"
/// is the worst case the pre-tokenizer can hand over.
#[derive(Clone, Copy)]
struct Sym {
    /// Token id, or `None` for a byte with no token in the vocabulary (it never merges).
    id: Option<u32>,
    prev: u32,
    next: u32,
    alive: bool,
}

const NONE: u32 = u32::MAX;

/// (rank, left index, right index, left id, right id) of a possible merge: 20 bytes.
type Candidate = (u32, u32, u32, u32, u32);

/// Applies the merges to one piece whose initial symbols are `initial` (one per input byte), in
/// rank order with ties going to the leftmost pair, which is what both HF `tokenizers` and
/// llama.cpp do. A heap plus lazy invalidation keeps long pieces (runs of punctuation) at
/// O(n log n) instead of the naive O(n^2) rescans.
pub(crate) fn merge(initial: &[Option<u32>], merges: &MergeTable, out: &mut Vec<u32>) {
    if initial.len() <= 1 {
        out.extend(initial.iter().flatten());
        return;
    }
    // Longer pieces than u32 indices allow cannot come from a request body; merge them in
    // parts rather than fail (the result differs only at the seams of such absurd input).
    if initial.len() >= NONE as usize {
        for part in initial.chunks(NONE as usize - 1) {
            merge(part, merges, out);
        }
        return;
    }
    let n = initial.len() as u32;
    let mut syms: Vec<Sym> = (0..n)
        .map(|i| Sym {
            id: initial[i as usize],
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            alive: true,
        })
        .collect();
    // Stale entries are detected on pop by re-checking adjacency and ids (a merged symbol
    // always gets a different, longer token).
    let mut heap: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: u32, r: u32| {
        if l == NONE || r == NONE {
            return;
        }
        if let (Some(a), Some(b)) = (syms[l as usize].id, syms[r as usize].id) {
            if let Some(&(rank, _)) = merges.get(&pair_key(a, b)) {
                heap.push(Reverse((rank, l, r, a, b)));
            }
        }
    };
    for i in 0..n - 1 {
        push(&mut heap, &syms, i, i + 1);
    }
    while let Some(Reverse((_, l, r, a, b))) = heap.pop() {
        let (sl, sr) = (syms[l as usize], syms[r as usize]);
        if !sl.alive || !sr.alive || sl.next != r || sl.id != Some(a) || sr.id != Some(b) {
            continue;
        }
        let Some(&(_, merged)) = merges.get(&pair_key(a, b)) else {
            continue;
        };
        syms[l as usize].id = Some(merged);
        syms[l as usize].next = sr.next;
        syms[r as usize].alive = false;
        if sr.next != NONE {
            syms[sr.next as usize].prev = l;
        }
        push(&mut heap, &syms, syms[l as usize].prev, l);
        push(&mut heap, &syms, l, syms[l as usize].next);
    }
    let mut i = 0;
    while i != NONE {
        if let Some(id) = syms[i as usize].id {
            out.push(id);
        }
        i = syms[i as usize].next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection_with_gpt2_landmarks() {
        let a = ALPHABET;
        // Landmarks of the GPT-2 table: space -> 'Ġ' (U+0120), '\n' -> 'Ċ' (U+010A), '!' itself.
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'!' as usize], '!');
        let set: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(set.len(), 256);
    }

    #[test]
    fn merge_prefers_lowest_rank_then_leftmost() {
        // ids: a=0 b=1 ab=2 bb=3; merges: (a,b)->ab rank 0, (b,b)->bb rank 1.
        let mut m = MergeTable::new();
        m.insert(pair_key(0, 1), (0, 2));
        m.insert(pair_key(1, 1), (1, 3));
        let mut out = Vec::new();
        // "abb": (a,b) rank 0 wins over (b,b) rank 1 -> [ab, b]
        merge(&[Some(0), Some(1), Some(1)], &m, &mut out);
        assert_eq!(out, vec![2, 1]);
        out.clear();
        // "bbb": two (b,b) candidates of equal rank, leftmost first -> [bb, b]
        merge(&[Some(1), Some(1), Some(1)], &m, &mut out);
        assert_eq!(out, vec![3, 1]);
    }
}
