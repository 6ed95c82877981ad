//! The kernel sources: one op per `.cu` file under `kernels/cuda/`, embedded in the binary.
//!
//! NVRTC compiles `prelude.cuh` + the op's headers + the op's file as one translation unit
//! (NVRTC 13.0 has no include path to the CUDA headers, so nothing is `#include`d).

/// Shared prelude of every module: integer typedefs, f16/bf16 conversions, reductions.
const PRELUDE: &str = include_str!("../cuda/prelude.cuh");
/// The ggml block decoders, shared by the ops that read quantized weights.
const QUANT: &str = include_str!("../cuda/quant.cuh");

/// One compiled module = one op file. Modules are compiled lazily, once per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Dequant,
    Gemv,
    RmsNorm,
    LayerNorm,
    Rope,
    Attention,
    IndexerScores,
    TopK,
    MoeRouter,
    MoeCombine,
    SiluMul,
    Elementwise,
    Argmax,
    AllReduce,
}

impl Op {
    /// Every op, for the compile check.
    pub const ALL: [Op; 14] = [
        Op::Dequant,
        Op::Gemv,
        Op::RmsNorm,
        Op::LayerNorm,
        Op::Rope,
        Op::Attention,
        Op::IndexerScores,
        Op::TopK,
        Op::MoeRouter,
        Op::MoeCombine,
        Op::SiluMul,
        Op::Elementwise,
        Op::Argmax,
        Op::AllReduce,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Dequant => "dequant",
            Op::Gemv => "gemv",
            Op::RmsNorm => "rmsnorm",
            Op::LayerNorm => "layernorm",
            Op::Rope => "rope",
            Op::Attention => "attention",
            Op::IndexerScores => "indexer_scores",
            Op::TopK => "topk",
            Op::MoeRouter => "moe_router",
            Op::MoeCombine => "moe_combine",
            Op::SiluMul => "silu_mul",
            Op::Elementwise => "elementwise",
            Op::Argmax => "argmax",
            Op::AllReduce => "allreduce",
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            Op::Dequant => "dequant.cu",
            Op::Gemv => "gemv.cu",
            Op::RmsNorm => "rmsnorm.cu",
            Op::LayerNorm => "layernorm.cu",
            Op::Rope => "rope.cu",
            Op::Attention => "attention.cu",
            Op::IndexerScores => "indexer_scores.cu",
            Op::TopK => "topk.cu",
            Op::MoeRouter => "moe_router.cu",
            Op::MoeCombine => "moe_combine.cu",
            Op::SiluMul => "silu_mul.cu",
            Op::Elementwise => "elementwise.cu",
            Op::Argmax => "argmax.cu",
            Op::AllReduce => "allreduce.cu",
        }
    }

    /// The op's own source file.
    pub fn source(self) -> &'static str {
        match self {
            Op::Dequant => include_str!("../cuda/dequant.cu"),
            Op::Gemv => include_str!("../cuda/gemv.cu"),
            Op::RmsNorm => include_str!("../cuda/rmsnorm.cu"),
            Op::LayerNorm => include_str!("../cuda/layernorm.cu"),
            Op::Rope => include_str!("../cuda/rope.cu"),
            Op::Attention => include_str!("../cuda/attention.cu"),
            Op::IndexerScores => include_str!("../cuda/indexer_scores.cu"),
            Op::TopK => include_str!("../cuda/topk.cu"),
            Op::MoeRouter => include_str!("../cuda/moe_router.cu"),
            Op::MoeCombine => include_str!("../cuda/moe_combine.cu"),
            Op::SiluMul => include_str!("../cuda/silu_mul.cu"),
            Op::Elementwise => include_str!("../cuda/elementwise.cu"),
            Op::Argmax => include_str!("../cuda/argmax.cu"),
            Op::AllReduce => include_str!("../cuda/allreduce.cu"),
        }
    }

    /// (file name, text) of everything NVRTC compiles for this op, in order: the prelude, the
    /// headers the op needs, the op's own file.
    pub fn sections(self) -> Vec<(&'static str, &'static str)> {
        let mut v = vec![("prelude.cuh", PRELUDE)];
        if matches!(self, Op::Dequant | Op::Gemv) {
            v.push(("quant.cuh", QUANT));
        }
        v.push((self.file_name(), self.source()));
        v
    }

    /// Every kernel entry point the Rust wrappers launch from this op's module.
    pub fn kernel_names(self) -> Vec<String> {
        let per_type = |prefixes: &[&str]| {
            gguf::GgmlType::ALL
                .iter()
                .flat_map(|&ty| {
                    let k = crate::quant::type_kernels(ty);
                    prefixes
                        .iter()
                        .map(|p| match *p {
                            "dequant" => k.dequant,
                            "dequant_bf16" => k.dequant_bf16,
                            "get_rows" => k.get_rows,
                            "gemv4" => k.gemv4,
                            _ => k.gemv,
                        })
                        .map(str::to_string)
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        let names: &[&str] = match self {
            Op::Dequant => return per_type(&["dequant", "dequant_bf16", "get_rows"]),
            Op::Gemv => return per_type(&["gemv", "gemv4"]),
            Op::RmsNorm => &["rmsnorm_f32"],
            Op::LayerNorm => &["layernorm_f32"],
            Op::Rope => &["rope_f32"],
            Op::Attention => &["attn_scores_f32", "attn_av_partial_f32", "attn_combine_f32"],
            Op::IndexerScores => &["indexer_scores_f32"],
            Op::TopK => &["topk_f32"],
            Op::MoeRouter => &["moe_router_f32"],
            Op::MoeCombine => &["moe_combine_f32"],
            Op::SiluMul => &["silu_mul_f32"],
            Op::Elementwise => &[
                "add_f32",
                "scale_f32",
                "copy_rows_f32",
                "f32_to_bf16",
                "add_bias_f32",
                "gather_rows_f32",
            ],
            Op::Argmax => &["argmax_f32"],
            Op::AllReduce => &["allreduce_oneshot_f32"],
        };
        names.iter().map(|s| s.to_string()).collect()
    }

    /// Whether NVRTC may contract `a*b+c` into FMAs. Off for the dequantizer, whose products must
    /// round exactly like the CPU oracle's (`verify --gpu` checks them to a few ulps).
    pub(crate) fn allow_fma(self) -> bool {
        !matches!(self, Op::Dequant)
    }
}
