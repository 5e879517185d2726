//! The cluster driver (`tests/k8s/cluster.sh` or `cluster-modern.sh`, kubectl), the run's paths,
//! the test pods' manifest, the test programs and the local images.

use super::util::{Flavor, IMAGE, MANAGER_IMAGE, wait};
use crate::paths::{target_dir, workspace_root};
use serde_json::Value;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct Cluster {
    pub dir: PathBuf,
    bin: PathBuf,
    pub node: String,
    pub flavor: Flavor,
    script: PathBuf,
    pub keep: bool,
}

impl Cluster {
    pub fn up(bin: PathBuf) -> Cluster {
        let flavor = Flavor::current();
        let (_, dir_var, node_var) = flavor.vars();
        let (dir, node) = flavor.defaults();
        let c = Cluster {
            dir: PathBuf::from(std::env::var(dir_var).unwrap_or_else(|_| dir.into())),
            bin,
            node: std::env::var(node_var).unwrap_or_else(|_| node.into()),
            flavor,
            script: workspace_root().join(flavor.script()),
            keep: std::env::var("VCUDA_K8S_KEEP").as_deref() == Ok("1"),
        };
        // A cluster left by an earlier run goes first: its pods and state
        // would mix with this run's.
        c.script_ok(&["down"]);
        c.script_ok(&["up"]);
        c
    }

    pub fn script(&self, args: &[&str]) -> std::process::Output {
        let (bin_var, dir_var, node_var) = self.flavor.vars();
        Command::new("bash")
            .arg(&self.script)
            .args(args)
            .env(bin_var, &self.bin)
            .env(dir_var, &self.dir)
            .env(node_var, &self.node)
            .output()
            .unwrap_or_else(|e| panic!("bash {}: {e}", self.script.display()))
    }

