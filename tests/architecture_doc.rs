//! `docs/architecture.md` draws the workspace's crate graph ("The crates":
//! its ```` ```mermaid ```` `graph` blocks, one `crate --> dependency` a
//! line). This test keeps the drawing true: it reads the real graph from
//! `cargo metadata --no-deps` (the workspace members and their normal
//! dependencies on each other; dev- and build-dependencies are not drawn)
//! and fails naming every edge or crate the document is missing and every
//! one it draws that does not exist.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::process::Command;

const DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/architecture.md");
const MANIFEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");

/// Crates (package names) and `from --> to` edges.
#[derive(Debug, Default, PartialEq, Eq)]
struct Graph {
    nodes: BTreeSet<String>,
    edges: BTreeSet<(String, String)>,
}

/// The workspace's real graph: members, and each member's normal
/// dependencies (optional and target-specific ones included) on members.
fn cargo_graph() -> Graph {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .arg("--manifest-path")
        .arg(MANIFEST)
        .output()
        .unwrap_or_else(|e| panic!("running {cargo:?} metadata: {e}"));
    assert!(
        out.status.success(),
        "{cargo:?} metadata --manifest-path {MANIFEST} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata printed JSON");
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .map(|id| id.as_str().expect("a package id"))
        .collect();
    let packages: Vec<&serde_json::Value> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| members.contains(p["id"].as_str().unwrap_or_default()))
        .collect();
    let name = |p: &serde_json::Value| p["name"].as_str().expect("a name").to_string();
    let mut graph = Graph {
        nodes: packages.iter().map(|p| name(p)).collect(),
        edges: BTreeSet::new(),
    };
    for p in &packages {
        for dep in p["dependencies"].as_array().expect("dependencies") {
            let to = dep["name"].as_str().expect("a dependency's name");
            // kind: null is a normal dependency ("dev", "build" are not);
            // a member is a path dependency (no source), whatever it is
            // renamed to in the dependent's Cargo.toml.
            if dep["kind"].is_null() && dep["source"].is_null() && graph.nodes.contains(to) {
                graph.edges.insert((name(p), to.to_string()));
            }
        }
    }
    graph
}

/// The graph `text` draws: the union of its ```` ```mermaid ```` blocks
/// that start with `graph` or `flowchart`. Understood lines: `a --> b`,
/// `a -->|label| b`, a node alone, either side with a shape and label
/// (`a["a (bin)"]`); `subgraph`, `end`, `direction`, styling and `%%`
/// comments are skipped. Anything else is an error naming its line, so an
/// edge is never silently not read.
fn doc_graph(text: &str) -> Result<Graph, String> {
    let mut graph = Graph::default();
    let mut lines = text.lines().enumerate();
    while let Some((_, line)) = lines.next() {
        if line.trim() != "```mermaid" {
            continue;
        }
        let block: Vec<(usize, &str)> = lines
            .by_ref()
            .take_while(|(_, l)| l.trim() != "```")
            .map(|(i, l)| (i + 1, l))
            .collect();
        let mut body = block
            .iter()
            .map(|&(n, l)| (n, l.split("%%").next().unwrap_or_default().trim()))
            .filter(|(_, l)| !l.is_empty());
        match body.next() {
            Some((_, head)) if head.starts_with("graph") || head.starts_with("flowchart") => {}
            _ => continue, // another kind of diagram
        }
        for (n, l) in body {
            let word = l.split_whitespace().next().unwrap_or_default();
            if matches!(
                word,
                "subgraph" | "end" | "direction" | "classDef" | "class" | "style" | "linkStyle"
            ) {
                continue;
            }
            read_line(l, &mut graph).map_err(|e| format!("{DOC} line {n}: {e}: `{l}`"))?;
        }
    }
    if graph.nodes.is_empty() {
        return Err(format!(
            "{DOC} has no ```mermaid graph block: the crate graph is drawn there"
        ));
    }
    Ok(graph)
}

/// One node or one edge, into `graph`.
fn read_line(line: &str, graph: &mut Graph) -> Result<(), String> {
    let (from, rest) = node(line)?;
    graph.nodes.insert(from.to_string());
    let rest = rest.trim_start();
    if rest.is_empty() {
        return Ok(());
    }
    let Some(rest) = rest.strip_prefix("-->") else {
        return Err("expected `a --> b` (one plain arrow a line) or a node alone".into());
    };
    let rest = rest.trim_start();
    let rest = match rest.strip_prefix('|') {
        Some(label) => label
            .split_once('|')
            .ok_or("an edge label `|...|` without its closing `|`")?
            .1
            .trim_start(),
        None => rest,
    };
    let (to, rest) = node(rest)?;
    if !rest.trim().is_empty() {
        return Err("one edge a line (no chains, no `&`)".into());
    }
    graph.nodes.insert(to.to_string());
    graph.edges.insert((from.to_string(), to.to_string()));
    Ok(())
}

