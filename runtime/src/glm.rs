//! The forward pass of the GLM-5 family (`glm-dsa`; `deepseek2` and `glm4moe` share it), written
//! once against the [`Backend`] ops. Follows transformers' `GlmMoeDsaForCausalLM` (spec §1):
//! MLA attention with interleaved RoPE on the rope dims, the DSA lightning indexer choosing the
//! keys each query may attend to, dense FFN blocks then MoE blocks with a sigmoid router.
//!
//! Attention runs "absorbed" by default (queries mapped into the latent space by `attn_k_b`,
//! attention over the cached latents, outputs mapped back by `attn_v_b`), as llama.cpp does;
//! [`AttnMode::Naive`] expands keys and values through the reassembled `kv_b` like transformers.
//! Both give the same numbers up to f32 rounding (tested).

use crate::backend::{AttnParams, Backend, IndexerParams, RopeParams, RouteParams};
use crate::cache::KvCache;
use crate::lm::{LanguageModel, SeqStep, SequenceState};
use crate::spec::{AttentionSpec, FfnKind, GqaSpec, LayerSpec, MlaSpec, ModelSpec};
use crate::weights::HostWeight;
use crate::RuntimeError;
use std::sync::Arc;

/// A named intermediate activation handed to an observer (host copies, rows = tokens).
#[derive(Debug, Clone, Copy)]
pub enum Activation<'a> {
    F32 {
        rows: usize,
        cols: usize,
        data: &'a [f32],
    },
    /// Integer results (selected key positions, chosen experts); `-1` = empty slot.
    Index {
        rows: usize,
        cols: usize,
        data: &'a [i64],
    },
}

/// Receives `(name, activation)` pairs such as `blk.3.attn_output.out` during a forward pass.
pub type Observer<'o> = &'o mut dyn FnMut(&str, Activation<'_>);

/// How MLA attention is evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnMode {
    /// Attention over the latent cache (`attn_k_b` / `attn_v_b`).
    Absorbed,
    /// Keys and values expanded from the latent through `kv_b`, as transformers does.
    Naive,
}

struct Mla<B: Backend> {
    /// `(attn_q_a, attn_q_a_norm)` when queries are low-rank.
    q_a: Option<(B::Weight, B::Weight)>,
    /// `attn_q_b`, or `attn_q` without q_lora.
    q_b: B::Weight,
    kv_a: B::Weight,
    kv_a_norm: B::Weight,
    k_b: B::Weight,
    v_b: B::Weight,
    /// Host copies (shared bytes) of k_b / v_b, to reassemble `kv_b` on demand.
    k_b_host: HostWeight,
    v_b_host: HostWeight,
    /// Reassembled `kv_b` for [`AttnMode::Naive`].
    kv_b: Option<B::Weight>,
    out: B::Weight,
}

struct Gqa<B: Backend> {
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    bias: Option<[B::Weight; 3]>,
    qk_norm: Option<[B::Weight; 2]>,
    out: B::Weight,
}

enum Attn<B: Backend> {
    Mla(Mla<B>),
    Gqa(Gqa<B>),
}

struct Indexer<B: Backend> {
    q_b: B::Weight,
    k: B::Weight,
    k_norm: B::Weight,
    k_norm_b: B::Weight,
    proj: B::Weight,
}

struct Mlp<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe {
        router: B::Weight,
        bias: Option<B::Weight>,
        gate: B::Weight,
        up: B::Weight,
        down: B::Weight,
        shared: Option<Mlp<B>>,
    },
}

struct Layer<B: Backend> {
    spec: LayerSpec,
    attn_norm: B::Weight,
    ffn_norm: B::Weight,
    attn: Attn<B>,
    indexer: Option<Indexer<B>>,
    ffn: Ffn<B>,
}

/// NextN / multi-token-prediction block weights, loaded for later use (speculative decoding);
/// the forward pass does not run them.
pub struct MtpLayer<B: Backend> {
    #[allow(dead_code)]
    layer: Layer<B>,
    pub eh_proj: B::Weight,
    pub enorm: B::Weight,
    pub hnorm: B::Weight,
    pub shared_head_norm: B::Weight,
    pub embed_tokens: Option<B::Weight>,
    pub shared_head_head: Option<B::Weight>,
}

/// A loaded model of the GLM-5 family on backend `B`.
pub struct GlmModel<B: Backend> {
    spec: ModelSpec,
    backend: B,
    token_embd: B::Weight,
    output_norm: B::Weight,
    /// `None`: tied to `token_embd`.
    output: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    mtp: Vec<MtpLayer<B>>,
    mode: AttnMode,
}

fn model_err(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::Model(msg.into())
}

