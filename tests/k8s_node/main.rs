//! vcuda against a real Kubernetes 1.20 node (issue 13): etcd, kube-apiserver
//! (Node,RBAC), controller-manager, scheduler, containerd + runc + a CNI
//! bridge and kubelet, brought up by `tests/k8s/cluster.sh` from binaries
//! built out of Debian's `kubernetes` source package
//! (`tests/k8s/build-kubernetes.sh`), over a simulated 4-GPU node
//! (`gpu-sim install --host-dev`). Workloads are the C test programs in pods
//! of a local busybox image (`imagePullPolicy: Never`).
//!
//! One test, in phases (a failure names its phase):
//!  1. the real `gpu-manager` binary on the host: both resources on the node
//!     (400 / 240), a share's `-lcuda` and cudart-style programs see the quota
//!     as the card and are refused past it, two shares at 30/70 on one GPU;
//!     then (`phase_tp.rs`) a TP = 2 server pod (`tencent.com/vcuda-gpus`)
//!     beside a second tenant's pod on the same pair: each rank's memory
//!     rules, the other's quota per GPU, both held to 50 % on each GPU;
//!     then (`phase_webhook.rs`, "1c") `vcuda-webhook` in front of the API
//!     server: bad requests refused at `kubectl apply`, and its own CA
//!     (`--self-managed`) rotated twice under calls that never fail;
//!     then (`phase_sched.rs`, "2b") kube-scheduler with `vcuda-scheduler`
//!     as its extender: 13 pods of 30 cores on 4 GPUs, 12 Running and 1
//!     Unschedulable with the reason, the extender killed and restarted;
//!     then (`phase_nodes.rs`, "2c") two more nodes (`cluster.sh node-up`)
//!     with their own managers: 13 pods over three nodes, a 200-pod trace,
//!     the extender killed mid-run;
//!  2. 20 live pods, the manager killed with -9 and restarted: quotas kept,
//!     a new process registers; kubelet restarted: resources back, pods
//!     undisturbed; pods deleted: allocations released, the host manager
//!     stopped;
//!  3. `deploy/overlays/share-before-1.22` applied as users apply an overlay
//!     (`kubectl apply -k`), through the test overlay `deploy/test/` (local
//!     image, host paths of the simulated root): the DaemonSet Ready under the RBAC authorizer with
//!     only the ClusterRole's verbs, a share pod served, a refusal as a
//!     Warning Event; 3b (`upgrade.rs`): the image upgraded and rolled back
//!     under live shares; 3d (`reboot.rs`): a node reboot; 3c
//!     (`uninstall.rs`): `deploy/overlays/uninstall`, refused while a share
//!     lives, then nothing left behind.
//!
//! With `VCUDA_K8S_MODERN=1` the same suite runs on the ≥ 1.36 node built
//! from the Go modules (`tests/k8s/cluster-modern.sh`, the DRA suite's node;
//! `VCUDA_K8S_MODERN_BIN`): deploy/overlays/share instead of
//! share-before-1.22, the scheduler's v1 configuration, the extra nodes at
//! 198.51.100.38 and up (test-support's `k8s::util::Flavor`). tests/run.sh
//! runs it on both.
//!
//! It runs when `VCUDA_K8S_BIN` is set or `VCUDA_REQUIRE_K8S=1` (tests/run.sh,
//! so CI, sets both) and skips with a line otherwise; with
//! `VCUDA_REQUIRE_K8S=1` anything missing fails it, named. One run per
//! machine at a time (`/tmp/vcuda-k8s.lock`). Figures are
//! printed (`k8s_node:` lines), never asserted on timing.
//! `VCUDA_K8S_KEEP=1` leaves the cluster up afterwards (tests/k8s/cluster.sh down).
//!
//! The cluster and its helpers are test-support's `k8s` (`util`: constants,
//! polling, the machine lock, clean-ups; `cluster`: cluster.sh and kubectl,
//! the pods' manifest, images); this suite's parts sit beside this file:
//! `host_manager.rs`, `phase1.rs`, `phase2.rs`, `deploy.rs` (phase 3).

mod deploy;
mod helm;
mod host_manager;
mod phase1;
mod phase2;
mod phase_memory;
mod phase_nodes;
mod phase_sched;
mod phase_tp;
mod phase_webhook;
mod reboot;
mod uninstall;
mod upgrade;

use std::path::{Path, PathBuf};
use std::time::Instant;
use test_support::k8s::cluster::{Cluster, Work, busybox_image, compile, manager_image};
use test_support::k8s::util::{Cleanup, Flavor, HostDevCleanup, MachineLock, k8s_bin};
use test_support::{Capability, missing, require, target_dir, workspace_root};

