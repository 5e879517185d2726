//! The node's GPUs, their pairwise PCIe levels and NVLink counts, and the
//! tree built from the levels.

use std::fmt;

use crate::error::TopologyError;

/// One `tencent.com/vcuda-memory` unit: 256 MiB.
pub const MEMORY_UNIT_BYTES: u64 = 256 << 20;

/// PCIe relationship between two GPUs, as NVML's `nvmlGpuTopologyLevel_t`
/// names them (the discriminants are NVML's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum PcieLevel {
    /// Same board (two dies on one card).
    Internal = 0,
    /// Behind one PCIe switch (PIX).
    Single = 10,
    /// Behind several PCIe switches, no host bridge in between (PXB).
    Multiple = 20,
    /// Through a PCIe host bridge (PHB).
    HostBridge = 30,
    /// Across host bridges within one NUMA node (NODE).
    Node = 40,
    /// Across NUMA nodes (SYS).
    System = 50,
}

impl PcieLevel {
    /// Every level, closest first.
    pub const ALL: [PcieLevel; 6] = [
        PcieLevel::Internal,
        PcieLevel::Single,
        PcieLevel::Multiple,
        PcieLevel::HostBridge,
        PcieLevel::Node,
        PcieLevel::System,
    ];

    /// From NVML's numeric value; `None` for values NVML does not define.
    pub fn from_nvml(value: u32) -> Option<PcieLevel> {
        PcieLevel::ALL.into_iter().find(|l| *l as u32 == value)
    }

    /// Position in [`PcieLevel::ALL`].
    pub(crate) fn rank(self) -> usize {
        self as usize / 10
    }

    /// The abbreviation `nvidia-smi topo -m` prints (`INT` for two dies on
    /// one board, which nvidia-smi shows per board instead).
    pub fn short_name(self) -> &'static str {
        match self {
            PcieLevel::Internal => "INT",
            PcieLevel::Single => "PIX",
            PcieLevel::Multiple => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::Node => "NODE",
            PcieLevel::System => "SYS",
        }
    }
}

impl fmt::Display for PcieLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

/// One GPU as the caller found it (NVML in production).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Position in [`Topology::gpus`]; placements name GPUs by it.
    pub index: usize,
    pub uuid: String,
    /// The `N` of `/dev/nvidiaN`.
    pub minor: u32,
    pub memory_bytes: u64,
    /// `None` where the platform does not say.
    pub numa_node: Option<u32>,
    pub pci_bus_id: String,
}

impl GpuInfo {
    /// Whole 256 MiB units of this GPU's memory (what shares are carved from).
    pub fn memory_units(&self) -> u64 {
        self.memory_bytes / MEMORY_UNIT_BYTES
    }
}

/// A node of the GPU tree: an inner group or a GPU leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeNode {
    /// Index into [`Tree::groups`].
    Group(usize),
    /// GPU index.
    Gpu(usize),
}

/// GPUs that are all within `level` of each other (transitively): one
/// PCIe switch, one host bridge, one NUMA node, the whole machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub level: PcieLevel,
    pub parent: Option<usize>,
    /// Subgroups and GPUs, ordered by their lowest GPU index.
    pub children: Vec<TreeNode>,
    /// Every GPU below, ascending.
    pub gpus: Vec<usize>,
    /// Distance from the root (root = 0).
    pub depth: usize,
}

/// The GPU tree: inner nodes are PCIe levels, leaves are GPUs.
///
/// Built by single-linkage clustering on the pairwise levels: at each level,
/// closest first, GPUs within that level of each other merge into one group.
/// A group that merges nothing new at a higher level is not repeated, so the
/// tree has no single-child chains. There is always a root group (also for
/// zero or one GPU), and no limit on the number of GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    groups: Vec<Group>,
    gpu_parent: Vec<usize>,
    root: usize,
}

