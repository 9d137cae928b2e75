//! The bucket collection in MongoDB: the client and its requests (loading
//! a customer's newest bucket, the guarded fill updates, the bucket
//! inserts, the reads behind `page` and `audit`). Beside it: `error` (what
//! requests fail with), `layout` (indexes, `init`, sharding), `codec` (the
//! stored document and our view of it), `write` (a write command's bytes,
//! write concern and size, and what its reply says) and `bson_out` (the
//! BSON writer both write with: one buffer per document, sized up front).
//!
//! Fills go out as one raw `update` command with many statements (every
//! server version has it; the driver's typed multi-statement API needs
//! MongoDB 8.0). That command reports only the total matched count, so a
//! shortfall marks every customer of the command as stale, to be reloaded:
//! rare, and always safe, because re-planning is idempotent.
//!
//! The reads that decide what is stored (`load_head`, `find_keys`) go to
//! the primary at read concern "majority", whatever the URI asks for: a
//! fill that a stepping-down primary will roll back, or a secondary that
//! has not caught up, must never make a trade look stored, or its offset
//! would be committed without it. `page` and the audit keep the URI's
//! preferences: they decide nothing, and an operator may well want them
//! off the primary.
//!
//! Sharded mode (`mongodb.sharded`, for a collection sharded on
//! `{customerId: 1}`): the unique indexes start with `customerId`, so they
//! hold per customer (MongoDB enforces uniqueness across shards only for
//! indexes that start with the shard key), and every filter and inserted
//! document carries the customer, in its [canonical](CustomerId::canonical)
//! form, so mongos sends each request to the shard that owns it. `init`
//! creates and checks that layout; each mode refuses a collection laid out
//! for the other.

mod bson_out;
mod codec;
mod error;
mod heads;
mod keys;
mod layout;
#[cfg(test)]
mod oracle;
mod write;

pub use codec::{bucket_document, fill_statement, head_from_document};
pub(crate) use codec::{stored_number, whole_number};
pub use error::{
    FillOutcome, InitError, InsertOutcome, StatementError, StoreError, CLIENT_REFUSED,
    DUPLICATE_KEY,
};
pub use heads::PROBE_CUSTOMERS;
pub use layout::{collection_conflict, layout_conflict, ShardState, SHARD_KEY_FIELD};
pub use write::{chunk_by_size, even_runs, fill_commands, update_command};
use write::{insert_failure, parse_write_reply, write_concern, write_concern_doc};

use std::collections::HashSet;
use std::future::IntoFuture;
use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use mongodb::bson::{doc, Document, RawDocumentBuf};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::{
    ClientOptions, CollectionOptions, InsertManyOptions, ReadConcern, ReadPreference,
    SelectionCriteria, WriteConcern,
};
use mongodb::{Client, Collection, Database};

use super::id::Prefix;
use secrecy::ExposeSecret;

use crate::config::Settings;
use crate::event::CustomerId;

/// Awaits `operation` for at most `limit`; an expired one is a
/// [`StoreError::TimedOut`], dropped mid-flight (see there).
async fn bounded<T, E: Into<StoreError>>(
    operation: &'static str,
    limit: Duration,
    work: impl IntoFuture<Output = Result<T, E>>,
) -> Result<T, StoreError> {
    in_time(operation, limit, work).await?.map_err(Into::into)
}

/// [`bounded`] for a caller that reads the operation's own error before
/// it becomes a [`StoreError`] (a server code that means "nothing there").
pub(crate) async fn in_time<F: IntoFuture>(
    operation: &'static str,
    limit: Duration,
    work: F,
) -> Result<F::Output, StoreError> {
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| StoreError::TimedOut { operation, limit })
}

#[derive(Clone)]
pub struct BucketStore {
    client: Client,
    db: Database,
    coll: Collection<Document>,
    /// The same collection for the reads that decide what is stored: the
    /// primary, read concern "majority" (see the module docs).
    reads: Collection<Document>,
    /// `mongodb.sharded`.
    sharded: bool,
    write_concern: WriteConcern,
    /// `write_concern` as the raw `update` command spells it, encoded once.
    write_concern_doc: RawDocumentBuf,
    load_concurrency: usize,
    /// `mongodb.fill_concurrency`: fill commands in flight at once.
    fill_concurrency: usize,
    /// Whether `load_heads` probes first (see `heads`), shared by clones.
    probe_first: Arc<AtomicBool>,
    /// `timeouts.mongodb_operation`: every operation's bound (see
    /// [`bounded`]).
    operation_limit: Duration,
    /// `timeouts.mongodb_ping`: the readiness ping's bound.
    ping_limit: Duration,
}

