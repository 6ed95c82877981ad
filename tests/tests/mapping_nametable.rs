//! The glm-dsa table against the name table recorded from llama.cpp's converter while it converted
//! the tiny-glm5 fixture (tests/fixtures/nametable-tiny-glm5.json): both directions, every name.

use mappings::{map_gguf_names, map_hf_names, table, GgufName, Kind};
use serde_json::Value;
use std::collections::BTreeMap;

fn load(rel: &str) -> Option<Value> {
    let p = gguftool_tests::fixture(rel);
    Some(serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
}

/// hf_name -> [(gguf name, ne)] from the recorded table.
fn recorded(nt: &Value) -> BTreeMap<String, Vec<(String, Vec<u64>)>> {
    nt["hf_to_gguf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let g = e["gguf"]
                .as_array()
                .unwrap()
                .iter()
                .map(|g| {
                    let ne = g["ne"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_u64().unwrap());
                    (g["name"].as_str().unwrap().to_string(), ne.collect())
                })
                .collect();
            (e["hf_name"].as_str().unwrap().to_string(), g)
        })
        .collect()
}

#[test]
fn hf_to_gguf_equals_the_converter_per_name() {
    let Some(nt) = load("nametable-tiny-glm5.json") else {
        return;
    };
    let t = table("glm-dsa").unwrap();
    let rec = recorded(&nt);
    assert_eq!(rec.len(), 135);
    for (hf, gguf) in &rec {
        let hit = t.match_hf(hf).unwrap_or_else(|| panic!("{hf} unmapped"));
        let want: Vec<&str> = gguf.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(hit.entry.gguf_names(hit.idx.bid), want, "{hf}");
    }
}

#[test]
fn gguf_to_hf_equals_the_converter_per_name() {
    let Some(nt) = load("nametable-tiny-glm5.json") else {
        return;
    };
    let t = table("glm-dsa").unwrap();
    let rec = nt["gguf_to_hf"].as_object().unwrap();
    assert_eq!(rec.len(), 94);
    // The GGUF side as a loader sees it: names with their ne (expert count = ne[2]).
    let ne: BTreeMap<String, Vec<u64>> = recorded(&nt).into_values().flatten().collect();
    let tensors: Vec<GgufName> = rec
        .keys()
        .map(|n| GgufName {
            name: n,
            dims: ne.get(n).map(Vec::as_slice),
        })
        .collect();
    let map = map_gguf_names(t, &tensors, None);
    assert!(map.unmapped.is_empty(), "{:?}", map.unmapped);
    assert!(map.notes.is_empty(), "{:?}", map.notes);
    for (g, hf) in rec {
        let want: Vec<&str> = hf
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let row = map
            .rows
            .iter()
            .find(|r| r.gguf.iter().any(|x| x == g))
            .unwrap_or_else(|| panic!("{g} has no row"));
        assert_eq!(row.hf, want, "{g}");
    }
}

#[test]
fn both_directions_give_the_same_rows_as_the_converter() {
    let Some(nt) = load("nametable-tiny-glm5.json") else {
        return;
    };
    let Some(index) = load("hf/model.safetensors.index.json") else {
        return;
    };
    let t = table("glm-dsa").unwrap();
    let rec = recorded(&nt);
    // converter rows: GGUF name tuple -> HF names
    let mut want: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
    for (hf, g) in &rec {
        want.entry(g.iter().map(|(n, _)| n.clone()).collect())
            .or_default()
            .push(hf.clone());
    }
    for v in want.values_mut() {
        v.sort();
    }

    // HF side: exactly the names in the checkpoint index (what `map` reads from an HF directory)
    let names: Vec<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(names.len(), 135);
    let h2g = map_hf_names(t, &names);
    assert!(h2g.unmapped.is_empty(), "{:?}", h2g.unmapped);
    assert!(h2g.notes.is_empty(), "{:?}", h2g.notes);

    let ne: BTreeMap<String, Vec<u64>> = rec.values().flatten().cloned().collect();
    let tensors: Vec<GgufName> = ne
        .iter()
        .map(|(n, d)| GgufName {
            name: n,
            dims: Some(d),
        })
        .collect();
    let g2h = map_gguf_names(t, &tensors, None);

    for map in [&h2g, &g2h] {
        let mut got: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
        for r in &map.rows {
            let mut hf = r.hf.clone();
            hf.sort();
            assert!(
                got.insert(r.gguf.clone(), hf).is_none(),
                "duplicate row {:?}",
                r.gguf
            );
        }
        assert_eq!(got, want, "{:?}", map.direction);
    }
    let kinds = |k: Kind| h2g.rows.iter().filter(|r| r.kind == k).count();
    assert_eq!(kinds(Kind::KvB), 4);
    assert_eq!(kinds(Kind::Experts), 9);
}

#[test]
fn every_fixture_gguf_maps_to_the_converters_rows() {
    let Some(nt) = load("nametable-tiny-glm5.json") else {
        return;
    };
    let t = table("glm-dsa").unwrap();
    let mut want: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
    for (hf, g) in recorded(&nt) {
        want.entry(g.into_iter().map(|(n, _)| n).collect())
            .or_default()
            .push(hf);
    }
    for f in [
        "gguf/tiny-glm5-BF16.gguf",
        "gguf/tiny-glm5-Q8_0.gguf",
        "gguf/tiny-glm5-Q6_K.gguf",
        "gguf/tiny-glm5-Q4_K_M.gguf",
        "gguf/split/tiny-glm5-Q4_K_M-00003-of-00003.gguf",
    ] {
        let p = gguftool_tests::fixture(f);
        let m = gguf::Model::open(p).unwrap();
        let g = GgufName::of_model(&m);
        let map = map_gguf_names(t, &g, None);
        assert!(
            map.unmapped.is_empty() && map.notes.is_empty(),
            "{f}: {map:?}"
        );
        let got: BTreeMap<Vec<String>, Vec<String>> =
            map.rows.into_iter().map(|r| (r.gguf, r.hf)).collect();
        assert_eq!(got, want, "{f}");
    }
}
