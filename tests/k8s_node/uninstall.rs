//! Phase 3c (issue 24): uninstall as an operator does it. The manager's
//! overlay deleted (`kubectl delete -k`) while a share pod (`live`) still runs: a new
//! CUDA process there fails closed saying the manager is gone;
//! deploy/overlays/uninstall (through the test overlay deploy/test/uninstall)
//! refuses while the share lives, naming it, and once its pod is gone
//! removes every vm directory, the mirrored driver, the checkpoint, the
//! manager's sockets and the Node's inventory annotation.

use std::path::Path;
use test_support::k8s::cluster::Cluster;
use test_support::k8s::util::{tail, wait};

const STATE: &str = "/etc/gpu-manager";
const PLUGINS: &str = "/var/lib/kubelet/device-plugins";

pub fn run(c: &Cluster, overlay: &Path, live: &str, figures: &mut Vec<String>) {
    c.kubectl_ok(&["delete", "-k", overlay.to_str().unwrap(), "--wait=false"]);
    gone(c, "app.kubernetes.io/name=gpu-manager");
    // The share's running process keeps its quota; a new one is refused,
    // saying why.
    let out = c
        .kubectl_cmd(&[
            "exec",
            live,
            "--",
            "env",
            "VCUDA_REGISTER_TIMEOUT_MS=1500",
            "/work/shim_client",
            "quota",
            "64",
        ])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success()
            && text.contains("cannot register with the GPU manager")
            && text.contains("refusing CUDA"),
        "a new process under a share whose manager is gone did not fail closed saying so:\n{text}"
    );
    let vm_before = entries(&Path::new(STATE).join("vm"));
    assert!(
        !vm_before.is_empty(),
        "ds-share's vm directory before the uninstall"
    );

    let un = overlay.join("uninstall");
    c.kubectl_ok(&["apply", "-k", un.to_str().unwrap()]);
    let pod = wait("the uninstall pod", 120, || {
        let l = c.json(&[
            "-n",
            "kube-system",
            "pods",
            "-l",
            "app.kubernetes.io/name=gpu-manager-uninstall",
        ])?;
        l["items"][0]["metadata"]["name"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| "none yet".to_string())
    });
    let log = |p: &str| {
        c.kubectl(&["-n", "kube-system", "logs", p])
            .unwrap_or_default()
    };
    let refusal = wait("the uninstall refusing while a share lives", 120, || {
        let l = log(&pod);
        l.lines()
            .find(|l| l.contains("not uninstalling yet: 1 share(s) still in use"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    assert_eq!(
        entries(&Path::new(STATE).join("vm")),
        vm_before,
        "nothing is removed under a live share"
    );
    c.kubectl_ok(&["delete", "pods", "--all", "--wait=false"]);
    let t = std::time::Instant::now();
    let done = wait("the uninstall done", 120, || {
        let l = log(&pod);
        l.lines()
            .find(|l| l.contains("uninstalled: removed"))
            .map(str::to_string)
            .ok_or_else(|| tail(&l, 5))
    });
    let took = t.elapsed();
    let left: Vec<String> = ["vm", "vdriver", "checkpoint"]
        .iter()
        .map(|d| Path::new(STATE).join(d))
        .chain(node_agent::mode::device_plugin_sockets(Path::new(PLUGINS)))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?} ({done})");
    let node = c.json(&["node", &c.node]).unwrap();
    assert!(
        node["metadata"]["annotations"]
            .get(gpu_allocator::inventory::ANNOTATION)
            .is_none(),
        "the inventory annotation is still on the node ({done})"
    );
    c.kubectl_ok(&["delete", "-k", un.to_str().unwrap(), "--wait=false"]);
    gone(c, "app.kubernetes.io/name=gpu-manager-uninstall");
    eprintln!("k8s_node: uninstall: {refusal}");
    eprintln!("k8s_node: uninstall: {done}");
    figures.push(format!(
        "Uninstall: refused while a share lived (named it); {:.1} s after its pod's delete, \
         vm directories, mirrored driver, checkpoint, plugin sockets and the inventory annotation gone",
        took.as_secs_f64()
    ));
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn gone(c: &Cluster, selector: &str) {
    wait(&format!("pods {selector} gone"), 120, || {
        let l = c.json(&["-n", "kube-system", "pods", "-l", selector])?;
        let k = l["items"].as_array().map_or(0, Vec::len);
        if k == 0 {
            Ok(())
        } else {
            Err(format!("{k} pods"))
        }
    });
}