/// A store's client, to be shut down before the process exits.
#[derive(Debug)]
pub struct Closing(Client);

impl Closing {
    /// Ends the client's server sessions and stops its background tasks.
    /// Left to the last handle's drop, the driver ends the sessions on a
    /// task it spawns, which on a multi-threaded runtime can run while the
    /// runtime shuts down and panic inside the driver (its connection pool
    /// already gone: `ConnectionRequester::request` unwraps a send), as
    /// `tradebucket audit` did at exit. `immediate`: the commands leave no
    /// cursor or session open to wait for.
    pub async fn close(self) {
        self.0.shutdown().immediate(true).await;
    }
}

impl BucketStore {
    /// What shuts this store's client down (every clone of it) once the
    /// caller is done: the commands' last step.
    pub fn closing(&self) -> Closing {
        Closing(self.client.clone())
    }

    /// A `ping` round trip: is the server reachable and answering, within
    /// `timeouts.mongodb_ping`?
    pub async fn ping(&self) -> Result<(), StoreError> {
        let ping = self.db.run_command(doc! { "ping": 1 });
        bounded("ping", self.ping_limit, ping).await.map(drop)
    }

    /// A client for `settings.mongodb`. Errors carry no secret of the URI
    /// (the driver's parse errors may quote it).
    pub async fn connect(settings: &Settings) -> Result<Self, StoreError> {
        Self::connect_with(settings, None).await
    }

    /// [`BucketStore::connect`], with the driver's command monitoring sent
    /// to `command_events` (tests record every command the worker sends).
    pub async fn connect_with(
        settings: &Settings,
        command_events: Option<EventHandler<CommandEvent>>,
    ) -> Result<Self, StoreError> {
        let scrubbed = |e: mongodb::error::Error| {
            StoreError::Failed(settings.scrubber().scrub(&e.to_string()))
        };
        let m = &settings.mongodb;
        let mut options = ClientOptions::parse(m.uri.expose_secret())
            .await
            .map_err(scrubbed)?;
        options
            .app_name
            .get_or_insert_with(|| "tradebucket".to_string());
        // Fail a request within seconds when the server is gone, so the
        // pipeline's backoff (not a driver-internal wait) paces the retries
        // and readiness reflects the outage promptly. The URI's own
        // serverSelectionTimeoutMS / connectTimeoutMS win.
        let t = &settings.timeouts;
        options
            .server_selection_timeout
            .get_or_insert(t.mongodb_server_selection);
        options.connect_timeout.get_or_insert(t.mongodb_connect);
        if command_events.is_some() {
            options.command_event_handler = command_events;
        }
        let client = Client::with_options(options).map_err(scrubbed)?;
        let db = client.database(&m.database);
        let coll = db.collection::<Document>(&m.collection);
        // Overrides the URI's readPreference and readConcernLevel for
        // these reads only.
        let reads = db.collection_with_options::<Document>(
            &m.collection,
            CollectionOptions::builder()
                .read_concern(ReadConcern::majority())
                .selection_criteria(SelectionCriteria::ReadPreference(ReadPreference::Primary))
                .build(),
        );
        let write_concern = write_concern(settings);
        Ok(BucketStore {
            client,
            db,
            coll,
            reads,
            sharded: m.sharded,
            write_concern_doc: write_concern_doc(&write_concern),
            write_concern,
            load_concurrency: m.load_concurrency,
            fill_concurrency: m.fill_concurrency,
            probe_first: Arc::new(AtomicBool::new(true)),
            operation_limit: t.mongodb_operation,
            ping_limit: t.mongodb_ping,
        })
    }

