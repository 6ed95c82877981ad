//! Hostile and malformed GGUF files, one test per corruption class of llama.cpp's
//! `tests/test-gguf.cpp` (`handcrafted_file_type`) plus our own limits. Files are written byte by
//! byte with the builder below from the format tables of the spec (§4.1, §4.2, §5), never with
//! the crate's writer, so the expectations do not come from the code under test.
//!
//! Every failure must be the exact `gguf::Error` variant and its message must name the file and
//! the byte offset of the fault. Lying counts and lengths must fail before any large allocation:
//! a counting allocator measures the largest single request made while parsing.

use gguf::{Error, GgufFile, Header, Value};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Cursor;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// Largest allocation request made by the current thread while tracking is on. Tests run in
// parallel threads, so the tracker is per thread.

struct TrackingAlloc;

thread_local! {
    static TRACK: Cell<(bool, usize)> = const { Cell::new((false, 0)) };
}

fn note(size: usize) {
    // `try_with` because the allocator also runs while thread-locals are torn down.
    let _ = TRACK.try_with(|t| {
        let (on, max) = t.get();
        if on && size > max {
            t.set((on, size));
        }
    });
}

unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: TrackingAlloc = TrackingAlloc;

/// Run `f` and return its result with the largest single allocation it requested.
fn largest_alloc<R>(f: impl FnOnce() -> R) -> (R, usize) {
    TRACK.with(|t| t.set((true, 0)));
    let r = f();
    let max = TRACK.with(|t| {
        let (_, max) = t.get();
        t.set((false, 0));
        max
    });
    (r, max)
}

/// The reader reserves at most 2^16 entries up front and grows stream buffers 1 MiB at a time;
/// with small real contents nothing should come near this. A count it trusted would ask for
/// gigabytes or exabytes.
const SMALL_ALLOC: usize = 8 << 20;

// ---------------------------------------------------------------------------------------------
// Format constants, from the spec tables (not from the crate).

const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// A ggml tensor type: id, elements per block, bytes per block (spec §5 table).
#[derive(Clone, Copy)]
struct Ty(u32, u64, u64);
const F32: Ty = Ty(0, 1, 4);
const F16: Ty = Ty(1, 1, 2);
const Q4_0: Ty = Ty(2, 32, 18);
const Q8_0: Ty = Ty(8, 32, 34);
const Q4_K: Ty = Ty(12, 256, 144);
const Q6_K: Ty = Ty(14, 256, 210);
const IQ4_NL: Ty = Ty(20, 32, 18);
const I8: Ty = Ty(24, 1, 1);
const I64: Ty = Ty(27, 1, 8);
const BF16: Ty = Ty(30, 1, 2);
const MXFP4: Ty = Ty(39, 32, 17);
const NVFP4: Ty = Ty(40, 64, 36);
const Q1_0: Ty = Ty(41, 128, 18);

/// Stored bytes of a tensor: `ne0 / block * type_size * ne1 * ...` (spec §4.3).
fn nbytes(ty: Ty, dims: &[u64]) -> u64 {
    let ne0 = dims.first().copied().unwrap_or(1);
    dims.iter().skip(1).product::<u64>() * (ne0 / ty.1) * ty.2
}

fn pad_to(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

// ---------------------------------------------------------------------------------------------
// Byte-level builder.

#[derive(Default)]
struct W(Vec<u8>);

impl W {
    /// Magic, version, tensor count, metadata count.
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> W {
        let mut w = W::default();
        w.raw(b"GGUF").u32(version).u64(n_tensors).u64(n_kv);
        w
    }
    fn pos(&self) -> u64 {
        self.0.len() as u64
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.raw(&[v])
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.raw(&v.to_le_bytes())
    }
    /// gguf_string: u64 length, then the bytes.
    fn str(&mut self, s: &[u8]) -> &mut Self {
        self.u64(s.len() as u64).raw(s)
    }
    /// A key and its value type id; the value follows.
    fn key(&mut self, k: &str, ty: u32) -> &mut Self {
        self.str(k.as_bytes()).u32(ty)
    }
    /// The start of an array value: element type and count; the elements follow.
    fn array(&mut self, elem: u32, count: u64) -> &mut Self {
        self.u32(elem).u64(count)
    }
    /// One tensor info.
    fn info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name.as_bytes()).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Zero bytes up to the next multiple of `align`.
    fn pad(&mut self, align: u64) -> &mut Self {
        let n = pad_to(self.pos(), align) - self.pos();
        self.raw(&vec![0; n as usize])
    }
    fn bytes(&self) -> Vec<u8> {
        self.0.clone()
    }
}

