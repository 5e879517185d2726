//! A stand-in for the GPU manager's registration service, for tests run
//! outside Rust (tests/python, tests/gpu): writes `<dir>/vcuda.config` for an
//! enforced container and serves `<dir>/vcuda.sock` until stdin closes.
//!
//! Usage: `test_manager DIR QUOTA_BYTES [DRIVER_MAJOR.MINOR] [--qos TIER [DIR2=TIER2 ...]]`;
//! prints `ready` once serving, and one line per registration event.
//! `--qos`: DIR's share gets TIER (`plain`, `latency`, `batch`) and one QoS
//! page for the GPU, and each `DIRn=TIERn` is another container on that GPU
//! (same quota) served by this process with the same page, as the node
//! agent hands one page to every share of a GPU (docs/qos.md).

use qos_page::Tier;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use test_support::shim::server;

fn usage(why: &str) -> ! {
    eprintln!("test_manager: {why}");
    eprintln!(
        "usage: test_manager DIR QUOTA_BYTES [DRIVER_MAJOR.MINOR] [--qos TIER [DIR2=TIER2 ...]]"
    );
    std::process::exit(2);
}

fn tier(s: &str) -> Tier {
    Tier::parse(s).unwrap_or_else(|e| usage(&format!("tier {s:?}: {e}")))
}

/// The containers to serve: DIR and, with `--qos`, the others, each with
/// its tier (None: no QoS page at all).
fn containers(args: &[String]) -> Vec<(PathBuf, Option<Tier>)> {
    let mut out = vec![(PathBuf::from(&args[1]), None)];
    let Some(at) = args.iter().position(|a| a == "--qos") else {
        return out;
    };
    let first = args
        .get(at + 1)
        .unwrap_or_else(|| usage("--qos needs a tier"));
    out[0].1 = Some(tier(first));
    for more in &args[at + 2..] {
        let (dir, t) = more
            .split_once('=')
            .unwrap_or_else(|| usage(&format!("{more:?} is not DIR=TIER")));
        out.push((PathBuf::from(dir), Some(tier(t))));
    }
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        usage("too few arguments");
    }
    let quota: u64 = args[2]
        .parse()
        .unwrap_or_else(|_| usage(&format!("QUOTA_BYTES {:?} is not a number", args[2])));
    let version = args
        .get(3)
        .filter(|v| !v.starts_with("--"))
        .and_then(|v| v.split_once('.'))
        .map(|(a, b)| (a.parse().unwrap_or(0), b.parse().unwrap_or(0)))
        .unwrap_or((0, 0));
    let page = server::Qos::page();
    let managers: Vec<_> = containers(&args)
        .into_iter()
        .map(|(dir, t)| {
            server::write_config(&dir, quota, version, true);
            let m = server::TestManager::start(&dir, quota);
            if let Some(t) = t {
                m.set_qos(page.with(t));
            }
            m
        })
        .collect();
    println!("ready");
    std::io::stdout().flush().unwrap();
    // Until stdin closes.
    let mut line = String::new();
    while std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map(|n| n > 0)
        .unwrap_or(false)
    {
        line.clear();
    }
    for e in managers.iter().flat_map(|m| m.events()) {
        println!("{e:?}");
    }
}
