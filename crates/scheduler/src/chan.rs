//! The event channel of one request: one sender (the engine), one receiver (its
//! [`crate::EventStream`]), unbounded, in order. A thin layer over [`flume`] that adds
//! what flume lacks: closing the receiving side while keeping what was already sent.
//!
//! Every generated token of every row is one send, so at large batches sending is a
//! visible share of a step; flume's unbounded send is one uncontended lock and a push
//! (tokio's unbounded channel paid about five atomic read-modify-writes per send).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use flume::r#async::RecvStream;
use futures_core::Stream;

pub(crate) use flume::TryRecvError;

pub(crate) fn channel<T: 'static>() -> (Sender<T>, Receiver<T>) {
    let (tx, rx) = flume::unbounded();
    let closed = Arc::new(AtomicBool::new(false));
    (
        Sender {
            tx,
            closed: closed.clone(),
        },
        Receiver {
            stream: rx.clone().into_stream(),
            rx,
            closed,
        },
    )
}

pub(crate) struct Sender<T> {
    tx: flume::Sender<T>,
    /// Set by the receiver when it closes or goes away. Read without a lock by
    /// `is_closed`, which the engine asks of every live request every step.
    closed: Arc<AtomicBool>,
}

impl<T> Sender<T> {
    /// Queues `msg`; gives it back if the receiver is closed or gone.
    pub fn send(&self, msg: T) -> Result<(), T> {
        if self.is_closed() {
            return Err(msg);
        }
        self.tx.send(msg).map_err(|e| e.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

pub(crate) struct Receiver<T: 'static> {
    rx: flume::Receiver<T>,
    /// The async side of `rx` (a second handle on the same channel): it keeps the
    /// registered waker between polls.
    stream: RecvStream<'static, T>,
    closed: Arc<AtomicBool>,
}

impl<T: 'static> Receiver<T> {
    /// Closed by this side: nothing more can arrive.
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        match self.rx.try_recv() {
            Err(TryRecvError::Empty) if self.is_closed() => Err(TryRecvError::Disconnected),
            r => r,
        }
    }

    /// `Ready(None)` once the sender is gone (or this side closed) and everything sent
    /// was received.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        if self.is_closed() {
            return Poll::Ready(self.rx.try_recv().ok());
        }
        Pin::new(&mut self.stream).poll_next(cx)
    }

    pub async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Blocks the calling thread until a message arrives or the sender is gone.
    pub fn blocking_recv(&mut self) -> Option<T> {
        if self.is_closed() {
            return self.rx.try_recv().ok();
        }
        self.rx.recv().ok()
    }

    /// Later sends fail; what was already sent can still be received.
    pub fn close(&mut self) {
        self.closed.store(true, Ordering::Release);
    }
}

impl<T: 'static> Drop for Receiver<T> {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_stay_send_and_sync() {
        // Front ends hand event streams to other tasks and threads (tonic needs Send).
        fn check<T: Send + Sync + Unpin + 'static>() {}
        check::<crate::EventStream>();
        check::<Sender<crate::request::Msg>>();
    }

    #[test]
    fn delivers_in_order_then_ends() {
        let (tx, mut rx) = channel();
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        for i in 0..5 {
            tx.send(i).unwrap();
        }
        drop(tx);
        for i in 0..5 {
            assert_eq!(rx.try_recv(), Ok(i));
        }
        assert_eq!(rx.try_recv(), Err(TryRecvError::Disconnected));
    }

    #[test]
    fn close_and_drop_fail_later_sends() {
        let (tx, mut rx) = channel();
        tx.send(1).unwrap();
        assert!(!tx.is_closed());
        rx.close();
        assert!(tx.is_closed());
        assert_eq!(tx.send(2), Err(2));
        assert_eq!(rx.try_recv(), Ok(1));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Disconnected));
        assert_eq!(rx.blocking_recv(), None);
        let (tx, rx) = channel::<u32>();
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(3), Err(3));
    }

    #[test]
    fn blocking_recv_wakes_across_threads() {
        let (tx, mut rx) = channel();
        let t = std::thread::spawn(move || {
            for i in 0..1000u32 {
                tx.send(i).unwrap();
                if i % 100 == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let mut got = Vec::new();
        while let Some(i) = rx.blocking_recv() {
            got.push(i);
        }
        t.join().unwrap();
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn recv_wakes_a_task() {
        let (tx, mut rx) = channel();
        let t = std::thread::spawn(move || {
            for i in 0..100u32 {
                std::thread::sleep(std::time::Duration::from_micros(50));
                tx.send(i).unwrap();
            }
        });
        let mut got = Vec::new();
        while let Some(i) = rx.recv().await {
            got.push(i);
        }
        t.join().unwrap();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }
}