/// Deterministic filler bytes for tensor data.
fn pattern(n: u64, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Running the parsers.

/// A file on disk that lives as long as the value.
struct TempGguf {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn write_temp(bytes: &[u8]) -> TempGguf {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hostile-case.gguf");
    std::fs::write(&path, bytes).unwrap();
    TempGguf { _dir: dir, path }
}

/// An error with the name the file was parsed under.
struct Failure {
    err: Error,
    file: String,
}

impl Failure {
    fn msg(&self) -> String {
        self.err.to_string()
    }
    /// The message names the file and this byte offset.
    fn at(&self, offset: u64) -> &Self {
        let want = format!("{} at byte {offset}", self.file);
        assert!(
            self.msg().contains(&want),
            "message {:?} lacks {want:?}",
            self.msg()
        );
        self
    }
}

fn same_kind(a: &Error, b: &Error) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// A header fault: `GgufFile::open`, `Header::parse_slice` and `Header::parse_reader` with the
/// length known must all refuse the file with the same error (same variant, same message), and
/// none may allocate much. Returns the `open` error.
fn header_err(bytes: &[u8]) -> Failure {
    let tmp = write_temp(bytes);
    let (open, a1) = largest_alloc(|| GgufFile::open(&tmp.path));
    let (slice, a2) = largest_alloc(|| Header::parse_slice(bytes, &tmp.path));
    let (stream, a3) = largest_alloc(|| {
        Header::parse_reader(Cursor::new(bytes), Some(bytes.len() as u64), &tmp.path)
    });
    let open = match open {
        Ok(_) => panic!("GgufFile::open accepted a corrupt file"),
        Err(e) => e,
    };
    let slice = slice.expect_err("parse_slice accepted a corrupt header");
    let stream = stream.expect_err("parse_reader accepted a corrupt header");
    for other in [&slice, &stream] {
        assert!(same_kind(&open, other), "open: {open:?}, other: {other:?}");
        assert_eq!(open.to_string(), other.to_string());
    }
    for a in [a1, a2, a3] {
        assert!(
            a < SMALL_ALLOC,
            "allocation of {a} bytes for a corrupt header"
        );
    }
    Failure {
        err: open,
        file: tmp.path.display().to_string(),
    }
}

/// A header that parses but whose tensor data is not where it says: `parse_slice` accepts it,
/// `GgufFile::open` refuses it.
fn data_err(bytes: &[u8]) -> Failure {
    let tmp = write_temp(bytes);
    Header::parse_slice(bytes, &tmp.path).expect("header itself is valid");
    let err = match GgufFile::open(&tmp.path) {
        Ok(_) => panic!("GgufFile::open accepted a file with bad tensor data"),
        Err(e) => e,
    };
    Failure {
        err,
        file: tmp.path.display().to_string(),
    }
}

/// A valid file: every parser accepts it and agrees.
fn open_ok(bytes: &[u8]) -> (TempGguf, GgufFile) {
    let tmp = write_temp(bytes);
    let f = GgufFile::open(&tmp.path).unwrap_or_else(|e| panic!("valid file refused: {e}"));
    let slice = Header::parse_slice(bytes, &tmp.path).unwrap();
    let stream = Header::parse_reader(Cursor::new(bytes), None, &tmp.path).unwrap();
    assert!(slice.bit_eq(f.header()) && stream.bit_eq(f.header()));
    (tmp, f)
}

// ---------------------------------------------------------------------------------------------
// Header: HEADER_BAD_MAGIC, BAD_VERSION_0/1/FUTURE, BAD_N_TENSORS, BAD_N_KV, EMPTY.

#[test]
fn bad_magic() {
    let mut w = W::header(3, 0, 0);
    w.0[..4].copy_from_slice(b"FUGG");
    let f = header_err(&w.bytes());
    assert!(
        matches!(f.err, Error::BadMagic { got, .. } if &got == b"FUGG"),
        "{:?}",
        f.err
    );
    f.at(0);
}

#[test]
fn short_magic_and_empty_file() {
    for bytes in [&b""[..], b"G", b"GGU"] {
        let f = header_err(bytes);
        assert!(
            matches!(f.err, Error::Truncated { need: 4, .. }),
            "{:?}",
            f.err
        );
        f.at(0);
        assert!(f.msg().contains("magic"), "{}", f.msg());
    }
}

#[test]
fn bad_versions() {
    for version in [0u32, 1, 4, 5, 0xFFFF] {
        let f = header_err(&W::header(version, 0, 0).bytes());
        assert!(
            matches!(f.err, Error::UnsupportedVersion { version: v, .. } if v == version),
            "{version}: {:?}",
            f.err
        );
        f.at(4);
    }
}

#[test]
fn header_only_files_parse() {
    // HEADER_EMPTY of test-gguf.cpp: no tensors, no metadata, padded. v2 has the same layout.
    for version in [2u32, 3] {
        let mut w = W::header(version, 0, 0);
        w.pad(32);
        let (_t, f) = open_ok(&w.bytes());
        assert_eq!(f.version(), version);
        assert!(f.metadata().is_empty() && f.tensors().is_empty());
        assert_eq!(f.alignment(), 32);
    }
    // Unpadded is fine too: there is no data section to align.
    open_ok(&W::header(3, 0, 0).bytes());
}

#[test]
fn big_endian_file_is_named_as_such() {
    // gguf-py --bigendian: magic bytes as is, every other field byte-swapped.
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_be_bytes());
    b.extend_from_slice(&0u64.to_be_bytes());
    b.extend_from_slice(&1u64.to_be_bytes());
    b.extend_from_slice(&4u64.to_be_bytes());
    b.extend_from_slice(b"test");
    b.extend_from_slice(&T_U32.to_be_bytes());
    b.extend_from_slice(&7u32.to_be_bytes());
    let f = header_err(&b);
    assert!(
        matches!(
            f.err,
            Error::BigEndian {
                raw: 0x0300_0000,
                ..
            }
        ),
        "{:?}",
        f.err
    );
    f.at(4);
    assert!(f.msg().contains("big-endian"), "{}", f.msg());
}

#[test]
fn huge_tensor_count_fails_fast() {
    for n in [u64::MAX, 1 << 40, 1000] {
        let f = header_err(&W::header(3, n, 0).bytes());
        assert!(
            matches!(f.err, Error::CountTooLarge { count, what: "tensor", .. } if count == n),
            "{n}: {:?}",
            f.err
        );
        f.at(8);
    }
}

#[test]
fn huge_kv_count_fails_fast() {
    for n in [u64::MAX, 1 << 40, 1000] {
        let f = header_err(&W::header(3, 0, n).bytes());
        assert!(
            matches!(f.err, Error::CountTooLarge { count, what: "metadata", .. } if count == n),
            "{n}: {:?}",
            f.err
        );
        f.at(16);
    }
}

#[test]
fn counts_that_only_together_exceed_the_file() {
    // Each count alone fits the bytes left; both together cannot.
    let mut w = W::header(3, 1, 2);
    w.raw(&[0; 30]);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::CountTooLarge { .. }), "{:?}", f.err);
    f.at(8);
}

