//! Runs one engine step over rows that join, decode and leave independently.
//!
//! Decoding rows share one left-padded [`KvCache`] so a step is a single
//! batched forward; prefilling rows run on their own single-row caches and are
//! merged into the decode batch the first time they decode. Every step is a
//! transaction: `forward` stages, `commit` makes it visible, `rollback` leaves
//! every row exactly as before the step.

use std::collections::HashMap;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::lanes::{self, Lanes};
use crate::llama::LlamaModel;
use crate::prefix::PrefixStore;

pub type RowId = u64;

/// One row's work in a step.
#[derive(Debug, Clone, Default)]
pub struct RowStep {
    pub row: RowId,
    /// A prefill chunk, or the token to decode followed by a draft.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`; must equal the row's committed length.
    pub start_pos: usize,
    pub want_logits: bool,
    /// How many trailing `tokens` are a speculative draft (0: none). A row
    /// with a draft decodes `tokens[0]` and verifies the rest in the same
    /// forward; its logits come back for every position, and
    /// [`BatchRunner::keep`] says how many of its tokens the commit keeps.
    pub draft: usize,
}

impl RowStep {
    fn decodes(&self) -> bool {
        self.start_pos > 0 && (self.tokens.len() == 1 || self.draft > 0)
    }
}

/// Logits of the rows that asked for them, in step order: the last position
/// of a row without a draft, every position of a row with one.
#[derive(Debug, Clone)]
pub struct StepLogits {
    pub rows: Vec<RowId>,
    /// Positions each of `rows` has in `data` (1 + its draft).
    pub counts: Vec<usize>,
    pub vocab: usize,
    /// `[sum(counts), vocab]`, row-major.
    pub data: Vec<f32>,
}

impl StepLogits {
    /// The `i`-th logits vector (the `i`-th row's when no row has a draft).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// Where a row's cache lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Batch(usize),
    Solo,
    /// Position in a parked prefill group.
    Parked(usize, usize),
}

/// Rows prefilled together, kept as one multi-row cache until they join the
/// decode batch: joining as a whole costs one concatenation instead of a copy
/// per row out of the group and another into the batch.
struct Parked {
    /// `None` once a row was released or moved out.
    rows: Vec<Option<RowId>>,
    cache: KvCache,
}

pub struct BatchRunner {
    model: LlamaModel,
    batch: KvCache,
    /// The row in each batch position; `None` for a released row whose cache
    /// columns are dropped at the next recomposition, so rows finishing
    /// together cost one filter of the batch, not one each.
    batch_rows: Vec<Option<RowId>>,
    solo: HashMap<RowId, KvCache>,
    /// Caches written by the open step, to commit or roll back together.
    touched_batch: bool,
    touched_solo: Vec<RowId>,
    /// Rows created by the open step (dropped again on rollback).
    created: Vec<RowId>,
    /// Called after each layer of each forward: fault injection in tests.
    layer_hook: Option<Box<dyn FnMut(usize) -> Result<()>>>,
    prefixes: PrefixStore,
    /// Fresh rows prefilled together in the open step: split into single-row
    /// caches at commit, dropped on rollback.
    groups: Vec<(Vec<RowId>, KvCache)>,
    /// Committed prefill groups whose rows have not joined the batch yet.
    parked: Vec<Parked>,
    /// CPU streams a step's independent forwards are spread over.
    lanes: Lanes,
    /// Lanes the last `forward` built graphs on.
    lanes_used: usize,
    /// Per batch position, the columns of the open step to keep at commit
    /// (the row's own tokens; `keep` lowers it for rejected drafts).
    batch_kept: Vec<i32>,
}

/// Prefix reuse granularity (tokens) and default capacity (tokens).
pub const PREFIX_BLOCK: usize = 16;
pub const PREFIX_CAPACITY: usize = 4096;

