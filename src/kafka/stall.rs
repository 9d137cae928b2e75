//! Partitions the consumer cannot read: records wait in Kafka, and the
//! client does not fetch them.
//!
//! librdkafka reports most such cases only as errors that name no
//! partition (and the Rust client drops the partition of the rest), or
//! not at all: a fetch that fails over and over looks like an idle
//! partition. So the symptom is watched instead. From librdkafka's
//! statistics, per assigned partition: its fetch position (`next_offset`,
//! which moves past transaction markers and aborted records too) and its
//! fetch queue. A partition is *suspect* when its position has not moved
//! for `timeouts.partition_stall` while nothing of it is queued for the
//! worker (a full queue is the worker's own backpressure: librdkafka
//! stops fetching a partition only while records of it are queued). A
//! suspect is *stalled* when Kafka says records are waiting past its
//! position (a ListOffsets query: statistics' high watermark is only as
//! fresh as the last fetch that worked).
//!
//! A partition the worker has paused (backpressure: a write being retried,
//! the in-flight bound) is not fetched on purpose, and librdkafka drops
//! what it had queued of it: it is never a suspect, and its window starts
//! afresh when it is resumed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::offsets::TopicPartition;

/// What librdkafka's statistics said about one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// The next offset librdkafka will fetch; negative while unknown.
    pub next: i64,
    /// Messages of this partition fetched and not yet read by the worker.
    pub queued: i64,
}

#[derive(Debug, Clone, Copy)]
struct Progress {
    next: i64,
    /// When `next` last changed, or the partition was last seen queued.
    since: Instant,
}

/// A stalled partition: the worker has read up to `next`, and Kafka holds
/// records up to `end`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stalled {
    pub tp: TopicPartition,
    pub next: i64,
    pub end: i64,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (topic, partition) = &self.tp;
        let waiting = self.end - self.next.max(0);
        write!(f, "{topic}/{partition} ({waiting} records waiting unread)")
    }
}

/// Tracks the fetch position of each assigned partition. Pure: the caller
/// supplies the time, the statistics and the end offsets.
#[derive(Debug)]
pub struct StallWatch {
    window: Duration,
    parts: BTreeMap<TopicPartition, Progress>,
    /// Paused by the worker: not read on purpose.
    paused: BTreeSet<TopicPartition>,
}

impl StallWatch {
    pub fn new(window: Duration) -> Self {
        StallWatch {
            window,
            parts: BTreeMap::new(),
            paused: BTreeSet::new(),
        }
    }

    /// The worker paused these partitions: they are not read on purpose.
    pub fn paused(&mut self, tps: &[TopicPartition]) {
        self.paused.extend(tps.iter().cloned());
    }

    /// The worker resumed these partitions: each starts a fresh window now
    /// (its position could not move while it was paused).
    pub fn resumed(&mut self, tps: &[TopicPartition], now: Instant) {
        for tp in tps {
            self.paused.remove(tp);
            if let Some(p) = self.parts.get_mut(tp) {
                p.since = now;
            }
        }
    }

    /// One statistics report for an assigned partition.
    pub fn observe(&mut self, tp: &TopicPartition, seen: Observed, now: Instant) {
        let fresh = Progress {
            next: seen.next,
            since: now,
        };
        let p = self.parts.entry(tp.clone()).or_insert(fresh);
        if p.next != seen.next || seen.queued > 0 {
            *p = fresh;
        }
    }

    /// Keeps only the partitions `keep` accepts (the assignment): a
    /// partition handed back later starts a fresh window.
    pub fn retain(&mut self, mut keep: impl FnMut(&TopicPartition) -> bool) {
        self.parts.retain(|tp, _| keep(tp));
    }

    /// Partitions whose position has not moved for the window, with
    /// nothing queued, and that position.
    pub fn suspects(&self, now: Instant) -> Vec<(TopicPartition, i64)> {
        self.parts
            .iter()
            .filter(|(tp, _)| !self.paused.contains(*tp))
            .filter(|(_, p)| now.saturating_duration_since(p.since) >= self.window)
            .map(|(tp, p)| (tp.clone(), p.next))
            .collect()
    }
}