/// Reassemble HF's `kv_b_proj` (`[n_head * (nope + v), kv_lora]` row-major, i.e. ggml dims
/// `{kv_lora, n_head * (nope + v)}`) from the GGUF split (spec §2.5):
/// `W[h*(nope+v) + i, r] = K(i, r, h)`, `W[h*(nope+v) + nope + j, r] = V(r, j, h)`.
pub fn join_kv_b(k_b: &[f32], v_b: &[f32], m: &MlaSpec) -> Vec<f32> {
    let (nope, v, r_n, h_n) = (m.qk_nope, m.v_head, m.kv_lora_rank, m.n_head);
    let mut w = vec![0f32; h_n * (nope + v) * r_n];
    for h in 0..h_n {
        for i in 0..nope {
            for r in 0..r_n {
                w[(h * (nope + v) + i) * r_n + r] = k_b[h * r_n * nope + r * nope + i];
            }
        }
        for j in 0..v {
            let dst = (h * (nope + v) + nope + j) * r_n;
            let src = h * v * r_n + j * r_n;
            w[dst..dst + r_n].copy_from_slice(&v_b[src..src + r_n]);
        }
    }
    w
}

/// Inverse of [`join_kv_b`]: `(k_b {nope, kv_lora, n_head}, v_b {kv_lora, v, n_head})`.
pub fn split_kv_b(kv_b: &[f32], m: &MlaSpec) -> (Vec<f32>, Vec<f32>) {
    let (nope, v, r_n, h_n) = (m.qk_nope, m.v_head, m.kv_lora_rank, m.n_head);
    let mut k_b = vec![0f32; h_n * r_n * nope];
    let mut v_b = vec![0f32; h_n * v * r_n];
    for h in 0..h_n {
        for i in 0..nope {
            for r in 0..r_n {
                k_b[h * r_n * nope + r * nope + i] = kv_b[(h * (nope + v) + i) * r_n + r];
            }
        }
        for j in 0..v {
            let src = (h * (nope + v) + nope + j) * r_n;
            let dst = h * v * r_n + j * r_n;
            v_b[dst..dst + r_n].copy_from_slice(&kv_b[src..src + r_n]);
        }
    }
    (k_b, v_b)
}

/// Loads weights by name through a closure so tests can build models from synthetic tensors.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    get: &'a dyn Fn(&str) -> Result<Option<HostWeight>, RuntimeError>,
}

impl<B: Backend> Loader<'_, B> {
    fn host(&self, name: &str) -> Result<HostWeight, RuntimeError> {
        (self.get)(name)?.ok_or_else(|| model_err(format!("missing tensor {name}")))
    }
    fn req(&self, name: &str) -> Result<B::Weight, RuntimeError> {
        self.backend.upload(self.host(name)?)
    }
    fn opt(&self, name: &str) -> Result<Option<B::Weight>, RuntimeError> {
        (self.get)(name)?
            .map(|w| self.backend.upload(w))
            .transpose()
    }
}

impl<B: Backend> GlmModel<B> {
    /// Load an open GGUF model onto `backend` (the spec checks every tensor first).
    pub fn load(backend: B, model: Arc<gguf::Model>) -> Result<Self, RuntimeError> {
        let spec = ModelSpec::from_model(&model)?;
        let get = |name: &str| -> Result<Option<HostWeight>, RuntimeError> {
            if model.tensor(name).is_none() {
                return Ok(None);
            }
            HostWeight::from_model(&model, name).map(Some)
        };
        Self::from_weights(backend, spec, &get)
    }

    /// Build from a spec and a weight source (`get(name)` = `Ok(None)` when absent).
    pub fn from_weights(
        backend: B,
        spec: ModelSpec,
        get: &dyn Fn(&str) -> Result<Option<HostWeight>, RuntimeError>,
    ) -> Result<Self, RuntimeError> {
        let ld = Loader {
            backend: &backend,
            get,
        };
        let token_embd = ld.req("token_embd.weight")?;
        let output_norm = ld.req("output_norm.weight")?;
        let output = ld.opt("output.weight")?;
        let mut layers = Vec::with_capacity(spec.n_layer);
        let mut mtp = Vec::new();
        for ls in &spec.layers {
            if ls.mtp && get(&format!("blk.{}.nextn.eh_proj.weight", ls.index))?.is_none() {
                continue;
            }
            let layer = Self::load_layer(&ld, &spec, ls)?;
            if ls.mtp {
                let b = |s: &str| format!("blk.{}.nextn.{s}", ls.index);
                mtp.push(MtpLayer {
                    layer,
                    eh_proj: ld.req(&b("eh_proj.weight"))?,
                    enorm: ld.req(&b("enorm.weight"))?,
                    hnorm: ld.req(&b("hnorm.weight"))?,
                    shared_head_norm: ld.req(&b("shared_head_norm.weight"))?,
                    embed_tokens: ld.opt(&b("embed_tokens.weight"))?,
                    shared_head_head: ld.opt(&b("shared_head_head.weight"))?,
                });
            } else {
                layers.push(layer);
            }
        }
        if layers.len() != spec.n_layer {
            return Err(model_err(format!(
                "{} trunk layers loaded, spec has {}",
                layers.len(),
                spec.n_layer
            )));
        }
        Ok(Self {
            spec,
            backend,
            token_embd,
            output_norm,
            output,
            layers,
            mtp,
            mode: AttnMode::Absorbed,
        })
    }

