//! The memory plan of a model split over N ranks, from the file's header alone (tensor types and
//! shapes; no tensor data is read, so it answers for the 402 GB model and for header-only
//! stand-ins alike): weights per rank by kind, KV cache bytes per token, the activation
//! workspace, headroom, and how much context fits in what is left.
//!
//! Each rank's weight bytes are computed with the loader's own rules ([`ShardView::share_of`],
//! `glm::part_of`, `mappings::shard::slice`), so a TP load reports the same numbers.

use super::{MoeSplit, Shard, ShardView};
use crate::glm::part_of;
use crate::spec::{AttentionSpec, ModelSpec, TensorSpec};
use crate::RuntimeError;
use mappings::shard::slice;
use serde::Serialize;

/// Weight bytes of one rank by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct KindBytes {
    /// Attention: projections, norms, the DSA indexer.
    pub attention: u64,
    /// Routed experts, shared experts and routers.
    pub experts: u64,
    /// Dense FFN blocks.
    pub dense: u64,
    /// Token embedding, output head and final norm.
    pub embeddings: u64,
    /// NextN / MTP blocks.
    pub mtp: u64,
}

/// One rank's share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankPlan {
    pub rank: usize,
    pub weight_bytes: u64,
    pub by_kind: KindBytes,
    /// Tensors whose split cuts quant blocks: held as exact F32 values (see docs/TP.md).
    pub reencoded_f32: Vec<String>,
    pub reencoded_extra_bytes: u64,
    /// KV cache bytes per token on this rank (f32 rows, as the backends store them).
    pub kv_bytes_per_token: u64,
}

/// The weights of every rank for one world size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WeightPlan {
    pub world: usize,
    pub moe_split: MoeSplit,
    pub ranks: Vec<RankPlan>,
}

impl WeightPlan {
    /// The rank that needs the most memory decides whether the split fits.
    pub fn max_weight_bytes(&self) -> u64 {
        self.ranks.iter().map(|r| r.weight_bytes).max().unwrap_or(0)
    }
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.ranks
            .iter()
            .map(|r| r.kv_bytes_per_token)
            .max()
            .unwrap_or(0)
    }
}

fn kind_of(spec: &ModelSpec, t: &TensorSpec) -> usize {
    let mtp = t
        .block
        .is_some_and(|b| spec.layers.get(b).is_some_and(|l| l.mtp));
    let r = t.role.as_str();
    if mtp {
        4
    } else if matches!(r, "token_embd" | "output" | "output_norm") {
        3
    } else if r.ends_with("_exps") || r.ends_with("_shexp") || r.starts_with("ffn_router") {
        1
    } else if matches!(r, "ffn_gate" | "ffn_up" | "ffn_down" | "ffn_norm") {
        2
    } else {
        0
    }
}

/// Bytes of rank `view`'s share of `t` stored as `ty`, and the extra bytes when the share is
/// re-encoded as F32 because it would cut quant blocks.
fn share_bytes(
    t: &TensorSpec,
    ty: gguf::GgmlType,
    view: &ShardView,
) -> Result<(u64, Option<u64>), RuntimeError> {
    let ne: Vec<u64> = t.dims.iter().map(|&d| d as u64).collect();
    let rows: u64 = ne[1..].iter().product();
    let whole = ty
        .row_bytes(ne[0])
        .map(|b| b * rows)
        .ok_or_else(|| RuntimeError::Model(format!("tensor {}: ne0 does not fit {ty}", t.name)))?;
    let Some((axis, range)) = view.share_of(t, part_of(&t.role))? else {
        return Ok((whole, None));
    };
    let r = range.start as u64..range.end as u64;
    match slice(ty, &ne, axis, r.clone()) {
        Ok(s) => Ok((s.n_bytes(), None)),
        Err(mappings::MappingError::SplitCutsBlock { .. }) => {
            let f32_bytes = (r.end - r.start) * rows * 4;
            let quantized = whole / ne[0] * (r.end - r.start);
            Ok((f32_bytes, Some(f32_bytes.saturating_sub(quantized))))
        }
        Err(e) => Err(RuntimeError::Model(format!("tensor {}: {e}", t.name))),
    }
}

/// KV cache bytes per token on a rank with this view (the layout `GlmModel` caches).
fn kv_bytes_per_token(spec: &ModelSpec, view: &ShardView) -> u64 {
    let per_layer = |own_indexer: bool| -> usize {
        match view.local_attention(&spec.attention) {
            AttentionSpec::Mla(m) => {
                m.cache_width()
                    + if own_indexer {
                        spec.indexer.map_or(0, |i| i.head_dim)
                    } else {
                        0
                    }
            }
            AttentionSpec::Gqa(g) => 2 * g.n_head_kv * g.head_dim,
        }
    };
    spec.layers
        .iter()
        .filter(|l| !l.mtp)
        .map(|l| per_layer(l.own_indexer) as u64 * 4)
        .sum()
}

