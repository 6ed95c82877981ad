//! Hyper-parameter values outside what the math allows are refused at load with the key named
//! (issue 14 item 8): a zero RoPE base or a non-positive RMS epsilon used to load and print NaN.

use gguf::{Metadata, Value};
use runtime::spec::ModelSpec;

fn metadata() -> Metadata {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gguf/tiny-glm5-Q4_K_M.gguf"
    );
    gguf::Model::open(p).unwrap().metadata().clone()
}

fn refused(key: &str, v: Value) -> String {
    let mut md = metadata();
    md.set(key, v);
    ModelSpec::from_metadata(&md)
        .err()
        .unwrap_or_else(|| panic!("{key} accepted"))
        .to_string()
}

#[test]
fn the_fixture_values_are_accepted() {
    ModelSpec::from_metadata(&metadata()).unwrap();
}

#[test]
fn rope_base_must_exceed_one() {
    for v in [0.0, -10000.0, 1.0, 0.5, f32::NAN, f32::INFINITY] {
        let e = refused("glm-dsa.rope.freq_base", Value::F32(v));
        assert!(e.contains("glm-dsa.rope.freq_base"), "{v}: {e}");
    }
}

#[test]
fn rms_epsilon_must_be_a_small_positive_number() {
    // 1e-39 is subnormal in f32; 1e-50 rounds to 0.
    for v in [0.0, -1e-5, 1e-39, 2.0, f32::NAN] {
        let e = refused("glm-dsa.attention.layer_norm_rms_epsilon", Value::F32(v));
        assert!(e.contains("layer_norm_rms_epsilon"), "{v}: {e}");
    }
    let e = refused(
        "glm-dsa.attention.layer_norm_rms_epsilon",
        Value::F64(1e-50),
    );
    assert!(e.contains("layer_norm_rms_epsilon"), "{e}");
}

#[test]
fn expert_scale_must_be_positive() {
    for v in [0.0, -2.5] {
        let e = refused("glm-dsa.expert_weights_scale", Value::F32(v));
        assert!(e.contains("expert_weights_scale"), "{v}: {e}");
    }
}