#[test]
fn lying_counts_on_a_stream_of_unknown_length() {
    // Without a length to check counts against, the reader must still only allocate as bytes
    // arrive and fail with Truncated when they stop.
    let mut cases = vec![
        W::header(3, u64::MAX, 0).bytes(),
        W::header(3, 0, u64::MAX).bytes(),
        W::header(3, u64::MAX, u64::MAX).bytes(),
    ];
    // A string as long as the cap allows, with 5 bytes behind it.
    let mut w = W::header(3, 0, 1);
    w.u64(1 << 30).raw(b"short");
    cases.push(w.bytes());
    // Arrays as long as the cap allows, of every element type.
    for elem in [T_U8, T_U64, T_STRING, T_ARRAY] {
        let mut w = W::header(3, 0, 1);
        w.key("arr", T_ARRAY).array(elem, 1 << 30).raw(&[1, 2, 3]);
        cases.push(w.bytes());
    }
    // A tensor table claiming 2^40 entries after one real one.
    let mut w = W::header(3, 1 << 40, 0);
    w.info("t", &[4], F32.0, 0);
    cases.push(w.bytes());
    for bytes in cases {
        let (r, max) =
            largest_alloc(|| Header::parse_reader(Cursor::new(&bytes), None, "stream.gguf"));
        let e = r.expect_err("lying stream accepted");
        assert!(matches!(e, Error::Truncated { .. }), "{e:?}");
        assert!(e.to_string().contains("stream.gguf at byte"), "{e}");
        assert!(max < SMALL_ALLOC, "allocated {max} bytes for {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Metadata: KV_BAD_KEY_SIZE, KV_EMPTY_KEY, KV_BAD_TYPE, KV_DUPLICATE_KEY, KV_BAD_ALIGN,
// KV_WRONG_TYPE_ALIGN, KV_SUCCESS, and limits on strings and arrays.

#[test]
fn key_length_huge() {
    let mut w = W::header(3, 0, 1);
    w.u64(u64::MAX).raw(b"key").u32(T_U8).u8(0);
    let f = header_err(&w.bytes());
    assert!(
        matches!(f.err, Error::StringTooLong { len: u64::MAX, max, .. } if max == 1 << 30),
        "{:?}",
        f.err
    );
    f.at(24);
}

#[test]
fn key_length_within_cap_but_past_the_end() {
    let mut w = W::header(3, 0, 1);
    w.u64(1 << 30).raw(b"key").u32(T_U8).u8(0);
    let f = header_err(&w.bytes());
    assert!(
        matches!(f.err, Error::Truncated { need, have: 8, .. } if need == 1 << 30),
        "{:?}",
        f.err
    );
    f.at(32);
}

#[test]
fn empty_key() {
    let mut w = W::header(3, 0, 1);
    w.key("", T_U32).u32(1);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::EmptyKey { .. }), "{:?}", f.err);
    f.at(24);
}

#[test]
fn invalid_utf8_key_and_string() {
    let mut w = W::header(3, 0, 1);
    w.str(b"bad\xff\xfekey").u32(T_U8).u8(0);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::InvalidUtf8 { .. }), "{:?}", f.err);
    f.at(24);

    let mut w = W::header(3, 0, 2);
    w.key("ok", T_U8).u8(1).key("s", T_STRING);
    let at = w.pos();
    w.str(b"\xc3\x28");
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::InvalidUtf8 { .. }), "{:?}", f.err);
    f.at(at);

    // Inside a string array, too.
    let mut w = W::header(3, 0, 1);
    w.key("tokens", T_ARRAY).array(T_STRING, 2).str(b"fine");
    let at = w.pos();
    w.str(b"\xed\xa0\x80"); // an encoded surrogate
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::InvalidUtf8 { .. }), "{:?}", f.err);
    f.at(at);
}

#[test]
fn unknown_value_type() {
    for id in [13u32, 14, 0x8000_0000, u32::MAX] {
        let mut w = W::header(3, 0, 1);
        w.str(b"k");
        let at = w.pos();
        w.u32(id).u8(0);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::UnknownValueType { id: i, key, .. } if *i == id && key == "k"),
            "{id}: {:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn unknown_array_element_type() {
    let mut w = W::header(3, 0, 1);
    w.key("arr", T_ARRAY);
    let at = w.pos();
    w.array(13, 1).u8(0);
    let f = header_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::UnknownValueType { id: 13, key, .. } if key == "arr"),
        "{:?}",
        f.err
    );
    f.at(at);
}

#[test]
fn array_count_over_the_cap() {
    for count in [(1u64 << 30) + 1, u64::MAX] {
        let mut w = W::header(3, 0, 1);
        w.key("arr", T_ARRAY).u32(T_U8);
        let at = w.pos();
        w.u64(count).raw(&[0; 16]);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::ArrayTooLong { count: c, max, key, .. }
                if *c == count && *max == 1 << 30 && key == "arr"),
            "{:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn array_count_past_the_end() {
    // Within the cap, but more elements than bytes left (a string needs at least 8 bytes).
    for (elem, count) in [
        (T_U8, 17u64),
        (T_U64, 3),
        (T_STRING, 3),
        (T_ARRAY, 2),
        (T_U8, 1 << 30),
    ] {
        let mut w = W::header(3, 0, 1);
        w.key("arr", T_ARRAY).u32(elem);
        let at = w.pos();
        w.u64(count).raw(&[0; 16]);
        let f = header_err(&w.bytes());
        assert!(
            matches!(f.err, Error::CountTooLarge { count: c, .. } if c == count),
            "{elem} x {count}: {:?}",
            f.err
        );
        f.at(at);
    }
}

/// `levels` arrays nested in each other, the innermost holding two U8 values (7, 9). Returns the
/// offset of each level's element-type field.
fn nested_arrays(w: &mut W, levels: usize) -> Vec<u64> {
    let mut starts = Vec::new();
    for level in 1..=levels {
        starts.push(w.pos());
        if level < levels {
            w.array(T_ARRAY, 1);
        } else {
            w.array(T_U8, 2).u8(7).u8(9);
        }
    }
    starts
}

#[test]
fn nested_arrays_within_the_cap_are_read() {
    let cap = gguf::reader::MAX_ARRAY_DEPTH;
    assert!(
        cap >= 2,
        "nested arrays (gguf-py writes them) must be readable"
    );
    let mut w = W::header(3, 0, 1);
    w.key("nested", T_ARRAY);
    nested_arrays(&mut w, cap);
    let (_t, f) = open_ok(&w.bytes());
    let mut v = f.metadata().get("nested").unwrap();
    for _ in 1..cap {
        let a = v.as_array().unwrap();
        assert_eq!(a.elem_type, gguf::ValueType::Array);
        assert_eq!(a.len(), 1);
        v = &a.values[0];
    }
    let inner = v.as_array().unwrap();
    assert_eq!(inner.values, vec![Value::U8(7), Value::U8(9)]);
}

#[test]
fn nested_arrays_deeper_than_the_cap() {
    let cap = gguf::reader::MAX_ARRAY_DEPTH;
    let mut w = W::header(3, 0, 1);
    w.key("deep", T_ARRAY);
    let starts = nested_arrays(&mut w, cap + 1);
    let f = header_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::ArrayTooDeep { max, key, .. } if *max == cap && key == "deep"),
        "{:?}",
        f.err
    );
    f.at(starts[cap]);

    // A bomb: arrays nested a million deep in a few megabytes must not recurse a million times.
    let mut w = W::header(3, 0, 1);
    w.key("bomb", T_ARRAY);
    for _ in 0..1_000_000 {
        w.array(T_ARRAY, 1);
    }
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::ArrayTooDeep { .. }), "{:?}", f.err);
}

#[test]
fn duplicate_key() {
    let mut w = W::header(3, 0, 3);
    w.key("my_key_0", T_U8)
        .u8(1)
        .key("my_key_1", T_STRING)
        .str(b"x");
    let at = w.pos();
    // Same key, different type: still a duplicate.
    w.key("my_key_0", T_U32).u32(2);
    let f = header_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::DuplicateKey { key, .. } if key == "my_key_0"),
        "{:?}",
        f.err
    );
    f.at(at);
}

