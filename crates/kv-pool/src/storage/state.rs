//! SSM state rows: per layer, one or more tensors `[num_slots, ...]` indexed
//! by the accounting's [`SlotId`](crate::SlotId)s, with new state staged until
//! the step commits.

use std::collections::HashSet;

use mlx_rs::ops::indexing::TryIndexMutOp;
use mlx_rs::{ops, Array, Dtype};

use crate::storage::step::to_i32;
use crate::storage::StorageError;
use crate::{SlotBatch, SlotId, StorageOp};

/// One component of a layer's recurrent state (e.g. the convolution window or
/// the SSM hidden state), per slot.
#[derive(Debug, Clone, PartialEq)]
pub struct StateSpec {
    /// Shape of one slot's state (without the leading slot axis).
    pub shape: Vec<i32>,
    /// Element type.
    pub dtype: Dtype,
}

impl StateSpec {
    /// A component of the given per-slot shape and dtype.
    pub fn new(shape: &[i32], dtype: Dtype) -> Self {
        Self {
            shape: shape.to_vec(),
            dtype,
        }
    }
}

#[derive(Debug)]
struct Staged {
    rows: Array,
    new: Vec<Array>,
}

/// State-slot storage of every SSM layer.
///
/// A batched step [`gather`](Self::gather)s its rows' state (`[B, ...]` per
/// component, rows in [`SlotBatch`] order, so batch merge/filter/extract are
/// index edits on the `SlotBatch`), runs the recurrence, and
/// [`stage`](Self::stage)s the new state. Nothing is written until
/// [`commit`](Self::commit); [`rollback`](Self::rollback) drops the staged
/// state and leaves the storage bit-identical (the committed arrays are never
/// touched before commit). Commit scatters the staged rows into the
/// exclusively owned slot arrays, so MLX updates them in place (see
/// [`KvStorage`](crate::storage::KvStorage) on keeping one reference).
#[derive(Debug)]
pub struct StateStorage {
    num_slots: u32,
    specs: Vec<StateSpec>,
    layers: Vec<Vec<Array>>,
    staged: Vec<Option<Staged>>,
}

