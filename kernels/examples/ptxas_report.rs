//! Developer tool: compile every kernel module for one arch and print ptxas' resource report
//! (registers, stack, spills) and the compile time. `cargo run -p kernels --example ptxas_report -- sm_120`
fn main() {
    let arch: &'static str = match std::env::args().nth(1).as_deref() {
        Some("sm_120") => "sm_120",
        Some("sm_100") => "sm_100",
        Some("sm_89") => "sm_89",
        Some("sm_80") => "sm_80",
        _ => "sm_90",
    };
    let filter = std::env::args().nth(2).unwrap_or_default();
    // Optional third argument: only modules whose op name contains it.
    let op_filter = std::env::args().nth(3).unwrap_or_default();
    if !kernels::nvrtc::available() {
        eprintln!("no NVRTC library");
        std::process::exit(2);
    }
    for op in kernels::Op::ALL {
        if !format!("{op:?}")
            .to_lowercase()
            .contains(&op_filter.to_lowercase())
        {
            continue;
        }
        let t = std::time::Instant::now();
        match kernels::nvrtc::compile(op, arch, true) {
            Ok(c) => {
                println!(
                    "== {} {arch}: {:.2} s, {} B cubin",
                    op.name(),
                    t.elapsed().as_secs_f64(),
                    c.cubin.len()
                );
                let mut func = String::new();
                for line in c.log.lines() {
                    if let Some(rest) = line.split("Function properties for ").nth(1) {
                        func = rest.trim().to_string();
                    } else if (line.contains("Used") || line.contains("spill"))
                        && (filter.is_empty() || func.contains(&filter))
                    {
                        println!("  {func}: {}", line.trim());
                    }
                }
            }
            Err(e) => println!("== {} {arch}: FAILED\n{e}", op.name()),
        }
    }
}
