//! Constrained output: a request's tokens kept inside a JSON schema, a regular
//! expression, a Lark grammar or a list of choices, with
//! [llguidance](https://crates.io/crates/llguidance) (the library vLLM, SGLang and
//! llama.cpp use) computing each step's token mask over the served tokenizer's trie.
//!
//! [`Grammars`] compiles a [`ConstraintSpec`] into a [`Constraint`] (the front end does it
//! before admission, so a bad grammar is the client's error, never the engine's). The
//! scheduler keeps the constraint in its request and drives it with the step
//! transaction:
//!
//! - when a step's inputs are filled, a constrained row that picks a token gets the
//!   mask of the constraint's state after the request's *committed* tokens
//!   ([`RowSampling::allowed`](crate::RowSampling::allowed)); a retried step reuses it;
//! - the step's picks are checked against that mask while the step is staged (a pick
//!   outside it fails the step like any contract violation);
//! - only once the step has committed does the constraint consume the picks (the apply,
//!   which cannot fail), so a rolled-back step leaves it exactly as it was: there is
//!   nothing to undo.
//!
//! A request ends with [`FinishReason::Stop`](crate::FinishReason::Stop) when its
//! grammar is complete: right after the token that completes it when nothing may follow
//! (the grammar forces the end), or when it picks an end-of-sequence token where the
//! grammar may end.

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};

use crate::model::TokenMask;

pub use llguidance;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark-style context-free grammar (llguidance's dialect: `start: ...` rules,
    /// `%json { ... }` and `%regex` extensions).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl ConstraintSpec {
    /// The kind, as the API names it.
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema(_) => "json_schema",
            ConstraintSpec::JsonObject => "json_object",
            ConstraintSpec::Regex(_) => "regex",
            ConstraintSpec::Lark(_) => "grammar",
            ConstraintSpec::Choice(_) => "choice",
        }
    }
}

/// Compiles constraints against one tokenizer; shared by every request of a server.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// Width of the model's logits: masks cover `0..vocab`.
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish()
    }
}

/// Largest choice list and longest grammar text accepted (a few MB of JSON schema is
/// what llguidance's own limits are sized for; these keep compile time bounded).
pub const MAX_CHOICES: usize = 1024;
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

impl Grammars {
    /// `env`: the served tokenizer's token trie (its EOS tokens the model's);
    /// `vocab`: the model's vocabulary (logit width), at least the trie's.
    pub fn new(env: TokEnv, vocab: usize) -> Result<Self, String> {
        let trie_vocab = env.tok_trie().vocab_size();
        if trie_vocab > vocab {
            return Err(format!(
                "the tokenizer has {trie_vocab} tokens, more than the model's {vocab} logits"
            ));
        }
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        // Errors name what is wrong without echoing the whole grammar back.
        factory.limits_mut().verbose_errors = false;
        Ok(Self {
            factory: Arc::new(factory),
            vocab,
        })
    }

    /// The mask width: the model's vocabulary.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles `spec`; the error says what is wrong with it, for the client.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, String> {
        let grammar = match spec {
            ConstraintSpec::JsonSchema(text) => {
                check_size(text)?;
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| format!("the JSON schema is not valid JSON: {e}"))?;
                TopLevelGrammar::from_json_schema(compact(schema)?)
            }
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"}))?)
            }
            ConstraintSpec::Regex(rx) => {
                check_size(rx)?;
                if rx.is_empty() {
                    return Err("the regex is empty".into());
                }
                TopLevelGrammar::from_regex(rx)
            }
            ConstraintSpec::Lark(g) => {
                check_size(g)?;
                if g.trim().is_empty() {
                    return Err("the grammar is empty".into());
                }
                TopLevelGrammar::from_lark(g.clone())
            }
            ConstraintSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err("the choice list is empty".into());
                }
                if choices.len() > MAX_CHOICES {
                    return Err(format!("{} choices, at most {MAX_CHOICES}", choices.len()));
                }
                if let Some(i) = choices.iter().position(String::is_empty) {
                    return Err(format!("choice {i} is empty"));
                }
                let total: usize = choices.iter().map(String::len).sum();
                if total > MAX_GRAMMAR_BYTES {
                    return Err(format!(
                        "the choices have {total} bytes, at most {MAX_GRAMMAR_BYTES}"
                    ));
                }
                // Each choice a quoted literal (Lark's strings are JSON strings).
                let alts: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::Value::String(c.clone()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        };
        // The grammar is the client's: a panic while compiling it is its error too.
        let factory = &self.factory;
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            factory.create_parser(grammar)
        }))
        .map_err(|_| "the constraint could not be compiled (internal error)".to_string())?
        .map_err(|e| first_line(&e.to_string()))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(first_line(&e));
        }
        // A grammar that allows no output at all is as useless as an invalid one.
        match matcher.compute_mask() {
            Ok(m) if m.is_zero() && !matcher.is_stopped() => {
                return Err("the constraint allows no output".into())
            }
            Ok(_) => {}
            Err(e) => return Err(first_line(&e.to_string())),
        }
        Ok(Constraint {
            matcher,
            kind: spec.kind(),
            words: self.vocab.div_ceil(32),
            consumed: 0,
            mask: None,
            drafted: None,
        })
    }
}

