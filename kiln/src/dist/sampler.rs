//! Which examples each rank computes: every global batch cut into one
//! disjoint piece per rank.

use crate::data::permutation_for_epoch;
use crate::data::{array_split, batch_ranges};

/// The examples of each rank, batch by batch: the epoch's order (seeded and
/// reshuffled per epoch, as PyTorch's `DistributedSampler` with
/// `set_epoch`) is cut into global batches of `batch_size` examples, and
/// each global batch into `size` consecutive pieces, the first
/// `rows % size` one example longer (numpy's `array_split`). The union of
/// the ranks' pieces is exactly the batch one process would take, so a
/// data-parallel step on n processes is the step of one process on the
/// same global batch. Unlike PyTorch's sampler, no example is repeated to
/// even out the last batch: a short last batch stays short (or is dropped
/// with `drop_last`), and a rank whose piece is empty contributes zero
/// gradients.
///
/// ```
/// use kiln::dist::DistributedSampler;
/// let s = DistributedSampler::new(10, 4, 1, 2).shuffle(None);
/// assert_eq!(s.batches(0), vec![vec![2, 3], vec![6, 7], vec![9]]); // rank 1's halves of [0..4], [4..8], [8, 9]
/// let seeded = DistributedSampler::new(10, 4, 0, 2).shuffle(Some(7));
/// assert_ne!(seeded.batches(0), seeded.batches(1)); // reshuffled each epoch
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    num_examples: usize,
    batch_size: usize,
    rank: usize,
    size: usize,
    seed: Option<u64>,
    drop_last: bool,
}

impl DistributedSampler {
    /// Rank `rank` of `size` over `num_examples` examples in global batches
    /// of `batch_size`; in order until [`DistributedSampler::shuffle`].
    /// A `batch_size` of 0 counts as 1, a `size` of 0 as 1.
    pub fn new(num_examples: usize, batch_size: usize, rank: usize, size: usize) -> DistributedSampler {
        DistributedSampler { num_examples, batch_size: batch_size.max(1), rank, size: size.max(1), seed: None, drop_last: false }
    }

    /// Shuffles each epoch with [`permutation_for_epoch`]`(n, seed, epoch)`
    /// (`None`: in order). Every rank must pass the same seed.
    pub fn shuffle(mut self, seed: Option<u64>) -> DistributedSampler {
        self.seed = seed;
        self
    }

    /// Drops a last global batch shorter than `batch_size`.
    pub fn drop_last(mut self, drop_last: bool) -> DistributedSampler {
        self.drop_last = drop_last;
        self
    }

    /// `(start, rows)` of each global batch of an epoch.
    pub fn global_batches(&self) -> Vec<(usize, usize)> {
        batch_ranges(self.num_examples, self.batch_size, self.drop_last)
    }

    /// The offset and length of this rank's piece of a global batch of
    /// `rows` examples.
    pub fn piece(&self, rows: usize) -> (usize, usize) {
        array_split(rows, self.size, self.rank.min(self.size - 1))
    }

    /// This rank's example indices for each global batch of `epoch` (an
    /// empty piece where the batch has fewer examples than ranks).
    pub fn batches(&self, epoch: u64) -> Vec<Vec<i64>> {
        let order = self.seed.map(|seed| permutation_for_epoch(self.num_examples, seed, epoch));
        self.global_batches()
            .into_iter()
            .map(|(start, rows)| {
                let (offset, len) = self.piece(rows);
                let range = start + offset..start + offset + len;
                match &order {
                    Some(o) => o[range].to_vec(),
                    None => range.map(|i| i as i64).collect(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_pieces_are_disjoint_and_make_up_each_global_batch() {
        for (n, bs, size) in [(10, 4, 3), (7, 7, 4), (3, 8, 4), (100, 32, 2), (0, 4, 2)] {
            for seed in [None, Some(3)] {
                let all: Vec<Vec<Vec<i64>>> = (0..size).map(|r| DistributedSampler::new(n, bs, r, size).shuffle(seed).batches(2)).collect();
                let one = DistributedSampler::new(n, bs, 0, 1).shuffle(seed).batches(2);
                assert_eq!(all[0].len(), one.len());
                for (b, whole) in one.iter().enumerate() {
                    let joined: Vec<i64> = all.iter().flat_map(|r| r[b].clone()).collect();
                    assert_eq!(&joined, whole, "n={n} bs={bs} size={size} batch {b}");
                }
            }
        }
        let s = DistributedSampler::new(10, 4, 0, 2).drop_last(true);
        assert_eq!(s.batches(0), vec![vec![0, 1], vec![4, 5]]);
    }
}
