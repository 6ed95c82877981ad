//! `bench` through the binary on the CPU: llama-bench-style records for every (test, depth,
//! sequences), one sample per repetition, positive rates; bad flags are errors (exit 2).

use std::path::PathBuf;
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("bench")
        .args(args)
        .output()
        .expect("run gguftool")
}

#[test]
fn json_has_one_record_per_test_depth_and_sequences() {
    let model = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let o = bench(&[
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "-p",
        "16",
        "-n",
        "4",
        "-d",
        "0,8",
        "--npl",
        "1,2",
        "-r",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recs: serde_json::Value =
        serde_json::from_slice(&o.stdout).expect("a JSON array on stdout");
    let recs = recs.as_array().expect("array");
    let mut seen = Vec::new();
    for r in recs {
        let test = r["test"].as_str().unwrap();
        let key = (
            test.to_string(),
            r["n_depth"].as_u64().unwrap(),
            r["n_seq"].as_u64().unwrap(),
        );
        assert!(!seen.contains(&key), "duplicate record {key:?}");
        seen.push(key);
        let samples = r["samples_ts"].as_array().unwrap();
        assert_eq!(samples.len(), 2, "one sample per repetition");
        assert!(samples.iter().all(|s| s.as_f64().unwrap() > 0.0));
        let avg = r["avg_ts"].as_f64().unwrap();
        let mean = samples.iter().map(|s| s.as_f64().unwrap()).sum::<f64>() / 2.0;
        assert!(
            (avg - mean).abs() <= 1e-9 * mean,
            "avg_ts is the samples' mean"
        );
        assert!(r["stddev_ts"].as_f64().unwrap() >= 0.0);
        match test {
            "pp" => assert_eq!(
                (r["n_prompt"].as_u64(), r["n_gen"].as_u64()),
                (Some(16), Some(0))
            ),
            "tg" => assert_eq!(
                (r["n_prompt"].as_u64(), r["n_gen"].as_u64()),
                (Some(0), Some(4))
            ),
            t => panic!("unknown test {t}"),
        }
        assert!(r["weight_bytes_per_step"].as_f64().unwrap() > 0.0);
        assert!(
            r["copy_gbs"].as_f64().unwrap() > 0.0,
            "copy bandwidth of the same run"
        );
        assert_eq!(r["device"], "cpu");
    }
    for t in ["pp", "tg"] {
        for d in [0, 8] {
            for s in [1, 2] {
                assert!(
                    seen.contains(&(t.to_string(), d, s)),
                    "missing {t} d{d} x{s}"
                );
            }
        }
    }
    assert_eq!(recs.len(), 8);
}

#[test]
fn bad_flags_are_errors() {
    let model = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let m = model.to_str().unwrap();
    for args in [
        vec!["-m", m, "--device", "cpu", "--tp", "0"],
        vec!["-m", m, "--device", "cpu", "-r", "0"],
        vec!["-m", m, "--device", "cpu", "--npl", "0"],
        vec!["-m", m, "--device", "cpu", "-p", "0", "-n", "0"],
        vec!["-m", m, "--device", "nope"],
        vec!["-m", m, "--device", "cpu", "-d", "100000000"],
    ] {
        let o = bench(&args);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!o.stderr.is_empty());
    }
}
