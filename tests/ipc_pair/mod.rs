//! Runs `tests/c/ipc_pair.c` as its two processes (the exporter `serve`
//! and the opener `open`, over a unix socket), pausing while the opener
//! holds what it opened so the test can look at the node then.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Stdio};
use test_support::shim::simnode::Container;

pub struct Pair {
    pub server_pid: u32,
    pub client_pid: u32,
    /// `key=value` lines of each (all of them once both have exited).
    pub server: HashMap<String, String>,
    pub client: HashMap<String, String>,
}

fn finish(c: Child, what: &str, early: &str) -> HashMap<String, String> {
    let o = c.wait_with_output().unwrap();
    let out = format!("{early}{}", String::from_utf8_lossy(&o.stdout));
    assert!(
        o.status.success(),
        "{what} failed:\n{out}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    test_support::kv(&out)
}

/// Runs the pair in `mode`: the exporter in `server.0`, the opener in
/// `client.0`; `at_pause` runs while the opener holds the opened memory.
pub fn run_pair(
    server: (&Container, &Path),
    client: (&Container, &Path),
    mode: &str,
    sock: &Path,
    at_pause: impl FnOnce(&Pair),
) -> Pair {
    run_pair_env(server, client, &[], mode, sock, at_pause)
}

/// [`run_pair`] with `client_env` set for the opener (its
/// `CUDA_VISIBLE_DEVICES`, say).
pub fn run_pair_env(
    server: (&Container, &Path),
    client: (&Container, &Path),
    client_env: &[(&str, &str)],
    mode: &str,
    sock: &Path,
    at_pause: impl FnOnce(&Pair),
) -> Pair {
    let _ = std::fs::remove_file(sock);
    let s = server
        .0
        .command(server.1)
        .args(["serve".as_ref(), sock.as_os_str(), mode.as_ref()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut c = client
        .0
        .command(client.1)
        .args(["open".as_ref(), sock.as_os_str(), mode.as_ref()])
        .envs(client_env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pair = Pair {
        server_pid: s.id(),
        client_pid: c.id(),
        server: HashMap::new(),
        client: HashMap::new(),
    };
    // The opener's lines up to its pause.
    let mut early = String::new();
    let mut lines = BufReader::new(c.stdout.take().unwrap());
    let mut paused = false;
    loop {
        let mut l = String::new();
        if lines.read_line(&mut l).unwrap() == 0 {
            break;
        }
        early.push_str(&l);
        if l.trim() == "opened=1" {
            paused = true;
            break;
        }
    }
    if paused {
        pair.client = test_support::kv(&early);
        at_pause(&pair);
        c.stdin.take().unwrap().write_all(b"go\n").unwrap();
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(lines.get_mut(), &mut rest).unwrap();
    let client_out = finish(c, "the opener", &format!("{early}{rest}"));
    let server_out = finish(s, "the exporter", "");
    assert!(paused, "the opener never paused:\n{client_out:?}");
    pair.client = client_out;
    pair.server = server_out;
    pair
}
