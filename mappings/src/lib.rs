//! HF <-> GGUF tensor-name mapping: one YAML table per architecture (the single source of truth),
//! both directions derived from it, composite transforms (expert stacking, kv_b split/reassembly)
//! and tensor-parallel slicing.
