//! `gguftool synth`: write a model with the exact tensor layout and types of a preset and random
//! contents (finite scales), for benchmarks on hardware where the real model is not available.
//! `--preset glm5` is the GLM-5-shaped layout of docs/BENCHMARKS.md (bench-models): the same
//! tensors and types llama.cpp was measured on.

use crate::util::{self, human_bytes, PartialFile};
use anyhow::{bail, Result};
use gguf::writer::{array_of, Layout};
use gguf::{GgmlType, Metadata, TensorInfo, Value, ValueType};
use rayon::prelude::*;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Layout preset: `glm5` (hidden 6144, 256 experts; ~7.4 GB for 2 layers) or `glm5-mini`
    /// (same structure, small dimensions; a few MB).
    #[arg(long, default_value = "glm5")]
    preset: String,
    /// Trunk layers (layer 0 dense, the rest MoE).
    #[arg(long, default_value_t = 4)]
    layers: u32,
    /// Seed of the random contents.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(short, long)]
    output: PathBuf,
    #[arg(long)]
    force: bool,
    #[arg(short, long)]
    quiet: bool,
}

struct Dims {
    hidden: u64,
    ffn: u64,
    heads: u64,
    q_lora: u64,
    kv_lora: u64,
    nope: u64,
    rope: u64,
    v_head: u64,
    experts: u64,
    used: u64,
    expert_ffn: u64,
    idx_heads: u64,
    idx_dim: u64,
    idx_topk: u64,
    vocab: u64,
    ctx: u64,
    rope_base: f32,
}

const GLM5: Dims = Dims {
    hidden: 6144,
    ffn: 12288,
    heads: 64,
    q_lora: 2048,
    kv_lora: 512,
    nope: 192,
    rope: 64,
    v_head: 256,
    experts: 256,
    used: 8,
    expert_ffn: 2048,
    idx_heads: 32,
    idx_dim: 128,
    idx_topk: 2048,
    vocab: 154880,
    ctx: 202752,
    rope_base: 1e6,
};

