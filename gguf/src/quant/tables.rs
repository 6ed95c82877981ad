//! Lookup tables of the IQ and FP4 formats, decoded once from the embedded data file
//! `gguf/data/iq_tables.bin` (written from gguf-py's published tables by
//! `tests/dev/gen_iq_grids.py`; the format is described there).

use super::QuantError;
use std::sync::OnceLock;

static DATA: &[u8] = include_bytes!("../../data/iq_tables.bin");

/// All tables, with the exact shapes the formats index them by, so an index masked to its bit
/// width can never be out of range.
pub(crate) struct Tables {
    pub iq2xxs: Box<[[u8; 8]; 256]>,
    pub iq2xs: Box<[[u8; 8]; 512]>,
    pub iq2s: Box<[[u8; 8]; 1024]>,
    pub iq3xxs: Box<[[u8; 4]; 256]>,
    pub iq3s: Box<[[u8; 4]; 512]>,
    pub iq1s: Box<[[i8; 8]; 2048]>,
    /// 7-bit sign index to 8 sign bits with even parity (bit k set: element k negative).
    pub ksigns: [u8; 128],
    pub kvalues_iq4nl: [i8; 16],
    /// E2M1 values, doubled (pairs with the halved E8M0/UE4M3 scales).
    pub kvalues_mxfp4: [i8; 16],
}

/// The decoded tables; decoding happens on first use.
pub(crate) fn tables() -> Result<&'static Tables, QuantError> {
    static CELL: OnceLock<Result<Tables, String>> = OnceLock::new();
    CELL.get_or_init(|| decode(DATA))
        .as_ref()
        .map_err(|e| QuantError::Tables(e.clone()))
}

struct Raw<'a> {
    name: &'a str,
    signed: bool,
    rows: usize,
    cols: usize,
    values: &'a [u8],
}

fn parse(data: &[u8]) -> Result<Vec<Raw<'_>>, String> {
    let mut r = Cursor { data, at: 0 };
    if r.take(8)? != b"GGIQTAB1" {
        return Err("bad magic".into());
    }
    let count = r.u32()? as usize;
    let mut out = Vec::new();
    for _ in 0..count {
        let name_len = usize::from(r.take(1)?[0]);
        let name = std::str::from_utf8(r.take(name_len)?).map_err(|e| e.to_string())?;
        let kind = r.take(1)?[0];
        let rows = r.u32()? as usize;
        let cols = r.u32()? as usize;
        let n = rows
            .checked_mul(cols)
            .ok_or_else(|| format!("{name}: size overflow"))?;
        out.push(Raw {
            name,
            signed: kind == 1,
            rows,
            cols,
            values: r.take(n)?,
        });
    }
    if r.at != data.len() {
        return Err(format!("{} trailing bytes", data.len() - r.at));
    }
    Ok(out)
}

struct Cursor<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or_else(|| format!("truncated at byte {}", self.at))?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

fn find<'a>(
    raw: &'a [Raw<'a>],
    name: &str,
    signed: bool,
    rows: usize,
    cols: usize,
) -> Result<&'a [u8], String> {
    let t = raw
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| format!("table {name} missing"))?;
    if t.signed != signed || t.rows != rows || t.cols != cols {
        return Err(format!(
            "table {name}: {}x{} signed={}, expected {rows}x{cols} signed={signed}",
            t.rows, t.cols, t.signed
        ));
    }
    Ok(t.values)
}

fn rows_u8<const C: usize, const R: usize>(v: &[u8]) -> Box<[[u8; C]; R]> {
    let mut out = Box::new([[0u8; C]; R]);
    for (dst, src) in out.iter_mut().zip(v.chunks_exact(C)) {
        dst.copy_from_slice(src);
    }
    out
}

fn to_i8<const N: usize>(v: &[u8]) -> [i8; N] {
    let mut out = [0i8; N];
    for (d, s) in out.iter_mut().zip(v) {
        *d = *s as i8;
    }
    out
}

fn decode(data: &[u8]) -> Result<Tables, String> {
    let raw = parse(data)?;
    let mut iq1s = Box::new([[0i8; 8]; 2048]);
    let v = find(&raw, "iq1s_grid", true, 2048, 8)?;
    for (dst, src) in iq1s.iter_mut().zip(v.chunks_exact(8)) {
        *dst = to_i8::<8>(src);
    }
    let mut ksigns = [0u8; 128];
    ksigns.copy_from_slice(find(&raw, "ksigns_iq2xs", false, 1, 128)?);
    Ok(Tables {
        iq2xxs: rows_u8::<8, 256>(find(&raw, "iq2xxs_grid", false, 256, 8)?),
        iq2xs: rows_u8::<8, 512>(find(&raw, "iq2xs_grid", false, 512, 8)?),
        iq2s: rows_u8::<8, 1024>(find(&raw, "iq2s_grid", false, 1024, 8)?),
        iq3xxs: rows_u8::<4, 256>(find(&raw, "iq3xxs_grid", false, 256, 4)?),
        iq3s: rows_u8::<4, 512>(find(&raw, "iq3s_grid", false, 512, 4)?),
        iq1s,
        ksigns,
        kvalues_iq4nl: to_i8::<16>(find(&raw, "kvalues_iq4nl", true, 1, 16)?),
        kvalues_mxfp4: to_i8::<16>(find(&raw, "kvalues_mxfp4", true, 1, 16)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tables_decode() {
        let t = match tables() {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        };
        // Properties the formats rely on, stated in ggml-common.h / spec §5.5:
        // ksigns[i] = i | parity(i) << 7.
        for (i, &s) in t.ksigns.iter().enumerate() {
            let parity = (i as u8).count_ones() as u8 & 1;
            assert_eq!(s, i as u8 | parity << 7, "ksigns[{i}]");
        }
        assert_eq!(
            t.kvalues_iq4nl,
            [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
        );
        assert_eq!(
            t.kvalues_mxfp4,
            [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
        );
        let set =
            |rows: &[[u8; 8]], allowed: &[u8]| rows.iter().flatten().all(|v| allowed.contains(v));
        assert!(set(&t.iq2xxs[..], &[0x08, 0x19, 0x2b]));
        assert!(set(&t.iq2xs[..], &[0x08, 0x19, 0x2b]));
        assert!(set(&t.iq2s[..], &[0x08, 0x19, 0x2b]));
        let iq3 = [0x04, 0x0c, 0x14, 0x1c, 0x24, 0x2c, 0x34, 0x3e];
        assert!(t.iq3xxs.iter().flatten().all(|v| iq3.contains(v)));
        assert!(t
            .iq3s
            .iter()
            .flatten()
            .all(|v| [1, 3, 5, 7, 9, 11, 13, 15].contains(v)));
        assert!(t.iq1s.iter().flatten().all(|v| (-1..=1).contains(v)));
        // Grids are sets of distinct points.
        let mut rows: Vec<_> = t.iq2s.iter().collect();
        rows.sort();
        rows.dedup();
        assert_eq!(rows.len(), 1024);
    }

    #[test]
    fn malformed_table_data_is_an_error() {
        assert!(decode(b"GGIQTAB1").is_err());
        assert!(decode(&DATA[..DATA.len() - 1]).is_err());
        assert!(decode(b"XXXXXXXX\0\0\0\0").is_err());
    }
}
