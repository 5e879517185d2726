//! The rotation against in-memory doubles on a simulated clock; every
//! certificate is checked by webpki (rustls' verifier), not by this code.

use std::sync::Arc;
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use super::doubles::{MemoryStore, MemoryTargets};
use super::*;
use crate::certs::{Plan, PolicyError};

const T0: u64 = 1_800_000_000;

fn policy() -> Policy {
    Policy::new(
        Duration::from_secs(60),
        Duration::from_secs(20),
        Duration::from_secs(5),
    )
    .unwrap()
}

fn rotator(dir: &Path, names: &[&str]) -> (Rotator, Arc<MemoryStore>, Arc<MemoryTargets>) {
    let store = Arc::new(MemoryStore::default());
    let targets = Arc::new(MemoryTargets::default());
    struct S(Arc<MemoryStore>);
    #[async_trait::async_trait]
    impl CertStore for S {
        fn name(&self) -> String {
            self.0.name()
        }
        async fn get(&self) -> Result<Option<(SecretImage, String)>, StoreError> {
            self.0.get().await
        }
        async fn put(&self, i: &SecretImage, v: Option<&str>) -> Result<(), StoreError> {
            self.0.put(i, v).await
        }
    }
    struct B(Arc<MemoryTargets>);
    #[async_trait::async_trait]
    impl BundleTargets for B {
        async fn set(&self, b: &[u8]) -> Result<(), RotateError> {
            self.0.set(b).await
        }
    }
    let r = Rotator {
        store: Box::new(S(store.clone())),
        targets: Box::new(B(targets.clone())),
        policy: policy(),
        names: names.iter().map(|s| s.to_string()).collect(),
        cert_file: dir.join("tls.crt"),
        key_file: dir.join("tls.key"),
    };
    (r, store, targets)
}

/// Whether the served certificate (the file) chains to `bundle` for
/// `name` at `now`, as a TLS client (the API server) checks it.
fn trusted(bundle: &str, cert_file: &Path, name: &str, now: u64) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let v = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| e.to_string())?;
    let pem = std::fs::read(cert_file).map_err(|e| e.to_string())?;
    let cert = CertificateDer::from_pem_slice(&pem).map_err(|e| e.to_string())?;
    let server = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    let at = UnixTime::since_unix_epoch(Duration::from_secs(now));
    v.verify_server_cert(&cert, &[], &server, &[], at)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

#[test]
fn an_api_server_a_little_behind_always_trusts_what_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let (r, store, targets) = rotator(dir.path(), &["vcuda-webhook.kube-system.svc", "127.0.0.1"]);
    // Each second: a pass, then the served certificate checked against
    // the bundle as published now and as an API server that has not yet
    // seen the last `overlap - 1` seconds of patches holds it.
    let lag = 4usize;
    let mut published: Vec<String> = Vec::new();
    let mut cas = std::collections::BTreeSet::new();
    let mut certs = std::collections::BTreeSet::new();
    for t in 0..200 {
        let now = T0 + t;
        let due = block_on(r.sync(now)).unwrap();
        assert!(due > now, "t={t}: next pass due at {due}, not after now");
        published.push(targets.0.lock().unwrap().last().unwrap().clone());
        let stale = &published[published.len().saturating_sub(lag + 1)];
        for (what, bundle) in [("current", published.last().unwrap()), ("stale", stale)] {
            for name in ["vcuda-webhook.kube-system.svc", "127.0.0.1"] {
                trusted(bundle, &dir.path().join("tls.crt"), name, now)
                    .unwrap_or_else(|e| panic!("t={t}: {what} bundle, {name}: {e}"));
            }
        }
        let s = decode(&store.secret.lock().unwrap().as_ref().unwrap().0).unwrap();
        cas.insert(s.ca.name.clone());
        certs.insert(s.cert_pem.clone());
        // Never more than three CAs trusted at once.
        assert!(
            published
                .last()
                .unwrap()
                .matches("BEGIN CERTIFICATE")
                .count()
                <= 3
        );
    }
    // 200 s of 60 s CAs and 20 s certificates: several of each.
    assert!(cas.len() >= 4, "CAs over 200 s: {cas:?}");
    assert!(
        certs.len() >= 10,
        "certificates over 200 s: {}",
        certs.len()
    );
    // The key on disk is the certificate's.
    let key = std::fs::read_to_string(dir.path().join("tls.key")).unwrap();
    let s = decode(&store.secret.lock().unwrap().as_ref().unwrap().0).unwrap();
    assert_eq!(key, s.key_pem);
}

