//! `vcuda-dra-driver uninstall`: what the DRA driver leaves on its node,
//! removed once nothing uses it (deploy/uninstall runs it on the nodes
//! labelled for DRA, after the driver's overlay was deleted).
//!
//! A stopping driver cannot tell an uninstall from an update (both are a
//! SIGTERM): it removes only its sockets and keeps the checkpoint, the
//! mirrored driver, the prepared claims' vm directories and CDI specs for
//! its successor. The kubelet deletes the node's slice 30 s after no
//! driver is registered. This mode removes the rest, but never while a
//! claim is still prepared (only a running driver can unprepare it: the
//! kubelet keeps such a pod Terminating until one does), while a share's
//! process lives, or while a driver still serves here.

use std::path::PathBuf;

use node_agent::in_use::{self, RemoveError};

use crate::checkpoint::Store;
use crate::daemon::Settings;

/// Why the node cannot be cleaned yet, each reason naming what holds it.
pub fn blockers(s: &Settings) -> Vec<String> {
    let mut out = Vec::new();
    for sock in node_agent::mode::dra_registration_sockets(&s.registry_dir) {
        if node_agent::mode::serving(&sock) {
            out.push(format!(
                "a DRA driver still serves here ({} accepts connections): delete its overlay first",
                sock.display()
            ));
        }
    }
    match Store::new(&s.state_dir).load(&s.node) {
        Ok(ck) if !ck.claims.is_empty() => {
            let names: Vec<String> = ck
                .claims
                .values()
                .map(|c| format!("{}/{} ({})", c.namespace, c.name, c.uid))
                .collect();
            out.push(format!(
                "{} claim(s) still prepared: {}; delete their pods while the driver runs (reinstall it if it is gone: only it can unprepare them)",
                names.len(),
                names.join(", ")
            ));
        }
        Ok(_) => {}
        Err(e) => out.push(format!(
            "the checkpoint cannot be read ({e}); look at it, or remove it by hand"
        )),
    }
    out.extend(node_agent::in_use::shares_in_use(&s.vm_dir));
    out
}

/// The host paths the driver created, removed when present; returns what
/// was removed. The kubelet's and CDI's directories stay: only the
/// driver's files in them go.
pub fn remove_state(s: &Settings) -> Result<Vec<PathBuf>, RemoveError> {
    let mut targets = vec![
        s.vm_dir.clone(),
        s.vdriver_dir.clone(),
        s.state_dir.clone(),
        s.plugins_dir.join(crate::DRIVER_NAME),
    ];
    targets.extend(node_agent::mode::dra_registration_sockets(&s.registry_dir));
    let prefix = format!("{}-", crate::DRIVER_NAME);
    targets.extend(
        std::fs::read_dir(&s.cdi_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .map(|n| n.to_string_lossy())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".json"))
            }),
    );
    node_agent::in_use::remove_paths(targets)
}

/// Runs the mode: waits (checking every `retry`) until nothing blocks,
/// removes the state and the node's ResourceSlice, then says what it did.
/// Cancelled first: `None`.
pub async fn run(
    s: &Settings,
    retry: std::time::Duration,
    cancel: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Option<String>> {
    let name = crate::slices::slice_name(&s.node);
    let forget = async {
        match daemon_kit::apiserver::client(s.kubeconfig.as_deref()).await {
            Ok(c) => {
                let api = crate::kube_api::KubeApi { client: c };
                match crate::publish::SliceApi::delete(&api, &name).await {
                    Ok(()) => format!("ResourceSlice {name} deleted"),
                    Err(e) => format!("ResourceSlice {name} left: {e}"),
                }
            }
            Err(e) => format!("ResourceSlice {name} left (no API server: {e})"),
        }
    };
    let done = in_use::uninstall(|| blockers(s), || remove_state(s), forget, retry, cancel).await?;
    Ok(done.map(|d| {
        format!(
            "uninstalled: removed {:?}; node {}: {}",
            d.removed, s.node, d.cluster
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn settings(root: &Path) -> Settings {
        let p = |s: &str| root.join(s);
        crate::cli::resolve(crate::cli::Args {
            node_name: Some("n1".into()),
            host_root: Some(p("host")),
            vm_dir: Some(p("etc/vm")),
            vdriver_dir: Some(p("etc/vdriver")),
            cdi_dir: Some(p("cdi")),
            state_dir: Some(p("plugins/vcuda.tencent.com")),
            plugins_dir: Some(p("plugins")),
            registry_dir: Some(p("plugins_registry")),
            display_socket: Some("none".into()),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn blocked_by_a_serving_driver_and_a_prepared_claim_then_everything_goes() {
        let d = tempfile::tempdir().unwrap();
        let s = settings(d.path());
        for dir in [
            "etc/vm/uid-1/gpu",
            "etc/vdriver/nvidia",
            "cdi",
            "plugins_registry",
        ] {
            std::fs::create_dir_all(d.path().join(dir)).unwrap();
        }
        let other_cdi = d.path().join("cdi/nvidia.com-gpu.json");
        std::fs::write(&other_cdi, "{}").unwrap();
        std::fs::write(d.path().join("cdi/vcuda.tencent.com-uid-1.json"), "{}").unwrap();
        let other_reg = d.path().join("plugins_registry/gpu.nvidia.com-reg.sock");
        std::fs::write(&other_reg, "").unwrap();
        let store = Store::new(&s.state_dir);
        let mut ck = store.load("n1").unwrap();
        ck.claims.insert(
            "uid-1".into(),
            crate::checkpoint::PreparedClaim {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "uid-1".into(),
                devices: vec![],
                prepared_at: 0,
            },
        );
        store.save(&ck).unwrap();
        let sockets = crate::grpc::Sockets::new(&s.plugins_dir, &s.registry_dir);
        let live = crate::grpc::bind_std(&sockets.registration).unwrap();
        let b = blockers(&s);
        assert_eq!(b.len(), 2, "{b:?}");
        assert!(b[0].contains("still serves here"), "{}", b[0]);
        assert!(b[1].contains("ns/c (uid-1)"), "{}", b[1]);

        drop(live); // the driver gone; its socket file stays
        ck.claims.clear();
        store.save(&ck).unwrap();
        assert_eq!(blockers(&s), Vec::<String>::new());
        let removed = remove_state(&s).unwrap();
        for gone in [
            "etc/vm",
            "etc/vdriver",
            "plugins/vcuda.tencent.com",
            "cdi/vcuda.tencent.com-uid-1.json",
        ] {
            assert!(!d.path().join(gone).exists(), "{gone} left");
            assert!(
                removed.contains(&d.path().join(gone)),
                "{gone} not reported"
            );
        }
        assert!(!sockets.registration.exists());
        // Other drivers' files and the shared directories stay.
        assert!(other_cdi.exists() && other_reg.exists());
        assert!(d.path().join("cdi").is_dir() && d.path().join("plugins").is_dir());
    }
}
