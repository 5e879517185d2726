//! Where the display's HTTP listeners bind. The query port serves every
//! endpoint, `/usage` and `/graph` among them (every tenant's pods and host
//! PIDs), so it is node-local unless an operator says otherwise; the probe
//! and metrics ports must be reached from outside the pod (the kubelet,
//! Prometheus) and so share an address of their own, `--metrics-addr`.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use super::{ConfigError, Options};

/// The display's HTTP listeners, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listeners {
    /// `--query-addr:--query-port`: every endpoint.
    pub query: SocketAddr,
    /// `--health-port` on `--metrics-addr`: `/healthz` and `/readyz` alone.
    pub health: Option<SocketAddr>,
    /// `--metrics-port` on `--metrics-addr`: `/metrics` alone.
    pub metrics: Option<SocketAddr>,
}

impl Listeners {
    /// From the query address and port (defaults `127.0.0.1:5678`), the
    /// probe and metrics ports, and their address (default: the query
    /// address); two listeners that would bind the same port are refused.
    pub fn resolve(o: &Options) -> Result<Listeners, ConfigError> {
        let query_addr = o
            .query_addr
            .as_deref()
            .unwrap_or(gpu_display::DEFAULT_QUERY_ADDR);
        let query_ip = ip_of("query-addr", query_addr)?;
        let query_port = o.query_port.unwrap_or(gpu_display::DEFAULT_QUERY_PORT);
        let outer = match o.metrics_addr.as_deref() {
            Some(a) if o.health_port.is_none() && o.metrics_port.is_none() => {
                return Err(ConfigError::Invalid {
                    field: "metrics-addr",
                    problem: format!(
                        "{a:?} is the address of metrics-port and health-port, and neither is set"
                    ),
                });
            }
            Some(a) => ip_of("metrics-addr", a)?,
            None => query_ip,
        };
        let at = |p: Option<u16>| p.map(|p| SocketAddr::new(outer, p));
        let l = Listeners {
            query: SocketAddr::new(query_ip, query_port),
            health: at(o.health_port),
            metrics: at(o.metrics_port),
        };
        l.distinct()?;
        Ok(l)
    }

    /// The display's options with these listeners, the rest default.
    pub fn display_options(self) -> gpu_display::DisplayOptions {
        gpu_display::DisplayOptions {
            query_addr: self.query,
            health_addr: self.health,
            metrics_addr: self.metrics,
            ..Default::default()
        }
    }

    /// No two listeners on one port of overlapping addresses (port 0 picks
    /// a free one, so never clashes).
    fn distinct(&self) -> Result<(), ConfigError> {
        let named = [
            ("query-port", Some(self.query)),
            ("health-port", self.health),
            ("metrics-port", self.metrics),
        ];
        for (i, (first, a)) in named.iter().enumerate() {
            for (field, b) in &named[i + 1..] {
                let (Some(a), Some(b)) = (a, b) else { continue };
                if a.port() != 0 && a.port() == b.port() && overlap(a.ip(), b.ip()) {
                    return Err(ConfigError::Invalid {
                        field,
                        problem: format!(
                            "{} is the {first} too ({a} and {b}); give each listener a port of its own (or leave it unset)",
                            b.port()
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

fn overlap(a: IpAddr, b: IpAddr) -> bool {
    a == b || a.is_unspecified() || b.is_unspecified()
}

/// An IP address, or the first address a host name resolves to
/// (`localhost`).
fn ip_of(field: &'static str, v: &str) -> Result<IpAddr, ConfigError> {
    if let Ok(ip) = v.parse() {
        return Ok(ip);
    }
    let invalid = |why: String| ConfigError::Invalid {
        field,
        problem: format!("{v:?} is neither an IP address nor a name this host resolves: {why}"),
    };
    (v, 0)
        .to_socket_addrs()
        .map_err(|e| invalid(e.to_string()))?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| invalid("no address".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(toml: &str) -> Result<Listeners, String> {
        Listeners::resolve(&toml::from_str(toml).unwrap()).map_err(|e| e.to_string())
    }

    #[test]
    fn the_query_port_is_local_unless_asked_and_the_rest_follows_metrics_addr() {
        let l = resolve("").unwrap();
        assert_eq!(l.query, "127.0.0.1:5678".parse().unwrap());
        assert_eq!((l.health, l.metrics), (None, None));
        // The shipped layout: the query port local, probes and metrics out.
        let l = resolve(
            "query-addr = \"127.0.0.1\"\nmetrics-addr = \"0.0.0.0\"\nmetrics-port = 5680\nhealth-port = 5679\n",
        )
        .unwrap();
        assert_eq!(l.query, "127.0.0.1:5678".parse().unwrap());
        assert_eq!(l.health, Some("0.0.0.0:5679".parse().unwrap()));
        assert_eq!(l.metrics, Some("0.0.0.0:5680".parse().unwrap()));
        // Before metrics-addr, the probe port was on the query address.
        let l = resolve("query-addr = \"0.0.0.0\"\nhealth-port = 5679\n").unwrap();
        assert_eq!(l.health, Some("0.0.0.0:5679".parse().unwrap()));
        let l = resolve("query-addr = \"localhost\"\n").unwrap();
        assert!(l.query.ip().is_loopback(), "{l:?}");
    }

    #[test]
    fn clashing_or_pointless_listeners_are_refused_by_name() {
        for (toml, field, says) in [
            ("health-port = 5678\n", "health-port:", "query-port"),
            ("metrics-port = 5678\n", "metrics-port:", "query-port"),
            (
                "metrics-addr = \"0.0.0.0\"\nmetrics-port = 5678\n",
                "metrics-port:",
                "0.0.0.0:5678",
            ),
            (
                "health-port = 6000\nmetrics-port = 6000\n",
                "metrics-port:",
                "health-port",
            ),
            (
                "metrics-addr = \"0.0.0.0\"\n",
                "metrics-addr:",
                "neither is set",
            ),
            (
                "query-addr = \"no such host.invalid\"\n",
                "query-addr:",
                "no such host",
            ),
            (
                "metrics-addr = \"300.1.1.1\"\nmetrics-port = 1\n",
                "metrics-addr:",
                "300.1.1.1",
            ),
        ] {
            let e = resolve(toml).unwrap_err();
            assert!(e.starts_with(field) && e.contains(says), "{toml}: {e}");
        }
        // Distinct addresses may share a port; port 0 picks one each.
        resolve("query-addr = \"127.0.0.1\"\nmetrics-addr = \"127.0.0.2\"\nmetrics-port = 5678\n")
            .unwrap();
        resolve("query-port = 0\nhealth-port = 0\nmetrics-port = 0\n").unwrap();
    }
}
