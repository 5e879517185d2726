//! Which container runtime the manager reconciles with
//! (`--container-runtime`, `--container-runtime-endpoint`).
//!
//! `auto` (the default) takes the first runtime whose socket exists:
//! containerd, CRI-O, Docker; none when there is none. Sockets are looked
//! up at their usual paths in the manager's own file system (the DaemonSet
//! mounts the host's `/run/containerd` and `/var/run` there), not under
//! `--host-root`, as Docker's always was. A containerd that answers CRI
//! with Unimplemented (Docker's own containerd, CRI plugin disabled) is
//! passed over. `auto` with an endpoint asks it `Version` over CRI: a CRI
//! runtime if it answers, else Docker (what an endpoint alone meant before).
//!
//! A chosen runtime whose socket is missing or silent is not an error: its
//! evidence is skipped at each use (degraded, never a release), and it is
//! used as soon as it answers.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use cri_api::v1::{CONTAINERD_SOCKET, CRIO_SOCKET};

use super::{Cri, Docker, NoRuntime};
use crate::world::ContainerRuntime;
use crate::world::RuntimeError;

pub const DOCKER_SOCKET: &str = "/var/run/docker.sock";

/// The values of `--container-runtime`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Auto,
    Containerd,
    CriO,
    Docker,
    None,
}

impl Kind {
    pub const NAMES: [&str; 5] = ["auto", "containerd", "cri-o", "docker", "none"];

    pub fn parse(s: &str) -> Option<Kind> {
        Some(match s {
            "auto" => Kind::Auto,
            "containerd" => Kind::Containerd,
            "cri-o" | "crio" => Kind::CriO,
            "docker" => Kind::Docker,
            "none" => Kind::None,
            _ => return None,
        })
    }

    /// Its socket when no endpoint is given.
    pub fn default_endpoint(self) -> Option<String> {
        let p = match self {
            Kind::Containerd => CONTAINERD_SOCKET,
            Kind::CriO => CRIO_SOCKET,
            Kind::Docker => DOCKER_SOCKET,
            Kind::Auto | Kind::None => return None,
        };
        Some(format!("unix://{p}"))
    }
}

fn is_socket(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

fn socket_of(endpoint: &str) -> &Path {
    Path::new(endpoint.strip_prefix("unix://").unwrap_or(endpoint))
}

/// The backend for `kind` at `endpoint` (empty: its default), with the
/// reason for `auto`'s choice logged.
pub async fn select(kind: Kind, endpoint: &str) -> Arc<dyn ContainerRuntime> {
    let given = (!endpoint.is_empty()).then(|| endpoint.to_string());
    let rt: Arc<dyn ContainerRuntime> = match kind {
        Kind::None => Arc::new(NoRuntime),
        Kind::Docker | Kind::Containerd | Kind::CriO => {
            let ep = given
                .or_else(|| kind.default_endpoint())
                .unwrap_or_default();
            if !is_socket(socket_of(&ep)) {
                tracing::warn!(
                    runtime = ?kind, endpoint = %ep,
                    "container runtime socket missing: its evidence is skipped until it appears (nothing is released on its account)"
                );
            }
            match kind {
                Kind::Docker => Arc::new(Docker::new(&ep)),
                Kind::Containerd => Arc::new(Cri::new("containerd", &ep)),
                _ => Arc::new(Cri::new("cri-o", &ep)),
            }
        }
        Kind::Auto => match given {
            Some(ep) => probe_endpoint(&ep).await,
            None => detect(&Sockets::default()).await,
        },
    };
    tracing::info!(
        runtime = %rt.describe(), requested = ?kind,
        "container runtime for recovery and garbage collection"
    );
    rt
}

/// `auto` with an endpoint: CRI if it answers `Version`, else Docker.
async fn probe_endpoint(ep: &str) -> Arc<dyn ContainerRuntime> {
    match Cri::new("cri", ep).version().await {
        Ok((name, version)) => {
            tracing::info!(endpoint = %ep, %name, %version, "auto: the endpoint answers CRI");
            Arc::new(Cri::new(&name, ep))
        }
        Err(e) => {
            tracing::info!(endpoint = %ep, error = %e, "auto: the endpoint does not answer CRI; taking it for Docker");
            Arc::new(Docker::new(ep))
        }
    }
}

/// Where `auto` looks (tests point it at their own runtimes).
#[derive(Debug, Clone)]
pub struct Sockets {
    pub containerd: String,
    pub crio: String,
    pub docker: String,
}

impl Default for Sockets {
    fn default() -> Self {
        Sockets {
            containerd: CONTAINERD_SOCKET.into(),
            crio: CRIO_SOCKET.into(),
            docker: DOCKER_SOCKET.into(),
        }
    }
}

/// `auto` without an endpoint: the first runtime whose socket exists.
pub async fn detect(at: &Sockets) -> Arc<dyn ContainerRuntime> {
    for (name, path) in [("containerd", &at.containerd), ("cri-o", &at.crio)] {
        if !is_socket(Path::new(path)) {
            continue;
        }
        let ep = format!("unix://{path}");
        let cri = Cri::new(name, &ep);
        match cri.version().await {
            Err(RuntimeError::Unsupported { reason, .. }) => {
                tracing::info!(
                    endpoint = %ep, %reason,
                    "auto: {name}'s socket does not serve CRI (its CRI plugin is disabled, as in Docker's own containerd); passed over"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "auto: {name}'s socket exists but does not answer yet; using it")
            }
            Ok(_) => {}
        }
        if is_socket(Path::new(&at.docker)) {
            tracing::warn!(
                "auto: Docker's socket {} exists too; if kubelet drives Docker (cri-dockerd), pass --container-runtime docker",
                at.docker
            );
        }
        return Arc::new(cri);
    }
    if is_socket(Path::new(&at.docker)) {
        return Arc::new(Docker::new(&format!("unix://{}", at.docker)));
    }
    tracing::warn!(
        "auto: no container runtime socket ({}, {}, {}); reconciling with kubelet and the API server only",
        at.containerd,
        at.crio,
        at.docker
    );
    Arc::new(NoRuntime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_have_default_sockets() {
        for n in Kind::NAMES {
            assert!(Kind::parse(n).is_some(), "{n}");
        }
        assert_eq!(Kind::parse("rkt"), None);
        assert_eq!(
            Kind::Containerd.default_endpoint().as_deref(),
            Some("unix:///run/containerd/containerd.sock")
        );
        assert_eq!(
            Kind::CriO.default_endpoint().as_deref(),
            Some("unix:///var/run/crio/crio.sock")
        );
        assert_eq!(Kind::Auto.default_endpoint(), None);
    }

    #[tokio::test]
    async fn an_explicit_runtime_with_a_missing_socket_is_kept_degraded() {
        let rt = select(Kind::Containerd, "unix:///nonexistent/containerd.sock").await;
        assert_eq!(
            rt.describe(),
            "containerd (CRI) at unix:///nonexistent/containerd.sock"
        );
        let e = rt.containers().await.unwrap_err().to_string();
        assert!(e.contains("/nonexistent/containerd.sock"), "{e}");
    }

    #[tokio::test]
    async fn auto_with_an_endpoint_that_does_not_answer_cri_is_docker() {
        let rt = select(Kind::Auto, "unix:///nonexistent/docker.sock").await;
        assert_eq!(rt.describe(), "docker at unix:///nonexistent/docker.sock");
    }
}
