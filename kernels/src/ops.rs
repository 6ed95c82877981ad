//! The kernel sources: one op per `.cu` file under `kernels/cuda/`, embedded in the binary.
//!
//! NVRTC compiles `prelude.cuh` + the op's headers + the op's file as one translation unit
//! (NVRTC 13.0 has no include path to the CUDA headers, so nothing is `#include`d). The integer
//! GEMV (`gemvq.cu`) is compiled once per weight type (a `#define` selects it), so a model only
//! compiles the types it has.

use std::sync::OnceLock;

use gguf::GgmlType;

/// Shared prelude of every module: integer typedefs, f16/bf16 conversions, reductions.
const PRELUDE: &str = include_str!("../cuda/prelude.cuh");
/// The ggml block decoders, shared by the ops that read quantized weights.
const QUANT: &str = include_str!("../cuda/quant.cuh");
/// The norms' shared row bodies (cache stores, LayerNorm statistics, the fused norm + RoPE
/// jobs), for the modules of rmsnorm.cu and layernorm.cu.
const NORM_ROWS: &str = include_str!("../cuda/norm_rows.cuh");

/// Weight types with an integer-dot-product GEMV (gemvq.cu). `Q4_K`, `Q5_K` and `IQ4_XS` read
/// GGUF blocks; the others read the repacked layout (`crate::repack`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

impl QType {
    pub const ALL: [QType; 10] = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
        QType::IQ4NL,
        QType::IQ4XS,
    ];

    /// The integer GEMV type for a weight type, if it has one.
    pub fn of(ty: GgmlType) -> Option<QType> {
        Some(match ty {
            GgmlType::Q4_0 => QType::Q4_0,
            GgmlType::Q4_1 => QType::Q4_1,
            GgmlType::Q5_0 => QType::Q5_0,
            GgmlType::Q5_1 => QType::Q5_1,
            GgmlType::Q8_0 => QType::Q8_0,
            GgmlType::Q4_K => QType::Q4K,
            GgmlType::Q5_K => QType::Q5K,
            GgmlType::Q6_K => QType::Q6K,
            GgmlType::IQ4_NL => QType::IQ4NL,
            GgmlType::IQ4_XS => QType::IQ4XS,
            _ => return None,
        })
    }

    /// `(QT_* macro, kernel suffix)` of the device layout this type is read in.
    fn device(self) -> (&'static str, &'static str) {
        match self {
            QType::Q4_0 => ("QT_Q4_0_R", "q4_0_r"),
            QType::Q4_1 => ("QT_Q4_1_R", "q4_1_r"),
            QType::Q5_0 => ("QT_Q5_0_R", "q5_0_r"),
            QType::Q5_1 => ("QT_Q5_1_R", "q5_1_r"),
            QType::Q8_0 => ("QT_Q8_0_R", "q8_0_r"),
            QType::Q4K => ("QT_Q4_K", "q4_k"),
            QType::Q5K => ("QT_Q5_K", "q5_k"),
            QType::Q6K => ("QT_Q6_K_R", "q6_k_r"),
            QType::IQ4NL => ("QT_IQ4_NL_R", "iq4_nl_r"),
            QType::IQ4XS => ("QT_IQ4_XS", "iq4_xs"),
        }
    }

    pub fn suffix(self) -> &'static str {
        self.device().1
    }

    /// The types with a tensor-core matrix product (mmq.cu).
    pub const MMQ: [QType; 4] = [QType::Q8_0, QType::Q4K, QType::Q5K, QType::Q6K];

    /// Weights per task (one lane's unit of work) of a one-column GEMV (`GQ_TW1` in gemvq.cu;
    /// launches of several columns always use 32): 32, but Q4_K's and Q6_K's cover 64 (Q4_K: two
    /// sub-blocks sharing 32 code bytes, the header decoded once; Q6_K: two 16-element groups
    /// sharing their high bits, scales and d; faster on the H200, docs/GPU.md).
    /// `GGUFTOOL_Q4K_TASK=32|64` and `GGUFTOOL_Q6K_TASK=32|64` pick the widths to measure.
    pub fn task_weights(self) -> usize {
        fn width(var: &str, default: usize) -> usize {
            match std::env::var(var).ok().and_then(|v| v.parse().ok()) {
                Some(w @ (32 | 64)) => w,
                _ => default,
            }
        }
        static Q4K: OnceLock<usize> = OnceLock::new();
        static Q6K: OnceLock<usize> = OnceLock::new();
        match self {
            QType::Q4K => *Q4K.get_or_init(|| width("GGUFTOOL_Q4K_TASK", Q4K_TASK_WEIGHTS)),
            QType::Q6K => *Q6K.get_or_init(|| width("GGUFTOOL_Q6K_TASK", Q6K_TASK_WEIGHTS)),
            _ => 32,
        }
    }
}

