//! Layer-by-layer activations of the CPU forward pass on tiny-glm5-BF16.gguf against the ones
//! transformers 5.24 recorded (fp32 eager, forward hooks) for the same token ids.

mod forward_util;

use gguftool_tests::fixture_or_skip;
use runtime::glm::Activation;
use safetensors::SafeTensors;
use std::collections::HashMap;

#[derive(Debug)]
enum Got {
    F32(usize, usize, Vec<f32>),
    Idx(usize, usize, Vec<i64>),
}

fn run(rel: &str, test: &str) {
    let Some(path) = fixture_or_skip(rel, test) else { return };
    let Some(model_path) = fixture_or_skip("gguf/tiny-glm5-BF16.gguf", test) else { return };
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tok = st.tensor("token_ids").unwrap();
    let ids: Vec<u32> = tok
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let model = forward_util::load(&model_path);
    let mut got: HashMap<String, Got> = HashMap::new();
    let mut obs = |name: &str, a: Activation<'_>| {
        let g = match a {
            Activation::F32 { rows, cols, data } => Got::F32(rows, cols, data.to_vec()),
            Activation::Index { rows, cols, data } => Got::Idx(rows, cols, data.to_vec()),
        };
        got.insert(name.to_string(), g);
    };
    let mut seq = model.new_cache().unwrap();
    let mut b = [runtime::SeqStep { seq: &mut seq, tokens: &ids, all_logits: true }];
    model.forward_observed(&mut b, Some(&mut obs)).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    for name in names {
        if name == "token_ids" { continue; }
        let t = st.tensor(&name).unwrap();
        let g = got.get(&name).unwrap_or_else(|| panic!("activation {name} not observed"));
        match (t.dtype(), g) {
            (safetensors::Dtype::F32, Got::F32(r, c, d)) => {
                let want: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                assert_eq!(vec![*r, *c], t.shape(), "{name} shape");
                let mut max = 0f32; let mut scale = 0f32;
                for (a, b) in d.iter().zip(&want) { max = max.max((a - b).abs()); scale = scale.max(b.abs()); }
                println!("{name}: max abs diff {max:.3e} (max |ref| {scale:.3})");
            }
            (safetensors::Dtype::I64, Got::Idx(r, c, d)) => {
                let want: Vec<i64> = t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
                let shape = t.shape();
                let mut bad = 0;
                for i in 0..shape[0] {
                    let mut a: Vec<i64> = want[i * shape[1]..(i + 1) * shape[1]].iter().copied().filter(|&j| j >= 0).collect();
                    let mut b: Vec<i64> = d[i * c..(i + 1) * c].iter().copied().filter(|&j| j >= 0).collect();
                    if name.contains("indexer") { a.retain(|&j| j <= i as i64); b.retain(|&j| j <= i as i64); }
                    a.sort(); b.sort();
                    if a != b { bad += 1; if bad < 4 { println!("  {name} row {i}: got {b:?} want {a:?}"); } }
                }
                println!("{name}: {bad} of {} rows differ ({r}x{c})", shape[0]);
            }
            _ => panic!("{name}: type mismatch {g:?}"),
        }
    }
}

#[test]
fn activations_counting_match_transformers() {
    run("refs/activations-counting.safetensors", "activations_counting_match_transformers");
}

#[test]
fn activations_long_counting_match_transformers() {
    run("refs/activations-long_counting.safetensors", "activations_long_counting_match_transformers");
}
