//! The bucket collection in MongoDB: the client and its requests (loading
//! a customer's newest bucket, the guarded fill updates, the bucket
//! inserts, the reads behind `page` and `audit`). Beside it: `error` (what
//! requests fail with), `layout` (indexes, `init`, sharding) and `codec`
//! (the stored document and our view of it).
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

mod codec;
mod error;
mod layout;

pub use codec::{bucket_document, fill_statement, head_from_document};
use codec::{describe, stored_number};
pub use error::{
    FillOutcome, InitError, InsertOutcome, StatementError, StoreError, CLIENT_REFUSED,
    DUPLICATE_KEY,
};
pub use layout::{layout_conflict, ShardState};

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use mongodb::bson::{doc, rawdoc, Bson, Document, RawArrayBuf, RawDocumentBuf};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::{
    Acknowledgment, ClientOptions, CollectionOptions, FindOneOptions, InsertManyOptions,
    ReadConcern, ReadPreference, SelectionCriteria, WriteConcern,
};
use mongodb::{Client, Collection, Database};

use super::id::Prefix;
use super::plan::LoadedHead;
use secrecy::ExposeSecret;

use crate::config::{Settings, WriteAcknowledgment};
use crate::event::CustomerId;

/// The shard key of sharded mode. Ranged, not hashed: MongoDB enforces a
/// unique index across shards only when it starts with the shard key, and
/// documents that for ranged shard keys; a hashed key index cannot be
/// unique itself. Ranged on the customer also keeps a customer's buckets
/// in one chunk, so its page query is one shard's.
pub const SHARD_KEY_FIELD: &str = "customerId";

/// Customers per `find_keys` query in sharded mode: each is one branch of
/// an `$or`, which the server plans branch by branch.
const FIND_KEYS_CUSTOMERS_PER_QUERY: usize = 500;

/// Bytes of fill statements per `update` command (a byte budget, not a
/// statement count). A command over MongoDB's 16 MiB limit is refused
/// whole, so the fills are cut into several commands at half of it, which
/// leaves room for the command's other fields; a statement larger than the
/// budget goes alone. At typical trade sizes a command this big also stays
/// far under the 100,000-statement limit.
const MAX_STATEMENT_BYTES: usize = 8 * 1024 * 1024;

/// Awaits `operation` for at most `limit`; an expired one is a
/// [`StoreError::TimedOut`], dropped mid-flight (see there).
async fn bounded<T, E: Into<StoreError>>(
    operation: &'static str,
    limit: Duration,
    work: impl std::future::IntoFuture<Output = Result<T, E>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(limit, work).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => Err(StoreError::TimedOut { operation, limit }),
    }
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
    /// `timeouts.mongodb_operation`: every operation's bound (see
    /// [`bounded`]).
    operation_limit: Duration,
}

impl BucketStore {
    /// A `ping` round trip: is the server reachable and answering?
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.db.run_command(doc! { "ping": 1 }).await?;
        Ok(())
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
            operation_limit: t.mongodb_operation,
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

    /// The newest bucket of `customer` (highest `_id` in its prefix range),
    /// with just the fields planning needs; a bucket whose fields we cannot
    /// plan against is reported, not an error (see [`UnreadableBucket`]).
    pub async fn load_head(&self, customer: &CustomerId) -> Result<LoadedHead, StoreError> {
        let options = FindOneOptions::builder()
            .sort(doc! {"_id": -1})
            .projection(doc! {
                "count": 1, "cap": 1, "capBytes": 1, "bytes": 1,
                "customerId": 1, "wm": 1, "history.key": 1,
            })
            .max_time(self.operation_limit)
            .build();
        let find = self
            .reads
            .find_one(self.customer_filter(customer))
            .with_options(options);
        let doc = bounded("find", self.operation_limit, find).await?;
        Ok(doc.map(|d| head_from_document(&d)).transpose())
    }

    /// Loads several customers' heads, `load_concurrency` at a time.
    pub async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        futures::stream::iter(customers)
            .map(|c| async move {
                let head = self.load_head(&c).await?;
                Ok::<_, StoreError>((c, head))
            })
            .buffer_unordered(self.load_concurrency)
            .try_collect()
            .await
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

