//! chat (in progress).
