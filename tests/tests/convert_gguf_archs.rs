//! HF -> GGUF for the architectures other than glm-dsa, on small checkpoints written by a
//! generator here (llama with llama3 rope scaling, qwen2 with biases and tied embeddings, qwen3
//! with q/k norms, gemma3 with a SentencePiece tokenizer.model, glm4moe with experts and an MTP
//! block, deepseek2 (DeepSeek-V3 recipe: MLA, experts, MTP layer dropped)). Checked structurally:
//! the output passes the architecture's mapping-table check (names, shapes, required keys),
//! carries the converter's metadata for the recipe, and its tensors hold the generated values
//! (through the converter's transforms). `GGUFTOOL_KEEP_CHECKPOINTS=DIR` keeps the checkpoints
//! so tests/dev/compare_archs_with_llamacpp.sh can run llama.cpp's converter on the same files.

use mappings::import::{self, ImportOptions, OutType};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const H: u64 = 64;
const FF: u64 = 128;
const VOCAB: u64 = 2048;

/// Deterministic pseudo-random bf16 values in about [-0.5, 0.5) (xorshift), never NaN.
fn values(seed: u64, n: usize) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let x = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            (x.to_bits() >> 16) as u16
        })
        .collect()
}

struct Ck {
    dir: PathBuf,
    tensors: Vec<(String, Vec<u64>)>,
}

impl Ck {
    fn t(&mut self, name: &str, shape: &[u64]) {
        self.tensors.push((name.to_string(), shape.to_vec()));
    }

