//! `gguftool plan` through the binary: it reads only headers (a full-size GLM-5 stand-in whose
//! tensor data is a hole on disk answers at once), per-GPU weights shrink with the split and
//! equal the bytes a TP load holds, the fit/refusal exits are 0/1 with the documented messages,
//! and a split that does not divide is an error (exit 2).

use gguf::writer::{array_of, Layout};
use gguf::{GgmlType, Metadata, TensorInfo, Value, ValueType};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn plan(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A GLM-5-shaped GGUF (spec §2.3: 78 trunk layers, 3 dense, 1 MTP block; the quant mix of
/// shared/docs/bench-models.md) whose tensor data is never written: a sparse file of the full
/// size (~400 GB apparent, a few KB on disk).
fn glm5_header_only(path: &Path) {
    let (d, ff, heads, q_lora, kv_lora, nope, rope, v_head) =
        (6144u64, 12288, 64, 2048, 512, 192, 64, 256);
    let (experts, used, eff, ih, idim, vocab) = (256u64, 8u64, 2048u64, 32u64, 128u64, 154880u64);
    let (n_layer, blocks) = (78u64, 79u64);
    let a = "glm-dsa";
    let mut m = Metadata::new(path);
    let u = |v: u64| Value::U32(v as u32);
    m.set("general.architecture", Value::String(a.into()));
    for (k, v) in [
        ("block_count", u(blocks)),
        ("context_length", u(202752)),
        ("embedding_length", u(d)),
        ("feed_forward_length", u(ff)),
        ("attention.head_count", u(heads)),
        ("attention.head_count_kv", u(1)),
        ("rope.freq_base", Value::F32(1e6)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("expert_used_count", u(used)),
        ("expert_group_count", u(1)),
        ("expert_group_used_count", u(1)),
        ("expert_gating_func", u(2)),
        ("attention.key_length", u(kv_lora + rope)),
        ("attention.value_length", u(kv_lora)),
        ("leading_dense_block_count", u(3)),
        ("vocab_size", u(vocab)),
        ("attention.q_lora_rank", u(q_lora)),
        ("attention.kv_lora_rank", u(kv_lora)),
        ("attention.key_length_mla", u(nope + rope)),
        ("attention.value_length_mla", u(v_head)),
        ("expert_feed_forward_length", u(eff)),
        ("expert_count", u(experts)),
        ("expert_shared_count", u(1)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_weights_norm", Value::Bool(true)),
        ("rope.dimension_count", u(rope)),
        ("nextn_predict_layers", u(1)),
        ("attention.indexer.head_count", u(ih)),
        ("attention.indexer.key_length", u(idim)),
        ("attention.indexer.top_k", u(2048)),
    ] {
        m.set(&format!("{a}.{k}"), v);
    }
    m.set(
        &format!("{a}.attention.indexer.types"),
        array_of(ValueType::Bool, vec![Value::Bool(true); n_layer as usize]),
    );
    use GgmlType::*;
    let mut ts = Vec::new();
    let mut t = |name: String, dims: &[u64], ty: GgmlType| {
        ts.push(TensorInfo {
            name,
            dims: dims.to_vec(),
            ty,
            offset: 0,
        })
    };
    t("token_embd.weight".into(), &[d, vocab], Q4_K);
    t("output_norm.weight".into(), &[d], F32);
    t("output.weight".into(), &[d, vocab], Q6_K);
    for l in 0..blocks {
        let b = |s: &str| format!("blk.{l}.{s}");
        t(b("attn_norm.weight"), &[d], F32);
        t(b("attn_q_a.weight"), &[d, q_lora], Q4_K);
        t(b("attn_q_a_norm.weight"), &[q_lora], F32);
        t(b("attn_q_b.weight"), &[q_lora, heads * (nope + rope)], Q4_K);
        t(b("attn_kv_a_mqa.weight"), &[d, kv_lora + rope], Q4_K);
        t(b("attn_kv_a_norm.weight"), &[kv_lora], F32);
        t(b("attn_k_b.weight"), &[nope, kv_lora, heads], Q8_0);
        t(b("attn_v_b.weight"), &[kv_lora, v_head, heads], Q4_K);
        t(b("attn_output.weight"), &[heads * v_head, d], Q4_K);
        t(b("ffn_norm.weight"), &[d], F32);
        t(b("indexer.k_norm.weight"), &[idim], F32);
        t(b("indexer.k_norm.bias"), &[idim], F32);
        t(b("indexer.proj.weight"), &[d, ih], F32);
        t(b("indexer.attn_k.weight"), &[d, idim], Q4_K);
        t(b("indexer.attn_q_b.weight"), &[q_lora, ih * idim], Q4_K);
        if l < 3 {
            t(b("ffn_gate.weight"), &[d, ff], Q4_K);
            t(b("ffn_up.weight"), &[d, ff], Q4_K);
            t(b("ffn_down.weight"), &[ff, d], Q6_K);
        } else {
            t(b("ffn_gate_inp.weight"), &[d, experts], F32);
            t(b("exp_probs_b.bias"), &[experts], F32);
            t(b("ffn_gate_exps.weight"), &[d, eff, experts], Q4_K);
            t(b("ffn_up_exps.weight"), &[d, eff, experts], Q4_K);
            t(b("ffn_down_exps.weight"), &[eff, d, experts], Q4_K);
            t(b("ffn_gate_shexp.weight"), &[d, eff], Q4_K);
            t(b("ffn_up_shexp.weight"), &[d, eff], Q4_K);
            t(b("ffn_down_shexp.weight"), &[eff, d], Q6_K);
        }
        if l == n_layer {
            t(b("nextn.eh_proj.weight"), &[2 * d, d], Q4_K);
            t(b("nextn.enorm.weight"), &[d], F32);
            t(b("nextn.hnorm.weight"), &[d], F32);
            t(b("nextn.shared_head_norm.weight"), &[d], F32);
        }
    }
    let layout = Layout::new(3, &m, ts).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    let mut header = Vec::new();
    layout.write_header(&mut header).unwrap();
    f.write_all(&header).unwrap();
    f.set_len(layout.file_size()).unwrap();
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[test]
fn glm5_plan_from_headers_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("glm5-header-only.gguf");
    glm5_header_only(&path);
    let p = path.to_str().unwrap();
    let t0 = std::time::Instant::now();
    let (rc, out, err) = plan(&[p, "--tp", "8", "--gpu-mem", "96G", "--json"]);
    println!("{out}");
    assert_eq!(rc, 0, "{err}");
    let v = json(&out);
    assert!(t0.elapsed().as_secs() < 60);
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    // Every GPU holds an eighth of the split tensors and all of the replicated ones.
    let w: Vec<u64> = gpus
        .iter()
        .map(|g| g["weight_bytes"].as_u64().unwrap())
        .collect();
    assert!(w.windows(2).all(|p| p[0] == p[1]), "{w:?}");
    let file = std::fs::metadata(&path).unwrap().len();
    assert!(
        w[0] > file / 8 && w[0] < file / 8 + file / 20,
        "{} of {file}",
        w[0]
    );
    // Real GLM-5 never cuts a block at TP <= 8.
    assert!(gpus
        .iter()
        .all(|g| g["reencoded_f32"].as_array().unwrap().is_empty()));
    // MLA latent + rope key (576) and indexer key (128) per trunk layer, f32: replicated.
    assert_eq!(v["kv_bytes_per_token"].as_u64(), Some(78 * (576 + 128) * 4));
    assert!(v["context_capacity_tokens"].as_u64().unwrap() > 32768);
    let (rc, table, _) = plan(&[
        p,
        "--tp",
        "8",
        "--gpu-mem",
        "96G",
        "--ctx",
        "32768",
        "--parallel",
        "4",
    ]);
    println!("{table}");
    assert_eq!(rc, 0, "{table}");
    // One GPU cannot hold it; the tool names the smallest split that does.
    let (rc, out, _) = plan(&[p, "--tp", "1", "--gpu-mem", "96G"]);
    assert_eq!(rc, 1);
    assert!(out.contains("needs 8 GPUs (--tp 8)"), "{out}");
}

#[test]
fn fixture_fits_and_refusals() {
    let q8 = fx("gguf/tiny-glm5-Q8_0.gguf");
    let q8 = q8.to_str().unwrap();
    let (rc, out, err) = plan(&[q8, "--tp", "2", "--gpu-mem", "8G", "--json"]);
    assert_eq!(rc, 0, "{err}");
    let v = json(&out);
    let one = json(&plan(&[q8, "--tp", "1", "--gpu-mem", "8G", "--json"]).1);
    let (w1, w2) = (
        one["weight_bytes"].as_u64().unwrap(),
        v["weight_bytes"].as_u64().unwrap(),
    );
    assert!(w2 < w1 && w2 > w1 / 2, "TP 2 {w2} vs TP 1 {w1}");
    assert_eq!(v["gpus_needed"].as_u64(), Some(1));
    let (rc, out, _) = plan(&[q8, "--tp", "1", "--gpu-mem", "1M"]);
    assert_eq!(rc, 1);
    assert!(out.contains("fits at no TP size"), "{out}");
    let (rc, _, err) = plan(&[q8, "--tp", "8"]);
    assert_eq!(rc, 2);
    assert!(err.contains("4 attention heads"), "{err}");
    // A Q4_K split inside its 256-element blocks shows the F32 cost.
    let q4 = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let (rc, out, _) = plan(&[q4.to_str().unwrap(), "--tp", "2", "--gpu-mem", "8G"]);
    assert_eq!(rc, 0);
    assert!(out.contains("held as exact F32 values"), "{out}");
}
