//! Tensor parallelism: one model over N ranks (GPUs, or CPU threads for exact tests of the
//! sharding math), driving the one forward definition of `crate::glm` in lock-step.
//!
//! - [`ShardView`]: which heads, FFN columns, experts and vocabulary rows a rank holds; the
//!   loader cuts every tensor along the axis its mapping-table entry gives it
//!   (`mappings::shard`), the forward pass reads the rank's dimensions from the view.
//! - [`Ranked`]: a rank's backend, the base backend's ops plus its group's collectives.
//! - [`HostComm`]: the in-process communicator (rank threads meet in host memory; the CPU
//!   reference's collectives, and the CUDA fallback).
//! - [`TpModel`]: N persistent rank threads behind one [`crate::LanguageModel`].
//! - [`plan`]: per-rank memory from the file's header only (`gguftool plan`).
//!
//! Design and the choices behind it (expert split, block-cutting splits, KV cost): docs/TP.md.

mod backend;
pub mod check;
mod host;
pub(crate) mod model;
pub mod plan;

pub use backend::{RankComm, Ranked};
pub use host::{sum_in_rank_order, GroupAborted, HostComm, HostGroup, RankSlots, SpinBarrier};
pub use model::{Observed, ObservedData, RankReport, RankSetup, TpModel, TpReport};

use crate::spec::{AttentionSpec, FfnKind, ModelSpec, TensorSpec};
use crate::RuntimeError;
use mappings::shard::{balanced_part, even_part};
use std::ops::Range;

/// A rank's place in its tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

/// How the routed experts of a MoE layer are divided over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum MoeSplit {
    /// Every rank holds 1/N of every expert's FFN columns: balanced at any batch size (the
    /// decode default, docs/TP.md).
    #[default]
    #[serde(rename = "column")]
    Columns,
    /// Expert parallelism: every rank holds whole experts (contiguous, as even as they divide)
    /// and computes the chosen experts it holds.
    #[serde(rename = "expert")]
    Experts,
}

impl std::str::FromStr for MoeSplit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "column" | "columns" => Ok(MoeSplit::Columns),
            "expert" | "experts" | "ep" => Ok(MoeSplit::Experts),
            _ => Err(format!("unknown expert split {s:?} (column, expert)")),
        }
    }
}

impl MoeSplit {
    pub fn name(self) -> &'static str {
        match self {
            MoeSplit::Columns => "column",
            MoeSplit::Experts => "expert",
        }
    }
}

/// Which dimension of the model a tensor's share is cut from (the forward pass's side of a
/// split; the mapping table gives the axis).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Replicated on every rank.
    Whole,
    /// Attention (query) heads.
    Heads,
    /// Key/value heads of grouped-query attention.
    KvHeads,
    /// Dense FFN columns.
    Ff,
    /// Shared-expert FFN columns.
    SharedFf,
    /// Routed experts: every expert's columns, or whole experts ([`MoeSplit`]).
    Experts,
    /// Vocabulary rows of the output head.
    Vocab,
}

/// The part of the model one rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardView {
    pub rank: usize,
    pub world: usize,
    pub moe: MoeSplit,
    /// Attention heads of this rank.
    pub heads: Range<usize>,
    /// Key/value heads (grouped-query attention; MLA has one latent head, replicated).
    pub kv_heads: Range<usize>,
    /// Routed experts this rank computes (all of them, in part, for [`MoeSplit::Columns`]).
    pub experts: Range<usize>,
    /// Output-head rows (vocabulary ids) of this rank.
    pub vocab: Range<usize>,
}

fn heads_of(a: &AttentionSpec) -> (usize, Option<usize>) {
    match a {
        AttentionSpec::Mla(m) => (m.n_head, None),
        AttentionSpec::Gqa(g) => (g.n_head, Some(g.n_head_kv)),
    }
}

/// Why `spec` cannot be split over `world` ranks, if it cannot.
fn split_problem(spec: &ModelSpec, world: usize, moe: MoeSplit) -> Option<String> {
    let (n_head, n_kv) = heads_of(&spec.attention);
    if !n_head.is_multiple_of(world) {
        return Some(format!(
            "the model's {n_head} attention heads do not divide over {world} ranks"
        ));
    }
    if let Some(kv) = n_kv {
        if !kv.is_multiple_of(world) {
            return Some(format!(
                "the model's {kv} key/value heads do not divide over {world} ranks (KV heads are split, not replicated)"
            ));
        }
    }
    let dense = spec
        .layers
        .iter()
        .any(|l| l.ffn == FfnKind::Dense || spec.moe.is_none());
    if dense && !spec.n_ff.is_multiple_of(world) {
        return Some(format!(
            "the dense FFN width {} does not divide over {world} ranks",
            spec.n_ff
        ));
    }
    if let Some(e) = &spec.moe {
        let shared = e.n_ff * e.n_shared;
        if !shared.is_multiple_of(world) {
            return Some(format!(
                "the shared-expert FFN width {shared} does not divide over {world} ranks"
            ));
        }
        if moe == MoeSplit::Columns && !e.n_ff.is_multiple_of(world) {
            return Some(format!(
                "the expert FFN width {} does not divide over {world} ranks (--moe-split expert places whole experts instead)",
                e.n_ff
            ));
        }
    }
    None
}

