//! engine (in progress).
