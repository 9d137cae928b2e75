//! The bucket collection in MongoDB: indexes, loading a customer's newest
//! bucket, the guarded fill updates and the bucket inserts, and the reads
//! behind `page` and `audit`.
//!
//! Fills go out as one raw `update` command with many statements (every
//! server version has it; the driver's typed multi-statement API needs
//! MongoDB 8.0). That command reports only the total matched count, so a
//! shortfall marks every customer of the command as stale, to be reloaded:
//! rare, and always safe, because re-planning is idempotent.

use std::collections::{BTreeMap, HashSet};

use futures::{StreamExt, TryStreamExt};
use mongodb::bson::{doc, rawdoc, Bson, Document, RawArrayBuf, RawBson, RawDocumentBuf};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::options::{
    Acknowledgment, ClientOptions, FindOneOptions, IndexOptions, InsertManyOptions, WriteConcern,
};
use mongodb::{Client, Collection, Database, IndexModel};

use super::id::Prefix;
use super::plan::{BucketHead, Fill, NewBucket};
use secrecy::ExposeSecret;

use crate::config::{Settings, WriteAcknowledgment};
use crate::event::{CustomerId, Trade};

/// Duplicate key: another writer (or an earlier delivery) got there first.
pub const DUPLICATE_KEY: i32 = 11000;

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
    /// A response we cannot interpret, or an error that retrying will not
    /// change (bad credentials, missing privileges). Still retried by the
    /// pipeline, loudly, because dropping the batch would lose trades.
    #[error("MongoDB request failed: {0}")]
    Failed(String),
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

