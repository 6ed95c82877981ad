//! The llama and gemma3 tables against real third-party GGUFs (llama.cpp conversions published on
//! PyPI, see tests/fixtures/UPSTREAM-README.md "Real third-party GGUF files"). They are too large
//! for the repository: set GGUFTOOL_THIRDPARTY_DIR to a folder holding
//! SmolLM2-135M-Instruct.Q4_1.gguf and gemma-3-270m-q4_k_m.gguf; otherwise the tests skip.

use mappings::{check_architecture, map_gguf_names, GgufName};
use std::path::PathBuf;

fn file(name: &str, test: &str) -> Option<PathBuf> {
    let p = std::env::var_os("GGUFTOOL_THIRDPARTY_DIR").map(|d| PathBuf::from(d).join(name));
    match p {
        Some(p) if p.exists() => Some(p),
        _ => {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("skipped: {test}: {name} (set GGUFTOOL_THIRDPARTY_DIR)\n").as_bytes(),
            );
            None
        }
    }
}

/// (file, arch, tensor count from the fixtures README)
const FILES: [(&str, &str, usize); 2] = [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "llama", 272),
    ("gemma-3-270m-q4_k_m.gguf", "gemma3", 236),
];

#[test]
fn third_party_models_match_their_tables() {
    for (name, arch, n) in FILES {
        let Some(p) = file(name, "third_party_models_match_their_tables") else {
            continue;
        };
        let m = gguf::Model::open(&p).unwrap();
        assert_eq!(m.architecture(), Some(arch));
        let rep = check_architecture(&m).unwrap();
        assert!(rep.is_ok(), "{name}: {rep:#?}");
        assert_eq!(rep.checked_tensors, n);
        let t = mappings::table(arch).unwrap();
        let g = GgufName::of_model(&m);
        let map = map_gguf_names(t, &g, None);
        assert!(map.unmapped.is_empty(), "{name}: {:?}", map.unmapped);
        // both are tied-embedding models: one extra row says so
        assert_eq!(map.rows.len(), n + 1);
    }
}
