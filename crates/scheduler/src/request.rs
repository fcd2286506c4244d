//! What callers send in and what they get back.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::chan;
use crate::detok::TextState;
use crate::model::Detokenizer;

/// Sampling knobs of one request. Defaults are greedy with no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: u32,
    /// 1.0 means off.
    pub top_p: f32,
    /// 0.0 means off.
    pub min_p: f32,
    /// Multiplicative (CTRL-style) over prompt and generated tokens; 1.0 means off.
    pub repetition_penalty: f32,
    /// Subtracted once from every token already generated (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted per occurrence of a token already generated (OpenAI semantics).
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// One generation request, as the front end hands it over (already tokenized and
/// authenticated: `tenant` and `tenant_weight` come from the API key, not the client).
#[derive(Debug, Clone)]
pub struct Request {
    pub tenant: String,
    /// Share of the engine relative to other tenants (> 0).
    pub tenant_weight: f64,
    /// Higher runs first within the tenant and is preempted last.
    pub priority: i32,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// Matched on the detokenized output; never emitted.
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    /// Makes sampling reproducible and independent of the rest of the batch.
    pub seed: Option<u64>,
    /// Number of top alternatives to report per token (None: no logprobs at all).
    pub logprobs: Option<usize>,
    /// Client-chosen id, unique per tenant among live requests; needed for `cancel`.
    pub request_id: Option<String>,
    pub deadline: Option<Instant>,
    /// What the output must match (JSON schema, regex, grammar, choices), compiled by
    /// [`crate::constraint::Grammars`]; None: unconstrained.
    pub constraint: Option<crate::constraint::Constraint>,
    /// The LoRA adapter the request runs with (the model's id for it; None: the
    /// base model). Its prefix-cache domain is the tenant's and the adapter's: KV
    /// computed under one adapter is never reused under another.
    pub adapter: Option<u32>,
}

impl Request {
    /// A greedy request with defaults everywhere else; handy in tests and examples.
    pub fn new(tenant: impl Into<String>, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            tenant: tenant.into(),
            tenant_weight: 1.0,
            priority: 0,
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            seed: None,
            logprobs: None,
            request_id: None,
            deadline: None,
            constraint: None,
            adapter: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token id or stop string matched, or the output constraint is complete.
    Stop,
    /// The model's end-of-sequence token (and `ignore_eos` was off).
    Eos,
    /// `cancel()` was called or the event receiver was dropped.
    Cancelled,
    /// The request could not be served; `Finished::error` says why.
    Error,
    /// The request's deadline passed before it finished.
    Deadline,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Eos => "eos",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
            FinishReason::Deadline => "deadline",
        }
    }
}

/// What matched when `FinishReason::Stop`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopMatch {
    TokenId(u32),
    String(String),
    /// The output constraint is complete: `Some(eos)` when the request picked that
    /// end-of-sequence token where the grammar may end (not emitted, as EOS never is),
    /// None right after the token that completed a grammar nothing may follow.
    Constraint(Option<u32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The `n` most likely tokens at this position, best first.
    pub top: Vec<(u32, f32)>,
}

/// New output of one request. `text` may be empty while text is held back (a possible
/// stop-string start or an incomplete UTF-8 character); it is never retracted.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenDelta {
    pub ids: Vec<u32>,
    pub text: String,
    /// One entry per id when the request asked for logprobs.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (0 until the KV pool provides one).
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Submit until first scheduled.
    pub queue_time: Duration,
    /// Submit until first token; None if no token was produced.
    pub time_to_first_token: Option<Duration>,
    /// How many times the request was preempted and recomputed.
    pub preemptions: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub stop: Option<StopMatch>,
    pub usage: Usage,
    /// Set for `FinishReason::Error`.
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenDelta),
    /// Always the last event of a stream.
    Finished(Finished),
}

/// Engine-assigned id of a request, unique for the engine's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestKey(pub u64);

/// Why `submit` refused a request. Returned at once; nothing is queued.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SubmitError {
    /// The request can never be served as asked (maps to INVALID_ARGUMENT).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A queue or rate limit is full now; try again after `retry_after`
    /// (maps to RESOURCE_EXHAUSTED).
    #[error("overloaded ({reason}); retry after {retry_after:?}")]
    Overloaded {
        retry_after: Duration,
        reason: String,
    },
    /// The engine has stopped (maps to UNAVAILABLE).
    #[error("engine is not running")]
    ShuttingDown,
}

