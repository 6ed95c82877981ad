//! `gguftool generate`: load a model (CPU or CUDA, on one device or split over `--tp` ranks) and
//! continue a prompt, streaming the text as it is produced (or one JSON object for scripts).

use anyhow::{bail, Context, Result};
use runtime::sampling::{finish_rows, SampleParams, SampleRequest, Sampled};
use runtime::{LanguageModel, SeqStep};
use serde_json::json;
use serving::chat::{ChatMessage, ChatTemplate};
use serving::sampler::{Sampler, SamplingParams};
use serving::tokenizer::{Bounded, Detokenizer, Tokenizer};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// The bundled demo model (tiny-glm5, Q4_K_M): `generate` and `serve` use it when no `-m` is
/// given, so the tool can be tried without downloading anything.
pub static DEMO_MODEL: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/gguf/tiny-glm5-Q4_K_M.gguf"
));

/// Name under which the demo model is reported.
pub const DEMO_MODEL_NAME: &str = "tiny-glm5-Q4_K_M.gguf (bundled demo)";

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (any shard of a split model). Without it, the bundled tiny demo model.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Prompt. Special tokens written in it (`[gMASK]`, `<|user|>`) are parsed as such.
    #[arg(short = 'p', long)]
    prompt: String,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus sampling mass (1 disables).
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep the K most likely tokens (0 disables).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Drop tokens below this fraction of the best token's probability (0 disables).
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    min_p: f32,
    /// Random seed (reproducible sampling).
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print each generated token's K most likely alternatives with their log-probabilities.
    #[arg(long, value_name = "K")]
    logprobs: Option<usize>,
    /// Print special tokens (`<|user|>`, ...) in the text instead of dropping them.
    #[arg(long)]
    special: bool,
    /// One JSON object {prompt_ids, ids, text, logprobs, ...} instead of streamed text.
    #[arg(long)]
    json: bool,
    /// Compute device: auto (a CUDA GPU when present, else the CPU), cpu, cuda, cuda:N.
    #[arg(long, default_value = "auto")]
    device: runtime::device::Device,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    #[command(flatten)]
    tp: super::tp::TpArgs,
    #[command(flatten)]
    draft: super::draft::DraftArgs,
}

