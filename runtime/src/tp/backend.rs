//! A tensor-parallel rank's backend: the base backend's ops unchanged, plus the collectives of
//! the rank's group and the turns its uploads take with the other ranks of its device. The
//! forward pass sees an ordinary [`Backend`].

use crate::backend::{
    AttnParams, Backend, IndexerKeysArgs, IndexerParams, KvRowsArgs, MlaNormed, RopeParams,
    RouteParams, SeqAttn,
};
use crate::weights::HostWeight;
use crate::RuntimeError;
use std::sync::{Arc, Condvar, Mutex};

/// The collectives of one rank of a group, over backend `B`'s tensors. Every rank of the group
/// must call the same collectives in the same order (lock-step).
pub trait RankComm<B: Backend>: Send + Sync {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// In-place sum over the ranks, added in rank order on every rank (bitwise equal results).
    fn all_reduce_sum(&self, be: &B, x: &mut B::Tensor) -> Result<(), RuntimeError>;
    /// The ranks' equally tall tensors side by side, in rank order.
    fn all_gather_cols(&self, be: &B, x: B::Tensor) -> Result<B::Tensor, RuntimeError>;
    /// Wake every rank waiting in a collective with an error (this rank failed mid-step).
    fn abort(&self);
    /// Ready for the next step after an aborted one (called once every rank has stopped).
    fn reset(&self);
    /// A short description for reports (`host`, `oneshot`, `nccl`).
    fn kind(&self) -> String;
    /// After a step: fail if a collective of it went wrong on the device without an error at
    /// launch (a one-shot all-reduce that timed out), so its results are never used.
    fn check(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
}

/// The loader of one device: the ranks placed on it upload one weight at a time, in the order
/// they asked (first come, first served). An upload reads its weight from the memory-mapped
/// file while it copies it, so two ranks uploading at once would make the disk serve two
/// regions of the file at once, slower than one sequential stream; taking turns keeps one
/// reader per device while ranks on different devices still load in parallel. Ranks of one
/// device share a tensor's neighbouring shares, so alternating turns read the file nearly in
/// order. A ticket queue rather than a plain mutex: a rank that releases and asks again at
/// once queues behind the waiting ranks instead of running ahead of them.
#[derive(Default)]
pub(crate) struct LoadTurns {
    /// (next ticket to hand out, ticket now served).
    tickets: Mutex<(u64, u64)>,
    turn: Condvar,
}

/// A rank's turn on its device's loader, ended on drop (also when the upload fails or panics).
struct LoadTurn<'a>(&'a LoadTurns);

impl LoadTurns {
    fn take(&self) -> LoadTurn<'_> {
        let mut t = self.tickets.lock().unwrap_or_else(|p| p.into_inner());
        let mine = t.0;
        t.0 += 1;
        while t.1 != mine {
            t = self.turn.wait(t).unwrap_or_else(|p| p.into_inner());
        }
        LoadTurn(self)
    }
}

impl Drop for LoadTurn<'_> {
    fn drop(&mut self) {
        self.0.tickets.lock().unwrap_or_else(|p| p.into_inner()).1 += 1;
        self.0.turn.notify_all();
    }
}

/// Backend `B` as rank `comm.rank()` of a tensor-parallel group.
pub struct Ranked<B: Backend> {
    inner: B,
    comm: Arc<dyn RankComm<B>>,
    /// The loader of this rank's device, shared with the other ranks on it.
    loader: Option<Arc<LoadTurns>>,
}

impl<B: Backend> Clone for Ranked<B> {
    fn clone(&self) -> Self {
        Ranked {
            inner: self.inner.clone(),
            comm: Arc::clone(&self.comm),
            loader: self.loader.clone(),
        }
    }
}

impl<B: Backend> Ranked<B> {
    pub fn new(inner: B, comm: Arc<dyn RankComm<B>>) -> Self {
        Ranked {
            inner,
            comm,
            loader: None,
        }
    }
    /// Upload weights in turns with the other ranks holding the same `loader`.
    pub(crate) fn with_loader(mut self, loader: Arc<LoadTurns>) -> Self {
        self.loader = Some(loader);
        self
    }
    pub fn inner(&self) -> &B {
        &self.inner
    }
    pub fn comm(&self) -> &Arc<dyn RankComm<B>> {
        &self.comm
    }
}

impl<B: Backend> Backend for Ranked<B> {
    type Tensor = B::Tensor;
    type Weight = B::Weight;
    type Index = B::Index;

