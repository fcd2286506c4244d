//! The LoRA adapters a server serves: those configured at start (`weft serve
//! --adapter NAME=DIR`, the config file's `[adapters]`) and those mounted and
//! unmounted at run time through the Admin service.
//!
//! The model holds a pool of `slots` resident adapters (`--max-loras`) of
//! rank up to `max_rank` (`--max-lora-rank`); any number of registered
//! adapters (up to [`MAX_ADAPTERS`]) keep their files in host memory and are
//! made resident when a step's rows need them, the least recently used one
//! evicted. The scheduler never runs more distinct adapters than slots at
//! once. The [`AdapterCatalog`] maps names to the engine's ids (never reused)
//! for validation, `ListModels` and the metrics.

// tonic's Status is the error of every call here, as in the server.
#![allow(clippy::result_large_err)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::RwLock;

use anyhow::Context as _;
use tonic::Status;
use weft_models::runner::BatchRunner;
use weft_scheduler::{AdapterCallError, EngineHandle, ModelError};

/// Most adapters one server registers (configured and mounted together).
pub const MAX_ADAPTERS: usize = 64;

/// Rank of the pool when run-time loading is on and no configured adapter or
/// `--max-lora-rank` says otherwise (vLLM's default too).
pub const DEFAULT_MAX_RANK: usize = 16;

/// A LoRA adapter to serve beside the model (`weft serve --adapter NAME=DIR`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSpec {
    pub name: String,
    pub dir: PathBuf,
}

/// How the model's adapter pool is sized, and whether adapters may be mounted
/// at run time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterPoolSpec {
    /// Adapters resident at once (`--max-loras`; default: the configured
    /// ones, at least 1 with run-time loading).
    pub slots: Option<usize>,
    /// Largest rank served (`--max-lora-rank`; default: the configured
    /// adapters' largest, at least [`DEFAULT_MAX_RANK`] with run-time loading).
    pub max_rank: Option<usize>,
    /// The directory run-time mounts must lie under (`--adapter-root`; None:
    /// run-time loading is off).
    pub root: Option<PathBuf>,
}

/// A LoRA adapter the engine holds: requests name it (`GenerateRequest.adapter`,
/// or `model` on the OpenAI API), rows run with its id.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedAdapter {
    pub name: String,
    /// The scheduler's and the model's id for it (1, 2, ...; never reused).
    pub id: u32,
    pub rank: u32,
    pub scale: f32,
    /// The projections it adapts ("q_proj", ...).
    pub targets: Vec<String>,
    /// "mlx-lm" or "peft".
    pub format: String,
    /// Host memory its files take (kept while it is registered).
    pub host_bytes: u64,
}

impl ServedAdapter {
    fn log(&self, dir: &Path, what: &str) {
        tracing::info!(
            adapter = %self.name,
            id = self.id,
            rank = self.rank,
            scale = self.scale,
            targets = %self.targets.join(","),
            format = %self.format,
            host_bytes = self.host_bytes,
            dir = %dir.display(),
            "{what}"
        );
    }

    /// What `ListModels` and `LoadAdapter` say of it.
    pub fn info(&self) -> crate::pb::AdapterInfo {
        crate::pb::AdapterInfo {
            name: self.name.clone(),
            rank: self.rank,
            scale: self.scale,
            targets: self.targets.clone(),
            format: self.format.clone(),
        }
    }
}

/// Whether `name` may name an adapter: 1-64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// What the engine set up at start.
#[derive(Debug, Clone, Default)]
pub struct StartedAdapters {
    pub served: Vec<ServedAdapter>,
    pub slots: usize,
    pub max_rank: usize,
}

