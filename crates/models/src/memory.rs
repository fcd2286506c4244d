//! Where the process's memory goes: MLX's allocator counters, its buffer-cache
//! cap, and an upper bound of what one step allocates beside the weights and
//! the KV pool, so the server can state its memory plan at startup and hold
//! to it (benches/RESULTS.md, "Memory inside the budget").

use crate::composed_attention::{bytes_per_score, MAX_SCORES};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// MLX's allocator, read now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MlxMemory {
    /// Bytes held by live arrays.
    pub active: u64,
    /// Bytes of freed buffers MLX keeps for reuse (its buffer cache).
    pub cache: u64,
    /// Most `active` bytes since the process started or [`reset_peak`].
    pub peak: u64,
}

/// Reads MLX's allocator counters.
pub fn mlx_memory() -> Result<MlxMemory> {
    let read = |what: &str, r: std::result::Result<usize, mlx_rs::error::Exception>| {
        r.map(|v| v as u64)
            .map_err(|e| ModelError::Invalid(format!("MLX {what} memory query failed: {e}")))
    };
    Ok(MlxMemory {
        active: read("active", mlx_rs::memory::active_memory())?,
        cache: read("cache", mlx_rs::memory::cache_memory())?,
        peak: read("peak", mlx_rs::memory::peak_memory())?,
    })
}

/// Starts MLX's peak counter again from the active bytes.
pub fn reset_peak() -> Result<()> {
    mlx_rs::memory::reset_peak_memory()
        .map_err(|e| ModelError::Invalid(format!("MLX peak memory reset failed: {e}")))
}

/// Sets MLX's memory limit to `bytes`; returns the previous limit. Past it
/// MLX's allocator first gives back its buffer cache, and MLX's evaluation
/// waits, between two operations, for a committed command buffer to complete
/// while its live arrays hold more and some buffer is in flight: on a GPU,
/// where every input of a committed buffer lives until the device completes
/// it, that wait is what bounds how far the host runs ahead of the device.
/// Allocations past it still succeed.
pub fn set_memory_limit(bytes: u64) -> Result<u64> {
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    mlx_rs::memory::set_memory_limit(bytes)
        .map(|v| v as u64)
        .map_err(|e| ModelError::Invalid(format!("MLX memory limit failed: {e}")))
}

/// Caps MLX's buffer cache at `bytes` (freed buffers beyond it go back to the
/// system allocator); returns the previous cap.
pub fn set_cache_limit(bytes: u64) -> Result<u64> {
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    mlx_rs::memory::set_cache_limit(bytes)
        .map(|v| v as u64)
        .map_err(|e| ModelError::Invalid(format!("MLX cache limit failed: {e}")))
}

/// What the largest step the scheduler may plan allocates at once, beside the
/// weights and the KV pool (an upper bound where MLX frees each layer's
/// intermediates as the next layer runs, so at most one layer's are live: the
/// CPU. On a GPU a committed command buffer's inputs live until the device
/// completes it; the server bounds that with MLX's memory limit,
/// `weft_grpc::memory_plan::mlx_limit`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepMemory {
    /// Recurrent layers (hybrid models): every row's state before the step,
    /// kept as the step's undo journal until it commits, and per layer the
    /// gathered state, the new one and the recurrence's intermediates.
    pub recurrent: u64,
    /// One layer's hidden states, projections and MLP intermediates for every
    /// token of the step.
    pub activations: u64,
    /// Attention scores and their softmax for the step's multi-token queries,
    /// all over the longest context a row may reach.
    pub attention: u64,
    /// Logits of every sampled position in f32, with the sampler's working
    /// copies.
    pub logits: u64,
    /// One layer's K and V gathered from the pool into the padded layout
    /// (dequantized from a quantized pool) for the rows that attend that way.
    pub gather: u64,
}

impl StepMemory {
    pub fn total(&self) -> u64 {
        self.activations + self.attention + self.logits + self.gather + self.recurrent
    }
}

/// The shape of the largest step: tokens it carries, positions it samples,
/// and the longest context one row can attend over.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    pub tokens: u64,
    pub sampled: u64,
    pub context: u64,
    /// Bytes per activation element (4 for f32, 2 for bf16).
    pub act_bytes: u64,
    /// Multi-token attention is composed in chunks of at most [`MAX_SCORES`]
    /// scores (the GPU), rather than over all of a forward's at once (MLX's
    /// CPU SDPA, which composes without a bound).
    pub chunked: bool,
    /// Rows whose context one forward may gather from the pool (each padded
    /// to `context`), and the bytes one gathered token of one layer takes
    /// (K and V, with a quantized pool's packed parts before dequantizing).
    pub gathered_rows: u64,
    pub gather_bytes_per_token: u64,
    /// Rows the step may hold (each with its recurrent state, in a hybrid).
    pub rows: u64,
    /// Elements per token of one layer the adapter deltas may hold (0
    /// without an adapter pool;
    /// [`crate::lora::AdapterPool::step_elements_per_token`]).
    pub adapter_per_token: u64,
}

