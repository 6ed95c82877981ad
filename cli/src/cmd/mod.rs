//! One module per subcommand: `Args` (clap) and `run`.

pub mod bench;
pub mod bench_draft;
pub mod completions;
pub mod convert;
pub mod doctor;
pub mod draft;
pub mod edit;
pub mod generate;
pub mod info;
pub mod map;
pub mod merge;
pub mod plan;
pub mod quantize;
pub mod serve;
pub mod split;
pub mod synth;
pub mod tp;
pub mod verify;
pub mod verify_gpu;
