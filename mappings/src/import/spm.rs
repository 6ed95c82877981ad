//! The pieces of a SentencePiece `tokenizer.model` (protobuf `ModelProto`, field 1 `pieces`:
//! `{1: piece string, 2: score float, 3: type enum}`), read with a bounded protobuf decoder. Other
//! fields (trainer/normalizer specs) are skipped.

/// SentencePiece piece types.
pub const NORMAL: u64 = 1;
pub const UNKNOWN: u64 = 2;
pub const CONTROL: u64 = 3;
pub const USER_DEFINED: u64 = 4;
pub const UNUSED: u64 = 5;
pub const BYTE: u64 = 6;

#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub piece: String,
    pub score: f32,
    pub kind: u64,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .b
                .get(self.pos)
                .ok_or_else(|| format!("truncated varint at byte {}", self.pos))?;
            self.pos += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(format!("varint longer than 10 bytes at byte {}", self.pos))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        let n = usize::try_from(n).map_err(|_| "length too large".to_string())?;
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(|| format!("field of {n} bytes at byte {} runs past the end", self.pos))?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next (field number, wire type) or `None` at the end.
    fn key(&mut self) -> Result<Option<(u64, u64)>, String> {
        if self.pos >= self.b.len() {
            return Ok(None);
        }
        let k = self.varint()?;
        Ok(Some((k >> 3, k & 7)))
    }

    fn skip(&mut self, wire: u64) -> Result<(), String> {
        match wire {
            0 => self.varint().map(drop),
            1 => self.take(8).map(drop),
            2 => {
                let n = self.varint()?;
                self.take(n).map(drop)
            }
            5 => self.take(4).map(drop),
            w => Err(format!(
                "unsupported protobuf wire type {w} at byte {}",
                self.pos
            )),
        }
    }
}

fn parse_piece(b: &[u8]) -> Result<Piece, String> {
    let mut r = Reader { b, pos: 0 };
    let mut p = Piece {
        piece: String::new(),
        score: 0.0,
        kind: NORMAL,
    };
    while let Some((field, wire)) = r.key()? {
        match (field, wire) {
            (1, 2) => {
                let n = r.varint()?;
                p.piece = String::from_utf8(r.take(n)?.to_vec())
                    .map_err(|_| "piece is not UTF-8".to_string())?;
            }
            (2, 5) => {
                let s = r.take(4)?;
                p.score = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
            (3, 0) => p.kind = r.varint()?,
            (_, w) => r.skip(w)?,
        }
    }
    Ok(p)
}

/// All pieces in id order.
pub fn parse_model(b: &[u8]) -> Result<Vec<Piece>, String> {
    let mut r = Reader { b, pos: 0 };
    let mut out = vec![];
    while let Some((field, wire)) = r.key()? {
        if (field, wire) == (1, 2) {
            let n = r.varint()?;
            out.push(parse_piece(r.take(n)?)?);
        } else {
            r.skip(wire)?;
        }
    }
    if out.is_empty() {
        return Err("no SentencePiece pieces (not a tokenizer.model?)".into());
    }
    Ok(out)
}

/// Encodes pieces as a minimal `ModelProto` (tests and generators).
pub fn encode_model(pieces: &[Piece]) -> Vec<u8> {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    let mut out = vec![];
    if pieces.iter().any(|p| p.kind == BYTE) {
        // trainer_spec { byte_fallback: true }: sentencepiece refuses byte pieces without it
        out.extend_from_slice(&[0x12, 0x03, 0x98, 0x02, 0x01]);
    }
    for p in pieces {
        let mut m = vec![0x0a];
        varint(&mut m, p.piece.len() as u64);
        m.extend_from_slice(p.piece.as_bytes());
        m.push(0x15);
        m.extend_from_slice(&p.score.to_le_bytes());
        m.push(0x18);
        varint(&mut m, p.kind);
        out.push(0x0a);
        varint(&mut out, m.len() as u64);
        out.extend(m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_hostile_bytes() {
        let ps = vec![
            Piece {
                piece: "<unk>".into(),
                score: 0.0,
                kind: UNKNOWN,
            },
            Piece {
                piece: "\u{2581}the".into(),
                score: -1.5,
                kind: NORMAL,
            },
        ];
        let b = encode_model(&ps);
        assert_eq!(parse_model(&b).unwrap(), ps);
        for cut in 1..b.len() {
            // every truncation is an error or a shorter valid prefix, never a panic
            let _ = parse_model(&b[..cut]);
        }
        assert!(
            parse_model(&[0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01])
                .is_err()
        );
        assert!(parse_model(&[]).is_err());
        let _ = (USER_DEFINED, CONTROL, UNUSED, BYTE);
    }
}