    pub fn collection(&self) -> &Collection<Document> {
        &self.coll
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Whether this store runs in sharded mode.
    pub fn sharded(&self) -> bool {
        self.sharded
    }

    /// The shard key value every filter of `customer`'s buckets carries in
    /// sharded mode; `None` otherwise.
    pub fn shard_key(&self, customer: &CustomerId) -> Option<CustomerId> {
        self.sharded.then(|| customer.canonical())
    }

    /// `customer`'s buckets: the `_id` prefix range, and in sharded mode
    /// the shard key too, so mongos asks one shard.
    fn customer_filter(&self, customer: &CustomerId) -> Document {
        let mut filter = Prefix::of(customer).range();
        if let Some(key) = self.shard_key(customer) {
            filter.insert(SHARD_KEY_FIELD, key.to_bson());
        }
        filter
    }

    /// `<database>.<collection>`.
    fn namespace(&self) -> String {
        format!("{}.{}", self.db.name(), self.coll.name())
    }

    /// Which of the `wanted` trade keys are stored already, and in which
    /// bucket: `(key, bucket _id)`. Each pair names the customer whose
    /// event holds the key. Unsharded, a key is looked up in every bucket
    /// (trade ids are unique across customers, and the writer dead-letters
    /// one found in another customer's); sharded, only in its customer's
    /// buckets, one `$or` branch per customer, so mongos asks only their
    /// shards.
    pub async fn find_keys(
        &self,
        wanted: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.find_entries(wanted, false).await
    }

    /// The buckets [`find_keys`](Self::find_keys) finds, with *every* key
    /// each one holds, asked or not: `(key, bucket _id)`. Each pair is a
    /// fact about the bucket, not an answer for an asker: sharded, a key
    /// of customer X's bucket says nothing about the same key of Y.
    /// Reconcile keeps them, so a bucket is read once for all its keys.
    pub async fn find_buckets_of_keys(
        &self,
        wanted: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.find_entries(wanted, true).await
    }

    /// `find_keys`, or with `every_key` each found bucket's every key. The
    /// keys go in filters of bounded size ([`keys::key_filters`]); a bucket
    /// that matches more than one is read once.
    async fn find_entries(
        &self,
        wanted: &[(CustomerId, String)],
        every_key: bool,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let asked = keys::Asked::new(wanted, self.sharded);
        let mut read: HashSet<String> = HashSet::new();
        let mut found = Vec::new();
        for filter in keys::key_filters(wanted, self.sharded) {
            let wanted = |id: &str, k: &str| every_key || asked.has(id, k);
            found.extend(self.keys_in(filter, &mut read, wanted).await?);
        }
        Ok(found)
    }

    /// `(key, bucket _id)` for every history key of the buckets `filter`
    /// matches, and not `read` before, that `wanted(bucket _id, key)`
    /// accepts.
    async fn keys_in(
        &self,
        filter: Document,
        read: &mut HashSet<String>,
        wanted: impl Fn(&str, &str) -> bool,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let find = async {
            let mut cursor = self
                .reads
                .find(filter)
                .projection(doc! {"history.key": 1})
                .max_time(self.operation_limit)
                .await?;
            let mut found = Vec::new();
            while let Some(d) = cursor.try_next().await? {
                let id = d.get_str("_id").unwrap_or_default().to_string();
                if !read.insert(id.clone()) {
                    continue;
                }
                for entry in d.get_array("history").map(|a| a.as_slice()).unwrap_or(&[]) {
                    if let Some(k) = entry.as_document().and_then(|e| e.get_str("key").ok()) {
                        if wanted(&id, k) {
                            found.push((k.to_string(), id.clone()));
                        }
                    }
                }
            }
            Ok::<_, mongodb::error::Error>(found)
        };
        bounded("find", self.operation_limit, find).await
    }

    /// Runs fill statements (unordered: each is its own customer's), in up
    /// to `fill_concurrency` `update` commands at once: one command's
    /// statements are applied one after another on one server thread, so a
    /// steady load, where every trade is such an append, would otherwise be
    /// bound to one core of the server (docs/design.md, "Batches, memory and
    /// speed"). Every command is waited for, also after one fails: a command
    /// given up here could still be applied after the caller has reloaded
    /// the heads it changes.
    pub async fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> Result<FillOutcome, StoreError> {
        let commands = fill_commands(&statements, self.fill_concurrency);
        let replies: Vec<_> = futures::stream::iter(commands)
            .map(|range| self.fill_command(&statements, range))
            .buffered(self.fill_concurrency)
            .collect()
            .await;
        let mut outcome = FillOutcome::default();
        for reply in replies {
            let (base, (matched, errors)) = reply?;
            outcome.matched += matched;
            outcome.errors.extend(errors.into_iter().map(|mut e| {
                e.index += base;
                e
            }));
        }
        Ok(outcome)
    }

    /// One `update` command of `statements[range]`: its first statement's
    /// index and what the reply says of them.
    async fn fill_command(
        &self,
        statements: &[RawDocumentBuf],
        range: Range<usize>,
    ) -> Result<(usize, (u64, Vec<StatementError>)), StoreError> {
        let (base, len) = (range.start, range.len());
        let command = update_command(
            self.coll.name(),
            &statements[range],
            &self.write_concern_doc,
        );
        let command = self.db.run_raw_command(command);
        let reply = bounded("update", self.operation_limit, command).await?;
        Ok((base, parse_write_reply(&reply, len)?))
    }

    /// Inserts new buckets. `ordered` stops at the first refusal, which is
    /// what keeps a customer's chain from getting a bucket after a missing
    /// one when several of its buckets share the command; unordered
    /// attempts every document and reports every refusal.
    pub async fn insert_buckets(
        &self,
        docs: Vec<RawDocumentBuf>,
        ordered: bool,
    ) -> Result<InsertOutcome, StoreError> {
        if docs.is_empty() {
            return Ok(InsertOutcome::default());
        }
        let options = InsertManyOptions::builder()
            .ordered(ordered)
            .write_concern(self.write_concern.clone())
            .build();
        let raw = self.coll.clone_with_type::<RawDocumentBuf>();
        let docs_len = docs.len();
        let insert = raw.insert_many(docs).with_options(options);
        in_time("insert", self.operation_limit, insert)
            .await?
            .map_or_else(
                |e| insert_failure(e, docs_len),
                |_| Ok(InsertOutcome::default()),
            )
    }

    /// Page `n` (1-based) of a customer's history: the manual's query,
    /// `find({_id: /^<id>_/}).sort({_id: 1}).skip(n - 1).limit(1)`.
    pub async fn page(
        &self,
        customer: &CustomerId,
        n: u64,
    ) -> Result<Option<Document>, StoreError> {
        let mut filter = doc! {"_id": Prefix::of(customer).page_regex()};
        if let Some(key) = self.shard_key(customer) {
            filter.insert(SHARD_KEY_FIELD, key.to_bson());
        }
        let read = async {
            let mut cursor = self
                .coll
                .find(filter)
                .sort(doc! {"_id": 1})
                .skip(n.saturating_sub(1))
                .limit(1)
                .max_time(self.operation_limit)
                .await?;
            cursor.try_next().await
        };
        bounded("find", self.operation_limit, read).await
    }

    /// The next document of a cursor that may run long (the audit reads
    /// every bucket): each step, a `getMore` round trip, is bounded by
    /// `timeouts.mongodb_operation`, not the whole read.
    pub async fn next_of<T>(&self, cursor: &mut mongodb::Cursor<T>) -> Result<Option<T>, StoreError>
    where
        T: serde::de::DeserializeOwned + Send + Sync + Unpin,
    {
        bounded("find", self.operation_limit, cursor.try_next()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::TimeoutOperation;

    #[tokio::test(start_paused = true)]
    async fn an_operation_past_its_limit_is_a_transient_timeout() {
        let limit = Duration::from_secs(30);
        let hung = std::future::pending::<Result<(), StoreError>>();
        let e = bounded("update", limit, hung).await.unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::TimedOut {
                    operation: "update",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(e.timeout_operation(), Some(TimeoutOperation::MongodbWrite));
        assert!(
            e.readiness_reason().contains("time limit"),
            "{}",
            e.readiness_reason()
        );
        // The start-up's reads count as reads, its index builds as writes.
        for (operation, label) in [
            ("find", TimeoutOperation::MongodbRead),
            ("listIndexes", TimeoutOperation::MongodbRead),
            ("listCollections", TimeoutOperation::MongodbRead),
            ("hello", TimeoutOperation::MongodbRead),
            ("createIndexes", TimeoutOperation::MongodbWrite),
            ("insert", TimeoutOperation::MongodbWrite),
        ] {
            let e = StoreError::TimedOut { operation, limit };
            assert_eq!(e.timeout_operation(), Some(label), "{operation}");
        }
        let quick = async { Ok::<_, StoreError>(7) };
        assert_eq!(bounded("find", limit, quick).await.unwrap(), 7);
        let wce = StoreError::WriteConcern {
            code: 64,
            message: "waiting for replication timed out".into(),
        };
        assert_eq!(
            wce.timeout_operation(),
            Some(TimeoutOperation::MongodbWriteConcern)
        );
    }

    /// The readiness ping is bounded in the store like any operation, and
    /// counted as a ping, not a write.
    #[tokio::test(start_paused = true)]
    async fn a_ping_past_its_limit_is_a_ping_timeout() {
        let limit = Duration::from_secs(2);
        let hung = std::future::pending::<Result<(), StoreError>>();
        let e = bounded("ping", limit, hung).await.unwrap_err();
        assert_eq!(e.timeout_operation(), Some(TimeoutOperation::MongodbPing));
    }
}
