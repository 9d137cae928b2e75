//! `tradebucket reconcile`: every record the consumer group has committed
//! past, checked against what the product promised for it: a trade stored
//! once under its customer, or a bad record dead-lettered.
//!
//! This module is the pure part: which offsets to read ([`span`]), and the
//! verdict on each record ([`Ledger`]). [`io`] reads the source partitions
//! and the dead-letter topics, looks the trades up in MongoDB and replays
//! the missing ones. `docs/operations.md` ("A customer says a trade is
//! missing") says how operators use it.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use serde::Serialize;

use crate::bucket::id::Prefix;
use crate::event::{CustomerId, Source};

pub mod io;
mod known;
#[cfg(test)]
mod tests;

/// Problems listed in full; the counts cover them all.
pub const LISTED_PROBLEMS: usize = 1_000;

/// What is wrong with one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    /// Neither stored nor dead-lettered: lost.
    Missing,
    /// Stored only under another customer, and not dead-lettered.
    Misfiled,
    /// Its trade key is stored more than once.
    StoredTwice,
    /// Dead-lettered, yet its trade is stored under its customer.
    DeadLetteredAndStored,
}

impl ProblemKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProblemKind::Missing => "missing",
            ProblemKind::Misfiled => "misfiled",
            ProblemKind::StoredTwice => "stored_twice",
            ProblemKind::DeadLetteredAndStored => "dead_lettered_and_stored",
        }
    }
}

/// One problem, at the source position of its record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Problem {
    pub kind: ProblemKind,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The trade key; none for a record that is not a trade.
    pub key: Option<String>,
    /// The buckets holding the key.
    pub buckets: Vec<String>,
}

/// Where reading a partition starts, as asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The earliest offset Kafka retains.
    Earliest,
    /// An offset (`--from`, or the first at or after `--since`).
    At(i64),
}

/// The offsets of one partition to check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Span {
    pub topic: String,
    pub partition: i32,
    /// First offset read.
    pub from: i64,
    /// End (exclusive): the group's committed offset, or with `--to-end`
    /// the partition's end.
    pub to: i64,
    /// Set when retention removed records asked for: the answer holds from
    /// this offset on.
    pub retained_from: Option<i64>,
    /// The group has no committed offset here: nothing was promised yet.
    pub uncommitted: bool,
}

/// The span of a partition whose records Kafka retains in `low..high`.
pub fn span(
    (topic, partition): (&str, i32),
    (low, high): (i64, i64),
    committed: Option<i64>,
    start: Start,
    to_end: bool,
) -> Span {
    let asked = match start {
        Start::Earliest => low,
        Start::At(o) => o,
    };
    let to = if to_end { Some(high) } else { committed };
    let from = asked.max(low);
    Span {
        topic: topic.to_string(),
        partition,
        from,
        to: to.unwrap_or(from).clamp(from, high.max(from)),
        // Asked from the earliest, the records retention removed are as
        // unanswerable as those asked for by offset.
        retained_from: (asked < low || (start == Start::Earliest && low > 0)).then_some(low),
        uncommitted: to.is_none(),
    }
}

/// Counts of one partition (or of all).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Records read and classified.
    pub records: u64,
    /// Trades stored once under their customer.
    pub stored: u64,
    /// Records whose trade key an earlier record already had (not a problem).
    pub upstream_duplicates: u64,
    /// Records (bad, or refused by the writer) with their dead letter.
    pub dead_lettered: u64,
    /// Of those, refused trades stored by a replay of their dead letter
    /// that was read too (`tradebucket.replay.of` naming them).
    pub dead_letters_replayed: u64,
    /// Of those, with more than one dead letter (at least once: a
    /// partition moved between the dead letter and its commit).
    pub dead_letters_repeated: u64,
    /// Offsets in the span Kafka holds no record at (compaction,
    /// transaction markers).
    pub gaps: u64,
    pub problems: u64,
}

impl Counts {
    fn add(&mut self, o: &Counts) {
        self.records += o.records;
        self.stored += o.stored;
        self.upstream_duplicates += o.upstream_duplicates;
        self.dead_lettered += o.dead_lettered;
        self.dead_letters_repeated += o.dead_letters_repeated;
        self.dead_letters_replayed += o.dead_letters_replayed;
        self.gaps += o.gaps;
        self.problems += o.problems;
    }
}

