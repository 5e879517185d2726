//! Framed messages over a unix stream socket with a file descriptor riding
//! along (SCM_RIGHTS): how the manager hands the ledger to a registering
//! process. A frame is a 4-byte big-endian length and that many bytes (the
//! registration protocol's framing); the descriptors (one ledger per GPU of
//! the container) are attached to the frame's first byte, in order.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

/// Most descriptors one frame carries (a container's ledgers: at most one
/// per GPU of its share, `quota_config::MAX_GPUS`).
pub const MAX_FDS: usize = fd_pass::MAX_FDS;

/// Sends `body` as one frame, with `fd` attached when given.
pub fn send_frame(sock: BorrowedFd<'_>, body: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    send_frame_fds(sock, body, fd.as_slice())
}

/// Sends `body` as one frame with `fds` attached, in order (at most
/// [`MAX_FDS`]).
pub fn send_frame_fds(sock: BorrowedFd<'_>, body: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut out = Outgoing::new(body, fds);
    out.send(sock)
}

/// A frame being sent, resumable where a non-blocking socket stopped it: a
/// `WouldBlock` leaves what was written written, so the next
/// [`Outgoing::send`] goes on from there (starting the frame over would put
/// a second header inside its body).
pub struct Outgoing {
    buf: Vec<u8>,
    fds: Vec<i32>,
    off: usize,
}

impl Outgoing {
    /// `body` framed, with `fds` to ride on its first byte.
    pub fn new(body: &[u8], fds: &[BorrowedFd<'_>]) -> Outgoing {
        let mut buf = Vec::with_capacity(4 + body.len());
        buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
        buf.extend_from_slice(body);
        let fds = fds.iter().map(|f| f.as_raw_fd()).collect();
        Outgoing { buf, fds, off: 0 }
    }

    /// Writes what is left of the frame; the descriptors go with the first
    /// write that takes any bytes.
    pub fn send(&mut self, sock: BorrowedFd<'_>) -> io::Result<()> {
        while self.off < self.buf.len() {
            self.off += fd_pass::sendmsg_fds(sock, &self.buf[self.off..], &self.fds)?;
            self.fds.clear();
        }
        Ok(())
    }
}

/// Receives one frame of at most `max` bytes and the descriptor passed with
/// it, if any (received close-on-exec). EOF before a whole frame is
/// `UnexpectedEof`.
pub fn recv_frame(sock: BorrowedFd<'_>, max: usize) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let (body, fds) = recv_frame_fds(sock, max)?;
    // Keep the first; extra descriptors are closed on drop.
    Ok((body, fds.into_iter().next()))
}

/// Receives one frame of at most `max` bytes and every descriptor passed
/// with it, in order (received close-on-exec).
pub fn recv_frame_fds(sock: BorrowedFd<'_>, max: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut got: Vec<OwnedFd> = Vec::new();
    let mut head = [0u8; 4];
    recv_exact(sock, &mut head, &mut got)?;
    let len = u32::from_be_bytes(head) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds {max}"),
        ));
    }
    let mut body = vec![0u8; len];
    recv_exact(sock, &mut body, &mut got)?;
    Ok((body, got))
}

fn recv_exact(sock: BorrowedFd<'_>, buf: &mut [u8], got: &mut Vec<OwnedFd>) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match fd_pass::recvmsg_fds(sock, &mut buf[off..], got)? {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed mid-frame",
                ));
            }
            n => off += n,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn frame_with_descriptor_round_trip() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"ledger").unwrap();
        send_frame(a.as_fd(), b"hello", Some(f.as_fd())).unwrap();
        send_frame(a.as_fd(), b"", None).unwrap();
        let (body, fd) = recv_frame(b.as_fd(), 1024).unwrap();
        assert_eq!(body, b"hello");
        let mut got = std::fs::File::from(fd.expect("descriptor passed"));
        got.rewind().unwrap();
        let mut s = String::new();
        got.read_to_string(&mut s).unwrap();
        assert_eq!(s, "ledger");
        let (body, fd) = recv_frame(b.as_fd(), 1024).unwrap();
        assert!(body.is_empty() && fd.is_none());
        drop(a);
        let e = recv_frame(b.as_fd(), 1024).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn frame_with_several_descriptors_keeps_their_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let files: Vec<std::fs::File> = (0..MAX_FDS)
            .map(|i| {
                let mut f = tempfile::tempfile().unwrap();
                write!(f, "ledger.{i}").unwrap();
                f
            })
            .collect();
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        send_frame_fds(a.as_fd(), b"multi", &fds).unwrap();
        let (body, got) = recv_frame_fds(b.as_fd(), 1024).unwrap();
        assert_eq!(body, b"multi");
        assert_eq!(got.len(), MAX_FDS);
        for (i, fd) in got.into_iter().enumerate() {
            let mut f = std::fs::File::from(fd);
            f.rewind().unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("ledger.{i}"));
        }
        let too_many: Vec<BorrowedFd<'_>> = (0..=MAX_FDS).map(|_| files[0].as_fd()).collect();
        let e = send_frame_fds(a.as_fd(), b"x", &too_many).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn oversize_frame_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(a.as_fd(), &[0u8; 100], None).unwrap();
        let e = recv_frame(b.as_fd(), 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
