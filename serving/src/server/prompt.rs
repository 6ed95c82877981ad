//! From a chat request to prompt tokens and a grammar: tools rendered through the model's
//! template or the generic fallback ([`super::tools`]), template variables checked against the
//! ones the template reads (a variable it never reads would be silently ignored), GLM thinking
//! control, and the constraint of the answer (structured output or a forced tool call).

use super::error::ApiError;
use super::params::{ChatRequest, ConstraintKind, ConstraintSpec};
use super::tools::{self, ToolChoice, ToolParser};
use super::Backend;
use crate::engine::SharedConstraint;
use crate::grammar::{Grammar, Reasoning};
use std::sync::Arc;

/// A rendered chat request.
pub(crate) struct ChatPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    /// Where the answer starts with respect to thinking.
    pub reasoning: Reasoning,
    /// Control tokens the text stream shows (tool markers for the parser).
    pub visible: Vec<u32>,
    /// Lark rules forcing a call (`tool_choice` required / named).
    pub forced: Option<(String, String)>,
}

impl ChatPrompt {
    pub fn starts_in_reasoning(&self) -> bool {
        matches!(self.reasoning, Reasoning::Open { .. })
    }
}

/// The parser that lifts calls out of the answer, when tools are offered.
pub(crate) fn tool_parser(b: &Backend, r: &ChatRequest) -> Option<ToolParser> {
    if r.tools.is_empty() || r.tool_choice == ToolChoice::None {
        return None;
    }
    let single = r.legacy_functions
        || !r.parallel_tool_calls
        || matches!(r.tool_choice, ToolChoice::Named(_));
    Some(ToolParser::new(
        b.chat.tools.format,
        r.tools.clone(),
        single,
    ))
}

/// The prompt text: tools prepared for the template, variables checked, template rendered.
pub(crate) fn render(b: &Backend, r: &ChatRequest) -> Result<String, ApiError> {
    let (messages, tools_kw) = tools::prepare(
        &r.messages,
        &r.tools,
        &r.tool_choice,
        &b.chat.tools,
        b.codec.as_ref(),
    );
    let mut kwargs = r.template_kwargs.clone();
    if let Some(vars) = &b.chat.template_vars {
        for k in kwargs.keys() {
            if k == "enable_thinking" || vars.contains(k) {
                continue;
            }
            let param = match k.as_str() {
                "reasoning_effort" | "documents" => k.clone(),
                _ => format!("chat_template_kwargs.{k}"),
            };
            return Err(ApiError::invalid(
                &param,
                format!("this model's chat template does not use '{k}'"),
            ));
        }
    }
    if let Some(t) = tools_kw {
        kwargs.insert("tools".into(), t);
    }
    b.codec
        .render_chat(&messages, r.add_generation_prompt, &kwargs)
        .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))
}

/// Render, tokenize and settle thinking for a chat request.
pub(crate) async fn prepare(b: &Arc<Backend>, r: &ChatRequest) -> Result<ChatPrompt, ApiError> {
    let (b2, r2) = (b.clone(), r.clone());
    let mut text = tokio::task::spawn_blocking(move || render(&b2, &r2))
        .await
        .map_err(|_| ApiError::internal("chat template task failed"))??;
    let mut ids = super::openai::encode(b, text.clone(), true).await?;
    let thinking_param = if r.template_kwargs.contains_key("enable_thinking") {
        "chat_template_kwargs.enable_thinking"
    } else {
        "thinking"
    };
    let reasoning = match b.think {
        None => {
            if r.enable_thinking == Some(true) {
                return Err(ApiError::invalid(
                    thinking_param,
                    "this model has no thinking tokens (<think>, </think>)",
                ));
            }
            Reasoning::None
        }
        Some((open, close)) => {
            let template_decides = b
                .chat
                .template_vars
                .as_ref()
                .is_none_or(|v| v.contains("enable_thinking"));
            let mut mode = reasoning_mode(&ids, open, close, r.enable_thinking);
            match r.enable_thinking {
                // The template opened a thinking block anyway: close it, the answer comes next.
                Some(false) if matches!(mode, Reasoning::Open { .. }) => {
                    ids.push(close);
                    text.push_str(&b.codec.decode(&[close], false));
                    mode = Reasoning::None;
                }
                Some(true) if !template_decides && !matches!(mode, Reasoning::Open { .. }) => {
                    return Err(ApiError::invalid(
                        thinking_param,
                        "this model's chat template never starts a thinking block, so thinking cannot be enabled",
                    ));
                }
                _ => {}
            }
            mode
        }
    };
    let forced = tools::forced_call_grammar(
        &r.tools,
        &r.tool_choice,
        r.parallel_tool_calls && !r.legacy_functions,
        &b.chat.tools,
    )?;
    let visible = if r.tools.is_empty() {
        Vec::new()
    } else {
        b.chat.tools.visible_ids()
    };
    Ok(ChatPrompt {
        text,
        ids,
        reasoning,
        visible,
        forced,
    })
}

