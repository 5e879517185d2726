//! The tree as text, with what is used and free on each GPU (for `/graph`
//! and `PrintGraph`).

use std::fmt::Write;

use crate::allocator::Allocator;
use crate::topology::TreeNode;

impl Allocator {
    /// The GPU tree with cores and memory used/free per GPU, followed by
    /// the NVLink link counts when the node has any.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let tree = self.topology().tree();
        self.render_node(&mut out, TreeNode::Group(tree.root()), "", "");
        let topo = self.topology();
        if topo.has_nvlink() {
            let n = topo.len();
            out.push_str("NVLink links:\n      ");
            for b in 0..n {
                let _ = write!(out, "{:>6}", format!("GPU{b}"));
            }
            out.push('\n');
            for a in 0..n {
                let _ = write!(out, "{:<6}", format!("GPU{a}"));
                for b in 0..n {
                    if a == b {
                        let _ = write!(out, "{:>6}", "X");
                    } else {
                        let _ = write!(out, "{:>6}", topo.nvlink_count(a, b));
                    }
                }
                out.push('\n');
            }
        }
        out
    }

    fn render_node(&self, out: &mut String, node: TreeNode, first: &str, rest: &str) {
        let topo = self.topology();
        match node {
            TreeNode::Group(id) => {
                let g = topo.tree().group(id);
                let free = g.gpus.iter().filter(|&&i| {
                    let u = self.usage(i);
                    u.takes_placements() && u.is_idle()
                });
                let _ = writeln!(
                    out,
                    "{first}{} ({} GPUs, {} whole free)",
                    g.level,
                    g.gpus.len(),
                    free.count()
                );
                for (i, &child) in g.children.iter().enumerate() {
                    let last = i + 1 == g.children.len();
                    let (f, r) = if last {
                        ("└─ ", "   ")
                    } else {
                        ("├─ ", "│  ")
                    };
                    self.render_node(out, child, &format!("{rest}{f}"), &format!("{rest}{r}"));
                }
            }
            TreeNode::Gpu(i) => {
                let info = &topo.gpus()[i];
                let u = self.usage(i);
                let mut state = String::new();
                if u.exclusive {
                    state.push_str(" [whole]");
                } else if u.shares > 0 {
                    let _ = write!(
                        state,
                        " [{} share{}]",
                        u.shares,
                        if u.shares == 1 { "" } else { "s" }
                    );
                }
                if !u.healthy {
                    state.push_str(" [UNHEALTHY]");
                }
                if u.mig {
                    state.push_str(" [MIG]");
                }
                let _ = writeln!(
                    out,
                    "{first}GPU{i} /dev/nvidia{} {}: cores {}/100 used {} free, memory {}/{} MiB used {} MiB free{state}",
                    info.minor,
                    info.uuid,
                    u.allocated_cores,
                    u.free_cores(),
                    u.allocated_memory_units * 256,
                    u.total_memory_units * 256,
                    u.free_memory_units() * 256,
                );
                for (inst, u) in self.instances().filter(|(inst, _)| inst.gpu == i) {
                    let shares = match u.shares {
                        0 => String::new(),
                        1 => " [1 share]".into(),
                        n => format!(" [{n} shares]"),
                    };
                    let _ = writeln!(
                        out,
                        "{rest}   MIG {} {}: cores {}/100 used, memory {}/{} MiB used{shares}{}",
                        inst.profile,
                        inst.uuid,
                        u.allocated_cores,
                        u.allocated_memory_units * 256,
                        u.total_memory_units * 256,
                        if u.healthy { "" } else { " [UNHEALTHY]" },
                    );
                }
            }
        }
    }
}