/// Upper bound of a step's allocations for `config` at `shape`.
pub fn step_memory(config: &ModelConfig, shape: StepShape) -> StepMemory {
    let h = config.hidden_size.max(0) as u64;
    let f = config.intermediate_size.max(0) as u64;
    let (hq, hkv, d) = (
        config.num_heads.max(0) as u64,
        config.num_kv_heads.max(0) as u64,
        config.head_dim.max(0) as u64,
    );
    let t = shape.tokens;
    // Input, norm, attention output projection, residual, MLP output and the
    // next norm ([T, h] each); fused q/k/v, roped q and k, attention output;
    // fused gate/up, its activation.
    let per_token = 6 * h + (hq + 2 * hkv) * d + (hq + hkv) * d + hq * d + 3 * f;
    let activations = t
        .saturating_mul(per_token.saturating_add(shape.adapter_per_token))
        .saturating_mul(shape.act_bytes);
    // Worst case: every prefill token of the step is one row's, over the
    // longest context. Composed attention (the GPU) materializes one chunk of
    // at most MAX_SCORES at a time; MLX's CPU SDPA all of a forward's.
    let mut scores = hq.saturating_mul(t).saturating_mul(shape.context);
    if shape.chunked {
        scores = scores.min(MAX_SCORES as u64);
    }
    let attention = scores.saturating_mul(bytes_per_score(shape.act_bytes));
    // f32 logits, the softmax / log-softmax the sampler takes, the masked copy.
    let logits = shape
        .sampled
        .saturating_mul(config.vocab_size.max(0) as u64)
        .saturating_mul(4 * 3);
    let gather = shape
        .gathered_rows
        .saturating_mul(shape.context)
        .saturating_mul(shape.gather_bytes_per_token);
    // Per recurrent layer and row: the convolution's inputs (activation
    // dtype) and the f32 matrices. The journal holds every recurrent layer's
    // old rows to the step's end; one layer at a time holds its gathered
    // state, its new one and a few of the recurrence's per-token states.
    let recurrent = match config.recurrent_state() {
        Some(r) => {
            let layers = config.recurrent_layers.iter().filter(|&&x| x).count() as u64;
            let per_layer = (r.conv_keep.max(0) as u64)
                .saturating_mul(r.conv_dim.max(0) as u64)
                .saturating_mul(shape.act_bytes)
                + r.matrix
                    .iter()
                    .map(|&d| d.max(0) as u64)
                    .product::<u64>()
                    .saturating_mul(4);
            shape
                .rows
                .saturating_mul(per_layer)
                .saturating_mul(layers + 5)
        }
        None => 0,
    };
    StepMemory {
        activations,
        attention,
        logits,
        gather,
        recurrent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(rows: u64) -> StepShape {
        StepShape {
            tokens: 256,
            sampled: rows,
            context: 1024,
            act_bytes: 2,
            chunked: true,
            gathered_rows: 0,
            gather_bytes_per_token: 0,
            rows,
            adapter_per_token: 0,
        }
    }

    /// A hybrid's step counts every row's recurrent state: the journal of all
    /// recurrent layers plus one layer's working copies; an attention-only
    /// model's step counts none.
    #[test]
    fn recurrent_state_is_counted_per_row_and_layer() {
        let hybrid = ModelConfig::parse(
            r#"{"model_type": "qwen3_5", "hidden_size": 128, "num_hidden_layers": 4,
                "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": 512,
                "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                "linear_conv_kernel_dim": 4, "full_attention_interval": 2}"#,
        )
        .expect("config");
        // Conv: 3 x (2 * 2 * 32 + 4 * 32) bf16; matrices: 4 x 32 x 32 f32.
        let per_layer = 3 * 256 * 2 + 4 * 32 * 32 * 4;
        let m = step_memory(&hybrid, shape(8));
        assert_eq!(m.recurrent, 8 * per_layer * (2 + 5));
        assert_eq!(
            m.total(),
            m.activations + m.attention + m.logits + m.recurrent
        );
        let llama = ModelConfig::parse(
            r#"{"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
                "intermediate_size": 256, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
                "vocab_size": 512}"#,
        )
        .expect("config");
        assert_eq!(step_memory(&llama, shape(8)).recurrent, 0);
    }
}
