//! The engine thread and its async-friendly handle.
//!
//! One dedicated `std::thread` owns the model (MLX arrays must never cross threads, so
//! the model is built on that thread by a factory closure) and the scheduler, whose KV
//! pool is sized from the model's `ModelInfo::kv` right there. Tokio front
//! ends talk to it through channels only: submit and cancel are commands, each request
//! gets its own unbounded event channel (bounded in practice by `max_tokens`), and stats
//! are a snapshot the engine publishes after every step. Admission limits are checked in
//! the caller's thread against shared counters, so `submit` answers at once.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, error, info};

use crate::admission::Admission;
use crate::chan;
use crate::config::SchedulerConfig;
use crate::model::{Detokenizer, Model, ModelError, ModelInfo};
use crate::request::{
    EventStream, FinishReason, Finished, Msg, Request, RequestKey, SubmitError, Usage,
};
use crate::scheduler::{Scheduler, Stats};

/// How long an idle engine sleeps between checks for new work (deadlines, shutdown).
const IDLE_POLL: Duration = Duration::from_millis(50);
/// Pause after a step that planned nothing although work exists, so the loop never spins.
const STALL_PAUSE: Duration = Duration::from_millis(1);

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model factory failed: {0}")]
    Factory(String),
    #[error("invalid config: {0}")]
    Config(String),
    #[error("could not spawn the engine thread: {0}")]
    Spawn(String),
    #[error("engine thread exited during startup")]
    Startup,
}

enum Command {
    Submit {
        key: RequestKey,
        req: Box<Request>,
        tx: chan::Sender<Msg>,
        arrival: Instant,
    },
    Cancel {
        tenant: String,
        request_id: String,
    },
    AddAdapter {
        id: u32,
        source: crate::model::AdapterSource,
        reply: flume::Sender<Result<crate::model::AdapterDesc, ModelError>>,
    },
    RemoveAdapter {
        id: u32,
        reply: flume::Sender<usize>,
    },
    Shutdown,
}

/// Why an adapter call to the engine did not happen.
#[derive(Debug, thiserror::Error)]
pub enum AdapterCallError {
    /// The model refused it (the message says why).
    #[error("{0}")]
    Refused(ModelError),
    #[error("the engine has stopped")]
    Stopped,
}

struct Shared {
    admission: Arc<Admission>,
    stats: Mutex<Stats>,
    info: ModelInfo,
    detok: Arc<dyn Detokenizer>,
    /// Set (before `alive` disconnects) when the engine thread panicked.
    failure: Mutex<Option<String>>,
    /// Called on the engine thread once it panicked, before any live request is
    /// failed ([`EngineHandle::on_failure`]).
    failure_hook: Mutex<Option<FailureHook>>,
    /// Never sent on: it disconnects when the engine thread ends, for any reason,
    /// which wakes every [`EngineHandle::stopped`].
    alive: flume::Receiver<()>,
}

/// What [`EngineHandle::on_failure`] registers.
pub type FailureHook = Box<dyn FnOnce(&str) + Send>;

