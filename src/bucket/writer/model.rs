//! The real [`BucketWriter`] against a model of MongoDB, with several
//! writers interleaved at every request and at every statement of a
//! request: what two workers of one group, a zombie after a rebalance and
//! an upstream that sends one trade on two partitions do together.
//!
//! The model applies the writer's own statements (the BSON that
//! `fill_statement` and `bucket_document` build) the way MongoDB does: a
//! fill matches only its `{_id, count}` guard; `history.key` and `prev`
//! are unique across buckets; each statement is atomic, a command is not.
//! A writer yields to the scheduler before each statement, so any other
//! writer's statements can land between any two of its own. A writer can
//! crash at any point (its future dropped, its cache lost) and restart
//! from its last committed batch.
//!
//! What must hold: every event settled as stored (`Written`,
//! `AlreadyApplied`, `Duplicate`) is stored, in one of its customer's
//! buckets, exactly once; at the end every distinct trade sent is stored;
//! every chain is whole, every bucket but the newest full, none appended
//! after its successor was inserted. The writer's shortfall rule before
//! this test existed (a fill counted as stored when its *last* key was
//! there) fails it within a few hundred cases.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use mongodb::bson::{rawdoc, Bson, DateTime, Document, RawDocumentBuf};
use proptest::prelude::*;

use super::{BucketWriter, Events, InsertSplit, Outcome};
use crate::bucket::db::BucketDb;
use crate::bucket::id::Prefix;
use crate::bucket::plan::{LoadedHead, Room};
use crate::bucket::size;
use crate::bucket::store::{
    head_from_document, FillOutcome, InsertOutcome, StatementError, StoreError, DUPLICATE_KEY,
};
use crate::event::{CustomerId, Source, Trade};
use crate::metrics::Metrics;

/// `Pending` once: a point where the scheduler may run another writer.
struct Turn(bool);

impl Future for Turn {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

fn turn() -> Turn {
    Turn(false)
}

/// The collection, and the order of its operations.
#[derive(Default)]
struct Db {
    docs: BTreeMap<String, Document>,
    ops: u64,
    /// Per bucket, the operation that last appended to it (or inserted it).
    last_append: HashMap<String, u64>,
    /// Per bucket, the operation that inserted its successor.
    successor_at: HashMap<String, u64>,
}

fn number(v: Option<&Bson>) -> i64 {
    match v {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        other => panic!("not an integer: {other:?}"),
    }
}

fn keys_of(d: &Document) -> Vec<String> {
    let history = d.get_array("history").expect("history");
    let key = |e: &Bson| e.as_document()?.get_str("key").ok().map(str::to_string);
    history.iter().filter_map(key).collect()
}

impl Db {
    /// The bucket other than `except` that holds `key`, if any.
    fn holder(&self, key: &str, except: &str) -> Option<&str> {
        let held =
            |(id, d): &(&String, &Document)| *id != except && keys_of(d).contains(&key.into());
        self.docs.iter().find(held).map(|(id, _)| id.as_str())
    }

    fn head(&self, customer: &CustomerId) -> LoadedHead {
        let prefix = Prefix::of(customer);
        let newest = self
            .docs
            .range(prefix.as_str().to_string()..)
            .take_while(|(id, _)| prefix.owns(id))
            .last();
        newest.map(|(_, d)| head_from_document(d)).transpose()
    }

    /// One fill statement, as MongoDB applies it: `Ok(false)` when its
    /// guard matches nothing.
    fn fill(&mut self, statement: &Document) -> Result<bool, i32> {
        let q = statement.get_document("q").expect("q");
        let id = q.get_str("_id").expect("_id").to_string();
        let Some(bucket) = self.docs.get(&id) else {
            return Ok(false);
        };
        if number(bucket.get("count")) != number(q.get("count")) {
            return Ok(false);
        }
        let u = statement.get_document("u").expect("u");
        let push = u
            .get_document("$push")
            .and_then(|p| p.get_document("history"));
        let entries = push
            .and_then(|h| h.get_array("$each"))
            .expect("$each")
            .clone();
        for e in &entries {
            let key = e
                .as_document()
                .and_then(|e| e.get_str("key").ok())
                .expect("key");
            if self.holder(key, &id).is_some() {
                return Err(DUPLICATE_KEY);
            }
        }
        let bucket = self.docs.get_mut(&id).expect("matched");
        apply_update(bucket, u, entries);
        self.ops += 1;
        self.last_append.insert(id, self.ops);
        Ok(true)
    }

