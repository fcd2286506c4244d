//! Rebuilding a Hugging Face `tokenizer.json` / `tokenizer_config.json` from
//! the tokenizer a GGUF file describes in its metadata.
//!
//! Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the
//! pre-tokenizers whose split rules are known here (see [`PreTokenizerKind`]),
//! and SentencePiece BPE vocabularies (`"llama"`, e.g. Gemma's) rebuilt as a
//! byte-fallback BPE (see [`build_spm_tokenizer`]).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Map, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::byte_level::ByteLevel as ByteLevelProcessor;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::GgufError;
use crate::reader::GgufFile;

type Result<T> = std::result::Result<T, GgufError>;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    /// An ordinary token.
    pub const NORMAL: i64 = 1;
    /// The unknown token.
    pub const UNKNOWN: i64 = 2;
    /// A control (special) token such as `<|im_end|>`.
    pub const CONTROL: i64 = 3;
    /// A user-defined token, matched whole in text.
    pub const USER_DEFINED: i64 = 4;
    /// An unused slot.
    pub const UNUSED: i64 = 5;
    /// A raw byte token (`<0x0A>`).
    pub const BYTE: i64 = 6;
}

/// How text is split before BPE, from `tokenizer.ggml.pre`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2's split regex (`default`, `gpt-2` or no key).
    Gpt2,
    /// Every digit on its own, then GPT-2's split regex (`smollm`,
    /// `starcoder`, `refact`, `codeshell`: the StarCoder family).
    DigitsThenGpt2,
}

impl PreTokenizerKind {
    /// The kind for a `tokenizer.ggml.pre` value.
    pub fn from_gguf(pre: Option<&str>) -> Result<Self> {
        match pre {
            None | Some("default") | Some("gpt-2") | Some("gpt2") => Ok(Self::Gpt2),
            Some("smollm") | Some("starcoder") | Some("refact") | Some("codeshell") => Ok(Self::DigitsThenGpt2),
            Some(other) => Err(GgufError::Unsupported(format!(
                "tokenizer.ggml.pre = {other:?}: this converter only knows the gpt-2 and smollm/starcoder pre-tokenizers"
            ))),
        }
    }
}

/// A tokenizer rebuilt from GGUF metadata, plus what goes in `tokenizer_config.json`.
#[derive(Debug)]
pub struct GgufTokenizer {
    /// The tokenizer (as saved to `tokenizer.json`).
    pub tokenizer: Tokenizer,
    /// The contents of `tokenizer_config.json`.
    pub config: Value,
    /// The contents of `special_tokens_map.json`.
    pub special_tokens_map: Value,
    /// Number of tokens in the vocabulary.
    pub vocab_size: usize,
    /// Beginning-of-sequence id, if the file names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence id, if the file names one.
    pub eos_token_id: Option<u32>,
    /// Padding id, if the file names one.
    pub pad_token_id: Option<u32>,
}

/// GPT-2's byte -> printable character table used by byte-level BPE: the
/// printable Latin-1 bytes stand for themselves, every other byte `b` for
/// the code point 256 + (its rank among the non-printable bytes).
fn byte_to_char_table() -> [char; 256] {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let cp = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        table[b as usize] = char::from_u32(cp).unwrap_or('\u{fffd}');
    }
    table
}

/// Builds the tokenizer described by `gguf`'s `tokenizer.*` metadata.
pub fn build_tokenizer(gguf: &GgufFile) -> Result<GgufTokenizer> {
    let model = gguf.get_str("tokenizer.ggml.model")?;
    match model {
        "gpt2" => build_byte_level_tokenizer(gguf),
        "llama" => build_spm_tokenizer(gguf),
        _ => Err(GgufError::Unsupported(format!(
            "tokenizer.ggml.model = {model:?}: only byte-level BPE (\"gpt2\") and SentencePiece BPE (\"llama\") tokenizers are supported"
        ))),
    }
}

