//! One answer ("choice") as the endpoints see it: the engine's token stream turned into text,
//! thinking text and tool calls ([`ChoiceStream`]), and several choices of a request merged into
//! one stream or collected into final answers. The OpenAI and Anthropic endpoints only format
//! what comes out of here.

use super::text::{Channel, Piece, TextStream, TokenInfo, ToolCall};
use super::tools::{ToolOut, ToolParser};
use crate::engine::{FinishReason, TokenLogprobs, Usage};
use futures::StreamExt;
use std::collections::VecDeque;

/// Why a choice ended, in OpenAI's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    ToolCalls,
}

impl Finish {
    pub fn openai(self, legacy_functions: bool) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls if legacy_functions => "function_call",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// What a choice produces, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    Prompt(Vec<TokenLogprobs>),
    Text {
        channel: Channel,
        text: String,
        tokens: Vec<TokenInfo>,
    },
    Call(ToolCall),
    Finish {
        reason: Finish,
        usage: Usage,
        /// The stop string that ended the text.
        stop: Option<String>,
    },
    Error(String),
}

/// The text stream of one choice with, when tools are offered, the parser that lifts tool
/// calls out of its content.
pub struct ChoiceStream {
    ts: TextStream,
    tools: Option<ToolParser>,
    include_stop: bool,
    /// Prefix of call ids (`call_<request>_<choice>`).
    call_prefix: String,
    queued: VecDeque<Out>,
    ended: bool,
}

impl ChoiceStream {
    pub fn new(
        ts: TextStream,
        tools: Option<ToolParser>,
        include_stop: bool,
        call_prefix: String,
    ) -> Self {
        ChoiceStream {
            ts,
            tools,
            include_stop,
            call_prefix,
            queued: VecDeque::new(),
            ended: false,
        }
    }

    /// The next output; `None` after `Finish` or `Error`.
    pub async fn next(&mut self) -> Option<Out> {
        loop {
            if let Some(o) = self.queued.pop_front() {
                return Some(o);
            }
            if self.ended {
                return None;
            }
            let piece = self.ts.next().await;
            self.handle(piece);
        }
    }

    fn handle(&mut self, piece: Option<Piece>) {
        match piece {
            None => {
                self.ended = true;
            }
            Some(Piece::Prompt(l)) => self.queued.push_back(Out::Prompt(l)),
            Some(Piece::Text {
                channel: Channel::Content,
                text,
                tokens,
            }) if self.tools.is_some() => self.content_with_tools(text, tokens),
            Some(Piece::Text {
                channel,
                text,
                tokens,
            }) => self.queued.push_back(Out::Text {
                channel,
                text,
                tokens,
            }),
            Some(Piece::Finish {
                reason,
                usage,
                stop,
            }) => {
                let mut reason = match reason {
                    FinishReason::Stop => Finish::Stop,
                    FinishReason::Length => Finish::Length,
                };
                if let Some(s) = stop.as_ref().filter(|_| self.include_stop) {
                    self.queued.push_back(Out::Text {
                        channel: Channel::Content,
                        text: s.clone(),
                        tokens: Vec::new(),
                    });
                }
                if let Some(p) = self.tools.as_mut() {
                    let mut outs = Vec::new();
                    p.finish(reason == Finish::Stop, &mut outs);
                    let calls = p.calls;
                    self.push_tool_outs(outs, Vec::new());
                    if calls > 0 {
                        reason = Finish::ToolCalls;
                    }
                }
                self.queued.push_back(Out::Finish {
                    reason,
                    usage,
                    stop,
                });
                self.ended = true;
            }
            Some(Piece::Error(e)) => {
                self.queued.push_back(Out::Error(e));
                self.ended = true;
            }
        }
    }

    fn content_with_tools(&mut self, text: String, tokens: Vec<TokenInfo>) {
        let Some(p) = self.tools.as_mut() else { return };
        let mut outs = Vec::new();
        p.push(&text, &mut outs);
        let done = p.done();
        self.push_tool_outs(outs, tokens);
        if done {
            // The one allowed call is complete: the rest of the generation is not wanted.
            let usage = self.ts.cancel();
            self.queued.push_back(Out::Finish {
                reason: Finish::ToolCalls,
                usage,
                stop: None,
            });
            self.ended = true;
        }
    }

    /// Parser output as `Out`s; the tokens' logprobs go with the first text piece.
    fn push_tool_outs(&mut self, outs: Vec<ToolOut>, mut tokens: Vec<TokenInfo>) {
        for o in outs {
            match o {
                ToolOut::Text(text) => self.queued.push_back(Out::Text {
                    channel: Channel::Content,
                    text,
                    tokens: std::mem::take(&mut tokens),
                }),
                ToolOut::Call { name, arguments } => {
                    let n = self.tools.as_ref().map_or(0, |p| p.calls);
                    self.queued.push_back(Out::Call(ToolCall {
                        id: format!("{}_{}", self.call_prefix, n.saturating_sub(1)),
                        name,
                        arguments,
                    }));
                }
            }
        }
    }

    /// Runs the choice to its end.
    pub async fn collect(mut self) -> Collected {
        let mut c = Collected::default();
        while let Some(o) = self.next().await {
            c.add(o);
        }
        c
    }
}

/// A finished choice.
#[derive(Debug, Default, Clone)]
pub struct Collected {
    pub prompt_lps: Option<Vec<TokenLogprobs>>,
    pub content: String,
    pub reasoning: String,
    /// Tokens of the content and of the reasoning, with their logprobs.
    pub tokens: Vec<TokenInfo>,
    /// The content as it came, piece by piece with the tokens of each (text offsets).
    pub pieces: Vec<(String, Vec<TokenInfo>)>,
    pub calls: Vec<ToolCall>,
    pub finish: Option<(Finish, Usage, Option<String>)>,
    pub error: Option<String>,
}

impl Collected {
    fn add(&mut self, o: Out) {
        match o {
            Out::Prompt(l) => self.prompt_lps = Some(l),
            Out::Text {
                channel,
                text,
                tokens,
            } => {
                match channel {
                    Channel::Content => {
                        self.content.push_str(&text);
                        self.pieces.push((text, tokens.clone()));
                    }
                    Channel::Reasoning => self.reasoning.push_str(&text),
                }
                self.tokens.extend(tokens);
            }
            Out::Call(c) => self.calls.push(c),
            Out::Finish {
                reason,
                usage,
                stop,
            } => self.finish = Some((reason, usage, stop)),
            Out::Error(e) => self.error = Some(e),
        }
    }
}

/// All choices of a request as one stream of `(choice index, output)`, in the order the engine
/// produces them. Dropping it cancels every choice.
pub fn merged(
    choices: Vec<ChoiceStream>,
) -> impl futures::Stream<Item = (usize, Out)> + Send + Unpin {
    futures::stream::select_all(choices.into_iter().enumerate().map(|(i, c)| {
        futures::stream::unfold(c, move |mut c| async move {
            let o = c.next().await?;
            Some(((i, o), c))
        })
        .boxed()
    }))
}

/// Runs every choice to its end (concurrently: they share the engine's batch).
pub async fn collect_all(choices: Vec<ChoiceStream>) -> Vec<Collected> {
    futures::future::join_all(choices.into_iter().map(ChoiceStream::collect)).await
}
