//! One write's events in stream order, as two slices read as one: the
//! trades earlier batches held back, then the batch's own. Joining them in
//! one vector copied every event of every batch (tens of thousands, some
//! 160 bytes each, into memory no cache held) only to put a few held
//! trades in front: a tenth of the worker's memory traffic
//! (docs/benchmarks.md, "Session 32").

use crate::event::{Source, Trade};

/// Events `0..first.len()` are `first`'s, the rest `rest`'s.
#[derive(Debug, Clone, Copy)]
pub struct Events<'a> {
    first: &'a [(Trade, Source)],
    rest: &'a [(Trade, Source)],
}

impl<'a> Events<'a> {
    /// `first`, then `rest`.
    pub fn new(first: &'a [(Trade, Source)], rest: &'a [(Trade, Source)]) -> Self {
        Events { first, rest }
    }

    /// The events of one slice.
    pub fn of(all: &'a [(Trade, Source)]) -> Self {
        Events::new(all, &[])
    }

    pub fn len(&self) -> usize {
        self.first.len() + self.rest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Event `i`. Panics past the end, as indexing a slice does.
    pub fn get(&self, i: usize) -> &'a (Trade, Source) {
        match i.checked_sub(self.first.len()) {
            None => &self.first[i],
            Some(j) => &self.rest[j],
        }
    }

    /// Every event, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a (Trade, Source)> + use<'a> {
        self.first.iter().chain(self.rest)
    }
}

impl<'a> From<&'a [(Trade, Source)]> for Events<'a> {
    fn from(all: &'a [(Trade, Source)]) -> Self {
        Events::of(all)
    }
}

impl<'a> From<&'a Vec<(Trade, Source)>> for Events<'a> {
    fn from(all: &'a Vec<(Trade, Source)>) -> Self {
        Events::of(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::CustomerId;
    use mongodb::bson::RawDocumentBuf;

    fn event(offset: i64) -> (Trade, Source) {
        let trade = Trade {
            key: format!("o:t/0/{offset}").into(),
            legacy_key: None,
            customer: CustomerId::Int(1),
            ticker: "X".into(),
            date_ms: 0,
            doc: RawDocumentBuf::new(),
        };
        let source = Source {
            topic: "t".into(),
            partition: 0,
            offset,
        };
        (trade, source)
    }

    fn offsets(events: Events<'_>) -> Vec<i64> {
        events.iter().map(|(_, s)| s.offset).collect()
    }

    #[test]
    fn reads_first_then_rest_by_index_and_in_order() {
        let (first, rest) = ([event(7), event(8)], [event(1), event(2), event(3)]);
        let events = Events::new(&first, &rest);
        assert_eq!(events.len(), 5);
        assert_eq!(offsets(events), [7, 8, 1, 2, 3]);
        let by_index: Vec<i64> = (0..5).map(|i| events.get(i).1.offset).collect();
        assert_eq!(by_index, [7, 8, 1, 2, 3]);
    }

    #[test]
    fn either_part_may_be_empty() {
        let some = [event(1), event(2)];
        assert_eq!(offsets(Events::of(&some)), [1, 2]);
        assert_eq!(offsets(Events::new(&[], &some)), [1, 2]);
        assert_eq!(Events::new(&some, &[]).get(1).1.offset, 2);
        assert!(Events::of(&[]).is_empty());
    }

    #[test]
    #[should_panic]
    fn past_the_end_panics_like_a_slice() {
        let some = [event(1)];
        Events::new(&some, &some).get(2);
    }
}
