//! `gguftool synth`: write a model with the exact tensor layout and types of a preset and random
//! contents (finite scales), for benchmarks and tests on hardware where the real model is not
//! available. `--preset glm5` is the GLM-5-shaped layout of docs/BENCHMARKS.md (bench-models): the
//! same tensors and types llama.cpp was measured on. Every file carries complete byte-level BPE
//! tokenizer metadata (synthetic vocabulary, as many tokens as the output head has rows), so
//! llama.cpp and `gguftool generate` load it.

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
    /// Layout preset: `glm5-mini` (GLM-5 structure at small dimensions, ~10 MB), `glm5-tp8`
    /// (small, but every row-split dimension is whole 256-blocks at tensor parallelism 8, ~40 MB),
    /// `glm5` (the GLM-5-shaped bench layout: hidden 6144, 64 heads, 256 experts; ~18 GB at the
    /// default 4 layers) or `glm5-full` (all 78 layers, 3 dense, plus the MTP layer; ~400 GB,
    /// meant for `--sparse`).
    #[arg(long, default_value = "glm5-mini")]
    preset: String,
    /// Trunk layers (the preset's leading layers dense, the rest MoE); default: the preset's
    /// (4, or 3 for glm5-tp8, 78 for glm5-full).
    #[arg(long)]
    layers: Option<u32>,
    /// Seed of the random contents.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write only the header and leave the tensor data a hole on disk (a full-size file that
    /// occupies almost no space: for `plan` and loaders that only read metadata).
    #[arg(long)]
    sparse: bool,
    /// Output GGUF file (written as OUTPUT.partial, renamed when complete).
    #[arg(short, long)]
    output: PathBuf,
    /// Replace OUTPUT if it exists.
    #[arg(long)]
    force: bool,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
    /// Print a JSON summary on stdout (implies --quiet).
    #[arg(long)]
    json: bool,
}

struct Dims {
    name: &'static str,
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
    /// Leading dense layers.
    dense: u32,
    default_layers: u32,
    /// One NextN (MTP) block after the trunk, as GLM-5 ships.
    mtp: bool,
}

const GLM5: Dims = Dims {
    name: "glm5",
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
    dense: 1,
    default_layers: 4,
    mtp: false,
};

const GLM5_FULL: Dims = Dims {
    name: "glm5-full",
    dense: 3,
    default_layers: 78,
    mtp: true,
    ..GLM5
};

const GLM5_MINI: Dims = Dims {
    name: "glm5-mini",
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
    dense: 1,
    default_layers: 4,
    mtp: false,
};

/// Every dimension a tensor-parallel split at TP 8 cuts along a row (the K side of attn_output,
/// ffn_down, ffn_down_exps, ffn_down_shexp) is a whole number of 256-blocks per rank:
/// heads * v_head = 2048, ffn = expert_ffn = 2048 (256 per rank); heads = 8 (one per rank).
const GLM5_TP8: Dims = Dims {
    name: "glm5-tp8",
    hidden: 512,
    ffn: 2048,
    heads: 8,
    q_lora: 256,
    kv_lora: 256,
    nope: 64,
    rope: 32,
    v_head: 256,
    experts: 8,
    used: 2,
    expert_ffn: 2048,
    idx_heads: 4,
    idx_dim: 64,
    idx_topk: 64,
    vocab: 4096,
    ctx: 4096,
    rope_base: 1e6,
    dense: 1,
    default_layers: 3,
    mtp: false,
};

const PRESETS: [&Dims; 4] = [&GLM5_MINI, &GLM5_TP8, &GLM5, &GLM5_FULL];