impl BatchRunner {
    pub fn new(model: LlamaModel) -> Self {
        let layers = model.num_layers();
        Self {
            model,
            batch: KvCache::new(layers, 0),
            batch_rows: Vec::new(),
            solo: HashMap::new(),
            touched_batch: false,
            touched_solo: Vec::new(),
            created: Vec::new(),
            layer_hook: None,
            prefixes: PrefixStore::new(PREFIX_BLOCK, PREFIX_CAPACITY),
            groups: Vec::new(),
            parked: Vec::new(),
            lanes: Lanes::single(),
            lanes_used: 0,
            batch_kept: Vec::new(),
        }
    }

    /// Spreads each step's independent forwards over these lanes (see
    /// [`Lanes`]); a runner starts with one.
    pub fn set_lanes(&mut self, lanes: Lanes) {
        self.lanes = lanes;
    }

    /// How many lanes the last step ran on (1 unless it was split).
    pub fn lanes_used(&self) -> usize {
        self.lanes_used
    }

    /// Sets the prefix cache capacity in tokens (0 turns reuse off).
    pub fn set_prefix_capacity(&mut self, tokens: usize) {
        self.prefixes = PrefixStore::new(PREFIX_BLOCK, tokens);
    }

    /// Longest reusable cached prefix of `tokens` for `tenant`.
    pub fn prefix_len(&self, tenant: &str, tokens: &[u32]) -> usize {
        self.prefixes.lookup(tenant, tokens)
    }

    /// Creates `row` from the tenant's longest cached prefix of `tokens`;
    /// returns its length (0: no hit, no row created). Outside any step.
    pub fn attach_prefix(&mut self, row: RowId, tenant: &str, tokens: &[u32]) -> usize {
        if self.home(row).is_some() || self.touched_batch || !self.touched_solo.is_empty() {
            return 0;
        }
        match self.prefixes.take(tenant, tokens) {
            Some((cache, n)) => {
                self.solo.insert(row, cache);
                n
            }
            None => 0,
        }
    }

    /// Stores a row's K/V for reuse; `tokens` are the tokens it holds.
    pub fn offer_prefix(&mut self, row: RowId, tenant: &str, tokens: &[u32]) -> Result<()> {
        if self.row_len(row) != Some(tokens.len()) {
            return Err(ModelError::Invalid(format!(
                "offer_prefix: row {row} holds {:?} tokens, offered {}",
                self.row_len(row),
                tokens.len()
            )));
        }
        let cache = match self.home(row) {
            Some(Home::Batch(i)) => self.batch.extract(i)?,
            Some(Home::Solo) => match self.solo.get(&row) {
                Some(c) => c.clone(),
                None => return Ok(()),
            },
            Some(Home::Parked(g, i)) => self.parked[g].cache.extract(i)?,
            None => return Ok(()),
        };
        self.prefixes.insert(tenant, tokens.to_vec(), cache);
        Ok(())
    }

    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    pub fn set_layer_hook(&mut self, hook: Option<Box<dyn FnMut(usize) -> Result<()>>>) {
        self.layer_hook = hook;
    }

    /// Committed length of a row, if it has state.
    pub fn row_len(&self, row: RowId) -> Option<usize> {
        match self.home(row)? {
            Home::Batch(i) => Some(self.batch.lengths()[i] as usize),
            Home::Solo => self.solo.get(&row).map(|c| c.lengths()[0] as usize),
            Home::Parked(g, i) => Some(self.parked[g].cache.lengths()[i] as usize),
        }
    }

    pub fn num_rows(&self) -> usize {
        self.batch_rows.iter().flatten().count()
            + self.solo.len()
            + self
                .parked
                .iter()
                .map(|p| p.rows.iter().flatten().count())
                .sum::<usize>()
    }

    fn home(&self, row: RowId) -> Option<Home> {
        if let Some(i) = self.batch_rows.iter().position(|&r| r == Some(row)) {
            Some(Home::Batch(i))
        } else if self.solo.contains_key(&row) {
            Some(Home::Solo)
        } else {
            self.parked.iter().enumerate().find_map(|(g, p)| {
                p.rows
                    .iter()
                    .position(|&r| r == Some(row))
                    .map(|i| Home::Parked(g, i))
            })
        }
    }