fn build_byte_level_tokenizer(gguf: &GgufFile) -> Result<GgufTokenizer> {
    let pre = PreTokenizerKind::from_gguf(gguf.get_str_opt("tokenizer.ggml.pre")?)?;
    let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
    if tokens.is_empty() || tokens.len() > u32::MAX as usize {
        return Err(GgufError::WrongType {
            key: "tokenizer.ggml.tokens".into(),
            expected: "a non-empty array".into(),
            found: format!("{} tokens", tokens.len()),
        });
    }
    let types = match gguf.get("tokenizer.ggml.token_type") {
        None => vec![token_type::NORMAL; tokens.len()],
        Some(_) => gguf.get_int_array("tokenizer.ggml.token_type")?,
    };
    if types.len() != tokens.len() {
        return Err(GgufError::WrongType {
            key: "tokenizer.ggml.token_type".into(),
            expected: format!("{} entries (one per token)", tokens.len()),
            found: format!("{} entries", types.len()),
        });
    }
    let merges_raw = gguf.get_str_array("tokenizer.ggml.merges")?;

    // Vocabulary: ordinary tokens are already spelled in the byte alphabet;
    // one that is not (and is not an added token, matched as raw text) is
    // re-spelled from its UTF-8 bytes.
    let table = byte_to_char_table();
    let mut alphabet = [false; 0x200];
    for c in table {
        alphabet[c as usize] = true;
    }
    let in_alphabet = |s: &str| {
        s.chars()
            .all(|c| (c as usize) < alphabet.len() && alphabet[c as usize])
    };
    let mut vocab: Vocab = Vocab::default();
    let mut added: Vec<(u32, String, bool)> = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        let id = id as u32;
        let spelled = match ty {
            token_type::CONTROL | token_type::USER_DEFINED => {
                added.push((id, tok.to_string(), ty == token_type::CONTROL));
                tok.to_string()
            }
            _ if in_alphabet(tok) => tok.to_string(),
            _ => tok.bytes().map(|b| table[b as usize]).collect(),
        };
        // Keep the first id of a duplicated spelling, as the file's order ranks them.
        vocab.entry(spelled).or_insert(id);
    }

    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let mut parts = m.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                merges.push((a.to_string(), b.to_string()))
            }
            _ => {
                return Err(GgufError::WrongType {
                    key: "tokenizer.ggml.merges".into(),
                    expected: "\"left right\" pairs".into(),
                    found: format!("element {i} = {m:?}"),
                })
            }
        }
    }

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| {
            GgufError::Tokenizer(format!(
                "building BPE from tokenizer.ggml.tokens/merges: {e}"
            ))
        })?;
    let mut tokenizer = Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let pre_tok: PreTokenizerWrapper = match pre {
        PreTokenizerKind::Gpt2 => byte_level.into(),
        PreTokenizerKind::DigitsThenGpt2 => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre_tok));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer.with_post_processor(Some(ByteLevelProcessor::new(false, false, true)));
    finish(
        gguf,
        tokenizer,
        &tokens,
        &added,
        "GPT2Tokenizer",
        None,
        false,
    )
}

