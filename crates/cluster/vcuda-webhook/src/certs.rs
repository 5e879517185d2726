//! The webhook's own CA and serving certificate (`--self-managed`). The
//! API server trusts whatever `caBundle` the webhook configurations carry,
//! so the webhook keeps a CA in a Secret, signs its serving certificate with
//! it and patches the CA into the configurations ([`crate::rotate`]).
//!
//! A CA is never swapped in one step: when a third of its validity is
//! left the next CA is *staged* (added to the bundle while the old one
//! still signs), and only after [`Policy::overlap`] — time for every API
//! server to read the patched configurations — does it sign the serving
//! certificate. The old CA stays in the bundle until it expires, so a
//! replica still serving a certificate of the old CA is trusted too. The
//! serving certificate is renewed when a third of its validity is left.
//!
//! [`plan`] decides (pure, over the stored state and the clock); [`apply`]
//! makes the keys.

use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// How long certificates live; when they are renewed follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub ca_validity: Duration,
    pub cert_validity: Duration,
    /// How long a staged CA is in the bundle before it signs.
    pub overlap: Duration,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "--cert-validity {cert}s must be at most half of --ca-validity {ca}s \
         (a certificate is renewed with a third of its life left, and never outlives its CA)"
    )]
    CertTooLong { cert: u64, ca: u64 },
    #[error(
        "--ca-overlap {overlap}s must be at most a sixth of --ca-validity {ca}s \
         (the next CA is staged with a third of the current one's life left)"
    )]
    OverlapTooLong { overlap: u64, ca: u64 },
    #[error("--ca-validity and --cert-validity must be at least 6 s")]
    TooShort,
}

impl Policy {
    pub fn new(ca: Duration, cert: Duration, overlap: Duration) -> Result<Policy, PolicyError> {
        if ca.as_secs() < 6 || cert.as_secs() < 6 {
            return Err(PolicyError::TooShort);
        }
        if cert > ca / 2 {
            return Err(PolicyError::CertTooLong {
                cert: cert.as_secs(),
                ca: ca.as_secs(),
            });
        }
        if overlap > ca / 6 {
            return Err(PolicyError::OverlapTooLong {
                overlap: overlap.as_secs(),
                ca: ca.as_secs(),
            });
        }
        Ok(Policy {
            ca_validity: ca,
            cert_validity: cert,
            overlap,
        })
    }

    fn ca_renew_left(&self) -> u64 {
        self.ca_validity.as_secs() / 3
    }

    fn cert_renew_left(&self) -> u64 {
        self.cert_validity.as_secs() / 3
    }
}

/// A CA: its certificate and key (PEM), its name and end (Unix seconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ca {
    pub name: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: u64,
}

/// A CA kept only to be trusted (its key is gone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trusted {
    pub cert_pem: String,
    pub not_after: u64,
}

/// Everything the Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Signs the serving certificate.
    pub ca: Ca,
    /// Staged: in the bundle, signing from `staged_at + overlap`.
    pub next: Option<(Ca, u64)>,
    /// The CA before `ca`, trusted until it expires.
    pub previous: Option<Trusted>,
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_not_after: u64,
    /// The names (DNS or IP) the certificate is for.
    pub cert_names: Vec<String>,
}

impl Stored {
    /// The PEM bundle the configurations' `caBundle` gets: every CA a
    /// serving certificate may chain to now or soon.
    pub fn bundle(&self) -> String {
        let mut b = self.ca.cert_pem.clone();
        if let Some((n, _)) = &self.next {
            b.push_str(&n.cert_pem);
        }
        if let Some(p) = &self.previous {
            b.push_str(&p.cert_pem);
        }
        b
    }

    /// When [`plan`] next has something to do (Unix seconds).
    pub fn next_due(&self, p: &Policy) -> u64 {
        let mut due = self.cert_not_after.saturating_sub(p.cert_renew_left());
        match &self.next {
            Some((_, staged)) => due = due.min(staged + p.overlap.as_secs()),
            None => due = due.min(self.ca.not_after.saturating_sub(p.ca_renew_left())),
        }
        if let Some(prev) = &self.previous {
            due = due.min(prev.not_after);
        }
        due
    }
}

/// What the stored state needs, by the clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Keep,
    /// Nothing usable stored: a CA and a certificate, both new.
    Fresh,
    /// The CA is a third from its end: make the next one, trusted only.
    StageCa,
    /// The staged CA has been trusted long enough: it signs a new
    /// certificate, the current one becomes the previous.
    PromoteCa,
    /// The certificate is a third from its end or names other hosts.
    NewCert,
    /// The previous CA expired: out of the bundle.
    DropPrevious,
}

