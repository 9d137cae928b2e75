//! The oracle: MongoDB and the dead-letter topic compared with an
//! independent recount of what was produced, trade by trade, and the
//! report every scenario writes. `Scenario::finish` runs these steps in
//! order: settle, check the trades, audit, check the dead letters, report,
//! assert.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use mongodb::bson::{Bson, Document};
use rdkafka::message::{Message, OwnedMessage};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use testkit::{audit_json, header, headers_of, poll_until, Produced, TestEnv, WorkerProcess};
use tradebucket::kafka::headers::Header;

use crate::chains;
use crate::harness::*;

/// Per expected trade (its product key, or in the storm its `ref`): its
/// customer, the product key its stored entry must have (checked only when
/// trades are counted by `ref`), and its source (partition, offset), or no
/// source when its copies went to several partitions (an unkeyed upstream
/// that sent it again) or were replayed: any copy may be the one stored,
/// so its place in a partition's order is not defined.
type Expected = HashMap<String, Wanted>;

#[derive(Debug, Clone)]
struct Wanted {
    customer: String,
    key: Option<String>,
    source: Option<(i32, i64)>,
}

/// The product key a good record's trade is stored under, from what the
/// test sent (README.md, "Input"): `t:<tradeId>`, or without one the
/// position it was produced at, `o:<topic>/<partition>/<offset>` (a replay
/// of it keeps that: docs/design.md, "Replayed dead letters").
fn product_key(r: &Rec, topic: &str, (p, o): (i32, i64)) -> Option<String> {
    let payload = r.msg.payload.as_deref()?;
    let v: Value = serde_json::from_slice(payload).ok()?;
    Some(match v.get("tradeId").and_then(Value::as_str) {
        Some(id) => format!("t:{id}"),
        None => format!("o:{topic}/{p}/{o}"),
    })
}

/// The trade identity and source position of every record expected in
/// MongoDB (first occurrence of each good trade). `replayed`: positions of
/// records something put back on the topic (their replays are copies on
/// other partitions). `topic`: with it, the product key of each is
/// expected too (trades counted by `ref`).
fn expected(
    recs: &[Rec],
    placed: &[(i32, i64)],
    replayed: &HashSet<(i32, i64)>,
    topic: Option<&str>,
) -> Expected {
    let mut out: Expected = HashMap::new();
    let mut partitions: HashMap<&str, HashSet<i32>> = HashMap::new();
    for (r, &(p, o)) in recs.iter().zip(placed) {
        let key = match &r.class {
            Class::Good { key, customer } => {
                out.entry(key.clone()).or_insert_with(|| Wanted {
                    customer: customer.clone(),
                    key: topic.and_then(|t| product_key(r, t, (p, o))),
                    source: Some((p, o)),
                });
                key
            }
            Class::Duplicate { key } => key,
            Class::Bad { .. } => continue,
        };
        let seen = partitions.entry(key).or_default();
        seen.insert(p);
        if replayed.contains(&(p, o)) {
            seen.insert(-1);
        }
    }
    for (key, _) in partitions.into_iter().filter(|(_, s)| s.len() > 1) {
        if let Some(e) = out.get_mut(key) {
            e.source = None;
        }
    }
    out
}

/// What one history entry is to the oracle: its identity (the product key,
/// or `ref:<n>` when trades are counted by `ref`) and its product key.
#[derive(Debug, Clone)]
struct Entry {
    id: String,
    key: String,
}

/// Per customer (the `_id` prefix), its entries in page order.
fn stored(buckets: &[Document], by_ref: bool) -> BTreeMap<String, Vec<Entry>> {
    let mut out: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
    for b in buckets {
        let id = b.get_str("_id").unwrap_or_default();
        let customer = id.split('_').next().unwrap_or_default().to_string();
        for h in b.get_array("history").into_iter().flatten() {
            let Some(h) = h.as_document() else { continue };
            let key = h.get_str("key").unwrap_or("<no key>").to_string();
            let id = if by_ref {
                match h.get("ref") {
                    Some(Bson::Int32(n)) => format!("ref:{n}"),
                    Some(Bson::Int64(n)) => format!("ref:{n}"),
                    other => format!("no ref ({key}, ref {other:?})"),
                }
            } else {
                key.clone()
            };
            out.entry(customer.clone())
                .or_default()
                .push(Entry { id, key });
        }
    }
    out
}

