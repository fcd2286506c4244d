//! Server-sent events as OpenAI-compatible servers stream them, and the
//! completion chunks inside them.
//!
//! The byte stream arrives in arbitrary pieces (a line, an event, or a JSON
//! object may be cut anywhere, even inside a UTF-8 sequence), so the parser
//! buffers bytes and only emits whole events: an event ends at a blank line;
//! its `data:` lines are joined with `\n`; `:` comment lines and other fields
//! (`event:`, `id:`, `retry:`) are ignored; `\n`, `\r\n` and `\r` all end a
//! line.

/// One event's payload.
#[derive(Debug, Clone, PartialEq)]
pub enum SseEvent {
    /// The `data` of an event.
    Data(String),
    /// `data: [DONE]`: the stream's end marker.
    Done,
}

/// Incremental SSE parser.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
    /// The previous piece ended in `\r`: a `\n` starting the next piece
    /// belongs to that line end.
    pending_cr: bool,
}

impl SseParser {
    /// A parser with nothing buffered.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next piece of the body; returns the events it completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let mut bytes = bytes;
        if self.pending_cr && bytes.first() == Some(&b'\n') {
            bytes = &bytes[1..];
        }
        self.pending_cr = false;
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        let mut i = 0;
        while i < self.buf.len() {
            let b = self.buf[i];
            if b == b'\n' || b == b'\r' {
                let line_end = i;
                i += 1;
                if b == b'\r' {
                    if i < self.buf.len() {
                        if self.buf[i] == b'\n' {
                            i += 1;
                        }
                    } else {
                        self.pending_cr = true;
                    }
                }
                let line = String::from_utf8_lossy(&self.buf[start..line_end]).into_owned();
                self.line(&line, &mut out);
                start = i;
            } else {
                i += 1;
            }
        }
        self.buf.drain(..start);
        out
    }

    /// The body ended. As the SSE spec says, an event cut off before its
    /// blank line is discarded — except a bare `[DONE]`, which some servers
    /// send without the final blank line.
    pub fn finish(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.buf.is_empty() {
            let line = String::from_utf8_lossy(&self.buf).into_owned();
            self.buf.clear();
            self.line(&line, &mut out);
        }
        if let Some(data) = self.data.take() {
            if data.trim() == "[DONE]" {
                out.push(SseEvent::Done);
            }
        }
        out
    }

    fn line(&mut self, line: &str, out: &mut Vec<SseEvent>) {
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        if let Some(data) = self.data.take() {
            if data.trim() == "[DONE]" {
                out.push(SseEvent::Done);
            } else {
                out.push(SseEvent::Data(data));
            }
        }
    }
}

/// What one streamed completion chunk says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// Generated text in this chunk (`choices[0].text` for `/v1/completions`,
    /// `choices[0].delta.content` for chat); empty when none.
    pub text: String,
    /// `choices[0].finish_reason` when set.
    pub finish_reason: Option<String>,
    /// `usage.prompt_tokens` when the chunk carries usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens` when the chunk carries usage.
    pub completion_tokens: Option<u64>,
    /// An in-stream error (`{"error": ...}`), as text.
    pub error: Option<String>,
}