impl Tree {
    fn build(n: usize, pcie: &[PcieLevel]) -> Tree {
        let mut groups: Vec<Group> = Vec::new();
        let mut gpu_parent = vec![usize::MAX; n];
        // Current clusters: (GPUs, node standing for them).
        let mut clusters: Vec<(Vec<usize>, TreeNode)> =
            (0..n).map(|g| (vec![g], TreeNode::Gpu(g))).collect();

        for level in PcieLevel::ALL {
            let mut uf = UnionFind::new(clusters.len());
            let mut cluster_of = vec![0; n];
            for (c, (gpus, _)) in clusters.iter().enumerate() {
                for &g in gpus {
                    cluster_of[g] = c;
                }
            }
            for a in 0..n {
                for b in a + 1..n {
                    if pcie[a * n + b] <= level {
                        uf.union(cluster_of[a], cluster_of[b]);
                    }
                }
            }
            let mut merged: Vec<Vec<usize>> = vec![Vec::new(); clusters.len()];
            for c in 0..clusters.len() {
                merged[uf.find(c)].push(c);
            }
            let mut next = Vec::new();
            for members in merged.into_iter().filter(|m| !m.is_empty()) {
                if members.len() == 1 {
                    next.push(std::mem::take(&mut clusters[members[0]]));
                    continue;
                }
                let id = groups.len();
                let mut gpus = Vec::new();
                let mut children = Vec::new();
                for c in members {
                    let (cg, node) = std::mem::take(&mut clusters[c]);
                    set_parent(&mut groups, &mut gpu_parent, node, id);
                    gpus.extend(cg);
                    children.push(node);
                }
                gpus.sort_unstable();
                groups.push(Group {
                    level,
                    parent: None,
                    children,
                    gpus: gpus.clone(),
                    depth: 0,
                });
                next.push((gpus, TreeNode::Group(id)));
            }
            next.sort_by_key(|(gpus, _)| gpus[0]);
            clusters = next;
        }

        // Everything is within SYS of everything, so one cluster remains
        // unless there are fewer than two GPUs; give those a root too.
        let root = match clusters.as_slice() {
            [(_, TreeNode::Group(id))] => *id,
            _ => {
                let id = groups.len();
                let mut children = Vec::new();
                for (_, node) in clusters {
                    set_parent(&mut groups, &mut gpu_parent, node, id);
                    children.push(node);
                }
                groups.push(Group {
                    level: PcieLevel::System,
                    parent: None,
                    children,
                    gpus: (0..n).collect(),
                    depth: 0,
                });
                id
            }
        };
        // Groups are created bottom-up, so walk them top-down for depths.
        for id in (0..groups.len()).rev() {
            if let Some(p) = groups[id].parent {
                groups[id].depth = groups[p].depth + 1;
            }
        }
        let mins: Vec<usize> = groups
            .iter()
            .map(|g| g.gpus.first().copied().unwrap_or(0))
            .collect();
        for g in &mut groups {
            g.children.sort_by_key(|c| match c {
                TreeNode::Gpu(i) => *i,
                TreeNode::Group(id) => mins[*id],
            });
        }
        Tree {
            groups,
            gpu_parent,
            root,
        }
    }

    /// The root group's index.
    pub fn root(&self) -> usize {
        self.root
    }

    /// All groups, children before parents (the root is last).
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    pub fn group(&self, id: usize) -> &Group {
        &self.groups[id]
    }

    /// The group directly above a GPU.
    pub fn parent_of_gpu(&self, gpu: usize) -> usize {
        self.gpu_parent[gpu]
    }

    /// Groups above a GPU, innermost first, ending at the root.
    pub fn ancestors(&self, gpu: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::successors(Some(self.gpu_parent[gpu]), |&g| self.groups[g].parent)
    }

    /// Innermost group holding both groups.
    pub(crate) fn lca(&self, mut a: usize, mut b: usize) -> usize {
        while a != b {
            let (da, db) = (self.groups[a].depth, self.groups[b].depth);
            if da >= db {
                a = self.groups[a].parent.expect("non-root group has a parent");
            }
            if db >= da {
                b = self.groups[b].parent.expect("non-root group has a parent");
            }
        }
        a
    }
}