/// The schema with llguidance's options for Weft's JSON: compact (no whitespace between
/// tokens, `,` and `:` separators), unless the schema sets `x-guidance` itself. Free
/// whitespace lets a model pad its output indefinitely, which small models do.
fn compact(schema: serde_json::Value) -> Result<serde_json::Value, String> {
    match schema {
        serde_json::Value::Object(mut m) => {
            m.entry("x-guidance")
                .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
            Ok(serde_json::Value::Object(m))
        }
        serde_json::Value::Bool(true) => compact(serde_json::json!({})),
        serde_json::Value::Bool(false) => Err("the JSON schema `false` allows no value".into()),
        _ => Err("the JSON schema must be an object (or true)".into()),
    }
}

fn check_size(text: &str) -> Result<(), String> {
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(format!("{} bytes, at most {MAX_GRAMMAR_BYTES}", text.len()));
    }
    Ok(())
}

fn first_line(e: &str) -> String {
    let line = e.lines().find(|l| !l.trim().is_empty()).unwrap_or(e);
    let mut s: String = line.chars().take(300).collect();
    if s.len() < line.len() {
        s.push_str("...");
    }
    s
}

/// One request's constraint: its matcher at the request's committed output.
pub struct Constraint {
    matcher: Matcher,
    kind: &'static str,
    /// Mask words (the model's vocabulary / 32, rounded up).
    words: usize,
    /// Tokens consumed: the request's committed generated tokens.
    consumed: usize,
    /// The mask at `consumed`, once computed (a retried step reuses it).
    mask: Option<(usize, TokenMask)>,
    /// The last draft checked, with its masks (a retried step reuses them).
    drafted: Option<Drafted>,
}

/// A speculation draft checked against the constraint at `at` consumed tokens.
#[derive(Clone)]
struct Drafted {
    at: usize,
    /// The draft as proposed, before it was cut where the constraint rejects it.
    proposed: Vec<u32>,
    /// Its first `kept` tokens are what the constraint accepts.
    kept: usize,
    /// The mask after the first `j + 1` kept tokens, for the draft's position `j + 1`.
    masks: Vec<TokenMask>,
    /// Whether the last kept token completes the grammar.
    completes: bool,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            // Independent state and caches: clones may run on other threads.
            matcher: self.matcher.deep_clone(),
            kind: self.kind,
            words: self.words,
            consumed: self.consumed,
            mask: self.mask.clone(),
            drafted: self.drafted.clone(),
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("kind", &self.kind)
            .field("consumed", &self.consumed)
            .finish()
    }
}

impl Constraint {
    /// `json_schema`, `json_object`, `regex`, `grammar` or `choice`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Tokens consumed so far (the request's committed output).
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Mask width in tokens (a multiple of 32 covering the vocabulary it was built for).
    pub fn vocab_words(&self) -> usize {
        self.words
    }

    /// The tokens allowed next, and whether it had to be computed (else cached).
    /// When the grammar is complete only end-of-sequence tokens are allowed.
    pub(crate) fn mask(&mut self) -> Result<(TokenMask, bool), String> {
        if let Some((at, m)) = &self.mask {
            if *at == self.consumed {
                return Ok((m.clone(), false));
            }
        }
        let mask = self.compute_mask()?;
        self.mask = Some((self.consumed, mask.clone()));
        Ok((mask, true))
    }

    /// The matcher's mask in its current state (EOS only once it is stopped).
    fn compute_mask(&mut self) -> Result<TokenMask, String> {
        let v = self.matcher.compute_mask_or_eos().map_err(matcher_error)?;
        let mut words = v.as_slice().to_vec();
        words.resize(self.words, 0);
        let mask = TokenMask::from_words(words);
        if mask.count() == 0 {
            return Err("output constraint allows no token".into());
        }
        Ok(mask)
    }