    /// One new bucket, under the unique `_id`, `prev` and `history.key`
    /// indexes.
    fn insert(&mut self, d: Document) -> Result<(), i32> {
        let id = d.get_str("_id").expect("_id").to_string();
        let prev = d.get_str("prev").expect("prev").to_string();
        let taken = self.docs.contains_key(&id)
            || self
                .docs
                .values()
                .any(|b| b.get_str("prev") == Ok(prev.as_str()))
            || keys_of(&d).iter().any(|k| self.holder(k, &id).is_some());
        if taken {
            return Err(DUPLICATE_KEY);
        }
        self.docs.insert(id.clone(), d);
        self.ops += 1;
        self.last_append.insert(id, self.ops);
        self.successor_at.insert(prev, self.ops);
        Ok(())
    }
}

/// `$push`, `$inc`, `$max` (on `wm.<partition>`) and `$addToSet` of a
/// fill, applied to `bucket`.
fn apply_update(bucket: &mut Document, u: &Document, entries: Vec<Bson>) {
    bucket
        .get_array_mut("history")
        .expect("history")
        .extend(entries);
    for (field, by) in u.get_document("$inc").expect("$inc") {
        let now = bucket.get(field).map_or(0, |v| number(Some(v)));
        bucket.insert(field, now + number(Some(by)));
    }
    let wm = bucket.get_document_mut("wm").expect("wm");
    for (path, offset) in u.get_document("$max").expect("$max") {
        let partition = path.strip_prefix("wm.").expect("wm.<partition>");
        let higher = wm
            .get(partition)
            .is_none_or(|old| number(Some(old)) < number(Some(offset)));
        if higher {
            wm.insert(partition, offset.clone());
        }
    }
    let add = u
        .get_document("$addToSet")
        .and_then(|a| a.get_document("tickers"));
    let tickers = add
        .and_then(|t| t.get_array("$each"))
        .expect("tickers")
        .clone();
    let stored = bucket.get_array_mut("tickers").expect("tickers");
    for t in tickers {
        if !stored.contains(&t) {
            stored.push(t);
        }
    }
}

/// What goes wrong in the model database, as a case draws it, so that
/// the writer's retry and isolation paths run against interleaved writers
/// too: a request that fails before it runs, a reply lost after the write
/// applied (the writer cannot tell the two apart), a transient error of one
/// statement (code 112, WriteConflict: says nothing of the data), and
/// documents refused for their data (code 121, DocumentValidationFailure)
/// whenever they hold a poisoned trade, as a validator refuses the same
/// trade every time.
#[derive(Default)]
struct Faults {
    /// Draws, used in turn; past its end, no faults.
    script: Vec<u8>,
    next: usize,
    /// Keys every statement holding one is refused for.
    poison: HashSet<String>,
}

/// What a request meets.
#[derive(PartialEq)]
enum Fault {
    None,
    /// Fails before anything is applied.
    Before,
    /// Applied, then the reply is lost.
    ReplyLost,
}

const WRITE_CONFLICT: i32 = 112;
const VALIDATION_FAILED: i32 = 121;

impl Faults {
    /// The next draw; none (no fault) once the script is used up, so a
    /// batch settles in the end however its faults fell.
    fn draw(&mut self) -> u8 {
        self.next += 1;
        self.script.get(self.next - 1).copied().unwrap_or(u8::MAX)
    }