#[test]
fn bad_alignment_values_and_types() {
    let bad: Vec<(u32, Vec<u8>)> = vec![
        (T_U32, 0u32.to_le_bytes().to_vec()),
        (T_U32, 13u32.to_le_bytes().to_vec()),
        (T_U32, 48u32.to_le_bytes().to_vec()),
        (T_U32, u32::MAX.to_le_bytes().to_vec()),
        // KV_WRONG_TYPE_ALIGN: right value, wrong type.
        (T_I32, 32u32.to_le_bytes().to_vec()),
        (T_U64, 32u64.to_le_bytes().to_vec()),
        (T_U16, 32u16.to_le_bytes().to_vec()),
        (T_STRING, {
            let mut s = 2u64.to_le_bytes().to_vec();
            s.extend_from_slice(b"32");
            s
        }),
    ];
    for (ty, value) in bad {
        let mut w = W::header(3, 0, 2);
        w.key("a", T_U8).u8(0);
        let at = w.pos();
        w.key("general.alignment", ty).raw(&value);
        let f = header_err(&w.bytes());
        assert!(
            matches!(f.err, Error::BadAlignment { .. }),
            "{ty}: {:?}",
            f.err
        );
        f.at(at);
    }
}

/// One value of every type and arrays of every element type (including empty ones), with the
/// values the reader must return.
fn kv_zoo() -> (W, Vec<(&'static str, Value)>) {
    use gguf::{Array, ValueType as VT};
    let arr = |elem_type, values| Value::Array(Array { elem_type, values });
    let mut w = W::default();
    let mut want = Vec::new();
    w.key("u8", T_U8).u8(0xfe);
    want.push(("u8", Value::U8(0xfe)));
    w.key("i8", T_I8).u8(0x80);
    want.push(("i8", Value::I8(-128)));
    w.key("u16", T_U16).u16(0xbeef);
    want.push(("u16", Value::U16(0xbeef)));
    w.key("i16", T_I16).u16(0xffff);
    want.push(("i16", Value::I16(-1)));
    w.key("u32", T_U32).u32(0xdead_beef);
    want.push(("u32", Value::U32(0xdead_beef)));
    w.key("i32", T_I32).u32(0x8000_0000);
    want.push(("i32", Value::I32(i32::MIN)));
    w.key("f32.nan", T_F32).u32(0x7fc0_1234);
    want.push(("f32.nan", Value::F32(f32::from_bits(0x7fc0_1234))));
    w.key("f32", T_F32).u32(0xbf80_0000);
    want.push(("f32", Value::F32(-1.0)));
    // The writer emits 0/1 but readers take any non-zero byte as true (gguf.cpp reads an int8).
    w.key("bool.2", T_BOOL).u8(2);
    want.push(("bool.2", Value::Bool(true)));
    w.key("bool.0", T_BOOL).u8(0);
    want.push(("bool.0", Value::Bool(false)));
    w.key("str", T_STRING).str("ünïcødé ✓ 字".as_bytes());
    want.push(("str", Value::String("ünïcødé ✓ 字".into())));
    w.key("str.empty", T_STRING).str(b"");
    want.push(("str.empty", Value::String(String::new())));
    w.key("u64", T_U64).u64(u64::MAX);
    want.push(("u64", Value::U64(u64::MAX)));
    w.key("i64", T_I64).u64(1u64 << 63);
    want.push(("i64", Value::I64(i64::MIN)));
    w.key("f64.nan", T_F64).u64(0xfff8_0000_0000_0001);
    want.push(("f64.nan", Value::F64(f64::from_bits(0xfff8_0000_0000_0001))));
    w.key("f64", T_F64).u64(0x4009_21fb_5444_2d18);
    want.push(("f64", Value::F64(std::f64::consts::PI)));

    w.key("a.u8", T_ARRAY).array(T_U8, 3).raw(&[1, 2, 255]);
    want.push((
        "a.u8",
        arr(VT::U8, vec![Value::U8(1), Value::U8(2), Value::U8(255)]),
    ));
    w.key("a.i8", T_ARRAY).array(T_I8, 2).raw(&[0xff, 0x7f]);
    want.push(("a.i8", arr(VT::I8, vec![Value::I8(-1), Value::I8(127)])));
    w.key("a.u16", T_ARRAY).array(T_U16, 1).u16(513);
    want.push(("a.u16", arr(VT::U16, vec![Value::U16(513)])));
    w.key("a.i16", T_ARRAY).array(T_I16, 1).u16(0x8000);
    want.push(("a.i16", arr(VT::I16, vec![Value::I16(i16::MIN)])));
    w.key("a.u32", T_ARRAY).array(T_U32, 2).u32(0).u32(u32::MAX);
    want.push((
        "a.u32",
        arr(VT::U32, vec![Value::U32(0), Value::U32(u32::MAX)]),
    ));
    w.key("a.i32", T_ARRAY).array(T_I32, 1).u32(0xffff_fffe);
    want.push(("a.i32", arr(VT::I32, vec![Value::I32(-2)])));
    w.key("a.f32", T_ARRAY)
        .array(T_F32, 2)
        .u32(0x3f80_0000)
        .u32(0xffc0_0001);
    want.push((
        "a.f32",
        arr(
            VT::F32,
            vec![Value::F32(1.0), Value::F32(f32::from_bits(0xffc0_0001))],
        ),
    ));
    w.key("a.bool", T_ARRAY).array(T_BOOL, 3).raw(&[0, 1, 0x80]);
    want.push((
        "a.bool",
        arr(
            VT::Bool,
            vec![Value::Bool(false), Value::Bool(true), Value::Bool(true)],
        ),
    ));
    w.key("a.str", T_ARRAY)
        .array(T_STRING, 3)
        .str(b"<s>")
        .str(b"")
        .str("Ġthe".as_bytes());
    want.push((
        "a.str",
        arr(
            VT::String,
            vec![
                Value::String("<s>".into()),
                Value::String("".into()),
                Value::String("Ġthe".into()),
            ],
        ),
    ));
    w.key("a.u64", T_ARRAY).array(T_U64, 1).u64(1 << 40);
    want.push(("a.u64", arr(VT::U64, vec![Value::U64(1 << 40)])));
    w.key("a.i64", T_ARRAY).array(T_I64, 1).u64(u64::MAX);
    want.push(("a.i64", arr(VT::I64, vec![Value::I64(-1)])));
    w.key("a.f64", T_ARRAY)
        .array(T_F64, 1)
        .u64(0x8000_0000_0000_0000);
    want.push(("a.f64", arr(VT::F64, vec![Value::F64(-0.0)])));
    w.key("a.empty.u8", T_ARRAY).array(T_U8, 0);
    want.push(("a.empty.u8", arr(VT::U8, vec![])));
    w.key("a.empty.str", T_ARRAY).array(T_STRING, 0);
    want.push(("a.empty.str", arr(VT::String, vec![])));
    w.key("a.empty.arr", T_ARRAY).array(T_ARRAY, 0);
    want.push(("a.empty.arr", arr(VT::Array, vec![])));
    w.key("a.arr", T_ARRAY)
        .array(T_ARRAY, 2)
        .array(T_U8, 1)
        .u8(5)
        .array(T_STRING, 1)
        .str(b"x");
    want.push((
        "a.arr",
        arr(
            VT::Array,
            vec![
                arr(VT::U8, vec![Value::U8(5)]),
                arr(VT::String, vec![Value::String("x".into())]),
            ],
        ),
    ));
    (w, want)
}

#[test]
fn every_value_type_reads_back() {
    let (zoo, want) = kv_zoo();
    let mut w = W::header(3, 0, want.len() as u64);
    w.raw(&zoo.0);
    let (_t, f) = open_ok(&w.bytes());
    let got: Vec<(&str, &Value)> = f.metadata().iter().collect();
    assert_eq!(got.len(), want.len());
    for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
        assert_eq!(gk, wk, "key order is file order");
        assert!(gv.bit_eq(wv), "{wk}: got {gv:?}, want {wv:?}");
    }
    assert_eq!(f.alignment(), 32);
}