/// Cheap to clone; every clone talks to the same engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: std_mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl EngineHandle {
    /// Queue a request or refuse it at once. The returned stream carries token deltas and
    /// ends with one `Event::Finished`; dropping it cancels the request.
    pub fn submit(&self, req: Request) -> Result<EventStream, SubmitError> {
        let now = Instant::now();
        let key = self.shared.admission.admit(&req, now)?;
        let (tx, rx) = chan::channel();
        let local = crate::scheduler::stream_detok(&req, &self.shared.detok);
        if let Err(std_mpsc::SendError(cmd)) = self.tx.send(Command::Submit {
            key,
            req: Box::new(req),
            tx,
            arrival: now,
        }) {
            if let Command::Submit { req, .. } = cmd {
                self.shared.admission.abandon(&req);
            }
            return Err(SubmitError::ShuttingDown);
        }
        Ok(EventStream::new(key, rx, local))
    }

    /// Cancel by client request id. Returns false if no live request has that id.
    pub fn cancel(&self, tenant: &str, request_id: &str) -> bool {
        if !self.shared.admission.knows(tenant, request_id) {
            return false;
        }
        self.tx
            .send(Command::Cancel {
                tenant: tenant.to_string(),
                request_id: request_id.to_string(),
            })
            .is_ok()
    }

    /// Registers LoRA adapter `id` with the model between two steps
    /// ([`Scheduler::add_adapter`]): from then on requests may name it.
    pub async fn add_adapter(
        &self,
        id: u32,
        source: crate::model::AdapterSource,
    ) -> Result<crate::model::AdapterDesc, AdapterCallError> {
        let (reply, rx) = flume::bounded(1);
        self.tx
            .send(Command::AddAdapter { id, source, reply })
            .map_err(|_| AdapterCallError::Stopped)?;
        match rx.recv_async().await {
            Ok(r) => r.map_err(AdapterCallError::Refused),
            Err(_) => Err(AdapterCallError::Stopped),
        }
    }

    /// Removes LoRA adapter `id` ([`Scheduler::remove_adapter`]): its live requests
    /// finish with it, later ones naming it fail. Returns how many live requests
    /// still name it.
    pub async fn remove_adapter(&self, id: u32) -> Result<usize, AdapterCallError> {
        let (reply, rx) = flume::bounded(1);
        self.tx
            .send(Command::RemoveAdapter { id, reply })
            .map_err(|_| AdapterCallError::Stopped)?;
        rx.recv_async().await.map_err(|_| AdapterCallError::Stopped)
    }

    /// The snapshot published after the latest step (waiting/running include requests
    /// still in flight to the engine thread).
    pub fn stats(&self) -> Stats {
        let mut s = self
            .shared
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (waiting, running) = self.shared.admission.counts();
        s.waiting = waiting;
        s.running = running;
        s
    }

    pub fn model_info(&self) -> &ModelInfo {
        &self.shared.info
    }

    /// Why the engine thread stopped on its own (it panicked), once it has.
    pub fn failure(&self) -> Option<String> {
        self.shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Registers `hook`, called on the engine thread with the panic's message if the
    /// thread panics, before any live request gets its final event: a server turns
    /// unhealthy there, so a client that saw its request fail never finds it healthy.
    /// A later call replaces an earlier hook.
    pub fn on_failure(&self, hook: FailureHook) {
        *self
            .shared
            .failure_hook
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// Resolves once the engine thread has ended: after [`Engine::shutdown`], or on
    /// its own after a panic (then [`failure`](Self::failure) says why, and every
    /// request that was live has had its final event).
    pub async fn stopped(&self) {
        let _ = self.shared.alive.recv_async().await;
    }
}

/// Owns the engine thread; dropping it shuts the engine down (live requests get an
/// error event) and joins the thread.
pub struct Engine {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Start the engine: the model is built by `factory` on the engine thread (it never
    /// leaves it), and the scheduler with its KV pool from the model's `ModelInfo::kv`.
    /// Blocks until both exist or the factory or the scheduler failed.
    pub fn start<M, E, F>(
        config: SchedulerConfig,
        factory: F,
        detok: Arc<dyn Detokenizer>,
    ) -> Result<Self, EngineError>
    where
        M: Model + 'static,
        E: std::fmt::Display,
        F: FnOnce() -> Result<M, E> + Send + 'static,
    {
        config.validate().map_err(EngineError::Config)?;
        let (cmd_tx, cmd_rx) = std_mpsc::channel::<Command>();
        let (ready_tx, ready_rx) = std_mpsc::channel::<Result<Arc<Shared>, EngineError>>();
        let thread = std::thread::Builder::new()
            .name("weft-engine".into())
            .spawn(move || {
                let sched = match factory() {
                    Err(e) => {
                        let _ = ready_tx.send(Err(EngineError::Factory(e.to_string())));
                        return;
                    }
                    Ok(model) => match Scheduler::new(config, model, detok) {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(EngineError::Config(e.to_string())));
                            return;
                        }
                    },
                };
                let (alive_tx, alive) = flume::bounded::<()>(0);
                let shared = Arc::new(Shared {
                    admission: sched.admission(),
                    stats: Mutex::new(sched.stats()),
                    info: sched.info().clone(),
                    detok: sched.detokenizer(),
                    failure: Mutex::new(None),
                    failure_hook: Mutex::new(None),
                    alive,
                });
                if ready_tx.send(Ok(shared.clone())).is_err() {
                    return;
                }
                let mut sched = sched;
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_loop(&mut sched, &cmd_rx, &shared)
                }));
                if let Err(p) = ran {
                    fail_after_panic(sched, &cmd_rx, &shared, panic_message(p.as_ref()));
                }
                drop(alive_tx);
            })
            .map_err(|e| EngineError::Spawn(e.to_string()))?;
        let shared = match ready_rx.recv() {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(EngineError::Startup);
            }
        };
        info!("engine started");
        Ok(Self {
            handle: EngineHandle { tx: cmd_tx, shared },
            thread: Some(thread),
        })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    pub fn submit(&self, req: Request) -> Result<EventStream, SubmitError> {
        self.handle.submit(req)
    }

    pub fn cancel(&self, tenant: &str, request_id: &str) -> bool {
        self.handle.cancel(tenant, request_id)
    }

    pub fn stats(&self) -> Stats {
        self.handle.stats()
    }

    /// Stop the engine: live requests finish with an error event.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.handle.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                error!("engine thread panicked");
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Closes admission when the engine loop ends for any reason, panics included, so
/// later submits fail fast instead of queueing into nothing.
struct CloseOnExit(Arc<Admission>);

