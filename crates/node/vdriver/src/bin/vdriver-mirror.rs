//! `vdriver-mirror`: the manager's driver mirror as a command, for the real-GPU
//! suite (`tests/gpu/`) and for inspecting a node by hand. Thin over
//! [`vdriver::Mirror`]; prints one JSON report on stdout.
//!
//! usage: vdriver-mirror --config VOLUME_CONF --out DIR [--host-root DIR]
//!                       [--interposer LIBVCUDA_SO] [--ld-cache PATH_IN_ROOT]

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: vdriver-mirror --config VOLUME_CONF --out DIR [--host-root DIR] \
[--interposer LIBVCUDA_SO] [--ld-cache PATH_IN_ROOT]";

#[derive(Debug, Default)]
struct Args {
    config: Option<PathBuf>,
    out: Option<PathBuf>,
    host_root: Option<PathBuf>,
    interposer: Option<PathBuf>,
    ld_cache: Option<PathBuf>,
}

fn parse(argv: &[String]) -> Result<Args, String> {
    let mut a = Args::default();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let slot = match flag.as_str() {
            "--config" => &mut a.config,
            "--out" => &mut a.out,
            "--host-root" => &mut a.host_root,
            "--interposer" => &mut a.interposer,
            "--ld-cache" => &mut a.ld_cache,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        };
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        if slot.replace(PathBuf::from(value)).is_some() {
            return Err(format!("{flag} given twice"));
        }
    }
    Ok(a)
}

fn run(a: Args) -> Result<serde_json::Value, String> {
    let config_path = a.config.ok_or("--config is required")?;
    let out = a.out.ok_or("--out is required")?;
    let root = a.host_root.unwrap_or_else(|| PathBuf::from("/"));
    if !root.is_dir() {
        return Err(format!("host root {} is not a directory", root.display()));
    }
    if let Some(i) = &a.interposer
        && !i.is_file()
    {
        return Err(format!("interposer {} is not a file", i.display()));
    }
    let config = vdriver::VolumeConfig::load(&config_path)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut m = vdriver::Mirror::new(&root, &config, &out).interposer(a.interposer.as_deref());
    if let Some(c) = a.ld_cache {
        m = m.ld_cache(c);
    }
    let report = m.run().map_err(|e| e.to_string())?;
    let volumes: Vec<_> = report
        .volumes
        .iter()
        .map(|v| {
            serde_json::json!({
                "name": v.name,
                "path": v.path,
                "shared": v.shared,
                "files": v.files.iter().map(|f| f.to_string_lossy()).collect::<Vec<_>>(),
                "linked": v.linked,
                "copied": v.copied,
                "unchanged": v.unchanged,
            })
        })
        .collect();
    Ok(serde_json::json!({
        "driver_version": report.driver_version.to_string(),
        "host_root": root,
        "volumes": volumes,
    }))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse(&argv) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("vdriver-mirror: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vdriver-mirror: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn argv(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_flags_and_rejects_bad_input() {
        let a = parse(&argv(&["--config", "c", "--out", "o", "--host-root", "/r"])).unwrap();
        assert_eq!(a.config.as_deref(), Some(Path::new("c")));
        assert_eq!(a.host_root.as_deref(), Some(Path::new("/r")));
        assert!(
            parse(&argv(&["--out"]))
                .unwrap_err()
                .contains("needs a value")
        );
        assert!(
            parse(&argv(&["--bogus", "x"]))
                .unwrap_err()
                .contains("unknown")
        );
        assert!(
            parse(&argv(&["--out", "a", "--out", "b"]))
                .unwrap_err()
                .contains("twice")
        );
        assert!(
            run(parse(&argv(&["--out", "o"])).unwrap())
                .unwrap_err()
                .contains("--config")
        );
    }
}