#[test]
fn a_name_not_in_the_certificate_is_not_trusted() {
    // The check above can fail: another host name is refused.
    let dir = tempfile::tempdir().unwrap();
    let (r, _, targets) = rotator(dir.path(), &["a.example"]);
    block_on(r.sync(T0)).unwrap();
    let bundle = targets.0.lock().unwrap().last().unwrap().clone();
    trusted(&bundle, &dir.path().join("tls.crt"), "a.example", T0).unwrap();
    let e = trusted(&bundle, &dir.path().join("tls.crt"), "b.example", T0).unwrap_err();
    assert!(
        e.contains("NotValidForName") || e.contains("not valid for name"),
        "{e}"
    );
    // And past its end, neither.
    assert!(trusted(&bundle, &dir.path().join("tls.crt"), "a.example", T0 + 3600).is_err());
}

#[test]
fn a_replica_that_loses_the_race_serves_the_winners_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (r, store, _) = rotator(dir.path(), &["w.example"]);
    let other = certs::apply(&Plan::Fresh, None, T0, &["w.example".into()], &policy()).unwrap();
    *store.interloper.lock().unwrap() = Some(encode(&other));
    block_on(r.sync(T0)).unwrap();
    let served = std::fs::read_to_string(dir.path().join("tls.crt")).unwrap();
    assert_eq!(served, other.cert_pem, "the winner's certificate is served");
    let s = decode(&store.secret.lock().unwrap().as_ref().unwrap().0).unwrap();
    assert_eq!(s, other, "the winner's Secret is kept as it wrote it");
}

#[test]
fn an_unusable_secret_is_made_anew_and_new_names_get_a_new_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (r, store, targets) = rotator(dir.path(), &["x.example"]);
    let mut junk = SecretImage::default();
    junk.data.insert("tls.crt".into(), b"not pem".to_vec());
    junk.annotation = Some("{not json".into());
    *store.secret.lock().unwrap() = Some((junk, 7));
    block_on(r.sync(T0)).unwrap();
    let bundle = targets.0.lock().unwrap().last().unwrap().clone();
    trusted(&bundle, &dir.path().join("tls.crt"), "x.example", T0).unwrap();
    let first = decode(&store.secret.lock().unwrap().as_ref().unwrap().0).unwrap();
    // Another name (the Service renamed): same CA, a new certificate.
    let (r2, _, _) = rotator(dir.path(), &["y.example"]);
    let r2 = Rotator {
        store: r.store,
        ..r2
    };
    block_on(r2.sync(T0 + 1)).unwrap();
    let second = decode(&store.secret.lock().unwrap().as_ref().unwrap().0).unwrap();
    assert_eq!(first.ca, second.ca);
    assert_ne!(first.cert_pem, second.cert_pem);
    trusted(&bundle, &dir.path().join("tls.crt"), "y.example", T0 + 1).unwrap();
}

#[test]
fn bad_settings_are_named() {
    let d = Duration::from_secs;
    assert_eq!(
        Policy::new(d(100), d(60), d(5)),
        Err(PolicyError::CertTooLong { cert: 60, ca: 100 })
    );
    assert_eq!(
        Policy::new(d(60), d(20), d(30)),
        Err(PolicyError::OverlapTooLong {
            overlap: 30,
            ca: 60
        })
    );
    assert_eq!(Policy::new(d(5), d(2), d(0)), Err(PolicyError::TooShort));
    assert_eq!(certs::parse_duration("365d"), Ok(d(365 * 86400)));
    assert_eq!(certs::parse_duration("90"), Ok(d(90)));
    assert!(
        certs::parse_duration("1w")
            .unwrap_err()
            .contains("unit 'w'")
    );
    assert!(
        certs::parse_duration("soon")
            .unwrap_err()
            .contains("not a duration")
    );
    assert_eq!(
        "validating/x".parse::<crate::kube_api::ConfigRef>(),
        Ok(crate::kube_api::ConfigRef::Validating("x".into()))
    );
    assert!(
        "pods/x"
            .parse::<crate::kube_api::ConfigRef>()
            .unwrap_err()
            .contains("validating/NAME")
    );
}