    /// `find_keys`, or with `every_key` each found bucket's every key.
    async fn find_entries(
        &self,
        wanted: &[(CustomerId, String)],
        every_key: bool,
    ) -> Result<Vec<(String, String)>, StoreError> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        if !self.sharded {
            let keys: HashSet<&str> = wanted.iter().map(|(_, k)| k.as_str()).collect();
            let list: Vec<&str> = keys.iter().copied().collect();
            return self
                .keys_in(doc! {"history.key": {"$in": list}}, |_, k| {
                    every_key || keys.contains(k)
                })
                .await;
        }
        let mut by_customer: BTreeMap<CustomerId, HashSet<&str>> = BTreeMap::new();
        for (customer, key) in wanted {
            by_customer
                .entry(customer.canonical())
                .or_default()
                .insert(key.as_str());
        }
        let asked: HashSet<(String, &str)> = by_customer
            .iter()
            .flat_map(|(c, keys)| {
                keys.iter()
                    .map(|k| (Prefix::of(c).as_str().to_string(), *k))
            })
            .collect();
        let groups: Vec<(CustomerId, HashSet<&str>)> = by_customer.into_iter().collect();
        let mut found = Vec::new();
        for chunk in groups.chunks(FIND_KEYS_CUSTOMERS_PER_QUERY) {
            let mut branches: Vec<Document> = chunk
                .iter()
                .map(|(customer, keys)| {
                    let keys: Vec<&str> = keys.iter().copied().collect();
                    doc! {SHARD_KEY_FIELD: customer.to_bson(), "history.key": {"$in": keys}}
                })
                .collect();
            let filter = if branches.len() == 1 {
                branches.pop().expect("one branch")
            } else {
                doc! {"$or": branches}
            };
            // A bucket's other keys may be another asker's: only the
            // bucket's own customer's count.
            let owned = |id: &str, k: &str| {
                every_key
                    || Prefix::of_id(id)
                        .is_some_and(|p| asked.contains(&(p.as_str().to_string(), k)))
            };
            found.extend(self.keys_in(filter, owned).await?);
        }
        Ok(found)
    }

    /// `(key, bucket _id)` for every history key of the buckets `filter`
    /// matches that `wanted(bucket _id, key)` accepts.
    async fn keys_in(
        &self,
        filter: Document,
        wanted: impl Fn(&str, &str) -> bool,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let read = async {
            let mut cursor = self
                .reads
                .find(filter)
                .projection(doc! {"history.key": 1})
                .max_time(self.operation_limit)
                .await?;
            let mut found = Vec::new();
            while let Some(d) = cursor.try_next().await? {
                let id = d.get_str("_id").unwrap_or_default().to_string();
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
        bounded("find", self.operation_limit, read).await
    }

    /// Runs fill statements (unordered: each is its own customer's).
    pub async fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> Result<FillOutcome, StoreError> {
        let mut outcome = FillOutcome::default();
        let mut base = 0;
        for chunk in chunk_by_size(statements) {
            let len = chunk.len();
            let mut updates = RawArrayBuf::new();
            for statement in chunk {
                updates.push(statement);
            }
            let command = self.db.run_raw_command(rawdoc! {
                "update": self.coll.name(),
                "updates": updates,
                "ordered": false,
                "writeConcern": self.write_concern_doc.clone(),
            });
            let reply = bounded("update", self.operation_limit, command).await?;
            let part = parse_write_reply(&reply, len)?;
            outcome.matched += part.0;
            outcome.errors.extend(part.1.into_iter().map(|mut e| {
                e.index += base;
                e
            }));
            base += len;
        }
        Ok(outcome)
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
        let Ok(result) = tokio::time::timeout(self.operation_limit, insert).await else {
            return Err(StoreError::TimedOut {
                operation: "insert",
                limit: self.operation_limit,
            });
        };
        result.map_or_else(
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

/// What an `insert_many` of `sent` documents that failed says: the
/// refused documents, or an error (its outcome unknown) to retry.
fn insert_failure(e: mongodb::error::Error, sent: usize) -> Result<InsertOutcome, StoreError> {
    let refused = |index: usize, code: i32, message: String| StatementError {
        index,
        code,
        message,
    };
    match *e.kind {
        ErrorKind::InsertMany(ref failure) if failure.write_concern_error.is_none() => {
            match failure.write_errors.as_deref() {
                Some(errors) if errors.iter().any(|w| w.index >= sent) => {
                    let bad = errors.iter().map(|w| w.index).max().unwrap_or(0);
                    Err(malformed(format!("a write error's index is {bad}"), sent))
                }
                Some(errors) if !errors.is_empty() => Ok(InsertOutcome {
                    errors: errors
                        .iter()
                        .map(|w| refused(w.index, w.code, w.message.clone()))
                        .collect(),
                }),
                _ => Err(StoreError::Transient(e)),
            }
        }
        ErrorKind::Write(WriteFailure::WriteError(ref w)) => Ok(InsertOutcome {
            errors: vec![refused(0, w.code, w.message.clone())],
        }),
        // Refused by the driver before anything was sent: every document
        // is suspect, and the writer's isolation finds the one at fault.
        ErrorKind::InvalidArgument { ref message, .. } => {
            let why = format!("the MongoDB driver refused the document: {message}");
            Ok(InsertOutcome {
                errors: (0..sent)
                    .map(|i| refused(i, CLIENT_REFUSED, why.clone()))
                    .collect(),
            })
        }
        _ => Err(StoreError::Transient(e)),
    }
}

/// `mongodb.write_concern` and `mongodb.journal`, with `wtimeout`: a replica
/// set that lost its majority answers with a write-concern error instead of
/// holding the write without bound.
fn write_concern(settings: &Settings) -> WriteConcern {
    let w = match settings.mongodb.write_concern {
        WriteAcknowledgment::Majority => Acknowledgment::Majority,
        WriteAcknowledgment::Nodes(n) => Acknowledgment::Nodes(n),
    };
    WriteConcern::builder()
        .w(w)
        .journal(settings.mongodb.journal)
        .w_timeout(settings.timeouts.mongodb_write_concern)
        .build()
}

/// The `writeConcern` field of a raw command.
fn write_concern_doc(wc: &WriteConcern) -> RawDocumentBuf {
    let mut d = RawDocumentBuf::new();
    match &wc.w {
        Some(Acknowledgment::Nodes(n)) => d.append("w", i64::from(*n)),
        Some(Acknowledgment::Custom(s)) => d.append("w", s.as_str()),
        _ => d.append("w", "majority"),
    }
    if let Some(j) = wc.journal {
        d.append("j", j);
    }
    if let Some(limit) = wc.w_timeout {
        d.append(
            "wtimeout",
            i64::try_from(limit.as_millis()).unwrap_or(i64::MAX),
        );
    }
    d
}

/// `(matched, statement errors)` from an `update` reply to `sent`
/// statements. A write-concern error makes the whole outcome unknown: an
/// error, so the batch is retried. So does a reply that names a statement
/// we did not send, or counts more matches than statements: a server (or a
/// proxy) saying that cannot be trusted about the others either, and
/// indexing with its numbers would crash the worker on the same batch
/// after every restart.
fn parse_write_reply(
    reply: &Document,
    sent: usize,
) -> Result<(u64, Vec<StatementError>), StoreError> {
    if let Ok(wce) = reply.get_document("writeConcernError") {
        let code = wce.get_i32("code").unwrap_or(-1);
        let message = wce.get_str("errmsg").unwrap_or_default();
        return Err(StoreError::WriteConcern {
            code,
            message: message.to_string(),
        });
    }
    let n = stored_number(reply, "n")
        .filter(|&n| n <= sent as u64)
        .ok_or_else(|| malformed(format!("n is {}", describe(reply.get("n"))), sent))?;
    let mut errors = Vec::new();
    if let Ok(list) = reply.get_array("writeErrors") {
        for e in list.iter().filter_map(Bson::as_document) {
            let index = stored_number(e, "index")
                .and_then(|i| usize::try_from(i).ok())
                .filter(|&i| i < sent)
                .ok_or_else(|| {
                    let index = describe(e.get("index"));
                    malformed(format!("a write error's index is {index}"), sent)
                })?;
            errors.push(StatementError {
                index,
                code: e.get_i32("code").unwrap_or(-1),
                message: e.get_str("errmsg").unwrap_or_default().to_string(),
            });
        }
    }
    Ok((n, errors))
}

/// A write reply that does not fit the request: retried like a failed
/// request (its outcome is unknown), and said plainly in the log.
fn malformed(what: String, sent: usize) -> StoreError {
    StoreError::Failed(format!(
        "malformed write reply to {sent} statements: {what}"
    ))
}

fn chunk_by_size(statements: Vec<RawDocumentBuf>) -> Vec<Vec<RawDocumentBuf>> {
    let mut chunks = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0;
    for s in statements {
        let size = s.as_bytes().len();
        if !current.is_empty() && bytes + size > MAX_STATEMENT_BYTES {
            chunks.push(std::mem::take(&mut current));
            bytes = 0;
        }
        bytes += size;
        current.push(s);
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
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

    #[test]
    fn the_raw_write_concern_carries_wtimeout() {
        let wc = WriteConcern::builder()
            .w(Acknowledgment::Majority)
            .journal(true)
            .w_timeout(Duration::from_secs(20))
            .build();
        let d = write_concern_doc(&wc);
        assert_eq!(d.get_i64("wtimeout").unwrap(), 20_000);
    }

    #[test]
    fn write_replies_are_parsed_with_indexes() {
        let reply = doc! {"ok": 1.0, "n": 3, "nModified": 3, "writeErrors": [
            {"index": 4, "code": 11000, "errmsg": "E11000 duplicate key"},
            {"index": 7, "code": 121, "errmsg": "Document failed validation"},
        ]};
        let (n, errs) = parse_write_reply(&reply, 8).unwrap();
        assert_eq!(n, 3);
        assert_eq!(errs.len(), 2);
        assert!(errs[0].is_duplicate_key());
        assert_eq!((errs[1].index, errs[1].code), (7, 121));
        let wce = doc! {"ok": 1.0, "n": 1, "writeConcernError": {"code": 64}};
        assert!(parse_write_reply(&wce, 8).is_err());
    }

    /// A reply that names a statement we did not send (or counts more
    /// matches than statements) is an error to retry, not an index to
    /// crash on: before, the writer indexed its statements with it.
    #[test]
    fn a_reply_naming_statements_never_sent_is_an_error_not_an_index() {
        let error_at = |index: Bson| {
            doc! {"ok": 1.0, "n": 0, "writeErrors": [
                {"index": index, "code": 11000, "errmsg": "E11000"},
            ]}
        };
        for index in [
            Bson::Int32(3),
            Bson::Int32(-1),
            Bson::Int64(1 << 40),
            Bson::Null,
        ] {
            let e = parse_write_reply(&error_at(index.clone()), 3).unwrap_err();
            assert!(
                matches!(e, StoreError::Failed(ref m) if m.contains("malformed")),
                "{index}: {e}"
            );
        }
        assert!(parse_write_reply(&error_at(Bson::Int32(2)), 3).is_ok());
        let too_many = doc! {"ok": 1.0, "n": 4};
        assert!(parse_write_reply(&too_many, 3).is_err());
        let no_n = doc! {"ok": 1.0};
        assert!(parse_write_reply(&no_n, 3).is_err());
    }

    #[test]
    fn chunks_respect_the_size_budget_and_keep_order() {
        let big = "x".repeat(3 * 1024 * 1024);
        let statements: Vec<RawDocumentBuf> = (0..5)
            .map(|i| rawdoc! {"i": i, "pad": big.as_str()})
            .collect();
        let chunks = chunk_by_size(statements);
        assert_eq!(
            chunks.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![2, 2, 1]
        );
        let order: Vec<i32> = chunks
            .iter()
            .flatten()
            .map(|d| d.get_i32("i").unwrap())
            .collect();
        assert_eq!(order, vec![0, 1, 2, 3, 4]);
    }
}
