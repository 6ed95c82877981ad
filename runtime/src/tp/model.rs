//! [`TpModel`]: N persistent rank threads behind one [`LanguageModel`]. Each thread owns one
//! rank's share of the weights (a [`GlmModel`] over its [`Ranked`] backend) and that rank's part
//! of every sequence's KV cache, keyed by a sequence id. A step is broadcast to every rank; the
//! ranks run the one forward definition in lock-step, meeting in their collectives, and rank 0
//! (or, for greedy top-k, every rank with its vocabulary slice) answers.
//!
//! A step that fails on any rank is undone on every rank (caches truncated to their lengths
//! before the step), so the sequences stay usable, as on a single device.

use super::backend::{LoadTurns, Ranked};
use super::host::GroupAborted;
use super::{MoeSplit, Shard, ShardView};
use crate::backend::Backend;
use crate::cache::KvCache;
use crate::glm::{GlmModel, HeadOutput};
use crate::lm::{local_top, merge_top, LanguageModel, LocalTop, SeqStep, SequenceState, TopTokens};
use crate::spec::ModelSpec;
use crate::RuntimeError;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

/// What a rank thread needs from its device: the backend (with its group's collectives) and
/// how to read the device memory left after the weights.
pub struct RankSetup<B: Backend> {
    pub backend: Ranked<B>,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    /// Free device memory in bytes, read after loading (the KV budget); `None`: host memory.
    pub free_memory: Option<Box<dyn Fn() -> Option<u64> + Send>>,
}

/// One rank's share, as loaded.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RankReport {
    pub rank: usize,
    pub device: String,
    /// Bytes of the weights this rank holds.
    pub weight_bytes: u64,
    /// Attention heads of this rank, and which.
    pub heads: usize,
    pub head_range: [usize; 2],
    /// Routed experts this rank computes (with `moe_split: column` every rank computes a slice
    /// of every expert: `expert_columns` of each expert's FFN columns).
    pub experts: usize,
    pub expert_range: [usize; 2],
    pub expert_columns: Option<[usize; 2]>,
    /// Vocabulary rows of the output head.
    pub vocab_range: [usize; 2],
    /// Tensors held as exact F32 values because their split cuts quant blocks.
    pub reencoded_f32: Vec<String>,
    /// Bytes that costs over the quantized shares.
    pub reencoded_extra_bytes: u64,
    /// KV cache bytes per token on this rank.
    pub cache_bytes_per_token: usize,
}

/// How a model is split, as loaded (`generate --json` reports it as `tp`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TpReport {
    pub world: usize,
    pub moe_split: MoeSplit,
    /// The collectives' implementation (`host`, `oneshot`, `nccl`).
    pub comm: String,
    pub ranks: Vec<RankReport>,
    /// Weight bytes over all ranks, and the wall time of the parallel load.
    pub load_bytes: u64,
    pub load_s: f64,
}

struct StepIn {
    seq: u64,
    /// Cache length before the step (checked on every rank).
    len: usize,
    tokens: Vec<u32>,
    all_logits: bool,
    /// A drafting sequence (its rank caches keep the draft layer's state).
    draft: bool,
}

#[derive(Clone, Copy)]
enum Want {
    Logits,
    TopK(usize),
}

enum Cmd {
    Forward {
        steps: Arc<Vec<StepIn>>,
        want: Want,
    },
    /// One draft-layer step of one sequence (trunk length `len`, checked on every rank).
    Draft {
        seq: u64,
        len: usize,
        tokens: Arc<Vec<u32>>,
    },
    /// Undo a failed step, or roll back rejected drafts: cache lengths to restore.
    Truncate(Vec<(u64, usize)>),
    Free(u64),
    /// Run `tokens` as a fresh sequence on every rank; rank 0 records its activations.
    Observe(Arc<Vec<u32>>),
    /// Clear an aborted group (rank 0 only; answered with `Reply::Done`).
    ResetComm,
    Stop,
}

enum RankOut {
    Logits(Vec<Vec<f32>>),
    Top(Vec<LocalTop>),
    Observed(Vec<Observed>),
}

