//! Offset tracking: which offset each partition may commit. Pure.
//!
//! A partition may commit only the contiguous prefix of consumed offsets
//! whose events are durably handled (written, already stored, or
//! dead-lettered). A later success never lets the commit jump over an
//! earlier event still in flight: that is the bug to avoid (vector#24215).
//!
//! Committed values follow Kafka's convention: the offset of the *next*
//! message to read, i.e. last handled offset + 1.

use std::collections::{BTreeMap, VecDeque};

/// A topic and partition.
pub type TopicPartition = (std::sync::Arc<str>, i32);

/// A partition's consumed offsets not yet handled. Kafka delivers a
/// partition's records in offset order, so an offset is nearly always
/// consumed above every one before it: a deque in ascending order takes it
/// at its back, and a handled one is found by binary search and marked,
/// its slot dropped once every offset below it is handled too. (A
/// `BTreeSet` did the same with a tree node walk per insert and removal:
/// 5 % of the worker's instructions.) An offset consumed out of order
/// (a partition handed back while an older batch still holds some of its
/// records) is put in its place; consumed again while in flight, it stays
/// one entry, as in a set.
#[derive(Debug, Default, Clone)]
struct InFlight {
    /// Ascending offsets, each with whether it is handled yet. The front
    /// one is never handled.
    slots: VecDeque<(i64, bool)>,
    /// How many slots are not handled.
    live: usize,
    /// The slot after the last one handled: where the next handled offset
    /// usually is, as a batch's records are handled in the order they were
    /// consumed. Only a guess, checked before use: a wrong one costs the
    /// binary search it spares.
    next: usize,
}

impl InFlight {
    fn insert(&mut self, offset: i64) {
        match self.slots.back() {
            Some(&(last, _)) if last >= offset => self.insert_within(offset),
            _ => {
                self.slots.push_back((offset, false));
                self.live += 1;
            }
        }
    }

    /// The rare path: `offset` is not above every slot.
    fn insert_within(&mut self, offset: i64) {
        match self.slots.binary_search_by_key(&offset, |&(o, _)| o) {
            Ok(i) => {
                let handled = &mut self.slots[i].1;
                if *handled {
                    *handled = false;
                    self.live += 1;
                }
            }
            Err(i) => {
                self.slots.insert(i, (offset, false));
                self.live += 1;
            }
        }
    }

    fn remove(&mut self, offset: i64) {
        let i = match self.slots.get(self.next) {
            Some(&(o, _)) if o == offset => self.next,
            _ => match self.slots.binary_search_by_key(&offset, |&(o, _)| o) {
                Ok(i) => i,
                Err(_) => return,
            },
        };
        self.next = i + 1;
        if std::mem::replace(&mut self.slots[i].1, true) {
            return;
        }
        self.live -= 1;
        while self.slots.front().is_some_and(|&(_, handled)| handled) {
            self.slots.pop_front();
            self.next = self.next.saturating_sub(1);
        }
        // Held trades can keep the front in flight while thousands behind
        // it are handled: drop handled slots once they are most of them.
        if self.slots.len() > 2 * self.live + 64 {
            self.slots.retain(|&(_, handled)| !handled);
            self.next = 0;
        }
    }

    fn first(&self) -> Option<i64> {
        self.slots.front().map(|&(o, _)| o)
    }

    fn is_empty(&self) -> bool {
        self.live == 0
    }

    fn len(&self) -> usize {
        self.live
    }
}

#[derive(Debug, Default, Clone)]
struct Track {
    /// Consumed but not yet handled.
    in_flight: InFlight,
    /// Highest offset consumed so far.
    highest: Option<i64>,
    /// The last value handed out for commit.
    committed: Option<i64>,
    /// The first offset consumed since assignment: the commit never needs
    /// to name anything at or below it until it advances.
    start: Option<i64>,
}

impl Track {
    /// The next offset to read after the contiguous handled prefix, if
    /// anything at all has been handled since `start`.
    fn next(&self, start: i64) -> Option<i64> {
        let next = match self.in_flight.first() {
            // Everything below the oldest in-flight offset is handled; the
            // oldest in-flight one is where a restart must resume.
            Some(oldest) => oldest,
            None => self.highest? + 1,
        };
        (next > start).then_some(next)
    }
}

