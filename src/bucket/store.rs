//! The bucket collection in MongoDB: indexes, loading a customer's newest
//! bucket, the guarded fill updates and the bucket inserts, and the reads
//! behind `page` and `audit`.
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

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use mongodb::bson::{doc, rawdoc, Bson, Document, RawArrayBuf, RawBson, RawDocumentBuf};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::{
    Acknowledgment, ClientOptions, CollectionOptions, FindOneOptions, IndexOptions,
    InsertManyOptions, ReadConcern, ReadPreference, SelectionCriteria, WriteConcern,
};
use mongodb::{Client, Collection, Database, IndexModel};

use super::id::Prefix;
use super::plan::{BucketHead, Fill, LoadedHead, NewBucket, UnreadableBucket};
use secrecy::ExposeSecret;

use crate::config::{Settings, WriteAcknowledgment};
use crate::event::{CustomerId, Trade};
use crate::metrics::TimeoutOperation;

/// Duplicate key: another writer (or an earlier delivery) got there first.
pub const DUPLICATE_KEY: i32 = 11000;

/// The per-statement codes that refuse the statement's *data*, and would
/// refuse it again on any server at any time: only these dead-letter the
/// events of the statement. Every other code (a shard's election seen
/// through mongos, a write conflict, an interrupted operation, an
/// authorization change) says nothing about the events, and the batch is
/// retried like a failed request. From MongoDB's `error_codes.yml`.
const REFUSALS_OF_DATA: [i32; 19] = [
    2,     // BadValue
    9,     // FailedToParse
    14,    // TypeMismatch
    15,    // Overflow
    16,    // InvalidLength
    22,    // InvalidBSON
    28,    // PathNotViable
    30,    // InvalidPath
    40,    // ConflictingUpdateOperators
    52,    // DollarPrefixedFieldName
    53,    // InvalidIdField
    55,    // InvalidDBRef
    56,    // EmptyFieldName
    57,    // DottedFieldName
    66,    // ImmutableField
    121,   // DocumentValidationFailure
    10334, // BSONObjectTooLarge
    17419, // an update's result over 16 MiB (older servers)
    CLIENT_REFUSED,
];

/// Not a server code: the driver refused the documents before sending them
/// (one too large to encode, say): a refusal of their data too.
pub const CLIENT_REFUSED: i32 = -2;

/// The server's answer for a collection or database that does not exist.
const NAMESPACE_NOT_FOUND: i32 = 26;

/// The server's answer to a user without the privilege.
const UNAUTHORIZED: i32 = 13;

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

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Worth retrying: network, elections, write-concern timeouts, a server
    /// restarting. The outcome of the failed request is unknown.
    #[error("MongoDB unavailable: {0}")]
    Transient(#[source] mongodb::error::Error),
    /// A statement failed with a code that does not refuse its data (see
    /// [`StatementError::refuses_data`]): retried like a failed request.
    #[error("MongoDB failed a statement (code {code}): {message}")]
    Statement { code: i32, message: String },
    /// The operation did not answer within `timeouts.mongodb_operation`
    /// and was abandoned (the driver closes a connection dropped mid-
    /// operation, so its late reply is never read as another's). Like
    /// [`StoreError::Transient`], the outcome is unknown: a write may have
    /// been applied. Retried with backoff; the guards make that safe.
    #[error("MongoDB {operation} did not answer within {limit:?} (timeouts.mongodb_operation); it may have been applied")]
    TimedOut {
        operation: &'static str,
        limit: Duration,
    },
    /// The server applied the write but could not satisfy the write
    /// concern (`wtimeout` expired, a majority lost): unknown whether it
    /// will survive. Retried like a failed request.
    #[error("MongoDB write concern not satisfied (code {code}): {message}")]
    WriteConcern { code: i32, message: String },
    /// A response we cannot interpret, or an error that retrying will not
    /// change (bad credentials, missing privileges). Still retried by the
    /// pipeline, loudly, because dropping the batch would lose trades.
    #[error("MongoDB request failed: {0}")]
    Failed(String),
}