/// One activation as a rank saw it (an owned copy of [`crate::glm::Activation`]).
#[derive(Debug, Clone)]
pub struct Observed {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub data: ObservedData,
}

#[derive(Debug, Clone)]
pub enum ObservedData {
    F32(Vec<f32>),
    Index(Vec<i64>),
}

struct Loaded {
    report: RankReport,
    free: Option<u64>,
    draft_layers: usize,
}

enum Reply {
    Loaded(Box<Result<Loaded, RuntimeError>>),
    Forward(Result<RankOut, RuntimeError>),
    Done,
}

/// A model split over tensor-parallel ranks.
pub struct TpModel {
    spec: ModelSpec,
    world: usize,
    txs: Vec<Sender<Cmd>>,
    /// Replies of all ranks; held for the whole of a step (steps are one at a time).
    rx: Mutex<Receiver<(usize, Reply)>>,
    threads: Vec<JoinHandle<()>>,
    next_id: AtomicU64,
    report: TpReport,
    cache_bytes_per_token: usize,
    capacity: Option<usize>,
    /// Draft layers every rank loaded.
    draft_layers: usize,
}

fn dead(world: usize) -> RuntimeError {
    RuntimeError::Tp {
        world,
        msg: "a rank thread has stopped".into(),
    }
}

fn is_abort(e: &RuntimeError) -> bool {
    matches!(e, RuntimeError::Tp { msg, .. } if *msg == GroupAborted.to_string())
}

