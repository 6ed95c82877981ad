//! Per-sequence KV cache, held in backend tensors. For MLA models one row per token and layer is
//! the normalised latent followed by the roped shared key part (`kv_lora + rope` values, the
//! compressed form: keys and values are re-derived from it), plus the lightning indexer's roped,
//! normalised key where the layer has an indexer. Grouped-query models cache keys and values.

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
        })
    }

    /// Drop every row past `len` (undo a partly applied step).
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
        self.layers
            .iter()
            .flat_map(|l| [Some(&l.kv), l.v.as_ref(), l.index_keys.as_ref()])
            .flatten()
            .map(|t| {
                let (r, c) = self.backend.shape(t);
                r * c * std::mem::size_of::<f32>()
            })
            .sum()
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