/// World sizes up to `limit` the model can be split over with `moe`.
pub fn valid_world_sizes(spec: &ModelSpec, moe: MoeSplit, limit: usize) -> Vec<usize> {
    (1..=limit)
        .filter(|&w| split_problem(spec, w, moe).is_none())
        .collect()
}

impl ShardView {
    /// The whole model (one rank).
    pub fn single(spec: &ModelSpec) -> ShardView {
        let (n_head, n_kv) = heads_of(&spec.attention);
        ShardView {
            rank: 0,
            world: 1,
            moe: MoeSplit::Columns,
            heads: 0..n_head,
            kv_heads: 0..n_kv.unwrap_or(1),
            experts: 0..spec.moe.map_or(0, |e| e.n_expert),
            vocab: 0..spec.n_vocab,
        }
    }

    /// Rank `shard.rank`'s part of `spec` over `shard.world` ranks, or why it cannot be split so
    /// (the error names the dimension and lists the world sizes that fit).
    pub fn new(spec: &ModelSpec, shard: Shard, moe: MoeSplit) -> Result<ShardView, RuntimeError> {
        let Shard { rank, world } = shard;
        let tp_err = |msg: String| RuntimeError::Tp { world, msg };
        if world == 0 || rank >= world {
            return Err(tp_err(format!("rank {rank} of {world} ranks")));
        }
        if let Some(p) = split_problem(spec, world, moe) {
            let (n_head, _) = heads_of(&spec.attention);
            let fits = valid_world_sizes(spec, moe, n_head.max(8));
            let fits: Vec<String> = fits.iter().map(|w| w.to_string()).collect();
            return Err(tp_err(format!(
                "{p} (tensor-parallel sizes that fit this model: {})",
                fits.join(", ")
            )));
        }
        let (n_head, n_kv) = heads_of(&spec.attention);
        let part = |len: usize| {
            even_part(len as u64, world as u64, rank as u64)
                .map(|r| r.start as usize..r.end as usize)
                .unwrap_or(0..len)
        };
        let n_expert = spec.moe.map_or(0, |e| e.n_expert);
        let experts = match moe {
            MoeSplit::Columns => 0..n_expert,
            MoeSplit::Experts => {
                let r = balanced_part(n_expert as u64, world as u64, rank as u64);
                r.start as usize..r.end as usize
            }
        };
        let v = balanced_part(spec.n_vocab as u64, world as u64, rank as u64);
        Ok(ShardView {
            rank,
            world,
            moe,
            heads: part(n_head),
            kv_heads: match n_kv {
                Some(kv) => part(kv),
                None => 0..1,
            },
            experts,
            vocab: v.start as usize..v.end as usize,
        })
    }

    /// Whether the routed experts are held whole (expert parallelism over several ranks).
    pub fn whole_experts(&self) -> bool {
        self.world > 1 && self.moe == MoeSplit::Experts
    }

    /// The attention dimensions this rank computes.
    pub fn local_attention(&self, a: &AttentionSpec) -> AttentionSpec {
        match *a {
            AttentionSpec::Mla(mut m) => {
                m.n_head = self.heads.len();
                AttentionSpec::Mla(m)
            }
            AttentionSpec::Gqa(mut g) => {
                g.n_head = self.heads.len();
                g.n_head_kv = self.kv_heads.len();
                AttentionSpec::Gqa(g)
            }
        }
    }

    /// Where this rank's share of tensor `t` (cut from `part`) lies: `None` for the whole
    /// tensor, else the ggml axis and index range. An error when the mapping table and the
    /// forward pass disagree on whether the tensor is split.
    pub fn share_of(
        &self,
        t: &TensorSpec,
        part: Part,
    ) -> Result<Option<(usize, Range<usize>)>, RuntimeError> {
        let axis = t.shard.axis(t.dims.len(), self.whole_experts());
        match (part, axis) {
            (Part::Whole, None) => Ok(None),
            (Part::Whole, Some(_)) | (_, None) => Err(RuntimeError::Model(format!(
                "tensor {}: the mapping table divides it as {:?}, the forward pass needs {part:?}",
                t.name, t.shard
            ))),
            (p, Some(axis)) => {
                let len = t.dims[axis];
                let r = self.range(p, len, &t.name)?;
                Ok((r != (0..len)).then_some((axis, r)))
            }
        }
    }

    /// This rank's index range of `part` along a tensor axis of `len` items.
    pub fn range(
        &self,
        part: Part,
        len: usize,
        tensor: &str,
    ) -> Result<Range<usize>, RuntimeError> {
        let even = || {
            even_part(len as u64, self.world as u64, self.rank as u64)
                .map(|r| r.start as usize..r.end as usize)
                .ok_or_else(|| RuntimeError::Tp {
                    world: self.world,
                    msg: format!(
                        "tensor {tensor}: {len} rows/columns do not divide over the ranks"
                    ),
                })
        };
        match part {
            Part::Whole => Ok(0..len),
            Part::Heads | Part::KvHeads | Part::Ff | Part::SharedFf => even(),
            Part::Experts if self.whole_experts() => Ok(self.experts.clone()),
            Part::Experts => even(),
            Part::Vocab => {
                let r = balanced_part(len as u64, self.world as u64, self.rank as u64);
                Ok(r.start as usize..r.end as usize)
            }
        }
    }
}
