//! Composition root: the real MLX model behind the scheduler's `Model` trait,
//! and the engine started on it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use weft_models::{BatchRunner, LoadOptions, RowStep, Tokenizer};
use weft_scheduler::{
    Detokenizer, Engine, Logits, Model, ModelError, ModelInfo, RowId, RowInput, SchedulerConfig,
};

/// `weft_models::BatchRunner` as the scheduler sees it.
pub struct MlxModel {
    runner: BatchRunner,
    info: ModelInfo,
}

impl MlxModel {
    pub fn new(runner: BatchRunner, eos_token_ids: Vec<u32>) -> Self {
        let c = &runner.model().config;
        let info = ModelInfo {
            vocab_size: c.vocab_size as usize,
            max_context: c.max_position_embeddings as usize,
            eos_token_ids,
        };
        Self { runner, info }
    }
}

fn failed(e: weft_models::ModelError) -> ModelError {
    match e {
        weft_models::ModelError::Invalid(m) => ModelError::Contract(m),
        other => ModelError::Failed(other.to_string()),
    }
}

impl Model for MlxModel {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn forward(&mut self, batch: &[RowInput]) -> Result<Logits, ModelError> {
        let steps: Vec<RowStep> = batch
            .iter()
            .map(|r| RowStep {
                row: r.row,
                tokens: r.tokens.clone(),
                start_pos: r.start_pos,
                want_logits: r.want_logits,
                draft: r.draft,
            })
            .collect();
        let out = self.runner.forward(&steps).map_err(failed)?;
        Ok(Logits {
            data: out.data,
            rows: out.rows,
            vocab: out.vocab,
        })
    }

    fn commit(&mut self) -> Result<(), ModelError> {
        self.runner.commit().map_err(failed)
    }

    fn supports_drafts(&self) -> bool {
        true
    }

    fn keep(&mut self, row: RowId, tokens: usize) -> Result<(), ModelError> {
        self.runner.keep(row, tokens).map_err(failed)
    }

    fn rollback(&mut self) {
        self.runner.rollback();
    }

    fn prefix_len(&self, tenant: &str, tokens: &[u32]) -> usize {
        self.runner.prefix_len(tenant, tokens)
    }

    fn attach_prefix(&mut self, row: RowId, tenant: &str, tokens: &[u32]) -> usize {
        self.runner.attach_prefix(row, tenant, tokens)
    }

    fn offer_prefix(&mut self, row: RowId, tenant: &str, tokens: &[u32]) {
        if let Err(e) = self.runner.offer_prefix(row, tenant, tokens) {
            tracing::warn!(row, error = %e, "prefix not cached");
        }
    }

    fn release_row(&mut self, row: RowId) {
        if let Err(e) = self.runner.release(row) {
            tracing::error!(row, error = %e, "releasing a row's cache failed");
        }
    }
}

/// The tokenizer as the scheduler's detokenizer.
pub struct TokenizerDetok(pub Arc<Tokenizer>);

impl Detokenizer for TokenizerDetok {
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.0.decode(ids).map_err(|e| e.to_string())
    }
}

/// Facts about the served model, read once at startup.
#[derive(Debug, Clone)]
pub struct ServedModel {
    pub name: String,
    pub dir: PathBuf,
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub dtype: String,
    pub quantization: String,
    pub eos_token_ids: Vec<u32>,
}

/// Resolves `--model`: empty or the default model's name fetches (once) and
/// converts the default model; anything else is a model directory.
pub fn resolve_model(spec: &str, progress: bool) -> anyhow::Result<PathBuf> {
    let default = weft_gguf::DEFAULT_MODEL.name;
    if spec.is_empty() || spec == default || spec == "default" {
        let cache = crate::paths::cache_dir();
        return Ok(weft_gguf::pull_default(&cache, progress)?);
    }
    let p = PathBuf::from(spec);
    if !p.is_dir() {
        anyhow::bail!(
            "--model {spec:?} is neither {default:?} nor a model directory (config.json, *.safetensors, tokenizer.json)"
        );
    }
    Ok(p)
}

/// Loads the tokenizer here and the model on the engine thread; returns once
/// the model is loaded and warm.
pub fn start_engine(
    dir: &Path,
    opts: LoadOptions,
    config: SchedulerConfig,
) -> anyhow::Result<(Engine, Arc<Tokenizer>, ServedModel)> {
    let tokenizer = Arc::new(Tokenizer::load(dir)?);
    let model_config = weft_models::ModelConfig::load(dir)?;
    let mut eos = model_config.eos_token_ids.clone();
    if let Some(e) = tokenizer.eos_token_id() {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    let policy = opts.policy();
    let quantization = match (&model_config.quantization, policy.dequantize) {
        (None, _) => "none".to_string(),
        (Some(q), deq) => format!(
            "affine q{} g{}{}",
            q.bits,
            q.group_size,
            if deq { " (dequantized at load)" } else { "" }
        ),
    };
    let served = ServedModel {
        name: dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        dir: dir.to_path_buf(),
        architecture: model_config.model_type.clone(),
        context_length: model_config.max_position_embeddings as usize,
        vocab_size: model_config.vocab_size as usize,
        dtype: format!("{:?}", policy.dtype).to_lowercase(),
        quantization,
        eos_token_ids: eos.clone(),
    };
    let dir_owned = dir.to_path_buf();
    let engine = Engine::start(
        config,
        move || -> anyhow::Result<MlxModel> {
            let loaded = weft_models::load(&dir_owned, opts)?;
            let mut runner = BatchRunner::new(loaded.model);
            runner.set_lanes(opts.lanes());
            warm_up(&mut runner)?;
            Ok(MlxModel::new(runner, eos))
        },
        Arc::new(TokenizerDetok(tokenizer.clone())),
    )?;
    Ok((engine, tokenizer, served))
}

/// One throwaway prefill and decode so the first request does not pay for
/// MLX's first-use setup.
fn warm_up(runner: &mut BatchRunner) -> anyhow::Result<()> {
    let row = u64::MAX;
    let steps = [RowStep {
        row,
        tokens: vec![1, 2, 3, 4],
        start_pos: 0,
        want_logits: true,
        draft: 0,
    }];
    runner.forward(&steps)?;
    runner.commit()?;
    let steps = [RowStep {
        row,
        tokens: vec![5],
        start_pos: 4,
        want_logits: true,
        draft: 0,
    }];
    runner.forward(&steps)?;
    runner.commit()?;
    runner.release(row)?;
    Ok(())
}
