//! The body of the `parse` fuzz target: properties every input must satisfy, panicking when one
//! does not (libFuzzer records a panic as a crash). Depends on `gguf` only, so
//! `gguf/tests/hostile.rs` compiles this same file as a module and runs it on stable over seeds
//! and mutations.
//!
//! Properties:
//! - no reader panics or allocates without bound (libFuzzer's `-rss_limit_mb` catches the latter);
//! - the slice reader and the stream reader with a known length give the same header or the same
//!   error, and the stream reader without a length accepts exactly what they accept;
//! - every error names the file;
//! - an accepted header obeys the format's limits, and if its tensor data lies inside the input,
//!   rewriting it reproduces the same header and tensor bytes, and rewriting is idempotent.

use gguf::{Header, TensorInfo};
use std::io::Cursor;

const FILE: &str = "fuzz-input.gguf";

/// Rewrites that would pad far past the input (a huge `general.alignment` with no tensors makes
/// a legal file whose canonical form is gigabytes of zeros) are skipped, not errors.
const MAX_REWRITE_GROWTH: u64 = 1 << 20;

pub fn check(data: &[u8]) {
    let slice = Header::parse_slice(data, FILE);
    let known = Header::parse_reader(Cursor::new(data), Some(data.len() as u64), FILE);
    let unknown = Header::parse_reader(Cursor::new(data), None, FILE);
    let h = match (slice, known) {
        (Err(a), Err(b)) => {
            let msg = a.to_string();
            assert_eq!(msg, b.to_string(), "slice and stream readers disagree");
            assert!(msg.contains(FILE), "error does not name the file: {msg}");
            assert!(
                unknown.is_err(),
                "unknown-length stream accepted what the slice reader refused: {msg}"
            );
            return;
        }
        (Ok(a), Ok(b)) => {
            assert!(a.bit_eq(&b), "slice and stream headers differ");
            let u = unknown.expect("unknown-length stream refused a valid header");
            assert!(a.bit_eq(&u), "unknown-length stream header differs");
            a
        }
        (a, b) => panic!("slice reader: {a:?}\nstream reader: {b:?}"),
    };

    assert!(h.version == 2 || h.version == 3);
    assert!(h.alignment.is_power_of_two());
    assert!(h.data_offset >= h.infos_end && h.data_offset - h.infos_end < h.alignment);
    assert_eq!(h.data_offset % h.alignment, 0);
    for t in &h.tensors {
        assert!(t.name.len() <= 63, "{:?}", t.name);
        assert!(t.dims.len() <= 4);
        assert_eq!(t.offset % h.alignment, 0);
    }
    // Typed accessors over every key, whatever its type.
    let md = &h.metadata;
    for (k, v) in md.iter() {
        let _ = v.display_summary(8);
        let _ = (md.get_u64(k), md.get_i64(k), md.get_f64(k), md.get_bool(k));
        let _ = (md.get_str(k), md.get_str_array(k));
        let _ = (md.get_i64_array(k), md.get_f64_array(k));
    }
    let _ = h.layout_findings();
    let _ = h.data_end();

    if h.check_data_layout(data.len() as u64).is_err() {
        return;
    }
    let bytes_of = |h: &Header, file: &'_ [u8], t: &TensorInfo| -> std::ops::Range<usize> {
        let start = h.data_offset + t.offset;
        let end = start + t.n_bytes();
        assert!(
            end <= file.len() as u64,
            "{} passed the layout check out of bounds",
            t.name
        );
        start as usize..end as usize
    };
    for t in &h.tensors {
        let _ = bytes_of(&h, data, t);
    }

    let layout = h.layout().expect("a validated header can be laid out");
    if layout.file_size() > (data.len() as u64).saturating_add(MAX_REWRITE_GROWTH) {
        return;
    }
    let mut out = Vec::new();
    gguf::writer::write_file(&mut out, &layout, |i| {
        &data[bytes_of(&h, data, &h.tensors[i])]
    })
    .expect("rewrite of a validated file");
    assert_eq!(out.len() as u64, layout.file_size());
    let h2 = Header::parse_slice(&out, FILE).expect("the rewritten file parses");
    h2.check_data_layout(out.len() as u64)
        .expect("the rewritten file's data is in bounds");
    assert!(h.bit_eq(&h2), "rewrite changed the header");
    for (a, b) in h.tensors.iter().zip(&h2.tensors) {
        assert!(
            data[bytes_of(&h, data, a)] == out[bytes_of(&h2, &out, b)],
            "rewrite changed {}",
            a.name
        );
    }
    let mut again = Vec::new();
    let layout2 = h2.layout().expect("rewritten header lays out");
    gguf::writer::write_file(&mut again, &layout2, |i| {
        &out[bytes_of(&h2, &out, &h2.tensors[i])]
    })
    .expect("second rewrite");
    assert!(again == out, "rewriting is not idempotent");
}
