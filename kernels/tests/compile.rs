//! Compile check: every kernel module compiles with NVRTC for sm_90 (H100/H200) and sm_120
//! (RTX PRO 6000 Blackwell), without a GPU. CI installs NVRTC from PyPI (.ci/nvrtc-setup.sh), so
//! there a kernel that does not compile fails the build; elsewhere the test says it skipped.

use std::io::Write;

use kernels::{nvrtc, Op};

/// Print past the test harness' output capture, so a skip is visible in a normal `cargo test`.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// ptxas' "N bytes spill stores" figure per function, from a `--ptxas-options=-v` log.
fn spills(log: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = rest.trim().to_string();
        }
        if let Some(pos) = line.find(" bytes spill stores") {
            let head = &line[..pos];
            let n = head
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|d| d.parse::<u64>().ok())
                .unwrap_or(0);
            out.push((current.clone(), n));
        }
    }
    out
}

#[test]
fn every_kernel_compiles_for_sm90_and_sm120() {
    if !nvrtc::available() {
        say(
            "skipped: no NVRTC library (every_kernel_compiles_for_sm90_and_sm120; see docs/GPU.md)",
        );
        return;
    }
    let (major, minor) = nvrtc::version().expect("nvrtcVersion");
    let archs = nvrtc::supported_archs().expect("nvrtcGetSupportedArchs");
    say(&format!("NVRTC {major}.{minor}, supported archs {archs:?}"));
    let mut failures = Vec::new();
    for arch in ["sm_90", "sm_120"] {
        for op in Op::ALL {
            match nvrtc::compile(op, arch, true) {
                Ok(c) => {
                    assert!(!c.cubin.is_empty(), "{} {arch}: empty CUBIN", op.name());
                    // Every entry point a launch wrapper names must exist (a typo would only
                    // show up as a load error on the device otherwise).
                    for name in op.kernel_names() {
                        if !c.ptx.contains(&format!(".entry {name}(")) {
                            failures.push(format!("{arch} {}: no kernel `{name}`", op.name()));
                        }
                    }
                    // The decode GEMV of the main weight types must not spill to local memory.
                    for (func, n) in spills(&c.log) {
                        let hot = [
                            "gemv4_q4_k",
                            "gemv4_q5_k",
                            "gemv4_q6_k_r",
                            "gemv4_q8_0_r",
                            "gemv4_bf16",
                            "gemv4_iq4_xs",
                            "gemv_q4_k",
                            "gemv_q5_k",
                            "gemv_q6_k_r",
                            "gemv_q8_0_r",
                            "gemv_bf16",
                            "gemv_f16",
                            "gemv_f32",
                            "gemv_iq4_xs",
                            "mla_partial_f32",
                            "mla_partial_bf16",
                            "mla_decode_f32",
                            "mla_decode_bf16",
                            "quantize_q8a",
                        ];
                        // Every integer-dot GEMV variant is hot (decode and grouped MoE).
                        let hot_q = func.starts_with("gemvq");
                        if n > 0 && (hot.contains(&func.as_str()) || hot_q) {
                            failures.push(format!("{arch} {func}: {n} bytes spill stores"));
                        }
                    }
                }
                Err(e) => failures.push(format!("{arch} {}: {e}", op.name())),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "kernel compile failures:\n{}",
        failures.join("\n")
    );
}