// ---------------------------------------------------------------------------------------------
// Tensor infos: TENSORS_BAD_NAME_SIZE, BAD_N_DIMS, BAD_SHAPE, ZERO_DIM, NE_TOO_BIG,
// NBYTES_TOO_BIG, BAD_TYPE, BAD_OFFSET, DUPLICATE_NAME, BAD_ALIGN, INCONSISTENT_ALIGN.

/// A header with `n` tensor infos and one metadata key; the infos follow.
fn with_tensors(n: u64) -> W {
    let mut w = W::header(3, n, 1);
    w.key("general.architecture", T_STRING).str(b"test");
    w
}

#[test]
fn tensor_name_too_long() {
    let name = "t".repeat(64);
    let mut w = with_tensors(1);
    let at = w.pos();
    w.info(&name, &[4], F32.0, 0).pad(32).raw(&[0; 16]);
    let f = header_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::TensorNameTooLong { len: 64, tensor, .. } if *tensor == name),
        "{:?}",
        f.err
    );
    f.at(at);

    // 63 bytes (GGML_MAX_NAME less the NUL) is the longest allowed.
    let name = "t".repeat(63);
    let mut w = with_tensors(1);
    w.info(&name, &[4], F32.0, 0).pad(32).raw(&[0; 16]);
    let (_t, f) = open_ok(&w.bytes());
    assert_eq!(f.tensors()[0].name, name);
}

#[test]
fn tensor_name_invalid_utf8_or_huge() {
    let mut w = with_tensors(1);
    let at = w.pos();
    w.str(b"blk.\xff").u32(1).u64(4).u32(F32.0).u64(0);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::InvalidUtf8 { .. }), "{:?}", f.err);
    f.at(at);

    let mut w = with_tensors(1);
    let at = w.pos();
    w.u64(u64::MAX - 3).raw(&[b'x'; 24]);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::StringTooLong { .. }), "{:?}", f.err);
    f.at(at);
}

#[test]
fn too_many_dims() {
    for n_dims in [5u32, 1000, u32::MAX] {
        let mut w = with_tensors(1);
        w.str(b"t");
        let at = w.pos();
        w.u32(n_dims);
        for _ in 0..5 {
            w.u64(1);
        }
        w.u32(F32.0).u64(0).pad(32).raw(&[0; 4]);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::TooManyDims { n_dims: n, tensor, .. } if *n == n_dims && tensor == "t"),
            "{:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn negative_dims() {
    // TENSORS_BAD_SHAPE: ne = -1 as int64.
    let mut w = with_tensors(1);
    w.str(b"t");
    let at = w.pos();
    w.u32(2).u64(u64::MAX).u64(u64::MAX).u32(F32.0).u64(0);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::ShapeOverflow { .. }), "{:?}", f.err);
    f.at(at);
}

#[test]
fn element_count_overflows() {
    // TENSORS_NE_TOO_BIG: the product of dims leaves int64 (and here u64).
    let big = 4 * i32::MAX as u64;
    for dims in [vec![big, big], vec![1 << 32, 1 << 31], vec![2, 2, 1 << 62]] {
        let mut w = with_tensors(1);
        w.str(b"t");
        let at = w.pos();
        w.u32(dims.len() as u32);
        for &d in &dims {
            w.u64(d);
        }
        w.u32(F32.0).u64(0);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::ShapeOverflow { dims: d, .. } if *d == dims),
            "{dims:?}: {:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn byte_count_overflows() {
    // TENSORS_NBYTES_TOO_BIG: the element count fits int64, the byte count does not.
    for (ty, dims) in [
        (I64, vec![1u64 << 30, 1 << 30]),
        (I64, vec![1u64 << 31, 1 << 31]),
        (F32, vec![1u64 << 62]),
        (Q6_K, vec![256, 1 << 60]),
    ] {
        let mut w = with_tensors(1);
        w.str(b"t");
        let at = w.pos();
        w.u32(dims.len() as u32);
        for &d in &dims {
            w.u64(d);
        }
        w.u32(ty.0).u64(0);
        let f = header_err(&w.bytes());
        assert!(
            matches!(f.err, Error::ShapeOverflow { .. }),
            "{dims:?}: {:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn row_not_a_multiple_of_the_block() {
    for (ty, ne0) in [
        (Q4_K, 100u64),
        (Q4_0, 33),
        (Q8_0, 16),
        (NVFP4, 32),
        (Q1_0, 64),
    ] {
        let mut w = with_tensors(1);
        w.str(b"w");
        let at = w.pos();
        w.u32(2).u64(ne0).u64(2).u32(ty.0).u64(0);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::BlockMisaligned { ne0: n, block, .. } if *n == ne0 && *block as u64 == ty.1),
            "{:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn unknown_and_retired_tensor_types() {
    // 4, 5: Q4_2/Q4_3; 31-33: Q4_0_4_4/4_8/8_8; 36-38: IQ4_NL_4_4/4_8/8_8; 42: past the table.
    for id in [4u32, 5, 31, 32, 33, 36, 37, 38, 42, 1000, u32::MAX] {
        let mut w = with_tensors(1);
        w.str(b"w").u32(1).u64(256);
        let at = w.pos();
        w.u32(id).u64(0).pad(32).raw(&[0; 1024]);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::UnknownTensorType { id: i, tensor, .. } if *i == id && tensor == "w"),
            "{id}: {:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn misaligned_offsets() {
    // TENSORS_BAD_OFFSET (-1) and plain misalignment against the default 32.
    for offset in [u64::MAX, 16, 1, 33] {
        let mut w = with_tensors(1);
        w.str(b"w").u32(1).u64(8).u32(F32.0);
        let at = w.pos();
        w.u64(offset).pad(32).raw(&[0; 96]);
        let f = header_err(&w.bytes());
        assert!(
            matches!(&f.err, Error::MisalignedOffset { offset: o, alignment: 32, .. } if *o == offset),
            "{offset}: {:?}",
            f.err
        );
        f.at(at);
    }
}

#[test]
fn inconsistent_alignment() {
    // TENSORS_INCONSISTENT_ALIGN: offsets laid out with alignment 1 while the file declares none
    // (so 32 applies).
    let mut w = with_tensors(2);
    w.info("a", &[5], F32.0, 0);
    let at = w.pos() + 8 + 1 + 4 + 8 + 4;
    w.info("b", &[5], F32.0, 20).pad(32).raw(&pattern(40, 0));
    let f = header_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::MisalignedOffset { offset: 20, tensor, .. } if tensor == "b"),
        "{:?}",
        f.err
    );
    f.at(at);
}

