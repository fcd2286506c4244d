"""Reference tokenization of a GGUF SentencePiece vocabulary, for weft-gguf's
Gemma 3 tokenizer test.

Usage: python spm_oracle.py MODEL.gguf CASES.json

Builds a SentencePiece model proto from the GGUF's own vocabulary, scores and
token types (`tokenizer.ggml.*`, read with llama.cpp's `gguf` package), loads it
into the `sentencepiece` library (Google's reference implementation, pinned in
tests/oracle/requirements.txt) and prints, as JSON, the ids it gives for each
string of CASES.json (a JSON list of strings).

The proto: model type BPE, byte fallback, and Gemma's normalizer (identity,
spaces escaped as U+2581, no dummy prefix unless `add_space_prefix`, no
whitespace folding). llama.cpp's token types are SentencePiece's piece types
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). llama.cpp
stores user-defined pieces with real spaces where SentencePiece has U+2581;
they are put back here, since SentencePiece matches them after escaping.

Control tokens are never produced from text by SentencePiece; like
transformers and llama.cpp (parse_special) the strings of control tokens in a
case are split off first (leftmost, longest) and become their ids, and the
text between them is encoded by SentencePiece.
"""

import json
import sys

import sentencepiece as spm
from gguf import GGUFReader
from sentencepiece import sentencepiece_model_pb2 as pb


def main():
    reader = GGUFReader(sys.argv[1])
    f = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    tokens = f["tokenizer.ggml.tokens"]
    scores = f["tokenizer.ggml.scores"]
    types = f["tokenizer.ggml.token_type"]
    add_prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))

    m = pb.ModelProto()
    for tok, score, ty in zip(tokens, scores, types):
        p = m.pieces.add()
        p.piece = tok.replace(" ", "\u2581") if ty == 4 else tok
        p.score = float(score)
        p.type = int(ty)
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = True
    ts.unk_id = int(f.get("tokenizer.ggml.unknown_token_id", 0))
    ts.bos_id = int(f.get("tokenizer.ggml.bos_token_id", -1))
    ts.eos_id = int(f.get("tokenizer.ggml.eos_token_id", -1))
    ts.pad_id = int(f.get("tokenizer.ggml.padding_token_id", -1))
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = add_prefix
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    sp = spm.SentencePieceProcessor(model_proto=m.SerializeToString())

    control = sorted(
        ((tok, i) for i, (tok, ty) in enumerate(zip(tokens, types)) if ty == 3),
        key=lambda x: -len(x[0]),
    )

    def encode(text):
        ids = []
        rest = text
        while rest:
            best = None
            for tok, i in control:
                at = rest.find(tok)
                if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(tok) > len(best[1]))):
                    best = (at, tok, i)
            if best is None:
                ids += sp.encode(rest)
                break
            at, tok, i = best
            if at:
                ids += sp.encode(rest[:at])
            ids.append(i)
            rest = rest[at + len(tok):]
        return ids

    cases = json.load(open(sys.argv[2], encoding="utf-8"))
    out = {
        "sentencepiece_version": spm.__version__,
        "vocab_size": len(tokens),
        "cases": [{"text": t, "ids": encode(t)} for t in cases],
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
