//! What the interposer costs, measured against calling the simulated driver
//! directly in the same run: the same C program (tests/c/shim_client.c,
//! `bench` mode) runs alternately with LD_LIBRARY_PATH on the sim's own
//! driver directory and on a vdriver-like directory whose libcuda.so.1 is
//! the interposer (quotas active, registered with a stand-in manager).
//! Prints medians over runs, the difference and the ratio, against the
//! budgets of issue #5. A benchmark, never a test: it asserts nothing.
//!
//! `cargo build --release --workspace && cargo bench -p cuda-shim --bench overhead`
//! (falls back to target/debug for gpu-sim and the sim's libraries).

#[path = "../testsupport/server.rs"]
mod server;

use std::path::{Path, PathBuf};
use std::process::Command;

const RUNS: usize = 15;
const LAUNCHES_PER_ROUND: &str = "20000";

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// `name` in this profile's dir, else in target/debug.
fn artifact(name: &str) -> PathBuf {
    let here = profile_dir().join(name);
    if here.exists() {
        return here;
    }
    let debug = profile_dir().parent().unwrap().join("debug").join(name);
    if debug.exists() {
        eprintln!(
            "note: using {} (no {} build)",
            debug.display(),
            here.display()
        );
        return debug;
    }
    panic!(
        "{name} not found in {} or target/debug: run `cargo build --release --workspace` first",
        profile_dir().display()
    );
}

/// (cuInit, launch, alloc+free) in ns, from one run.
type Sample = (f64, f64, f64);
/// A table row: name, field of a sample, budget, unit.
type Row = (&'static str, fn(&Sample) -> f64, f64, &'static str);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(client: &Path, lib: &Path, cfg: &Path) -> Sample {
    let out = Command::new(client)
        .args(["bench", LAUNCHES_PER_ROUND])
        .env("LD_LIBRARY_PATH", lib)
        .env("VCUDA_CONFIG_DIR", cfg)
        .env_remove("LOGGER_LEVEL")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{s}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let get = |k: &str| -> f64 {
        s.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {s}"))
            .parse()
            .unwrap()
    };
    (get("init_ns"), get("launch_ns"), get("alloc_free_ns"))
}

fn main() {
    // `cargo bench` passes --bench; nothing else is accepted.
    let root = tempfile::Builder::new()
        .prefix("shim-bench-")
        .tempdir()
        .unwrap();
    let root = root.path();
    let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/nodes/sim-1gpu.toml");
    let st = Command::new(artifact("gpu-sim"))
        .args(["install", "--node"])
        .arg(&node)
        .arg("--root")
        .arg(root)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    // The interposer directory: the sim's versioned libraries beside the
    // interposer's soname links, as the vdriver mirror lays them out.
    let real = root.join("usr/lib/x86_64-linux-gnu");
    let vd = root.join("vdriver/nvidia/lib64");
    std::fs::create_dir_all(&vd).unwrap();
    let mut version = String::new();
    for e in std::fs::read_dir(&real).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let ft = e.file_type().unwrap();
        if ft.is_file() && (name.starts_with("libcuda.so.") || name.starts_with("libnvidia-ml.so."))
        {
            std::fs::hard_link(e.path(), vd.join(&name)).unwrap();
            if let Some(v) = name.strip_prefix("libcuda.so.") {
                version = v.to_string();
            }
        }
    }
    let shim = profile_dir().join("libvcuda.so");
    assert!(shim.exists(), "{} missing", shim.display());
    std::fs::copy(&shim, vd.join("libvcuda.so")).unwrap();
    for n in [
        "libcuda.so",
        "libcuda.so.1",
        "libnvidia-ml.so",
        "libnvidia-ml.so.1",
    ] {
        std::fs::hard_link(vd.join("libvcuda.so"), vd.join(n)).unwrap();
    }
    let client = root.join("shim_client");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/shim_client.c");
    let st = Command::new("gcc")
        .args(["-O2", "-o"])
        .arg(&client)
        .arg(&src)
        .arg("-L")
        .arg(&real)
        .args(["-lcuda", "-lpthread"])
        .status()
        .unwrap();
    assert!(st.success(), "gcc");

    let cfg = root.join("vcuda");
    std::fs::create_dir_all(&cfg).unwrap();
    let mut parts = version.split('.').map(|p| p.parse::<i32>().unwrap_or(0));
    let dv = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    server::write_config(&cfg, 8 << 30, dv, true);
    let _manager = server::TestManager::start(&cfg, 8 << 30);

    let (mut direct, mut shimmed) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        direct.push(run(&client, &real, &cfg));
        shimmed.push(run(&client, &vd, &cfg));
    }
    println!(
        "cuda-shim overhead vs the simulated driver, medians of {RUNS} runs (each: 31 rounds)"
    );
    println!(
        "{:<22} {:>12} {:>12} {:>12} {:>8} {:>12}",
        "", "direct", "interposer", "added", "ratio", "budget"
    );
    let rows: [Row; 3] = [
        ("cuInit", |r| r.0, 1_000_000.0, "ns"),
        ("cuLaunchKernel", |r| r.1, 50.0, "ns"),
        ("cuMemAlloc+cuMemFree", |r| r.2, 2_000.0, "ns"),
    ];
    for (name, f, budget, unit) in rows {
        let d = median(direct.iter().map(f).collect());
        let s = median(shimmed.iter().map(f).collect());
        let added = s - d;
        println!(
            "{name:<22} {d:>10.1}{unit} {s:>10.1}{unit} {added:>10.1}{unit} {:>8.3} {:>10.0}{unit} {}",
            s / d,
            budget,
            if added <= budget { "ok" } else { "OVER" }
        );
    }
}