    /// Forgets a row's state. Not part of a step transaction.
    pub fn release(&mut self, row: RowId) -> Result<()> {
        match self.home(row) {
            Some(Home::Batch(i)) => {
                self.batch_rows[i] = None;
                if self.batch_rows.iter().all(Option::is_none) {
                    self.batch = KvCache::new(self.model.num_layers(), 0);
                    self.batch_rows.clear();
                }
            }
            Some(Home::Solo) => {
                self.solo.remove(&row);
            }
            Some(Home::Parked(g, i)) => {
                self.parked[g].rows[i] = None;
                self.drop_empty_parked();
            }
            None => {}
        }
        Ok(())
    }

    /// Stages one step. On error the step is rolled back before returning.
    pub fn forward(&mut self, steps: &[RowStep]) -> Result<StepLogits> {
        if self.touched_batch || !self.touched_solo.is_empty() || !self.created.is_empty() {
            return Err(ModelError::Invalid(
                "forward called inside an open step".into(),
            ));
        }
        let result = self.forward_inner(steps);
        if result.is_err() {
            self.rollback();
        }
        result
    }

    fn forward_inner(&mut self, steps: &[RowStep]) -> Result<StepLogits> {
        let mut seen = std::collections::HashSet::new();
        for s in steps {
            if !seen.insert(s.row) {
                return Err(ModelError::Invalid(format!(
                    "row {} appears twice in one step",
                    s.row
                )));
            }
            if s.tokens.is_empty() {
                return Err(ModelError::Invalid(format!("row {} has no tokens", s.row)));
            }
            if s.draft > 0 && (s.draft + 1 != s.tokens.len() || s.start_pos == 0) {
                return Err(ModelError::Invalid(format!(
                    "row {}: a draft of {} must follow exactly one decoded token of a started row \
                     ({} tokens at {})",
                    s.row,
                    s.draft,
                    s.tokens.len(),
                    s.start_pos
                )));
            }
            let have = self.row_len(s.row).unwrap_or(0);
            if have != s.start_pos {
                return Err(ModelError::Invalid(format!(
                    "row {} starts at {} but its cache holds {have} tokens",
                    s.row, s.start_pos
                )));
            }
        }
        // Decode rows: one new token (and maybe a draft) on top of existing state.
        let mut decode: Vec<&RowStep> = steps.iter().filter(|s| s.decodes()).collect();
        self.compose_batch(&decode.iter().map(|s| s.row).collect::<Vec<_>>())?;
        // The batch keeps its own row order (reordering would copy every
        // layer's cache); outputs are matched to steps by row id.
        let pos: HashMap<RowId, usize> = self
            .batch_rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| (r, i)))
            .collect();
        decode.sort_by_key(|s| pos.get(&s.row).copied().unwrap_or(usize::MAX));

        let mut outputs: HashMap<RowId, Array> = HashMap::new();
        let prefill: Vec<&RowStep> = steps.iter().filter(|s| !s.decodes()).collect();
        // Fresh rows prefill together, left-padded to the longest prompt of
        // their group: one [G, T] forward is about twice as fast per row on
        // CPU as G forwards of [1, T]. Groups bound the padding they add.
        let mut fresh: Vec<&RowStep> = Vec::new();
        let mut singles: Vec<&RowStep> = Vec::new();
        for s in prefill {
            if s.start_pos == 0 && self.home(s.row).is_none() {
                fresh.push(s);
            } else {
                singles.push(s);
            }
        }
        let plan = plan_lanes(
            ragged_groups(fresh),
            singles,
            decode.len(),
            self.lanes.count(),
            self.lanes.min_tokens(),
        );
        self.lanes_used = plan.lanes_used(!decode.is_empty());
        // Held until the step is evaluated, at the end of this function.
        let _blas = if plan.parallel {
            self.lanes.single_threaded_blas()
        } else {
            None
        };
        // Every forward of the step is built first and then run in lockstep
        // (`LlamaModel::forward_interleaved`), each on its lane.
        let mut groups = Vec::with_capacity(plan.groups.len());
        for (g, lane) in plan.groups {
            let t = g.iter().map(|s| s.tokens.len()).max().unwrap_or(0) as i32;
            let mut ids: Vec<i32> = Vec::with_capacity(g.len() * t as usize);
            let mut pads = Vec::with_capacity(g.len());
            for s in &g {
                let pad = t - s.tokens.len() as i32;
                pads.push(pad);
                // Padding ids are never attended to; 0 is valid in every vocabulary.
                ids.extend(std::iter::repeat_n(0, pad as usize));
                ids.extend(s.tokens.iter().map(|&x| x as i32));
            }
            let tokens = Array::from_slice(&ids, &[g.len() as i32, t]);
            let cache = KvCache::with_left_pad(self.model.num_layers(), pads);
            groups.push((g, lane, tokens, cache));
        }
        let mut singles = Vec::with_capacity(plan.singles.len());
        for (s, lane) in plan.singles {
            self.unpark(s.row)?;
            // Out of the map while the forward borrows it; put back below,
            // whatever the outcome, so a rollback finds it.
            let cache = match self.solo.remove(&s.row) {
                Some(c) => c,
                None => {
                    self.created.push(s.row);
                    KvCache::new(self.model.num_layers(), 1)
                }
            };
            self.touched_solo.push(s.row);
            let ids: Vec<i32> = s.tokens.iter().map(|&t| t as i32).collect();
            let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]);
            singles.push((s, lane, tokens, cache));
        }
        self.drop_empty_parked();
        let decode_tokens = if decode.is_empty() {
            None
        } else {
            // Rows with shorter drafts (or none) are filled on the right; the
            // filler columns are never kept, so they end up as holes.
            let t = decode.iter().map(|s| s.tokens.len()).max().unwrap_or(1);
            let mut ids: Vec<i32> = Vec::with_capacity(decode.len() * t);
            self.batch_kept = vec![t as i32; self.batch_rows.len()];
            for s in &decode {
                ids.extend(s.tokens.iter().map(|&x| x as i32));
                ids.extend(std::iter::repeat_n(0, t - s.tokens.len()));
                if let Some(&i) = pos.get(&s.row) {
                    self.batch_kept[i] = s.tokens.len() as i32;
                }
            }
            self.touched_batch = true;
            Some(Array::from_slice(&ids, &[decode.len() as i32, t as i32]))
        };
        let mut jobs: Vec<(usize, &Array, &mut KvCache, bool)> = Vec::new();
        for (_, lane, tokens, cache) in groups.iter_mut() {
            jobs.push((*lane, tokens, cache, true));
        }
        for (_, lane, tokens, cache) in singles.iter_mut() {
            jobs.push((*lane, tokens, cache, true));
        }
        if let Some(tokens) = &decode_tokens {
            let last_only = tokens.dim(1) == 1;
            jobs.push((plan.decode_lane, tokens, &mut self.batch, last_only));
        }
        let mut no_hook = |_: usize| Ok(());
        let hook: &mut dyn FnMut(usize) -> Result<()> = match &mut self.layer_hook {
            Some(h) => h.as_mut(),
            None => &mut no_hook,
        };
        let ran = self.model.forward_interleaved(jobs, &self.lanes, hook);
        // Solo caches go back to their map whatever happened, so a rollback
        // finds them.
        let mut single_rows = Vec::with_capacity(singles.len());
        for (s, _, _, cache) in singles {
            self.solo.insert(s.row, cache);
            single_rows.push(s);
        }
        let mut logits = ran?.into_iter();
        let mut next = || {
            logits
                .next()
                .ok_or_else(|| ModelError::Invalid("a forward returned no logits".into()))
        };
        for (g, _, _, cache) in groups {
            let l = next()?;
            for (i, s) in g.iter().enumerate() {
                if s.want_logits {
                    outputs.insert(s.row, l.try_index((i as i32, 0, ..))?);
                }
            }
            self.groups.push((g.iter().map(|s| s.row).collect(), cache));
        }
        for s in single_rows {
            let l = next()?;
            if s.want_logits {
                outputs.insert(s.row, l.reshape(&[-1])?);
            }
        }
        if decode_tokens.is_some() {
            let l = next()?;
            for (i, s) in decode.iter().enumerate() {
                if s.want_logits {
                    let n = 1 + s.draft as i32;
                    outputs.insert(s.row, l.try_index((i as i32, 0..n, ..))?);
                }
            }
        }
        let rows: Vec<RowId> = steps
            .iter()
            .filter(|s| s.want_logits)
            .map(|s| s.row)
            .collect();
        let vocab = self.model.config.vocab_size as usize;
        if rows.is_empty() {
            mlx_rs::transforms::eval(self.pending_arrays())?;
            return Ok(StepLogits {
                rows,
                counts: vec![],
                vocab,
                data: vec![],
            });
        }
        let parts: Vec<Array> = rows
            .iter()
            .map(|r| {
                let a = outputs
                    .remove(r)
                    .ok_or_else(|| ModelError::Invalid("missing logits".into()))?;
                Ok(a.reshape(&[-1, vocab as i32])?)
            })
            .collect::<Result<_>>()?;
        let counts = parts.iter().map(|a| a.dim(0) as usize).collect();
        let all = ops::concatenate(&parts, 0)?.as_dtype(Dtype::Float32)?;
        all.eval()?;
        let data = all.as_slice::<f32>().to_vec();
        Ok(StepLogits {
            rows,
            counts,
            vocab,
            data,
        })
    }

    /// Arrays a logits-free step must still evaluate (its cache writes).
    fn pending_arrays(&self) -> Vec<&Array> {
        // Cache arrays are lazily written; evaluating the batch and touched
        // solo caches materialises the step.
        let mut v = Vec::new();
        if self.touched_batch {
            v.extend(self.batch.arrays());
        }
        for r in &self.touched_solo {
            if let Some(c) = self.solo.get(r) {
                v.extend(c.arrays());
            }
        }
        for (_, c) in &self.groups {
            v.extend(c.arrays());
        }
        v
    }

    /// Makes the decode batch hold exactly the rows in `rows` (in any order:
    /// rows that stay keep their places, joiners are appended). Moving rows
    /// between the batch and solo caches changes no row's contents, so it
    /// happens outside the step transaction.
    fn compose_batch(&mut self, rows: &[RowId]) -> Result<()> {
        let same = rows.len() == self.batch_rows.len()
            && rows.iter().all(|&r| self.batch_rows.contains(&Some(r)));
        if same {
            return Ok(());
        }
        // Released rows are dropped; live rows that do not decode this step
        // are parked in single-row caches.
        let leaving: Vec<usize> = (0..self.batch_rows.len())
            .filter(|&i| self.batch_rows[i].is_none_or(|r| !rows.contains(&r)))
            .collect();
        for &i in &leaving {
            if let Some(r) = self.batch_rows[i] {
                let one = self.batch.extract(i)?;
                self.solo.insert(r, one);
            }
        }
        let staying: Vec<usize> = (0..self.batch_rows.len())
            .filter(|i| !leaving.contains(i))
            .collect();
        let mut order: Vec<RowId> = staying.iter().filter_map(|&i| self.batch_rows[i]).collect();
        let mut batch = if staying.is_empty() {
            None
        } else if leaving.is_empty() {
            Some(self.batch.clone())
        } else {
            let mut b = self.batch.clone();
            b.filter(&staying)?;
            Some(b)
        };
        let joiners: Vec<RowId> = rows
            .iter()
            .copied()
            .filter(|r| !order.contains(r))
            .collect();
        // Parked groups whose rows all join merge as they are; rows of other
        // groups move out one by one.
        let whole: Vec<usize> = (0..self.parked.len())
            .filter(|&g| {
                self.parked[g]
                    .rows
                    .iter()
                    .all(|r| r.is_some_and(|r| joiners.contains(&r)))
            })
            .collect();
        for &r in &joiners {
            if let Some(Home::Parked(g, _)) = self.home(r) {
                if !whole.contains(&g) {
                    self.unpark(r)?;
                }
            }
        }
        let mut caches = Vec::with_capacity(joiners.len());
        let mut joined = Vec::with_capacity(joiners.len());
        for &g in &whole {
            caches.push(&self.parked[g].cache);
            joined.extend(self.parked[g].rows.iter().flatten().copied());
        }
        for r in &joiners {
            if joined.contains(r) {
                continue;
            }
            caches.push(self.solo.get(r).ok_or_else(|| {
                ModelError::Invalid(format!("row {r} has no state to decode from"))
            })?);
            joined.push(*r);
        }
        if let Some((first, rest)) = caches.split_first() {
            match batch.as_mut() {
                Some(b) => b.merge_many(&caches)?,
                None => {
                    let mut b = (*first).clone();
                    b.merge_many(rest)?;
                    batch = Some(b);
                }
            }
        }
        order.extend(joined);
        for r in rows {
            self.solo.remove(r);
        }
        for &g in whole.iter().rev() {
            self.parked.remove(g);
        }
        self.drop_empty_parked();
        self.batch = batch.unwrap_or_else(|| KvCache::new(self.model.num_layers(), 0));
        self.batch_rows = order.into_iter().map(Some).collect();
        Ok(())
    }

    /// Moves a parked row into a single-row cache of its own (same contents).
    /// Leaves emptied groups in place, so group indices stay valid.
    fn unpark(&mut self, row: RowId) -> Result<()> {
        if let Some(Home::Parked(g, i)) = self.home(row) {
            let one = self.parked[g].cache.extract(i)?;
            self.parked[g].rows[i] = None;
            self.solo.insert(row, one);
        }
        Ok(())
    }

    fn drop_empty_parked(&mut self) {
        self.parked.retain(|p| p.rows.iter().any(Option::is_some));
    }

    /// Keeps only the first `tokens` of the open step's tokens of `row`, a
    /// row that decoded with a draft (the decoded token plus the accepted
    /// part of the draft). Staged like the step itself.
    pub fn keep(&mut self, row: RowId, tokens: usize) -> Result<()> {
        let Some(Home::Batch(i)) = self.home(row) else {
            return Err(ModelError::Invalid(format!(
                "keep: row {row} did not decode"
            )));
        };
        match self.batch_kept.get_mut(i) {
            Some(k) if self.touched_batch && tokens >= 1 && tokens as i32 <= *k => {
                *k = tokens as i32;
                Ok(())
            }
            k => Err(ModelError::Invalid(format!(
                "keep: {tokens} tokens of row {row}, which wrote {k:?} this step"
            ))),
        }
    }

    pub fn commit(&mut self) -> Result<()> {
        if self.touched_batch {
            self.batch.commit_kept(&self.batch_kept)?;
        }
        for (rows, mut cache) in std::mem::take(&mut self.groups) {
            cache.commit();
            self.parked.push(Parked {
                rows: rows.into_iter().map(Some).collect(),
                cache,
            });
        }
        for r in self.touched_solo.drain(..) {
            if let Some(c) = self.solo.get_mut(&r) {
                c.commit();
            }
        }
        self.touched_batch = false;
        self.created.clear();
        Ok(())
    }

    pub fn rollback(&mut self) {
        self.groups.clear();
        if self.touched_batch {
            self.batch.rollback();
        }
        for r in self.touched_solo.drain(..) {
            if let Some(c) = self.solo.get_mut(&r) {
                c.rollback();
            }
        }
        for r in self.created.drain(..) {
            self.solo.remove(&r);
        }
        self.touched_batch = false;
    }
}