/// Sets up the runner's adapter pool and registers `specs` (ids 1..=n, checked
/// against the base model: an error names the adapter and the tensor); the
/// first `slots` are made resident at once. No pool when there is nothing to
/// serve and run-time loading is off. On the engine thread, before the memory
/// plan (which counts the pool).
pub fn start(
    runner: &mut BatchRunner,
    base: &weft_models::ModelConfig,
    specs: &[AdapterSpec],
    pool: &AdapterPoolSpec,
) -> anyhow::Result<StartedAdapters> {
    let runtime = pool.root.is_some();
    if specs.is_empty() && !runtime {
        return Ok(StartedAdapters::default());
    }
    let files = specs
        .iter()
        .map(|s| {
            let f = weft_models::AdapterFiles::read(&s.dir)
                .with_context(|| format!("adapter {:?} ({})", s.name, s.dir.display()))?;
            let a = f
                .parse(base)
                .with_context(|| format!("adapter {:?} ({})", s.name, s.dir.display()))?;
            Ok((f, a.rank, a.targets()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let largest = files.iter().map(|f| f.1).max().unwrap_or(1);
    let max_rank = match pool.max_rank {
        Some(r) => {
            if let Some((s, f)) = specs.iter().zip(&files).find(|(_, f)| f.1 > r) {
                anyhow::bail!(
                    "adapter {:?} has rank {}, above --max-lora-rank {r}",
                    s.name,
                    f.1
                );
            }
            r
        }
        None if runtime => largest.max(DEFAULT_MAX_RANK),
        None => largest,
    };
    let slots = pool.slots.unwrap_or(specs.len()).clamp(1, MAX_ADAPTERS);
    let targets = if runtime {
        weft_models::Target::ALL.into_iter().collect()
    } else {
        files.iter().flat_map(|f| f.2.iter().copied()).collect()
    };
    runner.set_adapter_pool(Some(weft_models::AdapterPoolConfig {
        slots,
        max_rank,
        targets,
        layout: weft_models::StackLayout::Auto,
    }))?;
    let mut served = Vec::with_capacity(specs.len());
    for (i, (spec, (f, _, _))) in specs.iter().zip(files).enumerate() {
        let id = i as u32 + 1;
        let host = f.bytes();
        let a = runner
            .register_adapter(weft_models::AdapterId(u64::from(id)), f)
            .with_context(|| format!("adapter {:?}", spec.name))?;
        let s = served_from(&spec.name, id, crate::runtime::describe(&a, host));
        s.log(&spec.dir, "LoRA adapter registered");
        served.push(s);
    }
    let first: Vec<weft_models::AdapterId> = (1..=served.len().min(slots) as u64)
        .map(weft_models::AdapterId)
        .collect();
    runner.preload_adapters(&first)?;
    tracing::info!(
        slots,
        max_rank,
        registered = served.len(),
        runtime_loading = runtime,
        pool_bytes = runner.adapters().map_or(0, |p| p.bytes()),
        "LoRA adapter pool: {slots} resident at once, rank up to {max_rank}{}",
        match &pool.root {
            Some(r) => format!("; run-time loading from {}", r.display()),
            None => String::new(),
        }
    );
    Ok(StartedAdapters {
        served,
        slots,
        max_rank,
    })
}

fn served_from(name: &str, id: u32, d: weft_scheduler::AdapterDesc) -> ServedAdapter {
    ServedAdapter {
        name: name.to_string(),
        id,
        rank: d.rank,
        scale: d.scale,
        targets: d.targets,
        format: d.format,
        host_bytes: d.host_bytes,
    }
}

/// The adapters served now, by name.
#[derive(Debug, Default)]
pub struct AdapterCatalog {
    served: RwLock<Vec<ServedAdapter>>,
    next_id: AtomicU32,
    /// Resident at once (0: the model has no adapter pool).
    pub slots: usize,
    pub max_rank: usize,
    /// Run-time mounts lie under this directory (canonical; None: off).
    pub root: Option<PathBuf>,
    /// Mounts and unmounts, one at a time.
    ops: tokio::sync::Mutex<()>,
}

impl AdapterCatalog {
    /// The catalog of what the engine started with.
    pub fn new(started: StartedAdapters, root: Option<PathBuf>) -> Self {
        let next = started.served.iter().map(|a| a.id).max().unwrap_or(0) + 1;
        Self {
            served: RwLock::new(started.served),
            next_id: AtomicU32::new(next),
            slots: started.slots,
            max_rank: started.max_rank,
            root,
            ops: Default::default(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<ServedAdapter>> {
        self.served.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The served adapter called `name`.
    pub fn get(&self, name: &str) -> Option<ServedAdapter> {
        self.read().iter().find(|a| a.name == name).cloned()
    }

    /// Host bytes of every served adapter's files.
    pub fn host_bytes(&self) -> u64 {
        self.read().iter().map(|a| a.host_bytes).sum()
    }

    /// Every served adapter, in id order.
    pub fn list(&self) -> Vec<ServedAdapter> {
        self.read().clone()
    }

    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// The names, quoted, for error messages.
    pub fn names(&self) -> String {
        self.read()
            .iter()
            .map(|a| format!("{:?}", a.name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Mounts the adapter in `path` (under [`root`](Self::root)) as `name`:
    /// its files are read here, then checked and registered by the engine
    /// between two steps. `model` is the served model's name (not an
    /// adapter's).
    pub async fn mount(
        &self,
        engine: &EngineHandle,
        model: &str,
        name: &str,
        path: &str,
    ) -> Result<ServedAdapter, Status> {
        let Some(root) = &self.root else {
            return Err(Status::failed_precondition(
                "run-time adapter loading is off: start weft serve with --adapter-root DIR",
            ));
        };
        if self.slots == 0 {
            return Err(Status::failed_precondition(
                "this server has no adapter pool",
            ));
        }
        if !valid_name(name) {
            return Err(Status::invalid_argument(format!(
                "name {name:?}: expected 1-64 characters of A-Z a-z 0-9 . _ -"
            )));
        }
        if name == model {
            return Err(Status::invalid_argument(format!(
                "name {name:?} is the served model's; give the adapter another"
            )));
        }
        let dir = inside(root, path)?;
        let _one = self.ops.lock().await;
        if self.get(name).is_some() {
            return Err(Status::already_exists(format!(
                "adapter {name:?} is mounted already; unload it first"
            )));
        }
        if self.read().len() >= MAX_ADAPTERS {
            return Err(Status::resource_exhausted(format!(
                "{MAX_ADAPTERS} adapters are mounted, the most one server serves; unload one"
            )));
        }
        let read_dir = dir.clone();
        let files = tokio::task::spawn_blocking(move || weft_models::AdapterFiles::read(&read_dir))
            .await
            .map_err(|e| Status::internal(format!("reading the adapter: {e}")))?
            .map_err(|e| Status::invalid_argument(format!("path {path:?}: {e}")))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let d = engine
            .add_adapter(id, Box::new(files))
            .await
            .map_err(|e| match e {
                AdapterCallError::Refused(
                    ModelError::Failed(m) | ModelError::Contract(m) | ModelError::OutOfMemory(m),
                ) => Status::invalid_argument(format!("adapter {name:?} ({path}): {m}")),
                AdapterCallError::Stopped => Status::unavailable("the engine has stopped"),
            })?;
        let served = served_from(name, id, d);
        served.log(&dir, "LoRA adapter mounted");
        self.served
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(served.clone());
        Ok(served)
    }

    /// Unmounts `name`: it leaves the catalog at once (new requests naming it
    /// are refused); the engine lets its live requests finish, then frees it.
    /// Returns how many live requests still named it.
    pub async fn unmount(&self, engine: &EngineHandle, name: &str) -> Result<usize, Status> {
        let _one = self.ops.lock().await;
        let removed = {
            let mut s = self.served.write().unwrap_or_else(|p| p.into_inner());
            let i = s
                .iter()
                .position(|a| a.name == name)
                .ok_or_else(|| Status::not_found(format!("no adapter {name:?} is mounted")))?;
            s.remove(i)
        };
        let live = engine
            .remove_adapter(removed.id)
            .await
            .map_err(|_| Status::unavailable("the engine has stopped"))?;
        tracing::info!(
            adapter = %removed.name,
            id = removed.id,
            live_requests = live,
            "LoRA adapter unmounted (freed once its live requests end)"
        );
        Ok(live)
    }
}

/// `path` (relative to `root`, or absolute) resolved, and inside `root` (both
/// canonical: no `..` or symlink leads out).
fn inside(root: &Path, path: &str) -> Result<PathBuf, Status> {
    if path.is_empty() {
        return Err(Status::invalid_argument("path: empty"));
    }
    let p = root.join(path);
    let real = p.canonicalize().map_err(|e| {
        Status::not_found(format!(
            "path {path:?}: {} ({e})",
            if Path::new(path).is_absolute() {
                p.display().to_string()
            } else {
                format!("under the adapter root {}", root.display())
            }
        ))
    })?;
    if !real.starts_with(root) {
        return Err(Status::invalid_argument(format!(
            "path {path:?} is outside the adapter root {}",
            root.display()
        )));
    }
    if !real.is_dir() {
        return Err(Status::invalid_argument(format!(
            "path {path:?} is not a directory"
        )));
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_stay_under_the_root() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("root");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(d.path().join("outside")).unwrap();
        let root = root.canonicalize().unwrap();
        assert_eq!(inside(&root, "a/b").unwrap(), root.join("a/b"));
        let abs = root.join("a").display().to_string();
        assert_eq!(inside(&root, &abs).unwrap(), root.join("a"));
        let code = |p: &str| inside(&root, p).unwrap_err().code();
        assert_eq!(code("../outside"), tonic::Code::InvalidArgument);
        assert_eq!(
            code(&d.path().join("outside").display().to_string()),
            tonic::Code::InvalidArgument
        );
        assert_eq!(code("missing"), tonic::Code::NotFound);
        assert_eq!(code(""), tonic::Code::InvalidArgument);
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(d.path().join("outside"), root.join("link")).unwrap();
            assert_eq!(code("link"), tonic::Code::InvalidArgument);
        }
    }

    #[test]
    fn names() {
        assert!(valid_name("sql-v2.1_x"));
        assert!(!valid_name(""));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(65)));
    }
}