impl Drop for CloseOnExit {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// What a panic payload says (panics carry a `&str` or a `String`).
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The engine thread panicked: its state may be torn mid-step, so nothing of it is
/// trusted again. Every live request gets its final event (an error naming the
/// panic), admission closes, and the failure is published before the thread ends
/// (`EngineHandle::stopped` wakes; the server turns unhealthy and exits for its
/// supervisor to restart it).
fn fail_after_panic<M: Model>(
    sched: Scheduler<M>,
    rx: &std_mpsc::Receiver<Command>,
    shared: &Shared,
    msg: String,
) {
    error!(panic = %msg, "the engine thread panicked; failing every live request");
    shared.admission.close();
    *shared.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(msg.clone());
    let hook = shared
        .failure_hook
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(hook) = hook {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&msg))).is_err() {
            error!("the engine's failure hook panicked");
        }
    }
    let error = format!("the engine thread panicked ({msg}); the server is stopping");
    let mut sched = sched;
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sched.abandon_all(&error);
    }));
    if failed.is_err() {
        error!("failing the live requests panicked too: their streams end without a final event");
    }
    // Submits still in the channel passed admission before it closed: they are live
    // requests too and get the same final event.
    while let Ok(cmd) = rx.try_recv() {
        if let Command::Submit { req, tx, .. } = cmd {
            crate::metrics::finished(FinishReason::Error);
            let _ = tx.send(Msg::Finished(Box::new(Finished {
                reason: FinishReason::Error,
                stop: None,
                usage: Usage {
                    prompt_tokens: req.prompt.len(),
                    ..Usage::default()
                },
                error: Some(error.clone()),
            })));
        }
    }
    // Dropping a torn model or pool may panic again; the thread ends either way.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(sched))).is_err() {
        error!("dropping the engine's state after the panic panicked too");
    }
}

/// Makes the scheduler's stats now what `Engine::stats` reads.
fn publish_stats<M: Model>(sched: &Scheduler<M>, shared: &Shared) {
    *shared.stats.lock().unwrap_or_else(|p| p.into_inner()) = sched.stats();
}