/// Most padding a row may get in a prefill group, as a fraction (1/8) of the
/// group's length or an absolute floor of tokens, whichever is larger.
const PAD_FLOOR: usize = 16;

/// Splits fresh rows into prefill groups: longest first, each group taking
/// rows while their padding stays within `max(T / 8, PAD_FLOOR)` tokens.
/// Deterministic (ties by row id) so a retried step builds the same groups.
fn ragged_groups(mut rows: Vec<&RowStep>) -> Vec<Vec<&RowStep>> {
    rows.sort_by(|a, b| b.tokens.len().cmp(&a.tokens.len()).then(a.row.cmp(&b.row)));
    let mut groups: Vec<Vec<&RowStep>> = Vec::new();
    for s in rows {
        match groups.last_mut() {
            Some(g)
                if {
                    let t = g[0].tokens.len();
                    t - s.tokens.len() <= (t / 8).max(PAD_FLOOR)
                } =>
            {
                g.push(s)
            }
            _ => groups.push(vec![s]),
        }
    }
    groups
}

/// Which lane builds each forward of a step.
struct LanePlan<'a> {
    groups: Vec<(Vec<&'a RowStep>, usize)>,
    singles: Vec<(&'a RowStep, usize)>,
    decode_lane: usize,
    /// More than one lane has work: BLAS goes single-threaded for the step.
    parallel: bool,
}

impl LanePlan<'_> {
    /// Distinct lanes that build a forward (1 for an unsplit step).
    fn lanes_used(&self, decoding: bool) -> usize {
        if !self.parallel {
            return 1;
        }
        let mut used: Vec<usize> = self.groups.iter().map(|(_, l)| *l).collect();
        used.extend(self.singles.iter().map(|(_, l)| *l));
        used.extend(decoding.then_some(self.decode_lane));
        used.sort_unstable();
        used.dedup();
        used.len()
    }
}