    /// Writes the tensors (bf16) into two shards with an index, plus config and tokenizer.
    fn write(&self, config: Value, spm: bool) {
        let qwen = config["model_type"]
            .as_str()
            .is_some_and(|m| m.starts_with("qwen"));
        std::fs::create_dir_all(&self.dir).unwrap();
        let half = self.tensors.len() / 2;
        let mut weight_map = serde_json::Map::new();
        for (i, part) in [&self.tensors[..half], &self.tensors[half..]]
            .iter()
            .enumerate()
        {
            let file = format!("model-{:05}-of-00002.safetensors", i + 1);
            let data: Vec<(String, Vec<u8>, Vec<usize>)> = part
                .iter()
                .map(|(n, s)| {
                    let count: u64 = s.iter().product();
                    let v = values(n.len() as u64 * 31 + count, count as usize);
                    let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    weight_map.insert(n.clone(), json!(file));
                    (n.clone(), b, s.iter().map(|d| *d as usize).collect())
                })
                .collect();
            let views: Vec<(String, safetensors::tensor::TensorView)> = data
                .iter()
                .map(|(n, b, s)| {
                    (
                        n.clone(),
                        safetensors::tensor::TensorView::new(
                            safetensors::Dtype::BF16,
                            s.clone(),
                            b,
                        )
                        .unwrap(),
                    )
                })
                .collect();
            safetensors::serialize_to_file(views, None, &self.dir.join(&file)).unwrap();
        }
        let w = |name: &str, v: &Value| {
            std::fs::write(
                self.dir.join(name),
                serde_json::to_string_pretty(v).unwrap(),
            )
            .unwrap()
        };
        w(
            "model.safetensors.index.json",
            &json!({"metadata": {}, "weight_map": weight_map}),
        );
        w("config.json", &config);
        let fx = gguftool_tests::fixtures_dir().join("hf");
        if spm {
            let mut pieces = vec![
                piece("<pad>", 0.0, 3),
                piece("<eos>", 0.0, 3),
                piece("<bos>", 0.0, 3),
                piece("<unk>", 0.0, 2),
            ];
            for i in 0..256 {
                pieces.push(piece(&format!("<0x{i:02X}>"), 0.0, 6));
            }
            for i in pieces.len()..VOCAB as usize {
                pieces.push(piece(&format!("\u{2581}w{i}"), -(i as f32), 1));
            }
            let b = mappings::import::spm::encode_model(&pieces);
            std::fs::write(self.dir.join("tokenizer.model"), b).unwrap();
            w(
                "tokenizer_config.json",
                &json!({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                        "add_bos_token": true, "add_eos_token": false, "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}),
            );
        } else {
            for f in [
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
            ] {
                std::fs::copy(fx.join(f), self.dir.join(f)).unwrap();
            }
            if qwen {
                // Qwen2's split regex: digits one by one
                let p = self.dir.join("tokenizer.json");
                let t = std::fs::read_to_string(&p).unwrap();
                std::fs::write(&p, t.replace(r"\\p{N}{1,3}", r"\\p{N}")).unwrap();
            }
        }
    }
}

fn piece(p: &str, score: f32, kind: u64) -> mappings::import::spm::Piece {
    mappings::import::spm::Piece {
        piece: p.to_string(),
        score,
        kind,
    }
}

fn base(arch: &str, model_type: &str, layers: u64) -> Value {
    json!({
        "architectures": [arch], "model_type": model_type, "hidden_size": H, "intermediate_size": FF,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": layers,
        "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    })
}

fn attn(c: &mut Ck, l: u64, bias: bool, qk_norm: bool) {
    let p = format!("model.layers.{l}.self_attn");
    c.t(&format!("{p}.q_proj.weight"), &[64, H]);
    c.t(&format!("{p}.k_proj.weight"), &[32, H]);
    c.t(&format!("{p}.v_proj.weight"), &[32, H]);
    c.t(&format!("{p}.o_proj.weight"), &[H, 64]);
    if bias {
        c.t(&format!("{p}.q_proj.bias"), &[64]);
        c.t(&format!("{p}.k_proj.bias"), &[32]);
        c.t(&format!("{p}.v_proj.bias"), &[32]);
    }
    if qk_norm {
        c.t(&format!("{p}.q_norm.weight"), &[16]);
        c.t(&format!("{p}.k_norm.weight"), &[16]);
    }
}

fn mlp(c: &mut Ck, p: &str, ff: u64) {
    c.t(&format!("{p}.gate_proj.weight"), &[ff, H]);
    c.t(&format!("{p}.up_proj.weight"), &[ff, H]);
    c.t(&format!("{p}.down_proj.weight"), &[H, ff]);
}

fn globals(c: &mut Ck, lm_head: bool) {
    c.t("model.embed_tokens.weight", &[VOCAB, H]);
    c.t("model.norm.weight", &[H]);
    if lm_head {
        c.t("lm_head.weight", &[VOCAB, H]);
    }
}

/// (name, config, spm) for every generated checkpoint.
fn checkpoints(root: &Path) -> Vec<(Ck, Value, bool)> {
    let mut out = vec![];
    let mk = |n: &str| Ck {
        dir: root.join(n),
        tensors: vec![],
    };

    let mut c = mk("tiny-llama");
    globals(&mut c, true);
    for l in 0..2 {
        c.t(&format!("model.layers.{l}.input_layernorm.weight"), &[H]);
        c.t(
            &format!("model.layers.{l}.post_attention_layernorm.weight"),
            &[H],
        );
        attn(&mut c, l, false, false);
        mlp(&mut c, &format!("model.layers.{l}.mlp"), FF);
    }
    let mut cfg = base("LlamaForCausalLM", "llama", 2);
    cfg["rope_theta"] = json!(500000.0);
    cfg["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 128});
    out.push((c, cfg, false));

    for (name, class, mt, bias, norm, tied) in [
        ("tiny-qwen2", "Qwen2ForCausalLM", "qwen2", true, false, true),
        (
            "tiny-qwen3",
            "Qwen3ForCausalLM",
            "qwen3",
            false,
            true,
            false,
        ),
    ] {
        let mut c = mk(name);
        globals(&mut c, !tied);
        for l in 0..2 {
            c.t(&format!("model.layers.{l}.input_layernorm.weight"), &[H]);
            c.t(
                &format!("model.layers.{l}.post_attention_layernorm.weight"),
                &[H],
            );
            attn(&mut c, l, bias, norm);
            mlp(&mut c, &format!("model.layers.{l}.mlp"), FF);
        }
        let mut cfg = base(class, mt, 2);
        cfg["tie_word_embeddings"] = json!(tied);
        cfg["rope_theta"] = json!(1000000.0);
        if mt == "qwen3" {
            cfg["head_dim"] = json!(16);
        }
        out.push((c, cfg, false));
    }

    let mut c = mk("tiny-gemma3");
    globals(&mut c, false);
    for l in 0..2 {
        for n in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            c.t(&format!("model.layers.{l}.{n}.weight"), &[H]);
        }
        attn(&mut c, l, false, true);
        mlp(&mut c, &format!("model.layers.{l}.mlp"), FF);
    }
    let mut cfg = base("Gemma3ForCausalLM", "gemma3_text", 2);
    for (k, v) in [
        ("head_dim", json!(16)),
        ("sliding_window", json!(64)),
        ("rope_theta", json!(1000000.0)),
        ("rope_local_base_freq", json!(10000.0)),
        ("query_pre_attn_scalar", json!(16)),
        ("tie_word_embeddings", json!(true)),
        ("bos_token_id", json!(2)),
        ("eos_token_id", json!(1)),
        ("pad_token_id", json!(0)),
    ] {
        cfg[k] = v;
    }
    out.push((c, cfg, true));

    // glm4moe: layer 0 dense, layer 1 MoE (4 experts), layer 2 the MTP block
    let mut c = mk("tiny-glm4moe");
    globals(&mut c, true);
    for l in 0..3 {
        c.t(&format!("model.layers.{l}.input_layernorm.weight"), &[H]);
        c.t(
            &format!("model.layers.{l}.post_attention_layernorm.weight"),
            &[H],
        );
        attn(&mut c, l, true, false);
        if l == 0 {
            mlp(&mut c, "model.layers.0.mlp", FF);
        } else {
            c.t(&format!("model.layers.{l}.mlp.gate.weight"), &[4, H]);
            c.t(
                &format!("model.layers.{l}.mlp.gate.e_score_correction_bias"),
                &[4],
            );
            for x in 0..4 {
                mlp(&mut c, &format!("model.layers.{l}.mlp.experts.{x}"), 32);
            }
            mlp(&mut c, &format!("model.layers.{l}.mlp.shared_experts"), 32);
        }
    }
    c.t("model.layers.2.eh_proj.weight", &[H, 2 * H]);
    c.t("model.layers.2.enorm.weight", &[H]);
    c.t("model.layers.2.hnorm.weight", &[H]);
    c.t("model.layers.2.shared_head.norm.weight", &[H]);
    let mut cfg = base("Glm4MoeForCausalLM", "glm4_moe", 2);
    for (k, v) in [
        ("head_dim", json!(16)),
        ("partial_rotary_factor", json!(0.5)),
        ("n_routed_experts", json!(4)),
        ("num_experts_per_tok", json!(2)),
        ("n_shared_experts", json!(1)),
        ("moe_intermediate_size", json!(32)),
        ("first_k_dense_replace", json!(1)),
        ("num_nextn_predict_layers", json!(1)),
        ("attention_bias", json!(true)),
        ("routed_scaling_factor", json!(2.5)),
        ("norm_topk_prob", json!(true)),
        ("n_group", json!(1)),
        ("topk_group", json!(1)),
    ] {
        cfg[k] = v;
    }
    out.push((c, cfg, false));

    // DeepSeek-V3 recipe: MLA with q_lora, layer 0 dense, layer 1 MoE, layer 2 MTP (dropped)
    let mut c = mk("tiny-deepseek3");
    globals(&mut c, true);
    for l in 0..3 {
        let p = format!("model.layers.{l}");
        c.t(&format!("{p}.input_layernorm.weight"), &[H]);
        c.t(&format!("{p}.post_attention_layernorm.weight"), &[H]);
        c.t(&format!("{p}.self_attn.q_a_proj.weight"), &[32, H]);
        c.t(&format!("{p}.self_attn.q_a_layernorm.weight"), &[32]);
        c.t(&format!("{p}.self_attn.q_b_proj.weight"), &[4 * 48, 32]);
        c.t(
            &format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
            &[32 + 16, H],
        );
        c.t(&format!("{p}.self_attn.kv_a_layernorm.weight"), &[32]);
        c.t(
            &format!("{p}.self_attn.kv_b_proj.weight"),
            &[4 * (32 + 32), 32],
        );
        c.t(&format!("{p}.self_attn.o_proj.weight"), &[H, 4 * 32]);
        if l == 0 {
            mlp(&mut c, &format!("{p}.mlp"), FF);
        } else {
            c.t(&format!("{p}.mlp.gate.weight"), &[4, H]);
            c.t(&format!("{p}.mlp.gate.e_score_correction_bias"), &[4]);
            for x in 0..4 {
                mlp(&mut c, &format!("{p}.mlp.experts.{x}"), 32);
            }
            mlp(&mut c, &format!("{p}.mlp.shared_experts"), 32);
        }
    }
    let mut cfg = base("DeepseekV3ForCausalLM", "deepseek_v3", 2);
    for (k, v) in [
        ("num_key_value_heads", json!(4)),
        ("q_lora_rank", json!(32)),
        ("kv_lora_rank", json!(32)),
        ("qk_nope_head_dim", json!(32)),
        ("qk_rope_head_dim", json!(16)),
        ("v_head_dim", json!(32)),
        ("n_routed_experts", json!(4)),
        ("num_experts_per_tok", json!(2)),
        ("n_shared_experts", json!(1)),
        ("moe_intermediate_size", json!(32)),
        ("first_k_dense_replace", json!(1)),
        ("n_group", json!(2)),
        ("topk_group", json!(1)),
        ("num_nextn_predict_layers", json!(1)),
        ("scoring_func", json!("sigmoid")),
        ("rope_theta", json!(10000.0)),
    ] {
        cfg[k] = v;
    }
    out.push((c, cfg, false));
    out
}

fn meta_u64(m: &gguf::Model, k: &str) -> Option<u64> {
    m.metadata().get(k).and_then(|v| v.as_u64())
}

fn bf16_vals(m: &gguf::Model, name: &str) -> Vec<f32> {
    let t = m.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
    gguf::quant::dequantize_to_vec(t.info.ty, m.data(&t)).unwrap()
}

#[test]
fn every_table_architecture_converts_with_the_converters_rules() {
    let keep = std::env::var_os("GGUFTOOL_KEEP_CHECKPOINTS").map(PathBuf::from);
    let tmp = tempfile::tempdir().unwrap();
    let root = keep.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let mut archs = vec![];
    for (ck, cfg, spm) in checkpoints(&root) {
        ck.write(cfg.clone(), spm);
        let o = ImportOptions {
            outtype: OutType::Bf16,
            ..ImportOptions::default()
        };
        let plan =
            import::plan(&ck.dir, &o).unwrap_or_else(|e| panic!("{}: {e}", ck.dir.display()));
        let out = ck.dir.with_extension("gguf");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&out).unwrap());
        plan.write_shard(0, &mut f, &mut |_| true).unwrap();
        drop(f);
        let m = gguf::Model::open(&out).unwrap();
        let arch = m.architecture().unwrap().to_string();
        let report = mappings::check_architecture(&m).unwrap();
        assert!(report.is_ok(), "{arch}: {report:?}");
        let name = ck.dir.file_name().unwrap().to_string_lossy().to_string();
        let k = |s: &str| format!("{arch}.{s}");
        // general.* from the directory name, tensor types by the converter's rules
        let title = mappings::import::naming::id_to_title(&name);
        assert_eq!(
            m.metadata().get("general.name").and_then(|v| v.as_str()),
            Some(title.as_str())
        );
        for t in m.tensors() {
            let n = &t.info.name;
            let want_f32 = t.info.dims.len() == 1
                || n.ends_with("_norm.weight")
                || n.contains("ffn_gate_inp")
                || !n.ends_with(".weight");
            assert_eq!(
                t.info.ty == gguf::GgmlType::F32,
                want_f32,
                "{arch} {n}: {:?}",
                t.info.ty
            );
        }
        assert_eq!(meta_u64(&m, "general.file_type"), Some(32));
        let src = |n: &str| -> Vec<f32> {
            let (_, s) = ck.tensors.iter().find(|(x, _)| x == n).unwrap();
            let count: u64 = s.iter().product();
            values(n.len() as u64 * 31 + count, count as usize)
                .iter()
                .map(|b| f32::from_bits(u32::from(*b) << 16))
                .collect()
        };
        match arch.as_str() {
            "llama" => {
                assert_eq!(meta_u64(&m, &k("rope.dimension_count")), Some(16));
                assert_eq!(meta_u64(&m, &k("vocab_size")), Some(VOCAB));
                assert_eq!(
                    m.metadata()
                        .get("tokenizer.ggml.pre")
                        .and_then(|v| v.as_str()),
                    Some("llama-bpe")
                );
                // llama3 rope scaling: rope_freqs first, factors between 1 and `factor`
                let rf = bf16_vals(&m, "rope_freqs.weight");
                assert_eq!(m.tensors().next().unwrap().info.name, "rope_freqs.weight");
                assert_eq!(rf.len(), 8);
                assert!(
                    rf.iter().all(|f| (1.0..=8.0).contains(f)) && rf[0] == 1.0 && rf[7] == 8.0,
                    "{rf:?}"
                );
                // q rows permuted from rotate-half to interleaved per head
                let q = bf16_vals(&m, "blk.0.attn_q.weight");
                let hf = src("model.layers.0.self_attn.q_proj.weight");
                let (rows, cols, heads) = (64, 64, 4);
                let half = rows / heads / 2;
                for r in 0..rows {
                    let (h, rest) = (r / (2 * half), r % (2 * half));
                    let from = h * 2 * half + (rest % 2) * half + rest / 2;
                    assert_eq!(
                        q[r * cols..(r + 1) * cols],
                        hf[from * cols..(from + 1) * cols],
                        "row {r}"
                    );
                }
            }
            "qwen2" => {
                assert!(
                    m.tensor("output.weight").is_none(),
                    "tied: no output tensor"
                );
                assert_eq!(
                    bf16_vals(&m, "blk.1.attn_q.bias"),
                    src("model.layers.1.self_attn.q_proj.bias")
                );
            }
            "qwen3" => {
                assert_eq!(meta_u64(&m, &k("attention.key_length")), Some(16));
                assert!(m.tensor("blk.1.attn_k_norm.weight").is_some());
                assert_eq!(
                    m.metadata()
                        .get("tokenizer.ggml.pre")
                        .and_then(|v| v.as_str()),
                    Some("qwen2")
                );
            }
            "gemma3" => {
                assert_eq!(
                    m.metadata()
                        .get("tokenizer.ggml.model")
                        .and_then(|v| v.as_str()),
                    Some("llama")
                );
                assert_eq!(
                    m.metadata()
                        .get("tokenizer.ggml.add_space_prefix")
                        .and_then(|v| v.as_bool()),
                    Some(false)
                );
                assert_eq!(meta_u64(&m, &k("attention.sliding_window")), Some(64));
                assert_eq!(meta_u64(&m, "tokenizer.ggml.bos_token_id"), Some(2));
                // norms stored as w + 1
                let w = src("model.layers.0.input_layernorm.weight");
                let g = bf16_vals(&m, "blk.0.attn_norm.weight");
                assert!(w.iter().zip(&g).all(|(a, b)| *b == a + 1.0));
            }
            "glm4moe" => {
                assert_eq!(meta_u64(&m, &k("block_count")), Some(3));
                assert_eq!(meta_u64(&m, &k("nextn_predict_layers")), Some(1));
                assert_eq!(meta_u64(&m, &k("rope.dimension_count")), Some(8));
                assert_eq!(meta_u64(&m, &k("expert_gating_func")), Some(2));
                let e = bf16_vals(&m, "blk.1.ffn_up_exps.weight");
                let x2 = src("model.layers.1.mlp.experts.2.up_proj.weight");
                assert_eq!(e[2 * x2.len()..3 * x2.len()], x2[..]);
                assert!(m.tensor("blk.2.nextn.eh_proj.weight").is_some());
            }
            "deepseek2" => {
                assert_eq!(
                    meta_u64(&m, &k("block_count")),
                    Some(2),
                    "MTP layer dropped"
                );
                assert!(m.tensors().all(|t| !t.info.name.starts_with("blk.2.")));
                assert_eq!(meta_u64(&m, &k("attention.head_count_kv")), Some(1));
                assert_eq!(meta_u64(&m, &k("attention.key_length")), Some(48));
                assert_eq!(meta_u64(&m, &k("expert_gating_func")), Some(2));
                let kb = bf16_vals(&m, "blk.0.attn_k_b.weight");
                let w = src("model.layers.0.self_attn.kv_b_proj.weight");
                let d = mappings::kvb::MlaDims {
                    n_head: 4,
                    qk_nope: 32,
                    v_head: 32,
                    kv_lora: 32,
                };
                assert_eq!(kb, mappings::kvb::split(&w, d).unwrap().0);
            }
            other => panic!("unexpected arch {other}"),
        }
        archs.push(arch);
    }
    archs.sort();
    let mut want: Vec<String> = mappings::architectures()
        .into_iter()
        .filter(|a| *a != "glm-dsa")
        .map(String::from)
        .collect();
    want.sort();
    assert_eq!(
        archs, want,
        "one generated checkpoint per table architecture"
    );
}
