//! The batch's Avro and Protobuf records whose writer's schema was not in
//! memory when the batch closed: their schemas are fetched here, in the
//! stage, before the batch is written, so the loop never waits on the
//! registry. While the registry is unavailable the fetch is retried with
//! the one backoff policy and the batch waits, as a batch waits through a
//! MongoDB outage: the loop goes on polling until its in-flight bound
//! pauses the partitions, nothing is committed past the waiting records,
//! nothing is dead-lettered for it, and `/readyz` names the registry.

use super::*;
use crate::health::Change;

impl<B: BucketSink, D: DeadLetterSink> Stage<B, D> {
    /// `batch` with its pending records decoded (stored in record order
    /// among its trades, or dead-lettered), once their schemas are known.
    pub(super) async fn resolve_schemas(&mut self, mut batch: Closed) -> Closed {
        if batch.decoded.pending.is_empty() {
            return batch;
        }
        let mut ids: Vec<SchemaId> = batch.decoded.pending.iter().map(|(_, id)| *id).collect();
        ids.sort_unstable();
        ids.dedup();
        let resolved = self.fetch_until_answered(&ids).await;
        let max_bytes = self.settings.kafka.max_message_bytes;
        let mut late = Decoded::default();
        for (i, id) in std::mem::take(&mut batch.decoded.pending) {
            let r = &batch.records[i];
            let source = r.source();
            let parts = RecordParts {
                payload: r.payload.as_deref(),
                key: r.key.as_deref(),
                headers: &r.headers,
            };
            let mapping = self.mappings.get(&source.topic).map(AsRef::as_ref);
            match self
                .formats
                .decode(parts, mapping, &source, max_bytes, Some(&resolved))
            {
                Decode::Done(Ok(trade)) => {
                    late.events.push((trade, source));
                    late.record_of.push(i);
                }
                Decode::Done(Err(reject)) => batch.decoded.dead.push((i, reject)),
                // Every id was resolved above; kept total all the same.
                Decode::Missing(_) => batch.decoded.dead.push((
                    i,
                    Reject::new(
                        crate::event::RejectKind::InvalidSchema,
                        format!("schema id {id} could not be resolved"),
                    ),
                )),
            }
        }
        merge(&mut batch.decoded, late);
        batch
    }

    /// The schemas `ids`, fetched, retrying until the registry answers.
    async fn fetch_until_answered(&mut self, ids: &[SchemaId]) -> crate::registry::Resolved {
        let mut backoff = Backoff::new(&self.settings.retry);
        loop {
            match self.formats.fetch(ids).await {
                Ok(resolved) => {
                    if self.health.schema_registry_unavailable(None) == Change::Cleared {
                        tracing::info!("the Schema Registry answers again");
                    }
                    return resolved;
                }
                Err(why) => {
                    self.health.schema_registry_unavailable(Some(why.clone()));
                    self.metrics.retry(RetryKind::SchemaRegistry).inc();
                    let wait = backoff.next_wait();
                    tracing::warn!(error = %why, retry_in = ?wait, schema_ids = ?ids,
                        "cannot fetch schemas from the Schema Registry; retrying, the batch waits");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

/// `late`'s trades merged into `d`'s in record order (each customer's
/// trades are written in stream order), and the dead letters in it too.
fn merge(d: &mut Decoded, late: Decoded) {
    if !late.events.is_empty() {
        let early = std::mem::take(&mut d.events)
            .into_iter()
            .zip(std::mem::take(&mut d.record_of));
        let mut all: Vec<((Trade, Source), usize)> = early
            .chain(late.events.into_iter().zip(late.record_of))
            .collect();
        all.sort_by_key(|(_, i)| *i);
        for (event, i) in all {
            d.events.push(event);
            d.record_of.push(i);
        }
    }
    d.dead.sort_by_key(|(i, _)| *i);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_trades_take_their_record_order() {
        let trade = |i: i64| {
            let source = Source {
                topic: "t".into(),
                partition: 0,
                offset: i,
            };
            let payload =
                format!(r#"{{"customerId":1,"type":"buy","ticker":"A","qty":1,"date":{i}}}"#);
            (
                crate::event::decode(Some(payload.as_bytes()), &source, 1 << 20).unwrap(),
                source,
            )
        };
        let mut d = Decoded {
            events: vec![trade(0), trade(3)],
            record_of: vec![0, 3],
            dead: vec![(4, Reject::new(crate::event::RejectKind::Empty, "x"))],
            pending: Vec::new(),
        };
        let late = Decoded {
            events: vec![trade(1), trade(5)],
            record_of: vec![1, 5],
            ..Decoded::default()
        };
        d.dead
            .push((2, Reject::new(crate::event::RejectKind::Empty, "y")));
        merge(&mut d, late);
        assert_eq!(d.record_of, vec![0, 1, 3, 5]);
        let offsets: Vec<i64> = d.events.iter().map(|(_, s)| s.offset).collect();
        assert_eq!(offsets, vec![0, 1, 3, 5]);
        assert_eq!(
            d.dead.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            vec![2, 4]
        );
    }
}
