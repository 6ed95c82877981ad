//! CUDA kernels for gguftool: CUDA C sources (one op per `.cu` file), compiled by NVRTC at first use
//! for the device's architecture and cached, with Rust launch wrappers that check every launch.
