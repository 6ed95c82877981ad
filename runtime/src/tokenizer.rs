//! tokenizer (in progress).