#[test]
fn real_node_suite() {
    // The suite takes minutes and the whole machine's kubelet directory: it
    // runs when asked (tests/run.sh sets both), never as a side effect of a
    // plain `cargo test --workspace`.
    let flavor = Flavor::current();
    if std::env::var_os(flavor.vars().0).is_none() && !Capability::Kubernetes.required() {
        eprintln!(
            "skipped: the real-node suite runs with {}=<dir> or VCUDA_REQUIRE_K8S=1 \
             (tests/run.sh sets them; see tests/k8s/README.md)",
            flavor.vars().0
        );
        return;
    }
    if !require(Capability::Kubernetes) {
        return;
    }
    let bin = k8s_bin().expect("require(Kubernetes) found them");
    if !test_support::is_root() {
        missing(Capability::Kubernetes, "the real node needs root");
        return;
    }
    for f in ["gpu-manager", "gpu-sim", "libvcuda.so", "libcuda.so"] {
        assert!(
            target_dir().join(f).is_file(),
            "{f} missing in {}: cargo build --workspace first",
            target_dir().display()
        );
    }
    let _lock = MachineLock::take();
    let t_up = Instant::now();
    let c = Cluster::up(bin);
    eprintln!(
        "k8s_node: cluster up in {:.1} s",
        t_up.elapsed().as_secs_f64()
    );
    let w = Work::new(&c.dir);
    let mut figures: Vec<String> = Vec::new();

    // ------------------------------------------------------------ setup
    let installed = w.install_sim();
    eprint!("{installed}");
    // The sim's host device nodes go again at the end (those this install
    // created, and any a killed earlier run left: only this suite makes them).
    let _host_dev = if c.keep {
        HostDevCleanup(Vec::new())
    } else {
        HostDevCleanup::from_install_output(&installed)
    };
    let tc = workspace_root().join("tests/c");
    compile(&w, &tc.join("shim_client.c"), "shim_client", true);
    compile(&w, &tc.join("shim_compute.c"), "shim_compute", true);
    compile(&w, &tc.join("tp_serve.c"), "tp_serve", true);
    compile(&w, &tc.join("multi_gpu.c"), "multi_gpu", true);
    compile(&w, &tc.join("hold_memory.c"), "hold_memory", true);
    compile(
        &w,
        &workspace_root().join("tests/k8s/c/cudart_loader.c"),
        "cudart_loader",
        false,
    );
    busybox_image(&c, &c.dir.join("work"));

    // VCUDA_K8S_ONLY=helm runs the chart's phase alone, =webhook the
    // webhook's (while working on them).
    match std::env::var("VCUDA_K8S_ONLY").as_deref() {
        Ok("helm") => {
            manager_image(&c, &c.dir.join("work"));
            let copy = deploy::prepare_test_overlay(&c, &w);
            let _etc = Cleanup(
                (!Path::new("/etc/gpu-manager").exists())
                    .then(|| PathBuf::from("/etc/gpu-manager")),
            );
            helm::run(&c, &w, &copy, &mut figures);
            figures.iter().for_each(|f| eprintln!("k8s_node:   {f}"));
            return;
        }
        Ok("webhook") => {
            let mut m = host_manager::HostManager::start(&c, &w);
            m.wait_ready(120);
            phase_webhook::run(&c, &w, &mut figures);
            figures.iter().for_each(|f| eprintln!("k8s_node:   {f}"));
            return;
        }
        _ => {}
    }
    // VCUDA_K8S_ONLY=deploy runs phase 3 alone (while working on it).
    let host_phases = std::env::var("VCUDA_K8S_ONLY").as_deref() != Ok("deploy");
    if host_phases {
        host_manager_phases(&c, &w, &mut figures);
    }
    if matches!(
        std::env::var("VCUDA_K8S_ONLY").as_deref(),
        Ok("sched" | "nodes" | "live" | "memory" | "tp")
    ) {
        for f in &figures {
            eprintln!("k8s_node:   {f}");
        }
        return;
    }

    // ------------------------------------------------ phase 3: deploy/
    eprintln!("k8s_node: phase 3: deploy/ manifests, the DaemonSet under RBAC");
    let etc_existed = Path::new("/etc/gpu-manager").exists();
    let _etc_cleanup = Cleanup(if etc_existed {
        None
    } else {
        Some(PathBuf::from("/etc/gpu-manager"))
    });
    deploy::run(&c, &w, &mut figures);

    eprintln!("k8s_node: figures ({}, 2-core machine):", c.flavor.label());
    for f in &figures {
        eprintln!("k8s_node:   {f}");
    }
}

/// Phases 1 and 2: the real gpu-manager binary on the host.
/// `VCUDA_K8S_ONLY=sched` runs the extender's phase alone over a fresh
/// host manager, `=nodes` the three nodes', `=live` phases 1 and 2 only,
/// `=tp` phases 1 and 1b (while working on them).
fn host_manager_phases(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    let only = std::env::var("VCUDA_K8S_ONLY").unwrap_or_default();
    if only == "memory" {
        let mut m = host_manager::HostManager::start(c, w);
        m.wait_ready(120);
        phase_memory::run(c, w, figures);
        return;
    }
    if only == "sched" || only == "nodes" {
        let mut m = host_manager::HostManager::start(c, w);
        m.wait_ready(120);
        if only == "sched" {
            phase_sched::run(c, w, figures);
        } else {
            phase_nodes::run(c, w, figures);
        }
        return;
    }
    let (mut m, state) = phase1::run(c, w, figures);
    if only == "live" {
        phase2::run(c, w, figures, &mut m, &state);
        return;
    }
    phase_tp::run(c, w, figures, &state);
    if only == "tp" {
        return;
    }
    phase_memory::run(c, w, figures);
    phase_webhook::run(c, w, figures);
    // While the host manager serves (phase 2 ends by stopping it).
    phase_sched::run(c, w, figures);
    phase_nodes::run(c, w, figures);
    phase2::run(c, w, figures, &mut m, &state);
}