impl TpModel {
    /// Load `model` over `world` ranks: one thread per rank runs `setup(rank)` (its device and
    /// communicator), then reads its share straight from the memory-mapped file. Ranks whose
    /// setups name the same device upload in turns, one weight at a time (one reader of the
    /// file per device); ranks on different devices load in parallel. `progress` is told the
    /// bytes of every weight uploaded (by any rank). `on_failure` is called when a rank fails
    /// to load, to release ranks waiting for it in their setup.
    pub fn load<B, F>(
        model: Arc<gguf::Model>,
        world: usize,
        moe: MoeSplit,
        setup: F,
        progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
        on_failure: Option<Arc<dyn Fn() + Send + Sync>>,
    ) -> Result<TpModel, RuntimeError>
    where
        B: Backend,
        F: Fn(usize) -> Result<RankSetup<B>, RuntimeError> + Send + Sync + 'static,
    {
        let spec = ModelSpec::from_model(&model)?;
        // Refuse an impossible split before starting anything (names the dimension).
        let views = (0..world)
            .map(|rank| ShardView::new(&spec, Shard { rank, world }, moe))
            .collect::<Result<Vec<_>, _>>()?;
        let t0 = Instant::now();
        let setup = Arc::new(setup);
        let loaders: Loaders = Arc::default();
        let (reply_tx, rx) = channel::<(usize, Reply)>();
        let mut txs = Vec::with_capacity(world);
        let mut threads = Vec::with_capacity(world);
        for (rank, view) in views.into_iter().enumerate() {
            let (tx, cmd_rx) = channel::<Cmd>();
            let (model, setup, reply) = (Arc::clone(&model), Arc::clone(&setup), reply_tx.clone());
            let (progress, loaders) = (progress.clone(), Arc::clone(&loaders));
            let h = std::thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .spawn(move || {
                    let loaded = catch_unwind(AssertUnwindSafe(|| {
                        load_rank(&model, view, &*setup, progress.as_deref(), &loaders)
                    }))
                    .unwrap_or_else(|_| {
                        Err(RuntimeError::Tp {
                            world,
                            msg: format!("rank {rank} panicked while loading"),
                        })
                    });
                    match loaded {
                        Ok((m, info)) => {
                            let _ = reply.send((rank, Reply::Loaded(Box::new(Ok(info)))));
                            rank_loop(rank, m, cmd_rx, reply);
                        }
                        Err(e) => {
                            let _ = reply.send((rank, Reply::Loaded(Box::new(Err(e)))));
                        }
                    }
                })
                .map_err(|e| RuntimeError::Tp {
                    world,
                    msg: format!("starting rank thread {rank}: {e}"),
                })?;
            txs.push(tx);
            threads.push(h);
        }
        drop(reply_tx);
        let mut infos: Vec<Option<Loaded>> = (0..world).map(|_| None).collect();
        let mut first_err = None;
        for _ in 0..world {
            let Ok((rank, reply)) = rx.recv() else {
                first_err.get_or_insert_with(|| dead(world));
                break;
            };
            match reply {
                Reply::Loaded(r) => match *r {
                    Ok(info) => infos[rank] = Some(info),
                    Err(e) => {
                        if first_err.is_none() {
                            if let Some(f) = &on_failure {
                                f();
                            }
                            first_err = Some(e);
                        }
                    }
                },
                _ => {
                    first_err.get_or_insert_with(|| dead(world));
                }
            }
        }
        let mut this = TpModel {
            spec,
            world,
            txs,
            rx: Mutex::new(rx),
            threads,
            next_id: AtomicU64::new(1),
            report: TpReport {
                world,
                moe_split: moe,
                comm: String::new(),
                ranks: Vec::new(),
                load_bytes: 0,
                load_s: 0.0,
            },
            cache_bytes_per_token: 0,
            capacity: None,
            draft_layers: 0,
        };
        if let Some(e) = first_err {
            // Dropping `this` stops and joins the ranks that did load.
            return Err(e);
        }
        let infos: Vec<Loaded> = infos.into_iter().flatten().collect();
        this.cache_bytes_per_token = infos.iter().map(|i| i.report.cache_bytes_per_token).sum();
        this.draft_layers = infos.iter().map(|i| i.draft_layers).min().unwrap_or(0);
        // The KV budget: the tightest rank's free memory, less the activation workspace, over
        // that rank's cache bytes per token (every rank grows by the same tokens).
        this.capacity = infos
            .iter()
            .map(|i| {
                i.free.map(|f| {
                    let ws = super::plan::workspace_bytes(&this.spec, world);
                    (f.saturating_sub(ws) / i.report.cache_bytes_per_token.max(1) as u64) as usize
                })
            })
            .collect::<Option<Vec<usize>>>()
            .and_then(|v| v.into_iter().min());
        this.report.ranks = infos.into_iter().map(|i| i.report).collect();
        this.report.load_bytes = this.report.ranks.iter().map(|r| r.weight_bytes).sum();
        this.report.load_s = t0.elapsed().as_secs_f64();
        Ok(this)
    }

