//! Tokenizer (`tokenizer.json`) and chat template (`tokenizer_config.json`).

use std::path::Path;

use serde::Serialize;

use crate::error::{ModelError, Result};

/// One chat message, as chat templates expect it.
#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl Tokenizer {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", cfg_path.display())))?,
            Err(_) => serde_json::Value::Null,
        };
        let token_str = |key: &str| -> Option<String> {
            match cfg.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
                _ => None,
            }
        };
        let chat_template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        Ok(Self {
            inner,
            chat_template,
            bos_token: token_str("bos_token"),
            eos_token: token_str("eos_token"),
        })
    }

    /// The underlying `tokenizers` tokenizer (e.g. to build a token trie from it).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes text as mlx-lm does: special-token strings in it become special
    /// tokens, and the tokenizer's post-processor (e.g. a BOS) applies unless
    /// the text already starts with the BOS string.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let add_special = match &self.bos_token {
            Some(bos) => !text.starts_with(bos.as_str()),
            None => true,
        };
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token
            .as_deref()
            .and_then(|t| self.inner.token_to_id(t))
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the model's chat template over `messages`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or_else(|| ModelError::Template("this model has no chat template".into()))?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", src)
            .map_err(|e| ModelError::Template(e.to_string()))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| ModelError::Template(e.to_string()))
    }
}