/// Parses the JSON of one `data:` payload.
pub fn parse_chunk(data: &str) -> Result<Chunk, String> {
    let v: serde_json::Value =
        serde_json::from_str(data).map_err(|e| format!("bad JSON in SSE data: {e}"))?;
    let mut c = Chunk::default();
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        c.error = Some(match err {
            serde_json::Value::String(s) => s.clone(),
            other => other
                .get("message")
                .and_then(|m| m.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| other.to_string()),
        });
    }
    if let Some(choice) = v
        .get("choices")
        .and_then(|c| c.as_array())
        .and_then(|a| a.first())
    {
        let text = choice
            .get("text")
            .and_then(|t| t.as_str())
            .or_else(|| choice.pointer("/delta/content").and_then(|t| t.as_str()));
        c.text = text.unwrap_or_default().to_string();
        c.finish_reason = choice
            .get("finish_reason")
            .and_then(|f| f.as_str())
            .map(str::to_string);
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        c.prompt_tokens = u.get("prompt_tokens").and_then(|x| x.as_u64());
        c.completion_tokens = u.get("completion_tokens").and_then(|x| x.as_u64());
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(s: &str) -> SseEvent {
        SseEvent::Data(s.to_string())
    }

    #[test]
    fn whole_events() {
        let mut p = SseParser::new();
        let ev = p.push(b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n");
        assert_eq!(
            ev,
            vec![data("{\"a\":1}"), data("{\"a\":2}"), SseEvent::Done]
        );
        assert!(p.finish().is_empty());
    }

    #[test]
    fn split_anywhere_gives_the_same_events() {
        let body = "data: {\"choices\":[{\"text\":\"h\u{e9}llo\"}]}\r\n\r\n: keep-alive\n\nevent: x\nid: 3\ndata: first\ndata:second\n\ndata: [DONE]\n\n";
        let bytes = body.as_bytes();
        let want = vec![
            data("{\"choices\":[{\"text\":\"h\u{e9}llo\"}]}"),
            data("first\nsecond"),
            SseEvent::Done,
        ];
        // Every single split point, and byte-at-a-time.
        for cut in 0..=bytes.len() {
            let mut p = SseParser::new();
            let mut got = p.push(&bytes[..cut]);
            got.extend(p.push(&bytes[cut..]));
            got.extend(p.finish());
            assert_eq!(got, want, "cut at {cut}");
        }
        let mut p = SseParser::new();
        let mut got = Vec::new();
        for b in bytes {
            got.extend(p.push(std::slice::from_ref(b)));
        }
        got.extend(p.finish());
        assert_eq!(got, want);
    }

    #[test]
    fn cr_only_line_ends_and_cr_lf_split_across_pieces() {
        let mut p = SseParser::new();
        let mut got = p.push(b"data: a\r");
        got.extend(p.push(b"\n\r"));
        got.extend(p.push(b"\ndata: b\r\r"));
        assert_eq!(got, vec![data("a"), data("b")]);
    }

    #[test]
    fn cut_off_event_is_discarded_at_finish_except_done() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: [DONE]").is_empty());
        assert_eq!(p.finish(), vec![SseEvent::Done]);
        let mut p = SseParser::new();
        assert!(p.push(b"data: [DONE]\n").is_empty());
        assert_eq!(p.finish(), vec![SseEvent::Done]);
        let mut p = SseParser::new();
        assert_eq!(p.push(b"data: a\n\ndata: {\"choi"), vec![data("a")]);
        assert!(p.finish().is_empty());
        let mut p = SseParser::new();
        assert!(p.push(b"data: x\n").is_empty());
        assert!(p.finish().is_empty());
    }

    #[test]
    fn done_and_empty_data() {
        let mut p = SseParser::new();
        assert_eq!(
            p.push(b"data:[DONE]\n\ndata:\n\n"),
            vec![SseEvent::Done, data("")]
        );
        // Blank lines without data dispatch nothing.
        assert!(p.push(b"\n\n\n").is_empty());
    }

    #[test]
    fn parses_completion_chat_usage_and_error_chunks() {
        let c = parse_chunk(
            r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"finish_reason":null,"text":" Paris"}]}"#,
        )
        .unwrap();
        assert_eq!(c.text, " Paris");
        assert_eq!(c.finish_reason, None);

        let c =
            parse_chunk(r#"{"choices":[{"index":0,"finish_reason":"length","text":""}]}"#).unwrap();
        assert_eq!(c.text, "");
        assert_eq!(c.finish_reason.as_deref(), Some("length"));

        let c =
            parse_chunk(r#"{"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}"#).unwrap();
        assert_eq!(c.text, "Hi");

        let c = parse_chunk(
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":64,"total_tokens":76}}"#,
        )
        .unwrap();
        assert_eq!((c.prompt_tokens, c.completion_tokens), (Some(12), Some(64)));
        assert_eq!(c.text, "");

        assert_eq!(
            parse_chunk(r#"{"error":"model overloaded"}"#)
                .unwrap()
                .error
                .as_deref(),
            Some("model overloaded")
        );
        assert_eq!(
            parse_chunk(r#"{"error":{"message":"boom","code":500}}"#)
                .unwrap()
                .error
                .as_deref(),
            Some("boom")
        );
        assert!(parse_chunk("{not json").unwrap_err().contains("bad JSON"));
    }
}