    fn name(&self) -> String {
        format!(
            "{} [rank {}/{}]",
            self.inner.name(),
            self.comm.rank(),
            self.comm.world()
        )
    }
    fn upload(&self, w: HostWeight) -> Result<Self::Weight, RuntimeError> {
        // The turn covers the weight's whole read and upload (the backend reads the mmap while
        // it copies); the share was only cut (a view), not read, before.
        let _turn = self.loader.as_deref().map(LoadTurns::take);
        self.inner.upload(w)
    }
    fn new_tensor(&self, r: usize, c: usize, d: &[f32]) -> Result<Self::Tensor, RuntimeError> {
        self.inner.new_tensor(r, c, d)
    }
    fn to_host(&self, t: &Self::Tensor) -> Result<Vec<f32>, RuntimeError> {
        self.inner.to_host(t)
    }
    fn index_to_host(&self, i: &Self::Index) -> Result<(usize, usize, Vec<i64>), RuntimeError> {
        self.inner.index_to_host(i)
    }
    fn vector_to_host(&self, w: &Self::Weight) -> Result<Vec<f32>, RuntimeError> {
        self.inner.vector_to_host(w)
    }
    fn shape(&self, t: &Self::Tensor) -> (usize, usize) {
        self.inner.shape(t)
    }
    fn empty(&self, cols: usize) -> Result<Self::Tensor, RuntimeError> {
        self.inner.empty(cols)
    }
    fn append_rows(&self, dst: &mut Self::Tensor, src: &Self::Tensor) -> Result<(), RuntimeError> {
        self.inner.append_rows(dst, src)
    }
    fn append_rows_seqs(
        &self,
        dsts: &mut [&mut Self::Tensor],
        src: &Self::Tensor,
        counts: &[usize],
    ) -> Result<(), RuntimeError> {
        self.inner.append_rows_seqs(dsts, src, counts)
    }
    fn truncate_rows(&self, t: &mut Self::Tensor, rows: usize) -> Result<(), RuntimeError> {
        self.inner.truncate_rows(t, rows)
    }
    fn slice_rows(
        &self,
        x: &Self::Tensor,
        start: usize,
        n: usize,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.slice_rows(x, start, n)
    }
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor, RuntimeError> {
        self.inner.gather_rows(x, rows)
    }
    fn concat_rows(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor, RuntimeError> {
        self.inner.concat_rows(parts)
    }
    fn slice_cols(
        &self,
        x: &Self::Tensor,
        start: usize,
        n: usize,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.slice_cols(x, start, n)
    }
    fn concat_cols(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor, RuntimeError> {
        self.inner.concat_cols(parts)
    }
    fn head_slice(
        &self,
        x: &Self::Tensor,
        n_head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.head_slice(x, n_head, head_dim, start, n)
    }
    fn head_concat(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        n_head: usize,
        b_shared: bool,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.head_concat(a, b, n_head, b_shared)
    }
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor, RuntimeError> {
        self.inner.matmul(x, w)
    }
    fn matmul_heads(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.matmul_heads(x, w)
    }
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor, RuntimeError> {
        self.inner.embed(table, ids)
    }
    fn stage_positions(&self, positions: &[u32]) -> Result<(), RuntimeError> {
        self.inner.stage_positions(positions)
    }
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.rms_norm(x, w, eps)
    }
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.layer_norm(x, w, b, eps)
    }
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, RuntimeError> {
        self.inner.add(a, b)
    }
    fn reserve_rows(&self, t: &mut Self::Tensor, rows: usize) -> Result<(), RuntimeError> {
        self.inner.reserve_rows(t, rows)
    }
    fn glu(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.glu(x, gate, up)
    }
    fn matmul_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        acc: Self::Tensor,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.matmul_add(x, w, acc)
    }
    fn matmul_stacked(
        &self,
        x: &Self::Tensor,
        ws: &[&Self::Weight],
    ) -> Result<Vec<Self::Tensor>, RuntimeError> {
        self.inner.matmul_stacked(x, ws)
    }
    fn mla_queries(
        &self,
        q: &Self::Tensor,
        k_b: &Self::Weight,
        nope: usize,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.mla_queries(q, k_b, nope, positions, p)
    }
    fn mla_kv_rows(
        &self,
        kv_a: Self::Tensor,
        w: &Self::Weight,
        n: usize,
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&mut Self::Tensor>,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.mla_kv_rows(kv_a, w, n, eps, positions, p, cache)
    }
    fn indexer_keys(
        &self,
        k: Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
        positions: &[u32],
        p: &RopeParams,
        cache: Option<&mut Self::Tensor>,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.indexer_keys(k, w, b, eps, positions, p, cache)
    }
    fn mla_norms(
        &self,
        q: Option<(&Self::Tensor, &Self::Weight, f32)>,
        kv: KvRowsArgs<'_, Self::Tensor, Self::Weight>,
        ix: Option<IndexerKeysArgs<'_, Self::Tensor, Self::Weight>>,
        positions: &[u32],
    ) -> Result<MlaNormed<Self::Tensor>, RuntimeError> {
        self.inner.mla_norms(q, kv, ix, positions)
    }
    fn residual_into_norm(&self) -> bool {
        self.inner.residual_into_norm()
    }
    fn add_rms_norm(
        &self,
        res: &Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> Result<(Self::Tensor, Self::Tensor), RuntimeError> {
        self.inner.add_rms_norm(res, x, w, eps)
    }
    fn rms_norm_lead(
        &self,
        x: Self::Tensor,
        w: &Self::Weight,
        n: usize,
        eps: f32,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.rms_norm_lead(x, w, n, eps)
    }
    fn sample(
        &self,
        logits: &Self::Tensor,
        reqs: &[crate::sampling::SampleRequest],
    ) -> Result<Vec<(u32, bool)>, RuntimeError> {
        self.inner.sample(logits, reqs)
    }
    fn add_bias(&self, x: &Self::Tensor, b: &Self::Weight) -> Result<Self::Tensor, RuntimeError> {
        self.inner.add_bias(x, b)
    }
    fn scale(&self, x: &Self::Tensor, s: f32) -> Result<Self::Tensor, RuntimeError> {
        self.inner.scale(x, s)
    }
    fn silu_mul(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.silu_mul(gate, up)
    }
    fn rope(
        &self,
        x: &mut Self::Tensor,
        positions: &[u32],
        p: &RopeParams,
    ) -> Result<(), RuntimeError> {
        self.inner.rope(x, positions, p)
    }
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        p: &AttnParams,
        selected: Option<&Self::Index>,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.attention(q, k, v, p, selected)
    }
    fn attention_seqs(
        &self,
        q: &Self::Tensor,
        seqs: &[SeqAttn<'_, Self>],
        p: &AttnParams,
    ) -> Result<Self::Tensor, RuntimeError> {
        // The same sequences as the inner backend sees them (the tensors are its own).
        let inner: Vec<SeqAttn<'_, B>> = seqs
            .iter()
            .map(|s| SeqAttn {
                rows: s.rows,
                pos0: s.pos0,
                k: s.k,
                v: s.v,
                selected: s.selected,
            })
            .collect();
        self.inner.attention_seqs(q, &inner, p)
    }
    fn indexer_topk(
        &self,
        q: &Self::Tensor,
        weights: &Self::Tensor,
        keys: &Self::Tensor,
        p: &IndexerParams,
    ) -> Result<Self::Index, RuntimeError> {
        self.inner.indexer_topk(q, weights, keys, p)
    }
    fn moe_route(
        &self,
        logits: &Self::Tensor,
        bias: Option<&Self::Weight>,
        p: &RouteParams,
    ) -> Result<(Self::Tensor, Self::Index), RuntimeError> {
        self.inner.moe_route(logits, bias, p)
    }
    fn moe_ffn(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
        weights: &Self::Tensor,
        experts: &Self::Index,
    ) -> Result<Self::Tensor, RuntimeError> {
        self.inner.moe_ffn(x, gate, up, down, weights, experts)
    }

    fn rank(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world())
    }
    fn all_reduce_sum(&self, x: &mut Self::Tensor) -> Result<(), RuntimeError> {
        self.comm.all_reduce_sum(&self.inner, x)
    }
    fn all_gather_cols(&self, x: Self::Tensor) -> Result<Self::Tensor, RuntimeError> {
        self.comm.all_gather_cols(&self.inner, x)
    }
    fn local_expert_ids(
        &self,
        ids: Self::Index,
        first: usize,
        count: usize,
    ) -> Result<Self::Index, RuntimeError> {
        self.inner.local_expert_ids(ids, first, count)
    }
}

#[cfg(test)]
mod tests {
    use super::LoadTurns;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Turns exclude each other, every taker gets its turns, and a turn ended by a panic
    /// passes on to the next taker.
    #[test]
    fn load_turns_exclude_each_other_and_survive_a_panic() {
        let turns = Arc::new(LoadTurns::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (turns, inside, done) = (turns.clone(), inside.clone(), done.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _t = turns.take();
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two at once");
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("taker");
        }
        assert_eq!(done.load(Ordering::SeqCst), 800);
        let t2 = turns.clone();
        let r = std::thread::spawn(move || {
            let _t = t2.take();
            panic!("upload failed");
        })
        .join();
        assert!(r.is_err());
        // Would block forever had the panicking turn not ended.
        drop(turns.take());
    }
}
