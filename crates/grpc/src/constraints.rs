//! Output constraints against the served tokenizer: its vocabulary as a token trie
//! (`toktrie_hf_tokenizers`, llguidance's adapter for `tokenizers`), the model's EOS
//! tokens as the trie's, masks as wide as the model's logits.

use weft_models::Tokenizer;
use weft_scheduler::Grammars;

use crate::runtime::ServedModel;

/// The grammar compiler for `model` served with `tokenizer`.
pub fn grammars(tokenizer: &Tokenizer, model: &ServedModel) -> anyhow::Result<Grammars> {
    let mut bt = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(tokenizer.hf().clone())?;
    if !model.eos_token_ids.is_empty() {
        bt.set_eos_tokens(&model.eos_token_ids);
    }
    let env = bt.into_tok_env(Some(model.vocab_size))?;
    Grammars::new(env, model.vocab_size).map_err(anyhow::Error::msg)
}
