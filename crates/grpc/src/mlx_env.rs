//! MLX settings read from the environment that Weft defaults differently from
//! MLX, set (where the operator has not) before MLX reads them.
//!
//! `MLX_ENABLE_CACHE_THRASHING_CHECK=0`: MLX CUDA keeps its CUDA graphs (and
//! its convolution, FFT and SDPA plans) in LRU caches, and with this check on
//! (MLX's default) a cache that has missed more than twice its capacity over
//! the whole process (`MLX_CUDA_GRAPH_CACHE_SIZE`, 400 graphs: 800 misses)
//! throws on every later miss — from inside the command buffer's commit, which
//! leaves MLX's encoder unusable (MLX's `cuda/lru_cache.h`; the graph key is a
//! command buffer's topology, so every new mix of step kinds, chunk counts and
//! prompt lengths a server meets over days adds misses). For a server that
//! turns a slow path (an evicted graph is instantiated again) into failed
//! steps and a dead engine; off, an evicted graph is only rebuilt.

/// The variables [`apply_defaults`] sets, and their values.
pub const DEFAULTS: &[(&str, &str)] = &[("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")];

/// Which of [`DEFAULTS`] to set, given what the environment has (`get`): those
/// the operator left unset; a value they set is kept.
pub fn to_set(get: impl Fn(&str) -> Option<String>) -> Vec<(&'static str, &'static str)> {
    DEFAULTS
        .iter()
        .copied()
        .filter(|(k, _)| get(k).is_none())
        .collect()
}

/// Sets [`DEFAULTS`] the environment lacks; returns what it set. Call first
/// thing in `main`, before other threads start and before MLX initializes.
pub fn apply_defaults() -> Vec<(&'static str, &'static str)> {
    let set = to_set(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()));
    for (k, v) in &set {
        std::env::set_var(k, v);
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_only_what_the_operator_left_unset() {
        assert_eq!(
            to_set(|_| None),
            vec![("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")]
        );
        // The operator's own value, whatever it is, stays.
        assert!(
            to_set(|k| (k == "MLX_ENABLE_CACHE_THRASHING_CHECK").then(|| "1".into())).is_empty()
        );
        assert!(to_set(|_| Some(String::new())).is_empty());
    }
}