pub fn run(args: Args) -> Result<ExitCode> {
    util::install_interrupt_handler();
    let Some(d) = PRESETS.iter().find(|p| p.name == args.preset) else {
        bail!(
            "unknown preset {:?} ({})",
            args.preset,
            PRESETS.map(|p| p.name).join(", ")
        );
    };
    let layers = args.layers.unwrap_or(d.default_layers);
    if layers == 0 || layers > 200 {
        bail!("--layers must be 1..=200");
    }
    let quiet = args.quiet || args.json;
    let meta = glm_metadata(d, layers, &args.output);
    let tensors = glm_tensors(d, layers);
    let layout = Layout::new(3, &meta, tensors)?;
    let total = layout.file_size();
    if !args.sparse {
        if let Some(free) = util::free_space(&args.output) {
            if free < total {
                bail!(
                    "not enough free space: need {}, {} available (--sparse writes a hole)",
                    human_bytes(total),
                    human_bytes(free)
                );
            }
        }
    }
    let out = PartialFile::create(&args.output, args.force)?;
    let mut header = Vec::new();
    layout.write_header(&mut header)?;
    out.file.write_all_at(&header, 0)?;
    out.file.set_len(total)?;
    if !args.sparse {
        let pb = util::byte_progress(total, quiet, "synthesizing");
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
    }
    out.commit()?;
    if args.json {
        let doc = serde_json::json!({
            "output": args.output.display().to_string(),
            "preset": d.name,
            "layers": layers,
            "mtp_layers": u32::from(d.mtp),
            "bytes": total,
            "tensors": layout.tensors.len(),
            "vocab": d.vocab,
            "sparse": args.sparse,
            "seed": args.seed,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else if !quiet {
        eprintln!(
            "wrote {} ({}{}), {} tensors",
            args.output.display(),
            human_bytes(total),
            if args.sparse { ", sparse" } else { "" },
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
    let n_mtp = u64::from(d.mtp);
    let blocks = layers as u64 + n_mtp;
    m.set("general.architecture", Value::String(a.into()));
    m.set("general.type", Value::String("model".into()));
    m.set(
        "general.name",
        Value::String(format!(
            "synthetic GLM-5-shaped, preset {} (random weights)",
            d.name
        )),
    );
    let kv: Vec<(&str, Value)> = vec![
        ("block_count", u(blocks)),
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
        ("expert_gating_func", u(2)),
        ("attention.key_length", u(d.kv_lora + d.rope)),
        ("attention.value_length", u(d.kv_lora)),
        (
            "leading_dense_block_count",
            u(u64::from(d.dense.min(layers))),
        ),
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
        ("nextn_predict_layers", u(n_mtp)),
        ("attention.indexer.head_count", u(d.idx_heads)),
        ("attention.indexer.key_length", u(d.idx_dim)),
        ("attention.indexer.top_k", u(d.idx_topk)),
        (
            "attention.indexer.types",
            array_of(ValueType::Bool, vec![Value::Bool(true); blocks as usize]),
        ),
    ];
    for (k, v) in kv {
        m.set(&format!("{a}.{k}"), v);
    }
    m.set("general.quantization_version", Value::U32(2));
    m.set("general.file_type", Value::U32(15));
    for (k, v) in tokenizer_metadata(d.vocab as usize) {
        m.set(&k, v);
    }
    m
}

/// GLM's special tokens at their offsets from `<|endoftext|>` (id 154820 in the real vocabulary,
/// spec §7.3; the synthetic vocabulary keeps the real ids when it has the real size).
const SPECIALS: [(u64, &str); 12] = [
    (0, "<|endoftext|>"),
    (1, "[MASK]"),
    (2, "[gMASK]"),
    (3, "[sMASK]"),
    (4, "<sop>"),
    (5, "<eop>"),
    (6, "<|system|>"),
    (7, "<|user|>"),
    (8, "<|assistant|>"),
    (9, "<|observation|>"),
    (21, "<think>"),
    (22, "</think>"),
];
/// Ids reserved for special tokens at the end of the vocabulary (154880 - 154820).
const SPECIAL_SPAN: usize = 60;

/// GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to U+0100.. in order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 0x100u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                let c = char::from_u32(next).unwrap_or('?');
                next += 1;
                c
            }
        })
        .collect()
}

/// A synthetic byte-level BPE vocabulary of exactly `n` tokens: the 256 byte tokens, then merged
/// tokens (each the concatenation of a merge pair whose parts exist, so every merge is valid),
/// `[PAD{i}]` fillers and GLM's special tokens in the last [`SPECIAL_SPAN`] ids. Returns
/// (tokens, token types, merges).
fn synthetic_vocab(n: usize) -> (Vec<String>, Vec<i32>, Vec<String>) {
    const NORMAL: i32 = 1;
    const CONTROL: i32 = 3;
    const UNUSED: i32 = 5;
    let bytes = byte_chars();
    let mut tokens: Vec<String> = bytes.iter().map(|c| c.to_string()).collect();
    let mut types = vec![NORMAL; tokens.len()];
    let mut merges = Vec::new();
    let special0 = n.saturating_sub(SPECIAL_SPAN).max(tokens.len());
    // Merge parts: letters and digits, with and without GPT-2's space marker (U+0120 'Ġ').
    let mut units: Vec<String> = ('a'..='z').chain('0'..='9').map(String::from).collect();
    units.extend(('a'..='z').map(|c| format!("\u{120}{c}")));
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    // The spaced units are merges themselves (`Ġ` + letter), so every merge below has both
    // parts in the vocabulary.
    for u in &units {
        if tokens.len() >= special0 {
            break;
        }
        if seen.insert(u.clone()) {
            let mut c = u.chars();
            let first = c.next().map(String::from).unwrap_or_default();
            merges.push(format!("{first} {}", c.as_str()));
            tokens.push(u.clone());
            types.push(NORMAL);
        }
    }
    let mut frontier: Vec<String> = units.clone();
    // Breadth-first: unit+letter pairs, then (pair)+letter, ... until the span is filled.
    'fill: while tokens.len() < special0 {
        let mut next = Vec::new();
        for left in &frontier {
            for right in 'a'..='z' {
                if tokens.len() >= special0 {
                    break 'fill;
                }
                let r = right.to_string();
                let t = format!("{left}{r}");
                if seen.insert(t.clone()) {
                    merges.push(format!("{left} {r}"));
                    tokens.push(t.clone());
                    types.push(NORMAL);
                    next.push(t);
                }
            }
        }
        if next.is_empty() {
            break;
        }
        frontier = next;
    }
    while tokens.len() < n {
        let i = tokens.len();
        match SPECIALS
            .iter()
            .find(|(off, _)| special0 + *off as usize == i)
        {
            Some((_, s)) => {
                tokens.push(s.to_string());
                types.push(CONTROL);
            }
            None => {
                tokens.push(format!("[PAD{i}]"));
                types.push(UNUSED);
            }
        }
    }
    tokens.truncate(n);
    types.truncate(n);
    (tokens, types, merges)
}

