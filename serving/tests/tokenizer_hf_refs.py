#!/usr/bin/env python3
"""Dev script: writes tokenizer_hf_refs.json, reference token ids from the HF `tokenizers` library
for the fixture tokenizer (tests/fixtures/hf/tokenizer.json) on varied text.

The Rust test tokenizer_fixture.rs compares the GGUF-built tokenizer against this file; the Rust
tests never run Python. Regenerate with the same library version the fixtures were made with:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install tokenizers==0.23.3
    /tmp/venv/bin/python serving/tests/tokenizer_hf_refs.py
"""
import json
import os
import random

import tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "tests", "fixtures", "hf", "tokenizer.json")
OUT = os.path.join(HERE, "tokenizer_hf_refs.json")

HAND = [
    "The capital of France is Paris. What is the capital of Spain?",
    "I'm sure you're right, but they'VE said it'LL rain; DON'T go. O'Neil's",
    "1 22 333 4444 55555 666666 1234567890 3.14159 -42 +7 1,000,000 0x1F",
    "a  b   c    d\te\t\tf\nx\n\ny\n\n\nz \n w\r\nv \r\n\r\n",
    "   leading spaces and trailing   ",
    "!!! ??? ... --- === *** ### $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} ||| ~~~",
    "def f(x):\n    return x**2  # square\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    "Grüße aus Köln! naïve café, façade, smørrebrød, Ærø, ß, İstanbul",
    "Привет, мир! Ελληνικά. עברית. العربية. हिन्दी में लिखा गया पाठ।",
    "日本語のテキスト、中文文本。한국어 텍스트.",
    "emoji 🌍🚀 family 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "zero\u200bwidth, nbsp\u00a0here, thin\u2009space, ideographic\u3000space, line\u2028sep",
    "control chars \x00\x01\x07\x1b[0m\x7f done",
    "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nHi!<|assistant|>\n<think></think>\nHello.",
    "<|user|><|user|>x<|assistant|><think>a</think><tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>",
    "almost specials: <|user| <user|> [gMASK <sop >< think> <|USER|>",
    "text<|endoftext|>more text /nothink trailing",
    "<|observation|>\n<tool_response>\n{\"ok\": true}\n</tool_response>",
    "",
    " ",
    "\n",
    "a",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE",
]

CORPUS_WORDS = [
    "The", "capital", "of", "is", "Paris", "Madrid", "Dublin", "What", "the", "alphabet",
    "one", "two", "three", "helpful", "assistant", "counting", "twelve", "ABC", "xyz",
]
CHAR_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,;:!?'\"-_()[]{}<>|/\\@#$%^&*+=~`")
    + [" ", " ", " ", "\n", "\t", "\r\n", "  ", "é", "ü", "ß", "中", "文", "😀", "🌍", "\u0301", "\u00a0"]
)


def random_texts(n, seed=20261001):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.5:
                parts.append(rng.choice(CORPUS_WORDS))
            else:
                parts.append("".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 6))))
            parts.append(rng.choice([" ", "", "  ", "\n", ". "]))
        out.append("".join(parts))
    return out


def main():
    tok = tokenizers.Tokenizer.from_file(FIXTURE)
    cases = []
    for text in HAND + random_texts(300):
        enc = tok.encode(text, add_special_tokens=False)
        cases.append({
            "text": text,
            "token_ids": enc.ids,
            "decoded": tok.decode(enc.ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(enc.ids, skip_special_tokens=True),
        })
    doc = {
        "tool": f"HF tokenizers {tokenizers.__version__}, Tokenizer.from_file(tests/fixtures/hf/tokenizer.json), "
                "encode(add_special_tokens=False), decode(skip_special_tokens=False/True)",
        "script": "serving/tests/tokenizer_hf_refs.py",
        "cases": cases,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