fn run_loop<M: Model>(sched: &mut Scheduler<M>, rx: &std_mpsc::Receiver<Command>, shared: &Shared) {
    let _close = CloseOnExit(shared.admission.clone());
    let mut stalled = false;
    'outer: loop {
        let now = Instant::now();
        let mut handled = false;
        if !sched.has_work() || stalled {
            let wait = if stalled {
                STALL_PAUSE
            } else {
                sched
                    .next_deadline(now)
                    .map_or(IDLE_POLL, |d| d.min(IDLE_POLL))
            };
            match take(rx, sched, Some(wait)) {
                Got::Handled => handled = true,
                Got::Nothing => {}
                Got::Stop => break 'outer,
            }
        }
        loop {
            match take(rx, sched, None) {
                Got::Handled => handled = true,
                Got::Nothing => break,
                Got::Stop => break 'outer,
            }
        }
        if handled {
            // A cancel changes the pool at once (the row's blocks go back as it is
            // handled), a submit the queue: readers of the stats see it before the
            // next step ends, not a step later.
            publish_stats(sched, shared);
        }
        // A tenant whose last request just ended may send its next one at once:
        // wait a moment for it (every other command is handled meanwhile).
        while let Some(left) = sched.anticipation(Instant::now()) {
            if take(rx, sched, Some(left)) == Got::Stop {
                break 'outer;
            }
        }
        if let (true, Some((gap, cap))) = (sched.only_waiting(), sched.coalesce()) {
            // Clients of a burst arrive a few ms apart; stepping at the first
            // would prefill it alone and leave the rest waiting a whole step.
            let until = Instant::now() + cap;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match take(rx, sched, Some(gap.min(left))) {
                    Got::Handled => {}
                    Got::Nothing => break,
                    Got::Stop => break 'outer,
                }
            }
        }
        let t = Instant::now();
        let rep = sched.step(t);
        if rep.rows > 0 {
            debug!(
                rows = rep.rows,
                tokens = rep.tokens,
                attempts = rep.attempts,
                ms = t.elapsed().as_secs_f64() * 1e3,
                "step"
            );
        }
        stalled = rep.rows == 0 && sched.has_work();
        publish_stats(sched, shared);
    }
    sched.shutdown(Instant::now());
    publish_stats(sched, shared);
    info!("engine stopped");
}

#[derive(Debug, PartialEq, Eq)]
enum Got {
    Handled,
    /// Nothing queued (`wait` None) or nothing arrived within `wait`.
    Nothing,
    /// Shutdown, or every handle is gone.
    Stop,
}

/// Takes one command, waiting up to `wait` for it (not at all when None), and handles it.
fn take<M: Model>(
    rx: &std_mpsc::Receiver<Command>,
    sched: &mut Scheduler<M>,
    wait: Option<Duration>,
) -> Got {
    let cmd = match wait {
        Some(w) => match rx.recv_timeout(w) {
            Ok(cmd) => cmd,
            Err(std_mpsc::RecvTimeoutError::Timeout) => return Got::Nothing,
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return Got::Stop,
        },
        None => match rx.try_recv() {
            Ok(cmd) => cmd,
            Err(std_mpsc::TryRecvError::Empty) => return Got::Nothing,
            Err(std_mpsc::TryRecvError::Disconnected) => return Got::Stop,
        },
    };
    if handle(sched, cmd) {
        Got::Handled
    } else {
        Got::Stop
    }
}

/// Returns false on shutdown.
fn handle<M: Model>(sched: &mut Scheduler<M>, cmd: Command) -> bool {
    match cmd {
        Command::Submit {
            key,
            req,
            tx,
            arrival,
        } => sched.enqueue(key, *req, tx, arrival),
        Command::Cancel { tenant, request_id } => {
            sched.cancel(&tenant, &request_id, Instant::now());
        }
        Command::AddAdapter { id, source, reply } => {
            let _ = reply.send(sched.add_adapter(id, source));
        }
        Command::RemoveAdapter { id, reply } => {
            let _ = reply.send(sched.remove_adapter(id));
        }
        Command::Shutdown => return false,
    }
    true
}