    fn request(&mut self) -> Fault {
        match self.draw() % 16 {
            0 => Fault::Before,
            1 => Fault::ReplyLost,
            _ => Fault::None,
        }
    }

    /// The error a statement holding `keys` meets, if any.
    fn statement(&mut self, keys: &[String]) -> Option<i32> {
        if keys.iter().any(|k| self.poison.contains(k)) {
            return Some(VALIDATION_FAILED);
        }
        (self.draw() % 16 == 2).then_some(WRITE_CONFLICT)
    }
}

fn lost(what: &str) -> StoreError {
    StoreError::Failed(format!("the model lost the {what} request"))
}

/// The model behind the writer's seam; shared by every writer of a case.
#[derive(Clone, Default)]
struct ModelDb(Arc<Mutex<Db>>, Arc<Mutex<Faults>>);

impl ModelDb {
    fn db(&self) -> std::sync::MutexGuard<'_, Db> {
        self.0.lock().expect("not poisoned")
    }

    fn faults(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.1.lock().expect("not poisoned")
    }

    fn with_faults(script: Vec<u8>, poison: HashSet<String>) -> Self {
        let db = ModelDb::default();
        *db.faults() = Faults {
            script,
            next: 0,
            poison,
        };
        db
    }

    /// One statement applied, or the code it is refused with.
    fn statement(
        &self,
        keys: &[String],
        apply: impl FnOnce(&mut Db) -> Result<bool, i32>,
    ) -> Result<bool, i32> {
        match self.faults().statement(keys) {
            Some(code) => Err(code),
            None => apply(&mut self.db()),
        }
    }
}

impl BucketDb for ModelDb {
    fn shard_key(&self, _: &CustomerId) -> Option<CustomerId> {
        None
    }

    async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        if self.faults().request() != Fault::None {
            return Err(lost("load"));
        }
        let mut heads = Vec::with_capacity(customers.len());
        for c in customers {
            turn().await;
            let head = self.db().head(&c);
            heads.push((c, head));
        }
        Ok(heads)
    }

    async fn find_keys(
        &self,
        wanted: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        turn().await;
        if self.faults().request() != Fault::None {
            return Err(lost("find"));
        }
        let db = self.db();
        let mut found = Vec::new();
        for key in wanted.iter().map(|(_, k)| k).collect::<HashSet<_>>() {
            if let Some(id) = db.holder(key, "") {
                found.push((key.clone(), id.to_string()));
            }
        }
        Ok(found)
    }

    async fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> Result<FillOutcome, StoreError> {
        let fault = self.faults().request();
        if fault == Fault::Before {
            return Err(lost("update"));
        }
        let mut outcome = FillOutcome::default();
        for (index, s) in statements.iter().enumerate() {
            turn().await;
            let statement = s.to_document().expect("valid BSON");
            let keys = pushed_keys(&statement);
            match self.statement(&keys, |db| db.fill(&statement)) {
                Ok(matched) => outcome.matched += u64::from(matched),
                Err(code) => outcome.errors.push(refused(index, code)),
            }
        }
        match fault {
            Fault::ReplyLost => Err(lost("update")),
            _ => Ok(outcome),
        }
    }

    async fn insert_buckets(
        &self,
        docs: Vec<RawDocumentBuf>,
        ordered: bool,
    ) -> Result<InsertOutcome, StoreError> {
        let fault = self.faults().request();
        if fault == Fault::Before {
            return Err(lost("insert"));
        }
        let mut outcome = InsertOutcome::default();
        for (index, d) in docs.iter().enumerate() {
            turn().await;
            let d = d.to_document().expect("valid BSON");
            let keys = keys_of(&d);
            if let Err(code) = self.statement(&keys, |db| db.insert(d).map(|()| true)) {
                outcome.errors.push(refused(index, code));
                if ordered {
                    break;
                }
            }
        }
        match fault {
            Fault::ReplyLost => Err(lost("insert")),
            _ => Ok(outcome),
        }
    }
}