#[test]
fn bad_alignment_with_tensors() {
    // TENSORS_BAD_ALIGN / DATA_BAD_ALIGN: alignment 13 declared before tensors and data.
    let mut w = W::header(3, 1, 1);
    w.key("general.alignment", T_U32).u32(13);
    w.info("a", &[4], F32.0, 0).pad(13).raw(&[0; 16]);
    let f = header_err(&w.bytes());
    assert!(matches!(f.err, Error::BadAlignment { .. }), "{:?}", f.err);
    f.at(24);
}

#[test]
fn duplicate_tensor_name() {
    let mut w = with_tensors(2);
    w.info("my_tensor", &[8], F32.0, 0);
    let at = w.pos();
    w.info("my_tensor", &[8], F32.0, 32).pad(32).raw(&[0; 64]);
    let f = header_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::DuplicateTensor { tensor, .. } if tensor == "my_tensor"),
        "{:?}",
        f.err
    );
    f.at(at);
}

// ---------------------------------------------------------------------------------------------
// Tensor data: DATA_NOT_ENOUGH_DATA, DATA_MEM_SIZE_OVERFLOW, overlaps and gaps.

#[test]
fn tensor_data_past_end_of_file() {
    // The last tensor is one byte short.
    let mut w = with_tensors(2);
    w.info("a", &[8], F32.0, 0)
        .info("b", &[16], F32.0, 32)
        .pad(32);
    let data_offset = w.pos();
    w.raw(&pattern(32 + 63, 1));
    let f = data_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::TensorOutOfBounds { tensor, end, file_size, .. }
            if tensor == "b" && *end == data_offset + 96 && *file_size == data_offset + 95),
        "{:?}",
        f.err
    );
    f.at(data_offset + 32);
}

#[test]
fn data_size_overflow() {
    // DATA_MEM_SIZE_OVERFLOW: two tensors of 2^63 - 64 bytes each and 32 bytes of data.
    let ne = 0x7FFF_FFFF_FFFF_FFC0;
    let mut w = with_tensors(2);
    w.info("a", &[ne], I8.0, 0)
        .info("b", &[ne], I8.0, ne)
        .pad(32);
    let data_offset = w.pos();
    w.raw(&pattern(32, 0));
    let f = data_err(&w.bytes());
    assert!(
        matches!(&f.err, Error::TensorOutOfBounds { tensor, .. } if tensor == "a"),
        "{:?}",
        f.err
    );
    f.at(data_offset);
}

#[test]
fn offset_far_past_the_end() {
    // Aligned, so only the extent check can catch it; data_offset + offset overflows u64.
    for offset in [!31u64, 1 << 40] {
        let mut w = with_tensors(1);
        w.info("a", &[8], F32.0, offset).pad(32);
        let data_offset = w.pos();
        w.raw(&pattern(32, 0));
        let bytes = w.bytes();
        let f = data_err(&bytes);
        assert!(
            matches!(&f.err, Error::TensorOutOfBounds { tensor, .. } if tensor == "a"),
            "{:?}",
            f.err
        );
        f.at(data_offset.saturating_add(offset));
        // Reports and rewrites over the unchecked header must not overflow either.
        let h = Header::parse_slice(&bytes, "x.gguf").unwrap();
        assert!(h.data_end() > bytes.len() as u64);
        assert_eq!(h.layout_findings().len(), 1);
        match h.layout() {
            Ok(layout) => assert_eq!(layout.file_size(), data_offset + offset + 32),
            Err(e) => assert!(offset > 1 << 40 && matches!(e, Error::Write(_)), "{e}"),
        }
    }
}

/// A file of 1-D F32 tensors `(name, n_elements, offset)` over `data_len` pattern bytes that
/// opening must refuse; also returns where the data section starts, for `Failure::at`.
fn f32_tensors_data_err(tensors: &[(&str, u64, u64)], data_len: u64) -> (Failure, u64) {
    let mut w = with_tensors(tensors.len() as u64);
    for &(name, n, offset) in tensors {
        w.info(name, &[n], F32.0, offset);
    }
    w.pad(32);
    let data_offset = w.pos();
    w.raw(&pattern(data_len, 0));
    (data_err(&w.bytes()), data_offset)
}

#[test]
fn overlapping_tensors() {
    let (f, data_offset) = f32_tensors_data_err(&[("a", 16, 0), ("b", 8, 32)], 64);
    assert!(
        matches!(&f.err, Error::OverlappingTensors { tensor, other, start: 32, end: 64, .. }
            if tensor == "b" && other == "a"),
        "{:?}",
        f.err
    );
    f.at(data_offset + 32);

    // Table order does not matter: the later tensor in the data is named.
    let (f, _) = f32_tensors_data_err(&[("b", 8, 32), ("a", 16, 0)], 64);
    assert!(
        matches!(&f.err, Error::OverlappingTensors { tensor, .. } if tensor == "b"),
        "{:?}",
        f.err
    );

    // Same offset, same size.
    let (f, _) = f32_tensors_data_err(&[("a", 8, 0), ("b", 8, 0)], 32);
    assert!(
        matches!(f.err, Error::OverlappingTensors { .. }),
        "{:?}",
        f.err
    );
}

#[test]
fn overlap_not_adjacent_in_offset_order() {
    // "big" covers [0, 256); a zero-sized tensor sits inside it, then "c" at 64 also inside it.
    // Comparing only neighbours in offset order would miss big/c.
    let (f, data_offset) = f32_tensors_data_err(&[("big", 64, 0), ("z", 0, 32), ("c", 8, 64)], 256);
    assert!(
        matches!(&f.err, Error::OverlappingTensors { tensor, other, .. } if tensor == "c" && other == "big"),
        "{:?}",
        f.err
    );
    f.at(data_offset + 64);

    // Two small tensors inside a big one: the second small one is not adjacent to "big".
    let (f, _) = f32_tensors_data_err(&[("big", 64, 0), ("s1", 8, 160), ("s2", 8, 224)], 256);
    assert!(
        matches!(f.err, Error::OverlappingTensors { .. }),
        "{:?}",
        f.err
    );
}