/// Adds the control (special) and user-defined tokens, checks they kept
/// their ids, and assembles `tokenizer_config.json` and the special ids.
fn finish(
    gguf: &GgufFile,
    mut tokenizer: Tokenizer,
    tokens: &[&str],
    added: &[(u32, String, bool)],
    tokenizer_class: &str,
    default_chat_template: Option<&str>,
    user_defined_normalized: bool,
) -> Result<GgufTokenizer> {
    let specials: Vec<AddedToken> = added
        .iter()
        .filter(|(_, _, special)| *special)
        .map(|(_, t, _)| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    let plain: Vec<AddedToken> = added
        .iter()
        .filter(|(_, _, special)| !*special)
        .map(|(_, t, _)| AddedToken::from(t.clone(), false).normalized(user_defined_normalized))
        .collect();
    tokenizer.add_special_tokens(&specials);
    tokenizer.add_tokens(&plain);
    for (id, tok, _) in added {
        if tokenizer.token_to_id(tok) != Some(*id) {
            return Err(GgufError::Tokenizer(format!(
                "added token {tok:?} should keep id {id} but maps to {:?} (duplicated in the vocabulary?)",
                tokenizer.token_to_id(tok)
            )));
        }
    }

    let token_for = |key: &str| -> Result<Option<(u32, String)>> {
        match gguf.get_u32_opt(key)? {
            None => Ok(None),
            Some(id) => match tokens.get(id as usize) {
                Some(t) => Ok(Some((id, t.to_string()))),
                None => Err(GgufError::WrongType {
                    key: key.to_string(),
                    expected: format!("a token id below {}", tokens.len()),
                    found: id.to_string(),
                }),
            },
        }
    };
    let bos = token_for("tokenizer.ggml.bos_token_id")?;
    let eos = token_for("tokenizer.ggml.eos_token_id")?;
    let unk = token_for("tokenizer.ggml.unknown_token_id")?;
    let pad = token_for("tokenizer.ggml.padding_token_id")?;

    let mut config = Map::new();
    config.insert(
        "add_bos_token".into(),
        json!(gguf
            .get_bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false)),
    );
    config.insert(
        "add_eos_token".into(),
        json!(gguf
            .get_bool_opt("tokenizer.ggml.add_eos_token")?
            .unwrap_or(false)),
    );
    config.insert("add_prefix_space".into(), json!(false));
    let mut decoder = Map::new();
    for (id, tok, special) in added {
        decoder.insert(
            id.to_string(),
            json!({
                "content": tok,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": special,
            }),
        );
    }
    config.insert("added_tokens_decoder".into(), Value::Object(decoder));
    let additional: Vec<&String> = added.iter().filter(|a| a.2).map(|a| &a.1).collect();
    config.insert("additional_special_tokens".into(), json!(additional));
    let mut special_map = Map::new();
    for (name, tok) in [
        ("bos_token", &bos),
        ("eos_token", &eos),
        ("unk_token", &unk),
        ("pad_token", &pad),
    ] {
        if let Some((_, t)) = tok {
            config.insert(name.into(), json!(t));
            special_map.insert(name.into(), json!(t));
        }
    }
    special_map.insert("additional_special_tokens".into(), json!(additional));
    if let Some(template) = gguf
        .get_str_opt("tokenizer.chat_template")?
        .or(default_chat_template)
    {
        config.insert("chat_template".into(), json!(template));
    }
    config.insert("clean_up_tokenization_spaces".into(), json!(false));
    let arch = gguf.get_str_opt("general.architecture")?.unwrap_or("llama");
    if let Some(ctx) = gguf.get_u32_opt(&format!("{arch}.context_length"))? {
        config.insert("model_max_length".into(), json!(ctx));
    }
    config.insert("tokenizer_class".into(), json!(tokenizer_class));

    Ok(GgufTokenizer {
        tokenizer,
        config: Value::Object(config),
        special_tokens_map: Value::Object(special_map),
        vocab_size: tokens.len(),
        bos_token_id: bos.map(|b| b.0),
        eos_token_id: eos.map(|e| e.0),
        pad_token_id: pad.map(|p| p.0),
    })
}

/// SentencePiece's escaped space (U+2581).
pub const SPM_SPACE: char = '\u{2581}';

/// Pieces longer than this (in chars) get no merges (SentencePiece's trainer
/// caps pieces at 16 by default; Gemma's longest normal piece has 16). Bounds
/// the work per piece, which is quadratic in its length.
pub const MAX_MERGE_PIECE_CHARS: usize = 256;