/// Where the records put back on the source topic (`dlq replay`,
/// `reconcile --replay-missing`) say they were first read
/// (`tradebucket.replay.of`).
fn replayed_positions(env: &TestEnv) -> HashSet<(i32, i64)> {
    env.records_to_end()
        .iter()
        .filter_map(|m| header(m, "tradebucket.replay.of"))
        .filter_map(|origin| origin_position(&origin))
        .collect()
}

/// `<topic>/<partition>/<offset>` read back.
fn origin_position(origin: &str) -> Option<(i32, i64)> {
    let mut parts = origin.rsplitn(3, '/');
    let offset = parts.next()?.parse().ok()?;
    let partition = parts.next()?.parse().ok()?;
    Some((partition, offset))
}

/// Commit after write: after a crash, every event below the group's
/// committed offsets is stored. Returns the keys that are not.
pub async fn committed_but_not_stored(
    stack: &Stack,
    recs: &[Rec],
    placed: &[(i32, i64)],
) -> Vec<String> {
    // Asked until the (possibly just restarted) broker answers.
    let committed = loop {
        if let Some(c) = stack.committed() {
            break c;
        }
    };
    let stored: HashSet<String> = stack
        .env
        .histories()
        .await
        .into_values()
        .flatten()
        .collect();
    let mut missing = Vec::new();
    for (r, &(p, o)) in recs.iter().zip(placed) {
        let key = match &r.class {
            Class::Good { key, .. } | Class::Duplicate { key } => key,
            Class::Bad { .. } => continue,
        };
        if o < committed.get(&p).copied().unwrap_or(0) && !stored.contains(key) {
            missing.push(format!("{key} at {p}/{o}"));
        }
    }
    missing
}