impl StoreError {
    /// The `operation` label of `tradebucket_timeouts_total` when this is
    /// a time limit that expired: ours, or the server's `wtimeout`.
    pub fn timeout_operation(&self) -> Option<TimeoutOperation> {
        match self {
            StoreError::TimedOut { operation, .. } if *operation == "find" => {
                Some(TimeoutOperation::MongodbRead)
            }
            StoreError::TimedOut { .. } => Some(TimeoutOperation::MongodbWrite),
            StoreError::WriteConcern { .. } => Some(TimeoutOperation::MongodbWriteConcern),
            StoreError::Transient(e) if is_write_concern_timeout(e) => {
                Some(TimeoutOperation::MongodbWriteConcern)
            }
            _ => None,
        }
    }

    /// Why writes fail, for `/readyz` (no secret: never the URI).
    pub fn readiness_reason(&self) -> String {
        match self {
            StoreError::TimedOut { operation, limit } => format!(
                "MongoDB writes failing: a {operation} exceeded its {limit:?} time limit (timeouts.mongodb_operation); being retried"
            ),
            StoreError::WriteConcern { code, .. } => format!(
                "MongoDB writes failing: write concern not satisfied (code {code}, timeouts.mongodb_write_concern); being retried"
            ),
            _ if self.timeout_operation().is_some() => "MongoDB writes failing: write concern not satisfied in time (timeouts.mongodb_write_concern); being retried".to_string(),
            _ => "MongoDB writes failing: being retried".to_string(),
        }
    }
}

/// A write-concern error the driver reports (on `insert_many`): the
/// server's `wtimeout` or a majority it cannot reach.
fn is_write_concern_timeout(e: &mongodb::error::Error) -> bool {
    match *e.kind {
        ErrorKind::Write(WriteFailure::WriteConcernError(_)) => true,
        ErrorKind::InsertMany(ref f) => f.write_concern_error.is_some(),
        _ => false,
    }
}

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

impl From<mongodb::error::Error> for StoreError {
    fn from(e: mongodb::error::Error) -> Self {
        StoreError::Transient(e)
    }
}

/// What happened to one statement that failed on its own.
#[derive(Debug, Clone, PartialEq)]
pub struct StatementError {
    pub index: usize,
    pub code: i32,
    pub message: String,
}

impl StatementError {
    pub fn is_duplicate_key(&self) -> bool {
        self.code == DUPLICATE_KEY
    }

    /// Refuses the statement's data for good (see [`REFUSALS_OF_DATA`]).
    pub fn refuses_data(&self) -> bool {
        REFUSALS_OF_DATA.contains(&self.code)
    }
}

/// Result of one `update` command.
#[derive(Debug, Default)]
pub struct FillOutcome {
    /// Statements that matched their guard (total only: see module docs).
    pub matched: u64,
    pub errors: Vec<StatementError>,
}

/// Result of an insert: the documents that were refused. An ordered insert
/// stops at its first refusal (everything before it was inserted, nothing
/// after it attempted); an unordered one attempts every document.
#[derive(Debug, Default)]
pub struct InsertOutcome {
    pub errors: Vec<StatementError>,
}

/// `init` refused the collection: retrying will not help, an operator must
/// act (the message says how).
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Layout(String),
}

impl From<mongodb::error::Error> for InitError {
    fn from(e: mongodb::error::Error) -> Self {
        InitError::Store(StoreError::Transient(e))
    }
}

