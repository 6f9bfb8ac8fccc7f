//! What a dropped reply means. An actor answers every request it takes; a reply channel closed without
//! an answer means the actor's thread is unwinding from a panic, and its inbox closes a moment later,
//! when the unwinding drops the receiver. Liveness (`/health`) reads the closed inbox, so a requester that
//! reports the failure at once can let its client see a 5xx while `/health` still answers 200. A
//! requester therefore waits for the inbox to close before it reports a dropped reply: an ordering, not a
//! sleep, and a short one (the receiver is dropped as the panicking thread unwinds).

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use tokio::sync::mpsc::UnboundedSender;

/// Blocks the calling (non-async) thread until `inbox`'s receiving end is closed or dropped. Call it only
/// after the actor behind `inbox` dropped a reply unanswered: a live actor never closes its inbox.
pub fn wait_closed<T>(inbox: &UnboundedSender<T>) {
    block_on(inbox.closed());
}

/// Wakes a parked thread: the smallest executor that polls one future on the calling thread.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::wait_closed;
    use tokio::sync::mpsc;

    #[test]
    fn returns_once_the_receiver_is_dropped_on_another_thread() {
        let (tx, rx) = mpsc::unbounded_channel::<u8>();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            go_rx.recv().expect("go");
            drop(rx);
        });
        go_tx.send(()).expect("send");
        wait_closed(&tx);
        assert!(tx.is_closed());
        t.join().expect("join");
    }

    #[test]
    fn returns_at_once_when_already_closed() {
        let (tx, mut rx) = mpsc::unbounded_channel::<u8>();
        rx.close();
        wait_closed(&tx);
    }
}