/// What the engine sends down a request's channel; [`EventStream`] turns it into
/// [`Event`]s. Kept small (rare parts boxed): every generated token of every row is one
/// message, and at large batches the channel slots' cache traffic shows in step time.
#[derive(Debug)]
pub(crate) enum Msg {
    Token {
        id: u32,
        /// Text decided by the engine (requests with stop strings, which the engine must
        /// detokenize to match); None: the stream detokenizes.
        text: Option<String>,
        /// False for EOS and stop token ids, which are reported but add no text.
        textual: bool,
        /// The request's last token: flush held-back text.
        last: bool,
        logprob: Option<Box<TokenLogprob>>,
    },
    Finished(Box<Finished>),
}

struct LocalText {
    detok: Arc<dyn Detokenizer>,
    state: TextState,
}

/// The event stream of one request. Dropping it cancels the request within one step.
///
/// For requests without stop strings the engine sends bare token ids and the stream
/// detokenizes them (incrementally, UTF-8 safe) on the receiving side: that keeps
/// tokenizer work — microseconds per token with real tokenizers — off the engine thread
/// and spreads it over the front end's threads.
///
/// If the engine goes away without a final event (a panic on the engine thread), the
/// stream ends with a synthesized `Finished { reason: Error }` so callers never hang or
/// mistake a crash for a clean end.
pub struct EventStream {
    key: RequestKey,
    rx: chan::Receiver<Msg>,
    done: bool,
    text: Option<LocalText>,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("key", &self.key)
            .field("done", &self.done)
            .finish()
    }
}

impl EventStream {
    /// `detok`: Some when the stream detokenizes (the request has no stop strings).
    pub(crate) fn new(
        key: RequestKey,
        rx: chan::Receiver<Msg>,
        detok: Option<Arc<dyn Detokenizer>>,
    ) -> Self {
        let text = detok.map(|detok| LocalText {
            detok,
            state: TextState::default(),
        });
        Self {
            key,
            rx,
            done: false,
            text,
        }
    }

    pub fn key(&self) -> RequestKey {
        self.key
    }

    fn observe(&mut self, msg: Option<Msg>) -> Option<Event> {
        if self.done {
            return None;
        }
        match msg {
            Some(Msg::Token {
                id,
                text,
                textual,
                last,
                logprob,
            }) => {
                let text = match (text, &mut self.text) {
                    (Some(t), _) => t,
                    (None, Some(local)) if textual || last => {
                        let add = textual.then_some(id);
                        match local.state.stage(add, last, local.detok.as_ref(), &[]) {
                            Ok(mut u) => {
                                let emit = std::mem::take(&mut u.emit);
                                local.state.apply(u);
                                emit
                            }
                            Err(e) => {
                                // Closing the receiver makes the engine drop the request
                                // at its next step.
                                self.done = true;
                                self.rx.close();
                                return Some(Event::Finished(Finished {
                                    reason: FinishReason::Error,
                                    stop: None,
                                    usage: Usage::default(),
                                    error: Some(format!("detokenization failed: {e}")),
                                }));
                            }
                        }
                    }
                    _ => String::new(),
                };
                Some(Event::Token(TokenDelta {
                    ids: vec![id],
                    text,
                    logprobs: logprob.map(|l| vec![*l]),
                }))
            }
            Some(Msg::Finished(f)) => {
                self.done = true;
                Some(Event::Finished(*f))
            }
            None => {
                self.done = true;
                Some(Event::Finished(Finished {
                    reason: FinishReason::Error,
                    stop: None,
                    usage: Usage::default(),
                    error: Some("engine stopped without finishing the request".into()),
                }))
            }
        }
    }

    pub async fn recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let msg = self.rx.recv().await;
        self.observe(msg)
    }

    /// Non-blocking receive for synchronous callers (simulation tests). `None` means
    /// nothing is ready yet or the stream is over; see [`EventStream::is_done`].
    pub fn try_recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        match self.rx.try_recv() {
            Ok(msg) => self.observe(Some(msg)),
            Err(chan::TryRecvError::Empty) => None,
            Err(chan::TryRecvError::Disconnected) => self.observe(None),
        }
    }

    /// Blocking receive; must not be called from an async context.
    pub fn blocking_recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let msg = self.rx.blocking_recv();
        self.observe(msg)
    }

    pub fn is_done(&self) -> bool {
        self.done
    }
}

impl futures_core::Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(msg) => Poll::Ready(self.observe(msg)),
            Poll::Pending => Poll::Pending,
        }
    }
}