/// A trade read from the source, with what MongoDB holds of it.
#[derive(Debug, Clone)]
pub struct TradeSeen<'a> {
    pub at: &'a Source,
    pub customer: &'a CustomerId,
    /// Its key, and the key an earlier version stored a replay of it under
    /// (`r:<position>` for a trade without `tradeId`).
    pub keys: &'a [String],
    /// The buckets holding any of `keys` (one entry per stored copy).
    pub buckets: &'a [String],
}

/// The verdicts so far: counts per partition, the problems listed, and the
/// two indexes reconcile keeps. The dead letters' source positions are the
/// only index of records; the trade keys seen are kept as 64-bit hashes
/// (8 bytes each, to tell an upstream duplicate from the first copy), so
/// memory stays bounded by the topic's distinct trades, not its bytes. Two
/// keys sharing a hash (about one chance in 10^7 at a billion trades) make
/// the later one count as an upstream duplicate instead of stored: neither
/// is a problem, so a collision never hides one.
///
/// Keys are hashed by slot: sharded, a trade id is unique per customer,
/// so customer 8's `t:X` is not customer 7's, neither as an upstream
/// duplicate nor as a double already reported.
#[derive(Debug, Default)]
pub struct Ledger {
    dead_letters: HashMap<Source, u32>,
    seen: HashSet<u64>,
    /// The keys of every trade reported stored twice: each double is said
    /// once, at the first record read of it, whatever that record is (the
    /// original or a replay, in whichever partition is read first).
    doubled: HashSet<u64>,
    /// Sharded mode: keys are the customer's.
    sharded: bool,
    /// The positions replays read so far name (`tradebucket.replay.of`).
    replays: HashSet<Source>,
    /// Dead-lettered trades found stored before any replay of them was
    /// read: problems until one is ([`Ledger::replay_of`]).
    unreplayed: HashSet<Source>,
    pub counts: BTreeMap<(String, i32), Counts>,
    pub problems: Vec<Problem>,
    pub by_kind: BTreeMap<ProblemKind, u64>,
}

/// What became of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Stored,
    UpstreamDuplicate,
    DeadLettered,
    /// Dead-lettered, refused by the writer, and stored by a replay of
    /// its dead letter that was read before it.
    Replayed,
    Problem(ProblemKind),
}

impl Ledger {
    /// A ledger matching records against these dead letters' sources.
    pub fn new(dead_letter_sources: impl IntoIterator<Item = Source>) -> Ledger {
        let mut dead_letters = HashMap::new();
        for s in dead_letter_sources {
            *dead_letters.entry(s).or_insert(0) += 1;
        }
        Ledger {
            dead_letters,
            ..Ledger::default()
        }
    }

    /// A record that is not a trade: it must have its dead letter.
    pub fn bad(&mut self, at: &Source) -> Verdict {
        let verdict = match self.dead_letters.get(at) {
            Some(_) => Verdict::DeadLettered,
            None => Verdict::Problem(ProblemKind::Missing),
        };
        self.record(at, None, &[], verdict)
    }

    /// Keys hashed per customer, as sharded mode's unique index holds them.
    pub fn sharded(mut self, sharded: bool) -> Ledger {
        self.sharded = sharded;
        self
    }

    /// A trade: stored once under its customer, or dead-lettered.
    pub fn trade(&mut self, t: &TradeSeen<'_>) -> Verdict {
        let own = Prefix::of(t.customer);
        let own_copies = t
            .buckets
            .iter()
            .filter(|b| Prefix::of_id(b).as_ref() == Some(&own))
            .count();
        let hashes: Vec<u64> = t
            .keys
            .iter()
            .map(|k| slot_hash(self.sharded.then_some(&own), k))
            .collect();
        // Every key goes in (no short circuit): a later replay of this
        // record, or a copy stored under a version's older key, is its
        // upstream duplicate.
        let mut first = true;
        for h in &hashes {
            first &= self.seen.insert(*h);
        }
        // A double is said whatever was read before: it is judged before
        // the upstream duplicate, so reading a replay (or another
        // customer's same id) first cannot hide the two copies.
        let doubled = t.buckets.len() > 1 && !hashes.iter().any(|h| self.doubled.contains(h));
        if doubled {
            self.doubled.extend(&hashes);
        }
        let verdict = match (self.dead_letters.contains_key(t.at), own_copies) {
            (true, 0) => Verdict::DeadLettered,
            (true, _) if self.replays.contains(t.at) => Verdict::Replayed,
            (true, _) => {
                self.unreplayed.insert(t.at.clone());
                Verdict::Problem(ProblemKind::DeadLetteredAndStored)
            }
            (false, _) if t.buckets.is_empty() => Verdict::Problem(ProblemKind::Missing),
            (false, 0) => Verdict::Problem(ProblemKind::Misfiled),
            (false, _) if doubled => Verdict::Problem(ProblemKind::StoredTwice),
            (false, _) if !first || t.buckets.len() > 1 => Verdict::UpstreamDuplicate,
            (false, _) => Verdict::Stored,
        };
        self.record(t.at, t.keys.first(), t.buckets, verdict)
    }