#[derive(Clone)]
pub struct BucketStore {
    client: Client,
    db: Database,
    coll: Collection<Document>,
    write_concern: WriteConcern,
    /// `write_concern` as the raw `update` command spells it, encoded once.
    write_concern_doc: RawDocumentBuf,
    load_concurrency: usize,
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
        let client = Client::with_options(options).map_err(scrubbed)?;
        let db = client.database(&m.database);
        let coll = db.collection::<Document>(&m.collection);
        let w = match m.write_concern {
            WriteAcknowledgment::Majority => Acknowledgment::Majority,
            WriteAcknowledgment::Nodes(n) => Acknowledgment::Nodes(n),
        };
        let write_concern = WriteConcern::builder().w(w).journal(m.journal).build();
        Ok(BucketStore {
            client,
            db,
            coll,
            write_concern_doc: write_concern_doc(&write_concern),
            write_concern,
            load_concurrency: m.load_concurrency,
        })
    }

    pub fn collection(&self) -> &Collection<Document> {
        &self.coll
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Creates the indexes the guarantees rest on. Idempotent.
    pub async fn init(&self) -> Result<(), StoreError> {
        let unique = |name: &str, field: &str| {
            IndexModel::builder()
                .keys(doc! {field: 1})
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
        let models = vec![
            // One successor per bucket: no two writers can both open page n+1.
            unique("prev_unique", "prev"),
            // One copy of each trade across all buckets.
            unique("history_key_unique", "history.key"),
            // The keyword-search index (multikey over `tickers`).
            IndexModel::builder()
                .keys(doc! {"customerId": 1, "tickers": 1})
                .options(
                    IndexOptions::builder()
                        .name("customer_tickers".to_string())
                        .build(),
                )
                .build(),
        ];
        self.coll.create_indexes(models).await?;
        Ok(())
    }

    /// The newest bucket of `customer` (highest `_id` in its prefix range),
    /// with just the fields planning needs.
    pub async fn load_head(&self, customer: &CustomerId) -> Result<Option<BucketHead>, StoreError> {
        let options = FindOneOptions::builder()
            .sort(doc! {"_id": -1})
            .projection(doc! {
                "count": 1, "cap": 1, "capBytes": 1, "bytes": 1,
                "customerId": 1, "wm": 1, "history.key": 1,
            })
            .build();
        let doc = self
            .coll
            .find_one(Prefix::of(customer).range())
            .with_options(options)
            .await?;
        doc.map(|d| head_from_document(&d)).transpose()
    }

    /// Loads several customers' heads, `load_concurrency` at a time.
    pub async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, Option<BucketHead>)>, StoreError> {
        futures::stream::iter(customers)
            .map(|c| async move {
                let head = self.load_head(&c).await?;
                Ok::<_, StoreError>((c, head))
            })
            .buffer_unordered(self.load_concurrency)
            .try_collect()
            .await
    }

    /// Which of `keys` are stored already, and in which bucket.
    pub async fn find_keys(&self, keys: &[String]) -> Result<Vec<(String, String)>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: HashSet<&str> = keys.iter().map(String::as_str).collect();
        let mut cursor = self
            .coll
            .find(doc! {"history.key": {"$in": keys}})
            .projection(doc! {"history.key": 1})
            .await?;
        let mut found = Vec::new();
        while let Some(d) = cursor.try_next().await? {
            let id = d.get_str("_id").unwrap_or_default().to_string();
            for entry in d.get_array("history").map(|a| a.as_slice()).unwrap_or(&[]) {
                if let Some(k) = entry.as_document().and_then(|e| e.get_str("key").ok()) {
                    if wanted.contains(k) {
                        found.push((k.to_string(), id.clone()));
                    }
                }
            }
        }
        Ok(found)
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
            let reply = self
                .db
                .run_raw_command(rawdoc! {
                    "update": self.coll.name(),
                    "updates": updates,
                    "ordered": false,
                    "writeConcern": self.write_concern_doc.clone(),
                })
                .await?;
            let part = parse_write_reply(&reply)?;
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
        match raw.insert_many(docs).with_options(options).await {
            Ok(_) => Ok(InsertOutcome::default()),
            Err(e) => match *e.kind {
                ErrorKind::InsertMany(ref failure) if failure.write_concern_error.is_none() => {
                    match failure.write_errors.as_deref() {
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
        let mut cursor = self
            .coll
            .find(doc! {"_id": Prefix::of(customer).page_regex()})
            .sort(doc! {"_id": 1})
            .skip(n.saturating_sub(1))
            .limit(1)
            .await?;
        Ok(cursor.try_next().await?)
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
    d
}

/// `(matched, statement errors)` from an `update` reply. A write-concern
/// error makes the whole outcome unknown: an error, so the batch is retried.
fn parse_write_reply(reply: &Document) -> Result<(u64, Vec<StatementError>), StoreError> {
    if let Ok(wce) = reply.get_document("writeConcernError") {
        let code = wce.get_i32("code").unwrap_or(-1);
        let message = wce.get_str("errmsg").unwrap_or_default();
        return Err(StoreError::Failed(format!(
            "write concern error {code}: {message}"
        )));
    }
    let n = match reply.get("n") {
        Some(Bson::Int32(n)) => *n as u64,
        Some(Bson::Int64(n)) => *n as u64,
        Some(Bson::Double(n)) => *n as u64,
        _ => {
            return Err(StoreError::Failed(
                "update reply without a numeric n".to_string(),
            ))
        }
    };
    let mut errors = Vec::new();
    if let Ok(list) = reply.get_array("writeErrors") {
        for e in list.iter().filter_map(Bson::as_document) {
            let index = match e.get("index") {
                Some(Bson::Int32(i)) => *i as usize,
                Some(Bson::Int64(i)) => *i as usize,
                _ => {
                    return Err(StoreError::Failed(
                        "update reply with a write error without index".to_string(),
                    ))
                }
            };
            errors.push(StatementError {
                index,
                code: e.get_i32("code").unwrap_or(-1),
                message: e.get_str("errmsg").unwrap_or_default().to_string(),
            });
        }
    }
    Ok((n, errors))
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

/// Builds our view of a bucket from its stored form.
pub fn head_from_document(d: &Document) -> Result<BucketHead, StoreError> {
    let id = d
        .get_str("_id")
        // Not the document: messages reach the logs on every retry, and a
        // bucket is up to 16 MiB of trades.
        .map_err(|_| StoreError::Failed("a bucket with a non-string _id".to_string()))?
        .to_string();
    let count = match d.get("count") {
        Some(Bson::Int32(n)) => *n as u32,
        Some(Bson::Int64(n)) => *n as u32,
        Some(Bson::Double(n)) => *n as u32,
        _ => {
            return Err(StoreError::Failed(format!(
                "bucket {id} has no numeric count"
            )))
        }
    };
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
/// The same count means the same `bytes` (both change only here, together),
/// so the guard also vouches for the size bound the plan started from.
pub fn fill_statement(fill: &Fill, trades: &[&Trade]) -> RawDocumentBuf {
    let mut max = RawDocumentBuf::new();
    for (k, v) in &fill.wm {
        max.append(format!("wm.{k}"), *v);
    }
    let tickers: RawArrayBuf = fill.tickers.iter().map(String::as_str).collect();
    let mut inc = rawdoc! {"count": trades.len() as i64};
    if let Some(bytes) = fill.bytes {
        inc.append("bytes", bytes as i64);
    }
    rawdoc! {
        "q": {"_id": fill.bucket_id.as_str(), "count": fill.expected_count as i64},
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
    use super::*;

    #[test]
    fn write_replies_are_parsed_with_indexes() {
        let reply = doc! {"ok": 1.0, "n": 3, "nModified": 3, "writeErrors": [
            {"index": 4, "code": 11000, "errmsg": "E11000 duplicate key"},
            {"index": 7, "code": 121, "errmsg": "Document failed validation"},
        ]};
        let (n, errs) = parse_write_reply(&reply).unwrap();
        assert_eq!(n, 3);
        assert_eq!(errs.len(), 2);
        assert!(errs[0].is_duplicate_key());
        assert_eq!((errs[1].index, errs[1].code), (7, 121));
        let wce = doc! {"ok": 1.0, "n": 1, "writeConcernError": {"code": 64}};
        assert!(parse_write_reply(&wce).is_err());
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
