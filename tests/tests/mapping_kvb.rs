//! kv_b_proj <-> attn_k_b + attn_v_b on the fixture: the converter's own GGUF tensors and the HF
//! original (read with the `safetensors` crate) are the ground truth on both sides.

use gguf::Model;
use mappings::kvb::{self, MlaDims};
use mappings::values;
use serde_json::Value;
use std::collections::BTreeMap;

/// HF kv_b_proj of every layer: name -> bf16 words.
fn hf_kv_b() -> Option<BTreeMap<u64, Vec<u16>>> {
    let mut out = BTreeMap::new();
    for shard in 1..=4 {
        let p = gguftool_tests::fixture(&format!("hf/model-0000{shard}-of-00004.safetensors"));
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            if let Some(l) = name
                .strip_prefix("model.layers.")
                .and_then(|r| r.strip_suffix(".self_attn.kv_b_proj.weight"))
            {
                assert_eq!(view.dtype(), safetensors::Dtype::BF16);
                out.insert(l.parse().unwrap(), values::u16_words(view.data()));
            }
        }
    }
    assert_eq!(out.len(), 4);
    Some(out)
}

fn gguf(name: &str) -> Option<Model> {
    let p = gguftool_tests::fixture(&format!("gguf/{name}"));
    Some(Model::open(p).unwrap())
}

fn dims(m: &Model, bid: u64) -> MlaDims {
    let k = m.tensor(&format!("blk.{bid}.attn_k_b.weight")).unwrap();
    let v = m.tensor(&format!("blk.{bid}.attn_v_b.weight")).unwrap();
    MlaDims::from_ne(&k.info.dims, &v.info.dims).unwrap()
}

#[test]
fn bf16_split_and_reassembly_are_the_converters_bit_for_bit() {
    let (Some(hf), Some(m)) = (hf_kv_b(), gguf("tiny-glm5-BF16.gguf")) else {
        return;
    };
    for (bid, w) in &hf {
        let d = dims(&m, *bid);
        // config.json: 4 heads, qk_nope 64, v_head 64, kv_lora 256
        assert_eq!(
            d,
            MlaDims {
                n_head: 4,
                qk_nope: 64,
                v_head: 64,
                kv_lora: 256
            }
        );
        let k = values::u16_words(
            m.tensor_data(&format!("blk.{bid}.attn_k_b.weight"))
                .unwrap(),
        );
        let v = values::u16_words(
            m.tensor_data(&format!("blk.{bid}.attn_v_b.weight"))
                .unwrap(),
        );
        // GGUF -> HF
        assert_eq!(&kvb::reassemble(&k, &v, d).unwrap(), w, "layer {bid}");
        // HF -> GGUF
        let (k2, v2) = kvb::split(w, d).unwrap();
        assert_eq!((k2, v2), (k.clone(), v.clone()), "layer {bid}");
        // TP: every rank's slice equals slicing the full tensor, straight from the GGUF slabs and
        // through the f32 path the CLI uses
        for tp in [1, 2, 4] {
            for r in 0..tp {
                let part =
                    kvb::reassemble_heads(&k, &v, d, kvb::tp_heads(4, tp, r).unwrap()).unwrap();
                assert_eq!(part, kvb::tp_slice(w, d, tp, r).unwrap());
                let (_, shape, f) = mappings::export::kv_b_f32(&m, *bid, Some((tp, r))).unwrap();
                assert_eq!(shape, [512 / tp, 256]);
                let want: Vec<f32> = part
                    .iter()
                    .map(|x| half::bf16::from_bits(*x).to_f32())
                    .collect();
                assert_eq!(f, want);
            }
        }
    }
}

fn stats(file: &str, tensor: &str) -> Option<Value> {
    let p = gguftool_tests::fixture("stats-tiny-glm5.json");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let f = s["files"].as_array()?.iter().find(|f| f["file"] == file)?;
    let t = f["tensors"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == tensor)?;
    Some(t["dequant_f32"].clone())
}

