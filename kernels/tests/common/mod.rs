//! Shared by the GPU tests; the emulator's tests include oracle.rs directly by path.

pub mod oracle;
