//! Helpers shared by several commands: output formats, progress bars, atomic output files.