/// The keys a fill statement appends.
fn pushed_keys(statement: &Document) -> Vec<String> {
    let each = statement
        .get_document("u")
        .and_then(|u| u.get_document("$push"))
        .and_then(|p| p.get_document("history"))
        .and_then(|h| h.get_array("$each"));
    let key = |e: &Bson| e.as_document()?.get_str("key").ok().map(str::to_string);
    each.map(|a| a.iter().filter_map(key).collect())
        .unwrap_or_default()
}

fn refused(index: usize, code: i32) -> StatementError {
    let message = match code {
        DUPLICATE_KEY => "E11000 duplicate key",
        VALIDATION_FAILED => "Document failed validation",
        _ => "WriteConflict",
    };
    StatementError {
        index,
        code,
        message: message.into(),
    }
}

/// One event as sent: customer, trade id, seconds, partition.
type Sent = (Trade, Source);

/// The trade id of a key `t:<customer>-<id>`.
fn trade_number(key: &str) -> u32 {
    key.rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn trade(customer: i64, id: u32, secs: i64) -> Trade {
    let key = format!("t:{customer}-{id}");
    Trade {
        doc: rawdoc! {"key": key.as_str(), "date": DateTime::from_millis(secs * 1000)},
        key: key.into(),
        legacy_key: None,
        customer: CustomerId::Int(customer),
        ticker: if id.is_multiple_of(2) { "A" } else { "B" }.into(),
        date_ms: secs * 1000,
    }
}

/// Events on two partitions of a few hot customers; trade ids repeat, on
/// the same partition or the other one (an upstream that sends again).
fn streams() -> impl Strategy<Value = [Vec<Sent>; 2]> {
    let event = (0i64..3, 0u32..30, 0i64..3, 0i32..2);
    proptest::collection::vec(event, 1..70).prop_map(|raw| {
        let mut secs = 1_000;
        let mut parts: [Vec<Sent>; 2] = [Vec::new(), Vec::new()];
        for (customer, id, delta, p) in raw {
            secs += delta;
            let part = &mut parts[p as usize];
            let source = Source {
                topic: "t.x".into(),
                partition: p,
                offset: part.len() as i64,
            };
            part.push((trade(customer, id, secs), source));
        }
        parts
    })
}

/// A writer's batches, and how many of them are committed.
type Plan = (Vec<Vec<Sent>>, Arc<Mutex<usize>>);

/// What each writer of a case reads: batches of a stream, in order. A
/// zombie reads a window of partition 0 again while its owner does.
#[derive(Debug, Clone)]
struct Reader {
    partition: usize,
    from: usize,
    batch_len: usize,
}

fn readers() -> impl Strategy<Value = Vec<Reader>> {
    let owner = |p: usize| {
        (1usize..12).prop_map(move |n| Reader {
            partition: p,
            from: 0,
            batch_len: n,
        })
    };
    let zombie = (0usize..40, 1usize..12).prop_map(|(from, n)| Reader {
        partition: 0,
        from,
        batch_len: n,
    });
    (owner(0), owner(1), proptest::option::of(zombie)).prop_map(|(a, b, z)| {
        let mut readers = vec![a, b];
        readers.extend(z);
        readers
    })
}

/// Every settled event's outcome, by key: the test's record of what the
/// writers claimed.
type Claims = Arc<Mutex<Vec<(String, Outcome)>>>;

/// One writer's whole life: its batches in order, each retried until
/// settled; `committed` counts the batches done (a restart resumes there).
/// With `hold`, every batch but the last may hold trades back, as the
/// worker does under a backlog: they are written first in the next batch,
/// and the commit stops at the oldest batch with a trade still held.
fn writing(
    db: ModelDb,
    batches: Vec<Vec<Sent>>,
    committed: Arc<Mutex<usize>>,
    claims: Claims,
    config: Config,
) -> Pin<Box<dyn Future<Output = ()>>> {
    Box::pin(async move {
        let Config {
            capacity,
            hold,
            cache,
            inserts,
        } = config;
        let mut writer =
            BucketWriter::new(db, capacity, cache, Metrics::new()).with_insert_split(InsertSplit {
                commands: inserts,
                min_buckets: 1,
            });
        let from = *committed.lock().unwrap();
        // Held trades, each with the batch it came in, and what each
        // held customer's bucket takes.
        let mut held: Vec<(Sent, usize)> = Vec::new();
        let mut rooms: HashMap<CustomerId, Room> = HashMap::new();
        for (k, batch) in batches.iter().enumerate().skip(from) {
            let may_hold = (hold && k + 1 < batches.len()).then_some(0);
            // As the stage: a held customer whose trades in the batch all
            // fit in its bucket stays held, and they with it, unplanned.
            if may_hold.is_none() {
                rooms.clear();
            }
            keep_what_fits(&mut rooms, batch);
            let (kept, mut events): (Vec<_>, Vec<_>) = std::mem::take(&mut held)
                .into_iter()
                .partition(|((t, _), _)| rooms.contains_key(&t.customer));
            // Written as the stage writes them: the held trades and the
            // batch's as two parts of one call.
            let held_before = events.len();
            events.extend(batch.iter().map(|e| (e.clone(), k)));
            let sent: Vec<Sent> = events.iter().map(|(e, _)| e.clone()).collect();
            let mut outcomes = vec![Outcome::Pending; held_before];
            outcomes.extend(batch.iter().map(|(t, _)| match rooms.get(&t.customer) {
                Some(&room) => Outcome::Held(room),
                None => Outcome::Pending,
            }));
            let mut attempts = 0;
            // A failed call is retried at once (the model needs no
            // backoff); faults are drawn at about one request in eight.
            let parts = Events::new(&sent[..held_before], &sent[held_before..]);
            while writer.write(parts, &mut outcomes, may_hold).await.is_err() {
                attempts += 1;
                assert!(attempts < 200, "a batch never settles");
            }
            let mut claims = claims.lock().unwrap();
            held = kept;
            for ((event, at), outcome) in events.into_iter().zip(outcomes) {
                match outcome {
                    Outcome::Held(room) => {
                        rooms.insert(event.0.customer.clone(), room);
                        held.push((event, at));
                    }
                    o => claims.push((event.0.key.to_string(), o)),
                }
            }
            let oldest_held = held.iter().map(|(_, at)| *at).min();
            *committed.lock().unwrap() = oldest_held.unwrap_or(k + 1);
        }
    })
}

/// Keeps in `rooms` (the held customers) those whose trades in `batch` all
/// fit in their bucket, as `pipeline::stage::held` finds them: each trade
/// taken from its customer's room; a customer with one that does not fit
/// leaves `rooms`, and its held trades are written with the batch.
fn keep_what_fits(rooms: &mut HashMap<CustomerId, Room>, batch: &[Sent]) {
    let mut over = HashSet::new();
    for (trade, source) in batch {
        if let Some(room) = rooms.get_mut(&trade.customer) {
            if !room.take(size::charge(trade, source)) {
                over.insert(trade.customer.clone());
            }
        }
    }
    rooms.retain(|c, _| !over.contains(c));
}

/// How every writer of a case is set up.
#[derive(Debug, Clone, Copy)]
struct Config {
    capacity: u32,
    /// Trades held back between batches, as under a backlog.
    hold: bool,
    /// Customers cached: below the case's three customers, a write evicts
    /// heads it loaded before it plans them.
    cache: usize,
    /// Insert commands at once, with no minimum size, so that the case's
    /// few buckets are split too.
    inserts: usize,
}

/// Runs the writers to the end, interleaved as `schedule` says; a step
/// `(w, true)` crashes writer `w` (a new one starts from its commit).
fn run(
    db: &ModelDb,
    readers: &[Reader],
    parts: &[Vec<Sent>; 2],
    schedule: &[(usize, bool)],
    config: Config,
) -> Claims {
    let claims = Claims::default();
    let plans: Vec<Plan> = readers
        .iter()
        .map(|r| {
            let stream = &parts[r.partition][r.from.min(parts[r.partition].len())..];
            let batches = stream.chunks(r.batch_len).map(<[Sent]>::to_vec).collect();
            (batches, Arc::default())
        })
        .collect();
    let start = |w: usize| {
        writing(
            db.clone(),
            plans[w].0.clone(),
            plans[w].1.clone(),
            claims.clone(),
            config,
        )
    };
    let mut tasks: Vec<Option<Pin<Box<dyn Future<Output = ()>>>>> =
        (0..readers.len()).map(|w| Some(start(w))).collect();
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let steps = schedule.iter().copied().chain((0..).map(|i| (i, false)));
    for (pick, crash) in steps.take(1_000_000) {
        let live: Vec<usize> = (0..tasks.len()).filter(|&w| tasks[w].is_some()).collect();
        let Some(&w) = live.get(pick % live.len().max(1)) else {
            break;
        };
        if crash {
            tasks[w] = Some(start(w));
        }
        if tasks[w]
            .as_mut()
            .expect("live")
            .as_mut()
            .poll(&mut cx)
            .is_ready()
        {
            tasks[w] = None;
        }
    }
    assert!(
        tasks.iter().all(Option::is_none),
        "the writers never finished"
    );
    claims
}

/// Every key in the buckets once, and where.
fn stored(db: &Db) -> HashMap<String, String> {
    let mut stored = HashMap::new();
    for (id, d) in &db.docs {
        for k in keys_of(d) {
            if let Some(other) = stored.insert(k.clone(), id.clone()) {
                panic!("{k} stored twice: in {other} and {id}");
            }
        }
    }
    stored
}

/// Chains whole, counts true, every bucket but the newest full, none
/// appended after its successor went in.
fn check_chains(db: &Db, capacity: u32) {
    let mut prev: Option<(String, String)> = None; // (prefix, last id)
    for (id, d) in &db.docs {
        let prefix = Prefix::of_id(id)
            .expect("a bucket _id")
            .as_str()
            .to_string();
        let expected = match &prev {
            Some((p, last)) if *p == prefix => last.clone(),
            _ => prefix.clone(),
        };
        assert_eq!(d.get_str("prev").unwrap(), expected, "chain broken at {id}");
        let count = number(d.get("count"));
        assert_eq!(count as usize, keys_of(d).len(), "{id}: count");
        if let Some(successor) = db.successor_at.get(id) {
            assert!(
                count >= i64::from(capacity),
                "{id} has a successor but is not full"
            );
            assert!(
                db.last_append[id] < *successor,
                "{id} appended after its successor"
            );
        }
        prev = Some((prefix, id.clone()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Two owners, perhaps a zombie, one shared database, statements
    /// interleaved at random, crashes at random, trades held back between
    /// batches or not, a cache smaller than the customers or not, and the
    /// database failing requests, losing replies after applying them,
    /// failing single statements and refusing poisoned trades: every trade
    /// claimed stored is stored once, in its customer's buckets; only
    /// poisoned trades are dead-lettered; in the end every other trade sent
    /// is stored.
    #[test]
    fn interleaved_writers_store_every_trade_once(
        parts in streams(),
        readers in readers(),
        schedule in proptest::collection::vec((0usize..3, proptest::bool::weighted(0.02)), 0..400),
        capacity in 1u32..5,
        hold in proptest::bool::ANY,
        cache in prop_oneof![Just(100usize), 1usize..3],
        inserts in 1usize..4,
        script in prop_oneof![Just(Vec::new()), proptest::collection::vec(any::<u8>(), 1..200)],
        poison_every in proptest::option::of(4u32..9),
    ) {
        let poison: HashSet<String> = parts
            .iter()
            .flatten()
            .map(|(t, _)| t.key.to_string())
            .filter(|k| poison_every.is_some_and(|n| trade_number(k) % n == n - 1))
            .collect();
        let db = ModelDb::with_faults(script, poison.clone());
        let claims = run(&db, &readers, &parts, &schedule, Config { capacity, hold, cache, inserts });
        let db = db.db();
        let stored = stored(&db);
        for (key, outcome) in claims.lock().unwrap().iter() {
            match outcome {
                Outcome::Written | Outcome::AlreadyApplied | Outcome::Duplicate => {
                    let customer = key.trim_start_matches("t:").split('-').next().unwrap();
                    let at = stored.get(key);
                    prop_assert!(at.is_some(), "{key} settled as {outcome:?} but not stored");
                    prop_assert!(at.unwrap().starts_with(&format!("{customer}_")), "{key} misfiled");
                }
                Outcome::DeadLetter(_) if poison.contains(key) => {}
                other => prop_assert!(false, "{key}: {other:?}"),
            }
        }
        let sent: HashSet<&str> = parts
            .iter()
            .flatten()
            .map(|(t, _)| t.key.as_str())
            .filter(|k| !poison.contains(*k))
            .collect();
        let kept: HashSet<&str> = stored.keys().map(String::as_str).collect();
        prop_assert_eq!(kept, sent);
        check_chains(&db, capacity);
    }
}

/// The cache across batches of a lone writer: a customer's head goes back
/// into it after a write that held and after a plan with nothing to write
/// (a redelivered batch), so each head is read once, at the first batch.
#[test]
fn a_lone_writer_reads_each_head_once() {
    let db = ModelDb::default();
    let mut writer = BucketWriter::new(db.clone(), 3, 100, Metrics::new());
    let batch = |from: u32| -> Vec<Sent> {
        let mut events = Vec::new();
        for i in from..from + 5 {
            for customer in [1, 2] {
                let offset = i64::from(i) * 2 + customer;
                let source = Source {
                    topic: "t".into(),
                    partition: 0,
                    offset,
                };
                events.push((trade(customer, i, i64::from(i)), source));
            }
        }
        events
    };
    let mut write = |events: Vec<Sent>| {
        let mut outcomes = vec![Outcome::Pending; events.len()];
        let stats = futures::executor::block_on(writer.write(&events, &mut outcomes, None))
            .expect("the model never fails a request");
        (stats.heads_loaded, outcomes)
    };
    let (loaded, outcomes) = write(batch(0));
    assert_eq!(loaded, 2);
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Written),
        "{outcomes:?}"
    );
    let (loaded, outcomes) = write(batch(0));
    assert_eq!(loaded, 0, "a redelivered batch reads no head");
    assert!(
        outcomes.iter().all(|o| *o == Outcome::AlreadyApplied),
        "{outcomes:?}"
    );
    let (loaded, outcomes) = write(batch(5));
    assert_eq!(
        loaded, 0,
        "the heads stayed cached through a batch without writes"
    );
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Written),
        "{outcomes:?}"
    );
    assert_eq!(stored(&db.db()).len(), 20);
    check_chains(&db.db(), 3);
}

