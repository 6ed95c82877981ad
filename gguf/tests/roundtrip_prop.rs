//! Property: any metadata (all 13 value types, empty and nested arrays, unicode, NaN payloads)
//! and any tensors (every ggml type, valid shapes, any bytes, alignment 8/32/64) written by
//! `gguf::writer` are the bytes the spec (§4.1-4.3) prescribes, read back bit-exactly by every
//! reader, and rewritten to identical bytes.
//!
//! The expected file is encoded independently by `encode` below from the spec's layout, so the
//! writer is checked against the format, not only against the reader.

use gguf::{Array, GgmlType, GgufFile, Header, Metadata, TensorInfo, Value, ValueType};
use proptest::prelude::*;
use proptest::sample::{select, Index};

/// Arrays nest this deep at most (top-level array = 1); the reader accepts more
/// (`gguf::reader::MAX_ARRAY_DEPTH`), gguf-py writes nested arrays, llama.cpp writes none.
const NEST: usize = 3;

const SCALARS: [ValueType; 12] = [
    ValueType::U8,
    ValueType::I8,
    ValueType::U16,
    ValueType::I16,
    ValueType::U32,
    ValueType::I32,
    ValueType::F32,
    ValueType::Bool,
    ValueType::String,
    ValueType::U64,
    ValueType::I64,
    ValueType::F64,
];

fn value_types(depth: usize) -> Vec<ValueType> {
    let mut v = SCALARS.to_vec();
    if depth < NEST {
        v.push(ValueType::Array);
    }
    v
}

fn text() -> BoxedStrategy<String> {
    // Printable unicode of any plane, and arbitrary chars (controls, NUL) now and then.
    prop_oneof![3 => "\\PC{0,12}", 1 => any::<String>()].boxed()
}

/// A value of type `ty` at nesting level `depth` (1 for a top-level array).
fn value_of(ty: ValueType, depth: usize) -> BoxedStrategy<Value> {
    match ty {
        ValueType::U8 => any::<u8>().prop_map(Value::U8).boxed(),
        ValueType::I8 => any::<i8>().prop_map(Value::I8).boxed(),
        ValueType::U16 => any::<u16>().prop_map(Value::U16).boxed(),
        ValueType::I16 => any::<i16>().prop_map(Value::I16).boxed(),
        ValueType::U32 => any::<u32>().prop_map(Value::U32).boxed(),
        ValueType::I32 => any::<i32>().prop_map(Value::I32).boxed(),
        // From raw bits, so NaNs with payloads, infinities and subnormals all occur.
        ValueType::F32 => any::<u32>()
            .prop_map(|b| Value::F32(f32::from_bits(b)))
            .boxed(),
        ValueType::F64 => any::<u64>()
            .prop_map(|b| Value::F64(f64::from_bits(b)))
            .boxed(),
        ValueType::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        ValueType::String => text().prop_map(Value::String).boxed(),
        ValueType::U64 => any::<u64>().prop_map(Value::U64).boxed(),
        ValueType::I64 => any::<i64>().prop_map(Value::I64).boxed(),
        ValueType::Array => (select(value_types(depth + 1)), 0usize..5)
            .prop_flat_map(move |(elem_type, n)| {
                prop::collection::vec(value_of(elem_type, depth + 1), n)
                    .prop_map(move |values| Value::Array(Array { elem_type, values }))
            })
            .boxed(),
    }
}

fn any_value() -> BoxedStrategy<Value> {
    select(value_types(0))
        .prop_flat_map(|t| value_of(t, 0))
        .boxed()
}

/// Unique non-empty keys in random order, and maybe `general.alignment` somewhere among them.
fn metadata() -> impl Strategy<Value = (Vec<(String, Value)>, u64)> {
    (
        prop::collection::vec(("\\PC{1,16}", any_value()), 0..10),
        select(vec![None, Some(8u32), Some(32), Some(64)]),
        any::<Index>(),
    )
        .prop_map(|(raw, alignment, at)| {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for (k, v) in raw {
                if k != "general.alignment" && entries.iter().all(|(e, _)| *e != k) {
                    entries.push((k, v));
                }
            }
            if let Some(a) = alignment {
                let i = at.index(entries.len() + 1);
                entries.insert(i, ("general.alignment".into(), Value::U32(a)));
            }
            (entries, alignment.map_or(32, u64::from))
        })
}

