//! A workload run that stops at each `phase=NAME` line it prints and waits
//! for a newline on stdin before going on, so a test can look at the ledger,
//! the sim or the manager at that point (tests/c/shim_graph.c,
//! tests/c/shim_capture.c).

use super::simnode::Container;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

pub struct Stepped {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Everything the program printed so far.
    pub text: String,
}

impl Stepped {
    pub fn start(c: &Container, prog: &Path, args: &[&str]) -> Stepped {
        let mut child = c
            .command(prog)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        Stepped {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
            text: String::new(),
        }
    }

    /// Reads up to `phase=name` (the program then waits).
    pub fn reach(&mut self, name: &str) {
        let want = format!("phase={name}");
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            self.text.push_str(&line);
            assert!(n > 0, "ended before {want}:\n{}", self.text);
            if line.trim() == want {
                return;
            }
        }
    }

    pub fn resume(&mut self) {
        self.stdin.write_all(b"\n").unwrap();
    }

    /// Lets the program run to its end, which must be a success; returns all
    /// it printed.
    pub fn finish(mut self) -> String {
        self.resume();
        drop(self.stdin);
        self.stdout.read_to_string(&mut self.text).unwrap();
        assert!(self.child.wait().unwrap().success(), "{}", self.text);
        self.text
    }
}
