//! Cross-crate integration tests for gguftool. This library only locates fixture files:
//! the copies in `tests/fixtures/` travel with the repo; larger ones are looked up in
//! `../shared/fixtures/tiny-glm5` beside the checkout and reported as skipped when absent.

use std::path::PathBuf;

/// `tests/fixtures` inside the repository.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A fixture by its path relative to `tests/fixtures` (same layout as `shared/fixtures/tiny-glm5`).
/// Falls back to the shared folder beside the checkout; `None` when neither has it.
pub fn fixture(rel: &str) -> Option<PathBuf> {
    let local = fixtures_dir().join(rel);
    if local.exists() {
        return Some(local);
    }
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/fixtures/tiny-glm5")
        .join(rel);
    shared.exists().then_some(shared)
}

/// Like [`fixture`], but prints a visible skip line when the file is absent (straight to stderr:
/// libtest captures `println!`, and a skip must show in the CI log).
pub fn fixture_or_skip(rel: &str, test: &str) -> Option<PathBuf> {
    let f = fixture(rel);
    if f.is_none() {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            format!(
                "skipped: {test}: fixture {rel} not in tests/fixtures nor ../shared/fixtures\n"
            )
            .as_bytes(),
        );
    }
    f
}