    /// A replay of the record at `origin` was read: a refused trade
    /// there that is stored was put right by `dlq replay` (or stored by
    /// `--replay-missing` and dead-lettered by a lagging worker), not a
    /// problem, whichever of the two was read first.
    pub fn replay_of(&mut self, origin: Source) {
        if !self.unreplayed.remove(&origin) {
            self.replays.insert(origin);
            return;
        }
        let kind = ProblemKind::DeadLetteredAndStored;
        let c = self.partition(&origin.topic, origin.partition);
        c.problems -= 1;
        c.dead_lettered += 1;
        c.dead_letters_replayed += 1;
        if let Some(n) = self.by_kind.get_mut(&kind) {
            *n -= 1;
            if *n == 0 {
                self.by_kind.remove(&kind);
            }
        }
        self.problems.retain(|p| {
            let here = *p.topic == *origin.topic
                && p.partition == origin.partition
                && p.offset == origin.offset;
            p.kind != kind || !here
        });
        self.replays.insert(origin);
    }

    /// Offsets Kafka holds no record at.
    pub fn gaps(&mut self, topic: &str, partition: i32, n: u64) {
        self.partition(topic, partition).gaps += n;
    }

    fn partition(&mut self, topic: &str, partition: i32) -> &mut Counts {
        self.counts
            .entry((topic.to_string(), partition))
            .or_default()
    }

    fn record(
        &mut self,
        at: &Source,
        key: Option<&String>,
        buckets: &[String],
        verdict: Verdict,
    ) -> Verdict {
        let repeated = self.dead_letters.get(at).is_some_and(|n| *n > 1);
        let c = self.partition(&at.topic, at.partition);
        c.records += 1;
        match verdict {
            Verdict::Stored => c.stored += 1,
            Verdict::UpstreamDuplicate => c.upstream_duplicates += 1,
            Verdict::DeadLettered | Verdict::Replayed => {
                c.dead_lettered += 1;
                c.dead_letters_repeated += u64::from(repeated);
                c.dead_letters_replayed += u64::from(verdict == Verdict::Replayed);
            }
            Verdict::Problem(kind) => {
                c.problems += 1;
                *self.by_kind.entry(kind).or_default() += 1;
                if self.problems.len() < LISTED_PROBLEMS {
                    self.problems.push(Problem {
                        kind,
                        topic: at.topic.to_string(),
                        partition: at.partition,
                        offset: at.offset,
                        key: key.cloned(),
                        buckets: buckets.to_vec(),
                    });
                }
            }
        }
        verdict
    }

    /// The counts of every partition together.
    pub fn total(&self) -> Counts {
        let mut total = Counts::default();
        for c in self.counts.values() {
            total.add(c);
        }
        total
    }
}

/// A fixed hash (SipHash with zero keys) of a key, after its customer's
/// `_id` prefix when sharded (a prefix ends at its only `_`, so the two
/// never run together ambiguously): the same slot, the same hash.
fn slot_hash(customer: Option<&Prefix>, key: &str) -> u64 {
    let mut h = DefaultHasher::new();
    if let Some(prefix) = customer {
        prefix.as_str().hash(&mut h);
    }
    key.hash(&mut h);
    h.finish()
}

/// The keys a trade may be stored under: its own, and for one identified by
/// its position (`o:`), the key versions before issue #46 stored a replay
/// of that position under (`r:`). A replay is now stored under its
/// original's `o:` key; a copy under each is a double.
pub fn keys_of(key: &str) -> Vec<String> {
    match key.strip_prefix("o:") {
        Some(position) => vec![key.to_string(), format!("r:{position}")],
        None => vec![key.to_string()],
    }
}