const GLM5_MINI: Dims = Dims {
    hidden: 512,
    ffn: 1024,
    heads: 8,
    q_lora: 256,
    kv_lora: 256,
    nope: 64,
    rope: 32,
    v_head: 64,
    experts: 16,
    used: 4,
    expert_ffn: 256,
    idx_heads: 4,
    idx_dim: 64,
    idx_topk: 64,
    vocab: 4096,
    ctx: 4096,
    rope_base: 1e6,
};

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let d = match args.preset.as_str() {
        "glm5" => &GLM5,
        "glm5-mini" => &GLM5_MINI,
        p => bail!("unknown preset {p:?} (glm5, glm5-mini)"),
    };
    if args.layers == 0 || args.layers > 200 {
        bail!("--layers must be 1..=200");
    }
    let meta = glm_metadata(d, args.layers, &args.output);
    let tensors = glm_tensors(d, args.layers);
    let layout = Layout::new(3, &meta, tensors)?;
    let total = layout.file_size();
    if let Some(free) = util::free_space(&args.output) {
        if free < total {
            bail!(
                "not enough free space: need {}, {} available",
                human_bytes(total),
                human_bytes(free)
            );
        }
    }
    let out = PartialFile::create(&args.output, args.force)?;
    let mut header = Vec::new();
    layout.write_header(&mut header)?;
    out.file.write_all_at(&header, 0)?;
    out.file.set_len(total)?;
    let pb = util::byte_progress(total, args.quiet, "synthesizing");
    const CHUNK_BLOCKS: u64 = 1 << 16;
    for (ti, t) in layout.tensors.iter().enumerate() {
        let bsz = t.ty.type_size() as u64;
        let n_blocks = t.n_bytes() / bsz;
        let mut b0 = 0;
        while b0 < n_blocks {
            util::check_interrupted()?;
            let nb = (n_blocks - b0).min(CHUNK_BLOCKS);
            let mut buf = vec![0u8; (nb * bsz) as usize];
            buf.par_chunks_mut(bsz as usize * 1024)
                .enumerate()
                .for_each(|(ci, c)| {
                    let seed = args.seed
                        ^ ((ti as u64) << 40)
                        ^ (b0 + ci as u64 * 1024).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    fill_blocks(t.ty, c, seed, &t.name);
                });
            out.file
                .write_all_at(&buf, layout.data_offset + t.offset + b0 * bsz)?;
            pb.inc(buf.len() as u64);
            b0 += nb;
        }
    }
    pb.finish_and_clear();
    out.commit()?;
    if !args.quiet {
        eprintln!(
            "wrote {} ({}), {} tensors",
            args.output.display(),
            human_bytes(total),
            layout.tensors.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Random value in [-a, a).
fn uniform(s: &mut u64, a: f32) -> f32 {
    ((xorshift(s) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
}

/// Byte offsets of the f16 scale fields of one block: random bits there could be Inf/NaN.
fn scale_fields(ty: GgmlType) -> Option<&'static [usize]> {
    use GgmlType::*;
    Some(match ty {
        Q4_K | Q5_K | Q2_K => &[0, 2],
        Q6_K => &[208],
        Q3_K => &[108],
        Q8_0 | Q4_0 | Q5_0 | IQ4_NL | IQ4_XS | Q4_1 | Q5_1 => &[0],
        _ => return None,
    })
}

fn fill_blocks(ty: GgmlType, buf: &mut [u8], seed: u64, name: &str) {
    let mut s = seed | 1;
    match ty {
        GgmlType::F32 => {
            // Norm weights near 1 like trained ones; other F32 tensors small.
            let (base, a) = if name.contains("norm.weight") {
                (1.0, 0.1)
            } else {
                (0.0, 0.05)
            };
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&(base + uniform(&mut s, a)).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32(uniform(&mut s, 0.05)).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(uniform(&mut s, 0.05)).to_le_bytes());
            }
        }
        ty => {
            for c in buf.chunks_mut(8) {
                let r = xorshift(&mut s).to_le_bytes();
                c.copy_from_slice(&r[..c.len()]);
            }
            if let Some(fields) = scale_fields(ty) {
                for block in buf.chunks_exact_mut(ty.type_size()) {
                    for &f in fields {
                        let scale = 1e-4 + (uniform(&mut s, 1.0).abs() * 2e-3);
                        block[f..f + 2].copy_from_slice(&half::f16::from_f32(scale).to_le_bytes());
                    }
                }
            }
        }
    }
}

fn glm_metadata(d: &Dims, layers: u32, path: &std::path::Path) -> Metadata {
    let mut m = Metadata::new(path);
    let a = "glm-dsa";
    let u = |v: u64| Value::U32(v as u32);
    m.set("general.architecture", Value::String(a.into()));
    m.set("general.type", Value::String("model".into()));
    m.set(
        "general.name",
        Value::String("synthetic GLM-5-shaped (random weights)".into()),
    );
    let kv: Vec<(&str, Value)> = vec![
        ("block_count", u(layers as u64)),
        ("context_length", u(d.ctx)),
        ("embedding_length", u(d.hidden)),
        ("feed_forward_length", u(d.ffn)),
        ("attention.head_count", u(d.heads)),
        ("attention.head_count_kv", u(1)),
        ("rope.freq_base", Value::F32(d.rope_base)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("expert_count", u(d.experts)),
        ("expert_used_count", u(d.used)),
        ("expert_group_count", u(1)),
        ("expert_group_used_count", u(1)),
        ("attention.key_length", u(d.kv_lora + d.rope)),
        ("attention.value_length", u(d.kv_lora)),
        ("leading_dense_block_count", u(1)),
        ("vocab_size", u(d.vocab)),
        ("attention.q_lora_rank", u(d.q_lora)),
        ("attention.kv_lora_rank", u(d.kv_lora)),
        ("attention.key_length_mla", u(d.nope + d.rope)),
        ("attention.value_length_mla", u(d.v_head)),
        ("expert_feed_forward_length", u(d.expert_ffn)),
        ("expert_shared_count", u(1)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_weights_norm", Value::Bool(true)),
        ("rope.dimension_count", u(d.rope)),
        ("nextn_predict_layers", u(0)),
        ("attention.indexer.head_count", u(d.idx_heads)),
        ("attention.indexer.key_length", u(d.idx_dim)),
        ("attention.indexer.top_k", u(d.idx_topk)),
        (
            "attention.indexer.types",
            array_of(ValueType::Bool, vec![Value::Bool(true); layers as usize]),
        ),
    ];
    for (k, v) in kv {
        m.set(&format!("{a}.{k}"), v);
    }
    m.set("general.quantization_version", Value::U32(2));
    m.set("general.file_type", Value::U32(15));
    m
}

fn glm_tensors(d: &Dims, layers: u32) -> Vec<TensorInfo> {
    use GgmlType::*;
    let mut v = Vec::new();
    let mut t = |name: String, dims: &[u64], ty: GgmlType| {
        v.push(TensorInfo {
            name,
            dims: dims.to_vec(),
            ty,
            offset: 0,
        })
    };
    t("output.weight".into(), &[d.hidden, d.vocab], Q6_K);
    t("output_norm.weight".into(), &[d.hidden], F32);
    t("token_embd.weight".into(), &[d.hidden, d.vocab], Q4_K);
    for l in 0..layers {
        let b = |s: &str| format!("blk.{l}.{s}");
        // attn_k_b rows are qk_nope long: 192 is no multiple of 256, so Q8_0 as llama-quantize does.
        let kb_ty = if d.nope.is_multiple_of(256) {
            Q4_K
        } else {
            Q8_0
        };
        t(b("attn_k_b.weight"), &[d.nope, d.kv_lora, d.heads], kb_ty);
        t(
            b("attn_kv_a_mqa.weight"),
            &[d.hidden, d.kv_lora + d.rope],
            Q4_K,
        );
        t(b("attn_kv_a_norm.weight"), &[d.kv_lora], F32);
        t(b("attn_norm.weight"), &[d.hidden], F32);
        t(
            b("attn_output.weight"),
            &[d.heads * d.v_head, d.hidden],
            Q4_K,
        );
        t(b("attn_q_a.weight"), &[d.hidden, d.q_lora], Q4_K);
        t(b("attn_q_a_norm.weight"), &[d.q_lora], F32);
        t(
            b("attn_q_b.weight"),
            &[d.q_lora, d.heads * (d.nope + d.rope)],
            Q4_K,
        );
        t(b("attn_v_b.weight"), &[d.kv_lora, d.v_head, d.heads], Q4_K);
        if l == 0 {
            t(b("ffn_down.weight"), &[d.ffn, d.hidden], Q6_K);
            t(b("ffn_gate.weight"), &[d.hidden, d.ffn], Q4_K);
            t(b("ffn_norm.weight"), &[d.hidden], F32);
            t(b("ffn_up.weight"), &[d.hidden, d.ffn], Q4_K);
        } else {
            t(b("exp_probs_b.bias"), &[d.experts], F32);
            t(
                b("ffn_down_exps.weight"),
                &[d.expert_ffn, d.hidden, d.experts],
                Q4_K,
            );
            t(b("ffn_down_shexp.weight"), &[d.expert_ffn, d.hidden], Q6_K);
            t(
                b("ffn_gate_exps.weight"),
                &[d.hidden, d.expert_ffn, d.experts],
                Q4_K,
            );
            t(b("ffn_gate_inp.weight"), &[d.hidden, d.experts], F32);
            t(b("ffn_gate_shexp.weight"), &[d.hidden, d.expert_ffn], Q4_K);
            t(b("ffn_norm.weight"), &[d.hidden], F32);
            t(
                b("ffn_up_exps.weight"),
                &[d.hidden, d.expert_ffn, d.experts],
                Q4_K,
            );
            t(b("ffn_up_shexp.weight"), &[d.hidden, d.expert_ffn], Q4_K);
        }
        t(b("indexer.attn_k.weight"), &[d.hidden, d.idx_dim], Q4_K);
        t(
            b("indexer.attn_q_b.weight"),
            &[d.q_lora, d.idx_heads * d.idx_dim],
            Q4_K,
        );
        t(b("indexer.k_norm.bias"), &[d.idx_dim], F32);
        t(b("indexer.k_norm.weight"), &[d.idx_dim], F32);
        t(b("indexer.proj.weight"), &[d.hidden, d.idx_heads], F32);
    }
    v
}