impl StateStorage {
    /// Zeroed state for `layers` layers of `num_slots` slots, each with the
    /// components `specs`.
    pub fn new(num_slots: u32, layers: usize, specs: Vec<StateSpec>) -> Result<Self, StorageError> {
        if num_slots == 0 || layers == 0 || specs.is_empty() {
            return Err(StorageError::InvalidConfig(
                "state storage needs slots, layers and components",
            ));
        }
        let n = to_i32(num_slots as usize)?;
        let layers_v = (0..layers)
            .map(|_| {
                specs
                    .iter()
                    .map(|s| {
                        let mut shape = vec![n];
                        shape.extend_from_slice(&s.shape);
                        ops::zeros_dtype(&shape, s.dtype).map_err(StorageError::from)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            num_slots,
            specs,
            staged: (0..layers).map(|_| None).collect(),
            layers: layers_v,
        })
    }

    /// Slots per layer.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Components per layer.
    pub fn specs(&self) -> &[StateSpec] {
        &self.specs
    }

    /// Every committed state array, to evaluate after a commit.
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flatten()
    }

    /// Whether any layer has staged state.
    pub fn has_staged(&self) -> bool {
        self.staged.iter().any(Option::is_some)
    }

    /// The committed state of `batch`'s rows in one layer: per component,
    /// `[B, ...]`.
    pub fn gather(&self, layer: usize, batch: &SlotBatch) -> Result<Vec<Array>, StorageError> {
        let arrays = self.layer(layer)?;
        let rows = self.rows_array(batch, false)?;
        Ok(arrays
            .iter()
            .map(|a| a.take_axis(&rows, 0))
            .collect::<Result<Vec<_>, _>>()?)
    }

    /// Stages one layer's new state for `batch`'s rows (per component,
    /// `[B, ...]`), to be written at [`commit`](Self::commit). A layer can be
    /// staged once per step; rows must be distinct.
    pub fn stage(
        &mut self,
        layer: usize,
        batch: &SlotBatch,
        new: Vec<Array>,
    ) -> Result<(), StorageError> {
        self.layer(layer)?;
        if self.staged[layer].is_some() {
            return Err(StorageError::AlreadyStaged(layer));
        }
        if new.len() != self.specs.len() {
            return Err(StorageError::Shape {
                what: "state components",
                expected: vec![to_i32(self.specs.len())?],
                got: vec![to_i32(new.len())?],
            });
        }
        let b = to_i32(batch.len())?;
        for (x, spec) in new.iter().zip(&self.specs) {
            let mut want = vec![b];
            want.extend_from_slice(&spec.shape);
            if x.shape() != want.as_slice() {
                return Err(StorageError::Shape {
                    what: "staged state",
                    expected: want,
                    got: x.shape().to_vec(),
                });
            }
        }
        let rows = self.rows_array(batch, true)?;
        let new = new
            .into_iter()
            .zip(&self.specs)
            .map(|(x, spec)| {
                if x.dtype() == spec.dtype {
                    Ok(x)
                } else {
                    x.as_dtype(spec.dtype)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.staged[layer] = Some(Staged { rows, new });
        Ok(())
    }

    /// Writes every staged layer. Atomic: the new arrays are all built before
    /// any replaces its predecessor, so an error changes nothing (and the
    /// staged state stays for a retry or a rollback).
    pub fn commit(&mut self) -> Result<(), StorageError> {
        let mut updated: Vec<(usize, Vec<Array>)> = Vec::new();
        for (l, staged) in self.staged.iter().enumerate() {
            let Some(s) = staged else { continue };
            let arrays = self.layers[l]
                .iter()
                .zip(&s.new)
                .map(|(a, x)| scatter_rows(a, &s.rows, x))
                .collect::<Result<Vec<_>, _>>()?;
            updated.push((l, arrays));
        }
        for (l, arrays) in updated {
            // Dropping the old handles here leaves the scatters as their only
            // users, so MLX can write in place.
            self.layers[l] = arrays;
            self.staged[l] = None;
        }
        Ok(())
    }

    /// Drops the staged state; the committed state is untouched.
    pub fn rollback(&mut self) {
        for s in &mut self.staged {
            *s = None;
        }
    }

    /// Applies [`StorageOp::CopySlot`] and [`StorageOp::ResetSlot`] in order;
    /// other operations are ignored. Refused while state is staged (the ops
    /// belong before the step's forward pass). Slot ids are all checked before
    /// anything is written.
    pub fn apply(&mut self, ops: &[StorageOp]) -> Result<(), StorageError> {
        if self.has_staged() {
            return Err(StorageError::StagePending);
        }
        for op in ops {
            match *op {
                StorageOp::CopySlot { src, dst } => {
                    self.check_slot(src)?;
                    self.check_slot(dst)?;
                }
                StorageOp::ResetSlot(s) => self.check_slot(s)?,
                StorageOp::CopyBlock { .. } => {}
            }
        }
        for op in ops {
            match *op {
                StorageOp::CopySlot { src, dst } => {
                    let src = Array::from_slice(&[src as i32], &[1]);
                    let dst = Array::from_slice(&[dst as i32], &[1]);
                    for a in self.layers.iter_mut().flatten() {
                        let row = a.take_axis(&src, 0)?;
                        // Materialize the source row so the scatter below is
                        // the pool array's only user (in-place update).
                        row.eval()?;
                        a.try_index_mut((&dst, ..), &row)?;
                    }
                }
                StorageOp::ResetSlot(s) => {
                    let idx = Array::from_slice(&[s as i32], &[1]);
                    for a in self.layers.iter_mut().flatten() {
                        let mut shape = a.shape().to_vec();
                        shape[0] = 1;
                        let zeros = ops::zeros_dtype(&shape, a.dtype())?;
                        a.try_index_mut((&idx, ..), &zeros)?;
                    }
                }
                StorageOp::CopyBlock { .. } => {}
            }
        }
        Ok(())
    }

    fn layer(&self, layer: usize) -> Result<&[Array], StorageError> {
        self.layers
            .get(layer)
            .map(Vec::as_slice)
            .ok_or(StorageError::UnknownLayer {
                layer,
                layers: self.layers.len(),
            })
    }

    fn check_slot(&self, s: SlotId) -> Result<(), StorageError> {
        if s < self.num_slots {
            Ok(())
        } else {
            Err(StorageError::SlotOutOfRange {
                slot: s,
                num_slots: self.num_slots,
            })
        }
    }

    fn rows_array(&self, batch: &SlotBatch, distinct: bool) -> Result<Array, StorageError> {
        if batch.is_empty() {
            return Err(StorageError::BadRow("an empty slot batch"));
        }
        let mut seen = HashSet::new();
        let mut rows = Vec::with_capacity(batch.len());
        for &s in batch.rows() {
            self.check_slot(s)?;
            if distinct && !seen.insert(s) {
                return Err(StorageError::BadRow("a slot twice in one batch"));
            }
            rows.push(to_i32(s as usize)?);
        }
        Ok(Array::from_slice(&rows, &[to_i32(rows.len())?]))
    }
}

fn scatter_rows(a: &Array, rows: &Array, x: &Array) -> Result<Array, StorageError> {
    let mut out = a.clone();
    out.try_index_mut((rows, ..), x)?;
    Ok(out)
}
