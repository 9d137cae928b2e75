//! How a round's new buckets are split into `insert` commands sent at once
//! (`mongodb.insert_concurrency`). MongoDB applies concurrent commands in
//! parallel (document-level concurrency), while one command's documents go
//! in one after another; under a backlog a round inserts thousands of
//! buckets, so a few commands at once use more of the server.

use std::ops::Range;

use crate::bucket::store::even_runs;

/// At most `commands` commands, each of at least `min_buckets` new buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InsertSplit {
    pub commands: usize,
    pub min_buckets: usize,
}

impl InsertSplit {
    /// A command of fewer buckets than this is not split further. A steady
    /// load's rounds insert tens of buckets, which gain nothing from a
    /// second command and would each cost the server a command's fixed
    /// work (its write concern's wait among it); a backlog's rounds insert
    /// thousands.
    pub const MIN_BUCKETS: usize = 100;

    /// `commands` at once, none of fewer than [`Self::MIN_BUCKETS`].
    pub fn new(commands: usize) -> Self {
        InsertSplit {
            commands: commands.max(1),
            min_buckets: Self::MIN_BUCKETS,
        }
    }

    /// The commands for new buckets whose plans are `chains` (one entry per
    /// bucket, a customer's chain in consecutive entries): [`even_runs`],
    /// in order. `ordered` keeps each chain whole in one command, each cut
    /// moved past the chain it falls in: an ordered insert stops at its
    /// first refusal, which is what keeps a chain from getting a bucket
    /// after a missing one, and a chain split over two commands sent at
    /// once would lose that.
    pub fn commands<T: PartialEq>(self, chains: &[T], ordered: bool) -> Vec<Range<usize>> {
        let commands = self.commands.min(chains.len() / self.min_buckets.max(1));
        let mut runs = Vec::with_capacity(commands.max(1));
        let mut start = 0;
        for run in even_runs(chains.len(), commands) {
            let mut end = run.end.max(start);
            while ordered && end < chains.len() && chains[end] == chains[end - 1] {
                end += 1;
            }
            if end > start {
                runs.push(start..end);
                start = end;
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(commands: usize, min_buckets: usize) -> InsertSplit {
        InsertSplit {
            commands,
            min_buckets,
        }
    }

    #[test]
    fn small_rounds_stay_one_command_and_large_ones_split_evenly() {
        let firsts: Vec<usize> = (0..150).collect();
        assert_eq!(InsertSplit::new(2).commands(&firsts, false), vec![0..150]);
        let firsts: Vec<usize> = (0..2000).collect();
        assert_eq!(
            InsertSplit::new(2).commands(&firsts, false),
            vec![0..1000, 1000..2000]
        );
        assert_eq!(InsertSplit::new(1).commands(&firsts, false), vec![0..2000]);
        assert!(InsertSplit::new(2).commands::<usize>(&[], true).is_empty());
    }

    #[test]
    fn an_ordered_split_moves_the_cut_past_the_chain_it_falls_in() {
        let chains = [1, 1, 2, 2, 2, 3, 3, 4];
        assert_eq!(split(2, 1).commands(&chains, true), vec![0..5, 5..8]);
        assert_eq!(split(2, 1).commands(&chains, false), vec![0..4, 4..8]);
        // Runs differ by one bucket at most, as the fills' do.
        let firsts: Vec<usize> = (0..10).collect();
        assert_eq!(
            split(4, 1).commands(&firsts, false),
            vec![0..3, 3..6, 6..8, 8..10]
        );
        // One chain is one command, whatever the split asks.
        assert_eq!(split(4, 1).commands(&[7; 9], true), vec![0..9]);
    }

    proptest! {
        /// Every bucket in exactly one command, in order; no more commands
        /// than asked, none empty, none below the minimum unless unsplit;
        /// ordered, no chain in two commands.
        #[test]
        fn commands_cover_every_bucket_once_and_keep_chains_whole(
            lens in proptest::collection::vec(1usize..5, 0..300),
            commands in 1usize..6,
            min_buckets in 1usize..50,
            ordered in any::<bool>(),
        ) {
            let chains: Vec<usize> = lens
                .iter()
                .enumerate()
                .flat_map(|(c, &n)| std::iter::repeat_n(c, n))
                .collect();
            let runs = split(commands, min_buckets).commands(&chains, ordered);
            let mut next = 0;
            for run in &runs {
                prop_assert_eq!(run.start, next);
                prop_assert!(run.end > run.start);
                next = run.end;
                if ordered && run.end < chains.len() {
                    prop_assert_ne!(chains[run.end - 1], chains[run.end]);
                }
            }
            prop_assert_eq!(next, chains.len());
            prop_assert!(runs.len() <= commands);
            if runs.len() > 1 {
                prop_assert!(chains.len() / runs.len() >= min_buckets);
            }
        }
    }
}
