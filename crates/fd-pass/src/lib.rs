//! File descriptors over unix stream sockets (`SCM_RIGHTS`), each with a
//! short text message. The receiver gets its own copies of the open files
//! (the same sockets, not new ones), so a listening or connected socket
//! stays open while any holder of a copy lives.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The longest message [`recv`] takes.
pub const MAX_MESSAGE: usize = 512;
/// The most fds one message carries.
pub const MAX_FDS: usize = 64;

/// Sends `msg` with copies of `fds` (at most [`MAX_FDS`]) in one message.
pub fn send(stream: &UnixStream, msg: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr() as *mut libc::c_void,
        iov_len: msg.len(),
    };
    if fds.len() > MAX_FDS {
        return Err(io::Error::other(format!(
            "{} fds in one message; at most {MAX_FDS}",
            fds.len()
        )));
    }
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is arithmetic.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    // u64s: the control buffer must be aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is valid; every pointer set below outlives
    // the sendmsg call.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if !fds.is_empty() {
        hdr.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        hdr.msg_controllen = space as _;
        // SAFETY: the control buffer holds one cmsghdr with room for fds.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&hdr);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                fds.len(),
            );
        }
    }
    // SAFETY: hdr points at live buffers.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &hdr, libc::MSG_NOSIGNAL) };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize != msg.len() => Err(io::Error::other("short write of an fd message")),
        _ => Ok(()),
    }
}

/// Receives one message and the fds it carries (close-on-exec).
pub fn recv(stream: &UnixStream) -> io::Result<(String, Vec<OwnedFd>)> {
    let mut buf = [0u8; MAX_MESSAGE];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: arithmetic.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: as in send.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    hdr.msg_controllen = space as _;
    // SAFETY: hdr points at live buffers.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut hdr, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    let text = String::from_utf8_lossy(&buf[..n as usize])
        .trim()
        .to_string();
    Ok((text, fds))
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