#[test]
fn zero_sized_tensors_overlap_nothing() {
    // TENSORS_ZERO_DIM: a dimension of 0 is legal and occupies no bytes.
    let mut w = with_tensors(3);
    w.info("a", &[8, 0], F32.0, 0)
        .info("b", &[8], F32.0, 0)
        .info("c", &[0], Q4_K.0, 32)
        .pad(32);
    w.raw(&pattern(32, 0));
    let (_t, f) = open_ok(&w.bytes());
    assert_eq!(f.tensors()[0].n_elements(), 0);
    assert_eq!(f.tensors()[0].n_bytes(), 0);
    assert!(f.tensor_data(&f.tensors()[0]).is_empty());
    assert_eq!(f.tensor_data(&f.tensors()[1]), &pattern(32, 0)[..]);
}

#[test]
fn gap_between_tensors_is_read_and_reported() {
    let mut w = with_tensors(2);
    w.info("a", &[8], F32.0, 0)
        .info("b", &[8], F32.0, 64)
        .pad(32);
    let a = pattern(32, 3);
    let b = pattern(32, 9);
    w.raw(&a).raw(&[0xAA; 32]).raw(&b);
    let (_t, f) = open_ok(&w.bytes());
    assert_eq!(f.tensor_data(&f.tensors()[0]), &a[..]);
    assert_eq!(f.tensor_data(&f.tensors()[1]), &b[..]);
    let findings = f.header().layout_findings();
    assert_eq!(findings.len(), 1, "{findings:?}");
    assert!(
        matches!(&findings[0], Error::OffsetMismatch { tensor, expected: 32, got: 64, .. } if tensor == "b"),
        "{findings:?}"
    );
    assert!(findings[0]
        .to_string()
        .contains(&f.path().display().to_string()));
}

// ---------------------------------------------------------------------------------------------
// SUCCESS variants: TENSORS_SUCCESS, TENSORS_CUSTOM_ALIGN, DATA_SUCCESS, DATA_CUSTOM_ALIGN.

/// Tensors of several types and ranks (ne innermost first).
fn tensor_zoo() -> Vec<(String, Ty, Vec<u64>)> {
    vec![
        ("token_embd.weight".into(), Q4_K, vec![256, 3]),
        ("blk.0.attn_norm.weight".into(), F32, vec![7]),
        ("blk.0.ffn_up.weight".into(), Q8_0, vec![64, 2, 1]),
        ("blk.0.ffn_down.weight".into(), Q4_0, vec![32, 3, 2, 2]),
        ("blk.0.attn_q.weight".into(), F16, vec![3, 5]),
        ("blk.0.attn_k.weight".into(), BF16, vec![9]),
        ("blk.0.exps.weight".into(), MXFP4, vec![64, 1, 3]),
        ("blk.0.nv.weight".into(), NVFP4, vec![128]),
        ("blk.0.q1.weight".into(), Q1_0, vec![128, 2]),
        ("blk.0.iq.weight".into(), IQ4_NL, vec![32]),
        ("blk.0.idx".into(), I64, vec![3]),
        ("blk.0.i8".into(), I8, vec![1, 1, 1, 5]),
        ("output.weight".into(), Q6_K, vec![256]),
    ]
}

/// A canonical file (offsets = running padded sizes) with the zoo's tensors and metadata, under
/// `alignment` (declared only when not the default). Returns the bytes and each tensor's data.
fn canonical_file(alignment: u32) -> (Vec<u8>, Vec<Vec<u8>>, u64) {
    let tensors = tensor_zoo();
    let (zoo, want) = kv_zoo();
    let declare = alignment != 32;
    let n_kv = want.len() as u64 + u64::from(declare);
    let mut w = W::header(3, tensors.len() as u64, n_kv);
    w.raw(&zoo.0);
    if declare {
        w.key("general.alignment", T_U32).u32(alignment);
    }
    let align = alignment as u64;
    let mut offset = 0;
    let mut data = Vec::new();
    for (i, (name, ty, dims)) in tensors.iter().enumerate() {
        w.info(name, dims, ty.0, offset);
        let n = nbytes(*ty, dims);
        data.push(pattern(n, i as u8));
        offset += pad_to(n, align);
    }
    w.pad(align);
    let data_offset = w.pos();
    for d in &data {
        w.raw(d).pad(align);
    }
    (w.bytes(), data, data_offset)
}

