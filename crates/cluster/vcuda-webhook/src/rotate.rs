//! Keeps the self-managed certificates ([`crate::certs`]) where they are
//! used: in a Secret (shared by the replicas: the one that changes it first
//! wins, the others read what it wrote), in the files the TLS listener
//! serves (it reads them again when they change), and in the `caBundle` of
//! every webhook of the named configurations.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::certs::{self, Ca, Plan, Policy, Stored, Trusted};

/// The Secret's annotation holding what the PEM files do not say.
pub const ANNOTATION: &str = "vcuda.io/webhook-certificates";

/// A Secret's data and [`ANNOTATION`] as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretImage {
    pub data: BTreeMap<String, Vec<u8>>,
    pub annotation: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Someone else wrote it since it was read: read again.
    #[error("changed since it was read")]
    Conflict,
    #[error("{0}")]
    Api(String),
}

/// The Secret: `get` answers its image and version (none: absent).
#[async_trait::async_trait]
pub trait CertStore: Send + Sync {
    fn name(&self) -> String;
    async fn get(&self) -> Result<Option<(SecretImage, String)>, StoreError>;
    /// Creates it (`version` None) or replaces that version.
    async fn put(&self, image: &SecretImage, version: Option<&str>) -> Result<(), StoreError>;
}

/// The webhook configurations whose `caBundle` is kept.
#[async_trait::async_trait]
pub trait BundleTargets: Send + Sync {
    /// Sets `bundle` (PEM) on every webhook of every configuration.
    async fn set(&self, bundle: &[u8]) -> Result<(), RotateError>;
}

#[derive(Debug, thiserror::Error)]
pub enum RotateError {
    #[error("Secret {secret}: {source}")]
    Store {
        secret: String,
        #[source]
        source: StoreError,
    },
    #[error("Secret {secret} changed under each of 5 attempts")]
    Contended { secret: String },
    #[error(transparent)]
    Issue(#[from] certs::IssueError),
    #[error("writing {}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{kind} {name}: {problem}")]
    Target {
        kind: &'static str,
        name: String,
        problem: String,
    },
}

#[derive(Serialize, Deserialize)]
struct Meta {
    ca_name: String,
    ca_not_after: u64,
    next_ca_name: Option<String>,
    next_ca_not_after: Option<u64>,
    next_ca_staged_at: Option<u64>,
    previous_ca_not_after: Option<u64>,
    cert_not_after: u64,
    cert_names: Vec<String>,
}

/// Keys of the Secret's data (`ca.crt` is the bundle, for any reader).
const CA: &str = "ca-current.crt";
const CA_KEY: &str = "ca-current.key";
const NEXT: &str = "ca-next.crt";
const NEXT_KEY: &str = "ca-next.key";
const PREVIOUS: &str = "ca-previous.crt";

pub fn encode(s: &Stored) -> SecretImage {
    let mut data = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        data.insert(k.to_string(), v.as_bytes().to_vec());
    };
    put("ca.crt", &s.bundle());
    put("tls.crt", &s.cert_pem);
    put("tls.key", &s.key_pem);
    put(CA, &s.ca.cert_pem);
    put(CA_KEY, &s.ca.key_pem);
    if let Some((n, _)) = &s.next {
        put(NEXT, &n.cert_pem);
        put(NEXT_KEY, &n.key_pem);
    }
    if let Some(p) = &s.previous {
        put(PREVIOUS, &p.cert_pem);
    }
    let meta = Meta {
        ca_name: s.ca.name.clone(),
        ca_not_after: s.ca.not_after,
        next_ca_name: s.next.as_ref().map(|(n, _)| n.name.clone()),
        next_ca_not_after: s.next.as_ref().map(|(n, _)| n.not_after),
        next_ca_staged_at: s.next.as_ref().map(|(_, at)| *at),
        previous_ca_not_after: s.previous.as_ref().map(|p| p.not_after),
        cert_not_after: s.cert_not_after,
        cert_names: s.cert_names.clone(),
    };
    SecretImage {
        data,
        annotation: Some(serde_json::to_string(&meta).expect("plain struct")),
    }
}

/// The stored state, or why it cannot be used (it is then made anew).
pub fn decode(img: &SecretImage) -> Result<Stored, String> {
    let text = img
        .annotation
        .as_deref()
        .ok_or(format!("no {ANNOTATION} annotation"))?;
    let m: Meta = serde_json::from_str(text).map_err(|e| format!("{ANNOTATION}: {e}"))?;
    let get = |k: &str| -> Result<String, String> {
        let v = img.data.get(k).ok_or(format!("no {k}"))?;
        String::from_utf8(v.clone()).map_err(|_| format!("{k} is not PEM text"))
    };
    let next = match (m.next_ca_name, m.next_ca_not_after, m.next_ca_staged_at) {
        (Some(name), Some(not_after), Some(at)) => Some((
            Ca {
                name,
                cert_pem: get(NEXT)?,
                key_pem: get(NEXT_KEY)?,
                not_after,
            },
            at,
        )),
        _ => None,
    };
    let previous = match m.previous_ca_not_after {
        Some(not_after) => Some(Trusted {
            cert_pem: get(PREVIOUS)?,
            not_after,
        }),
        None => None,
    };
    Ok(Stored {
        ca: Ca {
            name: m.ca_name,
            cert_pem: get(CA)?,
            key_pem: get(CA_KEY)?,
            not_after: m.ca_not_after,
        },
        next,
        previous,
        cert_pem: get("tls.crt")?,
        key_pem: get("tls.key")?,
        cert_not_after: m.cert_not_after,
        cert_names: m.cert_names,
    })
}