/// Where the collection stands with sharding, as `init` found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardState {
    /// Not connected to mongos: a replica set, where nothing is sharded.
    NoMongos,
    /// Through mongos; the collection is not sharded.
    NotSharded,
    /// Through mongos; sharded on `{customerId: 1}`.
    Sharded,
    /// Through mongos, but the user may not read `config.collections`:
    /// unknown.
    Unknown(String),
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
        let w = match m.write_concern {
            WriteAcknowledgment::Majority => Acknowledgment::Majority,
            WriteAcknowledgment::Nodes(n) => Acknowledgment::Nodes(n),
        };
        // wtimeout: a replica set that lost its majority answers with a
        // write-concern error instead of holding the write without bound.
        let write_concern = WriteConcern::builder()
            .w(w)
            .journal(m.journal)
            .w_timeout(t.mongodb_write_concern)
            .build();
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

    /// Creates the indexes the guarantees rest on, after checking that the
    /// collection is laid out for this mode (see [`layout_conflict`] and
    /// [`BucketStore::shard_state`]). Idempotent; what `run` does at
    /// start-up. Never shards: that takes privileges a worker should not
    /// need, and is [`BucketStore::init_and_shard`]'s.
    pub async fn init(&self) -> Result<ShardState, InitError> {
        let existing = self.index_models().await?;
        if let Some(conflict) = layout_conflict(&existing, self.sharded, &self.namespace()) {
            return Err(InitError::Layout(conflict));
        }
        let state = self.shard_state().await?;
        let create = self.coll.create_indexes(index_models(self.sharded));
        bounded("createIndexes", self.operation_limit, create).await?;
        match (&state, self.sharded) {
            (ShardState::NoMongos, true) => tracing::warn!(
                "mongodb.sharded is true but the server is not mongos: the customer-scoped \
                 indexes are in place, the shard layout was not applied"
            ),
            (ShardState::NotSharded, true) => tracing::warn!(
                collection = %self.namespace(),
                "mongodb.sharded is true but the collection is not sharded yet: \
                 `tradebucket init` shards it on {{customerId: 1}}"
            ),
            (ShardState::Unknown(why), _) => tracing::warn!(
                collection = %self.namespace(),
                reason = %why,
                "cannot tell how the collection is sharded"
            ),
            _ => {}
        }
        Ok(state)
    }

    /// [`BucketStore::init`], and in sharded mode through mongos, shards
    /// the collection on `{customerId: 1}` if it is not yet: what
    /// `tradebucket init` does. First refuses buckets whose `customerId`
    /// is not in its canonical form (a collection moved from unsharded
    /// mode whose customer ids came as text of digits), which sharded mode
    /// would not find.
    pub async fn init_and_shard(&self) -> Result<ShardState, InitError> {
        let state = self.init().await?;
        if !self.sharded {
            return Ok(state);
        }
        if let Some(id) = self.non_canonical_customer().await? {
            return Err(InitError::Layout(format!(
                "{ns} holds buckets whose customerId is text of digits (bucket {id}); sharded \
                 mode stores such ids as numbers and would not find them. Convert them, with \
                 every worker stopped, as \"Moving an existing collection\" in \
                 docs/operations.md#sharding shows, then run init again",
                ns = self.namespace()
            )));
        }
        if state != ShardState::NotSharded {
            return Ok(state);
        }
        // Bounded too: `init` run again after a timeout finds the
        // collection sharded, or shards it.
        let admin = self.client.database("admin");
        let shard = admin.run_command(doc! {
            "shardCollection": self.namespace(),
            "key": {SHARD_KEY_FIELD: 1},
        });
        bounded("shardCollection", self.operation_limit, shard).await?;
        Ok(ShardState::Sharded)
    }

    /// The collection's indexes; none if it does not exist yet.
    async fn index_models(&self) -> Result<Vec<IndexModel>, StoreError> {
        let listed = async { self.coll.list_indexes().await?.try_collect().await };
        match tokio::time::timeout(self.operation_limit, listed)
            .await
            .map_err(|_| StoreError::TimedOut {
                operation: "listIndexes",
                limit: self.operation_limit,
            })? {
            Ok(models) => Ok(models),
            Err(e) if command_code(&e) == Some(NAMESPACE_NOT_FOUND) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// Through mongos (`hello` says `msg: "isdbgrid"`), the collection's
    /// entry in `config.collections`, which has its shard key under `key`
    /// on MongoDB 6, 7 and 8 (8.0 also lists unsharded collections it
    /// tracks, as `unsplittable`, and those are not sharded). Refuses a
    /// collection sharded on another key, and in unsharded mode any
    /// sharded one: its global unique indexes cannot exist there.
    async fn shard_state(&self) -> Result<ShardState, InitError> {
        let limit = self.operation_limit;
        let hello = bounded("hello", limit, self.db.run_command(doc! {"hello": 1})).await?;
        if hello.get_str("msg") != Ok("isdbgrid") {
            return Ok(ShardState::NoMongos);
        }
        let collections = self
            .client
            .database("config")
            .collection::<Document>("collections");
        let find = collections
            .find_one(doc! {"_id": self.namespace()})
            .max_time(limit);
        let entry = match tokio::time::timeout(limit, find).await {
            Err(_) => {
                return Err(StoreError::TimedOut {
                    operation: "find",
                    limit,
                }
                .into())
            }
            Ok(Ok(entry)) => entry,
            Ok(Err(e)) if command_code(&e) == Some(UNAUTHORIZED) => {
                return Ok(ShardState::Unknown(e.to_string()))
            }
            Ok(Err(e)) => return Err(e.into()),
        };
        let key = entry
            .filter(|c| {
                !c.get_bool("dropped").unwrap_or(false)
                    && !c.get_bool("unsplittable").unwrap_or(false)
            })
            .and_then(|c| c.get_document("key").ok().cloned());
        let ns = self.namespace();
        match key {
            None => Ok(ShardState::NotSharded),
            Some(key) if !self.sharded => Err(InitError::Layout(format!(
                "{ns} is sharded (on {key}) but mongodb.sharded is false: set it to true \
                 (see docs/operations.md#sharding)"
            ))),
            Some(key) if is_key(&key, &[SHARD_KEY_FIELD]) => Ok(ShardState::Sharded),
            Some(key) => Err(InitError::Layout(format!(
                "{ns} is sharded on {key}; tradebucket's sharded mode needs {{customerId: 1}} \
                 (ranged), which its unique indexes start with. Reshard it \
                 (reshardCollection) or use another collection"
            ))),
        }
    }

    /// The `_id` of a bucket whose `customerId` is text that sharded mode
    /// would store as a number, if there is one.
    async fn non_canonical_customer(&self) -> Result<Option<String>, StoreError> {
        let find = self
            .coll
            .find(doc! {SHARD_KEY_FIELD: {"$type": "string", "$regex": "^(0|[1-9][0-9]*)$"}})
            .projection(doc! {SHARD_KEY_FIELD: 1});
        let mut cursor = bounded("find", self.operation_limit, find).await?;
        while let Some(d) = self.next_of(&mut cursor).await? {
            let text = d.get_str(SHARD_KEY_FIELD).unwrap_or_default();
            // Twenty digits and more stay text: no Int64 holds them.
            if CustomerId::Str(text.to_string()).canonical() != CustomerId::Str(text.to_string()) {
                return Ok(Some(d.get_str("_id").unwrap_or("?").to_string()));
            }
        }
        Ok(None)
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
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        if !self.sharded {
            let keys: HashSet<&str> = wanted.iter().map(|(_, k)| k.as_str()).collect();
            let list: Vec<&str> = keys.iter().copied().collect();
            return self
                .keys_in(doc! {"history.key": {"$in": list}}, |_, k| keys.contains(k))
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
                Prefix::of_id(id).is_some_and(|p| asked.contains(&(p.as_str().to_string(), k)))
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
        match result {
            Ok(_) => Ok(InsertOutcome::default()),
            Err(e) => match *e.kind {
                ErrorKind::InsertMany(ref failure) if failure.write_concern_error.is_none() => {
                    match failure.write_errors.as_deref() {
                        Some(errors) if errors.iter().any(|w| w.index >= docs_len) => {
                            let bad = errors.iter().map(|w| w.index).max().unwrap_or(0);
                            Err(malformed(
                                format!("a write error's index is {bad}"),
                                docs_len,
                            ))
                        }
                        Some(errors) if !errors.is_empty() => Ok(InsertOutcome {
                            errors: errors
                                .iter()
                                .map(|w| StatementError {
                                    index: w.index,
                                    code: w.code,
                                    message: w.message.clone(),
                                })
                                .collect(),
                        }),
                        _ => Err(StoreError::Transient(e)),
                    }
                }
                ErrorKind::Write(WriteFailure::WriteError(ref w)) => Ok(InsertOutcome {
                    errors: vec![StatementError {
                        index: 0,
                        code: w.code,
                        message: w.message.clone(),
                    }],
                }),
                // Refused by the driver before anything was sent: every
                // document is suspect, and the writer's isolation finds the
                // one at fault.
                ErrorKind::InvalidArgument { ref message, .. } => Ok(InsertOutcome {
                    errors: (0..docs_len)
                        .map(|index| StatementError {
                            index,
                            code: CLIENT_REFUSED,
                            message: format!("the MongoDB driver refused the document: {message}"),
                        })
                        .collect(),
                }),
                _ => Err(StoreError::Transient(e)),
            },
        }
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

/// The indexes of each mode. Unsharded: `prev` and `history.key` unique
/// across the collection. Sharded: both unique per customer (MongoDB
/// allows a unique index on a sharded collection only if it starts with
/// the shard key), and `{customerId: 1, _id: 1}`, which serves `load_head`
/// (customer equality, `_id` range, newest first) and is the index the
/// shard key needs: `{customerId: 1, tickers: 1}` cannot be, being
/// multikey, and the unique ones cannot, being partial.
fn index_models(sharded: bool) -> Vec<IndexModel> {
    let unique = |name: &str, field: &str| {
        let keys = if sharded {
            doc! {SHARD_KEY_FIELD: 1, field: 1}
        } else {
            doc! {field: 1}
        };
        IndexModel::builder()
            .keys(keys)
            .options(
                IndexOptions::builder()
                    .name(name.to_string())
                    .unique(true)
                    // Buckets written by other tools (the manual's own
                    // upsert) have neither field; they must not collide
                    // with each other on a missing value.
                    .partial_filter_expression(doc! {field: {"$exists": true}})
                    .build(),
            )
            .build()
    };
    let plain = |name: &str, keys: Document| {
        IndexModel::builder()
            .keys(keys)
            .options(IndexOptions::builder().name(name.to_string()).build())
            .build()
    };
    let mut models = if sharded {
        vec![
            // One successor per bucket: no two writers can both open page n+1.
            unique("customer_prev_unique", "prev"),
            // One copy of each trade in a customer's buckets.
            unique("customer_history_key_unique", "history.key"),
            plain("customer_id", doc! {SHARD_KEY_FIELD: 1, "_id": 1}),
        ]
    } else {
        vec![
            unique("prev_unique", "prev"),
            // One copy of each trade across all buckets.
            unique("history_key_unique", "history.key"),
        ]
    };
    // The keyword-search index (multikey over `tickers`).
    models.push(plain(
        "customer_tickers",
        doc! {SHARD_KEY_FIELD: 1, "tickers": 1},
    ));
    models
}

/// Why the collection is laid out for the other mode, if it is: its unique
/// indexes on `prev` and `history.key` are scoped to the collection
/// (unsharded) or start with `customerId` (sharded). Found by key pattern,
/// whatever they are named. A collection with both is half-way through a
/// move and refused by both modes.
pub fn layout_conflict(indexes: &[IndexModel], sharded: bool, ns: &str) -> Option<String> {
    let unique_on = |fields: &[&str]| -> Vec<String> {
        indexes
            .iter()
            .filter(|m| m.options.as_ref().and_then(|o| o.unique) == Some(true))
            .filter(|m| is_key(&m.keys, fields))
            .map(|m| {
                m.options
                    .as_ref()
                    .and_then(|o| o.name.clone())
                    .unwrap_or_else(|| m.keys.to_string())
            })
            .collect()
    };
    let global: Vec<String> = [&["prev"][..], &["history.key"]]
        .iter()
        .flat_map(|f| unique_on(f))
        .collect();
    let scoped: Vec<String> = [
        &[SHARD_KEY_FIELD, "prev"][..],
        &[SHARD_KEY_FIELD, "history.key"],
    ]
    .iter()
    .flat_map(|f| unique_on(f))
    .collect();
    if sharded && !global.is_empty() {
        Some(format!(
            "mongodb.sharded is true but {ns} has the unsharded layout's unique indexes {} \
             (trade ids unique across customers), which MongoDB does not allow on a sharded \
             collection. Move it to sharded mode with every worker stopped: drop them \
             (dropIndex) and run `tradebucket init` with mongodb.sharded = true; see \
             \"Moving an existing collection\" in docs/operations.md#sharding",
            global.join(", ")
        ))
    } else if !sharded && !scoped.is_empty() {
        Some(format!(
            "mongodb.sharded is false but {ns} has the sharded layout's unique indexes {} \
             (trade ids unique per customer): set mongodb.sharded = true, or go back to \
             the unsharded layout as docs/operations.md#sharding says",
            scoped.join(", ")
        ))
    } else {
        None
    }
}

/// Whether an index key pattern is exactly `fields`, in order, ascending.
fn is_key(keys: &Document, fields: &[&str]) -> bool {
    keys.len() == fields.len()
        && keys.iter().zip(fields).all(|((name, direction), field)| {
            let ascending = match direction {
                Bson::Int32(n) => *n == 1,
                Bson::Int64(n) => *n == 1,
                Bson::Double(n) => *n == 1.0,
                _ => false,
            };
            name == field && ascending
        })
}

/// The server's error code, for a command error.
fn command_code(e: &mongodb::error::Error) -> Option<i32> {
    match *e.kind {
        ErrorKind::Command(ref c) => Some(c.code),
        _ => None,
    }
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

/// Builds our view of a bucket from its stored form; or says why this
/// version cannot plan against it. `count` must be a whole number the
/// guard can match exactly: a `2.5` read as 2 would make every guarded
/// fill miss, for ever.
pub fn head_from_document(d: &Document) -> Result<BucketHead, UnreadableBucket> {
    let id = d
        .get_str("_id")
        // Not the document: messages reach the logs and dead letters, and a
        // bucket is up to 16 MiB of trades.
        .map_err(|_| UnreadableBucket {
            id: format!("{:?}", d.get("_id").map(Bson::element_type)),
            why: "its _id is not a string".to_string(),
        })?
        .to_string();
    let count = stored_number(d, "count")
        .and_then(|c| u32::try_from(c).ok())
        .ok_or_else(|| UnreadableBucket {
            id: id.clone(),
            why: format!(
                "its count is {}, not a whole number from 0 to 2^32-1",
                describe(d.get("count"))
            ),
        })?;
    // Without them the bucket is a legacy one (see `BucketHead::cap` and
    // `BucketHead::size`); a value that is not a count counts as absent.
    let cap = stored_number(d, "cap").and_then(|c| u32::try_from(c).ok());
    let size = match (stored_number(d, "bytes"), stored_number(d, "capBytes")) {
        (Some(bytes), Some(cap_bytes)) => Some(super::plan::Size { bytes, cap_bytes }),
        _ => None,
    };
    let keys = d
        .get_array("history")
        .map(|a| a.as_slice())
        .unwrap_or(&[])
        .iter()
        .filter_map(|e| e.as_document()?.get_str("key").ok().map(str::to_string))
        .collect();
    let mut wm = BTreeMap::new();
    if let Ok(w) = d.get_document("wm") {
        for (k, v) in w {
            let offset = match v {
                Bson::Int64(o) => *o,
                Bson::Int32(o) => i64::from(*o),
                _ => continue,
            };
            wm.insert(k.clone(), offset);
        }
    }
    Ok(BucketHead {
        id,
        customer: d.get("customerId").cloned().unwrap_or(Bson::Null),
        count,
        cap,
        size,
        keys,
        wm,
    })
}

/// A stored value's type and, if short, the value: enough to find the
/// bucket's fault without copying a whole field into a dead letter.
fn describe(v: Option<&Bson>) -> String {
    match v {
        None => "missing".to_string(),
        Some(v @ (Bson::Int32(_) | Bson::Int64(_) | Bson::Double(_) | Bson::Decimal128(_))) => {
            format!("{v}")
        }
        Some(v) => format!("of type {:?}", v.element_type()),
    }
}

/// A non-negative integer field, as any numeric BSON type.
fn stored_number(d: &Document, field: &str) -> Option<u64> {
    match d.get(field)? {
        Bson::Int32(n) => u64::try_from(*n).ok(),
        Bson::Int64(n) => u64::try_from(*n).ok(),
        Bson::Double(n) if *n >= 0.0 && n.fract() == 0.0 => Some(*n as u64),
        _ => None,
    }
}

/// The guarded append: matches only if nobody appended since we looked.
/// In sharded mode `shard_key` is the customer's (see
/// [`BucketStore::shard_key`]), so mongos sends it to one shard. The same
/// count means the same `bytes` (both change only here, together), so the
/// guard also vouches for the size bound the plan started from.
pub fn fill_statement(
    fill: &Fill,
    trades: &[&Trade],
    shard_key: Option<&CustomerId>,
) -> RawDocumentBuf {
    let mut max = RawDocumentBuf::new();
    for (k, v) in &fill.wm {
        max.append(format!("wm.{k}"), *v);
    }
    let tickers: RawArrayBuf = fill.tickers.iter().map(String::as_str).collect();
    let mut q = rawdoc! {"_id": fill.bucket_id.as_str(), "count": fill.expected_count as i64};
    match shard_key {
        Some(CustomerId::Int(i)) => q.append(SHARD_KEY_FIELD, *i),
        Some(CustomerId::Str(s)) => q.append(SHARD_KEY_FIELD, s.as_str()),
        None => {}
    }
    let mut inc = rawdoc! {"count": trades.len() as i64};
    if let Some(bytes) = fill.bytes {
        inc.append("bytes", bytes as i64);
    }
    rawdoc! {
        "q": q,
        "u": {
            "$push": {"history": {"$each": history(trades)}},
            "$inc": inc,
            "$max": max,
            "$addToSet": {"tickers": {"$each": tickers}},
        },
    }
}

/// A new bucket document.
pub fn bucket_document(bucket: &NewBucket, trades: &[&Trade]) -> RawDocumentBuf {
    let mut wm = RawDocumentBuf::new();
    for (k, v) in &bucket.wm {
        wm.append(k, *v);
    }
    // Only an embedded document with a NUL in a field name fails to
    // re-encode, and this value was either decoded from BSON (which cannot
    // hold such a name) or built from a customer id.
    let customer = RawBson::try_from(bucket.customer.clone())
        .expect("a customer id taken from BSON re-encodes as BSON");
    let tickers: RawArrayBuf = bucket.tickers.iter().map(String::as_str).collect();
    // Field for field what `size::empty_bucket` counts.
    rawdoc! {
        "_id": bucket.id.as_str(),
        "customerId": customer,
        "count": trades.len() as i64,
        "cap": i64::from(bucket.limits.cap),
        "capBytes": bucket.limits.cap_bytes as i64,
        "bytes": bucket.bytes as i64,
        "history": history(trades),
        "tickers": tickers,
        "prev": bucket.prev.as_str(),
        "wm": wm,
    }
}

/// The trades' history entries, copied as encoded bytes.
fn history(trades: &[&Trade]) -> RawArrayBuf {
    let mut history = RawArrayBuf::new();
    for t in trades {
        history.push(t.doc.clone());
    }
    history
}

#[cfg(test)]
mod tests {
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

    use super::*;

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

    /// A `count` the guard could never match is the bucket's fault, told
    /// apart from a bucket we can plan against; integral doubles are fine.
    #[test]
    fn a_count_that_is_not_a_whole_number_makes_the_bucket_unreadable() {
        let bucket = |count: Bson| doc! {"_id": "7_1700000000", "count": count, "history": []};
        for bad in [
            Bson::Double(2.5),
            Bson::Int32(-1),
            Bson::String("2".into()),
            Bson::Null,
            Bson::Double(f64::NAN),
            Bson::Int64(1 << 33),
        ] {
            let e = head_from_document(&bucket(bad.clone())).unwrap_err();
            assert_eq!(e.id, "7_1700000000", "{bad}");
            assert!(e.why.contains("count"), "{bad}: {e}");
        }
        for good in [Bson::Double(2.0), Bson::Int32(2), Bson::Int64(2)] {
            assert_eq!(head_from_document(&bucket(good)).unwrap().count, 2);
        }
        let missing = doc! {"_id": "7_1700000000", "history": []};
        assert!(head_from_document(&missing)
            .unwrap_err()
            .why
            .contains("missing"));
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

    fn index(name: &str, keys: Document, unique: bool) -> IndexModel {
        IndexModel::builder()
            .keys(keys)
            .options(
                IndexOptions::builder()
                    .name(name.to_string())
                    .unique(unique)
                    .build(),
            )
            .build()
    }

    #[test]
    fn each_mode_creates_what_the_other_refuses() {
        let ns = "db.trades";
        for sharded in [false, true] {
            let own = index_models(sharded);
            assert_eq!(layout_conflict(&own, sharded, ns), None, "{sharded}");
            let refused = layout_conflict(&own, !sharded, ns).expect("the other mode refuses");
            assert!(refused.contains("docs/operations.md#sharding"), "{refused}");
            // Half-way through a move, both sets: both modes refuse.
            let mut both = own.clone();
            both.extend(index_models(!sharded));
            assert!(layout_conflict(&both, sharded, ns).is_some());
        }
        // Sharded, every index starts with the shard key, and one that
        // can support it is neither partial nor multikey: `customer_id`.
        for m in index_models(true) {
            assert_eq!(
                m.keys.keys().next().map(String::as_str),
                Some(SHARD_KEY_FIELD)
            );
        }
        assert!(index_models(true)
            .iter()
            .any(|m| is_key(&m.keys, &[SHARD_KEY_FIELD, "_id"])
                && m.options
                    .as_ref()
                    .unwrap()
                    .partial_filter_expression
                    .is_none()));
    }

    #[test]
    fn layouts_are_told_by_key_pattern_not_name() {
        let ns = "db.trades";
        let renamed = vec![index("mine", doc! {"history.key": 1.0}, true)];
        let why = layout_conflict(&renamed, true, ns).expect("a global unique key index");
        assert!(why.contains("mine") && why.contains(ns), "{why}");
        // Not unique, or descending, or another key: not the layout's.
        for other in [
            index("a", doc! {"history.key": 1}, false),
            index("b", doc! {"prev": -1}, true),
            index("c", doc! {"prev": 1, "count": 1}, true),
        ] {
            assert_eq!(layout_conflict(&[other], true, ns), None);
        }
        let scoped = vec![index("s", doc! {"customerId": 1_i64, "prev": 1}, true)];
        assert!(layout_conflict(&scoped, false, ns).is_some());
    }

    #[test]
    fn heads_round_trip_through_the_stored_form() {
        let d = doc! {"_id": "5_0000000100", "customerId": 5_i64, "count": 2_i64,
        "history": [{"key": "a"}, {"key": "b"}], "wm": {"t:0": 17_i64}};
        let h = head_from_document(&d).unwrap();
        assert_eq!(h.count, 2);
        assert_eq!(h.keys.len(), 2);
        assert_eq!(h.wm.get("t:0"), Some(&17));
        assert_eq!(h.customer, Bson::Int64(5));
    }
}