    /// Checks a speculation draft (the tokens after the row's next pick) against the
    /// constraint: `draft` is cut before the first token the constraint would not
    /// allow there (the model's masked pick could never match it) and after one that
    /// completes the grammar. Returns how many masks were computed: the committed
    /// state's if it was not yet, and one per kept token for the position after it
    /// ([`Self::draft_masks`]); the same draft again at the same state reuses them.
    /// The constraint's state is left as it was (the draft is consumed tentatively,
    /// and rolled back).
    pub(crate) fn check_draft(&mut self, draft: &mut Vec<u32>) -> Result<u64, String> {
        if let Some(d) = &self.drafted {
            if d.at == self.consumed && d.proposed == *draft {
                draft.truncate(d.kept);
                return Ok(0);
            }
        }
        let (mut prev, computed) = self.mask()?;
        let mut computed = u64::from(computed);
        let mut d = Drafted {
            at: self.consumed,
            proposed: draft.clone(),
            kept: 0,
            masks: Vec::new(),
            completes: false,
        };
        // The masks are cheap to check against and prove each token valid, so the
        // tentative consume never puts the matcher in its error state.
        let mut r = Ok(());
        for &t in draft.iter() {
            if !prev.allows(t) {
                break;
            }
            if let Err(e) = self.matcher.consume_tokens(&[t]) {
                r = Err(matcher_error(e));
                break;
            }
            d.kept += 1;
            d.completes = self.matcher.is_stopped();
            match self.compute_mask() {
                Ok(m) => prev = m,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
            computed += 1;
            d.masks.push(prev.clone());
            if d.completes {
                break;
            }
        }
        let undo = self.matcher.rollback(d.kept).map_err(matcher_error);
        r?;
        undo?;
        draft.truncate(d.kept);
        self.drafted = Some(d);
        Ok(computed)
    }

    /// The masks of a checked draft's positions after the first (the first picks under
    /// [`Self::mask`]): `n` of them, the draft being `n` tokens long.
    pub(crate) fn draft_masks(&self, n: usize) -> Result<&[TokenMask], String> {
        match &self.drafted {
            _ if n == 0 => Ok(&[]),
            Some(d) if d.at == self.consumed && d.kept >= n => Ok(&d.masks[..n]),
            _ => Err(format!(
                "a draft of {n} tokens was not checked against the output constraint"
            )),
        }
    }

    /// Whether position `j` of a step may pick `t`: the committed state's mask at 0,
    /// the checked draft's masks after it.
    pub(crate) fn allows_at(&self, j: usize, t: u32) -> bool {
        if j == 0 {
            return self.allows(t);
        }
        self.draft_masks(j).is_ok_and(|m| m[j - 1].allows(t))
    }

    /// Whether picking `t` at position `j` of a step whose row carries `draft` (checked)
    /// completes the grammar: after the draft's first `j` tokens, which the step
    /// accepted. The state is left as it was.
    pub(crate) fn completes_at(&mut self, j: usize, t: u32, draft: &[u32]) -> Result<bool, String> {
        if j < draft.len() && draft[j] == t {
            // A draft token: checked with the draft (only its last may complete).
            self.draft_masks(draft.len())?;
            let completes = self.drafted.as_ref().is_some_and(|d| d.completes);
            return Ok(completes && j + 1 == draft.len());
        }
        let before = draft.get(..j).ok_or("a pick past the draft")?;
        self.matcher.consume_tokens(before).map_err(matcher_error)?;
        let r = self.completes_with(t);
        let undo = self.matcher.rollback(before.len()).map_err(matcher_error);
        let done = r?;
        undo?;
        Ok(done)
    }

    /// Whether the mask of the committed state allows `t` (the mask must have been
    /// computed for this state: it was, for the step that picked `t`).
    pub(crate) fn allows(&self, t: u32) -> bool {
        matches!(&self.mask, Some((at, m)) if *at == self.consumed && m.allows(t))
    }

    /// Consumes committed tokens; returns whether the grammar is complete (nothing
    /// but the end may follow).
    pub(crate) fn advance(&mut self, tokens: &[u32]) -> Result<bool, String> {
        self.matcher.consume_tokens(tokens).map_err(matcher_error)?;
        self.consumed += tokens.len();
        Ok(self.matcher.is_stopped())
    }

    /// Whether consuming `t` would complete the grammar (nothing but the end could
    /// follow). The state is left as it was: `t` is consumed and rolled back again.
    pub(crate) fn completes_with(&mut self, t: u32) -> Result<bool, String> {
        self.matcher.consume_tokens(&[t]).map_err(matcher_error)?;
        let done = self.matcher.is_stopped();
        self.matcher.rollback(1).map_err(matcher_error)?;
        Ok(done)
    }
}

fn matcher_error(e: anyhow::Error) -> String {
    format!("output constraint: {}", first_line(&e.to_string()))
}

/// Host time spent computing masks, for one step.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct MaskTime {
    pub seconds: f64,
    pub computed: u64,
}

impl MaskTime {
    /// Adds the time since `since`, in which `computed` masks were (a count or a bool).
    pub fn add(&mut self, since: Instant, computed: impl Into<u64>) {
        self.seconds += since.elapsed().as_secs_f64();
        self.computed += computed.into();
    }
}
