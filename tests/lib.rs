//! Cross-crate integration tests for gguftool. This library only locates fixture files: every
//! fixture a test reads lives in `tests/fixtures/` (copies of the public fixtures, same layout as
//! `shared/fixtures/tiny-glm5`), so a fresh clone runs every test. A missing fixture is a test
//! failure naming the file, never a skip.

use std::path::PathBuf;

/// `tests/fixtures` inside the repository.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A fixture by its path relative to `tests/fixtures`; panics (fails the test) when absent.
pub fn fixture(rel: &str) -> PathBuf {
    let p = fixtures_dir().join(rel);
    assert!(
        p.exists(),
        "fixture {rel} is missing from {}: the repository must carry every fixture a test reads",
        fixtures_dir().display()
    );
    p
}

/// Write a copy of the GGUF `src` to `dst` with `edit` applied to its metadata and `patch` to
/// each tensor's bytes (by name): how tests build broken models (a hostile chat template, NaN
/// weights, an out-of-range hyper-parameter) from a fixture.
pub fn rewrite_gguf(
    src: &std::path::Path,
    dst: &std::path::Path,
    edit: impl FnOnce(&mut gguf::Metadata),
    patch: impl Fn(&str, &mut Vec<u8>),
) {
    let m = gguf::GgufFile::open(src).unwrap();
    let mut meta = m.metadata().clone();
    edit(&mut meta);
    let tensors: Vec<(String, Vec<u64>, gguf::GgmlType, Vec<u8>)> = m
        .tensors()
        .iter()
        .map(|t| {
            let mut b = m.tensor_data(t).to_vec();
            patch(&t.name, &mut b);
            (t.name.clone(), t.dims.clone(), t.ty, b)
        })
        .collect();
    let refs: Vec<(&str, &[u64], gguf::GgmlType, &[u8])> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.as_slice(), *t, b.as_slice()))
        .collect();
    std::fs::write(dst, gguf::writer::build(&meta, &refs).unwrap()).unwrap();
}

/// Fill the first 4 KiB of a BF16 tensor with quiet NaNs (what the doctor acceptance check
/// does to `blk.1.attn_q_b.weight`).
pub fn nan_fill_bf16(bytes: &mut [u8]) {
    let n = bytes.len().min(4096);
    for pair in bytes[..n].chunks_exact_mut(2) {
        pair.copy_from_slice(&[0xc0, 0x7f]);
    }
}

/// The hostile chat template: 100,000 copies of 100 KB, 10 GB of output.
pub const HOSTILE_TEMPLATE: &str =
    "{% set s='x'*100000 %}{% for i in range(100000) %}{{s}}{% endfor %}";

/// The Q4_K_M fixture with [`HOSTILE_TEMPLATE`] as its chat template, written into `dir`.
pub fn hostile_template_model(dir: &std::path::Path) -> PathBuf {
    let out = dir.join("hostile-template.gguf");
    rewrite_gguf(
        &fixture("gguf/tiny-glm5-Q4_K_M.gguf"),
        &out,
        |meta| {
            meta.set(
                "tokenizer.chat_template",
                gguf::Value::String(HOSTILE_TEMPLATE.into()),
            )
        },
        |_, _| {},
    );
    out
}

/// The BF16 fixture with NaNs in `blk.1.attn_q_b.weight` ([`nan_fill_bf16`]), written into `dir`.
pub fn nan_weights_model(dir: &std::path::Path) -> PathBuf {
    let out = dir.join("nan-weights.gguf");
    rewrite_gguf(
        &fixture("gguf/tiny-glm5-BF16.gguf"),
        &out,
        |_| {},
        |name, b| {
            if name == "blk.1.attn_q_b.weight" {
                nan_fill_bf16(b);
            }
        },
    );
    out
}