fn at(partition: i32, offset: i64) -> Source {
    Source {
        topic: "t".into(),
        partition,
        offset,
    }
}

/// One call of `writer`, which the model never fails.
fn write_once(
    writer: &mut BucketWriter<ModelDb>,
    events: &[Sent],
    hold: Option<usize>,
) -> Vec<Outcome> {
    let mut outcomes = vec![Outcome::Pending; events.len()];
    futures::executor::block_on(writer.write(events, &mut outcomes, hold))
        .expect("the model never fails a request");
    outcomes
}

/// Issue #46, item 2: a write of more customers than the writer caches
/// (a flush of every held trade: up to `batch.hold_trades +
/// batch.max_events` events) evicts heads it loaded itself before it
/// plans them. Taken for "no bucket", each such customer got a new first
/// bucket (`prev: "<c>_"`), a second chain wherever the first bucket was
/// gone (retention, deleted by hand) or had no `prev`.
#[test]
fn a_head_evicted_within_a_write_is_read_again_not_taken_for_none() {
    let db = ModelDb::default();
    let event = |c: i64, i: u32| {
        (
            trade(c, i, 1_000 + i64::from(i)),
            at(0, i64::from(i) * 10 + c),
        )
    };
    let first: Vec<Sent> = (0..3)
        .flat_map(|i| (1..=5).map(move |c| event(c, i)))
        .collect();
    let mut roomy = BucketWriter::new(db.clone(), 2, 100, Metrics::new());
    write_once(&mut roomy, &first, None);
    // Each customer's first bucket (of two) is gone.
    db.db()
        .docs
        .retain(|_, d| !d.get_str("prev").unwrap().ends_with('_'));
    assert_eq!(db.db().docs.len(), 5);
    let mut small = BucketWriter::new(db.clone(), 2, 2, Metrics::new());
    let next: Vec<Sent> = (1..=5).map(|c| event(c, 3)).collect();
    let outcomes = write_once(&mut small, &next, None);
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Written),
        "{outcomes:?}"
    );
    let db = db.db();
    assert_eq!(db.docs.len(), 5, "a second chain: {:?}", db.docs.keys());
    for (id, d) in &db.docs {
        assert_eq!(number(d.get("count")), 2, "{id} filled");
    }
}

