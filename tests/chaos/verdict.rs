//! The oracle: MongoDB and the dead-letter topic compared with an
//! independent recount of what was produced, trade by trade, and the
//! report every scenario writes. `Scenario::finish` runs these steps in
//! order: settle, check the trades, audit, check the dead letters, report,
//! assert.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use rdkafka::message::{Message, OwnedMessage};
use serde_json::{json, Value};

use testkit::{audit_json, header, poll_until, TestEnv, WorkerProcess};

use crate::harness::*;

/// Per expected trade key: its customer and source (partition, offset).
type Expected = HashMap<String, (String, i32, i64)>;

/// The trade identity and source position of every record expected in
/// MongoDB (first occurrence of each good trade).
fn expected(recs: &[Rec], placed: &[(i32, i64)]) -> Expected {
    let mut out = HashMap::new();
    for (r, &(p, o)) in recs.iter().zip(placed) {
        if let Class::Good { key, customer } = &r.class {
            out.entry(key.clone()).or_insert((customer.clone(), p, o));
        }
    }
    out
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
}

/// Every stored key against `expect`: unknown or misplaced keys, partition
/// order within each customer, lost and duplicated trades.
fn check_trades(histories: &BTreeMap<String, Vec<String>>, expect: &Expected) -> Trades {
    let mut t = Trades {
        expected: expect.len(),
        customers: expect
            .values()
            .map(|(c, _, _)| c)
            .collect::<HashSet<_>>()
            .len(),
        ..Trades::default()
    };
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (customer, keys) in histories {
        let mut last: BTreeMap<i32, i64> = BTreeMap::new();
        for k in keys {
            t.stored += 1;
            *seen.entry(k.as_str()).or_default() += 1;
            match expect.get(k) {
                None => t.unexpected.push(format!("{customer}: {k}")),
                Some((c, _, _)) if c != customer => {
                    t.unexpected.push(format!("{customer}: {k} belongs to {c}"))
                }
                Some(&(_, p, o)) => {
                    // Within a customer, each source partition's events
                    // keep their order.
                    if let Some(prev) = last.insert(p, o) {
                        if prev >= o {
                            t.order_violations
                                .push(format!("{customer}: partition {p} offset {o} after {prev}"));
                        }
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
}

/// Exactly the bad events, each once, with the original key, payload and
/// headers and the error/source headers.
fn check_dead_letters(env: &TestEnv, recs: &[Rec], placed: &[(i32, i64)]) -> DeadLetters {
    let by_pos: HashMap<(i32, i64), usize> =
        placed.iter().enumerate().map(|(i, &po)| (po, i)).collect();
    let mut d = DeadLetters::default();
    let mut bad_expected: HashSet<usize> = HashSet::new();
    for (i, r) in recs.iter().enumerate() {
        if let Class::Bad { kind, poison } = r.class {
            bad_expected.insert(i);
            d.kinds.entry(kind.to_string()).or_default().0 += 1;
            *d.poisons.entry(poison).or_default() += 1;
        }
    }
    let dl = env.dead_letters_to_end();
    let mut found: HashSet<usize> = HashSet::new();
    for m in &dl {
        let kind = header(m, "tradebucket.error.kind").unwrap_or_default();
        d.kinds.entry(kind.clone()).or_default().1 += 1;
        let pos = header(m, "tradebucket.source.partition")
            .and_then(|p| p.parse::<i32>().ok())
            .zip(header(m, "tradebucket.source.offset").and_then(|o| o.parse::<i64>().ok()));
        let Some(&i) = pos.and_then(|po| by_pos.get(&po)) else {
            d.wrong
                .push(format!("dead letter for an unknown position {pos:?}"));
            continue;
        };
        if !found.insert(i) {
            continue;
        }
        let r = &recs[i];
        let Class::Bad { kind: want, poison } = r.class else {
            d.wrong.push(format!(
                "record {i} ({:?}) dead-lettered as {kind}",
                r.class
            ));
            continue;
        };
        let problems = dead_letter_problems(m, r, &kind, want, &env.topic);
        if !problems.is_empty() {
            d.wrong
                .push(format!("record {i} ({poison}): {}", problems.join(", ")));
        }
    }
    d.expected = bad_expected.len();
    d.actual = dl.len();
    d.distinct = found.len();
    d.missing = bad_expected.difference(&found).copied().collect();
    d
}

/// What is wrong with dead letter `m` of record `r` (of kind `kind`,
/// expected `want`), if anything.
fn dead_letter_problems(
    m: &OwnedMessage,
    r: &Rec,
    kind: &str,
    want: &str,
    topic: &str,
) -> Vec<String> {
    let mut problems = Vec::new();
    if kind != want {
        problems.push(format!("kind {kind}, expected {want}"));
    }
    if header(m, "tradebucket.error.message").is_none_or(|s| s.is_empty()) {
        problems.push("no error message".into());
    }
    if header(m, "tradebucket.source.topic").as_deref() != Some(topic) {
        problems.push("wrong source topic".into());
    }
    if m.key() != r.msg.key.as_ref().map(|k| k.as_bytes()) {
        problems.push("original key lost".into());
    }
    if m.payload().unwrap_or_default() != r.msg.payload.as_deref().unwrap_or_default() {
        problems.push("original payload changed".into());
    }
    for (k, v) in &r.msg.headers {
        if header(m, k).as_deref() != Some(v.as_str()) {
            problems.push(format!("original header {k} lost"));
        }
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
        let trades = check_trades(&self.stack.env.histories().await, &expected(recs, placed));
        let audit = audit_binary(&self.vars);
        let dead = check_dead_letters(&self.stack.env, recs, placed);
        let report = self.report(recs, &settled, &trades, &audit, &dead);
        self.write_report(&report);
        print_samples(&trades, &dead);
        self.assert_verdict(&settled, &trades, &audit, &dead);
        // Leave nothing behind: the private servers go with the stack.
        let _ = std::fs::remove_dir_all(report_dir().join("logs").join(self.name));
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
        for w in workers {
            self.sigterm(w);
        }
        let committed = self.stack.committed();
        let committed_to_end = reached && committed.as_ref() == Some(&self.stack.end_offsets());
        Settled {
            seconds_until_committed_to_end,
            committed,
            committed_to_end,
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
            "order_violations": trades.order_violations.len(),
            "dead_letters_expected": dead.expected,
            "dead_letters_actual": dead.actual,
            "dead_letters_distinct": dead.distinct,
            "dead_letters_missing": dead.missing.len(),
            "dead_letters_wrong": dead.wrong.len(),
            "dead_letter_kinds_expected_actual": dead.kinds,
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
        assert_eq!(trades.stored, trades.expected);
        let (audit_code, numbers) = audit;
        assert_eq!(*audit_code, Some(0), "tradebucket audit exits 0");
        assert_eq!(numbers.get("violations").copied(), Some(0), "audit clean");
        assert_eq!(numbers.get("trades").copied(), Some(trades.expected as u64));
        assert_eq!(
            dead.actual, dead.expected,
            "dead letters: exactly the bad events"
        );
        assert!(
            dead.missing.is_empty() && dead.wrong.is_empty(),
            "dead letters wrong"
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
        ("dead letters wrong", &dead.wrong),
        ("dead letters missing", &missing),
    ] {
        for item in list.iter().take(10) {
            eprintln!("{what}: {item}");
        }
    }
}