/// A decode forward reads every weight once whatever its batch, which costs
/// about as much as this many prefill tokens.
const DECODE_PASS_TOKENS: usize = 64;

/// Spreads a step's forwards over `lanes`. With more than one lane, groups
/// big enough to feed two lanes are halved (halves that land on the same lane
/// are joined again); if in the end fewer than two lanes would carry
/// `min_tokens`, everything stays on lane 0 with the groups whole, as a
/// one-lane runner would build it. Deterministic.
fn plan_lanes<'a>(
    groups: Vec<Vec<&'a RowStep>>,
    singles: Vec<&'a RowStep>,
    decode_rows: usize,
    lanes: usize,
    min_tokens: usize,
) -> LanePlan<'a> {
    let width = |g: &[&RowStep]| g.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    // Jobs: (origin group, rows); singles carry no origin.
    let mut jobs: Vec<(Option<usize>, Vec<&'a RowStep>)> = Vec::new();
    for (o, g) in groups.iter().enumerate() {
        if lanes > 1 && g.len() >= 2 && g.len() * width(g) >= 2 * min_tokens {
            let (a, b) = g.split_at(g.len() / 2);
            jobs.extend([(Some(o), a.to_vec()), (Some(o), b.to_vec())]);
        } else {
            jobs.push((Some(o), g.clone()));
        }
    }
    jobs.extend(singles.iter().map(|&s| (None, vec![s])));
    let mut costs: Vec<usize> = jobs.iter().map(|(_, g)| g.len() * width(g)).collect();
    if decode_rows > 0 {
        costs.push(decode_rows + DECODE_PASS_TOKENS);
    }
    let mut at = lanes::assign(&costs, lanes.max(1));
    let mut load = vec![0usize; lanes.max(1)];
    for (c, &l) in costs.iter().zip(&at) {
        load[l] += c;
    }
    let parallel = load.iter().filter(|&&l| l >= min_tokens).count() >= 2;
    if !parallel {
        at.iter_mut().for_each(|l| *l = 0);
    }
    let decode_lane = if decode_rows > 0 { at[jobs.len()] } else { 0 };
    // A group whose parts all share a lane runs whole.
    let mut plan = LanePlan {
        groups: Vec::new(),
        singles: Vec::new(),
        decode_lane,
        parallel,
    };
    let mut emit = |rows: Vec<&'a RowStep>, lane: usize| match rows.len() {
        1 => plan.singles.push((rows[0], lane)),
        _ => plan.groups.push((rows, lane)),
    };
    for (o, g) in groups.into_iter().enumerate() {
        let parts: Vec<usize> = (0..jobs.len()).filter(|&j| jobs[j].0 == Some(o)).collect();
        if parts.iter().all(|&j| at[j] == at[parts[0]]) {
            emit(g, at[parts[0]]);
        } else {
            for j in parts {
                emit(std::mem::take(&mut jobs[j].1), at[j]);
            }
        }
    }
    for (j, job) in jobs.iter().enumerate() {
        if job.0.is_none() {
            emit(job.1.clone(), at[j]);
        }
    }
    plan.singles.sort_by_key(|(s, _)| s.row);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(rows: usize, tokens: usize) -> Vec<RowStep> {
        (0..rows)
            .map(|r| RowStep {
                row: r as RowId,
                tokens: vec![1; tokens],
                start_pos: 0,
                want_logits: true,
                draft: 0,
            })
            .collect()
    }

    fn rows_of(g: &[&RowStep]) -> Vec<RowId> {
        g.iter().map(|s| s.row).collect()
    }

    #[test]
    fn one_lane_keeps_groups_whole() {
        let s = steps(8, 128);
        let plan = plan_lanes(ragged_groups(s.iter().collect()), vec![], 4, 1, 256);
        assert!(!plan.parallel);
        assert_eq!(plan.groups.len(), 1);
        assert_eq!(plan.groups[0].1, 0);
        assert_eq!(plan.decode_lane, 0);
    }

    #[test]
    fn a_big_group_is_halved_over_two_lanes() {
        let s = steps(8, 128);
        let plan = plan_lanes(ragged_groups(s.iter().collect()), vec![], 0, 2, 256);
        assert!(plan.parallel);
        let got: Vec<(Vec<RowId>, usize)> =
            plan.groups.iter().map(|(g, l)| (rows_of(g), *l)).collect();
        assert_eq!(got, vec![(vec![0, 1, 2, 3], 0), (vec![4, 5, 6, 7], 1)]);
    }

    #[test]
    fn small_steps_and_pure_decode_stay_on_one_lane() {
        let s = steps(2, 16);
        let plan = plan_lanes(ragged_groups(s.iter().collect()), vec![], 8, 2, 256);
        assert!(!plan.parallel);
        assert_eq!(
            plan.groups.len(),
            1,
            "a group too small to split stays whole"
        );
        assert!(plan.groups.iter().all(|(_, l)| *l == 0));
        let plan = plan_lanes(vec![], vec![], 32, 2, 256);
        assert!(!plan.parallel);
        assert_eq!(plan.decode_lane, 0);
    }

    #[test]
    fn decode_and_chunks_balance_against_a_group() {
        // A 4 x 128 group (two halves of 256 token-rows), a 300-token chunk
        // and a 16-row decode (16 + 64): largest first, the chunk takes lane
        // 0, both halves lane 1 (256, then 512 against 300), so the group runs
        // whole there; the decode goes to lane 0.
        let g = steps(4, 128);
        let mut chunk = steps(1, 300);
        chunk[0].row = 9;
        chunk[0].start_pos = 100;
        let plan = plan_lanes(
            ragged_groups(g.iter().collect()),
            chunk.iter().collect(),
            16,
            2,
            256,
        );
        assert!(plan.parallel);
        let got: Vec<(Vec<RowId>, usize)> =
            plan.groups.iter().map(|(g, l)| (rows_of(g), *l)).collect();
        assert_eq!(got, vec![(vec![0, 1, 2, 3], 1)]);
        assert_eq!(plan.singles.len(), 1);
        assert_eq!(plan.singles[0].1, 0);
        assert_eq!(plan.decode_lane, 0);
    }
}