/// Thinking state at the end of the prompt: inside an open block, just after a closed one, or
/// free to start one (when thinking is not switched off).
fn reasoning_mode(ids: &[u32], open: u32, close: u32, enable: Option<bool>) -> Reasoning {
    match ids.iter().rposition(|&t| t == open || t == close) {
        Some(p) if ids[p] == open => Reasoning::Open { close },
        // `<think></think>` ends the prompt (thinking off): at most a newline follows.
        Some(p) if ids.len() - p <= 3 => Reasoning::None,
        _ if enable == Some(false) => Reasoning::None,
        _ => Reasoning::Optional { open, close },
    }
}

/// [`constraint`] with a thinking budget on top (which needs the thinking tokens).
pub(crate) async fn chat_constraint(
    b: &Arc<Backend>,
    r: &ChatRequest,
    p: &ChatPrompt,
) -> Result<Option<SharedConstraint>, ApiError> {
    let inner = constraint(
        b,
        r.common.constraint.as_ref(),
        p.forced.clone(),
        p.reasoning,
    )
    .await?;
    let Some(budget) = r.thinking_budget else {
        return Ok(inner);
    };
    let Some((open, close)) = b.think else {
        return Err(ApiError::invalid(
            "thinking",
            "this model has no thinking tokens",
        ));
    };
    Ok(Some(SharedConstraint(Arc::new(
        crate::grammar::ThinkingBudget {
            inner: inner.map(|c| c.0),
            open,
            close,
            budget,
            starts_open: p.starts_in_reasoning(),
            vocab: b.engine.vocab_size(),
        },
    ))))
}

/// The constraint of an answer: a forced call, a structured-output grammar, or none (both at
/// once are refused when the request is parsed).
pub(crate) async fn constraint(
    b: &Arc<Backend>,
    spec: Option<&ConstraintSpec>,
    forced: Option<(String, String)>,
    reasoning: Reasoning,
) -> Result<Option<SharedConstraint>, ApiError> {
    let (grammar, field) = match (spec, forced) {
        (_, Some((start, rules))) => (Grammar::Rules { start, rules }, "tools".to_string()),
        (Some(s), None) => {
            let g = match &s.kind {
                ConstraintKind::JsonSchema(v) => Grammar::JsonSchema(v.clone()),
                ConstraintKind::Gbnf(g) => Grammar::Gbnf(g.clone()),
                ConstraintKind::Lark(l) => Grammar::Lark(l.clone()),
                ConstraintKind::Regex(r) => Grammar::Regex(r.clone()),
                ConstraintKind::Choice(c) => Grammar::Choice(c.clone()),
                ConstraintKind::Tokens(t) => {
                    let vocab = b.engine.vocab_size();
                    if let Some(&bad) = t.iter().find(|&&t| t as usize >= vocab) {
                        return Err(ApiError::invalid(
                            &s.field,
                            format!("token id {bad} is out of range (vocabulary size {vocab})"),
                        ));
                    }
                    return Ok(Some(SharedConstraint(Arc::new(
                        crate::grammar::TokenSet::new(t, vocab),
                    ))));
                }
            };
            (g, s.field.clone())
        }
        (None, None) => return Ok(None),
    };
    let b = b.clone();
    tokio::task::spawn_blocking(move || {
        let vocab = b
            .chat
            .vocabulary(&b)
            .map_err(|e| ApiError::invalid(&field, e))?;
        let compiled = vocab
            .compile(&grammar, reasoning)
            .map_err(|e| ApiError::invalid(&field, format!("'{field}': {e}")))?;
        Ok(Some(SharedConstraint(Arc::new(compiled))))
    })
    .await
    .map_err(|_| ApiError::internal("grammar task failed"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_modes() {
        let (o, c) = (90, 91);
        assert_eq!(
            reasoning_mode(&[1, 2, o], o, c, None),
            Reasoning::Open { close: c }
        );
        assert_eq!(reasoning_mode(&[1, o, c, 10], o, c, None), Reasoning::None);
        assert_eq!(
            reasoning_mode(&[1, 2, 3], o, c, None),
            Reasoning::Optional { open: o, close: c }
        );
        assert_eq!(
            reasoning_mode(&[1, 2, 3], o, c, Some(false)),
            Reasoning::None
        );
        // An old closed block far back in the history does not count.
        assert_eq!(
            reasoning_mode(&[o, c, 1, 2, 3, 4, 5], o, c, Some(true)),
            Reasoning::Optional { open: o, close: c }
        );
    }
}