/// A node at the start of `s`: its id, and what follows its shape and
/// label if it has one.
fn node(s: &str) -> Result<(&str, &str), String> {
    let s = s.trim_start();
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .unwrap_or(s.len());
    // An id never ends in '-': that is the start of an arrow.
    let id = s[..end].trim_end_matches('-');
    let mut rest = &s[id.len()..];
    if id.is_empty() {
        return Err("expected a crate's name".into());
    }
    if rest.starts_with(['[', '(', '{', '>']) {
        let mut depth = 0usize;
        let mut quoted = false;
        let mut close = None;
        for (i, c) in rest.char_indices() {
            match c {
                '"' => quoted = !quoted,
                _ if quoted => {}
                '[' | '(' | '{' => depth += 1,
                '>' if i == 0 => depth += 1,
                ']' | ')' | '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        close = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[close.ok_or("a node's label is not closed")?..];
    }
    Ok((id, rest))
}

/// What differs, one line each; empty when the two agree.
fn differences(real: &Graph, doc: &Graph) -> String {
    let mut out = String::new();
    let mut section = |title: &str, items: Vec<String>| {
        if !items.is_empty() {
            let _ = writeln!(out, "  {title}:");
            for i in items {
                let _ = writeln!(out, "    {i}");
            }
        }
    };
    let edge = |(a, b): &(String, String)| format!("{a} --> {b}");
    section(
        "edges missing from the doc (a Cargo.toml has them as normal dependencies; draw them)",
        real.edges.difference(&doc.edges).map(edge).collect(),
    );
    section(
        "edges the doc draws that no Cargo.toml has (remove them; dev- and build-dependencies are not drawn)",
        doc.edges.difference(&real.edges).map(edge).collect(),
    );
    section(
        "workspace members missing from the doc (draw each at least as a node)",
        real.nodes.difference(&doc.nodes).cloned().collect(),
    );
    section(
        "crates the doc draws that are not workspace members (package names, as in Cargo.toml)",
        doc.nodes.difference(&real.nodes).cloned().collect(),
    );
    out
}

#[test]
fn architecture_doc_draws_the_real_crate_graph() {
    let text = std::fs::read_to_string(DOC).unwrap_or_else(|e| panic!("reading {DOC}: {e}"));
    let doc = doc_graph(&text).unwrap_or_else(|e| panic!("{e}"));
    let real = cargo_graph();
    let diff = differences(&real, &doc);
    assert!(
        diff.is_empty(),
        "docs/architecture.md's crate graph (its ```mermaid graph blocks) is not the \
         workspace's (cargo metadata: normal dependencies between workspace members):\n{diff}"
    );
}

fn graph(nodes: &[&str], edges: &[(&str, &str)]) -> Graph {
    Graph {
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
        edges: edges
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
    }
}

#[test]
fn the_doc_reader_reads_labels_and_skips_other_blocks() {
    let text = "intro\n\
        ```\nnot --> read\n```\n\
        ```mermaid\nsequenceDiagram\n  a->>b: hi\n```\n\
        ```mermaid\ngraph LR\n  %% a comment\n  subgraph nodes [The node]\n\
        gpu-manager[\"gpu-manager (bin, a --> b)\"] --> node-agent\n\
        node-agent -->|registration| vcuda-api\n  end\n  lone((lone))\n\
        x-y-->z %% trailing\n```\n\
        ```mermaid\nflowchart TD\n  node-agent --> vdriver\n```\n";
    assert_eq!(
        doc_graph(text).unwrap(),
        graph(
            &[
                "gpu-manager",
                "node-agent",
                "vcuda-api",
                "lone",
                "x-y",
                "z",
                "vdriver"
            ],
            &[
                ("gpu-manager", "node-agent"),
                ("node-agent", "vcuda-api"),
                ("x-y", "z"),
                ("node-agent", "vdriver"),
            ],
        )
    );
}

#[test]
fn the_doc_reader_refuses_what_it_cannot_read() {
    for line in [
        "a --> b --> c",
        "a --> b & c",
        "a -.-> b",
        "a ==> b",
        "a[\"open --> b",
    ] {
        let text = format!("```mermaid\ngraph LR\n{line}\n```\n");
        let err = doc_graph(&text).unwrap_err();
        assert!(
            err.contains("line 3") && err.contains(line),
            "{line}: {err}"
        );
    }
    assert!(doc_graph("no diagram\n").is_err());
}

#[test]
fn differences_name_each_side() {
    let real = graph(&["a", "b", "c"], &[("a", "b"), ("b", "c")]);
    let doc = graph(&["a", "b", "d"], &[("a", "b"), ("a", "d")]);
    let diff = differences(&real, &doc);
    for want in ["    b --> c\n", "    a --> d\n", "    c\n", "    d\n"] {
        assert!(diff.contains(want), "{want:?} not in:\n{diff}");
    }
    assert!(differences(&real, &real).is_empty());
}
