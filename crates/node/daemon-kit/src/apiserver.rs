//! The API server client both daemons build: from `--kubeconfig` when
//! given, else in-cluster (or `$KUBECONFIG`), with a connect timeout so a
//! dead API server is an error at start-up rather than a hang.

use std::path::Path;
use std::time::Duration;

use kube::Client;

/// Why no client could be built, naming the file or what was tried.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("reading kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no API server configuration: not in a cluster and no kubeconfig ({0}); pass --kubeconfig"
    )]
    Infer(#[source] kube::config::InferConfigError),
    #[error("building the API client: {0}")]
    Client(#[source] kube::Error),
}

/// How long to wait for the API server's TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A client for `kubeconfig`, or the inferred configuration.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, ClientError> {
    let kubeconfig_error = |p: &Path| {
        let path = p.display().to_string();
        move |source| ClientError::Kubeconfig { path, source }
    };
    let mut cfg = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p).map_err(kubeconfig_error(p))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(kubeconfig_error(p))?
        }
        None => kube::Config::infer().await.map_err(ClientError::Infer)?,
    };
    cfg.connect_timeout = Some(CONNECT_TIMEOUT);
    Client::try_from(cfg).map_err(ClientError::Client)
}

#[cfg(test)]
mod tests {
    fn error_of(r: Result<kube::Client, super::ClientError>) -> String {
        match r {
            Ok(_) => panic!("a client from a bad kubeconfig"),
            Err(e) => e.to_string(),
        }
    }

    #[tokio::test]
    async fn an_unreadable_kubeconfig_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(&path, "this: [is not a kubeconfig").unwrap();
        let err = error_of(super::client(Some(&path)).await);
        assert!(
            err.starts_with(&format!("reading kubeconfig {}:", path.display())),
            "{err}"
        );
        let missing = dir.path().join("missing");
        let err = error_of(super::client(Some(&missing)).await);
        assert!(err.contains("missing"), "{err}");
    }
}