    fn load_layer(
        ld: &Loader<'_, B>,
        spec: &ModelSpec,
        ls: &LayerSpec,
    ) -> Result<Layer<B>, RuntimeError> {
        let b = |s: &str| format!("blk.{}.{s}", ls.index);
        let attn = match &spec.attention {
            AttentionSpec::Mla(m) => {
                let q_a = match m.q_lora_rank {
                    Some(_) => Some((
                        ld.req(&b("attn_q_a.weight"))?,
                        ld.req(&b("attn_q_a_norm.weight"))?,
                    )),
                    None => None,
                };
                let q_b = if q_a.is_some() {
                    ld.req(&b("attn_q_b.weight"))?
                } else {
                    ld.req(&b("attn_q.weight"))?
                };
                let (k_b_host, v_b_host) = if spec.kv_b_unsplit {
                    let kv = ld.host(&b("attn_kv_b.weight"))?.to_f32()?;
                    let (k, v) = split_kv_b(&kv, m);
                    (
                        HostWeight::from_f32(
                            b("attn_k_b.weight"),
                            vec![m.qk_nope, m.kv_lora_rank, m.n_head],
                            &k,
                        )?,
                        HostWeight::from_f32(
                            b("attn_v_b.weight"),
                            vec![m.kv_lora_rank, m.v_head, m.n_head],
                            &v,
                        )?,
                    )
                } else {
                    (
                        ld.host(&b("attn_k_b.weight"))?,
                        ld.host(&b("attn_v_b.weight"))?,
                    )
                };
                let k_b = ld.backend.upload(k_b_host.clone())?;
                let v_b = ld.backend.upload(v_b_host.clone())?;
                Attn::Mla(Mla {
                    q_a,
                    q_b,
                    kv_a: ld.req(&b("attn_kv_a_mqa.weight"))?,
                    kv_a_norm: ld.req(&b("attn_kv_a_norm.weight"))?,
                    k_b,
                    v_b,
                    k_b_host,
                    v_b_host,
                    kv_b: None,
                    out: ld.req(&b("attn_output.weight"))?,
                })
            }
            AttentionSpec::Gqa(g) => Attn::Gqa(Gqa {
                q: ld.req(&b("attn_q.weight"))?,
                k: ld.req(&b("attn_k.weight"))?,
                v: ld.req(&b("attn_v.weight"))?,
                bias: if g.bias {
                    Some([
                        ld.req(&b("attn_q.bias"))?,
                        ld.req(&b("attn_k.bias"))?,
                        ld.req(&b("attn_v.bias"))?,
                    ])
                } else {
                    None
                },
                qk_norm: if g.qk_norm {
                    Some([
                        ld.req(&b("attn_q_norm.weight"))?,
                        ld.req(&b("attn_k_norm.weight"))?,
                    ])
                } else {
                    None
                },
                out: ld.req(&b("attn_output.weight"))?,
            }),
        };
        let indexer = if ls.own_indexer {
            Some(Indexer {
                q_b: ld.req(&b("indexer.attn_q_b.weight"))?,
                k: ld.req(&b("indexer.attn_k.weight"))?,
                k_norm: ld.req(&b("indexer.k_norm.weight"))?,
                k_norm_b: ld.req(&b("indexer.k_norm.bias"))?,
                proj: ld.req(&b("indexer.proj.weight"))?,
            })
        } else {
            None
        };
        let ffn = match (ls.ffn, &spec.moe) {
            (FfnKind::Moe, Some(e)) => Ffn::Moe {
                router: ld.req(&b("ffn_gate_inp.weight"))?,
                bias: ld.opt(&b("exp_probs_b.bias"))?,
                gate: ld.req(&b("ffn_gate_exps.weight"))?,
                up: ld.req(&b("ffn_up_exps.weight"))?,
                down: ld.req(&b("ffn_down_exps.weight"))?,
                shared: if e.n_shared > 0 {
                    Some(Mlp {
                        gate: ld.req(&b("ffn_gate_shexp.weight"))?,
                        up: ld.req(&b("ffn_up_shexp.weight"))?,
                        down: ld.req(&b("ffn_down_shexp.weight"))?,
                    })
                } else {
                    None
                },
            },
            _ => Ffn::Dense(Mlp {
                gate: ld.req(&b("ffn_gate.weight"))?,
                up: ld.req(&b("ffn_up.weight"))?,
                down: ld.req(&b("ffn_down.weight"))?,
            }),
        };
        Ok(Layer {
            spec: ls.clone(),
            attn_norm: ld.req(&b("attn_norm.weight"))?,
            ffn_norm: ld.req(&b("ffn_norm.weight"))?,
            attn,
            indexer,
            ffn,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The NextN blocks' weights (not used by the forward pass yet).
    pub fn mtp_layers(&self) -> &[MtpLayer<B>] {
        &self.mtp
    }
    pub fn attn_mode(&self) -> AttnMode {
        self.mode
    }

    /// Switch MLA evaluation; [`AttnMode::Naive`] reassembles `kv_b` per layer (host f32).
    pub fn set_attn_mode(&mut self, mode: AttnMode) -> Result<(), RuntimeError> {
        if let (AttnMode::Naive, AttentionSpec::Mla(m)) = (mode, &self.spec.attention) {
            for (li, layer) in self.layers.iter_mut().enumerate() {
                if let Attn::Mla(a) = &mut layer.attn {
                    if a.kv_b.is_none() {
                        let w = join_kv_b(&a.k_b_host.to_f32()?, &a.v_b_host.to_f32()?, m);
                        a.kv_b = Some(self.backend.upload(HostWeight::from_f32(
                            format!("blk.{li}.attn_kv_b.weight"),
                            vec![m.kv_lora_rank, m.n_head * (m.qk_nope + m.v_head)],
                            &w,
                        )?)?);
                    }
                }
            }
        }
        self.mode = mode;
        Ok(())
    }

    /// A fresh, empty cache for this model.
    pub fn new_cache(&self) -> Result<KvCache<B>, RuntimeError> {
        let widths: Vec<_> = self
            .layers
            .iter()
            .map(|l| match &self.spec.attention {
                AttentionSpec::Mla(m) => (
                    m.cache_width(),
                    None,
                    l.indexer
                        .as_ref()
                        .and(self.spec.indexer.map(|i| i.head_dim)),
                ),
                AttentionSpec::Gqa(g) => (
                    g.n_head_kv * g.head_dim,
                    Some(g.n_head_kv * g.head_dim),
                    None,
                ),
            })
            .collect();
        KvCache::new(&self.backend, &widths)
    }

    /// The batched forward pass with an optional observer of named activations. With several
    /// sequences the observed rows are the batch's rows stacked in order.
    pub fn forward_observed(
        &self,
        batch: &mut [SeqStep<'_>],
        mut obs: Option<Observer<'_>>,
    ) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let mut caches: Vec<&mut KvCache<B>> = Vec::with_capacity(batch.len());
        let mut tokens: Vec<u32> = Vec::new();
        let mut segs: Vec<Seg> = Vec::with_capacity(batch.len());
        let mut all_logits = Vec::with_capacity(batch.len());
        for step in batch.iter_mut() {
            let cache = step
                .seq
                .as_any_mut()
                .downcast_mut::<KvCache<B>>()
                .ok_or_else(|| RuntimeError::Backend("sequence state of another model".into()))?;
            let n = step.tokens.len();
            if n == 0 {
                return Err(RuntimeError::Backend("a step without tokens".into()));
            }
            let need = cache.len + n;
            if need > self.spec.n_ctx_train {
                return Err(RuntimeError::ContextExceeded {
                    need,
                    max: self.spec.n_ctx_train,
                });
            }
            if let Some(&bad) = step
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.spec.n_vocab)
            {
                return Err(RuntimeError::Backend(format!(
                    "token id {bad} out of range (vocabulary {})",
                    self.spec.n_vocab
                )));
            }
            segs.push(Seg {
                row0: tokens.len(),
                n,
                pos0: cache.len,
            });
            tokens.extend_from_slice(step.tokens);
            all_logits.push(step.all_logits);
            caches.push(cache);
        }
        let lens: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let result = self.run(&tokens, &segs, &all_logits, &mut caches, &mut obs);
        match result {
            Ok(out) => {
                for (c, s) in caches.iter_mut().zip(&segs) {
                    c.len = s.pos0 + s.n;
                }
                Ok(out)
            }
            Err(e) => {
                for (c, &len) in caches.iter_mut().zip(&lens) {
                    // Best effort: the step failed anyway; keep the cache consistent.
                    let _ = c.truncate(len);
                }
                Err(e)
            }
        }
    }

    fn emit(
        &self,
        obs: &mut Option<Observer<'_>>,
        name: impl FnOnce() -> String,
        t: &B::Tensor,
    ) -> Result<(), RuntimeError> {
        if let Some(o) = obs.as_mut() {
            let (rows, cols) = self.backend.shape(t);
            let data = self.backend.to_host(t)?;
            o(
                &name(),
                Activation::F32 {
                    rows,
                    cols,
                    data: &data,
                },
            );
        }
        Ok(())
    }

    fn emit_index(
        &self,
        obs: &mut Option<Observer<'_>>,
        name: impl FnOnce() -> String,
        t: &B::Index,
    ) -> Result<(), RuntimeError> {
        if let Some(o) = obs.as_mut() {
            let (rows, cols, data) = self.backend.index_to_host(t)?;
            o(
                &name(),
                Activation::Index {
                    rows,
                    cols,
                    data: &data,
                },
            );
        }
        Ok(())
    }

    fn run(
        &self,
        tokens: &[u32],
        segs: &[Seg],
        all_logits: &[bool],
        caches: &mut [&mut KvCache<B>],
        obs: &mut Option<Observer<'_>>,
    ) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let be = &self.backend;
        let positions: Vec<u32> = segs
            .iter()
            .flat_map(|s| (s.pos0..s.pos0 + s.n).map(|p| p as u32))
            .collect();
        let mut h = be.embed(&self.token_embd, tokens)?;
        self.emit(obs, || "token_embd.out".into(), &h)?;
        // Selection of the last layer with its own indexer, per sequence (shared layers reuse it).
        let mut prev_sel: Vec<Option<B::Index>> = segs.iter().map(|_| None).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            let x = be.rms_norm(&h, &layer.attn_norm, self.spec.rms_eps)?;
            self.emit(obs, || format!("blk.{li}.attn_norm.out"), &x)?;
            let a = match (&layer.attn, &self.spec.attention) {
                (Attn::Mla(w), AttentionSpec::Mla(m)) => self.mla(
                    li,
                    layer,
                    w,
                    m,
                    &x,
                    &positions,
                    segs,
                    caches,
                    &mut prev_sel,
                    obs,
                )?,
                (Attn::Gqa(w), AttentionSpec::Gqa(g)) => {
                    self.gqa(li, w, g, &x, &positions, segs, caches)?
                }
                _ => return Err(model_err("attention weights do not match the spec")),
            };
            self.emit(obs, || format!("blk.{li}.attn_output.out"), &a)?;
            h = be.add(&h, &a)?;
            let x = be.rms_norm(&h, &layer.ffn_norm, self.spec.rms_eps)?;
            self.emit(obs, || format!("blk.{li}.ffn_norm.out"), &x)?;
            let f = self.ffn(li, &layer.ffn, &x, obs)?;
            self.emit(obs, || format!("blk.{li}.ffn.out"), &f)?;
            h = be.add(&h, &f)?;
            self.emit(obs, || format!("blk.{li}.out"), &h)?;
        }
        // Only the rows whose logits are wanted go through the head.
        let mut rows = Vec::new();
        for (s, &all) in segs.iter().zip(all_logits) {
            if all {
                rows.extend(s.row0..s.row0 + s.n);
            } else {
                rows.push(s.row0 + s.n - 1);
            }
        }
        let hs = be.gather_rows(&h, &rows)?;
        let hn = be.rms_norm(&hs, &self.output_norm, self.spec.rms_eps)?;
        self.emit(obs, || "output_norm.out".into(), &hn)?;
        let head = self.output.as_ref().unwrap_or(&self.token_embd);
        let logits = be.matmul(&hn, head)?;
        self.emit(obs, || "logits".into(), &logits)?;
        let host = be.to_host(&logits)?;
        let v = self.spec.n_vocab;
        let mut out = Vec::with_capacity(segs.len());
        let mut r = 0;
        for (s, &all) in segs.iter().zip(all_logits) {
            let n = if all { s.n } else { 1 };
            out.push(host[r * v..(r + n) * v].to_vec());
            r += n;
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn mla(
        &self,
        li: usize,
        layer: &Layer<B>,
        w: &Mla<B>,
        m: &MlaSpec,
        x: &B::Tensor,
        positions: &[u32],
        segs: &[Seg],
        caches: &mut [&mut KvCache<B>],
        prev_sel: &mut [Option<B::Index>],
        obs: &mut Option<Observer<'_>>,
    ) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        let rope = self.spec.rope;
        let h_n = m.n_head;
        let rope_p = |groups: usize, dim: usize| RopeParams {
            n_groups: groups,
            group_dim: dim,
            offset: 0,
            n_rot: rope.n_rot,
            theta: rope.theta,
            style: rope.style,
        };
        // Queries.
        let (q, q_resid) = match &w.q_a {
            Some((qa, qa_norm)) => {
                let r = be.matmul(x, qa)?;
                let r = be.rms_norm(&r, qa_norm, m.lora_norm_eps)?;
                self.emit(obs, || format!("blk.{li}.attn_q_a_norm.out"), &r)?;
                (be.matmul(&r, &w.q_b)?, Some(r))
            }
            None => (be.matmul(x, &w.q_b)?, None),
        };
        self.emit(obs, || format!("blk.{li}.attn_q_b.out"), &q)?;
        let q_nope = be.head_slice(&q, h_n, m.qk_head(), 0, m.qk_nope)?;
        let mut q_rot = be.head_slice(&q, h_n, m.qk_head(), m.qk_nope, m.qk_rope)?;
        be.rope(&mut q_rot, positions, &rope_p(h_n, m.qk_rope))?;
        // Compressed keys/values: normalised latent and the roped shared key part.
        let kv_a = be.matmul(x, &w.kv_a)?;
        self.emit(obs, || format!("blk.{li}.attn_kv_a_mqa.out"), &kv_a)?;
        let lat = be.slice_cols(&kv_a, 0, m.kv_lora_rank)?;
        let lat = be.rms_norm(&lat, &w.kv_a_norm, m.lora_norm_eps)?;
        self.emit(obs, || format!("blk.{li}.attn_kv_a_norm.out"), &lat)?;
        let mut k_rot = be.slice_cols(&kv_a, m.kv_lora_rank, m.qk_rope)?;
        be.rope(&mut k_rot, positions, &rope_p(1, m.qk_rope))?;
        let kv_rows = be.concat_cols(&[&lat, &k_rot])?;

        // Lightning indexer: keys always (they are cached), queries only when some query sees
        // more than top_k keys (otherwise every causal key is selected: dense attention).
        let mut ix_q = None;
        let mut ix_keys = None;
        if let (Some(ix), Some(iw)) = (&self.spec.indexer, &layer.indexer) {
            let mut k = be.matmul(x, &iw.k)?;
            k = be.layer_norm(&k, &iw.k_norm, &iw.k_norm_b, ix.norm_eps)?;
            be.rope(&mut k, positions, &rope_p(1, ix.head_dim))?;
            self.emit(obs, || format!("blk.{li}.indexer.k.out"), &k)?;
            ix_keys = Some(k);
            if segs.iter().any(|s| s.pos0 + s.n > ix.top_k) {
                let qr = q_resid
                    .as_ref()
                    .ok_or_else(|| model_err("indexer without q_lora"))?;
                let mut qi = be.matmul(qr, &iw.q_b)?;
                be.rope(&mut qi, positions, &rope_p(ix.n_head, ix.head_dim))?;
                // transformers: weights_proj(x) * n_heads^-0.5 (the softmax scale is applied to
                // the dot products, as there).
                let wts = be.scale(
                    &be.matmul(x, &iw.proj)?,
                    (ix.n_head as f64).powf(-0.5) as f32,
                )?;
                self.emit(obs, || format!("blk.{li}.indexer.q.out"), &qi)?;
                self.emit(obs, || format!("blk.{li}.indexer.weights.out"), &wts)?;
                ix_q = Some((qi, wts));
            }
        }

        let q_abs = match self.mode {
            AttnMode::Absorbed => {
                let qa = be.matmul_heads(&q_nope, &w.k_b)?;
                Some(be.head_concat(&qa, &q_rot, h_n, false)?)
            }
            AttnMode::Naive => None,
        };
        let q_full = match self.mode {
            AttnMode::Naive => Some(be.head_concat(&q_nope, &q_rot, h_n, false)?),
            AttnMode::Absorbed => None,
        };
        let mut outs = Vec::with_capacity(segs.len());
        let mut observed_sel: Vec<(usize, usize, Vec<i64>)> = Vec::new();
        for (si, s) in segs.iter().enumerate() {
            let cache = &mut caches[si].layers[li];
            be.append_rows(&mut cache.kv, &be.slice_rows(&kv_rows, s.row0, s.n)?)?;
            if let (Some(keys), Some(ck)) = (&ix_keys, cache.index_keys.as_mut()) {
                be.append_rows(ck, &be.slice_rows(keys, s.row0, s.n)?)?;
            }
            let t = s.pos0 + s.n;
            let sel = match (&self.spec.indexer, layer.spec.own_indexer) {
                (Some(ix), true) => match (&ix_q, &cache.index_keys) {
                    (Some((qi, wts)), Some(keys)) if t > ix.top_k => Some(be.indexer_topk(
                        &be.slice_rows(qi, s.row0, s.n)?,
                        &be.slice_rows(wts, s.row0, s.n)?,
                        keys,
                        &IndexerParams {
                            n_head: ix.n_head,
                            head_dim: ix.head_dim,
                            scale: (ix.head_dim as f64).powf(-0.5) as f32,
                            top_k: ix.top_k,
                            pos0: s.pos0,
                        },
                    )?),
                    _ => None,
                },
                (Some(_), false) => prev_sel[si].take(),
                (None, _) => None,
            };
            if obs.is_some() {
                if let Some(ix) = &self.spec.indexer {
                    observed_sel.push(match &sel {
                        Some(sl) => be.index_to_host(sl)?,
                        None => dense_selection(s, ix.top_k.min(t)),
                    });
                }
            }
            let p = AttnParams {
                n_head: h_n,
                n_kv_head: 1,
                k_dim: m.cache_width(),
                v_dim: m.kv_lora_rank,
                scale: m.scale,
                pos0: s.pos0,
            };
            let o = match (self.mode, &q_abs, &q_full) {
                (AttnMode::Absorbed, Some(qa), _) => {
                    let qs = be.slice_rows(qa, s.row0, s.n)?;
                    be.attention(&qs, &cache.kv, &cache.kv, &p, sel.as_ref())?
                }
                (AttnMode::Naive, _, Some(qf)) => {
                    let kv_b = w
                        .kv_b
                        .as_ref()
                        .ok_or_else(|| model_err("naive attention without kv_b"))?;
                    let latent = be.slice_cols(&cache.kv, 0, m.kv_lora_rank)?;
                    let kr = be.slice_cols(&cache.kv, m.kv_lora_rank, m.qk_rope)?;
                    let e = be.matmul(&latent, kv_b)?;
                    let kn = be.head_slice(&e, h_n, m.qk_nope + m.v_head, 0, m.qk_nope)?;
                    let vv = be.head_slice(&e, h_n, m.qk_nope + m.v_head, m.qk_nope, m.v_head)?;
                    let kk = be.head_concat(&kn, &kr, h_n, true)?;
                    let qs = be.slice_rows(qf, s.row0, s.n)?;
                    let p = AttnParams {
                        n_kv_head: h_n,
                        k_dim: m.qk_head(),
                        v_dim: m.v_head,
                        ..p
                    };
                    be.attention(&qs, &kk, &vv, &p, sel.as_ref())?
                }
                _ => return Err(model_err("attention mode state")),
            };
            outs.push(o);
            prev_sel[si] = sel;
        }
        if let Some(o) = obs.as_mut() {
            if !observed_sel.is_empty() {
                let cols = observed_sel.iter().map(|s| s.1).max().unwrap_or(0);
                let rows: usize = observed_sel.iter().map(|s| s.0).sum();
                let mut data = Vec::with_capacity(rows * cols);
                for (r, c, d) in &observed_sel {
                    for i in 0..*r {
                        data.extend_from_slice(&d[i * c..(i + 1) * c]);
                        data.extend(std::iter::repeat_n(-1, cols - c));
                    }
                }
                o(
                    &format!("blk.{li}.indexer.topk_indices"),
                    Activation::Index {
                        rows,
                        cols,
                        data: &data,
                    },
                );
            }
        }
        let refs: Vec<&B::Tensor> = outs.iter().collect();
        let o = be.concat_rows(&refs)?;
        let o = match self.mode {
            AttnMode::Absorbed => be.matmul_heads(&o, &w.v_b)?,
            AttnMode::Naive => o,
        };
        be.matmul(&o, &w.out)
    }

    #[allow(clippy::too_many_arguments)]
    fn gqa(
        &self,
        li: usize,
        w: &Gqa<B>,
        g: &GqaSpec,
        x: &B::Tensor,
        positions: &[u32],
        segs: &[Seg],
        caches: &mut [&mut KvCache<B>],
    ) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        let mut q = be.matmul(x, &w.q)?;
        let mut k = be.matmul(x, &w.k)?;
        let mut v = be.matmul(x, &w.v)?;
        if let Some([qb, kb, vb]) = &w.bias {
            q = be.add_bias(&q, qb)?;
            k = be.add_bias(&k, kb)?;
            v = be.add_bias(&v, vb)?;
        }
        if let Some([qn, kn]) = &w.qk_norm {
            q = be.rms_norm(&q, qn, self.spec.rms_eps)?;
            k = be.rms_norm(&k, kn, self.spec.rms_eps)?;
        }
        let rp = |groups| RopeParams {
            n_groups: groups,
            group_dim: g.head_dim,
            offset: 0,
            n_rot: self.spec.rope.n_rot,
            theta: self.spec.rope.theta,
            style: self.spec.rope.style,
        };
        be.rope(&mut q, positions, &rp(g.n_head))?;
        be.rope(&mut k, positions, &rp(g.n_head_kv))?;
        let mut outs = Vec::with_capacity(segs.len());
        for (si, s) in segs.iter().enumerate() {
            let cache = &mut caches[si].layers[li];
            be.append_rows(&mut cache.kv, &be.slice_rows(&k, s.row0, s.n)?)?;
            let cv = cache
                .v
                .as_mut()
                .ok_or_else(|| model_err("GQA cache without values"))?;
            be.append_rows(cv, &be.slice_rows(&v, s.row0, s.n)?)?;
            let p = AttnParams {
                n_head: g.n_head,
                n_kv_head: g.n_head_kv,
                k_dim: g.head_dim,
                v_dim: g.head_dim,
                scale: g.scale,
                pos0: s.pos0,
            };
            let qs = be.slice_rows(&q, s.row0, s.n)?;
            outs.push(be.attention(&qs, &cache.kv, cv, &p, None)?);
        }
        let refs: Vec<&B::Tensor> = outs.iter().collect();
        be.matmul(&be.concat_rows(&refs)?, &w.out)
    }