/// The `tokenizer.ggml.*` keys llama.cpp needs to load a GLM-style byte-level BPE vocabulary
/// (spec §7.1): model, pre, tokens, token_type, merges and the special token ids.
fn tokenizer_metadata(n: usize) -> Vec<(String, Value)> {
    let (tokens, types, merges) = synthetic_vocab(n);
    let special0 = (n.saturating_sub(SPECIAL_SPAN)) as u64;
    let id = |off: u64| Value::U32((special0 + off) as u32);
    let strs = |v: Vec<String>| {
        array_of(
            ValueType::String,
            v.into_iter().map(Value::String).collect(),
        )
    };
    let p = |k: &str| format!("tokenizer.ggml.{k}");
    vec![
        (p("model"), Value::String("gpt2".into())),
        (p("pre"), Value::String("glm4".into())),
        (p("tokens"), strs(tokens)),
        (
            p("token_type"),
            array_of(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        ),
        (p("merges"), strs(merges)),
        (p("bos_token_id"), id(2)),
        (p("eos_token_id"), id(0)),
        (p("padding_token_id"), id(0)),
        (p("eot_token_id"), id(7)),
        (p("unknown_token_id"), id(0)),
        (p("eom_token_id"), id(9)),
    ]
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
    let blocks = layers + u32::from(d.mtp);
    for l in 0..blocks {
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
        if l < d.dense.min(layers) {
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
        if l >= layers {
            // The NextN block: projection of [embedding; hidden] and its norms (spec §2.3).
            t(b("nextn.eh_proj.weight"), &[2 * d.hidden, d.hidden], Q8_0);
            t(b("nextn.enorm.weight"), &[d.hidden], F32);
            t(b("nextn.hnorm.weight"), &[d.hidden], F32);
            t(b("nextn.shared_head_norm.weight"), &[d.hidden], F32);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_has_exact_size_unique_tokens_and_valid_merges() {
        for n in [4096usize, 154880] {
            let (tokens, types, merges) = synthetic_vocab(n);
            assert_eq!(tokens.len(), n);
            assert_eq!(types.len(), n);
            let set: std::collections::HashSet<&String> = tokens.iter().collect();
            assert_eq!(set.len(), n, "tokens are unique");
            assert!(!merges.is_empty());
            for m in &merges {
                let (l, r) = m.split_once(' ').expect("merge is a pair");
                assert!(
                    set.contains(&l.to_string()) && set.contains(&r.to_string()),
                    "{m}"
                );
                assert!(set.contains(&format!("{l}{r}")), "{m}");
            }
            // llama.cpp's BPE loader requires the byte token of '\n' (U+010A).
            assert!(set.contains(&"\u{10A}".to_string()));
            let eos = n - SPECIAL_SPAN;
            assert_eq!(tokens[eos], "<|endoftext|>");
            assert_eq!(types[eos], 3);
        }
        // The real GLM-5 vocabulary size keeps the real special ids (spec §7.3).
        let (tokens, _, _) = synthetic_vocab(154880);
        assert_eq!(tokens[154820], "<|endoftext|>");
        assert_eq!(tokens[154822], "[gMASK]");
        assert_eq!(tokens[154841], "<think>");
    }

    #[test]
    fn tp8_preset_row_splits_are_whole_blocks() {
        let d = &GLM5_TP8;
        for k in [d.heads * d.v_head, d.ffn, d.expert_ffn] {
            assert!(
                k.is_multiple_of(8 * 256),
                "{k} per rank is not whole 256-blocks"
            );
        }
        assert!(d.heads.is_multiple_of(8));
    }
}