/// One replica's rotation: the Secret, its files, the configurations.
pub struct Rotator {
    pub store: Box<dyn CertStore>,
    pub targets: Box<dyn BundleTargets>,
    pub policy: Policy,
    /// DNS names and IP addresses of the serving certificate.
    pub names: Vec<String>,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Rotator {
    /// Brings the Secret up to date for `now` (creating it, renewing what
    /// is due) and answers what it holds.
    async fn settle(&self, now: u64) -> Result<Stored, RotateError> {
        let secret = self.store.name();
        let err = |source| RotateError::Store {
            secret: secret.clone(),
            source,
        };
        for _ in 0..5 {
            let got = self.store.get().await.map_err(err)?;
            let (stored, version) = match &got {
                None => (None, None),
                Some((img, v)) => match decode(img) {
                    Ok(s) => (Some(s), Some(v.as_str())),
                    Err(why) => {
                        if !img.data.is_empty() {
                            tracing::warn!(
                                secret,
                                why,
                                "stored certificates unusable: making new ones"
                            );
                        }
                        (None, Some(v.as_str()))
                    }
                },
            };
            let plan = certs::plan(now, stored.as_ref(), &self.names, &self.policy);
            if plan == Plan::Keep
                && let Some(s) = stored
            {
                return Ok(s);
            }
            let next = certs::apply(&plan, stored, now, &self.names, &self.policy)?;
            match self.store.put(&encode(&next), version).await {
                Ok(()) => {
                    tracing::info!(
                        secret,
                        ?plan,
                        ca = next.ca.name,
                        cert_not_after = next.cert_not_after,
                        "webhook certificates updated"
                    );
                    return Ok(next);
                }
                Err(StoreError::Conflict) => continue,
                Err(e) => return Err(err(e)),
            }
        }
        Err(RotateError::Contended { secret })
    }

    /// One pass: the Secret settled, the files and the bundle made to
    /// match it. Answers when the next pass is due (Unix seconds).
    pub async fn sync(&self, now: u64) -> Result<u64, RotateError> {
        let s = self.settle(now).await?;
        // Key before certificate: the listener keeps its pair until both
        // read as one, and a certificate is what it watches first.
        write_if_changed(&self.key_file, s.key_pem.as_bytes())?;
        write_if_changed(&self.cert_file, s.cert_pem.as_bytes())?;
        self.targets.set(s.bundle().as_bytes()).await?;
        Ok(s.next_due(&self.policy))
    }

    /// Passes until cancelled: when one is due, and at least every
    /// `recheck` (another replica may have rotated, or someone edited a
    /// configuration); a failed pass is retried after 5 s.
    pub async fn run(self, recheck: Duration, cancel: CancellationToken) {
        loop {
            let now = unix_now();
            let wait = match self.sync(now).await {
                Ok(due) => Duration::from_secs(due.saturating_sub(now).max(1)).min(recheck),
                Err(e) => {
                    tracing::warn!(error = %e, "webhook certificates: retrying in 5 s");
                    Duration::from_secs(5)
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// Writes `bytes` to `path` through a rename, unless it holds them already.
fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<(), RotateError> {
    if std::fs::read(path).is_ok_and(|b| b == bytes) {
        return Ok(());
    }
    let err = |source| RotateError::File {
        path: path.to_path_buf(),
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
pub mod doubles {
    use std::sync::Mutex;

    use super::*;

    /// A Secret in memory; `interloper` is written over it once, between
    /// the next get and put (another replica rotating first).
    #[derive(Default)]
    pub struct MemoryStore {
        pub secret: Mutex<Option<(SecretImage, u64)>>,
        pub interloper: Mutex<Option<SecretImage>>,
    }

    #[async_trait::async_trait]
    impl CertStore for MemoryStore {
        fn name(&self) -> String {
            "test/webhook-tls".into()
        }
        async fn get(&self) -> Result<Option<(SecretImage, String)>, StoreError> {
            let got = self.secret.lock().unwrap().clone();
            if let Some(img) = self.interloper.lock().unwrap().take() {
                let mut s = self.secret.lock().unwrap();
                let v = s.as_ref().map_or(0, |(_, v)| v + 1);
                *s = Some((img, v));
            }
            Ok(got.map(|(i, v)| (i, v.to_string())))
        }
        async fn put(&self, image: &SecretImage, version: Option<&str>) -> Result<(), StoreError> {
            let mut s = self.secret.lock().unwrap();
            let now = s.as_ref().map(|(_, v)| v.to_string());
            if now.as_deref() != version {
                return Err(StoreError::Conflict);
            }
            let v = s.as_ref().map_or(0, |(_, v)| v + 1);
            *s = Some((image.clone(), v));
            Ok(())
        }
    }

    #[derive(Default)]
    pub struct MemoryTargets(pub Mutex<Vec<String>>);

    #[async_trait::async_trait]
    impl BundleTargets for MemoryTargets {
        async fn set(&self, bundle: &[u8]) -> Result<(), RotateError> {
            let b = String::from_utf8(bundle.to_vec()).unwrap();
            let mut v = self.0.lock().unwrap();
            if v.last() != Some(&b) {
                v.push(b);
            }
            Ok(())
        }
    }
}