struct Step {
    id: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    // The same checks `serve` applies to a request's fields, before anything is loaded.
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
    };
    sampling.validate().map_err(|e| {
        let flag = match e.range.field {
            "temperature" => "--temp",
            "top_p" => "--top-p",
            _ => "--min-p",
        };
        anyhow::anyhow!("{flag}: {e}")
    })?;
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .context("setting up worker threads")?;
    }
    let load_start = Instant::now();
    let model = match &args.model {
        Some(p) => gguf::Model::open(p).with_context(|| format!("opening {}", p.display()))?,
        None => gguf::Model::from_static(DEMO_MODEL, DEMO_MODEL_NAME)
            .context("opening the bundled demo model")?,
    };
    let model = Arc::new(model);
    let tok = Tokenizer::from_gguf(model.metadata()).context("loading the tokenizer")?;
    let opts = args.tp.options(args.device)?;
    let loaded =
        super::tp::load(Arc::clone(&model), opts, args.json).context("loading the model")?;
    let device = loaded.device;
    let lm: &dyn LanguageModel = loaded.lm.as_ref();
    let load_s = load_start.elapsed().as_secs_f64();
    let draft_k = args.draft.k_for(lm)?;

    // A prompt needs room for at least one generated token.
    let limit = lm.context_length().saturating_sub(1);
    let tok = Arc::new(tok);
    let bounded = if args.chat {
        let mut tmpl =
            ChatTemplate::from_gguf(model.metadata()).context("loading the chat template")?;
        // Special tokens come from the template only, never from the --prompt/--system text.
        let esc = Arc::clone(&tok);
        tmpl.set_content_escaper(Arc::new(move |s| esc.escape_control_text(s)));
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage::new("system", s.as_str()));
        }
        msgs.push(ChatMessage::new("user", args.prompt.as_str()));
        let text = tmpl
            .render(&msgs, true)
            .context("rendering the chat template")?;
        tok.encode_chat(&text, limit)
    } else {
        tok.encode_bounded(&args.prompt, true, limit)
    };
    let prompt = match bounded.context("tokenizing the prompt")? {
        Bounded::Complete(ids) => ids,
        Bounded::Exceeds { .. } => bail!(
            "the prompt is longer than {limit} tokens; the model's context is {}",
            lm.context_length()
        ),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let n_predict = args.n_predict.min(lm.context_length() - prompt.len());

    // The model samples (on the GPU: on the device, copying back the ids, and the logits only
    // with --logprobs); the seeded stream of `sampler` supplies each step's uniform number
    // (`Sampler::request`). Speculative rounds sample on the host by the same rules.
    let mut sampler = Sampler::new(sampling);
    let mut detok = Detokenizer::new(!args.special);
    let mut out = std::io::stdout().lock();
    let mut seq = match draft_k {
        Some(_) => None,
        None => {
            let mut s = lm.new_sequence();
            // The whole run's cache at once: no reallocation and copy while decoding.
            s.reserve(prompt.len() + n_predict)
                .context("allocating the KV cache")?;
            Some(s)
        }
    };
    let mut spec = match draft_k {
        Some(k) => {
            Some(serving::speculative::SpecSequence::new(lm, k).context("starting --draft mtp")?)
        }
        None => None,
    };
    let mut steps: Vec<Step> = Vec::new();
    let mut text_out = String::new();
    let mut finish = "length";

    let t0 = Instant::now();
    let mut fed: Vec<u32> = prompt.clone();
    let check = |next: &Sampled, fed: &[u32]| -> Result<()> {
        if !next.non_finite {
            return Ok(());
        }
        let d = runtime::numerics::locate_non_finite(Arc::clone(&model), fed)
            .context("re-running the CPU reference to locate the non-finite values")?;
        bail!(
            "{}",
            runtime::numerics::non_finite_message(&device.name(), fed.len() - 1, &d)
        )
    };
    // With drafts: tokens already chosen by the last verification round, in order.
    let mut queue: std::collections::VecDeque<serving::speculative::Emitted> = Default::default();
    let mut next = match (&mut seq, &mut spec) {
        (Some(s), _) => forward(lm, s.as_mut(), &prompt, sampler.request(args.logprobs))?,
        (None, Some(sp)) => {
            let logits = sp.prefill(lm, &prompt).context("forward pass")?;
            let id = sampler.sample(&logits);
            chosen(id, &logits, args.logprobs)
        }
        (None, None) => bail!("no sequence"),
    };
    check(&next, &fed)?;
    let prompt_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..n_predict {
        let id = next.id;
        steps.push(Step {
            id,
            logprob: next.logprob.unwrap_or(f32::NAN),
            top: std::mem::take(&mut next.top),
        });
        if !args.ignore_eos && tok.is_eog(id) {
            finish = "stop";
            break;
        }
        let piece = detok.push(&tok, id)?;
        text_out.push_str(&piece);
        if !args.json {
            out.write_all(piece.as_bytes())?;
            out.flush()?;
        }
        if i + 1 < n_predict {
            fed.push(id);
            next = match (&mut seq, &mut spec) {
                (Some(s), _) => forward(lm, s.as_mut(), &[id], sampler.request(args.logprobs))?,
                (None, Some(sp)) => {
                    if queue.is_empty() {
                        queue.extend(
                            sp.step(
                                lm,
                                &mut sampler,
                                id,
                                n_predict - i - 1,
                                args.logprobs.is_some(),
                            )
                            .context("speculative decoding round")?,
                        );
                    }
                    let e = queue.pop_front().context("no token from the round")?;
                    if e.logits.is_empty() {
                        // An ids-only round (greedy, no log-probabilities).
                        Sampled {
                            id: e.id,
                            non_finite: e.non_finite,
                            logprob: None,
                            top: Vec::new(),
                        }
                    } else {
                        chosen(e.id, &e.logits, args.logprobs)
                    }
                }
                (None, None) => bail!("no sequence"),
            };
            check(&next, &fed)?;
        }
    }
    let tail = detok.finish();
    text_out.push_str(&tail);
    let decode_s = t1.elapsed().as_secs_f64();
    // The last sampled token needs no forward pass: decode rate counts the forwards run.
    let n_gen = steps.len();
    let n_decode_forwards = n_gen.saturating_sub(1);
    let ids: Vec<u32> = steps
        .iter()
        .take(if finish == "stop" { n_gen - 1 } else { n_gen })
        .map(|s| s.id)
        .collect();
    let piece = |id: u32| tok.decode(&[id], false).unwrap_or_default();

    if args.json {
        let logprobs: Vec<_> = steps
            .iter()
            .map(|s| {
                json!({
                    "id": s.id,
                    "token": piece(s.id),
                    "logprob": s.logprob,
                    "top_logprobs": s.top.iter().map(|&(id, lp)| json!({"id": id, "token": piece(id), "logprob": lp})).collect::<Vec<_>>(),
                })
            })
            .collect();
        let obj = json!({
            "model": args.model.as_ref().map_or(DEMO_MODEL_NAME.to_string(), |p| p.display().to_string()),
            "prompt_ids": prompt,
            "ids": ids,
            "text": text_out,
            "finish_reason": finish,
            "logprobs": if args.logprobs.is_some() { json!(logprobs) } else { json!([]) },
            "device": device.name(),
            "tp": loaded.tp,
            "load": {"weight_bytes": loaded.weight_bytes, "seconds": loaded.load_s},
            "draft": spec.as_ref().map(|s| {
                let mut d = s.stats.to_json();
                d["kind"] = json!("mtp");
                d["n"] = json!(draft_k);
                d["rounds"] = json!(s.stats.rounds);
                d
            }),
            "timings": {
                "load_s": load_s,
                "prompt_tokens": prompt.len(),
                "prompt_s": prompt_s,
                "generated_tokens": n_gen,
                "decode_s": decode_s,
            },
        });
        writeln!(out, "{}", serde_json::to_string(&obj)?)?;
    } else {
        out.write_all(tail.as_bytes())?;
        writeln!(out)?;
        if let Some(k) = args.logprobs {
            writeln!(out)?;
            for (i, s) in steps.iter().enumerate() {
                write!(
                    out,
                    "{i:>4} {:>6} {:<16} {:>9.4}",
                    s.id,
                    format!("{:?}", piece(s.id)),
                    s.logprob
                )?;
                if k > 0 {
                    let alts: Vec<String> = s
                        .top
                        .iter()
                        .map(|&(id, lp)| format!("{:?}={lp:.4}", piece(id)))
                        .collect();
                    write!(out, "  | {}", alts.join(" "))?;
                }
                writeln!(out)?;
            }
        }
        out.flush()?;
        eprintln!(
            "[{}] prompt: {} tokens in {:.1} ms ({:.1} tok/s); generated {} tokens in {:.1} ms ({:.1} tok/s); finish: {finish}",
            device.name(),
            prompt.len(),
            prompt_s * 1e3,
            prompt.len() as f64 / prompt_s.max(1e-9),
            n_gen,
            decode_s * 1e3,
            n_decode_forwards as f64 / decode_s.max(1e-9),
        );
        if let Some(s) = &spec {
            eprintln!(
                "[draft mtp, {} per round] drafted {}, accepted {} ({:.1}%), per position: {}",
                draft_k.unwrap_or(0),
                s.stats.n_drafted(),
                s.stats.n_accepted(),
                100.0 * s.stats.acceptance_rate(),
                s.stats
                    .per_position_rates()
                    .iter()
                    .map(|r| format!("{r:.2}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A token chosen on the host from `logits` (a speculative round's), in the form
/// [`LanguageModel::forward_sample`] returns it.
fn chosen(id: u32, logits: &[f32], logprobs: Option<usize>) -> Sampled {
    let non_finite = runtime::numerics::first_non_finite(logits).is_some();
    let req = SampleRequest {
        params: SampleParams::GREEDY,
        u: 0.0,
        logprobs,
    };
    finish_rows(&[(id, non_finite)], &[req], Some(logits), logits.len())
        .pop()
        .unwrap_or(Sampled {
            id,
            non_finite,
            logprob: None,
            top: Vec::new(),
        })
}

/// One step: append `tokens`, sample the next token.
fn forward(
    lm: &dyn LanguageModel,
    seq: &mut dyn runtime::SequenceState,
    tokens: &[u32],
    req: SampleRequest,
) -> Result<Sampled> {
    let mut b = [SeqStep {
        seq,
        tokens,
        all_logits: false,
    }];
    let mut out = lm.forward_sample(&mut b, &[req]).context("forward pass")?;
    out.pop().context("the model returned no token")
}
