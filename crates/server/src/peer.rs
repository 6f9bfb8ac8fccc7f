//! Whether the client of a request is still there. A streamed answer learns that its client left when a
//! write fails; a non-streamed one writes nothing until it is done, and actix-web keeps polling its handler
//! after the peer has closed the connection, so an abandoned request went on generating to `max_tokens`.
//! The connection's socket says it at once: a peer that closed its side makes the socket report
//! `POLLRDHUP` (Linux). Each connection's socket is kept (a duplicate descriptor) when it is accepted; a
//! request's handler is raced against [`hung_up`], and losing the race drops it, which drops its
//! generation's event channel: the scheduler cancels the sequence (cancellation is channel closure).
//!
//! An HTTP client does not half-close a connection it still reads from, so a hang-up is a departure.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The socket of a request's connection (a duplicate of actix's descriptor, closed with the connection).
#[derive(Clone, Debug)]
pub(crate) struct PeerSocket(Arc<OwnedFd>);

/// `HttpServer::on_connect`: keeps the socket of every TCP connection in its extensions.
pub(crate) fn on_connect(conn: &dyn std::any::Any, ext: &mut actix_web::dev::Extensions) {
    if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
        if let Ok(fd) = tcp.as_fd().try_clone_to_owned() {
            ext.insert(PeerSocket(Arc::new(fd)));
        }
    }
}

/// Whether the peer has closed its side of `fd` (or the socket failed), without waiting.
fn closed(fd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Resolves when the peer of `s` hangs up; never, if that cannot be watched.
pub(crate) async fn hung_up(s: &PeerSocket) {
    let Ok(fd) = s.0.try_clone() else { return std::future::pending().await };
    // SAFETY: `fd` is an `OwnedFd` the `AsyncFd` owns: open, never replaced, closed only when it drops.
    let Ok(watch) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return std::future::pending().await;
    };
    loop {
        let Ok(mut ready) = watch.readable().await else { return std::future::pending().await };
        if closed(watch.get_ref().as_fd()) {
            return;
        }
        // Readable without a hang-up: the next request of a pipelining client. Wait for the next edge.
        ready.clear_ready();
    }
}
