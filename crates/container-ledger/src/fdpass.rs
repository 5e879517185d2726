//! Framed messages over a unix stream socket with a file descriptor riding
//! along (SCM_RIGHTS): how the manager hands the ledger to a registering
//! process. A frame is a 4-byte big-endian length and that many bytes (the
//! registration protocol's framing); the descriptors (one ledger per GPU of
//! the container) are attached to the frame's first byte, in order.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Most descriptors one frame carries (a container's ledgers: at most one
/// per GPU of its share, `quota_config::MAX_GPUS`).
pub const MAX_FDS: usize = 64;
/// Control buffer for [`MAX_FDS`] descriptors, in u64 words (8-aligned):
/// CMSG_SPACE(64 × 4) = 16 + 256 bytes.
const CMSG_WORDS: usize = (16 + MAX_FDS * 4) / 8 + 2;

/// Sends `body` as one frame, with `fd` attached when given.
pub fn send_frame(sock: BorrowedFd<'_>, body: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    send_frame_fds(sock, body, fd.as_slice())
}

/// Sends `body` as one frame with `fds` attached, in order (at most
/// [`MAX_FDS`]).
pub fn send_frame_fds(sock: BorrowedFd<'_>, body: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors on one frame; at most {MAX_FDS}", fds.len()),
        ));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    let mut off = 0;
    // Only the first sendmsg carries the descriptors.
    let mut pass: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    while off < buf.len() {
        let mut iov = libc::iovec {
            iov_base: buf[off..].as_ptr() as *mut libc::c_void,
            iov_len: buf.len() - off,
        };
        let mut cmsg_buf = [0u64; CMSG_WORDS];
        // SAFETY: `msghdr` is integers and raw pointers: all-zero is valid
        // (NULL name/control, empty lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !pass.is_empty() {
            let data = (pass.len() * 4) as u32;
            // SAFETY: pure arithmetic on a length, no memory touched.
            let space = unsafe { libc::CMSG_SPACE(data) } as usize;
            msg.msg_control = cmsg_buf.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: `msg_control` is `cmsg_buf` (8-aligned, live for the
            // loop body, CMSG_WORDS × 8 bytes) and `msg_controllen` =
            // CMSG_SPACE(4 × n) with n ≤ MAX_FDS fits in it, so CMSG_FIRSTHDR
            // is non-NULL and the header plus the n descriptors lie inside.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(data) as _;
                for (i, raw) in pass.iter().enumerate() {
                    (libc::CMSG_DATA(c) as *mut i32)
                        .add(i)
                        .write_unaligned(*raw);
                }
            }
        }
        // SAFETY: `msg` points at `iov` (inside `buf`, live) and at `cmsg_buf`
        // when a descriptor rides along; the kernel only reads them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        pass.clear();
        off += n as usize;
    }
    Ok(())
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
        let mut iov = libc::iovec {
            iov_base: buf[off..].as_mut_ptr().cast(),
            iov_len: buf.len() - off,
        };
        let mut cmsg_buf = [0u64; CMSG_WORDS];
        // SAFETY: `msghdr` is integers and raw pointers: all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_buf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cmsg_buf) as _;
        // SAFETY: `msg` points at `iov` (the unfilled tail of `buf`) and at
        // `cmsg_buf` with their true lengths; the kernel writes within them.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: the CMSG_* walk stays within `cmsg_buf` as the kernel
        // filled it (`msg_controllen` was set by recvmsg; CMSG_NXTHDR returns
        // NULL past the end); each SCM_RIGHTS entry's `cmsg_len` bounds its
        // data, read unaligned. Descriptors received with SCM_RIGHTS are new
        // ones the kernel installed for us, so each is owned exactly once.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                    for i in 0..count {
                        let fd = (libc::CMSG_DATA(c) as *const i32).add(i).read_unaligned();
                        got.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more descriptors than the {MAX_FDS} a frame may carry"),
            ));
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed mid-frame",
            ));
        }
        off += n as usize;
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
