//! Reading the fixture GGUFs (made by llama.cpp's converter, quantizer and splitter) and writing
//! them back: tensor tables equal gguf-py's records, rewrites are byte-identical.

use gguf::{GgufFile, Model};
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn gguf_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures().join("gguf"))
        .unwrap()
        .chain(std::fs::read_dir(fixtures().join("gguf/split")).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    v.sort();
    assert!(v.len() >= 5, "fixture GGUFs missing: {v:?}");
    v
}

fn stats_ref() -> serde_json::Value {
    let s = std::fs::read_to_string(fixtures().join("stats-tiny-glm5.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

#[test]
fn tensor_tables_equal_gguf_py() {
    let stats = stats_ref();
    for path in gguf_files() {
        let name = path.file_name().unwrap().to_str().unwrap();
        let r = stats["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["file"] == name)
            .unwrap_or_else(|| panic!("{name} not in stats reference"));
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(
            f.version() as u64,
            r["gguf_version"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(f.alignment(), r["alignment"].as_u64().unwrap(), "{name}");
        assert_eq!(f.file_size(), r["size"].as_u64().unwrap(), "{name}");
        assert_eq!(
            f.data_offset(),
            r["tensor_data_offset"].as_u64().unwrap(),
            "{name}"
        );
        let rt = r["tensors"].as_array().unwrap();
        assert_eq!(f.tensors().len(), rt.len(), "{name}");
        for (t, e) in f.tensors().iter().zip(rt) {
            assert_eq!(t.name, e["name"].as_str().unwrap());
            assert_eq!(t.ty.name(), e["type"].as_str().unwrap().to_uppercase());
            let ne: Vec<u64> = e["ne"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(t.dims, ne, "{}", t.name);
            assert_eq!(t.n_elements(), e["n_elements"].as_u64().unwrap());
            assert_eq!(t.n_bytes(), e["n_bytes"].as_u64().unwrap());
            assert_eq!(
                f.data_offset() + t.offset,
                e["data_offset"].as_u64().unwrap()
            );
        }
        // Metadata: keys in file order, types and values as gguf-py read them.
        let rmeta = r["metadata"].as_object().unwrap();
        let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k).collect();
        let rkeys: Vec<&str> = rmeta.keys().map(String::as_str).collect();
        assert_eq!(keys, rkeys, "{name}");
        for (k, v) in f.metadata().iter() {
            check_value(name, k, v, &rmeta[k]);
        }
    }
}

#[test]
fn rewrite_is_byte_identical() {
    for path in gguf_files() {
        let f = GgufFile::open(&path).unwrap();
        let layout = f.header().layout().unwrap();
        let mut out = Vec::new();
        gguf::writer::write_file(&mut out, &layout, |i| f.tensor_data(&f.tensors()[i])).unwrap();
        let orig = std::fs::read(&path).unwrap();
        assert_eq!(out.len(), orig.len(), "{}", path.display());
        assert!(out == orig, "{} differs after rewrite", path.display());
    }
}

#[test]
fn streaming_reader_equals_mmap_reader() {
    for path in gguf_files() {
        let f = GgufFile::open(&path).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let len = file.metadata().unwrap().len();
        let h =
            gguf::Header::parse_reader(std::io::BufReader::new(file), Some(len), &path).unwrap();
        assert_eq!(&h, f.header());
        let h2 =
            gguf::Header::parse_reader(std::fs::File::open(&path).unwrap(), None, &path).unwrap();
        assert_eq!(&h2, f.header());
    }
}

#[test]
fn split_model_opens_from_any_shard() {
    let merged = GgufFile::open(fixtures().join("gguf/tiny-glm5-Q4_K_M.gguf")).unwrap();
    for k in 1..=3 {
        let p = fixtures().join(format!("gguf/split/tiny-glm5-Q4_K_M-0000{k}-of-00003.gguf"));
        let m = Model::open(&p).unwrap();
        assert_eq!(m.shards().len(), 3);
        assert_eq!(m.n_tensors(), merged.tensors().len());
        for (a, b) in m.tensors().zip(merged.tensors()) {
            assert_eq!(a.info.name, b.name);
            assert_eq!(m.data(&a), merged.tensor_data(b), "{}", b.name);
        }
        assert_eq!(m.architecture(), Some("glm-dsa"));
    }
}

/// Compare one metadata value with gguf-py's record (`{"type", "value"}`; arrays over 64 items
/// are recorded as their length, first 8 items and the sha256 of their JSON).
fn check_value(file: &str, key: &str, v: &gguf::Value, r: &serde_json::Value) {
    use gguf::Value as V;
    let rtype = r["type"].as_str().unwrap();
    match v {
        V::Array(a) => {
            assert_eq!(
                rtype,
                format!("array[{}]", a.elem_type.name()),
                "{file} {key}"
            );
            let json_items: Vec<serde_json::Value> = a.values.iter().map(to_json).collect();
            if let Some(items) = r["value"].as_array() {
                assert_eq!(&json_items, items, "{file} {key}");
            } else {
                let summary = &r["value"];
                assert_eq!(
                    a.len() as u64,
                    summary["len"].as_u64().unwrap(),
                    "{file} {key}"
                );
                let first = summary["first8"].as_array().unwrap();
                assert_eq!(&json_items[..first.len()], &first[..], "{file} {key}");
                // sha256 of Python's json.dumps(array, ensure_ascii=False): ", " separators.
                let items: Vec<String> = json_items
                    .iter()
                    .map(|j| serde_json::to_string(j).unwrap())
                    .collect();
                let text = format!("[{}]", items.join(", "));
                use sha2::Digest;
                let digest = sha2::Sha256::digest(text.as_bytes());
                let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
                assert_eq!(
                    hex,
                    summary["sha256_json"].as_str().unwrap(),
                    "{file} {key}"
                );
            }
        }
        other => {
            assert_eq!(other.value_type().name(), rtype, "{file} {key}");
            assert_eq!(to_json(other), r["value"], "{file} {key}");
        }
    }
}

fn to_json(v: &gguf::Value) -> serde_json::Value {
    use gguf::Value as V;
    match v {
        V::String(s) => s.clone().into(),
        V::Bool(b) => (*b).into(),
        V::F32(x) => serde_json::Value::from(*x as f64),
        V::F64(x) => serde_json::Value::from(*x),
        V::Array(a) => a.values.iter().map(to_json).collect::<Vec<_>>().into(),
        other => match other.as_i64() {
            Some(i) => i.into(),
            None => other.as_u64().unwrap().into(),
        },
    }
}