/// Q4_K's and Q6_K's default one-column GEMV task widths (weights), see
/// [`QType::task_weights`].
const Q4K_TASK_WEIGHTS: usize = 64;
const Q6K_TASK_WEIGHTS: usize = 64;

/// The gemvq kernel variants: `(prefix, columns, mode, rows per lane group)`. The several-row
/// variants of the multi-column kernels are the default (`GGUFTOOL_GEMVQ_ROWS=1` or
/// [`crate::Gpu::set_gemvq_multirow`] selects the one-row ones); one-column launches take the
/// most rows up to [`crate::Gpu::set_gemvq1_rows`] (`GGUFTOOL_GEMVQ1_ROWS`).
pub(crate) const GEMVQ_VARIANTS: [(&str, usize, u8, usize); 15] = [
    ("gemvq1_", 1, 0, 1),
    ("gemvq2_", 2, 0, 1),
    ("gemvq4_", 4, 0, 1),
    ("gemvq8_", 8, 0, 1),
    ("gemvq_glu1_", 1, 1, 1),
    ("gemvq_glu8_", 8, 1, 1),
    ("gemvq_comb_", 1, 2, 1),
    ("gemvq2r_", 2, 0, 4),
    ("gemvq4r_", 4, 0, 4),
    ("gemvq8r_", 8, 0, 2),
    ("gemvq_glu8r_", 8, 1, 2),
    ("gemvq1r2_", 1, 0, 2),
    ("gemvq1r4_", 1, 0, 4),
    ("gemvq_glu1r_", 1, 1, 2),
    ("gemvq_comb_r_", 1, 2, 2),
];

/// One compiled module = one op file (gemvq: one module per weight type). Compiled lazily, once
/// per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Dequant,
    Gemv,
    GemvQ(QType),
    /// The int8 tensor-core matrix product (mmq.cu) for 8..64 columns; [`QType::MMQ`] types.
    Mmq(QType),
    Quantize,
    RmsNorm,
    LayerNorm,
    Rope,
    Attention,
    Mla,
    IndexerScores,
    TopK,
    MoeRouter,
    MoeCombine,
    MoeSort,
    SiluMul,
    Elementwise,
    Argmax,
    Sample,
    AllReduce,
}