/// The suspects Kafka holds records for past their position. `ends` are
/// the end offsets Kafka reported (a suspect missing from it, because the
/// query failed for it, is not judged).
pub fn stalled(
    suspects: &[(TopicPartition, i64)],
    ends: &BTreeMap<TopicPartition, i64>,
) -> Vec<Stalled> {
    suspects
        .iter()
        .filter_map(|(tp, next)| {
            let end = *ends.get(tp)?;
            (end > (*next).max(0)).then(|| Stalled {
                tp: tp.clone(),
                next: *next,
                end,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(60);

    fn tp(p: i32) -> TopicPartition {
        ("t".into(), p)
    }

    fn seen(next: i64, queued: i64) -> Observed {
        Observed { next, queued }
    }

    #[test]
    fn a_position_that_does_not_move_for_the_window_is_suspect() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(W);
        w.observe(&tp(0), seen(5, 0), t0);
        w.observe(&tp(0), seen(5, 0), t0 + Duration::from_secs(30));
        assert!(w.suspects(t0 + Duration::from_secs(59)).is_empty());
        assert_eq!(w.suspects(t0 + W), vec![(tp(0), 5)]);
    }

    #[test]
    fn moving_or_queued_partitions_are_not_suspect() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(W);
        w.observe(&tp(0), seen(5, 0), t0);
        w.observe(&tp(1), seen(9, 0), t0);
        // Partition 0 moves; partition 1 waits for the worker, which is
        // busy (its records are queued).
        w.observe(&tp(0), seen(6, 0), t0 + Duration::from_secs(50));
        w.observe(&tp(1), seen(9, 400), t0 + Duration::from_secs(50));
        assert!(w.suspects(t0 + Duration::from_secs(100)).is_empty());
        assert_eq!(w.suspects(t0 + Duration::from_secs(110)).len(), 2);
    }

    #[test]
    fn a_paused_partition_is_not_suspect_and_starts_a_new_window_on_resume() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(W);
        w.observe(&tp(0), seen(5, 0), t0);
        w.observe(&tp(1), seen(9, 0), t0);
        w.paused(&[tp(0)]);
        // Paused for two windows: not fetched, nothing queued, on purpose.
        w.observe(&tp(0), seen(5, 0), t0 + 2 * W);
        assert_eq!(w.suspects(t0 + 2 * W), vec![(tp(1), 9)]);
        w.resumed(&[tp(0)], t0 + 2 * W);
        assert_eq!(w.suspects(t0 + 3 * W - Duration::from_secs(1)).len(), 1);
        assert_eq!(
            w.suspects(t0 + 3 * W).len(),
            2,
            "a fresh window after resume"
        );
    }

    #[test]
    fn a_reassigned_partition_starts_a_new_window() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(W);
        w.observe(&tp(0), seen(5, 0), t0);
        w.retain(|_| false);
        w.observe(&tp(0), seen(5, 0), t0 + W);
        assert!(w.suspects(t0 + W).is_empty());
    }

    #[test]
    fn only_suspects_with_records_past_their_position_are_stalled() {
        let suspects = vec![(tp(0), 5), (tp(1), 7), (tp(2), -1001), (tp(3), 3)];
        // Partition 1 is idle (nothing past 7); 2's position is unknown
        // and Kafka holds records; 3's end could not be queried.
        let ends = BTreeMap::from([(tp(0), 8), (tp(1), 7), (tp(2), 4)]);
        let found = stalled(&suspects, &ends);
        assert_eq!(
            found,
            vec![
                Stalled {
                    tp: tp(0),
                    next: 5,
                    end: 8
                },
                Stalled {
                    tp: tp(2),
                    next: -1001,
                    end: 4
                },
            ]
        );
        assert_eq!(found[0].to_string(), "t/0 (3 records waiting unread)");
        assert_eq!(found[1].to_string(), "t/2 (4 records waiting unread)");
    }
}
