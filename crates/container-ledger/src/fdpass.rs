//! Framed messages over a unix stream socket with a file descriptor riding
//! along (SCM_RIGHTS): how the manager hands the ledger to a registering
//! process. A frame is a 4-byte big-endian length and that many bytes (the
//! registration protocol's framing); the descriptor is attached to the
//! frame's first byte.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Sends `body` as one frame, with `fd` attached when given.
pub fn send_frame(sock: BorrowedFd<'_>, body: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
    let mut off = 0;
    // Only the first sendmsg carries the descriptor.
    let mut pass = fd.map(|f| f.as_raw_fd());
    while off < buf.len() {
        let mut iov = libc::iovec {
            iov_base: buf[off..].as_ptr() as *mut libc::c_void,
            iov_len: buf.len() - off,
        };
        let mut cmsg_buf = [0u64; 4];
        // SAFETY: `msghdr` is integers and raw pointers: all-zero is valid
        // (NULL name/control, empty lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(raw) = pass {
            // SAFETY: pure arithmetic on a length, no memory touched.
            let space = unsafe { libc::CMSG_SPACE(4) } as usize;
            msg.msg_control = cmsg_buf.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            // SAFETY: `msg_control` is `cmsg_buf` (32 bytes, 8-aligned, live for
            // the loop body) and `msg_controllen` = CMSG_SPACE(4) (24) fits
            // in it, so CMSG_FIRSTHDR is non-NULL and the header plus 4 data
            // bytes lie inside the buffer.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(4) as _;
                (libc::CMSG_DATA(c) as *mut i32).write_unaligned(raw);
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
        pass = None;
        off += n as usize;
    }
    Ok(())
}

/// Receives one frame of at most `max` bytes and the descriptor passed with
/// it, if any (received close-on-exec). EOF before a whole frame is
/// `UnexpectedEof`.
pub fn recv_frame(sock: BorrowedFd<'_>, max: usize) -> io::Result<(Vec<u8>, Option<OwnedFd>)> {
    let mut got: Option<OwnedFd> = None;
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

fn recv_exact(sock: BorrowedFd<'_>, buf: &mut [u8], got: &mut Option<OwnedFd>) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let mut iov = libc::iovec {
            iov_base: buf[off..].as_mut_ptr().cast(),
            iov_len: buf.len() - off,
        };
        let mut cmsg_buf = [0u64; 8];
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
                        let owned = OwnedFd::from_raw_fd(fd);
                        // Keep the first; extra descriptors are closed on drop.
                        if got.is_none() {
                            *got = Some(owned);
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
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
    fn oversize_frame_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(a.as_fd(), &[0u8; 100], None).unwrap();
        let e = recv_frame(b.as_fd(), 10).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