fn set_parent(groups: &mut [Group], gpu_parent: &mut [usize], node: TreeNode, parent: usize) {
    match node {
        TreeNode::Gpu(g) => gpu_parent[g] = parent,
        TreeNode::Group(c) => groups[c].parent = Some(parent),
    }
}

impl Default for TreeNode {
    fn default() -> Self {
        TreeNode::Gpu(usize::MAX)
    }
}

struct UnionFind(Vec<usize>);

impl UnionFind {
    fn new(n: usize) -> Self {
        UnionFind((0..n).collect())
    }
    fn find(&mut self, mut x: usize) -> usize {
        while self.0[x] != x {
            self.0[x] = self.0[self.0[x]];
            x = self.0[x];
        }
        x
    }
    fn union(&mut self, a: usize, b: usize) {
        let (a, b) = (self.find(a), self.find(b));
        // Keep the lower root so results do not depend on pair order.
        if a < b {
            self.0[b] = a;
        } else {
            self.0[a] = b;
        }
    }
}

/// The node as the allocator sees it: GPUs, pairwise PCIe levels and NVLink
/// link counts, and the tree built from the levels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    gpus: Vec<GpuInfo>,
    pcie: Vec<PcieLevel>,
    nvlink: Vec<u32>,
    tree: Tree,
}

impl Topology {
    /// From square matrices indexed by GPU index. The diagonal is ignored;
    /// both matrices must be symmetric.
    pub fn new(
        gpus: Vec<GpuInfo>,
        pcie: Vec<Vec<PcieLevel>>,
        nvlink: Vec<Vec<u32>>,
    ) -> Result<Topology, TopologyError> {
        let n = gpus.len();
        for (name, rows) in [("pcie", pcie.len()), ("nvlink", nvlink.len())] {
            if rows != n {
                return Err(TopologyError::MatrixSize {
                    matrix: name,
                    expected: n,
                    found: rows,
                });
            }
        }
        for (name, lens) in [
            ("pcie", pcie.iter().map(Vec::len).collect::<Vec<_>>()),
            ("nvlink", nvlink.iter().map(Vec::len).collect()),
        ] {
            if let Some(&bad) = lens.iter().find(|&&l| l != n) {
                return Err(TopologyError::MatrixSize {
                    matrix: name,
                    expected: n,
                    found: bad,
                });
            }
        }
        Topology::from_fn(gpus, |a, b| pcie[a][b], |a, b| nvlink[a][b])
    }