impl Op {
    /// Every module, for the compile check.
    pub const ALL: [Op; 32] = [
        Op::Dequant,
        Op::Gemv,
        Op::Quantize,
        Op::RmsNorm,
        Op::LayerNorm,
        Op::Rope,
        Op::Attention,
        Op::Mla,
        Op::IndexerScores,
        Op::TopK,
        Op::MoeRouter,
        Op::MoeCombine,
        Op::MoeSort,
        Op::SiluMul,
        Op::Elementwise,
        Op::Argmax,
        Op::Sample,
        Op::GemvQ(QType::Q4_0),
        Op::GemvQ(QType::Q4_1),
        Op::GemvQ(QType::Q5_0),
        Op::GemvQ(QType::Q5_1),
        Op::GemvQ(QType::Q8_0),
        Op::GemvQ(QType::Q4K),
        Op::GemvQ(QType::Q5K),
        Op::GemvQ(QType::Q6K),
        Op::GemvQ(QType::IQ4NL),
        Op::GemvQ(QType::IQ4XS),
        Op::Mmq(QType::Q8_0),
        Op::Mmq(QType::Q4K),
        Op::Mmq(QType::Q5K),
        Op::Mmq(QType::Q6K),
        Op::AllReduce,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Dequant => "dequant",
            Op::Gemv => "gemv",
            Op::GemvQ(_) => "gemvq",
            Op::Mmq(_) => "mmq",
            Op::Quantize => "quantize",
            Op::RmsNorm => "rmsnorm",
            Op::LayerNorm => "layernorm",
            Op::Rope => "rope",
            Op::Attention => "attention",
            Op::Mla => "mla",
            Op::IndexerScores => "indexer_scores",
            Op::TopK => "topk",
            Op::MoeRouter => "moe_router",
            Op::MoeCombine => "moe_combine",
            Op::MoeSort => "moe_sort",
            Op::SiluMul => "silu_mul",
            Op::Elementwise => "elementwise",
            Op::Argmax => "argmax",
            Op::Sample => "sample",
            Op::AllReduce => "allreduce",
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            Op::Dequant => "dequant.cu",
            Op::Gemv => "gemv.cu",
            Op::GemvQ(_) => "gemvq.cu",
            Op::Mmq(_) => "mmq.cu",
            Op::Quantize => "quantize.cu",
            Op::RmsNorm => "rmsnorm.cu",
            Op::LayerNorm => "layernorm.cu",
            Op::Rope => "rope.cu",
            Op::Attention => "attention.cu",
            Op::Mla => "mla.cu",
            Op::IndexerScores => "indexer_scores.cu",
            Op::TopK => "topk.cu",
            Op::MoeRouter => "moe_router.cu",
            Op::MoeCombine => "moe_combine.cu",
            Op::MoeSort => "moe_sort.cu",
            Op::SiluMul => "silu_mul.cu",
            Op::Elementwise => "elementwise.cu",
            Op::Argmax => "argmax.cu",
            Op::Sample => "sample.cu",
            Op::AllReduce => "allreduce.cu",
        }
    }

    /// The op's own source file.
    pub fn source(self) -> &'static str {
        match self {
            Op::Dequant => include_str!("../cuda/dequant.cu"),
            Op::Gemv => include_str!("../cuda/gemv.cu"),
            Op::GemvQ(_) => include_str!("../cuda/gemvq.cu"),
            Op::Mmq(_) => include_str!("../cuda/mmq.cu"),
            Op::Quantize => include_str!("../cuda/quantize.cu"),
            Op::RmsNorm => include_str!("../cuda/rmsnorm.cu"),
            Op::LayerNorm => include_str!("../cuda/layernorm.cu"),
            Op::Rope => include_str!("../cuda/rope.cu"),
            Op::Attention => include_str!("../cuda/attention.cu"),
            Op::Mla => include_str!("../cuda/mla.cu"),
            Op::IndexerScores => include_str!("../cuda/indexer_scores.cu"),
            Op::TopK => include_str!("../cuda/topk.cu"),
            Op::MoeRouter => include_str!("../cuda/moe_router.cu"),
            Op::MoeCombine => include_str!("../cuda/moe_combine.cu"),
            Op::MoeSort => include_str!("../cuda/moe_sort.cu"),
            Op::SiluMul => include_str!("../cuda/silu_mul.cu"),
            Op::Elementwise => include_str!("../cuda/elementwise.cu"),
            Op::Argmax => include_str!("../cuda/argmax.cu"),
            Op::Sample => include_str!("../cuda/sample.cu"),
            Op::AllReduce => include_str!("../cuda/allreduce.cu"),
        }
    }

    /// (file name, text) of everything NVRTC compiles for this op, in order: the prelude, the
    /// per-module defines, the headers the op needs, the op's own file.
    pub fn sections(self) -> Vec<(&'static str, String)> {
        let mut v = vec![("prelude.cuh", PRELUDE.to_string())];
        if matches!(self, Op::Dequant | Op::Gemv | Op::GemvQ(_) | Op::Mmq(_)) {
            v.push(("quant.cuh", QUANT.to_string()));
        }
        if let Op::GemvQ(q) = self {
            let (id, suf) = q.device();
            v.push((
                "gemvq-type.cuh",
                format!(
                    "#define GQ_QT {id}\n#define GQ_SUF {suf}\n#define GQ_TW1 {}\n",
                    q.task_weights()
                ),
            ));
        }
        if matches!(self, Op::RmsNorm | Op::LayerNorm) {
            v.push(("norm_rows.cuh", NORM_ROWS.to_string()));
        }
        if self == Op::RmsNorm {
            // The register path's width, which the wrapper needs too (its parts).
            v.push((
                "rmsnorm-regs.cuh",
                format!("#define RMS_REGS {}\n", crate::norm::rms_regs()),
            ));
        }
        if let Op::Mmq(q) = self {
            let (id, suf) = q.device();
            v.push((
                "mmq-type.cuh",
                format!("#define MQ_QT {id}\n#define MQ_SUF {suf}\n"),
            ));
        }
        v.push((self.file_name(), self.source().to_string()));
        v
    }

    /// Every kernel entry point the Rust wrappers launch from this op's module.
    pub fn kernel_names(self) -> Vec<String> {
        let per_type = |f: &dyn Fn(crate::quant::TypeKernels) -> Vec<&'static str>| {
            let mut out = Vec::new();
            for &ty in gguf::GgmlType::ALL.iter() {
                out.extend(
                    f(crate::quant::type_kernels(ty, false))
                        .into_iter()
                        .map(str::to_string),
                );
                if crate::repack::is_packed(ty) {
                    out.extend(
                        f(crate::quant::type_kernels(ty, true))
                            .into_iter()
                            .map(str::to_string),
                    );
                }
            }
            out
        };
        let names: &[&str] = match self {
            Op::Dequant => return per_type(&|k| vec![k.dequant, k.dequant_bf16, k.get_rows]),
            Op::Gemv => {
                let mut v = per_type(&|k| vec![k.gemv, k.gemv4, k.gemvs]);
                v.push(crate::gemv::GEMVC_F32.to_string());
                return v;
            }
            Op::GemvQ(q) => {
                return GEMVQ_VARIANTS
                    .iter()
                    .map(|(p, _, _, _)| format!("{p}{}", q.suffix()))
                    .collect()
            }
            Op::Mmq(q) => {
                return crate::mmq::MMQ_VARIANTS
                    .iter()
                    .map(|(p, _, _, _)| format!("{p}{}", q.suffix()))
                    .chain(std::iter::once(format!("mmq_reduce_{}", q.suffix())))
                    .chain(std::iter::once("mma_s8_selftest".to_string()))
                    .collect()
            }
            Op::Quantize => &["quantize_q8a"],
            Op::RmsNorm => &["rmsnorm_f32", "rmsnorm_rope_f32", "mla_norms_f32"],
            Op::LayerNorm => &["layernorm_f32", "layernorm_rope_f32"],
            Op::Rope => &["rope_f32", "rope_q8_f32"],
            Op::Attention => &["attn_scores_f32", "attn_av_partial_f32", "attn_combine_f32"],
            Op::Mla => &[
                "mla_partial_f32",
                "mla_partial_bf16",
                "mla_decode_f32",
                "mla_decode_bf16",
                "mla_tc_bf16",
            ],
            Op::IndexerScores => &[
                "indexer_scores_f32",
                "indexer_scores_bf16",
                "indexer_scores_lanes_bf16",
                "indexer_scores_tc_bf16",
            ],
            Op::TopK => &["topk_f32", "topk_mb_hist", "topk_mb_gather"],
            Op::MoeRouter => &["moe_router_f32", "moe_local_ids"],
            Op::MoeCombine => &["moe_combine_f32"],
            Op::MoeSort => &["moe_count", "moe_plan", "moe_scatter"],
            Op::SiluMul => &["silu_mul_f32"],
            Op::Elementwise => &[
                "add_f32",
                "scale_f32",
                "copy_rows_f32",
                "f32_to_bf16",
                "add_bias_f32",
                "gather_rows_f32",
                "bf16_to_f32",
                "scatter_rows_f32",
                "scatter_rows_bf16",
            ],
            Op::Argmax => &["argmax_f32", "argmax_part_f32", "argmax_final_f32"],
            Op::Sample => &["sample_rows", "sample_greedy_part", "sample_greedy_final"],
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