/// Issue #46, item 5: a second copy of a trade in one batch was settled
/// as a duplicate because its first copy was accepted, though the first
/// was then held: the copy's offset could be committed on the account of
/// a trade not stored. It now shares its first's fate.
#[test]
fn a_copy_of_a_held_trade_is_held_not_settled() {
    let db = ModelDb::default();
    let mut writer = BucketWriter::new(db.clone(), 3, 100, Metrics::new());
    let events = vec![
        (trade(1, 0, 1_000), at(0, 0)),
        (trade(1, 0, 1_000), at(1, 0)),
    ];
    let outcomes = write_once(&mut writer, &events, Some(0));
    assert!(matches!(outcomes[0], Outcome::Held(_)));
    assert_eq!(
        outcomes[1], outcomes[0],
        "held with its first, in its bucket"
    );
    assert!(db.db().docs.is_empty());
    // Written once the hold ends: the copy is a duplicate of a stored trade.
    let outcomes = write_once(&mut writer, &events, None);
    assert_eq!(outcomes, vec![Outcome::Written, Outcome::Duplicate]);
}

/// A replay stored by a version before issue #46 holds `r:<position>`; a
/// replay of the same record now carries `o:<position>` and that legacy
/// key, which the writer looks up: a duplicate, not a second copy.
#[test]
fn a_replay_stored_under_its_legacy_key_is_not_stored_again() {
    let db = ModelDb::default();
    let mut writer = BucketWriter::new(db.clone(), 3, 100, Metrics::new());
    let legacy = |key: &str| {
        let mut t = trade(1, 0, 1_000);
        t.key = key.into();
        t.doc = rawdoc! {"key": key, "date": DateTime::from_millis(1_000_000)};
        t
    };
    let old = vec![(legacy("r:t/0/5"), at(1, 0))];
    assert_eq!(write_once(&mut writer, &old, None), vec![Outcome::Written]);
    let mut replay = legacy("o:t/0/5");
    replay.legacy_key = Some("r:t/0/5".into());
    // A fresh writer: the cached head would not vouch for the key anyway.
    let mut writer = BucketWriter::new(db.clone(), 3, 100, Metrics::new());
    let outcomes = write_once(&mut writer, &[(replay, at(1, 1))], None);
    assert_eq!(outcomes, vec![Outcome::Duplicate]);
    assert_eq!(stored(&db.db()).len(), 1);
}