    fn mlp(&self, m: &Mlp<B>, x: &B::Tensor) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        let a = be.silu_mul(&be.matmul(x, &m.gate)?, &be.matmul(x, &m.up)?)?;
        be.matmul(&a, &m.down)
    }

    fn ffn(
        &self,
        li: usize,
        f: &Ffn<B>,
        x: &B::Tensor,
        obs: &mut Option<Observer<'_>>,
    ) -> Result<B::Tensor, RuntimeError> {
        let be = &self.backend;
        match f {
            Ffn::Dense(m) => self.mlp(m, x),
            Ffn::Moe {
                router,
                bias,
                gate,
                up,
                down,
                shared,
            } => {
                let e = self
                    .spec
                    .moe
                    .ok_or_else(|| model_err("MoE layer without expert parameters"))?;
                // The router runs in f32 on f32 weights (never quantised in GGUF).
                let logits = be.matmul(x, router)?;
                let (wts, ids) = be.moe_route(
                    &logits,
                    bias.as_ref(),
                    &RouteParams {
                        n_expert: e.n_expert,
                        n_used: e.n_used,
                        n_group: e.n_group,
                        n_group_used: e.n_group_used,
                        gating: e.gating,
                        normalize: e.normalize,
                        scale: e.scale,
                    },
                )?;
                self.emit(obs, || format!("blk.{li}.router.weights"), &wts)?;
                self.emit_index(obs, || format!("blk.{li}.router.experts"), &ids)?;
                let y = be.moe_ffn(x, gate, up, down, &wts, &ids)?;
                match shared {
                    Some(m) => be.add(&y, &self.mlp(m, x)?),
                    None => Ok(y),
                }
            }
        }
    }
}

