use super::*;

fn at(offset: i64) -> Source {
    Source {
        topic: "trades".into(),
        partition: 0,
        offset,
    }
}

fn c7() -> CustomerId {
    CustomerId::Int(7)
}

fn seen<'a>(
    at: &'a Source,
    customer: &'a CustomerId,
    keys: &'a [String],
    buckets: &'a [String],
) -> TradeSeen<'a> {
    TradeSeen {
        at,
        customer,
        keys,
        buckets,
    }
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

#[test]
fn a_trade_stored_once_under_its_customer_is_stored_and_a_later_copy_an_upstream_duplicate() {
    let mut l = Ledger::new([]);
    let (keys, buckets) = (s(&["t:a"]), s(&["7_100"]));
    assert_eq!(
        l.trade(&seen(&at(0), &c7(), &keys, &buckets)),
        Verdict::Stored
    );
    assert_eq!(
        l.trade(&seen(&at(1), &c7(), &keys, &buckets)),
        Verdict::UpstreamDuplicate
    );
    let t = l.total();
    assert_eq!(
        (t.records, t.stored, t.upstream_duplicates, t.problems),
        (2, 1, 1, 0)
    );
}

#[test]
fn every_problem_kind_is_named_at_its_position() {
    let mut l = Ledger::new([at(3)]);
    let c = c7();
    let k = |x: &str| s(&[x]);
    assert_eq!(
        l.trade(&seen(&at(0), &c, &k("t:a"), &[])),
        Verdict::Problem(ProblemKind::Missing)
    );
    assert_eq!(
        l.trade(&seen(&at(1), &c, &k("t:b"), &s(&["8_100"]))),
        Verdict::Problem(ProblemKind::Misfiled)
    );
    assert_eq!(
        l.trade(&seen(&at(2), &c, &k("t:c"), &s(&["7_100", "7_200"]))),
        Verdict::Problem(ProblemKind::StoredTwice)
    );
    assert_eq!(
        l.trade(&seen(&at(3), &c, &k("t:d"), &s(&["7_100"]))),
        Verdict::Problem(ProblemKind::DeadLetteredAndStored)
    );
    assert_eq!(l.bad(&at(4)), Verdict::Problem(ProblemKind::Missing));
    let offsets: Vec<(ProblemKind, i64)> = l.problems.iter().map(|p| (p.kind, p.offset)).collect();
    assert_eq!(
        offsets,
        vec![
            (ProblemKind::Missing, 0),
            (ProblemKind::Misfiled, 1),
            (ProblemKind::StoredTwice, 2),
            (ProblemKind::DeadLetteredAndStored, 3),
            (ProblemKind::Missing, 4),
        ]
    );
    assert_eq!(l.total().problems, 5);
    assert_eq!(l.by_kind[&ProblemKind::Missing], 2);
}

#[test]
fn dead_letters_account_for_bad_records_and_refused_trades_and_repeats_are_counted() {
    let mut l = Ledger::new([at(0), at(1), at(1)]);
    assert_eq!(l.bad(&at(0)), Verdict::DeadLettered);
    // Refused by the writer: its key is another customer's.
    let (keys, other) = (s(&["t:x"]), s(&["8_1"]));
    assert_eq!(
        l.trade(&seen(&at(1), &c7(), &keys, &other)),
        Verdict::DeadLettered
    );
    let t = l.total();
    assert_eq!(
        (t.dead_lettered, t.dead_letters_repeated, t.problems),
        (2, 1, 0)
    );
}

#[test]
fn stored_twice_is_said_once_per_key() {
    let mut l = Ledger::new([]);
    let (keys, twice) = (s(&["t:a"]), s(&["7_1", "7_2"]));
    l.trade(&seen(&at(0), &c7(), &keys, &twice));
    assert_eq!(
        l.trade(&seen(&at(1), &c7(), &keys, &twice)),
        Verdict::UpstreamDuplicate
    );
    assert_eq!(l.total().problems, 1);
}

#[test]
fn a_position_keyed_trade_is_found_under_its_replay_identity() {
    assert_eq!(
        keys_of("o:trades/0/5"),
        s(&["o:trades/0/5", "r:trades/0/5"])
    );
    assert_eq!(keys_of("t:9"), s(&["t:9"]));
    assert_eq!(keys_of("r:trades/0/5"), s(&["r:trades/0/5"]));
}

#[test]
fn listed_problems_are_capped_but_counted() {
    let mut l = Ledger::new([]);
    for o in 0..(LISTED_PROBLEMS as i64 + 5) {
        l.bad(&at(o));
    }
    assert_eq!(l.problems.len(), LISTED_PROBLEMS);
    assert_eq!(l.total().problems, LISTED_PROBLEMS as u64 + 5);
}