    /// Set by the loader that knows the communicator (reports only).
    pub fn set_comm_kind(&mut self, kind: String) {
        self.report.comm = kind;
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Run one step on every rank; on any failure undo it everywhere.
    fn run(&self, steps: Vec<StepIn>, want: Want) -> Result<Vec<RankOut>, RuntimeError> {
        let undo: Vec<(u64, usize)> = steps.iter().map(|s| (s.seq, s.len)).collect();
        let steps = Arc::new(steps);
        self.broadcast(
            || Cmd::Forward {
                steps: Arc::clone(&steps),
                want,
            },
            undo,
        )
    }

    /// Rank 0's activations of a fresh sequence over `tokens` (every rank runs the step): the
    /// replicated and all-reduced ones (norms, the latent, the indexer, the router, each block's
    /// attention and FFN outputs after their all-reduce) are the unsharded model's; the
    /// head- or vocabulary-split ones have the rank's local shape.
    pub fn observe_rank0(&self, tokens: &[u32]) -> Result<Vec<Observed>, RuntimeError> {
        crate::glm::check_step(&self.spec, 0, tokens)?;
        let tokens = Arc::new(tokens.to_vec());
        let mut outs = self.broadcast(|| Cmd::Observe(Arc::clone(&tokens)), Vec::new())?;
        match outs.swap_remove(0) {
            RankOut::Observed(v) => Ok(v),
            _ => Err(RuntimeError::Tp {
                world: self.world,
                msg: "rank 0 returned no activations".into(),
            }),
        }
    }

    /// Send `cmd()` to every rank and collect their answers; on any failure roll the caches of
    /// `undo` back everywhere.
    fn broadcast(
        &self,
        cmd: impl Fn() -> Cmd,
        undo: Vec<(u64, usize)>,
    ) -> Result<Vec<RankOut>, RuntimeError> {
        let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        for tx in &self.txs {
            tx.send(cmd()).map_err(|_| dead(self.world))?;
        }
        let mut outs: Vec<Option<Result<RankOut, RuntimeError>>> =
            (0..self.world).map(|_| None).collect();
        for _ in 0..self.world {
            match rx.recv().map_err(|_| dead(self.world))? {
                (r, Reply::Forward(o)) => outs[r] = Some(o),
                _ => return Err(dead(self.world)),
            }
        }
        let outs: Vec<Result<RankOut, RuntimeError>> = outs
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(dead(self.world))))
            .collect();
        if outs.iter().all(Result::is_ok) {
            return Ok(outs.into_iter().flatten().collect());
        }
        for tx in &self.txs {
            tx.send(Cmd::Truncate(undo.clone()))
                .map_err(|_| dead(self.world))?;
        }
        self.txs[0]
            .send(Cmd::ResetComm)
            .map_err(|_| dead(self.world))?;
        match rx.recv() {
            Ok((_, Reply::Done)) => {}
            _ => return Err(dead(self.world)),
        }
        let errs: Vec<RuntimeError> = outs.into_iter().filter_map(Result::err).collect();
        let pick = errs.iter().position(|e| !is_abort(e)).unwrap_or(0);
        Err(errs
            .into_iter()
            .nth(pick)
            .unwrap_or_else(|| dead(self.world)))
    }

    /// Check a batch and turn it into rank steps.
    fn steps(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<StepIn>, RuntimeError> {
        let mut out: Vec<StepIn> = Vec::with_capacity(batch.len());
        for s in batch.iter_mut() {
            let seq =
                s.seq.as_any_mut().downcast_mut::<TpSeq>().ok_or_else(|| {
                    RuntimeError::Backend("sequence state of another model".into())
                })?;
            crate::glm::check_step(&self.spec, seq.len, s.tokens)?;
            if out.iter().any(|o| o.seq == seq.id) {
                return Err(RuntimeError::Backend(
                    "the same sequence twice in one step".into(),
                ));
            }
            out.push(StepIn {
                seq: seq.id,
                len: seq.len,
                tokens: s.tokens.to_vec(),
                all_logits: s.all_logits,
                draft: seq.draft,
            });
        }
        Ok(out)
    }

    fn advance(batch: &mut [SeqStep<'_>]) {
        for s in batch.iter_mut() {
            if let Some(seq) = s.seq.as_any_mut().downcast_mut::<TpSeq>() {
                seq.len += s.tokens.len();
            }
        }
    }
}

impl Drop for TpModel {
    fn drop(&mut self) {
        for tx in &self.txs {
            let _ = tx.send(Cmd::Stop);
        }
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// The loader of each device (by the name its ranks' setups give it).
type Loaders = Arc<Mutex<HashMap<String, Arc<LoadTurns>>>>;

fn load_rank<B: Backend>(
    model: &Arc<gguf::Model>,
    view: ShardView,
    setup: &(dyn Fn(usize) -> Result<RankSetup<B>, RuntimeError> + Send + Sync),
    progress: Option<&(dyn Fn(u64) + Send + Sync)>,
    loaders: &Loaders,
) -> Result<(GlmModel<Ranked<B>>, Loaded), RuntimeError> {
    let rank = view.rank;
    let s = setup(rank)?;
    let loader = Arc::clone(
        loaders
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(s.device.clone())
            .or_default(),
    );
    let backend = s.backend.with_loader(loader);
    let progress = progress.map(|p| p as &(dyn Fn(u64) + Sync));
    let m = GlmModel::load_view(backend, Arc::clone(model), Some(view), progress)?;
    let report = rank_report(&m, s.device);
    let free = s.free_memory.as_ref().and_then(|f| f());
    let draft_layers = m.mtp_layers().len();
    Ok((
        m,
        Loaded {
            report,
            free,
            draft_layers,
        },
    ))
}

/// What rank `m` holds.
pub(crate) fn rank_report<B: Backend>(m: &GlmModel<B>, device: String) -> RankReport {
    let v = m.view();
    let st = m.load_stats();
    RankReport {
        rank: v.rank,
        device,
        weight_bytes: st.weight_bytes,
        heads: v.heads.len(),
        head_range: [v.heads.start, v.heads.end],
        experts: v.experts.len(),
        expert_range: [v.experts.start, v.experts.end],
        expert_columns: match (m.spec().moe, v.moe, v.world) {
            (Some(e), MoeSplit::Columns, w) if w > 1 => {
                let per = e.n_ff / w;
                Some([v.rank * per, (v.rank + 1) * per])
            }
            _ => None,
        },
        vocab_range: [v.vocab.start, v.vocab.end],
        reencoded_f32: st.reencoded.iter().map(|(n, _)| n.clone()).collect(),
        reencoded_extra_bytes: st.reencoded.iter().map(|(_, b)| b).sum(),
        cache_bytes_per_token: m.cache_bytes_per_token(),
    }
}

/// The rank thread: its caches by sequence id, commands in order.
fn rank_loop<B: Backend>(
    rank: usize,
    model: GlmModel<Ranked<B>>,
    rx: Receiver<Cmd>,
    reply: Sender<(usize, Reply)>,
) {
    let mut caches: HashMap<u64, KvCache<Ranked<B>>> = HashMap::new();
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Cmd::Forward { steps, want } => {
                let r = guarded(rank, &model, "a forward pass", || {
                    rank_step(rank, &model, &mut caches, &steps, want)
                });
                if reply.send((rank, Reply::Forward(r))).is_err() {
                    return;
                }
            }
            Cmd::Draft { seq, len, tokens } => {
                let r = guarded(rank, &model, "a draft step", || {
                    let c = caches
                        .get_mut(&seq)
                        .filter(|c| c.len() == len)
                        .ok_or_else(|| {
                            RuntimeError::Backend(format!(
                                "rank {rank}: no cache of length {len} for sequence {seq}"
                            ))
                        })?;
                    let head = if rank == 0 {
                        HeadOutput::Gathered
                    } else {
                        HeadOutput::GatherOnly
                    };
                    model
                        .forward_draft(c, &tokens, head, None)
                        .map(|l| RankOut::Logits(vec![l]))
                });
                if reply.send((rank, Reply::Forward(r))).is_err() {
                    return;
                }
            }
            Cmd::Observe(tokens) => {
                let r = guarded(rank, &model, "an observed forward pass", || {
                    let mut cache = model.new_cache()?;
                    let mut out = Vec::new();
                    let mut record = |name: &str, a: crate::glm::Activation<'_>| {
                        out.push(match a {
                            crate::glm::Activation::F32 { rows, cols, data } => Observed {
                                name: name.to_string(),
                                rows,
                                cols,
                                data: ObservedData::F32(data.to_vec()),
                            },
                            crate::glm::Activation::Index { rows, cols, data } => Observed {
                                name: name.to_string(),
                                rows,
                                cols,
                                data: ObservedData::Index(data.to_vec()),
                            },
                        })
                    };
                    let mut b = [SeqStep {
                        seq: &mut cache,
                        tokens: &tokens,
                        all_logits: true,
                    }];
                    let obs: Option<crate::glm::Observer<'_>> =
                        if rank == 0 { Some(&mut record) } else { None };
                    model.forward_observed(&mut b, obs)?;
                    Ok(RankOut::Observed(out))
                });
                if reply.send((rank, Reply::Forward(r))).is_err() {
                    return;
                }
            }
            Cmd::Truncate(lens) => {
                for (id, len) in lens {
                    if len == 0 {
                        caches.remove(&id);
                    } else if let Some(c) = caches.get_mut(&id) {
                        // Best effort: a cache that cannot shrink fails its next step.
                        let _ = c.rollback(len);
                    }
                }
            }
            Cmd::Free(id) => {
                caches.remove(&id);
            }
            Cmd::ResetComm => {
                model.backend().comm().reset();
                if reply.send((rank, Reply::Done)).is_err() {
                    return;
                }
            }
            Cmd::Stop => return,
        }
    }
}

