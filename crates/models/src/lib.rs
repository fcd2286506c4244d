//! Model configs, weights, tokenizers and forward graphs over mlx-rs.