#[test]
fn spans_run_from_the_asked_or_retained_start_to_the_committed_offset() {
    let tp = ("trades", 0);
    let s1 = span(tp, (0, 100), Some(60), Start::Earliest, false);
    assert_eq!(
        (s1.from, s1.to, s1.retained_from, s1.uncommitted),
        (0, 60, None, false)
    );
    // Retention removed 0..40: the answer holds from 40.
    let s2 = span(tp, (40, 100), Some(60), Start::Earliest, false);
    assert_eq!((s2.from, s2.to, s2.retained_from), (40, 60, Some(40)));
    let s3 = span(tp, (40, 100), Some(60), Start::At(10), false);
    assert_eq!((s3.from, s3.retained_from), (40, Some(40)));
    let s4 = span(tp, (0, 100), Some(60), Start::At(50), true);
    assert_eq!((s4.from, s4.to, s4.retained_from), (50, 100, None));
    // Nothing committed: nothing promised, nothing read.
    let s5 = span(tp, (0, 100), None, Start::Earliest, false);
    assert_eq!((s5.from, s5.to, s5.uncommitted), (0, 0, true));
    // Asked to start past the committed offset: an empty span.
    let s6 = span(tp, (0, 100), Some(60), Start::At(80), false);
    assert_eq!((s6.from, s6.to), (80, 80));
}

/// Issue #46: a trade without `tradeId` stored once under its position
/// (`o:`) and once under the key versions before stored its replay under
/// (`r:`) is a double, whichever of its records is read first. With the
/// replay's partition read first, the replay was counted stored and the
/// original, doubled, an upstream duplicate: exit 0.
#[test]
fn a_double_is_reported_whichever_record_is_read_first() {
    let both = s(&["7_100", "7_200"]);
    let (original, replay) = (
        at(5),
        Source {
            partition: 1,
            ..at(9)
        },
    );
    for order in [[&original, &replay], [&replay, &original]] {
        let mut l = Ledger::new([]);
        let keys = keys_of("o:trades/0/5");
        let verdicts: Vec<Verdict> = order
            .iter()
            .map(|at| l.trade(&seen(at, &c7(), &keys, &both)))
            .collect();
        assert_eq!(
            verdicts,
            vec![
                Verdict::Problem(ProblemKind::StoredTwice),
                Verdict::UpstreamDuplicate
            ]
        );
        assert_eq!(l.total().problems, 1);
    }
    // A key read first with one copy (as a version before #46 read a
    // replay: its `r:` key alone) and then with two still reports the two.
    let mut l = Ledger::new([]);
    let one = s(&["7_200"]);
    let r_only = s(&["r:trades/0/5"]);
    assert_eq!(
        l.trade(&seen(&replay, &c7(), &r_only, &one)),
        Verdict::Stored
    );
    let keys = keys_of("o:trades/0/5");
    assert_eq!(
        l.trade(&seen(&original, &c7(), &keys, &both)),
        Verdict::Problem(ProblemKind::StoredTwice)
    );
}

/// Sharded, a trade id is the customer's: customer 8's `t:X` stored twice
/// is reported although customer 7's `t:X` was read before, and is not
/// its upstream duplicate.
#[test]
fn sharded_doubles_and_duplicates_are_per_customer() {
    let c8 = CustomerId::Int(8);
    let keys = s(&["t:X"]);
    for sharded in [false, true] {
        let mut l = Ledger::new([]).sharded(sharded);
        let seven = s(&["7_100"]);
        assert_eq!(
            l.trade(&seen(&at(0), &c7(), &keys, &seven)),
            Verdict::Stored
        );
        let eights = s(&["8_100", "8_200"]);
        let verdict = l.trade(&seen(&at(1), &c8, &keys, &eights));
        assert_eq!(
            verdict,
            Verdict::Problem(ProblemKind::StoredTwice),
            "sharded {sharded}"
        );
        let eight = s(&["8_100"]);
        let verdict = l.trade(&seen(&at(2), &c8, &keys, &eight));
        assert_eq!(verdict, Verdict::UpstreamDuplicate, "sharded {sharded}");
        if sharded {
            let mut l = Ledger::new([]).sharded(true);
            l.trade(&seen(&at(0), &c7(), &keys, &seven));
            let verdict = l.trade(&seen(&at(1), &c8, &keys, &eight));
            assert_eq!(verdict, Verdict::Stored, "another customer's trade");
        }
    }
}

/// A refused trade, dead-lettered, then stored by `dlq replay`: not a
/// problem once the replay is read, before or after the original; stored
/// with no replay read (redelivered once the refusal was lifted), it is.
#[test]
fn a_dead_letter_replayed_and_stored_is_no_problem_whichever_is_read_first() {
    let (c, keys, stored) = (c7(), s(&["t:d"]), s(&["7_100"]));
    let mut l = Ledger::new([at(3), at(4), at(5)]);
    l.replay_of(at(3));
    assert_eq!(
        l.trade(&seen(&at(3), &c, &keys, &stored)),
        Verdict::Replayed
    );
    let doubled = Verdict::Problem(ProblemKind::DeadLetteredAndStored);
    let other = s(&["t:e"]);
    assert_eq!(l.trade(&seen(&at(4), &c, &other, &stored)), doubled);
    assert_eq!(l.total().problems, 1);
    l.replay_of(at(4));
    let t = l.total();
    assert_eq!(
        (t.problems, t.dead_lettered, t.dead_letters_replayed),
        (0, 2, 2)
    );
    assert!(l.problems.is_empty() && l.by_kind.is_empty());
    // No replay of at(5) is read: a problem, as before.
    assert_eq!(l.trade(&seen(&at(5), &c, &s(&["t:f"]), &stored)), doubled);
    l.replay_of(at(6));
    assert_eq!(l.total().problems, 1);
    assert_eq!(l.problems[0].offset, 5);
}
