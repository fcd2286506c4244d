//! The event channel of one request: one sender (the engine), one receiver (its
//! [`crate::EventStream`]), unbounded.
//!
//! Every generated token of every row is one send, so at large batches sending is a
//! visible share of a step. tokio's unbounded channel is lock-free but pays about five
//! atomic read-modify-writes per send (message count, slot claim, ready bit, and two on
//! the receiver's waker). Here a mutex guards the queue and the waker together, so a send
//! pays two (lock and unlock). Every critical section is a push, a pop or a flag write,
//! so neither side can hold up the other for longer than that.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

struct State<T> {
    queue: VecDeque<T>,
    /// The receiver's waker while it waits on an empty queue.
    waker: Option<Waker>,
    /// The sender is gone: once the queue is drained, the stream has ended.
    sender_gone: bool,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    /// The receiver closed or went away, so sends fail. Written under the lock (so a send
    /// that holds the lock sees it), read without it by `is_closed`, which the engine asks
    /// of every live request every step.
    closed: AtomicBool,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Every critical section leaves the state consistent, so a panic in another
        // holder (which only poisons the lock) is no reason to give up on the channel.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            waker: None,
            sender_gone: false,
        }),
        closed: AtomicBool::new(false),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

pub(crate) struct Sender<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Sender<T> {
    /// Queues `msg`; gives it back if the receiver is closed or gone.
    pub fn send(&self, msg: T) -> Result<(), T> {
        let waker = {
            let mut st = self.shared.lock();
            if self.shared.closed.load(Ordering::Relaxed) {
                return Err(msg);
            }
            st.queue.push_back(msg);
            st.waker.take()
        };
        // Woken outside the lock: the woken task may run at once and take it.
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut st = self.shared.lock();
            st.sender_gone = true;
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TryRecvError {
    Empty,
    Disconnected,
}

pub(crate) struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Receiver<T> {
    pub fn try_recv(&mut self) -> Result<T, TryRecvError> {
        let mut st = self.shared.lock();
        match st.queue.pop_front() {
            Some(msg) => Ok(msg),
            None if st.sender_gone || self.is_closed() => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Closed by this side: nothing more can arrive.
    fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Relaxed)
    }

    /// `Ready(None)` once the sender is gone (or this side closed) and everything sent
    /// was received.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut st = self.shared.lock();
        if let Some(msg) = st.queue.pop_front() {
            return Poll::Ready(Some(msg));
        }
        if st.sender_gone || self.is_closed() {
            return Poll::Ready(None);
        }
        match &mut st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    pub async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Blocks the calling thread until a message arrives or the sender is gone.
    pub fn blocking_recv(&mut self) -> Option<T> {
        let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            match self.poll_recv(&mut cx) {
                Poll::Ready(msg) => return msg,
                // A wake between the poll and the park leaves the thread's token set, so
                // the park returns at once; spurious returns just poll again.
                Poll::Pending => std::thread::park(),
            }
        }
    }

    /// Later sends fail; what was already sent can still be received.
    pub fn close(&mut self) {
        let _st = self.shared.lock();
        self.shared.closed.store(true, Ordering::Release);
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let (queue, waker) = {
            let mut st = self.shared.lock();
            self.shared.closed.store(true, Ordering::Release);
            (std::mem::take(&mut st.queue), st.waker.take())
        };
        // Dropped outside the lock: their destructors may take time.
        drop(queue);
        drop(waker);
    }
}

struct ThreadWaker(std::thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
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
