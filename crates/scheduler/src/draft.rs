//! Drafts for speculative decoding by prompt lookup (n-gram matching).
//!
//! A decoding row's sequence (prompt ++ generated) often repeats itself: quoted
//! context, code being edited, lists, and the loops small models fall into. The
//! tokens that followed the latest earlier occurrence of the sequence's last few
//! tokens are a free guess at what comes next; the model verifies the guess in
//! the step that decodes the row, and greedy output stays exactly what plain
//! decoding would produce. No draft model, no extra weights.

/// Longest suffix matched, tried first (longer matches predict better).
pub const MAX_NGRAM: usize = 3;
/// Shortest suffix matched. Single-token matches are mostly common tokens in
/// ordinary text: measured on the default model's greedy output, 1-token
/// matches drafted 34 tokens of one non-repeating stream with 6 accepted, 2-token
/// matches 6 with 4 accepted, and looping streams lost almost nothing (1146 -> 1116
/// accepted of 32 streams' drafts).
pub const MIN_NGRAM: usize = 2;
/// How far back a match is searched, bounding the per-row cost on long sequences.
const WINDOW: usize = 4096;

/// A sequence stored as two slices (a request's prompt and its generated tokens).
#[derive(Clone, Copy)]
pub struct Seq<'a> {
    pub head: &'a [u32],
    pub tail: &'a [u32],
}

impl Seq<'_> {
    fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    fn at(&self, i: usize) -> u32 {
        match i.checked_sub(self.head.len()) {
            None => self.head[i],
            Some(j) => self.tail[j],
        }
    }
}

/// Appends to `out` up to `max` tokens that followed the most recent earlier
/// occurrence of the longest suffix of `seq` (of [`MIN_NGRAM`]..=[`MAX_NGRAM`]
/// tokens) that occurred before; appends nothing when no such suffix recurs.
pub fn propose(seq: Seq<'_>, max: usize, out: &mut Vec<u32>) {
    let len = seq.len();
    if max == 0 || len <= MIN_NGRAM {
        return;
    }
    let lowest = len.saturating_sub(WINDOW);
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len - 1)).rev() {
        // The match may not be the suffix itself: it ends at `end` < len.
        let mut end = len - 1;
        while end >= n && end - n >= lowest {
            if (0..n).all(|i| seq.at(end - 1 - i) == seq.at(len - 1 - i)) {
                let take = max.min(len - end);
                out.extend((end..end + take).map(|i| seq.at(i)));
                return;
            }
            end -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(head: &[u32], tail: &[u32], max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        propose(Seq { head, tail }, max, &mut out);
        out
    }

    #[test]
    fn continues_the_latest_match_of_the_longest_suffix() {
        // "7 8" occurs twice before the end; the later one (followed by 5 6) wins.
        let s = [7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8];
        assert_eq!(draft(&s, &[], 2), vec![5, 6]);
        // A 3-token match beats a later 2-token one.
        let s = [1, 7, 8, 4, 4, 7, 8, 5, 1, 7, 8];
        assert_eq!(draft(&s, &[], 3), vec![4, 4, 7]);
    }

    #[test]
    fn spans_prompt_and_generated_tokens() {
        assert_eq!(draft(&[3, 4, 5, 6], &[9, 3, 4], 2), vec![5, 6]);
        // The match itself may straddle the boundary.
        assert_eq!(draft(&[1, 2], &[3, 1, 2], 1), vec![3]);
        assert_eq!(draft(&[4, 1], &[2, 9, 1, 2], 2), vec![9, 1]);
    }

    #[test]
    fn drafts_are_cut_at_the_end_of_the_sequence() {
        // In a loop of period 1 the only continuation is one token long.
        assert_eq!(draft(&[5, 5, 5], &[], 4), vec![5]);
        assert_eq!(draft(&[1, 2, 1, 2], &[], 4), vec![1, 2]);
    }

    #[test]
    fn no_recurrence_no_draft() {
        assert!(draft(&[1, 2, 3, 4], &[], 3).is_empty());
        // A single recurring token is not enough.
        assert!(draft(&[7, 1, 2, 7], &[], 3).is_empty());
        assert!(draft(&[1], &[], 3).is_empty());
        assert!(draft(&[1, 2, 1], &[], 0).is_empty());
    }
}
