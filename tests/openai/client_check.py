"""The official `openai` client against a running `weft serve` (its HTTP API).

    python tests/openai/client_check.py <base_url> <api_key> <model>

Runs completions and chat, whole and streamed (with usage), logprobs, seeds,
stop strings and the refusal paths, asserting what an SDK user relies on;
prints one JSON line of facts for the Rust test to check further. Exit 0 = ok.
"""
import json
import sys

import openai

base, key, model = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
facts = {}

# /v1/models
ms = c.models.list()
ids = [m.id for m in ms.data]
assert model in ids, ids
facts["models"] = ids

# Completions, whole.
r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                         temperature=0)
ch = r.choices[0]
assert r.object == "text_completion" and isinstance(ch.text, str) and ch.text, r
assert ch.finish_reason in ("length", "stop"), ch.finish_reason
assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0, r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
facts["greedy_text"] = ch.text

# The same, streamed with usage: the same text, a usage chunk at the end.
parts, usage, reasons = [], None, []
for chunk in c.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=8, temperature=0, stream=True,
                                  stream_options={"include_usage": True}):
    if chunk.usage is not None:
        usage = chunk.usage
    for x in chunk.choices:
        parts.append(x.text)
        if x.finish_reason:
            reasons.append(x.finish_reason)
assert "".join(parts) == facts["greedy_text"], (parts, facts["greedy_text"])
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
assert len(reasons) == 1, reasons

# Seeded sampling repeats; logprobs come per token.
a = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                         temperature=0.9, top_p=0.95, seed=42, logprobs=2)
b = c.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                         temperature=0.9, top_p=0.95, seed=42, logprobs=2)
assert a.choices[0].text == b.choices[0].text
lp = a.choices[0].logprobs
assert len(lp.tokens) == a.usage.completion_tokens and len(lp.token_logprobs) == len(lp.tokens)
assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)

# Chat, whole and streamed.
msgs = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."}]
r = c.chat.completions.create(model=model, messages=msgs, max_completion_tokens=12,
                              temperature=0, logprobs=True, top_logprobs=3)
m = r.choices[0].message
assert r.object == "chat.completion" and m.role == "assistant" and m.content, r
assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
assert all(len(t.top_logprobs) == 3 for t in r.choices[0].logprobs.content)
text, roles, usage = [], [], None
for chunk in c.chat.completions.create(model=model, messages=msgs, max_completion_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
    if chunk.usage is not None:
        usage = chunk.usage
    for x in chunk.choices:
        if x.delta.role:
            roles.append(x.delta.role)
        if x.delta.content:
            text.append(x.delta.content)
assert "".join(text) == m.content, (text, m.content)
assert roles == ["assistant"], roles
assert usage.completion_tokens == r.usage.completion_tokens
facts["chat_text"] = m.content

# A stop string ends the text before it.
r = c.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                         stop=[","])
assert "," not in r.choices[0].text and r.choices[0].finish_reason == "stop", r.choices[0]

# Refusals: a bad parameter (400 naming it), n > 1, a bad key (401).
for kwargs, param in [({"temperature": 500.0}, "temperature"), ({"n": 2}, "n"),
                      ({"max_tokens": 10**9}, "max_tokens")]:
    try:
        c.completions.create(model=model, prompt="hi", **{"max_tokens": 4, **kwargs})
        raise SystemExit(f"{kwargs} was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == param, (kwargs, e.body)
        assert e.body["type"] == "invalid_request_error"
bad = openai.OpenAI(base_url=base, api_key="not-a-key", max_retries=0)
try:
    bad.completions.create(model=model, prompt="hi", max_tokens=2)
    raise SystemExit("a bad key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401
print(json.dumps(facts))