/// Run one rank's part of a step: a panic becomes an error, and any error releases the ranks
/// waiting for this one in a collective.
fn guarded<B: Backend>(
    rank: usize,
    model: &GlmModel<Ranked<B>>,
    what: &str,
    f: impl FnOnce() -> Result<RankOut, RuntimeError>,
) -> Result<RankOut, RuntimeError> {
    let r = catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| {
            Err(RuntimeError::Tp {
                world: model.view().world,
                msg: format!("rank {rank} panicked during {what}"),
            })
        })
        .and_then(|out| model.backend().comm().check().map(|()| out));
    if r.is_err() {
        model.backend().comm().abort();
    }
    r
}

fn rank_step<B: Backend>(
    rank: usize,
    model: &GlmModel<Ranked<B>>,
    caches: &mut HashMap<u64, KvCache<Ranked<B>>>,
    steps: &[StepIn],
    want: Want,
) -> Result<RankOut, RuntimeError> {
    // Take the step's caches out of the map for the duration of the step.
    let mut taken: Vec<KvCache<Ranked<B>>> = Vec::with_capacity(steps.len());
    let mut failure = None;
    for s in steps {
        let c = match caches.remove(&s.seq) {
            Some(c) => c,
            None if s.len == 0 => match if s.draft {
                model.new_draft_cache()
            } else {
                model.new_cache()
            } {
                Ok(c) => c,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            },
            None => {
                failure = Some(RuntimeError::Backend(format!(
                    "rank {rank}: no cache for sequence {} of length {}",
                    s.seq, s.len
                )));
                break;
            }
        };
        if c.len() != s.len {
            failure = Some(RuntimeError::Backend(format!(
                "rank {rank}: sequence {} has {} cached tokens, the step expects {}",
                s.seq,
                c.len(),
                s.len
            )));
        }
        taken.push(c);
    }
    let result = match failure {
        Some(e) => Err(e),
        None => {
            let mut batch: Vec<SeqStep<'_>> = taken
                .iter_mut()
                .zip(steps)
                .map(|(c, s)| SeqStep {
                    seq: c as &mut dyn SequenceState,
                    tokens: &s.tokens,
                    all_logits: s.all_logits,
                })
                .collect();
            match want {
                Want::Logits => {
                    let head = if rank == 0 {
                        HeadOutput::Gathered
                    } else {
                        HeadOutput::GatherOnly
                    };
                    model
                        .forward_head(&mut batch, head, None)
                        .map(RankOut::Logits)
                }
                Want::TopK(k) => {
                    let id0 = model.view().vocab.start as u32;
                    model
                        .forward_head(&mut batch, HeadOutput::Local, None)
                        .map(|l| RankOut::Top(l.iter().map(|v| local_top(v, k, id0)).collect()))
                }
            }
        }
    };
    for (c, s) in taken.into_iter().zip(steps) {
        caches.insert(s.seq, c);
    }
    result
}

