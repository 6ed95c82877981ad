#!/usr/bin/env python3
"""Dev script: writes tokenizer_spm_refs.json, a small SentencePiece BPE model (pieces, scores,
types, as a llama-style GGUF stores them) and the token ids the `sentencepiece` library itself
produces for varied text. tokenizer_fixture.rs builds the SPM tokenizer from the pieces and
compares. The Rust tests never run Python. Regenerate with:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install sentencepiece==0.2.3
    /tmp/venv/bin/python serving/tests/tokenizer_spm_refs.py

Training options follow Llama-2's tokenizer: BPE, byte fallback, identity normalization, no
whitespace collapsing, dummy prefix (GGUF `tokenizer.ggml.add_space_prefix = true`).
"""
import io
import json
import os
import random

import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tokenizer_spm_refs.json")

WORDS = (
    "the of and to in is was for on that with as by at from his her they this which one two three "
    "capital city river mountain country people language history music science water light "
    "Paris Madrid Berlin Tokyo München café naïve über Straße éclair déjà vu 東京 北京 数学"
).split()


def corpus(seed=7):
    rng = random.Random(seed)
    lines = []
    for _ in range(3000):
        n = rng.randint(3, 14)
        s = " ".join(rng.choice(WORDS) for _ in range(n))
        if rng.random() < 0.3:
            s += rng.choice([".", ",", "!", "?", ";"])
        if rng.random() < 0.2:
            s = s.capitalize()
        if rng.random() < 0.1:
            s += " " + str(rng.randint(0, 9999))
        lines.append(s)
    return lines


TEXTS = [
    "the capital city of the country",
    "Paris is the capital. Madrid is a city!",
    "  two leading spaces, double  spaces and trailing ",
    "München, café, naïve, über die Straße",
    "東京 and 北京 and 数学",
    "numbers 12345 and 3.14",
    "unseen letters: xyzzy QWERTY ǅ",
    "emoji 🌍 and CJK 漢字 fall back to bytes",
    "new\nlines\tand tabs",
    "a",
    " ",
    "",
]


def main():
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        # GGUF token types: 1 normal, 2 unknown, 3 control, 6 byte.
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    cases = []
    for text in TEXTS:
        ids = sp.encode(text)
        cases.append({"text": text, "token_ids": ids, "decoded": sp.decode(ids)})
    doc = {
        "tool": f"sentencepiece {spm.__version__}: SentencePieceTrainer.train(model_type=bpe, vocab_size=600, "
                "byte_fallback, identity normalization, remove_extra_whitespaces=False, add_dummy_prefix), "
                "SentencePieceProcessor.encode / decode",
        "script": "serving/tests/tokenizer_spm_refs.py",
        "tokens": tokens,
        "scores": scores,
        "token_types": types,
        "cases": cases,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {len(tokens)} pieces, {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
