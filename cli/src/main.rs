//! The `gguftool` binary: command-line parsing and dispatch. Each command lives in `cmd/<name>.rs`;
//! libraries return typed errors, this binary turns them into one-line messages and exit codes
//! (0 ok, 1 findings, 2 error).

mod cmd;
mod output;
mod util;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "gguftool",
    version,
    about = "Verifiable tooling and a runtime for GGUF models"
)]
struct Cli {
    /// Print the full error chain on failure.
    #[arg(long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe a GGUF model (any shard describes the whole split model).
    Info(cmd::info::Args),
    /// Merge split shards into one file, checking the whole set first.
    Merge(cmd::merge::Args),
    /// Split a model into llama.cpp-compatible shards.
    Split(cmd::split::Args),
    /// Check structure, per-tensor statistics, architecture and integrity.
    Verify(cmd::verify::Args),
    /// Print the HF <-> GGUF tensor-name table.
    Map(cmd::map::Args),
    /// Quantize a model to a llama.cpp file type (byte-identical to llama-quantize).
    Quantize(cmd::quantize::Args),
    /// Edit metadata or tensor names (split-aware, atomic, tensor data copied untouched).
    Edit(cmd::edit::Args),
    /// Convert a GGUF model to HF-layout safetensors.
    Convert(cmd::convert::Args),
    /// Generate text from a prompt.
    Generate(cmd::generate::Args),
    /// Serve an OpenAI-compatible HTTP API.
    Serve(cmd::serve::Args),
    /// Per-GPU memory of a model split over N GPUs (tensor parallelism), from its header.
    Plan(cmd::plan::Args),
    /// Benchmark kernels and the forward pass.
    Bench(cmd::bench::Args),
    /// Write a model with a preset's exact layout and random contents (benchmarks).
    Synth(cmd::synth::Args),
    /// Diagnose the environment and a model (GPU, layers where CPU and GPU diverge).
    Doctor(cmd::doctor::Args),
    /// Print a shell completion script (bash, zsh, fish, ...).
    Completions(cmd::completions::Args),
}

fn main() -> ExitCode {
    util::quiet_broken_pipes();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info(a) => cmd::info::run(a),
        Command::Merge(a) => cmd::merge::run(a),
        Command::Split(a) => cmd::split::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Map(a) => cmd::map::run(a),
        Command::Quantize(a) => cmd::quantize::run(a),
        Command::Edit(a) => cmd::edit::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Doctor(a) => cmd::doctor::run(a),
        Command::Synth(a) => cmd::synth::run(a),
        Command::Completions(a) => cmd::completions::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            if util::is_broken_pipe(&e) {
                util::exit_on_broken_pipe();
            }
            // However the interrupted work reported it (a copy that stopped, `Interrupted`),
            // a signal ends the command with 128 + its number.
            let signal = output::pending_signal()
                .or_else(|| e.downcast_ref::<util::Interrupted>().map(|i| i.signal));
            if let Some(signal) = signal {
                eprintln!("error: {}", util::Interrupted { signal });
                return ExitCode::from((128 + signal) as u8);
            }
            if cli.verbose {
                eprintln!("error: {e:?}");
            } else {
                eprintln!("error: {}", util::error_text(&e));
            }
            ExitCode::from(2)
        }
    }
}