/// A sequence of a [`TpModel`]: its id on the ranks and its length. Dropping it frees the
/// ranks' caches.
struct TpSeq {
    id: u64,
    len: usize,
    draft: bool,
    bytes_per_token: usize,
    txs: Vec<Sender<Cmd>>,
}

impl SequenceState for TpSeq {
    fn len(&self) -> usize {
        self.len
    }
    fn cache_bytes(&self) -> usize {
        self.len * self.bytes_per_token
    }
    fn truncate(&mut self, len: usize) -> Result<(), RuntimeError> {
        if len > self.len {
            return Err(RuntimeError::Backend(format!(
                "truncate to {len} tokens: the sequence holds {}",
                self.len
            )));
        }
        // Commands are applied in order on every rank, before any later step.
        for tx in &self.txs {
            tx.send(Cmd::Truncate(vec![(self.id, len)]))
                .map_err(|_| RuntimeError::Tp {
                    world: self.txs.len(),
                    msg: "a rank thread has stopped".into(),
                })?;
        }
        self.len = len;
        Ok(())
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl Drop for TpSeq {
    fn drop(&mut self) {
        for tx in &self.txs {
            let _ = tx.send(Cmd::Free(self.id));
        }
    }
}

impl LanguageModel for TpModel {
    fn new_sequence(&self) -> Box<dyn SequenceState> {
        Box::new(TpSeq {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            len: 0,
            draft: false,
            bytes_per_token: self.cache_bytes_per_token,
            txs: self.txs.clone(),
        })
    }
    fn draft_layers(&self) -> usize {
        self.draft_layers
    }
    fn new_draft_sequence(&self) -> Result<Box<dyn SequenceState>, RuntimeError> {
        if self.draft_layers == 0 {
            return Err(RuntimeError::NoDraftLayer);
        }
        Ok(Box::new(TpSeq {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            len: 0,
            draft: true,
            bytes_per_token: self.cache_bytes_per_token,
            txs: self.txs.clone(),
        }))
    }
    fn draft_forward(
        &self,
        seq: &mut dyn SequenceState,
        tokens: &[u32],
    ) -> Result<Vec<f32>, RuntimeError> {
        let seq = seq
            .as_any_mut()
            .downcast_mut::<TpSeq>()
            .filter(|s| s.draft)
            .ok_or_else(|| {
                RuntimeError::Backend("draft step on a sequence made without a draft layer".into())
            })?;
        let tokens = Arc::new(tokens.to_vec());
        let (id, len) = (seq.id, seq.len);
        let mut outs = self.broadcast(
            || Cmd::Draft {
                seq: id,
                len,
                tokens: Arc::clone(&tokens),
            },
            vec![(id, len)],
        )?;
        match outs.swap_remove(0) {
            RankOut::Logits(mut l) if l.len() == 1 => Ok(l.swap_remove(0)),
            _ => Err(RuntimeError::Tp {
                world: self.world,
                msg: "rank 0 returned no draft logits".into(),
            }),
        }
    }
    fn vocab_size(&self) -> usize {
        self.spec.n_vocab
    }
    fn context_length(&self) -> usize {
        self.spec.n_ctx_train
    }
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let steps = self.steps(batch)?;
        let n = steps.len();
        let mut outs = self.run(steps, Want::Logits)?;
        match outs.swap_remove(0) {
            RankOut::Logits(l) if l.len() == n => {
                Self::advance(batch);
                Ok(l)
            }
            _ => Err(RuntimeError::Tp {
                world: self.world,
                msg: "rank 0 returned no logits".into(),
            }),
        }
    }
    fn forward_top_k(
        &self,
        batch: &mut [SeqStep<'_>],
        k: usize,
    ) -> Result<Vec<TopTokens>, RuntimeError> {
        crate::lm::last_positions_only(batch)?;
        let steps = self.steps(batch)?;
        let n = steps.len();
        let outs = self.run(steps, Want::TopK(k))?;
        let mut per_rank = Vec::with_capacity(outs.len());
        for o in outs {
            match o {
                RankOut::Top(t) if t.len() == n => per_rank.push(t),
                _ => {
                    return Err(RuntimeError::Tp {
                        world: self.world,
                        msg: "a rank returned no candidates".into(),
                    })
                }
            }
        }
        Self::advance(batch);
        Ok((0..n)
            .map(|i| {
                let parts: Vec<LocalTop> = per_rank.iter().map(|r| r[i].clone()).collect();
                merge_top(&parts, k)
            })
            .collect())
    }
    fn tp_report(&self) -> Option<TpReport> {
        Some(self.report.clone())
    }
    fn cache_capacity_tokens(&self) -> Option<usize> {
        self.capacity
    }
}