#[test]
fn tensors_and_data_read_back() {
    // 32: default; 64: custom (TENSORS/DATA_CUSTOM_ALIGN); 1: test-gguf.cpp's custom alignment.
    for alignment in [32u32, 64, 1] {
        let (bytes, data, data_offset) = canonical_file(alignment);
        let (_t, f) = open_ok(&bytes);
        assert_eq!(f.alignment(), alignment as u64);
        assert_eq!(f.data_offset(), data_offset);
        assert_eq!(f.file_size(), bytes.len() as u64);
        let zoo = tensor_zoo();
        assert_eq!(f.tensors().len(), zoo.len());
        let mut expected_offset = 0;
        for ((t, (name, ty, dims)), d) in f.tensors().iter().zip(&zoo).zip(&data) {
            assert_eq!(&t.name, name);
            assert_eq!(t.ty.id(), ty.0);
            assert_eq!(&t.dims, dims);
            assert_eq!(t.offset, expected_offset);
            assert_eq!(t.n_bytes(), d.len() as u64, "{name}");
            assert_eq!(t.n_elements(), dims.iter().product::<u64>());
            assert_eq!(f.tensor_data(t), &d[..], "{name}");
            expected_offset += pad_to(d.len() as u64, alignment as u64);
        }
        assert!(f.header().layout_findings().is_empty());
        assert_eq!(f.header().data_end(), bytes.len() as u64);
        let (_, want) = kv_zoo();
        for (k, v) in &want {
            assert!(f.metadata().get(k).unwrap().bit_eq(v), "{k}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Truncation anywhere.

/// A small valid file touching most field kinds. The last tensor's size is a multiple of the
/// alignment, so the file has no trailing padding and every strict prefix is missing something.
fn small_file() -> Vec<u8> {
    let mut w = W::header(3, 2, 6);
    w.key("general.architecture", T_STRING).str(b"glm-dsa");
    w.key("general.alignment", T_U32).u32(32);
    w.key("n", T_U64).u64(78);
    w.key("eps", T_F32).u32(0x3727_c5ac);
    w.key("flag", T_BOOL).u8(1);
    w.key("tokens", T_ARRAY)
        .array(T_STRING, 3)
        .str(b"a")
        .str(b"bc")
        .str(b"");
    w.info("a", &[32], Q8_0.0, 0)
        .info("b", &[8, 2], F32.0, 64)
        .pad(32);
    w.raw(&pattern(34, 1)).pad(32).raw(&pattern(64, 2));
    w.bytes()
}

#[test]
fn truncated_at_every_byte() {
    let bytes = small_file();
    let (_t, full) = open_ok(&bytes);
    let infos_end = full.header().infos_end;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("truncated.gguf");
    let file = path.display().to_string();
    for len in 0..bytes.len() {
        let prefix = &bytes[..len];
        std::fs::write(&path, prefix).unwrap();
        let open = GgufFile::open(&path);
        let Err(e) = open else {
            panic!("prefix of {len} bytes accepted");
        };
        assert!(
            e.to_string().contains(&format!("{file} at byte")),
            "{len}: {e}"
        );
        let slice = Header::parse_slice(prefix, &path);
        let known = Header::parse_reader(Cursor::new(prefix), Some(len as u64), &path);
        let unknown = Header::parse_reader(Cursor::new(prefix), None, &path);
        if (len as u64) < infos_end {
            assert!(
                matches!(e, Error::Truncated { .. } | Error::CountTooLarge { .. }),
                "{len}: {e:?}"
            );
            for r in [&slice, &known] {
                let other = r.as_ref().expect_err("truncated header accepted");
                assert!(
                    same_kind(&e, other) && e.to_string() == other.to_string(),
                    "{len}"
                );
            }
            let u = unknown.expect_err("truncated stream accepted");
            assert!(matches!(u, Error::Truncated { .. }), "{len}: {u:?}");
        } else {
            // The header is whole; the data is not.
            assert!(matches!(e, Error::TensorOutOfBounds { .. }), "{len}: {e:?}");
            for r in [slice, known, unknown] {
                assert!(r.unwrap().bit_eq(full.header()), "{len}");
            }
        }
    }
}

#[test]
fn arbitrary_garbage_never_panics() {
    // Flip each byte of a valid header to a few hostile values; whatever the parsers decide,
    // they must decide it without panicking, and accepted files must have in-bounds tensors.
    let (bytes, _, data_offset) = canonical_file(32);
    let path = Path::new("mutant.gguf");
    for i in 0..data_offset as usize {
        for v in [0x00u8, 0xff, 0x80, 0x7f, 0x01, bytes[i] ^ 0x20] {
            let mut m = bytes.clone();
            m[i] = v;
            let Ok(h) = Header::parse_slice(&m, path) else {
                continue;
            };
            let _ = h.layout_findings();
            let _ = h.data_end();
            if let Ok(layout) = h.layout() {
                let _ = (layout.file_size(), layout.data_plan());
            }
            if h.check_data_layout(m.len() as u64).is_ok() {
                for t in &h.tensors {
                    let end = h.data_offset + t.offset + t.n_bytes();
                    assert!(
                        end <= m.len() as u64,
                        "byte {i} = {v:#x}: {} out of bounds",
                        t.name
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The fuzz target's body (fuzz/src/lib.rs) on stable: seeds and bounded random mutations. The
// real fuzzer (cargo +nightly fuzz run parse) explores far more; this keeps the properties
// checked in every test run.

#[path = "../../fuzz/src/lib.rs"]
mod fuzz_body;

/// xorshift64*: a fixed seed keeps the run reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values at the edges of the checks: caps, int64 and u32 limits, small counts.
const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    3,
    4,
    13,
    32,
    63,
    64,
    255,
    1 << 30,
    (1 << 30) + 1,
    1 << 31,
    1 << 32,
    1 << 63,
    u64::MAX,
];

fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut m = input.to_vec();
    for _ in 0..1 + rng.below(3) {
        let len = m.len();
        let at = rng.below(len);
        match rng.below(6) {
            0 if len > 0 => m[at] ^= 1 << rng.below(8),
            1 if len > 0 => m[at] = INTERESTING[rng.below(16)] as u8,
            2 => {
                let width = if rng.below(2) == 0 { 4 } else { 8 };
                let v = INTERESTING[rng.below(16)].to_le_bytes();
                for (i, b) in v[..width].iter().enumerate() {
                    if let Some(x) = m.get_mut(at + i) {
                        *x = *b;
                    }
                }
            }
            3 => m.truncate(at),
            4 => {
                let end = (at + 1 + rng.below(16)).min(len);
                m.drain(at..end);
            }
            _ => {
                let end = (at + 1 + rng.below(32)).min(len);
                let chunk = m[at..end].to_vec();
                let to = rng.below(len + 1);
                m.splice(to..to, chunk);
            }
        }
    }
    m
}

#[test]
fn fuzz_body_over_seeds_and_mutations() {
    let mut seeds = vec![
        small_file(),
        canonical_file(32).0,
        canonical_file(64).0,
        canonical_file(1).0,
        W::header(3, 0, 0).bytes(),
    ];
    // Headers written by llama.cpp (gguf-split shards of the fixture model): the whole file
    // once, then its header (with one tensor's worth of data) as a mutation seed.
    let split = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf/split");
    for name in [
        "tiny-glm5-Q4_K_M-00002-of-00003.gguf",
        "tiny-glm5-Q4_K_M-00003-of-00003.gguf",
    ] {
        let bytes = std::fs::read(split.join(name)).unwrap();
        fuzz_body::check(&bytes);
        let h = Header::parse_slice(&bytes, name).unwrap();
        let end = (h.data_offset + h.tensors[0].n_bytes()) as usize;
        seeds.push(bytes[..end.min(bytes.len())].to_vec());
    }
    // Whatever a developer's fuzzing left in the (untracked) corpus.
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/parse");
    if let Ok(dir) = std::fs::read_dir(corpus) {
        for e in dir.flatten().take(500) {
            if let Ok(b) = std::fs::read(e.path()) {
                if b.len() <= 1 << 16 {
                    seeds.push(b);
                }
            }
        }
    }
    for s in &seeds {
        fuzz_body::check(s);
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for i in 0..20_000 {
        let seed = &seeds[rng.below(seeds.len())];
        let m = mutate(&mut rng, seed);
        let r = std::panic::catch_unwind(|| fuzz_body::check(&m));
        if r.is_err() {
            let path = std::env::temp_dir().join(format!("gguf-fuzz-smoke-{i}.gguf"));
            std::fs::write(&path, &m).unwrap();
            panic!(
                "mutation {i} broke a property; input saved to {}",
                path.display()
            );
        }
    }
}
