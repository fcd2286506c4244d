//! Incremental, UTF-8 safe detokenization with stop strings.
//!
//! Decoding every generated id again at each step is quadratic, and decoding ids one by
//! one breaks multi-token characters and tokenizers that change a token's text by
//! context. The usual remedy (TGI, vLLM): keep two offsets into the ids, decode the small
//! window `[prefix_offset..]` and `[prefix_offset..read_offset]`, and emit the difference
//! once it no longer ends in U+FFFD (an incomplete character).
//!
//! On top of that, text that might be the start of a stop string is held back until it
//! either completes the stop string (and is dropped with everything after it) or cannot
//! any more. So no emitted text is ever retracted.
//!
//! Staging: `stage` computes the update without touching the state; `apply` installs it
//! at commit. That keeps the step transaction cheap (no clone of the id history).

use crate::model::Detokenizer;

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct TextState {
    /// Generated ids that contribute text (stop tokens and EOS excluded).
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Decoded but not yet emitted (a possible stop-string prefix).
    pending: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TextUpdate {
    pub emit: String,
    /// The stop string that matched; output ends here.
    pub stop: Option<String>,
    push: Option<u32>,
    prefix_offset: usize,
    read_offset: usize,
    pending: String,
}

impl TextState {
    /// The state after `id` is appended (None: no new id). `flush` emits everything left,
    /// incomplete characters included, because no more tokens will come.
    ///
    /// Takes `&mut self` only to append `id` while decoding (saving a copy of the window);
    /// the state is unchanged when it returns, whatever the outcome.
    pub fn stage(
        &mut self,
        id: Option<u32>,
        flush: bool,
        detok: &dyn Detokenizer,
        stops: &[String],
    ) -> Result<TextUpdate, String> {
        let len = self.ids.len();
        self.ids.extend(id);
        let out = self.stage_appended(id, flush, detok, stops);
        self.ids.truncate(len);
        out
    }

    fn stage_appended(
        &self,
        id: Option<u32>,
        flush: bool,
        detok: &dyn Detokenizer,
        stops: &[String],
    ) -> Result<TextUpdate, String> {
        let prefix_text = detok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let new_text = detok.decode(&self.ids[self.prefix_offset..])?;
        let (mut po, mut ro) = (self.prefix_offset, self.read_offset);
        let mut delta = "";
        let grew = new_text.len() > prefix_text.len();
        if grew && (flush || !new_text.ends_with('\u{FFFD}')) {
            // A tokenizer that rewrites earlier text is not prefix-stable; emit nothing
            // rather than garbage, and let a later window catch up.
            if let Some(d) = new_text.get(prefix_text.len()..) {
                if new_text.starts_with(prefix_text.as_str()) {
                    delta = d;
                    po = self.read_offset;
                    ro = self.ids.len();
                }
            }
        }
        if stops.is_empty() && self.pending.is_empty() {
            // Nothing can be held back: skip the stop-string machinery.
            return Ok(TextUpdate {
                emit: delta.to_owned(),
                stop: None,
                push: id,
                prefix_offset: po,
                read_offset: ro,
                pending: String::new(),
            });
        }
        let mut pending = String::with_capacity(self.pending.len() + delta.len());
        pending.push_str(&self.pending);
        pending.push_str(delta);

        let first_stop = stops
            .iter()
            .filter_map(|s| pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, s)| (at, std::cmp::Reverse(s.len())));
        let (emit, stop, keep) = if let Some((at, s)) = first_stop {
            (pending[..at].to_string(), Some(s.clone()), String::new())
        } else if flush {
            (pending, None, String::new())
        } else {
            let hold = held_suffix(&pending, stops);
            let cut = pending.len() - hold;
            (pending[..cut].to_string(), None, pending[cut..].to_string())
        };
        Ok(TextUpdate {
            emit,
            stop,
            push: id,
            prefix_offset: po,
            read_offset: ro,
            pending: keep,
        })
    }

    pub fn apply(&mut self, u: TextUpdate) {
        self.ids.extend(u.push);
        self.prefix_offset = u.prefix_offset;
        self.read_offset = u.read_offset;
        self.pending = u.pending;
    }
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of a stop
/// string (so might still grow into one).
fn held_suffix(text: &str, stops: &[String]) -> usize {
    let longest = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    if longest < 2 {
        return 0;
    }
    let lo = text.len().saturating_sub(longest - 1);
    for start in lo..text.len() {
        if !text.is_char_boundary(start) {
            continue;
        }
        let tail = &text[start..];
        if stops
            .iter()
            .any(|s| s.len() > tail.len() && s.starts_with(tail))
        {
            return tail.len();
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each id is one byte; decoding is lossy UTF-8, like a byte-level BPE.
    struct Bytes;
    impl Detokenizer for Bytes {
        fn decode(&self, ids: &[u32]) -> Result<String, String> {
            let b: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
            Ok(String::from_utf8_lossy(&b).into_owned())
        }
    }

    fn run(bytes: &[u8], stops: &[&str]) -> (Vec<String>, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut st = TextState::default();
        let mut out = Vec::new();
        for (i, &b) in bytes.iter().enumerate() {
            let last = i + 1 == bytes.len();
            let u = st.stage(Some(u32::from(b)), last, &Bytes, &stops).unwrap();
            out.push(u.emit.clone());
            let stop = u.stop.clone();
            st.apply(u);
            if stop.is_some() {
                return (out, stop);
            }
        }
        (out, None)
    }

    #[test]
    fn holds_incomplete_utf8() {
        let (out, _) = run("a€b".as_bytes(), &[]);
        assert_eq!(out, vec!["a", "", "", "€", "b"]);
    }

    #[test]
    fn stop_string_is_not_emitted_and_prefix_is_held() {
        let (out, stop) = run(b"hello wXrld. world", &["wor"]);
        assert_eq!(stop.as_deref(), Some("wor"));
        let text: String = out.concat();
        assert_eq!(text, "hello wXrld. ");
        // "w" was held back, then released when "X" showed it was no stop.
        assert_eq!(out[6], "");
        assert_eq!(out[7], "wX");
    }

    #[test]
    fn flush_releases_held_text() {
        let (out, stop) = run(b"abwo", &["wor"]);
        assert_eq!(stop, None);
        assert_eq!(out.concat(), "abwo");
    }

    #[test]
    fn stop_spanning_multibyte() {
        let (out, stop) = run("x€€y".as_bytes(), &["€y"]);
        assert_eq!(stop.as_deref(), Some("€y"));
        assert_eq!(out.concat(), "x€");
    }
}
