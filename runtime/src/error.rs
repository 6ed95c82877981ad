//! The runtime's error type.

/// Errors from loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    /// The model's metadata or tensors do not fit its architecture.
    #[error("model: {0}")]
    Model(String),
    /// The request asks for more context than the model or cache allows.
    #[error("context length exceeded: {need} tokens > {max}")]
    ContextExceeded { need: usize, max: usize },
    /// Speculative decoding asked of a model without a NextN / MTP layer (or without its weights).
    #[error("the model has no NextN/MTP draft layer (nextn_predict_layers = 0 or its tensors are absent)")]
    NoDraftLayer,
    #[error("backend: {0}")]
    Backend(String),
    /// A GPU op failed; the kernel error is kept (device faults, bad shapes, unsupported types).
    #[error("{op}: {source}")]
    Kernel {
        op: &'static str,
        #[source]
        source: kernels::KernelError,
    },
    /// The model cannot be split over this many tensor-parallel ranks, or a rank failed.
    #[error("tensor parallelism over {world} ranks: {msg}")]
    Tp { world: usize, msg: String },
}
