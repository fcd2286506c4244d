"""Independent reference tokenization for weft-gguf's tokenizer test.

Usage: python tokenizer_oracle.py MODEL.gguf

Builds a tokenizer straight from the GGUF file with transformers (which has
its own GGUF tokenizer conversion, independent of weft-gguf) and prints, as
JSON on stdout, the ids it gives for a varied set of strings. The Rust test
`tests/tokenizer_oracle.rs` encodes the same strings with the converted
`tokenizer.json` and requires identical ids.

One known gap in transformers is filled in here, from llama.cpp's definition
of the file's pre-tokenizer: for `tokenizer.ggml.pre` = "smollm" (and the rest
of the StarCoder family) llama.cpp splits every digit off first (regex
`\p{N}`) and then applies the GPT-2 split regex, which is also what the
original SmolLM2 `tokenizer.json` does (Digits(individual_digits=True) then
ByteLevel). transformers ignores that `pre` value and uses plain GPT-2
splitting, which differs when whitespace precedes a digit ("x  1"). When it
is filled in, "patched_pre_tokenizer" is true and "ids_unpatched" carries
what unpatched transformers gives, for the record.

Needs: transformers, gguf (pip install transformers gguf).
"""

import json
import os
import sys

CASES = [
    "The capital of France is",
    "12345",
    "Call 555-0123 at 10:30, or x=3.14159 and 1e-5; 2024年",
    "mixed123numbers456 and 7 8 9 and 0.5",
    "runs of space before digits:  1,   22,\t3,\n\n4 \u00a05",
    "héllo wörld 你好",
    "Ünïcödé ñ ß ø — “quotes” ‘single’ … «guillemets»",
    "日本語のテキスト。한국어 텍스트. Русский текст. Ελληνικά. العربية",
    "🦀🔥",
    "👨\u200d👩\u200d👧\u200d👦 family, e\u0301 combining, \ufeffBOM",
    "def f(x):\n\treturn x  +  1\n\n\n# done\n",
    "if (a && b) { return [1, 2]; } // comment\n    indented\t\ttabs",
    "a\r\nb\r\n\r\nc",
    "   leading spaces and trailing   ",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
    "don't I'll we've THEY'RE it's",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<|im_end|>",
    "not special: <|im_start |> <im_end> <|unknown|>",
    "",
    " ",
    "\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]


# llama.cpp pre-tokenizer types that split digits one by one before the GPT-2 regex.
DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell"}


def read_metadata(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}


def load_public(path):
    """transformers' public GGUF route. Recent transformers need torch for it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return type(tok).__name__, tok.backend_tokenizer


def load_without_torch(path):
    """The same conversion (transformers' `convert_gguf_tokenizer`), with the
    metadata read by the `gguf` package (llama.cpp's reader) instead of
    transformers' torch-dependent one."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    metadata = read_metadata(path)
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata
    }
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return "tokenizers.Tokenizer", backend


def fill_in_pre_tokenizer(backend, pre):
    """A copy of `backend` with llama.cpp's digits-first split, if transformers left it out."""
    from tokenizers import Tokenizer, pre_tokenizers

    if pre not in DIGITS_FIRST or "Digits" in json.dumps(json.loads(backend.to_str())["pre_tokenizer"]):
        return backend, False
    patched = Tokenizer.from_str(backend.to_str())
    patched.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return patched, True


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: tokenizer_oracle.py MODEL.gguf")
    path = os.path.abspath(sys.argv[1])
    import transformers

    try:
        route = "AutoTokenizer.from_pretrained(gguf_file=...)"
        tokenizer_class, backend = load_public(path)
    except ModuleNotFoundError as e:
        if "torch" not in str(e) and "read_gguf_metadata" not in str(e):
            raise
        route = "gguf.GGUFReader + transformers convert_gguf_tokenizer (no torch)"
        tokenizer_class, backend = load_without_torch(path)
    pre = read_metadata(path).get("tokenizer.ggml.pre")
    tok, patched = fill_in_pre_tokenizer(backend, pre)
    cases = []
    for text in CASES:
        cases.append(
            {
                "text": text,
                "ids": tok.encode(text, add_special_tokens=False).ids,
                "ids_with_special": tok.encode(text, add_special_tokens=True).ids,
                "ids_unpatched": backend.encode(text, add_special_tokens=False).ids,
            }
        )
    json.dump(
        {
            "transformers_version": transformers.__version__,
            "route": route,
            "tokenizer_class": tokenizer_class,
            "gguf_pre_tokenizer": pre,
            "patched_pre_tokenizer": patched,
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "cases": cases,
        },
        sys.stdout,
        ensure_ascii=True,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