/// What `stored` needs at `now` for a certificate naming `names`.
pub fn plan(now: u64, stored: Option<&Stored>, names: &[String], p: &Policy) -> Plan {
    let Some(s) = stored else { return Plan::Fresh };
    if s.ca.not_after <= now {
        // Expired (the webhook was down past its CA's end): nothing it
        // signs is trusted any more, start over.
        return Plan::Fresh;
    }
    match &s.next {
        Some((_, staged)) if now >= staged + p.overlap.as_secs() => return Plan::PromoteCa,
        None if s.ca.not_after <= now + p.ca_renew_left() => return Plan::StageCa,
        _ => {}
    }
    if s.cert_not_after <= now + p.cert_renew_left() || s.cert_names != names {
        return Plan::NewCert;
    }
    if s.previous
        .as_ref()
        .is_some_and(|prev| prev.not_after <= now)
    {
        return Plan::DropPrevious;
    }
    Plan::Keep
}

/// Making a key or signing failed (rcgen).
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct IssueError {
    what: &'static str,
    #[source]
    source: rcgen::Error,
}

fn e(what: &'static str) -> impl FnOnce(rcgen::Error) -> IssueError {
    move |source| IssueError { what, source }
}

/// Not-before is set this far back: API servers whose clocks run behind.
const BACKDATE: u64 = 300;

fn offset(unix: u64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp(unix as i64)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}

fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

fn new_ca(now: u64, p: &Policy) -> Result<Ca, IssueError> {
    let key = KeyPair::generate().map_err(e("making a CA key"))?;
    // The start second names it: two CAs of one webhook never share a name.
    let name = format!("vcuda-webhook CA {now}");
    let not_after = now + p.ca_validity.as_secs();
    let mut params = ca_params(&name);
    params.not_before = offset(now.saturating_sub(BACKDATE));
    params.not_after = offset(not_after);
    let cert = params.self_signed(&key).map_err(e("signing the CA"))?;
    Ok(Ca {
        name,
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
        not_after,
    })
}

/// A serving certificate for `names` signed by `ca`, never outliving it:
/// (certificate, key, end).
fn new_cert(
    now: u64,
    ca: &Ca,
    names: &[String],
    p: &Policy,
) -> Result<(String, String, u64), IssueError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(e("reading the CA key"))?;
    let ca_params = ca_params(&ca.name);
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let key = KeyPair::generate().map_err(e("making the serving key"))?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().map(String::as_str).unwrap_or("vcuda-webhook"),
    );
    params.distinguished_name = dn;
    params.subject_alt_names = names
        .iter()
        .map(|n| match n.parse() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => n.clone().try_into().map(SanType::DnsName),
        })
        .collect::<Result<_, _>>()
        .map_err(e("a certificate name"))?;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let not_after = (now + p.cert_validity.as_secs()).min(ca.not_after);
    params.not_before = offset(now.saturating_sub(BACKDATE));
    params.not_after = offset(not_after);
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(e("signing the serving certificate"))?;
    Ok((cert.pem(), key.serialize_pem(), not_after))
}

/// The state after `plan` (made with new keys where it needs them;
/// nothing stored is made anew whatever the plan).
pub fn apply(
    plan: &Plan,
    stored: Option<Stored>,
    now: u64,
    names: &[String],
    p: &Policy,
) -> Result<Stored, IssueError> {
    let mut s = match (plan, stored) {
        (Plan::Fresh, _) | (_, None) => {
            let ca = new_ca(now, p)?;
            let (cert_pem, key_pem, cert_not_after) = new_cert(now, &ca, names, p)?;
            return Ok(Stored {
                ca,
                next: None,
                previous: None,
                cert_pem,
                key_pem,
                cert_not_after,
                cert_names: names.to_vec(),
            });
        }
        (_, Some(s)) => s,
    };
    match plan {
        Plan::StageCa => s.next = Some((new_ca(now, p)?, now)),
        Plan::PromoteCa => {
            if let Some((next, _)) = s.next.take() {
                let old = std::mem::replace(&mut s.ca, next);
                s.previous = Some(Trusted {
                    cert_pem: old.cert_pem,
                    not_after: old.not_after,
                });
                renew(&mut s, now, names, p)?;
            }
        }
        Plan::NewCert => renew(&mut s, now, names, p)?,
        Plan::DropPrevious => s.previous = None,
        Plan::Keep | Plan::Fresh => {}
    }
    Ok(s)
}

fn renew(s: &mut Stored, now: u64, names: &[String], p: &Policy) -> Result<(), IssueError> {
    let (cert_pem, key_pem, end) = new_cert(now, &s.ca, names, p)?;
    s.cert_pem = cert_pem;
    s.key_pem = key_pem;
    s.cert_not_after = end;
    s.cert_names = names.to_vec();
    Ok(())
}

/// `90s`, `10m`, `12h`, `365d` (or plain seconds): a duration flag.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (a number and s, m, h or d: 90s, 365d)"))?;
    let mult = match unit {
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("'{s}': unit '{unit}' is not one of s, m, h, d")),
    };
    Ok(Duration::from_secs(n * mult))
}
