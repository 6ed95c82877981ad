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
