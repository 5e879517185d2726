//! Keeps the driver's two listening sockets open across a restart of its
//! whole container (a kill -9 of the supervisor too, an OOM kill of the
//! container): `vcuda-dra-driver hold-sockets`, a second container in the
//! driver's pod, holds copies of the listening fds. The kubelet's calls
//! made while the driver container restarts wait in the listen backlog,
//! and the new supervisor takes the same sockets back from the holder, so
//! the kubelet sees neither a refused socket nor a new registration (it
//! retries a refused NodePrepareResources only 10-15 s later).
//!
//! Protocol, one request per connection on the holder's unix socket, fds
//! passed with `SCM_RIGHTS`: `PUT <instance>` with the plugin and
//! registration listeners (the holder keeps them), `REGISTERED` (the
//! kubelet registered that instance), `GET` (answered `NONE`, or
//! `HELD <instance> <0|1 registered>` with copies of both fds), `DROP`
//! (a supervisor stopping cleanly removes its sockets: nothing to keep).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use fd_pass::{recv, send};

/// Sockets a holder kept.
#[derive(Debug)]
pub struct Held {
    pub instance: String,
    pub registered: bool,
    /// Plugin, registration.
    pub fds: [OwnedFd; 2],
}

fn request(holder: &Path, msg: &str, fds: &[RawFd]) -> io::Result<(String, Vec<OwnedFd>)> {
    let s = UnixStream::connect(holder)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    send(&s, msg.as_bytes(), fds)?;
    recv(&s)
}

fn ok(holder: &Path, what: &str, reply: &str) -> io::Result<()> {
    match reply {
        "OK" => Ok(()),
        other => Err(io::Error::other(format!(
            "socket holder {}: {what} answered {other:?}",
            holder.display()
        ))),
    }
}

/// Gives the holder the listeners of `instance`.
pub fn put(holder: &Path, instance: &str, fds: [RawFd; 2]) -> io::Result<()> {
    let (reply, _) = request(holder, &format!("PUT {instance}"), &fds)?;
    ok(holder, "PUT", &reply)
}

/// Tells the holder the kubelet registered the instance it holds.
pub fn registered(holder: &Path) -> io::Result<()> {
    let (reply, _) = request(holder, "REGISTERED", &[])?;
    ok(holder, "REGISTERED", &reply)
}

/// Tells the holder to let its sockets go.
pub fn drop_held(holder: &Path) -> io::Result<()> {
    let (reply, _) = request(holder, "DROP", &[])?;
    ok(holder, "DROP", &reply)
}

/// The sockets the holder keeps, if any.
pub fn get(holder: &Path) -> io::Result<Option<Held>> {
    let (reply, fds) = request(holder, "GET", &[])?;
    if reply == "NONE" {
        return Ok(None);
    }
    let mut words = reply.split(' ');
    match (
        words.next(),
        words.next(),
        words.next(),
        <[OwnedFd; 2]>::try_from(fds),
    ) {
        (Some("HELD"), Some(instance), Some(reg), Ok(fds)) => Ok(Some(Held {
            instance: instance.to_string(),
            registered: reg == "1",
            fds,
        })),
        (_, _, _, fds) => Err(io::Error::other(format!(
            "socket holder {}: GET answered {reply:?} with {} fds",
            holder.display(),
            fds.map_or_else(|v| v.len(), |_| 2)
        ))),
    }
}

/// The holder: serves `path` until killed.
pub fn serve(path: &Path) -> anyhow::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)
        .map_err(|e| anyhow::anyhow!("binding the socket holder at {}: {e}", path.display()))?;
    tracing::info!(socket = %path.display(), "holding the driver's sockets across its container's restarts");
    let mut held: Option<Held> = None;
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
        let Ok((msg, fds)) = recv(&s) else { continue };
        let reply = answer(&mut held, &msg, fds);
        let fds: Vec<RawFd> = match (&held, msg.as_str()) {
            (Some(h), "GET") => h.fds.iter().map(|f| f.as_raw_fd()).collect(),
            _ => Vec::new(),
        };
        if let Err(e) = send(&s, reply.as_bytes(), &fds) {
            tracing::warn!(error = %e, "answering the driver");
        }
    }
    Ok(())
}

/// What the holder does with one request.
fn answer(held: &mut Option<Held>, msg: &str, fds: Vec<OwnedFd>) -> String {
    let mut words = msg.split(' ');
    match (words.next(), words.next()) {
        (Some("PUT"), Some(instance)) => match <[OwnedFd; 2]>::try_from(fds) {
            Ok(fds) => {
                tracing::info!(instance, "holding the sockets of this instance");
                *held = Some(Held {
                    instance: instance.to_string(),
                    registered: false,
                    fds,
                });
                "OK".into()
            }
            Err(v) => format!("ERROR PUT carries {} fds, not 2", v.len()),
        },
        (Some("REGISTERED"), None) => match held {
            Some(h) => {
                h.registered = true;
                "OK".into()
            }
            None => "ERROR nothing held".into(),
        },
        (Some("DROP"), None) => {
            if let Some(h) = held.take() {
                tracing::info!(instance = %h.instance, "the driver stopped cleanly: letting its sockets go");
            }
            "OK".into()
        }
        (Some("GET"), None) => match held {
            Some(h) => {
                tracing::info!(instance = %h.instance, "handing the held sockets to a restarted driver");
                format!("HELD {} {}", h.instance, u8::from(h.registered))
            }
            None => "NONE".into(),
        },
        _ => format!("ERROR unknown request {msg:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_driver_gets_the_same_listening_sockets_back() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("holder.sock");
        let p = path.clone();
        std::thread::spawn(move || serve(&p));
        while UnixStream::connect(&path).is_err() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(get(&path).unwrap().is_none());
        let sock = tmp.path().join("plugin.sock");
        let (a, b) = (
            UnixListener::bind(&sock).unwrap(),
            UnixListener::bind(tmp.path().join("reg.sock")).unwrap(),
        );
        put(&path, "1-2-3", [a.as_raw_fd(), b.as_raw_fd()]).unwrap();
        registered(&path).unwrap();
        // The first driver dies: its own fds close, the holder's stay.
        drop((a, b));
        let client = UnixStream::connect(&sock).expect("the socket still accepts");
        let held = get(&path).unwrap().unwrap();
        assert_eq!((held.instance.as_str(), held.registered), ("1-2-3", true));
        let again = UnixListener::from(held.fds.into_iter().next().unwrap());
        let (mut conn, _) = again.accept().unwrap();
        drop(client);
        let mut b = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut conn, &mut b).unwrap(),
            0,
            "the waiting connection"
        );
        drop_held(&path).unwrap();
        assert!(get(&path).unwrap().is_none());
        let (reply, _) = request(&path, "PUT x", &[]).unwrap();
        assert!(reply.contains("0 fds"), "{reply}");
    }
}