/// The merges a SentencePiece BPE vocabulary implies, best first.
///
/// SentencePiece's BPE encoder (`bpe_model.cc`) starts from the characters
/// of the (normalized) text and repeatedly merges the adjacent pair whose
/// concatenation is a vocabulary piece with the highest score (leftmost on a
/// tie); user-defined pieces are matched whole beforehand and never merge.
/// A Hugging Face BPE does the same with ranked merges when every split
/// `(left, right)` of a normal piece into two normal pieces is a merge
/// ranked by the piece's score — the derivation transformers' SentencePiece
/// converters use (`SentencePieceExtractor`): score descending, then piece
/// id, then the ids of the two halves.
///
/// A vocabulary built to blow this up (every prefix of a long piece also a
/// piece) is refused: more than 4 merges per token, or more merge text than
/// 8 times the tokens' own bytes, is an error rather than a huge allocation
/// (Gemma 3: 513,511 merges for 262,144 tokens).
pub fn spm_merges(tokens: &[&str], scores: &[f32], types: &[i64]) -> Result<Vec<(String, String)>> {
    let mut normal: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
    for (id, (&t, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == token_type::NORMAL {
            normal.entry(t).or_insert(id as u32);
        }
    }
    let token_bytes: usize = tokens.iter().map(|t| t.len()).sum();
    let max_merges = tokens.len().saturating_mul(4);
    let max_bytes = token_bytes.saturating_mul(8);
    let too_many = |what: String| GgufError::WrongType {
        key: "tokenizer.ggml.tokens".into(),
        expected: format!(
            "a SentencePiece vocabulary (at most {max_merges} implied merges of {max_bytes} bytes)"
        ),
        found: what,
    };
    // (score, piece id, left id, right id, split byte offset)
    let mut found: Vec<(f32, u32, u32, u32, usize)> = Vec::new();
    let mut bytes = 0usize;
    for (&piece, &id) in &normal {
        if piece.chars().nth(MAX_MERGE_PIECE_CHARS).is_some() {
            continue;
        }
        let score = scores.get(id as usize).copied().unwrap_or(0.0);
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (normal.get(l), normal.get(r)) {
                bytes += piece.len();
                if found.len() >= max_merges || bytes > max_bytes {
                    return Err(too_many(format!(
                        "more than {} merges / {bytes} bytes of merges",
                        found.len()
                    )));
                }
                found.push((score, id, li, ri, at));
            }
        }
    }
    found.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    Ok(found
        .into_iter()
        .map(|(_, id, _, _, at)| {
            let (l, r) = tokens[id as usize].split_at(at);
            (l.to_string(), r.to_string())
        })
        .collect())
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = "llama"`, with
/// `tokenizer.ggml.scores` and `token_type`; Gemma's) as a Hugging Face
/// tokenizer, the shape of Google's own Gemma `tokenizer.json`:
///
/// - normalizer: spaces become `▁` (U+2581); a leading `▁` only if
///   `tokenizer.ggml.add_space_prefix` is true (Gemma: false);
/// - no pre-tokenizer (SentencePiece merges across the whole text);
/// - BPE over the vocabulary with [`spm_merges`], byte fallback to the
///   `<0xXX>` tokens, `<unk>` for the rest;
/// - control tokens as special added tokens (matched in the raw text);
///   user-defined tokens (Gemma's whitespace runs, `\n` runs, HTML tags) as
///   added tokens matched whole in the *normalized* text, as SentencePiece's
///   prefix matcher does after escaping spaces (so a literal `▁▁` in the text
///   is the two-space token too). llama.cpp's converter stores them with real
///   spaces; they keep that spelling (and id), the normalizer turns it into
///   the `▁` form they are matched in;
/// - decoder: `▁` back to spaces, byte tokens to bytes;
/// - post-processor: `<bos>` first when `tokenizer.ggml.add_bos_token`.
pub fn build_spm_tokenizer(gguf: &GgufFile) -> Result<GgufTokenizer> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::sequence::Sequence as DecoderSequence;
    use tokenizers::decoders::DecoderWrapper;
    use tokenizers::normalizers::replace::Replace;
    use tokenizers::normalizers::{NormalizerWrapper, Prepend, Sequence as NormalizerSequence};
    use tokenizers::processors::template::TemplateProcessing;

    let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
    if tokens.is_empty() || tokens.len() > u32::MAX as usize {
        return Err(GgufError::WrongType {
            key: "tokenizer.ggml.tokens".into(),
            expected: "a non-empty array".into(),
            found: format!("{} tokens", tokens.len()),
        });
    }
    let scores: Vec<f32> = {
        let raw = gguf.get_array("tokenizer.ggml.scores")?;
        let mut v = Vec::with_capacity(raw.len().min(tokens.len()));
        for (i, x) in raw.iter().enumerate() {
            match x.as_float() {
                Some(f) => v.push(f as f32),
                None => {
                    return Err(GgufError::WrongType {
                        key: "tokenizer.ggml.scores".into(),
                        expected: "an array of floats".into(),
                        found: format!("element {i} of type {}", x.type_name()),
                    })
                }
            }
        }
        v
    };
    let types = gguf.get_int_array("tokenizer.ggml.token_type")?;
    for (key, len) in [
        ("tokenizer.ggml.scores", scores.len()),
        ("tokenizer.ggml.token_type", types.len()),
    ] {
        if len != tokens.len() {
            return Err(GgufError::WrongType {
                key: key.into(),
                expected: format!("{} entries (one per token)", tokens.len()),
                found: format!("{len} entries"),
            });
        }
    }

    let mut vocab: Vocab = Vocab::default();
    let mut added: Vec<(u32, String, bool)> = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        let id = id as u32;
        match ty {
            token_type::CONTROL => added.push((id, tok.to_string(), true)),
            token_type::USER_DEFINED => added.push((id, tok.to_string(), false)),
            _ => {}
        }
        if vocab.insert(tok.to_string(), id).is_some() {
            return Err(GgufError::WrongType {
                key: "tokenizer.ggml.tokens".into(),
                expected: "distinct tokens".into(),
                found: format!("{tok:?} more than once (again at id {id})"),
            });
        }
    }
    let unk = match gguf.get_u32_opt("tokenizer.ggml.unknown_token_id")? {
        Some(id) => tokens.get(id as usize).map(|t| t.to_string()),
        None => vocab.contains_key("<unk>").then(|| "<unk>".to_string()),
    };
    let merges = spm_merges(&tokens, &scores, &types)?;
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        builder = builder.unk_token(u);
    }
    let bpe = builder.build().map_err(|e| {
        GgufError::Tokenizer(format!(
            "building BPE from the SentencePiece vocabulary: {e}"
        ))
    })?;
    let mut tokenizer = Tokenizer::new(bpe);
    let space = SPM_SPACE.to_string();
    let replace = Replace::new(" ", space.as_str())
        .map_err(|e| GgufError::Tokenizer(format!("normalizer: {e}")))?;
    let add_prefix = gguf
        .get_bool_opt("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let normalizer: NormalizerWrapper = if add_prefix {
        NormalizerSequence::new(vec![Prepend::new(space.clone()).into(), replace.into()]).into()
    } else {
        replace.into()
    };
    tokenizer.with_normalizer(Some(normalizer));
    let unspace = Replace::new(space.as_str(), " ")
        .map_err(|e| GgufError::Tokenizer(format!("decoder: {e}")))?;
    let mut decoders = vec![
        DecoderWrapper::Replace(unspace),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_prefix {
        decoders.push(DecoderWrapper::Strip(
            tokenizers::decoders::strip::Strip::new(' ', 1, 0),
        ));
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    let add_bos = gguf
        .get_bool_opt("tokenizer.ggml.add_bos_token")?
        .unwrap_or(true);
    let bos = match gguf.get_u32_opt("tokenizer.ggml.bos_token_id")? {
        Some(id) => tokens.get(id as usize).map(|t| (t.to_string(), id)),
        None => None,
    };
    if let (true, Some((bos_tok, bos_id))) = (add_bos, &bos) {
        let post = TemplateProcessing::builder()
            .try_single(format!("{bos_tok} $A"))
            .and_then(|b| b.try_pair(format!("{bos_tok} $A {bos_tok}:1 $B:1")))
            .map_err(|e| GgufError::Tokenizer(format!("post-processor: {e}")))?
            .special_tokens(vec![(bos_tok.clone(), *bos_id)])
            .build()
            .map_err(|e| GgufError::Tokenizer(format!("post-processor: {e}")))?;
        tokenizer.with_post_processor(Some(post));
    }
    let arch = gguf.get_str_opt("general.architecture")?.unwrap_or("");
    let template = (arch == "gemma3").then_some(crate::gemma3::GEMMA3_CHAT_TEMPLATE);
    let mut out = finish(
        gguf,
        tokenizer,
        &tokens,
        &added,
        "PreTrainedTokenizerFast",
        template,
        true,
    )?;
    if let Value::Object(cfg) = &mut out.config {
        cfg.insert("add_bos_token".into(), json!(add_bos));
        cfg.insert("add_prefix_space".into(), json!(add_prefix));
        cfg.insert("spaces_between_special_tokens".into(), json!(false));
    }
    Ok(out)
}

pub(crate) fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|source| GgufError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text + "\n").map_err(|e| GgufError::io("write", path, e))
}

impl GgufTokenizer {
    /// Writes `tokenizer.json`, `tokenizer_config.json` and
    /// `special_tokens_map.json` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join("tokenizer.json");
        self.tokenizer
            .save(&path, false)
            .map_err(|e| GgufError::Tokenizer(format!("saving {}: {e}", path.display())))?;
        write_json(&dir.join("tokenizer_config.json"), &self.config)?;
        write_json(
            &dir.join("special_tokens_map.json"),
            &self.special_tokens_map,
        )
    }
}

/// Token ids of `text` without special-token post-processing (helper for tests and tools).
pub fn encode_ids(tokenizer: &Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
    tokenizer
        .encode(text, add_special_tokens)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| GgufError::Tokenizer(format!("encoding {text:?}: {e}")))
}

/// Counts how many vocabulary entries are each token type (diagnostics).
pub fn token_type_histogram(gguf: &GgufFile) -> Result<HashMap<i64, usize>> {
    let mut h = HashMap::new();
    for t in gguf.get_int_array("tokenizer.ggml.token_type")? {
        *h.entry(t).or_insert(0) += 1;
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::{GgufBuilder, GgufValue};

    fn strings(v: &[&str]) -> GgufValue {
        GgufValue::Array(v.iter().map(|s| GgufValue::String(s.to_string())).collect())
    }

    fn tiny(pre: &str) -> GgufFile {
        // Bytes 'a', 'b', space (Ġ), digits, and merges "a b" -> "ab", "Ġ ab" -> "Ġab".
        let mut toks = vec!["<|end|>", "a", "b", "Ġ", "1", "2", "ab", "Ġab", "12", "Ġ1"];
        let mut types = vec![3, 1, 1, 1, 1, 1, 1, 1, 1, 1];
        toks.push("<tool>");
        types.push(4);
        let b = GgufBuilder::new()
            .kv("general.architecture", GgufValue::String("llama".into()))
            .kv("tokenizer.ggml.model", GgufValue::String("gpt2".into()))
            .kv("tokenizer.ggml.pre", GgufValue::String(pre.into()))
            .kv("tokenizer.ggml.tokens", strings(&toks))
            .kv(
                "tokenizer.ggml.token_type",
                GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
            )
            .kv(
                "tokenizer.ggml.merges",
                strings(&["a b", "Ġ ab", "1 2", "Ġ 1"]),
            )
            .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(0))
            .kv(
                "tokenizer.chat_template",
                GgufValue::String("{{ x }}".into()),
            );
        GgufFile::from_bytes("tiny", b.build()).unwrap()
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xad], 'Ń');
        let mut all: Vec<char> = t.to_vec();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn tiny_tokenizer_encodes_and_splits_digits() {
        let g = tiny("smollm");
        let t = build_tokenizer(&g).unwrap();
        assert_eq!(
            encode_ids(&t.tokenizer, "ab ab", false).unwrap(),
            vec![6, 7]
        );
        // Digits are split one by one, so neither "12" nor "Ġ1" can be formed.
        assert_eq!(
            encode_ids(&t.tokenizer, "ab 12", false).unwrap(),
            vec![6, 3, 4, 5]
        );
        assert_eq!(
            encode_ids(&t.tokenizer, "a<|end|>b<tool>", false).unwrap(),
            vec![1, 0, 2, 10]
        );
        let g = tiny("gpt-2");
        let t2 = build_tokenizer(&g).unwrap();
        assert_eq!(
            encode_ids(&t2.tokenizer, "ab 12", false).unwrap(),
            vec![6, 3, 8]
        );
        assert_eq!(t.config["eos_token"], "<|end|>");
        assert_eq!(t.config["chat_template"], "{{ x }}");
        assert_eq!(t.config["added_tokens_decoder"]["0"]["special"], true);
        assert_eq!(t.config["added_tokens_decoder"]["10"]["special"], false);
        let decoded = t.tokenizer.decode(&[6, 3, 4, 5], false).unwrap();
        assert_eq!(decoded, "ab 12");
    }

    #[test]
    fn unknown_pre_tokenizer_and_model_are_errors() {
        let err = build_tokenizer(&tiny("some-new-thing"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("some-new-thing"), "{err}");
        let g = GgufFile::from_bytes(
            "x",
            GgufBuilder::new()
                .kv("tokenizer.ggml.model", GgufValue::String("bert".into()))
                .build(),
        )
        .unwrap();
        assert!(matches!(
            build_tokenizer(&g),
            Err(GgufError::Unsupported(_))
        ));
    }
}
