//! A stand-in for the GPU manager's registration service, for tests run
//! outside Rust (tests/python): writes `<dir>/vcuda.config` for an enforced
//! container and serves `<dir>/vcuda.sock` until stdin closes.
//!
//! Usage: `test_manager DIR QUOTA_BYTES [DRIVER_MAJOR.MINOR]`; prints
//! `ready` once serving, and one line per registration event.

use std::io::{BufRead, Write};
use test_support::shim::server;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: test_manager DIR QUOTA_BYTES [DRIVER_MAJOR.MINOR]");
        std::process::exit(2);
    }
    let dir = std::path::PathBuf::from(&args[1]);
    let quota: u64 = args[2].parse().expect("QUOTA_BYTES");
    let version = args
        .get(3)
        .and_then(|v| v.split_once('.'))
        .map(|(a, b)| (a.parse().unwrap_or(0), b.parse().unwrap_or(0)))
        .unwrap_or((0, 0));
    server::write_config(&dir, quota, version, true);
    let m = server::TestManager::start(&dir, quota);
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
    for e in m.events() {
        println!("{e:?}");
    }
}