/// Worst-case |dequant - original| as a fraction of the tensor's max |w|, from each format's
/// step size: Q8_0 d = amax/127 (error d/2, plus f16 rounding of d); Q6_K 6-bit with 8-bit
/// sub-scales; Q5_0 d = amax/16; Q4_K asymmetric 4-bit over a range <= 2 amax with 6-bit
/// scales and mins. Each bound is about twice the step/2 estimate.
fn bound(ty: &str) -> f32 {
    match ty {
        "Q8_0" => 1.0 / 128.0,
        "Q6_K" => 1.0 / 32.0,
        "Q5_0" => 1.0 / 16.0,
        "Q4_K" => 1.0 / 8.0,
        other => panic!("no bound for {other}"),
    }
}

#[test]
fn quantized_reassembly_keeps_every_value_and_stays_near_the_original() {
    let Some(hf) = hf_kv_b() else { return };
    for file in [
        "tiny-glm5-Q8_0.gguf",
        "tiny-glm5-Q6_K.gguf",
        "tiny-glm5-Q4_K_M.gguf",
    ] {
        let Some(m) = gguf(file) else { return };
        for (bid, w) in &hf {
            let (_, shape, got) = mappings::export::kv_b_f32(&m, *bid, None).unwrap();
            assert_eq!(shape, [512, 256]);
            // A permutation keeps the multiset of dequantized values: min, max, sum and sum of
            // squares equal the union of gguf-py's attn_k_b and attn_v_b statistics.
            let (mut n, mut sum, mut sq) = (0f64, 0f64, 0f64);
            let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
            let mut types = vec![];
            for part in ["attn_k_b", "attn_v_b"] {
                let name = format!("blk.{bid}.{part}.weight");
                types.push(m.tensor(&name).unwrap().info.ty.name().to_string());
                let s = stats(file, &name).unwrap();
                let cnt = m.tensor(&name).unwrap().info.n_elements() as f64;
                n += cnt;
                sum += s["mean"].as_f64().unwrap() * cnt;
                sq += s["sum_sq"].as_f64().unwrap();
                lo = lo.min(s["min"].as_f64().unwrap());
                hi = hi.max(s["max"].as_f64().unwrap());
            }
            assert_eq!(n as usize, got.len());
            let gsum: f64 = got.iter().map(|x| f64::from(*x)).sum();
            let gsq: f64 = got.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
            let gmin = got.iter().fold(f32::INFINITY, |a, x| a.min(*x));
            let gmax = got.iter().fold(f32::NEG_INFINITY, |a, x| a.max(*x));
            // the JSON carries f32 extremes as f64 decimals, compare at f32 precision
            assert_eq!((gmin, gmax), (lo as f32, hi as f32), "{file} layer {bid}");
            // f64 summation error <= n * eps * sum|x|, and sum|x| <= sqrt(n * sum_sq)
            // (Cauchy-Schwarz); the JSON's mean adds one more rounding of the same size
            let tol = 2.0 * n * f64::EPSILON * (n * sq).sqrt();
            assert!(
                (gsum - sum).abs() <= tol,
                "{file} layer {bid}: sum {gsum} vs {sum}"
            );
            assert!(
                (gsq - sq).abs() <= 2.0 * n * f64::EPSILON * sq,
                "{file} layer {bid}: sum_sq {gsq} vs {sq}"
            );

            let orig: Vec<f32> = w
                .iter()
                .map(|x| half::bf16::from_bits(*x).to_f32())
                .collect();
            let amax = orig.iter().fold(0f32, |a, x| a.max(x.abs()));
            let err = orig
                .iter()
                .zip(&got)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            let b = types.iter().map(|t| bound(t)).fold(0f32, f32::max);
            assert!(
                err <= amax * b,
                "{file} layer {bid} ({types:?}): max |err| {err} > {}",
                amax * b
            );
            assert!(err > 0.0, "{file}: a quantized file cannot be exact");
        }
    }
}