    /// From functions of a GPU-index pair (called for `a != b` only).
    pub fn from_fn(
        gpus: Vec<GpuInfo>,
        pcie: impl Fn(usize, usize) -> PcieLevel,
        nvlink: impl Fn(usize, usize) -> u32,
    ) -> Result<Topology, TopologyError> {
        let n = gpus.len();
        for (i, g) in gpus.iter().enumerate() {
            if g.index != i {
                return Err(TopologyError::IndexMismatch {
                    position: i,
                    index: g.index,
                });
            }
        }
        let mut p = vec![PcieLevel::Internal; n * n];
        let mut l = vec![0; n * n];
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    p[a * n + b] = pcie(a, b);
                    l[a * n + b] = nvlink(a, b);
                }
            }
        }
        for a in 0..n {
            for b in a + 1..n {
                if p[a * n + b] != p[b * n + a] || l[a * n + b] != l[b * n + a] {
                    return Err(TopologyError::Asymmetric { a, b });
                }
            }
        }
        let tree = Tree::build(n, &p);
        Ok(Topology {
            gpus,
            pcie: p,
            nvlink: l,
            tree,
        })
    }

    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// PCIe level between two GPUs (`Internal` for a GPU with itself).
    pub fn pcie_level(&self, a: usize, b: usize) -> PcieLevel {
        self.pcie[a * self.gpus.len() + b]
    }

    /// NVLink links between two GPUs (0 for a GPU with itself).
    pub fn nvlink_count(&self, a: usize, b: usize) -> u32 {
        self.nvlink[a * self.gpus.len() + b]
    }

    pub fn has_nvlink(&self) -> bool {
        self.nvlink.iter().any(|&l| l > 0)
    }

    pub fn tree(&self) -> &Tree {
        &self.tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn gpu(i: usize) -> GpuInfo {
        GpuInfo {
            index: i,
            uuid: format!("GPU-{i}"),
            minor: i as u32,
            memory_bytes: 16 << 30,
            numa_node: None,
            pci_bus_id: String::new(),
        }
    }

    fn levels(n: usize, f: impl Fn(usize, usize) -> PcieLevel) -> Topology {
        Topology::from_fn((0..n).map(gpu).collect(), f, |_, _| 0).unwrap()
    }

    #[test]
    fn tree_of_pairs_and_halves() {
        // 0-1 and 2-3 on switches, 0..3 on one NUMA node, 4..7 another.
        let t = levels(8, |a, b| {
            if a / 2 == b / 2 {
                PcieLevel::Single
            } else if a / 4 == b / 4 {
                PcieLevel::Node
            } else {
                PcieLevel::System
            }
        });
        let tree = t.tree();
        let root = tree.group(tree.root());
        assert_eq!(root.level, PcieLevel::System);
        assert_eq!(root.children.len(), 2);
        let TreeNode::Group(half) = root.children[0] else {
            panic!("root child is a group")
        };
        assert_eq!(tree.group(half).gpus, vec![0, 1, 2, 3]);
        assert_eq!(tree.group(half).level, PcieLevel::Node);
        let p = tree.parent_of_gpu(5);
        assert_eq!(tree.group(p).gpus, vec![4, 5]);
        assert_eq!(tree.group(p).level, PcieLevel::Single);
        assert_eq!(tree.ancestors(5).count(), 3);
        assert_eq!(tree.groups().len(), 7);
    }

    #[test]
    fn one_and_zero_gpus_have_a_root() {
        let t = levels(1, |_, _| PcieLevel::System);
        let root = t.tree().group(t.tree().root());
        assert_eq!(root.children, vec![TreeNode::Gpu(0)]);
        let t = levels(0, |_, _| PcieLevel::System);
        assert!(t.tree().group(t.tree().root()).children.is_empty());
    }

    #[test]
    fn no_gpu_cap() {
        let t = levels(100, |a, b| {
            if a / 10 == b / 10 {
                PcieLevel::HostBridge
            } else {
                PcieLevel::System
            }
        });
        assert_eq!(t.tree().group(t.tree().root()).children.len(), 10);
        assert_eq!(t.tree().group(t.tree().parent_of_gpu(99)).gpus.len(), 10);
    }

    #[test]
    fn flat_node_has_gpus_under_root() {
        let t = levels(3, |_, _| PcieLevel::Node);
        let root = t.tree().group(t.tree().root());
        assert_eq!(root.level, PcieLevel::Node);
        assert_eq!(
            root.children,
            vec![TreeNode::Gpu(0), TreeNode::Gpu(1), TreeNode::Gpu(2)]
        );
    }

    #[test]
    fn bad_matrices_are_rejected() {
        let gpus: Vec<_> = (0..2).map(gpu).collect();
        let err = Topology::new(
            gpus.clone(),
            vec![vec![PcieLevel::System; 2]],
            vec![vec![0; 2]; 2],
        )
        .unwrap_err();
        assert!(err.to_string().contains("pcie"), "{err}");
        let err =
            Topology::from_fn(gpus.clone(), |_, _| PcieLevel::System, |a, _| a as u32).unwrap_err();
        assert_eq!(err, TopologyError::Asymmetric { a: 0, b: 1 });
        let mut swapped = gpus;
        swapped[0].index = 1;
        assert!(Topology::from_fn(swapped, |_, _| PcieLevel::System, |_, _| 0).is_err());
    }

    #[test]
    fn nvml_levels_round_trip() {
        for l in PcieLevel::ALL {
            assert_eq!(PcieLevel::from_nvml(l as u32), Some(l));
        }
        assert_eq!(PcieLevel::from_nvml(15), None);
    }
}
