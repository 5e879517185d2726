//! Unix-socket gRPC servers that accept whatever `:authority` a client
//! sends.
//!
//! tonic's HTTP/2 layer (h2) resets any request whose `:authority` is not a
//! valid URI authority. Over a unix socket there is no host, and real
//! clients fill it with the socket path: kubelet before 1.26 (grpc-go) on
//! the device-plugin sockets, Python grpcio with default options on the
//! display socket. Go gRPC servers accept them, so we must too.
//! [`incoming`] wraps each accepted connection in [`Fixed`], which rewrites
//! such values to `localhost` below h2 (see [`rewrite`]).
//!
//! ```text
//! Server::builder()
//!     .add_service(svc)
//!     .serve_with_incoming(uds_authority::incoming(UnixListener::bind(path)?))
//! ```

pub mod rewrite;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt, wrappers::UnixListenerStream};
use tonic::transport::server::Connected;

/// Accepted connections of `listener`, each wrapped in [`Fixed`].
pub fn incoming(listener: UnixListener) -> impl Stream<Item = io::Result<Fixed<UnixStream>>> {
    UnixListenerStream::new(listener).map(|c| c.map(Fixed::new))
}

/// A server-side connection whose incoming header blocks are normalised.
/// Writes pass straight through.
pub struct Fixed<S> {
    inner: S,
    rw: rewrite::Rewriter,
    ready: Vec<u8>,
    ready_at: usize,
    chunk: Box<[u8]>,
    eof: bool,
}

impl<S> Fixed<S> {
    pub fn new(inner: S) -> Self {
        Fixed {
            inner,
            rw: rewrite::Rewriter::default(),
            ready: Vec::new(),
            ready_at: 0,
            chunk: vec![0; 16 * 1024].into_boxed_slice(),
            eof: false,
        }
    }

    /// `:authority` values replaced on this connection so far.
    pub fn rewritten(&self) -> u64 {
        self.rw.rewritten()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Fixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready_at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_at);
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut this.chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let got = rb.filled();
            if got.is_empty() {
                // A truncated frame left in the rewriter is dropped; h2
                // sees the end of the connection either way.
                this.eof = true;
            } else {
                this.rw.feed(got, &mut this.ready);
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Fixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for Fixed<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