#[derive(Debug, Default, Clone)]
pub struct OffsetTracker {
    parts: BTreeMap<TopicPartition, Track>,
    /// Once frozen (see [`OffsetTracker::freeze`]): the highest commit each
    /// partition may still make. A partition without one commits nothing.
    ceiling: Option<BTreeMap<TopicPartition, i64>>,
}

impl OffsetTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// A message was consumed and is now in flight.
    pub fn consumed(&mut self, tp: &TopicPartition, offset: i64) {
        // Called once per record: the key is copied only for a partition's
        // first one (`entry` would take an owned key every time).
        let t = match self.parts.get_mut(tp) {
            Some(t) => t,
            None => self.parts.entry(tp.clone()).or_default(),
        };
        t.in_flight.insert(offset);
        t.highest = Some(t.highest.map_or(offset, |h| h.max(offset)));
        t.start.get_or_insert(offset);
    }

    /// The offset after the newest one consumed from `tp`, if any.
    pub fn next_to_consume(&self, tp: &TopicPartition) -> Option<i64> {
        self.parts.get(tp)?.highest.map(|h| h + 1)
    }

    /// The message's event is durably handled.
    pub fn handled(&mut self, tp: &TopicPartition, offset: i64) {
        self.handled_all([(tp, offset)]);
    }

    /// These messages' events are durably handled. A batch's records come
    /// in runs of one partition (a fetch response's worth), so the
    /// partition is looked up once a run, not once a record.
    pub fn handled_all<'a>(&mut self, done: impl IntoIterator<Item = (&'a TopicPartition, i64)>) {
        let mut done = done.into_iter().peekable();
        while let Some((tp, offset)) = done.next() {
            let Some(t) = self.parts.get_mut(tp) else {
                continue;
            };
            t.in_flight.remove(offset);
            while let Some((_, offset)) = done.next_if(|&(next, _)| next == tp) {
                t.in_flight.remove(offset);
            }
            if t.in_flight.is_empty() && t.highest.is_none() {
                self.parts.remove(tp); // revoked, and its last record is done
            }
        }
    }

    /// The partition was taken from us. What we consumed of it belongs to
    /// its next owner, which re-reads from the last commit: its progress
    /// here is forgotten. Its records still in flight are kept, though:
    /// with batches in flight, the partition can be handed straight back
    /// while an older batch still holds its records, and a commit of the
    /// new assignment must not pass them before they are handled.
    pub fn revoked(&mut self, tp: &TopicPartition) {
        let Some(t) = self.parts.get_mut(tp) else {
            return;
        };
        if t.in_flight.is_empty() {
            self.parts.remove(tp);
        } else {
            t.highest = None;
            t.committed = None;
            t.start = None;
        }
    }

    /// From now on, no partition commits past what has been consumed so
    /// far: for when the client reports that it skipped records of some
    /// partition without saying which. Records consumed before the report
    /// still commit (a partition's records and errors arrive in order);
    /// records consumed after it never do. A second freeze keeps the first
    /// one's ceilings.
    pub fn freeze(&mut self) {
        if self.ceiling.is_none() {
            let ceiling = self
                .parts
                .iter()
                .filter_map(|(tp, t)| Some((tp.clone(), t.highest? + 1)))
                .collect();
            self.ceiling = Some(ceiling);
        }
    }

    /// Offsets (next to read) that advanced since the last call, per
    /// partition that `owned` accepts (the current assignment), and marks
    /// them as handed out. A partition given away commits nothing here: its
    /// new owner commits it.
    pub fn take_commits(
        &mut self,
        owned: impl Fn(&TopicPartition) -> bool,
    ) -> Vec<(TopicPartition, i64)> {
        let mut out = Vec::new();
        for (tp, t) in self.parts.iter_mut().filter(|(tp, _)| owned(tp)) {
            let start = t.start.unwrap_or(i64::MIN);
            let cap = match &self.ceiling {
                None => i64::MAX,
                Some(ceiling) => ceiling.get(tp).copied().unwrap_or(i64::MIN),
            };
            if let Some(next) = t.next(start).map(|n| n.min(cap)) {
                if next > start && t.committed.is_none_or(|c| next > c) {
                    t.committed = Some(next);
                    out.push((tp.clone(), next));
                }
            }
        }
        out
    }

    /// Events consumed and not yet handled, over all partitions.
    pub fn in_flight(&self) -> usize {
        self.parts.values().map(|t| t.in_flight.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tp(p: i32) -> TopicPartition {
        ("t".into(), p)
    }

    fn all(_: &TopicPartition) -> bool {
        true
    }

    #[test]
    fn a_frozen_tracker_commits_only_what_was_consumed_before() {
        let mut t = OffsetTracker::new();
        for o in 0..4 {
            t.consumed(&tp(0), o);
        }
        t.freeze();
        // Consumed after the freeze: maybe past records the client skipped.
        t.consumed(&tp(0), 7);
        t.consumed(&tp(1), 0);
        for (p, o) in [(0, 0), (0, 1), (0, 2), (0, 3), (0, 7), (1, 0)] {
            t.handled(&tp(p), o);
        }
        assert_eq!(t.take_commits(all), vec![(tp(0), 4)]);
        t.freeze();
        t.consumed(&tp(0), 8);
        t.handled(&tp(0), 8);
        assert!(
            t.take_commits(all).is_empty(),
            "a second freeze raises nothing"
        );
    }

    #[test]
    fn commits_the_next_offset_after_the_contiguous_prefix() {
        let mut t = OffsetTracker::new();
        for o in 10..15 {
            t.consumed(&tp(0), o);
        }
        assert!(t.take_commits(all).is_empty(), "nothing handled yet");
        t.handled(&tp(0), 10);
        t.handled(&tp(0), 12); // a later success...
        assert_eq!(
            t.take_commits(all),
            vec![(tp(0), 11)],
            "...does not skip 11"
        );
        t.handled(&tp(0), 11);
        assert_eq!(t.take_commits(all), vec![(tp(0), 13)]);
        t.handled(&tp(0), 13);
        t.handled(&tp(0), 14);
        assert_eq!(
            t.take_commits(all),
            vec![(tp(0), 15)],
            "offset + 1 convention"
        );
        assert!(t.take_commits(all).is_empty(), "nothing new to commit");
    }

    #[test]
    fn gaps_in_offsets_are_not_waited_for() {
        // Compaction and transaction markers leave holes; only consumed
        // offsets count.
        let mut t = OffsetTracker::new();
        for o in [3, 7, 20] {
            t.consumed(&tp(1), o);
            t.handled(&tp(1), o);
        }
        assert_eq!(t.take_commits(all), vec![(tp(1), 21)]);
    }

    #[test]
    fn partitions_are_independent_and_can_be_dropped() {
        let mut t = OffsetTracker::new();
        t.consumed(&tp(0), 0);
        t.consumed(&tp(1), 0);
        t.handled(&tp(1), 0);
        assert_eq!(t.take_commits(all), vec![(tp(1), 1)]);
        assert_eq!(t.in_flight(), 1);
        t.revoked(&tp(0));
        let theirs = |p: &TopicPartition| *p != tp(0);
        t.handled(&tp(0), 0); // late completion after revoke
        assert!(t.take_commits(theirs).is_empty());
        assert_eq!(t.in_flight(), 0);
        assert!(
            t.take_commits(all).is_empty(),
            "a revoked partition's progress is forgotten"
        );
    }

    /// Two batches in flight: partition 0 is revoked while the older batch
    /// still holds its offsets 0..3, then handed straight back, and the
    /// newer batch (offsets 3..6, where librdkafka resumes) finishes
    /// first. Its commit must not pass the older batch's records.
    #[test]
    fn a_partition_handed_back_waits_for_its_older_batch() {
        let mut t = OffsetTracker::new();
        for o in 0..3 {
            t.consumed(&tp(0), o);
        }
        t.revoked(&tp(0));
        for o in 3..6 {
            t.consumed(&tp(0), o);
            t.handled(&tp(0), o);
        }
        assert!(
            t.take_commits(all).is_empty(),
            "offsets 0..3 are still being written"
        );
        for o in 0..3 {
            t.handled(&tp(0), o);
        }
        assert_eq!(t.take_commits(all), vec![(tp(0), 6)]);
    }

    /// What a step of [`in_flight_is_a_set`] does.
    #[derive(Debug, Clone)]
    enum Step {
        /// Consume the offset this far above the highest so far (0: again).
        Next(i64),
        /// Consume an offset at or below the highest (a partition handed
        /// back, re-read from its last commit).
        Back(proptest::sample::Index),
        /// Handle one of the offsets consumed so far (maybe again).
        Handle(proptest::sample::Index),
        /// Handle the second-oldest in flight: records handled in order
        /// behind a held one, the path `InFlight::next` guesses right on.
        AfterOldest,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0i64..4).prop_map(Step::Next),
            1 => any::<proptest::sample::Index>().prop_map(Step::Back),
            6 => any::<proptest::sample::Index>().prop_map(Step::Handle),
            4 => Just(Step::AfterOldest),
        ]
    }

    proptest! {
        /// The deque of in-flight offsets behaves as the set it replaced:
        /// after every step the same oldest offset and the same count,
        /// whatever the order of consuming and handling.
        #[test]
        fn in_flight_is_a_set(steps in proptest::collection::vec(step(), 0..400)) {
            let mut deque = InFlight::default();
            let mut set = std::collections::BTreeSet::new();
            let mut seen: Vec<i64> = Vec::new();
            for s in steps {
                match s {
                    Step::Next(gap) => {
                        let o = seen.iter().max().map_or(0, |m| m + gap);
                        seen.push(o);
                        deque.insert(o);
                        set.insert(o);
                    }
                    Step::Back(ix) if !seen.is_empty() => {
                        let o = seen[ix.index(seen.len())];
                        deque.insert(o);
                        set.insert(o);
                    }
                    Step::Handle(ix) if !seen.is_empty() => {
                        let o = seen[ix.index(seen.len())];
                        deque.remove(o);
                        set.remove(&o);
                    }
                    Step::AfterOldest => {
                        if let Some(&o) = set.iter().nth(1) {
                            deque.remove(o);
                            set.remove(&o);
                        }
                    }
                    _ => {}
                }
                prop_assert_eq!(deque.first(), set.first().copied());
                prop_assert_eq!(deque.len(), set.len());
                prop_assert_eq!(deque.is_empty(), set.is_empty());
                prop_assert!(deque.slots.len() <= 2 * deque.live + 65);
            }
        }

        /// Handling a batch's records at once is handling them one by one:
        /// the same commits and the same count in flight, over partitions
        /// interleaved in runs and records handled twice or never consumed.
        #[test]
        fn handled_all_is_handled_one_by_one(
            consumed in proptest::collection::vec((0i32..3, 0i64..40), 0..80),
            done in proptest::collection::vec((0i32..4, 0i64..45), 0..80),
            revoke in proptest::option::of(0i32..3),
        ) {
            let (mut singly, mut together) = (OffsetTracker::new(), OffsetTracker::new());
            for &(p, o) in &consumed {
                singly.consumed(&tp(p), o);
                together.consumed(&tp(p), o);
            }
            if let Some(p) = revoke {
                singly.revoked(&tp(p));
                together.revoked(&tp(p));
            }
            let done: Vec<(TopicPartition, i64)> = done.into_iter().map(|(p, o)| (tp(p), o)).collect();
            for (tp, o) in &done {
                singly.handled(tp, *o);
            }
            together.handled_all(done.iter().map(|(tp, o)| (tp, *o)));
            prop_assert_eq!(singly.in_flight(), together.in_flight());
            prop_assert_eq!(singly.take_commits(all), together.take_commits(all));
        }

        /// Whatever order events complete in, the commit is always exactly
        /// the first unhandled consumed offset (or last + 1), and never
        /// moves backwards.
        #[test]
        fn commit_is_the_contiguous_prefix(
            n in 1usize..60,
            order in proptest::collection::vec(any::<proptest::sample::Index>(), 0..60),
            gaps in proptest::collection::vec(1i64..4, 60),
        ) {
            let offsets: Vec<i64> = gaps.iter().take(n).scan(100i64, |acc, g| { *acc += g; Some(*acc) }).collect();
            let mut t = OffsetTracker::new();
            for &o in &offsets { t.consumed(&tp(0), o); }
            let mut handled = vec![false; n];
            let mut last = None;
            for ix in order {
                let i = ix.index(n);
                handled[i] = true;
                t.handled(&tp(0), offsets[i]);
                let expected = match handled.iter().position(|h| !h) {
                    Some(0) => None,
                    Some(first) => Some(offsets[first]),
                    None => Some(offsets[n - 1] + 1),
                };
                let got = t.take_commits(all).first().map(|(_, o)| *o);
                if expected != last {
                    prop_assert_eq!(got, expected);
                    last = expected;
                } else {
                    prop_assert_eq!(got, None);
                }
            }
        }
    }
}