/// Every rank's weights when `model` is split over `world` ranks, from its header only.
pub fn weight_plan(
    model: &gguf::Model,
    spec: &ModelSpec,
    world: usize,
    moe: MoeSplit,
) -> Result<WeightPlan, RuntimeError> {
    let mut ranks = Vec::with_capacity(world);
    for rank in 0..world {
        let view = ShardView::new(spec, Shard { rank, world }, moe)?;
        let mut kinds = [0u64; 5];
        let (mut extra, mut names) = (0u64, Vec::new());
        let mut add = |t: &TensorSpec, ty| -> Result<(), RuntimeError> {
            let (b, e) = share_bytes(t, ty, &view)?;
            kinds[kind_of(spec, t)] += b;
            if let Some(e) = e {
                extra += e;
                names.push(t.name.clone());
            }
            Ok(())
        };
        for t in &spec.tensors {
            if let Some(info) = model.tensor(&t.name) {
                add(t, info.info.ty)?;
            } else if let (Some(tied), true) = (&t.tied_to, world > 1) {
                // A tied head: the embedding's vocabulary share is held once more as the head.
                if let Some(info) = model.tensor(tied) {
                    add(t, info.info.ty)?;
                }
            }
        }
        ranks.push(RankPlan {
            rank,
            weight_bytes: kinds.iter().sum(),
            by_kind: KindBytes {
                attention: kinds[0],
                experts: kinds[1],
                dense: kinds[2],
                embeddings: kinds[3],
                mtp: kinds[4],
            },
            reencoded_f32: names,
            reencoded_extra_bytes: extra,
            kv_bytes_per_token: kv_bytes_per_token(spec, &view),
        });
    }
    Ok(WeightPlan {
        world,
        moe_split: moe,
        ranks,
    })
}

/// Rows of one prefill chunk the engine runs (`serving::engine::EngineConfig::prefill_chunk`'s
/// default), the size the activation estimate assumes.
pub const PREFILL_ROWS: usize = 512;

/// Peak activation memory of one forward step on a rank, estimated from the op sequence: a
/// prefill chunk of [`PREFILL_ROWS`] tokens plus decode rows, each op's f32 output alive until
/// the next block (residual stream, norms, queries and attention outputs of the rank's heads,
/// the routed experts' gate/up/activation/down rows, the indexer's scores over `ctx` keys and
/// the gathered logits), plus 256 MiB for kernels, cuBLAS and allocator slack.
pub fn workspace_for(spec: &ModelSpec, world: usize, ctx: usize, decode_rows: usize) -> u64 {
    let rows = (PREFILL_ROWS + decode_rows) as u64;
    let w = world.max(1) as u64;
    let d = spec.n_embd as u64;
    let attn = match &spec.attention {
        AttentionSpec::Mla(m) => {
            (m.n_head as u64 / w) * (2 * m.qk_head() + m.v_head + m.cache_width()) as u64
        }
        AttentionSpec::Gqa(g) => (g.n_head as u64 / w) * 3 * g.head_dim as u64,
    };
    let moe = spec
        .moe
        .map_or(0, |e| e.n_used as u64 * (3 * e.n_ff as u64 / w + d));
    let dense = 3 * spec.n_ff as u64 / w;
    let indexer = spec.indexer.map_or(0, |_| ctx as u64);
    let logits = decode_rows.max(1) as u64 * spec.n_vocab as u64 * 2;
    (rows * (6 * d + attn + moe.max(dense) + indexer) + logits) * 4 + (256 << 20)
}

/// [`workspace_for`] at 4096 keys and 16 decode rows (the KV budget of a loaded model).
pub fn workspace_bytes(spec: &ModelSpec, world: usize) -> u64 {
    workspace_for(spec, world, 4096, 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_cover_the_forward_roles() {
        let s = |role: &str| TensorSpec {
            role: role.into(),
            block: None,
            name: role.into(),
            dims: vec![1],
            required: true,
            shard: mappings::shard::ShardRole::Replicated,
            tied_to: None,
        };
        let spec = tiny();
        assert_eq!(kind_of(&spec, &s("output")), 3);
        assert_eq!(kind_of(&spec, &s("ffn_up_exps")), 1);
        assert_eq!(kind_of(&spec, &s("ffn_router_bias")), 1);
        assert_eq!(kind_of(&spec, &s("ffn_down")), 2);
        assert_eq!(kind_of(&spec, &s("indexer_q_b")), 0);
    }

    fn tiny() -> ModelSpec {
        let m = gguf::Model::open(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/gguf/tiny-glm5-BF16.gguf"),
        )
        .unwrap();
        ModelSpec::from_model(&m).unwrap()
    }
}
