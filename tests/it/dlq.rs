//! `tradebucket dlq` against a dead-letter topic the real worker wrote:
//! `list` counts and filters it, `show` decodes one, `replay` puts
//! corrected events back so that they are stored once, however often the
//! same dead letters are replayed, with or without `tradeId`.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use mongodb::bson::doc;
use testkit::*;
use tradebucket::dlq::{LetterView, Listing};

use crate::bin;

/// Runs `tradebucket dlq ARGS` with the test's settings; (exit code, stdout, stderr).
fn dlq(env: &TestEnv, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin())
        .arg("dlq")
        .args(args)
        .envs(env.vars(&[]))
        .output()
        .expect("run tradebucket dlq");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn listing(env: &TestEnv, args: &[&str]) -> Listing {
    let mut all = vec!["list", "--json", "--limit", "0"];
    all.extend_from_slice(args);
    let (code, out, err) = dlq(env, &all);
    assert_eq!(code, Some(0), "dlq list {args:?}: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn payload(json: serde_json::Value) -> Produced {
    Produced {
        key: Some("k1".into()),
        payload: Some(json.to_string().into_bytes()),
        ..Produced::default()
    }
}

/// Waits until the worker has committed every source record and the
/// dead-letter topic holds `n` records.
async fn settled(env: &TestEnv, n: usize) {
    env.wait_committed_to_end(Duration::from_secs(60)).await;
    eventually(
        "the dead letters are written",
        Duration::from_secs(30),
        || async { env.dead_letters_to_end().len() == n },
    )
    .await;
}

#[tokio::test]
async fn dlq_list_counts_and_filters_what_the_worker_dead_lettered() {
    let env = TestEnv::new("dlq-list", 2).await;
    let positions = env.produce(&six_bad_and_one_good()).await;
    let worker = WorkerProcess::start(bin(), env.vars(&[]), Log::Quiet);
    settled(&env, 6).await;
    check_kinds_and_the_forged_identity(&env);
    check_filters(&env, &positions);
    check_text_and_show(&env, positions[0]);
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// Three records that are not JSON, a tombstone, a valid trade, one with
/// fields missing, and a forged, malformed replay identity.
fn six_bad_and_one_good() -> Vec<Produced> {
    let not_json = || Produced {
        key: Some("k1".into()),
        payload: Some(b"{not json".to_vec()),
        ..Produced::default()
    };
    let mut records = vec![not_json(), not_json(), not_json()];
    records.push(Produced {
        key: Some("k2".into()),
        ..Produced::default()
    });
    records.push(payload(trade("L1").json()));
    records.push(payload(
        serde_json::json!({"tradeId": "L2", "customerId": 5}),
    ));
    // A forged, malformed replay identity: dead-lettered, named.
    let mut forged = payload(trade("").no_id().json());
    forged.headers = vec![("tradebucket.replay.of".into(), "trades/01/2".into())];
    records.push(forged);
    records
}

/// The summary by kind; the forged identity's letter names the header.
fn check_kinds_and_the_forged_identity(env: &TestEnv) {
    let all = listing(env, &[]);
    assert_eq!((all.scanned, all.matched), (6, 6));
    let kinds: BTreeMap<&str, u64> = all.by_kind.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    let expected = [
        ("empty", 1),
        ("invalid_field", 1),
        ("missing_field", 1),
        ("not_json", 3),
    ];
    assert_eq!(kinds, BTreeMap::from(expected));
    let forged = all
        .letters
        .iter()
        .find(|l| l.kind.as_deref() == Some("invalid_field"))
        .unwrap();
    let message = forged.message.as_deref().unwrap();
    assert!(message.contains("tradebucket.replay.of"), "{forged:?}");
}

/// Each filter, alone and combined.
fn check_filters(env: &TestEnv, positions: &[(i32, i64)]) {
    let not_json = listing(env, &["--kind", "not_json"]);
    assert_eq!((not_json.scanned, not_json.matched), (6, 3));
    assert!(not_json
        .letters
        .iter()
        .all(|l| l.kind.as_deref() == Some("not_json")));
    // The source partition filter agrees with where the records went (the
    // valid trade, fifth, was stored).
    let p = positions[0].0;
    let on_p = positions.iter().filter(|(q, _)| *q == p).count() as u64;
    let on_p = on_p - u64::from(positions[4].0 == p);
    let by_partition = listing(env, &["--source-partition", &p.to_string()]);
    assert_eq!(by_partition.matched, on_p);
    let two = listing(env, &["--kind", "not_json", "--kind", "empty"]);
    assert_eq!(two.matched, 4);
    let future = listing(env, &["--since", "2999-01-01T00:00:00Z"]);
    assert_eq!(future.matched, 0);
    assert_eq!(listing(env, &["--since", "1h"]).matched, 6);
    assert_eq!(listing(env, &["--source-topic", "elsewhere"]).matched, 0);
    assert_eq!(listing(env, &["--at", "0:1"]).matched, 1);
}

/// The text form (a summary and a line per letter), and `show` of one
/// letter with its headers decoded, of `first` (its source position).
fn check_text_and_show(env: &TestEnv, (p0, o0): (i32, i64)) {
    let (code, text, _) = dlq(env, &["list", "--kind", "empty"]);
    assert_eq!(code, Some(0));
    assert!(text.contains("6 dead letters, 1 matched"), "{text}");
    assert!(text.contains("empty"), "{text}");
    let (code, out, err) = dlq(env, &["show", "0:0", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let view: LetterView = serde_json::from_str(&out).unwrap();
    assert_eq!(view.kind.as_deref(), Some("not_json"));
    assert_eq!(view.payload.as_deref(), Some("{not json"));
    assert_eq!(view.key.as_deref(), Some("k1"));
    assert_eq!(view.source, Some(format!("{}/{p0}/{o0}", env.topic)));
    let (code, text, _) = dlq(env, &["show", "0:0"]);
    assert_eq!(code, Some(0));
    assert!(text.contains("tradebucket.error.kind: not_json"), "{text}");
    let (code, _, err) = dlq(env, &["show", "0:99"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no dead letter at"), "{err}");
}

/// Lifts `refuse_ticker`'s validator: the cause of the dead letters is
/// corrected.
async fn lift_validator(env: &TestEnv) {
    env.store()
        .await
        .client()
        .database(&env.db)
        .run_command(doc! {"collMod": "trades", "validator": {}})
        .await
        .expect("collMod");
}

#[tokio::test]
async fn replayed_dead_letters_are_stored_once_however_often_replayed() {
    let env = TestEnv::new("dlq-replay", 2).await;
    env.refuse_ticker("BAD").await;
    let events: Vec<_> = (0..6)
        .map(|i| {
            let t = trade(format!("R{i}")).customer(i % 2).ticker("BAD");
            payload(if i < 3 { t.json() } else { t.no_id().json() })
        })
        .collect();
    env.produce(&events).await;
    let worker = WorkerProcess::start(bin(), env.vars(&[]), Log::Quiet);
    settled(&env, 6).await;
    let rejected = listing(&env, &["--kind", "rejected_by_database"]);
    assert_eq!(rejected.matched, 6);
    check_dry_run_and_refusal(&env);
    replay_before_the_fix_keeps_the_first_identity(&env).await;
    lift_validator(&env).await;
    replay_twice_stores_once(&env).await;
    replay_a_corrected_payload_twice_stores_once(&env).await;
    assert_eq!(worker.sigterm(Duration::from_secs(30)), Some(0));
    env.cleanup().await;
}

/// A dry run sends nothing; a replay with nothing selected is refused.
fn check_dry_run_and_refusal(env: &TestEnv) {
    let (code, out, err) = dlq(env, &["replay", "--all", "--dry-run"]);
    assert_eq!(code, Some(0), "{err}");
    let nothing = "dry run: 6 dead letters, nothing sent";
    assert!(out.contains(nothing), "{out}");
    let (code, _, err) = dlq(env, &["replay"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--all"), "{err}");
}

/// Replayed before the cause is fixed: dead-lettered again, and those dead
/// letters keep the first identity.
async fn replay_before_the_fix_keeps_the_first_identity(env: &TestEnv) {
    let (code, _, err) = dlq(env, &["replay", "--all", "--rate", "0"]);
    assert_eq!(code, Some(0), "{err}");
    settled(env, 12).await;
    let letters = listing(env, &[]).letters;
    let (first, second) = letters.split_at(6);
    let sources: BTreeSet<_> = first.iter().map(|l| l.source.clone()).collect();
    let identities: BTreeSet<_> = second.iter().map(|l| l.identity.clone()).collect();
    assert_eq!(identities, sources);
    assert!(second.iter().all(|l| l.identity != l.source), "{second:?}");
}

/// Every dead letter, twice: the twelve name six trades, stored once each
/// (three by `tradeId`, three by their first position), and nothing more
/// is dead-lettered once the cause is fixed.
async fn replay_twice_stores_once(env: &TestEnv) {
    for round in 0..2 {
        let args = ["replay", "--kind", "rejected_by_database", "--rate", "0"];
        let (code, out, err) = dlq(env, &args);
        assert_eq!(code, Some(0), "round {round}: {err}");
        assert!(out.contains("replayed 12 dead letters"), "{out}");
        env.wait_committed_to_end(Duration::from_secs(60)).await;
        let report = audit_clean(env, 10).await;
        assert_eq!(report.trades, 6, "round {round}");
    }
    let keys: Vec<String> = env.histories().await.into_values().flatten().collect();
    // Without `tradeId`: under the original's position key (issue #46).
    let replayed = keys.iter().filter(|k| k.starts_with("o:")).count();
    let by_id = keys.iter().filter(|k| k.starts_with("t:")).count();
    assert_eq!((replayed, by_id), (3, 3), "{keys:?}");
    assert_eq!(env.dead_letters_to_end().len(), 12);
}

/// A corrected payload for one dead letter (`--payload`): a trade without
/// `tradeId`, replayed twice with different corrections, is stored once;
/// `--payload` with more than one dead letter is refused.
async fn replay_a_corrected_payload_twice_stores_once(env: &TestEnv) {
    let file = std::env::temp_dir().join(unique("corrected"));
    let path = file.to_str().unwrap();
    for (round, qty) in [(0, 5), (1, 6)] {
        let fixed = trade("").no_id().customer(9).ticker("FIXED").qty(qty);
        std::fs::write(&file, fixed.json().to_string()).unwrap();
        let (code, out, err) = dlq(env, &["replay", "--at", "0:0", "--payload", path]);
        assert_eq!(code, Some(0), "round {round}: {err}");
        assert!(out.contains("replayed 1 dead letters"), "{out}");
        env.wait_committed_to_end(Duration::from_secs(60)).await;
        assert_eq!(audit_clean(env, 10).await.trades, 7, "round {round}");
    }
    let (code, _, err) = dlq(env, &["replay", "--all", "--payload", path]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--payload replaces one dead letter"), "{err}");
    let _ = std::fs::remove_file(file);
}
