//! The command-line tools on synthetic traces: `cumem-synth` writes one,
//! `cumem-replay` replays it from the file and from its `synth:` name, with
//! the same figures.

use std::path::PathBuf;
use std::process::Command;

use cumem_replay::synth::{generate, Workload};
use cumem_replay::trace::Trace;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cumem-synth-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `cumem-replay --json` on `trace` and returns the trace's and the
/// `sim_device` result's JSON.
fn replay_json(trace: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_cumem-replay"))
        .args(["--target", "sim_device", "--repeat", "1", "--json", trace])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_written_synthetic_trace_replays_as_its_name_does() {
    let dir = temp_dir("write");
    let out = Command::new(env!("CARGO_BIN_EXE_cumem-synth"))
        .args(["--dir", dir.to_str().unwrap(), "kv_cache:3", "synth:moe"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let file = dir.join("synth_kv_cache_s3.csv.gz");
    let mut read = Trace::read(&file).unwrap();
    assert_eq!(read.name, "synth_kv_cache_s3");
    read.name.clear();
    let mut made = generate(Workload::KvCache, 3);
    made.name.clear();
    assert_eq!(read, made, "the file holds the generated trace");
    assert!(dir.join("synth_moe_s1.csv.gz").is_file());

    let from_file = replay_json(file.to_str().unwrap());
    let from_name = replay_json("synth:kv_cache:3");
    for key in ["name", "operations", "peak_live", "page_floor"] {
        assert_eq!(from_file["traces"][0][key], from_name["traces"][0][key], "{key}");
    }
    assert_eq!(from_name["traces"][0]["name"], "synth_kv_cache_s3");
    for key in ["peak_reserved", "map_calls", "unmap_calls", "failures"] {
        assert_eq!(from_file["results"][0][key], from_name["results"][0][key], "{key}");
    }
    assert_eq!(from_name["results"][0]["failures"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_synthetic_names_are_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_cumem-replay"))
        .args(["--target", "sim_device", "synth:nope"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nope") && err.contains("kv_cache"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_cumem-synth")).arg("moe:seven").output().unwrap();
    assert!(!out.status.success());
}
