//! Per-sequence KV cache, held in backend tensors. For MLA models one row per token and layer is
//! the normalised latent followed by the roped shared key part (`kv_lora + rope` values, the
//! compressed form: keys and values are re-derived from it), plus the lightning indexer's roped,
//! normalised key where the layer has an indexer. Grouped-query models cache keys and values.
//!
//! A sequence made for speculative decoding also carries its NextN/MTP draft layer's state
//! ([`DraftState`]): that layer's own one-layer cache and the trunk's post-`output_norm` hidden
//! states it has not consumed yet.

use crate::backend::Backend;
use crate::lm::SequenceState;
use crate::RuntimeError;
use std::any::Any;

/// One layer's cached rows.
pub struct LayerCache<B: Backend> {
    /// MLA: `[t, kv_lora + rope]`; GQA: keys `[t, n_kv * head_dim]`.
    pub kv: B::Tensor,
    /// GQA values `[t, n_kv * head_dim]`.
    pub v: Option<B::Tensor>,
    /// Indexer keys `[t, index_head_dim]`.
    pub index_keys: Option<B::Tensor>,
}

/// The cache of one sequence over all trunk layers.
pub struct KvCache<B: Backend> {
    pub(crate) backend: B,
    pub layers: Vec<LayerCache<B>>,
    pub(crate) len: usize,
    /// The draft layer's state; `None` for a sequence decoded without drafts.
    pub(crate) draft: Option<Box<DraftState<B>>>,
}

/// The NextN/MTP draft layer's part of a sequence.
///
/// Draft row `i` of `cache` was computed from the trunk's hidden state at position `i` and the
/// token at `i + 1`, so it predicts the token at `i + 2`. Rows `0 .. committed` were built from
/// real trunk hidden states; rows past them are drafting rows (built from the draft layer's own
/// output) and are dropped whenever the sequence is rolled back. `pending` holds the trunk's
/// hidden states of positions `committed ..` that no draft row used yet.
pub struct DraftState<B: Backend> {
    /// One layer's cache (the draft layer's attention).
    pub(crate) cache: KvCache<B>,
    pub(crate) committed: usize,
    /// Trunk hidden states after `output_norm`, rows = positions `committed ..`.
    pub(crate) pending: Option<B::Tensor>,
    /// The draft layer's last output hidden state (after `shared_head_norm`): the "hidden"
    /// input of the next, recursive draft row.
    pub(crate) own: Option<B::Tensor>,
}

impl<B: Backend> DraftState<B> {
    pub(crate) fn pending_rows(&self) -> usize {
        self.pending
            .as_ref()
            .map_or(0, |t| self.cache.backend.shape(t).0)
    }

    /// Keep trunk hidden states of the step just run (`rows` = its positions in order).
    pub(crate) fn push_pending(&mut self, rows: B::Tensor) -> Result<(), RuntimeError> {
        match self.pending.as_mut() {
            Some(p) => self.cache.backend.append_rows(p, &rows),
            None => {
                self.pending = Some(rows);
                Ok(())
            }
        }
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache; `widths[l] = (kv cols, value cols if separate, indexer key cols)`.
    pub fn new(
        backend: &B,
        widths: &[(usize, Option<usize>, Option<usize>)],
    ) -> Result<Self, RuntimeError> {
        let layers = widths
            .iter()
            .map(|&(kv, v, ik)| {
                Ok(LayerCache {
                    kv: backend.empty(kv)?,
                    v: v.map(|c| backend.empty(c)).transpose()?,
                    index_keys: ik.map(|c| backend.empty(c)).transpose()?,
                })
            })
            .collect::<Result<_, RuntimeError>>()?;
        Ok(Self {
            backend: backend.clone(),
            layers,
            len: 0,
            draft: None,
        })
    }

    /// Give this (empty) sequence a draft layer state with one cache layer of `widths`.
    pub fn with_draft(
        mut self,
        widths: (usize, Option<usize>, Option<usize>),
    ) -> Result<Self, RuntimeError> {
        let cache = KvCache::new(&self.backend, &[widths])?;
        self.draft = Some(Box::new(DraftState {
            cache,
            committed: 0,
            pending: None,
            own: None,
        }));
        Ok(self)
    }

    /// Whether the sequence keeps draft layer state.
    pub fn has_draft(&self) -> bool {
        self.draft.is_some()
    }

    /// Roll the sequence back to its first `len` tokens, trunk and draft layer alike: drafting
    /// rows are dropped, trunk hidden states past `len` too. Rolling back past the draft rows
    /// built from real trunk states is refused (their hidden states are gone), except to 0.
    pub fn rollback(&mut self, len: usize) -> Result<(), RuntimeError> {
        if let Some(d) = self.draft.as_mut() {
            if len < d.committed && len > 0 {
                return Err(RuntimeError::Backend(format!(
                    "cannot roll a drafting sequence back to {len} tokens: its draft layer \
                     already consumed the trunk states up to {}",
                    d.committed
                )));
            }
            if len == 0 {
                d.committed = 0;
                d.pending = None;
            }
            d.cache.truncate(d.committed)?;
            d.own = None;
            let keep = len.min(self.len).saturating_sub(d.committed);
            if let Some(p) = d.pending.as_mut() {
                if keep == 0 {
                    d.pending = None;
                } else if d.cache.backend.shape(p).0 > keep {
                    d.cache.backend.truncate_rows(p, keep)?;
                }
            }
        }
        self.truncate(len)
    }

    /// Drop every trunk row past `len` (undo a partly applied step).
    pub fn truncate(&mut self, len: usize) -> Result<(), RuntimeError> {
        for l in &mut self.layers {
            for t in [Some(&mut l.kv), l.v.as_mut(), l.index_keys.as_mut()]
                .into_iter()
                .flatten()
            {
                if self.backend.shape(t).0 > len {
                    self.backend.truncate_rows(t, len)?;
                }
            }
        }
        self.len = self.len.min(len);
        Ok(())
    }
}

impl<B: Backend> SequenceState for KvCache<B> {
    fn len(&self) -> usize {
        self.len
    }

    fn cache_bytes(&self) -> usize {
        self.draft.as_ref().map_or(0, |d| d.cache.cache_bytes())
            + self
                .layers
                .iter()
                .flat_map(|l| [Some(&l.kv), l.v.as_ref(), l.index_keys.as_ref()])
                .flatten()
                .map(|t| {
                    let (r, c) = self.backend.shape(t);
                    r * c * std::mem::size_of::<f32>()
                })
                .sum::<usize>()
    }

    fn truncate(&mut self, len: usize) -> Result<(), RuntimeError> {
        self.rollback(len)
    }

    fn reserve(&mut self, tokens: usize) -> Result<(), RuntimeError> {
        for l in &mut self.layers {
            for t in [Some(&mut l.kv), l.v.as_mut(), l.index_keys.as_mut()]
                .into_iter()
                .flatten()
            {
                self.backend.reserve_rows(t, tokens)?;
            }
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
