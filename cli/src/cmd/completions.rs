//! `gguftool completions SHELL`: a shell completion script on stdout (clap_complete), e.g.
//! `gguftool completions bash > /etc/bash_completion.d/gguftool`.

use anyhow::Result;
use clap::CommandFactory;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// bash, zsh, fish, elvish or powershell.
    shell: clap_complete::Shell,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let mut cmd = crate::Cli::command();
    let name = cmd.get_name().to_string();
    // Generated into memory first: clap_complete panics when its writer fails.
    let mut buf = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, name, &mut buf);
    match std::io::Write::write_all(&mut std::io::stdout().lock(), &buf) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        // `gguftool completions bash | head`: the reader is gone, nothing left to do.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Err(e) => Err(anyhow::Error::new(e).context("writing the completion script")),
    }
}
