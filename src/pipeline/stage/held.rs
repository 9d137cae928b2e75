//! The trades the stage holds back (docs/design.md, "Holding partial
//! buckets under a backlog"), by customer, and which of them the next
//! write takes.
//!
//! A customer's held trades part-fill a bucket, and the writer said what
//! that bucket takes before it is full ([`Room`]). A batch whose trades of
//! that customer all fit in it would only be held again, so they are held
//! without being planned: marked [`Outcome::Held`] before the write, which
//! passes them by. Each trade counts as if it were accepted (a duplicate
//! takes no room in the plan), so the stage hands a customer to the writer
//! no later than the writer would fill its bucket. Without this, every
//! held trade was taken out, planned, held and put back with every batch
//! that brought its customer: several times per trade under a backlog.

use std::collections::HashMap;

use std::time::Duration;

use tokio::time::Instant as TokioInstant;

use super::super::seams::Record;
use crate::bucket::plan::Room;
use crate::bucket::size;
use crate::bucket::writer::Outcome;
use crate::event::{CustomerId, Source, Trade};

/// A trade a batch held back ([`Outcome::Held`]), with its record: its
/// offset stays uncommitted, and a write may still dead-letter it, until a
/// later batch writes it.
pub(super) struct Held {
    pub event: (Trade, Source),
    pub record: Record,
    /// When it was first held: `batch.hold_max_age` counts from here.
    pub since: TokioInstant,
}

/// One customer's held trades.
struct List {
    /// In stream order: the tail of its trades so far, its oldest first.
    trades: Vec<Held>,
    /// What the bucket they part-fill takes before it is full, as the
    /// writer said when it held them, less what was held since unplanned.
    room: Room,
    /// While a batch is taken: one of its trades does not fit in `room`.
    overflows: bool,
}

/// What a write that may hold takes (see [`HeldTrades::take_due`]).
pub(super) struct Due {
    /// Held trades to write first: those past their age, then those of the
    /// batch's customers whose trades do not all fit.
    pub taken: Vec<Held>,
    /// How many of `taken` are past their age.
    pub expired: usize,
    /// One per event of the batch: `Held` for those that fit, held
    /// unplanned; `Pending` for the others.
    pub outcomes: Vec<Outcome>,
}

/// Held trades by customer.
#[derive(Default)]
pub(super) struct HeldTrades {
    // foldhash, as the writer's maps: a lookup per event of every batch.
    lists: HashMap<CustomerId, List, foldhash::fast::RandomState>,
    /// How many trades `lists` holds.
    count: usize,
}

impl HeldTrades {
    pub fn count(&self) -> usize {
        self.count
    }

    /// Forgets what every held customer's bucket takes: after a
    /// revocation the writer reloads its buckets, so it decides again.
    pub fn forget_rooms(&mut self) {
        for list in self.lists.values_mut() {
            list.room = Room::default();
        }
    }

    /// Every held trade, for a write that holds nothing.
    pub fn take_all(&mut self) -> Vec<Held> {
        let mut all = Vec::with_capacity(self.count);
        self.lists
            .drain()
            .for_each(|(_, list)| all.extend(list.trades));
        self.count = 0;
        all
    }

    /// What a write of `events` that may hold takes: the held trades of
    /// customers whose oldest is `max_age` old (written whole), then those
    /// of `events`' customers whose trades in `events` do not all fit in
    /// their bucket; the others wait, unplanned, and so do the trades of
    /// `events` that fit, marked held.
    pub fn take_due(
        &mut self,
        events: &[(Trade, Source)],
        now: TokioInstant,
        max_age: Duration,
    ) -> Due {
        let mut taken = Vec::new();
        // A customer's list is in stream order, so its first is its oldest.
        self.lists.retain(|_, list| {
            let young = list
                .trades
                .first()
                .is_some_and(|h| now.duration_since(h.since) < max_age);
            if !young {
                taken.append(&mut list.trades);
            }
            young
        });
        let expired = taken.len();
        for (trade, source) in events {
            if let Some(list) = self.lists.get_mut(&trade.customer) {
                list.overflows |= !list.room.take(size::charge(trade, source));
            }
        }
        let outcomes = events
            .iter()
            .map(|(trade, _)| {
                let customer = &trade.customer;
                match self.lists.get(customer).map(|l| (l.overflows, l.room)) {
                    Some((false, room)) => Outcome::Held(room),
                    Some((true, _)) => {
                        taken.extend(
                            self.lists
                                .remove(customer)
                                .into_iter()
                                .flat_map(|l| l.trades),
                        );
                        Outcome::Pending
                    }
                    None => Outcome::Pending,
                }
            })
            .collect();
        self.count -= taken.len();
        Due {
            taken,
            expired,
            outcomes,
        }
    }

    /// Adds `held` at the end of its customer's list, whose bucket now
    /// takes `room`.
    pub fn keep(&mut self, held: Held, room: Room) {
        self.count += 1;
        let customer = &held.event.0.customer;
        match self.lists.get_mut(customer) {
            // Grown as a `Vec` grows, not exactly: a batch keeps a
            // customer's held trades one by one, and growing by one
            // reallocated and copied the whole list for each (about 1 % of
            // the worker's pipeline thread on a keyed backlog,
            // docs/benchmarks.md, "Session 35"). Doubling leaves a list no
            // more spare room than its own length, which is less than a
            // bucket's.
            Some(list) => {
                list.trades.push(held);
                list.room = room;
            }
            None => {
                let customer = customer.clone();
                let list = List {
                    trades: vec![held],
                    room,
                    overflows: false,
                };
                self.lists.insert(customer, list);
            }
        }
    }
}

#[cfg(test)]
mod tests;
