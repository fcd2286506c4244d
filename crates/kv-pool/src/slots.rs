//! Fixed-size SSM state slots (conv + recurrent state rows).
//!
//! Unlike KV blocks, a recurrent state is replaced wholesale every step, so a
//! slot is never shared: there is no reference count and no copy-on-write, and
//! a fork copies the whole slot up front.

use crate::{KvError, OwnerId};

/// Index of a state row in the storage half's slot tensors.
pub type SlotId = u32;

#[derive(Debug, Clone, Copy)]
enum SlotUndo {
    Acquired(SlotId),
    Released(SlotId, OwnerId),
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotStats {
    /// Slots in the pool.
    pub total: usize,
    /// Slots not acquired.
    pub free: usize,
    /// Slots acquired.
    pub used: usize,
}

/// Exact slot state, comparable with `==`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPoolSnapshot {
    /// Holder of each slot.
    pub owners: Vec<Option<OwnerId>>,
    /// Free slots, the next one to hand out last.
    pub free_order: Vec<SlotId>,
}

/// Allocator of state slots.
#[derive(Debug, Clone)]
pub struct SlotPool {
    owners: Vec<Option<OwnerId>>,
    free: Vec<SlotId>,
    journal: Vec<SlotUndo>,
    journaling: bool,
}

impl SlotPool {
    /// A pool of `n` slots.
    pub fn new(n: u32) -> Self {
        Self {
            owners: vec![None; n as usize],
            // Stack popped from the end: slot 0 is handed out first.
            free: (0..n).rev().collect(),
            journal: Vec::new(),
            journaling: false,
        }
    }

    /// Takes a free slot for `owner`. Its contents are stale; the caller must
    /// reset it before the first step.
    pub fn acquire(&mut self, owner: OwnerId) -> Result<SlotId, KvError> {
        let s = self.free.pop().ok_or(KvError::SlotsExhausted {
            needed: 1,
            available: 0,
        })?;
        self.owners[s as usize] = Some(owner);
        if self.journaling {
            self.journal.push(SlotUndo::Acquired(s));
        }
        Ok(s)
    }

    /// Returns a slot.
    pub fn release(&mut self, slot: SlotId) -> Result<(), KvError> {
        let owner = self
            .owners
            .get_mut(slot as usize)
            .and_then(Option::take)
            .ok_or(KvError::SlotNotAcquired(slot))?;
        self.free.push(slot);
        if self.journaling {
            self.journal.push(SlotUndo::Released(slot, owner));
        }
        Ok(())
    }

    /// Holder of a slot, `None` when free or out of range.
    pub fn owner(&self, slot: SlotId) -> Option<OwnerId> {
        self.owners.get(slot as usize).copied().flatten()
    }

    /// Free slots.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Counts for metrics.
    pub fn stats(&self) -> SlotStats {
        SlotStats {
            total: self.owners.len(),
            free: self.free.len(),
            used: self.owners.len() - self.free.len(),
        }
    }

    /// Exact state.
    pub fn snapshot(&self) -> SlotPoolSnapshot {
        SlotPoolSnapshot {
            owners: self.owners.clone(),
            free_order: self.free.clone(),
        }
    }

    /// Structure check: the free stack and the owner table agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free = vec![false; self.owners.len()];
        for &s in &self.free {
            let i = s as usize;
            if i >= self.owners.len() || on_free[i] {
                return Err(format!("slot {s} is out of range or free twice"));
            }
            if self.owners[i].is_some() {
                return Err(format!("slot {s} is both free and owned"));
            }
            on_free[i] = true;
        }
        if let Some(s) = (0..self.owners.len()).find(|&i| !on_free[i] && self.owners[i].is_none()) {
            return Err(format!("slot {s} leaked: neither free nor owned"));
        }
        Ok(())
    }

    pub(crate) fn set_journaling(&mut self, on: bool) {
        self.journaling = on;
    }

    pub(crate) fn journal_len(&self) -> usize {
        self.journal.len()
    }

    pub(crate) fn clear_journal(&mut self) {
        self.journal.clear();
    }

    /// Forgets the undo records before `mark` (an older step committed).
    pub(crate) fn drain_journal(&mut self, mark: usize) {
        self.journal.drain(..mark.min(self.journal.len()));
    }

    pub(crate) fn rollback_to(&mut self, mark: usize) {
        while self.journal.len() > mark {
            match self.journal.pop().expect("length checked") {
                SlotUndo::Acquired(s) => {
                    self.owners[s as usize] = None;
                    self.free.push(s);
                }
                SlotUndo::Released(s, owner) => {
                    let top = self.free.pop();
                    debug_assert_eq!(top, Some(s));
                    self.owners[s as usize] = Some(owner);
                }
            }
        }
    }
}

/// The rows of one batched SSM step, as slot indices in row order.
///
/// The storage half gathers `state[rows]` before the step and scatters the new
/// state back to the same rows after it; batch reshaping (requests joining,
/// finishing, being moved to another batch) is then pure index manipulation
/// here instead of tensor surgery on a batch-shaped state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotBatch {
    rows: Vec<SlotId>,
}

impl SlotBatch {
    /// A batch from slots in row order.
    pub fn from_slots(rows: Vec<SlotId>) -> Self {
        Self { rows }
    }

    /// Slot of each row: the gather/scatter index list.
    pub fn rows(&self) -> &[SlotId] {
        &self.rows
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Appends `other`'s rows after this batch's rows (batch concatenation).
    pub fn merge(&mut self, other: SlotBatch) {
        self.rows.extend(other.rows);
    }

    /// Keeps only the rows listed in `keep`, in that order (the new row `i` is
    /// the old row `keep[i]`). Repeated or out-of-range rows are rejected because
    /// two rows scattering into one slot would race.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), KvError> {
        let len = self.rows.len();
        let mut seen = vec![false; len];
        for &r in keep {
            if r >= len || seen[r] {
                return Err(KvError::BadRow { row: r, len });
            }
            seen[r] = true;
        }
        self.rows = keep.iter().map(|&r| self.rows[r]).collect();
        Ok(())
    }

    /// Removes one row and returns its slot; later rows move up by one.
    pub fn extract(&mut self, row: usize) -> Result<SlotId, KvError> {
        if row >= self.rows.len() {
            return Err(KvError::BadRow {
                row,
                len: self.rows.len(),
            });
        }
        Ok(self.rows.remove(row))
    }
}
