//! `gguftool doctor`: what this machine offers for the CUDA backend — driver, devices, NVRTC,
//! whether every kernel compiles for the device (or for sm_90/sm_120 without one), cuBLAS.
//! Exit 0 when a usable GPU path exists, 1 when something is missing (with the reason).

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Result;
use kernels::{nvrtc, Gpu, Op};

#[derive(clap::Args)]
pub struct Args {
    /// Skip compiling every kernel (the slowest check, a few seconds per architecture).
    #[arg(long)]
    no_compile: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let mut findings = Vec::new();
    let driver = kernels::driver_available();
    println!(
        "CUDA driver library: {}",
        if driver { "found" } else { "not found" }
    );
    let count = kernels::device_count();
    println!("CUDA devices: {count}");
    let mut archs = Vec::new();
    for i in 0..count {
        match Gpu::get(i) {
            Ok(g) => {
                let d = g.info();
                println!(
                    "  [{i}] {}: compute capability {}.{} ({}), {} SMs, {:.1} GiB, L2 {} MiB",
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.arch,
                    d.sm_count,
                    d.total_mem as f64 / (1u64 << 30) as f64,
                    d.l2_bytes >> 20
                );
                archs.push(d.arch.clone());
            }
            Err(e) => findings.push(format!("device {i}: {e}")),
        }
    }
    if count == 0 {
        findings.push("no CUDA device: the GPU backend is unavailable (CPU only)".into());
    }
    if !nvrtc::available() {
        findings
            .push("NVRTC (libnvrtc) not found: kernels cannot be compiled (docs/GPU.md)".into());
    } else {
        let (maj, min) = nvrtc::version()?;
        let supported = nvrtc::supported_archs()?;
        println!("NVRTC {maj}.{min}, targets {supported:?}");
        if archs.is_empty() {
            archs = vec!["sm_90".to_string(), "sm_120".to_string()];
        }
        if !args.no_compile {
            for arch in &archs {
                let t = Instant::now();
                let mut failed = Vec::new();
                for op in Op::ALL {
                    if let Err(e) = nvrtc::compile(op, arch, false) {
                        failed.push(format!("{}: {e}", op.name()));
                    }
                }
                println!(
                    "compile all {} kernel modules for {arch}: {} ({:.1} s)",
                    Op::ALL.len(),
                    if failed.is_empty() { "ok" } else { "FAILED" },
                    t.elapsed().as_secs_f64()
                );
                findings.extend(failed);
            }
        }
    }
    if count > 0 {
        match Gpu::get(0).and_then(|g| {
            // A one-row matmul exercises dequantization, cuBLAS and the stream end to end.
            let w = g.upload(&[0u8; 4 * 32])?;
            let x = g.upload(&[1.0f32; 32])?;
            let mut y = g.zeros::<f32>(1)?;
            g.matmul(
                kernels::MatShape::new(gguf::GgmlType::F32, 1, 32),
                &w,
                &x,
                1,
                &mut y,
            )?;
            g.synchronize()
        }) {
            Ok(()) => println!("cuBLAS + kernel launch on device 0: ok"),
            Err(e) => findings.push(format!("launch check on device 0: {e}")),
        }
    }
    if findings.is_empty() {
        println!("doctor: no findings");
        Ok(ExitCode::SUCCESS)
    } else {
        for f in &findings {
            println!("finding: {f}");
        }
        Ok(ExitCode::from(1))
    }
}