    pub fn script_ok(&self, args: &[&str]) -> String {
        let out = self.script(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprint!("{stderr}");
        assert!(
            out.status.success(),
            "{} {args:?} failed ({}): {stderr}",
            self.flavor.script(),
            out.status
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Another node of this cluster (`cluster.sh node-up K`, K = 2..9):
    /// its name; its containerd socket is [`Cluster::node_containerd`] and
    /// its mount namespace that of [`Cluster::node_pid`].
    pub fn node_up(&self, k: u32) -> String {
        self.script_ok(&["node-up", &k.to_string()]);
        format!("{}-{k}", self.node)
    }

    pub fn node_containerd(&self, k: u32) -> PathBuf {
        self.dir
            .join(format!("node-{k}/containerd/containerd.sock"))
    }

    /// The pid of node K's kubelet, whose mount namespace is the node's.
    pub fn node_pid(&self, k: u32) -> u32 {
        let p = self.dir.join(format!("run/node-{k}.pid"));
        fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .trim()
            .parse()
            .unwrap()
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    pub fn kubectl_cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(self.bin.join("kubectl"));
        c.arg("--kubeconfig").arg(self.kubeconfig()).args(args);
        c
    }

    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        let out = self.kubectl_cmd(args).output().expect("kubectl");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "kubectl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        self.kubectl(args).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn apply(&self, yaml: &str) {
        let mut child = self
            .kubectl_cmd(&["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(yaml.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn json(&self, args: &[&str]) -> Result<Value, String> {
        let mut a = vec!["get"];
        a.extend_from_slice(args);
        a.extend_from_slice(&["-o", "json"]);
        let s = self.kubectl(&a)?;
        serde_json::from_str(&s).map_err(|e| e.to_string())
    }

    /// The node's allocatable (vcuda-core, vcuda-memory).
    pub fn allocatable(&self) -> Result<(i64, i64), String> {
        let n = self.json(&["node", &self.node])?;
        let a = &n["status"]["allocatable"];
        let get = |k: &str| {
            a[k].as_str()
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(0)
        };
        Ok((
            get("tencent.com/vcuda-core"),
            get("tencent.com/vcuda-memory"),
        ))
    }

    pub fn wait_allocatable(&self, what: &str, want: (i64, i64), secs: u64) {
        wait(what, secs, || match self.allocatable()? {
            got if got == want => Ok(()),
            got => Err(format!("allocatable {got:?}")),
        })
    }

    pub fn pod(&self, name: &str) -> Result<Value, String> {
        self.json(&["pod", name])
    }

    pub fn wait_phase(&self, name: &str, phases: &[&str], secs: u64) -> Value {
        wait(&format!("pod {name} in {phases:?}"), secs, || {
            let p = self.pod(name)?;
            let phase = p["status"]["phase"].as_str().unwrap_or("").to_string();
            if phases.contains(&phase.as_str()) {
                Ok(p)
            } else {
                Err(format!("phase {phase:?}, status {}", p["status"]))
            }
        })
    }

    pub fn logs(&self, name: &str) -> String {
        self.kubectl(&["logs", name]).unwrap_or_default()
    }

    /// Runs a pod to completion and returns its log.
    pub fn run_pod(&self, yaml: &str, name: &str) -> String {
        self.apply(yaml);
        let p = self.wait_phase(name, &["Succeeded", "Failed"], 180);
        let log = self.logs(name);
        assert_eq!(
            p["status"]["phase"], "Succeeded",
            "pod {name} failed: {}\nlog:\n{log}",
            p["status"]
        );
        log
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.keep {
            eprintln!(
                "k8s_node: VCUDA_K8S_KEEP=1: cluster left up in {} ({} down)",
                self.dir.display(),
                self.flavor.script()
            );
            return;
        }
        let out = self.script(&["down"]);
        if !out.status.success() {
            eprintln!(
                "k8s_node: {} down: {}",
                self.flavor.script(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Paths of this run's node: the simulated root, the programs, the
/// manager's directories.
pub struct Work {
    pub sim: PathBuf,
    pub bin: PathBuf,
    pub mgr: PathBuf,
}

impl Work {
    pub fn new(dir: &Path) -> Work {
        let w = Work {
            sim: dir.join("sim"),
            bin: dir.join("work/bin"),
            mgr: dir.join("work/manager"),
        };
        fs::create_dir_all(&w.bin).unwrap();
        fs::create_dir_all(&w.mgr).unwrap();
        w
    }

    pub fn vm(&self) -> PathBuf {
        self.mgr.join("vm")
    }

    /// `gpu-sim install --host-dev` of the suite's node file into
    /// [`Work::sim`]; what it printed (the host device nodes it created).
    pub fn install_sim(&self) -> String {
        let out = std::process::Command::new(target_dir().join("gpu-sim"))
            .args(["install", "--node"])
            .arg(workspace_root().join(crate::k8s::util::NODE_FILE))
            .arg("--root")
            .arg(&self.sim)
            .arg("--host-dev")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "gpu-sim install --host-dev: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A pod of the busybox image with the host's glibc, the test programs at
/// /work and the simulated driver's state at /run/gpu-sim (where the real
/// driver's kernel module would be): `sh -c CMD` under the given limits.
pub fn pod_yaml(
    w: &Work,
    name: &str,
    cores: u32,
    mem_units: u32,
    cmd: &str,
    labels: &str,
) -> String {
    let mut limits = format!("tencent.com/vcuda-core: \"{cores}\"");
    if mem_units > 0 {
        limits.push_str(&format!(", tencent.com/vcuda-memory: \"{mem_units}\""));
    }
    let mut lib64 = String::new();
    if Path::new("/usr/lib64").exists() {
        lib64 = "        - {name: lib64, mountPath: /lib64, readOnly: true}\n".into();
    }
    let mut lib64_vol = String::new();
    if !lib64.is_empty() {
        lib64_vol = "    - {name: lib64, hostPath: {path: /usr/lib64}}\n".into();
    }
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
  labels: {{app: vcuda-k8s-test{labels}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
  containers:
    - name: main
      image: {IMAGE}
      imagePullPolicy: Never
      command: ["/bin/sh", "-c", {cmd:?}]
      resources:
        limits: {{{limits}}}
      volumeMounts:
        - {{name: glibc, mountPath: /lib/x86_64-linux-gnu, readOnly: true}}
{lib64}        - {{name: work, mountPath: /work, readOnly: true}}
        - {{name: gpu-sim, mountPath: /run/gpu-sim}}
  volumes:
    - {{name: glibc, hostPath: {{path: /usr/lib/x86_64-linux-gnu}}}}
{lib64_vol}    - {{name: work, hostPath: {{path: {bin}}}}}
    - {{name: gpu-sim, hostPath: {{path: {state}}}}}
"#,
        bin = w.bin.display(),
        state = w.sim.join("run/gpu-sim").display(),
    )
}

pub fn compile(w: &Work, src: &Path, name: &str, with_cuda: bool) {
    let mut c = Command::new("gcc");
    c.arg("-O1")
        .arg("-o")
        .arg(w.bin.join(name))
        .arg(src)
        .arg(format!("-I{}", workspace_root().join("tests/c").display()));
    if with_cuda {
        c.arg("-L")
            .arg(w.sim.join("usr/lib/x86_64-linux-gnu"))
            .arg("-lcuda");
    } else {
        c.arg("-ldl");
    }
    let st = c.status().expect("gcc");
    assert!(st.success(), "compiling {}", src.display());
}

/// A one-layer image imported into containerd's k8s.io namespace.
pub fn import_image(c: &Cluster, tag: &str, rootfs: &Path, entry: &[&str]) {
    let tar = rootfs.with_extension("tar");
    let mut args = vec![
        "image-tar",
        tag,
        rootfs.to_str().unwrap(),
        tar.to_str().unwrap(),
    ];
    args.extend_from_slice(entry);
    c.script_ok(&args);
    c.script_ok(&["import", tar.to_str().unwrap()]);
}

pub fn busybox_image(c: &Cluster, dir: &Path) {
    let root = dir.join("busybox-rootfs");
    fs::create_dir_all(root.join("bin")).unwrap();
    for d in ["tmp", "proc", "sys", "dev", "etc", "run", "usr/local"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    assert!(
        Path::new("/bin/busybox").is_file(),
        "/bin/busybox missing (apt-get install busybox-static)"
    );
    fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for a in [
        "sh", "ls", "cat", "echo", "sleep", "env", "test", "true", "grep", "head",
    ] {
        let _ = std::os::unix::fs::symlink("busybox", root.join("bin").join(a));
    }
    import_image(c, IMAGE, &root, &["/bin/sh"]);
}

/// The manager image without a registry: the workspace's gpu-manager, its
/// shared libraries (from ldd) and the interposer where the ConfigMap
/// expects it, as deploy/Dockerfile lays them out.
pub fn manager_image(c: &Cluster, dir: &Path) {
    let root = daemon_rootfs(dir, "gpu-manager");
    import_image(c, MANAGER_IMAGE, &root, &["/usr/bin/gpu-manager"]);
}

/// `<dir>/<binary>-rootfs`: the workspace's `binary` at /usr/bin, its
/// shared libraries (from ldd) and the interposer at
/// /usr/lib/vcuda/libvcuda.so, as deploy/Dockerfile lays them out.
pub fn daemon_rootfs(dir: &Path, binary: &str) -> PathBuf {
    let root = dir.join(format!("{binary}-rootfs"));
    let t = target_dir();
    for d in [
        "usr/bin",
        "usr/lib/vcuda",
        "tmp",
        "etc/gpu-manager",
        "var/run",
    ] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    fs::copy(t.join(binary), root.join("usr/bin").join(binary)).unwrap();
    fs::copy(
        t.join("libvcuda.so"),
        root.join("usr/lib/vcuda/libvcuda.so"),
    )
    .unwrap();
    let ldd = Command::new("ldd").arg(t.join(binary)).output().unwrap();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        let Some(p) = path else { continue };
        let real = fs::canonicalize(&p).unwrap();
        let dest = root.join(p.strip_prefix("/").unwrap());
        fs::create_dir_all(dest.parent().unwrap()).unwrap();
        fs::copy(&real, &dest).unwrap();
    }
    root
}