/// Rows of one sequence inside the stacked batch.
#[derive(Debug, Clone, Copy)]
struct Seg {
    row0: usize,
    n: usize,
    pos0: usize,
}

/// What a dense step selects, in the indexer's output form: row `i` lists keys `0 ..= pos0 + i`.
fn dense_selection(s: &Seg, cols: usize) -> (usize, usize, Vec<i64>) {
    let mut d = vec![-1i64; s.n * cols];
    for i in 0..s.n {
        for j in 0..=(s.pos0 + i).min(cols.saturating_sub(1)) {
            d[i * cols + j] = j as i64;
        }
    }
    (s.n, cols, d)
}

impl<B: Backend> LanguageModel for GlmModel<B> {
    fn new_sequence(&self) -> Box<dyn SequenceState> {
        match self.new_cache() {
            Ok(c) => Box::new(c),
            // Creating empty tensors only fails on a broken device; the first forward call on
            // this placeholder then reports "sequence state of another model".
            Err(_) => Box::new(NoCache),
        }
    }
    fn vocab_size(&self) -> usize {
        self.spec.n_vocab
    }
    fn context_length(&self) -> usize {
        self.spec.n_ctx_train
    }
    fn forward(&self, batch: &mut [SeqStep<'_>]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        self.forward_observed(batch, None)
    }
}

struct NoCache;

impl SequenceState for NoCache {
    fn len(&self) -> usize {
        0
    }
    fn cache_bytes(&self) -> usize {
        0
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Open a GGUF model of a supported architecture on the CPU backend.
pub fn load_cpu(model: Arc<gguf::Model>) -> Result<GlmModel<crate::cpu::CpuBackend>, RuntimeError> {
    GlmModel::load(crate::cpu::CpuBackend, model)
}
