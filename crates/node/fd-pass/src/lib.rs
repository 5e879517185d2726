//! File descriptors over unix stream sockets (`SCM_RIGHTS`), each with a
//! short text message. The receiver gets its own copies of the open files
//! (the same sockets, not new ones), so a listening or connected socket
//! stays open while any holder of a copy lives.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The longest message [`recv`] takes.
pub const MAX_MESSAGE: usize = 512;
/// The most fds one message carries.
pub const MAX_FDS: usize = 64;

/// Sends `msg` with copies of `fds` (at most [`MAX_FDS`]) in one message.
pub fn send(stream: &UnixStream, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    match sendmsg_fds(stream.as_fd(), msg, fds)? {
        n if n != msg.len() => Err(io::Error::other("short write of an fd message")),
        _ => Ok(()),
    }
}

/// Receives one message and the fds it carries (close-on-exec).
pub fn recv(stream: &UnixStream) -> io::Result<(String, Vec<OwnedFd>)> {
    let mut buf = [0u8; MAX_MESSAGE];
    let mut fds = Vec::new();
    let n = recvmsg_fds(stream.as_fd(), &mut buf, &mut fds)?;
    let text = String::from_utf8_lossy(&buf[..n]).trim().to_string();
    Ok((text, fds))
}

/// Control buffer for [`MAX_FDS`] descriptors, in u64 words (8-aligned):
/// CMSG_SPACE(64 × 4) = 16 + 256 bytes.
const CMSG_WORDS: usize = (16 + MAX_FDS * 4) / 8 + 2;

/// One `sendmsg` of `bytes` with copies of `fds` attached (at most
/// [`MAX_FDS`]), `MSG_NOSIGNAL` (a peer gone is `EPIPE`, never SIGPIPE),
/// retried on EINTR. Returns the bytes sent: a stream socket may take
/// fewer, and the descriptors ride on the first byte, so a caller sending
/// the rest passes none again. The one SCM_RIGHTS sender in the tree.
pub fn sendmsg_fds(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} descriptors in one message; at most {MAX_FDS}",
                fds.len()
            ),
        ));
    }
    loop {
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        let mut cmsg_buf = [0u64; CMSG_WORDS];
        // SAFETY: `msghdr` is integers and raw pointers: all-zero is valid
        // (NULL name/control, empty lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let data = std::mem::size_of_val(fds) as u32;
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
                for (i, raw) in fds.iter().enumerate() {
                    (libc::CMSG_DATA(c) as *mut RawFd)
                        .add(i)
                        .write_unaligned(*raw);
                }
            }
        }
        // SAFETY: `msg` points at `iov` (over `bytes`, live) and at
        // `cmsg_buf` when descriptors ride along; the kernel only reads them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One `recvmsg` into `buf`, appending the descriptors that came with it
/// to `got` (close-on-exec), retried on EINTR. Returns the bytes read (0:
/// EOF). More descriptors than [`MAX_FDS`] (the kernel truncated them) is
/// an error. The one SCM_RIGHTS receiver in the tree.
pub fn recvmsg_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    got: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut cmsg_buf = [0u64; CMSG_WORDS];
        // SAFETY: `msghdr` is integers and raw pointers: all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cmsg_buf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cmsg_buf) as _;
        // SAFETY: `msg` points at `iov` (over `buf`) and at `cmsg_buf` with
        // their true lengths; the kernel writes within them.
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
                        let fd = (libc::CMSG_DATA(c) as *const RawFd).add(i).read_unaligned();
                        got.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more descriptors than the {MAX_FDS} a message may carry"),
            ));
        }
        return Ok(n as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_passed_stays_open_after_the_sender_closes_it() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let l = std::os::unix::net::UnixListener::bind(tmp.path().join("s")).unwrap();
        send(&a, b"here", &[l.as_raw_fd()]).unwrap();
        drop(l);
        let (msg, fds) = recv(&b).unwrap();
        assert_eq!(msg, "here");
        assert_eq!(fds.len(), 1);
        assert!(
            UnixStream::connect(tmp.path().join("s")).is_ok(),
            "still listening"
        );
        let too_many = vec![a.as_raw_fd(); MAX_FDS + 1];
        assert!(send(&a, b"x", &too_many).is_err());
        send(&a, b"none", &[]).unwrap();
        let (msg, fds) = recv(&b).unwrap();
        assert_eq!((msg.as_str(), fds.len()), ("none", 0));
    }
}
