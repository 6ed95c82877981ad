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

/// Kernels launched without programmatic dependent launch: the one-shot all-reduce spins on
/// other ranks' flags, and a rank's blocks parked early could hold the SMs another rank's
/// stream needs on a shared GPU.
const NOT_PDL: &[&str] = &["allreduce_oneshot_f32"];

/// Problems of one PTX module's entries with programmatic dependent launch (prelude.cuh): every
/// entry but [`NOT_PDL`] waits (`griddepcontrol.wait`), and before that wait it executes no
/// memory instruction but parameter loads and L2 prefetches: such a kernel runs alongside its
/// predecessor until then, so an earlier load could read a value not yet written, an earlier
/// store could overwrite one still being read (pool buffers are reused in stream order).
fn pdl_problems(ptx: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in ptx.split(".entry ").skip(1) {
        let name = part.split('(').next().unwrap_or("").trim().to_string();
        // The body of this entry only (the next `.visible` starts another symbol).
        let body = part.split(".visible").next().unwrap_or(part);
        let Some(at) = body.find("griddepcontrol.wait") else {
            if !NOT_PDL.contains(&name.as_str()) {
                out.push(format!(
                    "{name}: no griddepcontrol.wait (pdl_entry / pdl_wait)"
                ));
            }
            continue;
        };
        if NOT_PDL.contains(&name.as_str()) {
            out.push(format!(
                "{name}: waits, but is listed as launched without PDL"
            ));
        }
        for line in body[..at].lines() {
            let t = line.trim_start();
            // Strip a predicate guard (`@%p1 ld.global...`).
            let t = match t.strip_prefix('@') {
                Some(r) => r.split_once(' ').map_or("", |(_, i)| i.trim_start()),
                None => t,
            };
            let op = t.split(|c: char| c.is_whitespace()).next().unwrap_or("");
            let memory = [
                "ld.",
                "ldu.",
                "st.",
                "atom.",
                "red.",
                "cp.",
                "tex.",
                "suld.",
                "sust.",
                "multimem.",
            ]
            .iter()
            .any(|p| op.starts_with(p));
            if memory && !op.starts_with("ld.param") {
                out.push(format!(
                    "{name}: `{}` before griddepcontrol.wait",
                    t.trim_end()
                ));
            }
        }
    }
    out
}

#[test]
fn pdl_check_flags_early_memory_and_missing_waits() {
    let ok = ".visible .entry a(\n.param .u64 a_p\n)\n{\nld.param.u64 %rd1, [a_p];\nprefetch.global.L2 [%rd1];\ngriddepcontrol.launch_dependents;\ngriddepcontrol.wait;\nld.global.f32 %f1, [%rd1];\n}\n";
    assert!(pdl_problems(ok).is_empty(), "{:?}", pdl_problems(ok));
    let early = ".visible .entry b(\n.param .u64 b_p\n)\n{\n@%p1 ld.global.nc.f32 %f1, [%rd1];\ngriddepcontrol.wait;\n}\n";
    assert_eq!(pdl_problems(early).len(), 1);
    let store = ".visible .entry c(\n)\n{\nst.global.u32 [%rd1], %r1;\ngriddepcontrol.wait;\n}\n";
    assert_eq!(pdl_problems(store).len(), 1);
    let none = ".visible .entry d(\n)\n{\nret;\n}\n";
    assert_eq!(pdl_problems(none).len(), 1);
    let exempt = ".visible .entry allreduce_oneshot_f32(\n)\n{\nret;\n}\n";
    assert!(pdl_problems(exempt).is_empty());
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
                    failures.extend(
                        pdl_problems(&c.ptx)
                            .into_iter()
                            .map(|p| format!("{arch} {}: {p}", op.name())),
                    );
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
                            "mla_tc_bf16",
                            "quantize_q8a",
                            "rope_q8_f32",
                        ];
                        // Every integer-dot GEMV and tensor-core matrix product variant is hot
                        // (decode, prefill, grouped MoE).
                        let hot_q = func.starts_with("gemvq") || func.starts_with("mmq");
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
