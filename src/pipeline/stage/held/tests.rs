use std::sync::Arc;

use mongodb::bson::rawdoc;

use super::*;

fn event(customer: i64, offset: i64) -> (Trade, Source) {
    let trade = Trade {
        key: format!("k{offset}").into(),
        legacy_key: None,
        customer: CustomerId::Int(customer),
        ticker: "MDB".into(),
        date_ms: 0,
        doc: rawdoc! {"key": format!("k{offset}")},
    };
    let source = Source {
        topic: "trades".into(),
        partition: 0,
        offset,
    };
    (trade, source)
}

fn held(customer: i64, offset: i64, since: TokioInstant) -> Held {
    Held {
        event: event(customer, offset),
        record: Record {
            tp: (Arc::from("trades"), 0),
            offset,
            key: None,
            payload: None,
            headers: Vec::new(),
            timestamp_ms: None,
        },
        since,
    }
}

fn offsets(taken: &[Held]) -> Vec<i64> {
    taken.iter().map(|h| h.record.offset).collect()
}

/// Room for `trades` more trades of any size.
fn trades(trades: u32) -> Room {
    Room {
        trades,
        bytes: u64::MAX,
    }
}

/// Each outcome's room in trades: `Some` for a held one.
fn rooms(outcomes: &[Outcome]) -> Vec<Option<u32>> {
    outcomes
        .iter()
        .map(|o| match o {
            Outcome::Held(room) => Some(room.trades),
            Outcome::Pending => None,
            other => panic!("a stage marks no {other:?}"),
        })
        .collect()
}

const AGE: Duration = Duration::from_secs(60);

#[tokio::test(start_paused = true)]
async fn trades_that_fit_stay_held_and_the_rest_take_their_customer_s() {
    let now = TokioInstant::now();
    let mut h = HeldTrades::default();
    h.keep(held(1, 0, now), trades(2));
    h.keep(held(2, 1, now), trades(1));
    h.keep(held(3, 2, now), trades(5));
    // Customer 1's two fit; customer 2's two do not; 3 is not in the batch;
    // 4 holds nothing.
    let batch = [
        event(1, 10),
        event(2, 11),
        event(1, 12),
        event(2, 13),
        event(4, 14),
    ];
    let due = h.take_due(&batch, now, AGE);
    assert_eq!(offsets(&due.taken), vec![1], "customer 2's, to go first");
    assert_eq!(due.expired, 0);
    let rooms = rooms(&due.outcomes);
    assert_eq!(rooms, vec![Some(0), None, Some(0), None, None]);
    assert_eq!(h.count(), 2, "customers 1 and 3 still hold one each");
}

#[tokio::test(start_paused = true)]
async fn a_bucket_full_by_size_takes_no_more() {
    let now = TokioInstant::now();
    let mut h = HeldTrades::default();
    let e = event(1, 10);
    let charge = size::charge(&e.0, &e.1);
    h.keep(
        held(1, 0, now),
        Room {
            trades: 9,
            bytes: charge - 1,
        },
    );
    let due = h.take_due(&[e], now, AGE);
    assert_eq!(offsets(&due.taken), vec![0]);
    assert_eq!(rooms(&due.outcomes), vec![None]);
}

#[tokio::test(start_paused = true)]
async fn held_trades_past_their_age_go_first_whatever_fits() {
    let start = TokioInstant::now();
    let mut h = HeldTrades::default();
    h.keep(held(1, 0, start), trades(5));
    tokio::time::advance(AGE).await;
    let now = TokioInstant::now();
    h.keep(held(2, 1, now), trades(5));
    let due = h.take_due(&[event(2, 10), event(1, 11)], now, AGE);
    assert_eq!((offsets(&due.taken), due.expired), (vec![0], 1));
    assert_eq!(
        rooms(&due.outcomes),
        vec![Some(4), None],
        "customer 1's 11 is written after its expired 0"
    );
}

#[tokio::test(start_paused = true)]
async fn kept_trades_follow_their_customer_s_and_set_its_room() {
    let now = TokioInstant::now();
    let mut h = HeldTrades::default();
    h.keep(held(1, 0, now), trades(1));
    h.keep(held(1, 3, now), trades(0));
    let due = h.take_due(&[event(1, 10)], now, AGE);
    assert_eq!(offsets(&due.taken), vec![0, 3], "in order, its room spent");
    assert_eq!(h.count(), 0);
}

#[tokio::test(start_paused = true)]
async fn forgotten_rooms_take_nothing_and_take_all_empties() {
    let now = TokioInstant::now();
    let mut h = HeldTrades::default();
    h.keep(held(1, 0, now), trades(5));
    h.keep(held(2, 1, now), trades(5));
    h.forget_rooms();
    let due = h.take_due(&[event(1, 10)], now, AGE);
    assert_eq!(offsets(&due.taken), vec![0]);
    let mut all = offsets(&h.take_all());
    all.sort();
    assert_eq!((all, h.count()), (vec![1], 0));
}