struct Tensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

impl std::fmt::Debug for Tensor {
    // The data is noise from a seed: its length says enough in a failure report.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} {} {:?} ({} bytes)",
            self.name,
            self.ty,
            self.dims,
            self.data.len()
        )
    }
}

/// Byte size from the spec's formula: `ne0 / block * type_size * ne1 * ne2 * ne3`.
fn nbytes(ty: GgmlType, dims: &[u64]) -> u64 {
    dims[0] / ty.block_size() as u64 * ty.type_size() as u64 * dims[1..].iter().product::<u64>()
}

fn fill(n: u64, mut seed: u64) -> Vec<u8> {
    // splitmix64: cheap varied bytes without generating megabytes through proptest.
    (0..n)
        .map(|_| {
            seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

fn tensors() -> impl Strategy<Value = Vec<Tensor>> {
    // Mostly 1-3 per dimension, sometimes 0 (an empty tensor is legal and occupies nothing).
    let dim = prop_oneof![1 => Just(0u64), 8 => 1u64..=3];
    prop::collection::vec(
        (
            select(GgmlType::ALL.to_vec()),
            1usize..=4,
            prop::collection::vec(dim, 4),
            "\\PC{0,8}",
            any::<u64>(),
        ),
        0..6,
    )
    .prop_map(|specs| {
        specs
            .into_iter()
            .enumerate()
            .map(|(i, (ty, n_dims, mut dims, suffix, seed))| {
                dims.truncate(n_dims);
                dims[0] *= ty.block_size() as u64;
                // Index prefix keeps names unique; at most 4 + 8 * 4 bytes, under the 63 cap.
                let name = format!("t{i}.{suffix}");
                let data = fill(nbytes(ty, &dims), seed);
                Tensor {
                    name,
                    ty,
                    dims,
                    data,
                }
            })
            .collect()
    })
}

// ---------------------------------------------------------------------------------------------
// Independent encoder (spec §4.1-4.3).

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::Bool(b) => out.push(*b as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => {
            let elem_id = match a.elem_type {
                ValueType::U8 => 0u32,
                ValueType::I8 => 1,
                ValueType::U16 => 2,
                ValueType::I16 => 3,
                ValueType::U32 => 4,
                ValueType::I32 => 5,
                ValueType::F32 => 6,
                ValueType::Bool => 7,
                ValueType::String => 8,
                ValueType::Array => 9,
                ValueType::U64 => 10,
                ValueType::I64 => 11,
                ValueType::F64 => 12,
            };
            out.extend_from_slice(&elem_id.to_le_bytes());
            out.extend_from_slice(&(a.values.len() as u64).to_le_bytes());
            for e in &a.values {
                put_value(out, e);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
    }
}

fn pad(out: &mut Vec<u8>, align: u64) {
    let len = (out.len() as u64).div_ceil(align) * align;
    out.resize(len as usize, 0);
}

/// The whole file: header, infos with canonical offsets, padding, padded data. Returns the bytes,
/// the data section's offset and each tensor's offset within it.
fn encode(entries: &[(String, Value)], tensors: &[Tensor], align: u64) -> (Vec<u8>, u64, Vec<u64>) {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (k, v) in entries {
        put_str(&mut out, k);
        out.extend_from_slice(&type_id(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offsets = Vec::new();
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset += (t.data.len() as u64).div_ceil(align) * align;
    }
    // Spec §4.1 puts the padding after the infos whether or not any data follows.
    pad(&mut out, align);
    let data_offset = out.len() as u64;
    for t in tensors {
        out.extend_from_slice(&t.data);
        pad(&mut out, align);
    }
    (out, data_offset, offsets)
}

// ---------------------------------------------------------------------------------------------

fn check_header(
    h: &Header,
    entries: &[(String, Value)],
    tensors: &[Tensor],
    align: u64,
    data_offset: u64,
    offsets: &[u64],
) -> Result<(), TestCaseError> {
    prop_assert_eq!(h.version, 3);
    prop_assert_eq!(h.alignment, align);
    prop_assert_eq!(h.data_offset, data_offset);
    prop_assert_eq!(h.metadata.len(), entries.len());
    for ((gk, gv), (wk, wv)) in h.metadata.iter().zip(entries) {
        prop_assert_eq!(gk, wk.as_str());
        prop_assert!(gv.bit_eq(wv), "{}: read {:?}, wrote {:?}", wk, gv, wv);
    }
    prop_assert_eq!(h.tensors.len(), tensors.len());
    for ((got, want), &off) in h.tensors.iter().zip(tensors).zip(offsets) {
        let expect = TensorInfo {
            name: want.name.clone(),
            dims: want.dims.clone(),
            ty: want.ty,
            offset: off,
        };
        prop_assert_eq!(got, &expect);
        prop_assert_eq!(got.n_bytes(), want.data.len() as u64);
    }
    prop_assert!(h.layout_findings().is_empty());
    Ok(())
}

proptest! {
    // CI has 2 cores: a moderate number of cases, each writing one temp file.
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn write_read_write((entries, align) in metadata(), tensors in tensors()) {
        let (expected, data_offset, offsets) = encode(&entries, &tensors, align);
        let metadata = Metadata::from_entries("prop.gguf", entries.clone());
        let specs: Vec<(&str, &[u64], GgmlType, &[u8])> = tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dims.as_slice(), t.ty, t.data.as_slice()))
            .collect();
        let bytes = gguf::writer::build(&metadata, &specs).unwrap();
        prop_assert!(bytes == expected, "writer output differs from the spec encoding");

        // Every reader reads the same thing back.
        let h = Header::parse_slice(&bytes, "prop.gguf").unwrap();
        check_header(&h, &entries, &tensors, align, data_offset, &offsets)?;
        h.check_data_layout(bytes.len() as u64).unwrap();
        let streamed = Header::parse_reader(std::io::Cursor::new(&bytes), None, "prop.gguf").unwrap();
        check_header(&streamed, &entries, &tensors, align, data_offset, &offsets)?;

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prop.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let f = GgufFile::open(&path).unwrap();
        check_header(f.header(), &entries, &tensors, align, data_offset, &offsets)?;
        for (info, t) in f.tensors().iter().zip(&tensors) {
            prop_assert!(f.tensor_data(info) == &t.data[..], "{} data differs", t.name);
        }

        // read -> write gives the same bytes.
        let layout = f.header().layout().unwrap();
        prop_assert_eq!(layout.file_size(), bytes.len() as u64);
        let mut again = Vec::new();
        gguf::writer::write_file(&mut again, &layout, |i| f.tensor_data(&f.tensors()[i])).unwrap();
        prop_assert!(again == bytes, "rewrite differs");
    }
}

#[test]
fn writer_refuses_impossible_shapes() {
    // Hand-built tensor infos are input too: sizes that overflow or misfit the block must be
    // errors, not panics.
    let md = Metadata::new("w.gguf");
    let cases: [(&[u64], GgmlType); 4] = [
        (&[4, u64::MAX], GgmlType::F32),
        (&[u64::MAX], GgmlType::F32),
        (&[100], GgmlType::Q4_K),
        (&[256, 1 << 62, 4], GgmlType::Q6_K),
    ];
    for (dims, ty) in cases {
        let r = gguf::writer::build(&md, &[("t", dims, ty, &[])]);
        assert!(
            matches!(r, Err(gguf::Error::Write(_))),
            "{dims:?} {ty}: {r:?}"
        );
    }
    // Offsets kept from a header never checked against its file.
    let t = TensorInfo {
        name: "t".into(),
        dims: vec![8],
        ty: GgmlType::F32,
        offset: !31, // the largest multiple of 32
    };
    let r = gguf::writer::Layout::with_offsets(3, &md, vec![t]);
    assert!(matches!(r, Err(gguf::Error::Write(_))));
}
