//! What the tests against the real `kube` client share.

use apiserver_emulator::ApiServer;
use kube::Client;

/// A `kube` client for `server`, configured from the kubeconfig it writes.
pub async fn client(server: &ApiServer) -> Client {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    server.write_kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    Client::try_from(cfg).unwrap()
}