/// `tradebucket audit --json` (the binary): exit code and its summary
/// numbers, in the shape the reports have always had (`violations` a count;
/// `tests/chaos/render.py` reads it).
pub fn audit_binary(vars: &BTreeMap<String, String>) -> (Option<i32>, BTreeMap<String, u64>) {
    let (code, report) = audit_json(bin(), vars);
    for v in report.violations.iter().take(20) {
        eprintln!("audit violation: {v}");
    }
    let numbers = [
        ("customers", report.customers),
        ("buckets", report.buckets),
        ("trades", report.trades),
        ("violations", report.violations.len() as u64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    (code, numbers)
}

impl Scenario {
    /// `tradebucket reconcile --json`: its totals go in the report's notes;
    /// an exit other than 0 or any problem is a failure, except
    /// `dead_lettered_and_stored` at `refused` positions: a trade MongoDB
    /// refused, dead-lettered, and stored once the refusal was lifted by
    /// a redelivery, which is what reconcile says of it (docs/operations.md:
    /// "harmless for the data"); one stored by `dlq replay` is no problem
    /// once reconcile reads the replay.
    fn reconcile_binary(&mut self, refused: &HashSet<(i32, i64)>) {
        let out = std::process::Command::new(bin())
            .args(["reconcile", "--json", "--rate", "0"])
            .envs(&self.vars)
            .output()
            .expect("run tradebucket reconcile");
        let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let total = report.get("total").cloned().unwrap_or_default();
        self.notes.insert("reconcile".into(), total.clone());
        let problems = total.get("problems").and_then(Value::as_u64);
        let listed = report
            .get("problems")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let (accepted, other): (Vec<Value>, Vec<Value>) = listed.into_iter().partition(|p| {
            let at = p["partition"]
                .as_i64()
                .and_then(|p| i32::try_from(p).ok())
                .zip(p["offset"].as_i64());
            p["kind"] == "dead_lettered_and_stored" && at.is_some_and(|at| refused.contains(&at))
        });
        self.notes.insert(
            "reconcile_dead_lettered_and_stored_after_refusal".into(),
            json!(accepted.len()),
        );
        let clean = problems == Some(accepted.len() as u64);
        let exit_ok = out.status.code() == Some(if accepted.is_empty() { 0 } else { 1 });
        if !clean || !exit_ok {
            self.failures.push(format!(
                "reconcile exited {:?} with problems {problems:?} ({} after a refusal): {} {}",
                out.status.code(),
                accepted.len(),
                Value::Array(other),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
}

/// Where the group stood once the workers were stopped.
struct Settled {
    seconds_until_committed_to_end: f64,
    committed: Option<BTreeMap<i32, i64>>,
    committed_to_end: bool,
}

/// MongoDB against the recount.
#[derive(Default)]
struct Trades {
    expected: usize,
    customers: usize,
    stored: usize,
    lost: Vec<String>,
    duplicated: usize,
    unexpected: Vec<String>,
    order_violations: Vec<String>,
    /// Stored under another product key than the one its record gives it.
    wrong_keys: Vec<String>,
}

/// Every stored entry against `expect`: unknown or misplaced trades, their
/// product keys, partition order within each customer, lost and duplicated
/// trades.
fn check_trades(histories: &BTreeMap<String, Vec<Entry>>, expect: &Expected) -> Trades {
    let mut t = Trades {
        expected: expect.len(),
        customers: expect
            .values()
            .map(|w| &w.customer)
            .collect::<HashSet<_>>()
            .len(),
        ..Trades::default()
    };
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (customer, entries) in histories {
        let mut last: BTreeMap<i32, i64> = BTreeMap::new();
        for e in entries {
            t.stored += 1;
            *seen.entry(e.id.as_str()).or_default() += 1;
            let Some(want) = expect.get(&e.id) else {
                t.unexpected.push(format!("{customer}: {}", e.id));
                continue;
            };
            if &want.customer != customer {
                t.unexpected
                    .push(format!("{customer}: {} belongs to {}", e.id, want.customer));
                continue;
            }
            if want.key.as_ref().is_some_and(|k| k != &e.key) {
                t.wrong_keys.push(format!(
                    "{customer}: {} stored as {}, not {:?}",
                    e.id, e.key, want.key
                ));
            }
            // Within a customer, each source partition's events keep
            // their order.
            if let Some((p, o)) = want.source {
                if let Some(prev) = last.insert(p, o) {
                    if prev >= o {
                        t.order_violations
                            .push(format!("{customer}: partition {p} offset {o} after {prev}"));
                    }
                }
            }
        }
    }
    t.lost = expect
        .keys()
        .filter(|k| !seen.contains_key(k.as_str()))
        .cloned()
        .collect();
    t.duplicated = seen.values().map(|n| n - 1).sum();
    t
}

/// The dead-letter topic against the bad events produced.
#[derive(Default)]
struct DeadLetters {
    expected: usize,
    actual: usize,
    distinct: usize,
    missing: Vec<usize>,
    wrong: Vec<String>,
    /// Per dead-letter kind: (expected, actual).
    kinds: BTreeMap<String, (usize, usize)>,
    /// Per poison recipe: how many were produced.
    poisons: BTreeMap<&'static str, usize>,
    /// Dead letters in the shortened form: (expected, actual).
    shortened: (usize, usize),
    /// Good records refused by MongoDB (`rejected_by_database`) while the
    /// scenario had it refuse their ticker, each counted once.
    refused: usize,
    /// Where those dead letters say their records were read: their
    /// source, and for a replay, its first position.
    refused_positions: HashSet<(i32, i64)>,
}

/// The `ticker` a record's payload names, if it is JSON with one.
fn ticker_of(r: &Rec) -> Option<String> {
    let v: Value = serde_json::from_slice(r.msg.payload.as_deref()?).ok()?;
    v.get("ticker")?.as_str().map(str::to_string)
}

/// Exactly the bad events, each once, with the original key, payload and
/// headers (or their shortened form) and the error/source headers. A dead
/// letter of a replay (`tradebucket.replay.of`) is its first record's.
/// `refused`: MongoDB refused trades of this ticker for a while, so their
/// records' dead letters (`rejected_by_database`) are expected too.
fn check_dead_letters(
    env: &TestEnv,
    recs: &[Rec],
    placed: &[(i32, i64)],
    refused: Option<&str>,
) -> DeadLetters {
    let by_pos: HashMap<(i32, i64), usize> =
        placed.iter().enumerate().map(|(i, &po)| (po, i)).collect();
    let mut d = DeadLetters::default();
    let bad_expected = expected_bad(recs, &mut d);
    let dl = env.dead_letters_to_end();
    let mut seen = Seen::default();
    for m in &dl {
        let kind = header(m, "tradebucket.error.kind").unwrap_or_default();
        d.kinds.entry(kind.clone()).or_default().1 += 1;
        d.shortened.1 += usize::from(header(m, "tradebucket.shortened").is_some());
        let source = header(m, "tradebucket.source.partition")
            .and_then(|p| p.parse::<i32>().ok())
            .zip(header(m, "tradebucket.source.offset").and_then(|o| o.parse::<i64>().ok()));
        let origin = header(m, "tradebucket.replay.of").and_then(|o| origin_position(&o));
        let pos = origin.or(source);
        let Some(&i) = pos.and_then(|po| by_pos.get(&po)) else {
            d.wrong
                .push(format!("dead letter for an unknown position {pos:?}"));
            continue;
        };
        let letter = Letter {
            m,
            i,
            kind: &kind,
            positions: source.into_iter().chain(origin).collect(),
        };
        judge_letter(env, recs, refused, letter, &mut seen, &mut d);
    }
    d.expected = bad_expected.len();
    d.actual = dl.len();
    d.distinct = seen.found.len();
    d.missing = bad_expected.difference(&seen.found).copied().collect();
    d.refused = seen.refusals.len();
    d
}

/// The bad records the producer made, counted by kind and poison.
fn expected_bad(recs: &[Rec], d: &mut DeadLetters) -> HashSet<usize> {
    let mut bad_expected = HashSet::new();
    for (i, r) in recs.iter().enumerate() {
        if let Class::Bad {
            kind,
            poison,
            shortened,
        } = r.class
        {
            bad_expected.insert(i);
            d.kinds.entry(kind.to_string()).or_default().0 += 1;
            *d.poisons.entry(poison).or_default() += 1;
            d.shortened.0 += usize::from(shortened);
        }
    }
    bad_expected
}

/// The records a dead letter was seen for: bad ones, and good ones the
/// database refused (the storm's refused ticker).
#[derive(Default)]
struct Seen {
    found: HashSet<usize>,
    refusals: HashSet<usize>,
}

/// One dead letter: the message, the record it is for, its kind and the
/// positions it names (its source, and the original a replay names).
struct Letter<'m> {
    m: &'m OwnedMessage,
    i: usize,
    kind: &'m str,
    positions: Vec<(i32, i64)>,
}

/// Whether one dead letter is right for its record: a refusal of a good
/// trade with the refused ticker, or a bad record's first dead letter with
/// the kind and headers it must carry.
fn judge_letter(
    env: &TestEnv,
    recs: &[Rec],
    refused: Option<&str>,
    l: Letter<'_>,
    seen: &mut Seen,
    d: &mut DeadLetters,
) {
    let r = &recs[l.i];
    let i = l.i;
    let good = matches!(r.class, Class::Good { .. } | Class::Duplicate { .. });
    if good
        && l.kind == "rejected_by_database"
        && refused.is_some()
        && ticker_of(r).as_deref() == refused
    {
        d.refused_positions.extend(l.positions);
        if seen.refusals.insert(i) {
            let want = Want {
                kind: "rejected_by_database",
                shortened: false,
                topic: &env.topic,
            };
            let problems = dead_letter_problems(l.m, r, &want);
            if !problems.is_empty() {
                d.wrong
                    .push(format!("record {i} (refused): {}", problems.join(", ")));
            }
        }
        return;
    }
    if !seen.found.insert(i) {
        return;
    }
    let Class::Bad {
        kind: want,
        poison,
        shortened,
    } = r.class
    else {
        d.wrong.push(format!(
            "record {i} ({:?}) dead-lettered as {}",
            r.class, l.kind
        ));
        return;
    };
    let want = Want {
        kind: want,
        shortened,
        topic: &env.topic,
    };
    let problems = dead_letter_problems(l.m, r, &want);
    if !problems.is_empty() {
        d.wrong
            .push(format!("record {i} ({poison}): {}", problems.join(", ")));
    }
}

/// What the dead letter of one bad record must say.
struct Want<'a> {
    kind: &'static str,
    shortened: bool,
    topic: &'a str,
}

/// The headers tradebucket writes on every dead letter.
const OURS: [&str; 5] = [
    "tradebucket.error.kind",
    "tradebucket.error.message",
    "tradebucket.source.topic",
    "tradebucket.source.partition",
    "tradebucket.source.offset",
];

/// The headers it adds on a shortened dead letter only.
const OURS_SHORTENED: [&str; 3] = [
    "tradebucket.shortened",
    "tradebucket.payload.length",
    "tradebucket.payload.sha256",
];

/// What a shortened dead letter keeps of the payload and of the key.
const KEPT_BYTES: usize = 1024;

/// What is wrong with dead letter `m` of record `r`, if anything.
fn dead_letter_problems(m: &OwnedMessage, r: &Rec, want: &Want<'_>) -> Vec<String> {
    let headers = headers_of(m);
    let mut problems = our_header_problems(m, &headers, want);
    problems.extend(if want.shortened {
        shortened_content_problems(m, &headers, &r.msg)
    } else {
        content_problems(m, &headers, &r.msg)
    });
    problems
}

/// Ours: each exactly once (an inbound `tradebucket.*` header, forged or
/// not, must not show as a second one), the kind the README promises, a
/// message, the source topic. (Partition and offset found the record.)
fn our_header_problems(m: &OwnedMessage, headers: &[Header], want: &Want<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    let count = |name: &str| headers.iter().filter(|(k, _)| k == name.as_bytes()).count();
    for name in OURS {
        if count(name) != 1 {
            problems.push(format!("{name} {} times", count(name)));
        }
    }
    for name in OURS_SHORTENED {
        if count(name) != usize::from(want.shortened) {
            problems.push(format!("{name} {} times", count(name)));
        }
    }
    let kind = header(m, "tradebucket.error.kind").unwrap_or_default();
    if kind != want.kind {
        problems.push(format!("kind {kind}, expected {}", want.kind));
    }
    if header(m, "tradebucket.error.message").is_none_or(|s| s.is_empty()) {
        problems.push("no error message".into());
    }
    if header(m, "tradebucket.source.topic").as_deref() != Some(want.topic) {
        problems.push("wrong source topic".into());
    }
    problems
}

/// Whether a header name is in tradebucket's namespace.
fn ours(name: &[u8]) -> bool {
    name.starts_with(b"tradebucket.")
}

/// The original headers a full dead letter of `p` carries, in order, as
/// bytes: a name cut at its first NUL (librdkafka hands names out as C
/// strings, src/kafka/headers.rs), and none in tradebucket's namespace
/// (a producer cannot forge ours).
fn expected_original_headers(p: &Produced) -> Vec<Header> {
    let text = p
        .headers
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), Some(v.as_bytes().to_vec())));
    text.chain(p.raw_headers.iter().cloned())
        .map(|(mut name, value)| {
            if let Some(nul) = name.iter().position(|&b| b == 0) {
                name.truncate(nul);
            }
            (name, value)
        })
        .filter(|(name, _)| !ours(name))
        .collect()
}

/// Headers as `name=value` with bytes escaped, `name` alone for a null value.
fn show(headers: &[Header]) -> String {
    let one = |(k, v): &Header| match v {
        Some(v) => format!("{}={}", k.escape_ascii(), v.escape_ascii()),
        None => k.escape_ascii().to_string(),
    };
    headers.iter().map(one).collect::<Vec<_>>().join(", ")
}

/// The full form: the original key, payload and headers, unchanged.
fn content_problems(m: &OwnedMessage, headers: &[Header], p: &Produced) -> Vec<String> {
    let mut problems = Vec::new();
    if m.key() != p.key.as_ref().map(|k| k.as_bytes()) {
        problems.push("original key lost".into());
    }
    // Null and empty alike, as they always were here.
    if m.payload().unwrap_or_default() != p.payload.as_deref().unwrap_or_default() {
        problems.push("original payload changed".into());
    }
    let originals: Vec<Header> = headers.iter().filter(|(k, _)| !ours(k)).cloned().collect();
    let expected = expected_original_headers(p);
    if originals != expected {
        problems.push(format!(
            "original headers [{}], expected [{}]",
            show(&originals),
            show(&expected)
        ));
    }
    problems
}

/// The shortened form: the first bytes of key and payload, no original
/// headers, and the original payload's length and SHA-256.
fn shortened_content_problems(m: &OwnedMessage, headers: &[Header], p: &Produced) -> Vec<String> {
    let mut problems = Vec::new();
    let payload = p.payload.as_deref().unwrap_or_default();
    let cut = |b: &[u8]| b[..b.len().min(KEPT_BYTES)].to_vec();
    if m.key().map(cut) != p.key.as_ref().map(|k| cut(k.as_bytes())) {
        problems.push("key not its first bytes".into());
    }
    if m.payload().map(cut) != Some(cut(payload))
        || m.payload().map(<[u8]>::len) != Some(KEPT_BYTES.min(payload.len()))
    {
        problems.push("payload not its first bytes".into());
    }
    if headers.iter().any(|(k, _)| !ours(k)) {
        problems.push("original headers kept".into());
    }
    if header(m, "tradebucket.payload.length") != Some(payload.len().to_string()) {
        problems.push("wrong payload length".into());
    }
    let digest: String = Sha256::digest(payload)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if header(m, "tradebucket.payload.sha256") != Some(digest) {
        problems.push("wrong payload digest".into());
    }
    problems
}

/// Rounded to a tenth, as the reports show seconds.
fn tenths(seconds: f64) -> f64 {
    (seconds * 10.0).round() / 10.0
}

impl Scenario {
    /// Waits for the group to commit to the end of the topic, stops the
    /// workers with SIGTERM, and checks everything against the recount.
    /// Writes the report, then asserts on it.
    pub async fn finish(
        mut self,
        workers: Vec<WorkerProcess>,
        recs: &[Rec],
        placed: &[(i32, i64)],
    ) {
        assert_eq!(recs.len(), placed.len(), "every record was produced");
        let settled = self.settle(workers).await;
        self.step("workers stopped");
        self.check_logs();
        let buckets = self.stack.env.buckets().await;
        let (replayed, topic) = if self.by_ref {
            let topic = Some(self.stack.env.topic.as_str());
            (replayed_positions(&self.stack.env), topic)
        } else {
            (HashSet::new(), None)
        };
        let expect = expected(recs, placed, &replayed, topic);
        let trades = check_trades(&stored(&buckets, self.by_ref), &expect);
        self.note("records_replayed", json!(replayed.len()));
        if let Some(capacities) = self.chains.clone() {
            self.check_chains(&buckets, &capacities);
        }
        self.step("trades checked");
        let audit = audit_binary(&self.vars);
        self.step("audit");
        let dead = check_dead_letters(&self.stack.env, recs, placed, self.refused_ticker);
        self.step("dead letters checked");
        if self.reconcile {
            self.reconcile_binary(&dead.refused_positions);
            self.step("reconcile");
        }
        let report = self.report(recs, &settled, &trades, &audit, &dead);
        self.write_report(&report);
        print_samples(&trades, &dead);
        self.assert_verdict(&settled, &trades, &audit, &dead);
        // Leave nothing behind (the private servers go with the stack),
        // unless asked to keep the workers' logs of a passing run, to see
        // where a slow one spent its time.
        if std::env::var_os("TRADEBUCKET_CHAOS_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(report_dir().join("logs").join(self.name));
        }
    }

    /// Waits (bounded) for the commits to reach the end, then stops every
    /// worker with SIGTERM.
    async fn settle(&mut self, workers: Vec<WorkerProcess>) -> Settled {
        let end = self.stack.end_offsets();
        let timeout = Duration::from_secs(pick(240, 1200));
        let stack = &self.stack;
        let reached = poll_until(timeout, POLL, || async {
            stack.committed().as_ref() == Some(&end)
        })
        .await;
        let seconds_until_committed_to_end = self.started.elapsed().as_secs_f64();
        self.step(if reached {
            "committed to the end"
        } else {
            "not committed to the end in time"
        });
        for mut w in workers {
            // Every worker handed over was meant to be running: one that
            // ended by itself (a panic, a fatal error) is a failure even if
            // another took its partitions over.
            // (Reaped by now: it gets no signal, its pid may be reused.)
            match w.exited() {
                Some(status) => self
                    .failures
                    .push(format!("worker {} exited by itself: {status}", w.id())),
                None => self.sigterm(w),
            }
        }
        let committed = self.stack.committed();
        let committed_to_end = reached && committed.as_ref() == Some(&self.stack.end_offsets());
        Settled {
            seconds_until_committed_to_end,
            committed,
            committed_to_end,
        }
    }

    /// Says on stderr that the verdict is through `what`, and when.
    fn step(&self, what: &str) {
        eprintln!(
            "[{} +{:.1}s] verdict: {what}",
            self.name,
            self.started.elapsed().as_secs_f64()
        );
    }

    /// The test's own check of every chain (`chains.rs`): its figures go
    /// in the notes, each violation is a failure.
    fn check_chains(&mut self, buckets: &[Document], capacities: &BTreeSet<u32>) {
        let c = chains::check(buckets, capacities);
        self.note(
            "chains",
            json!({
                "customers": c.customers,
                "buckets": c.buckets,
                "closed_by_count": c.closed_by_count,
                "closed_by_size": c.closed_by_size,
                "buckets_per_cap": c.caps,
                "violations": c.violations.len(),
            }),
        );
        for v in c.violations.iter().take(20) {
            eprintln!("chain violation: {v}");
            self.failures.push(format!("chain: {v}"));
        }
    }

    /// A panic in a worker's log is a failure even when the process went
    /// on (a task of its own can panic alone).
    fn check_logs(&mut self) {
        let dir = report_dir().join("logs").join(self.name);
        let logs = std::fs::read_dir(&dir).into_iter().flatten().flatten();
        for log in logs {
            let text = String::from_utf8_lossy(&std::fs::read(log.path()).unwrap_or_default())
                .into_owned();
            if let Some(line) = text.lines().find(|l| l.contains("panicked")) {
                let name = log.file_name();
                self.failures
                    .push(format!("{}: {line}", name.to_string_lossy()));
            }
        }
    }

    /// The scenario's JSON report (`tests/chaos/render.py` prints the
    /// tables of docs/reliability.md from it).
    fn report(
        &self,
        recs: &[Rec],
        settled: &Settled,
        trades: &Trades,
        audit: &(Option<i32>, BTreeMap<String, u64>),
        dead: &DeadLetters,
    ) -> Value {
        let duplicates_produced = recs
            .iter()
            .filter(|r| matches!(r.class, Class::Duplicate { .. }))
            .count();
        json!({
            "scenario": self.name,
            "title": self.title,
            "size": if full() { "full" } else { "reduced" },
            "seconds_total": tenths(self.started.elapsed().as_secs_f64()),
            "seconds_until_committed_to_end": tenths(settled.seconds_until_committed_to_end),
            "events_produced": recs.len(),
            "partitions": self.stack.env.partitions,
            "customers": trades.customers,
            "capacity": CAPACITY,
            "trades_expected": trades.expected,
            "upstream_duplicates_produced": duplicates_produced,
            "bad_events_produced": dead.expected,
            "poison_kinds": dead.poisons,
            "faults_injected": self.faults.len(),
            "faults": self.faults,
            "trades_stored": trades.stored,
            "lost": trades.lost.len(),
            "duplicated": trades.duplicated,
            "unexpected": trades.unexpected.len(),
            "wrong_keys": trades.wrong_keys.len(),
            "order_violations": trades.order_violations.len(),
            "dead_letters_expected": dead.expected,
            "dead_letters_actual": dead.actual,
            "dead_letters_distinct": dead.distinct,
            "trades_refused_dead_lettered": dead.refused,
            "dead_letters_missing": dead.missing.len(),
            "dead_letters_wrong": dead.wrong.len(),
            "dead_letter_kinds_expected_actual": dead.kinds,
            "dead_letters_shortened_expected_actual": dead.shortened,
            "audit_exit_code": audit.0,
            "audit": audit.1,
            "committed_to_end": settled.committed_to_end,
            "committed": settled.committed,
            "sigterm_exit_codes": self.exit_codes,
            "failures": self.failures,
            "notes": self.notes,
        })
    }

    /// `<report dir>/<scenario>.json`, also printed.
    fn write_report(&self, report: &Value) {
        let text = serde_json::to_string_pretty(report).unwrap();
        let dir = report_dir();
        std::fs::create_dir_all(&dir).expect("report dir");
        let path = dir.join(format!("{}.json", self.name));
        std::fs::write(&path, &text).expect("write report");
        eprintln!("chaos report {}:\n{text}", path.display());
    }

    fn assert_verdict(
        &self,
        settled: &Settled,
        trades: &Trades,
        audit: &(Option<i32>, BTreeMap<String, u64>),
        dead: &DeadLetters,
    ) {
        assert!(
            self.failures.is_empty(),
            "failed checks: {:?}",
            self.failures
        );
        assert_eq!(trades.lost.len(), 0, "trades lost");
        assert_eq!(trades.duplicated, 0, "trades duplicated");
        assert!(
            trades.unexpected.is_empty(),
            "trades stored that should not be"
        );
        assert!(trades.order_violations.is_empty(), "partition order broken");
        assert!(
            trades.wrong_keys.is_empty(),
            "trades stored under a wrong key"
        );
        assert_eq!(trades.stored, trades.expected);
        let (audit_code, numbers) = audit;
        assert_eq!(*audit_code, Some(0), "tradebucket audit exits 0");
        assert_eq!(numbers.get("violations").copied(), Some(0), "audit clean");
        assert_eq!(numbers.get("trades").copied(), Some(trades.expected as u64));
        if self.dead_letters_at_least_once {
            assert_eq!(
                dead.distinct, dead.expected,
                "dead letters: every bad event (repeats allowed)"
            );
        } else {
            assert_eq!(
                dead.actual, dead.expected,
                "dead letters: exactly the bad events"
            );
        }
        assert!(
            dead.missing.is_empty() && dead.wrong.is_empty(),
            "dead letters wrong"
        );
        assert_eq!(
            dead.shortened.0, dead.shortened.1,
            "dead letters in the shortened form"
        );
        assert!(
            settled.committed_to_end,
            "committed {:?} short of the end",
            settled.committed
        );
        assert!(
            self.exit_codes.iter().all(|c| *c == Some(0)),
            "every SIGTERM exits 0: {:?}",
            self.exit_codes
        );
    }
}

/// The first few items of each kind of failure, for the log.
fn print_samples(trades: &Trades, dead: &DeadLetters) {
    let missing: Vec<String> = dead.missing.iter().map(|i| format!("record {i}")).collect();
    for (what, list) in [
        ("lost", &trades.lost),
        ("unexpected", &trades.unexpected),
        ("out of order", &trades.order_violations),
        ("wrong key", &trades.wrong_keys),
        ("dead letters wrong", &dead.wrong),
        ("dead letters missing", &missing),
    ] {
        for item in list.iter().take(10) {
            eprintln!("{what}: {item}");
        }
    }
}
