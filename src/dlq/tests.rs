use super::*;
use crate::event::replay_origin;
use crate::event::RejectKind;
use crate::kafka::H_PAYLOAD_LENGTH;

fn h(name: &str, value: &str) -> Header {
    (name.as_bytes().to_vec(), Some(value.as_bytes().to_vec()))
}

/// A dead letter as the worker writes it: the original headers, then ours.
fn dead_letter(at: (i32, i64), ts: i64, kind: &str, source: (&str, i32, i64)) -> Letter {
    Letter::new(
        ("trades.dlq".into(), at.0, at.1),
        Some(ts),
        Some(b"cust-1".to_vec()),
        Some(br#"{"bad":1}"#.to_vec()),
        vec![
            h("trace-id", "abc"),
            (vec![0xff], Some(vec![0xfe])),
            h(H_ERROR_KIND, kind),
            h(H_ERROR_MESSAGE, "why"),
            h(H_SOURCE_TOPIC, source.0),
            h(H_SOURCE_PARTITION, &source.1.to_string()),
            h(H_SOURCE_OFFSET, &source.2.to_string()),
        ],
    )
}

fn src(topic: &str, partition: i32, offset: i64) -> Source {
    Source {
        topic: topic.into(),
        partition,
        offset,
    }
}

#[test]
fn a_dead_letter_reads_back_its_kind_source_and_identity() {
    let l = dead_letter((2, 9), 1_000, "not_json", ("trades", 1, 41));
    assert_eq!(l.kind.as_deref(), Some("not_json"));
    assert_eq!(l.message.as_deref(), Some("why"));
    assert_eq!(l.source, Some(src("trades", 1, 41)));
    assert_eq!(l.identity, Some(src("trades", 1, 41)));
    assert!(!l.shortened);
}

#[test]
fn a_replay_sends_key_payload_and_original_headers_with_the_identity() {
    let l = dead_letter((0, 3), 1_000, "rejected_by_database", ("trades", 1, 41));
    let r = l.replay().unwrap();
    assert_eq!(r.topic, "trades");
    assert_eq!(r.key, l.key);
    assert_eq!(r.payload, l.payload);
    assert_eq!(
        r.headers,
        vec![
            h("trace-id", "abc"),
            (vec![0xff], Some(vec![0xfe])),
            h(H_REPLAY_OF, "trades/1/41"),
        ]
    );
    // What the worker reads from those headers is the same identity.
    assert_eq!(
        replay_origin(&r.headers).unwrap(),
        Some(src("trades", 1, 41))
    );
}

#[test]
fn a_replayed_event_dead_lettered_again_keeps_its_first_identity() {
    let mut l = dead_letter((0, 7), 1_000, "invalid_field", ("trades", 0, 900));
    // The worker's dead letter of a replay carries its replay.of on.
    l.headers.push(h(H_REPLAY_OF, "trades/1/41"));
    let l = Letter::new(
        ("trades.dlq".into(), 0, 7),
        l.timestamp_ms,
        l.key,
        l.payload,
        l.headers,
    );
    assert_eq!(l.source, Some(src("trades", 0, 900)));
    assert_eq!(l.identity, Some(src("trades", 1, 41)));
    let r = l.replay().unwrap();
    let ours: Vec<_> = r
        .headers
        .iter()
        .filter(|(n, _)| n.starts_with(OUR_HEADER_PREFIX))
        .collect();
    assert_eq!(ours, vec![&h(H_REPLAY_OF, "trades/1/41")]);
}

#[test]
fn shortened_and_foreign_records_are_refused_with_the_reason() {
    let mut l = dead_letter((1, 5), 1_000, "oversize", ("trades", 0, 1));
    l.headers.push(h(H_SHORTENED, "cut"));
    l.headers.push(h(H_PAYLOAD_LENGTH, "3000000"));
    let l = Letter::new(("t.dlq".into(), 1, 5), None, l.key, l.payload, l.headers);
    let why = l.replay().unwrap_err();
    assert!(why.contains("1:5") && why.contains("shortened"), "{why}");
    let foreign = Letter::new(("t.dlq".into(), 0, 0), None, None, None, vec![]);
    assert!(foreign
        .replay()
        .unwrap_err()
        .contains("not a tradebucket dead letter"));
}

#[test]
fn the_filter_needs_every_criterion_it_is_given() {
    let l = dead_letter((2, 9), 5_000, "not_json", ("trades", 1, 41));
    let f = |edit: fn(&mut Filter)| {
        let mut f = Filter::default();
        edit(&mut f);
        f.matches(&l)
    };
    assert!(f(|_| {}));
    assert!(f(|f| f.kinds = vec!["empty".into(), "not_json".into()]));
    assert!(!f(|f| f.kinds = vec!["empty".into()]));
    assert!(f(|f| f.source_topic = Some("trades".into())));
    assert!(!f(|f| f.source_topic = Some("other".into())));
    assert!(f(|f| f.source_partition = Some(1)));
    assert!(!f(|f| f.source_partition = Some(0)));
    assert!(f(|f| f.at = vec![(2, 9)]));
    assert!(!f(|f| f.at = vec![(9, 2)]));
    assert!(f(
        |f| f.since = DateTime::<Utc>::from_timestamp_millis(5_000)
    ));
    assert!(!f(
        |f| f.since = DateTime::<Utc>::from_timestamp_millis(5_001)
    ));
    assert!(!f(
        |f| f.until = DateTime::<Utc>::from_timestamp_millis(5_000)
    ));
    assert!(f(
        |f| f.until = DateTime::<Utc>::from_timestamp_millis(5_001)
    ));
    let both = Filter {
        kinds: vec!["not_json".into()],
        source_partition: Some(0),
        ..Filter::default()
    };
    assert!(!both.matches(&l));
    // A record without our headers matches only a filter on none of them.
    let foreign = Letter::new(("t.dlq".into(), 0, 0), None, None, None, vec![]);
    assert!(!Filter {
        source_partition: Some(0),
        ..Filter::default()
    }
    .matches(&foreign));
}

#[test]
fn the_listing_counts_every_match_by_kind_and_keeps_the_first() {
    let mut listing = Listing::default();
    let filter = Filter {
        source_topic: Some("trades".into()),
        ..Filter::default()
    };
    for (i, kind) in ["not_json", "empty", "not_json", "oversize"]
        .iter()
        .enumerate()
    {
        let l = dead_letter((0, i as i64), 1, kind, ("trades", 0, i as i64));
        listing.add(&l, &filter, 2);
    }
    listing.add(
        &dead_letter((0, 9), 1, "empty", ("other", 0, 1)),
        &filter,
        2,
    );
    assert_eq!((listing.scanned, listing.matched), (5, 4));
    let kinds: Vec<_> = listing
        .by_kind
        .iter()
        .map(|(k, n)| (k.as_str(), *n))
        .collect();
    assert_eq!(kinds, vec![("empty", 1), ("not_json", 2), ("oversize", 1)]);
    assert_eq!(listing.letters.len(), 2);
}

#[test]
fn times_and_positions_parse_and_bad_ones_say_why() {
    assert_eq!(
        parse_time("2026-11-23T14:00:00Z").unwrap().timestamp(),
        1_795_442_400
    );
    let two_hours_ago = parse_time("2h").unwrap();
    let age = Utc::now() - two_hours_ago;
    assert!((age.num_seconds() - 7200).abs() < 5, "{age}");
    assert!(parse_time("yesterday-ish").is_err());
    assert_eq!(parse_at("3:41").unwrap(), (3, 41));
    for bad in ["3", "a:1", "1:b", ""] {
        assert!(parse_at(bad).is_err(), "{bad}");
    }
}

#[test]
fn bytes_show_as_text_or_escaped() {
    assert_eq!(show_bytes(b"plain"), "plain");
    assert_eq!(show_bytes(&[0xff, b'a']), "\\xffa");
    let view = LetterView::of(&dead_letter((0, 1), 0, "empty", ("t", 0, 1)));
    assert_eq!(
        view.headers[1],
        ("\\xff".to_string(), Some("\\xfe".to_string()))
    );
    assert!(view.detail().contains("trace-id: abc"));
    assert_eq!(view.identity.as_deref(), Some("t/0/1"));
}

#[test]
fn the_replay_header_is_read_strictly() {
    let read = |values: &[&[u8]]| {
        let headers: Vec<Header> = values
            .iter()
            .map(|v| (H_REPLAY_OF.as_bytes().to_vec(), Some(v.to_vec())))
            .collect();
        replay_origin(&headers)
    };
    assert_eq!(read(&[]), Ok(None));
    assert_eq!(read(&[b"trades/1/41"]), Ok(Some(src("trades", 1, 41))));
    assert_eq!(read(&[b"a.b_c-D/0/0"]), Ok(Some(src("a.b_c-D", 0, 0))));
    for bad in [
        &b"trades/1"[..],
        b"trades/1/41/2",
        b"/1/41",
        b"tr ades/1/41",
        b"../1/41",
        b"trades/-1/41",
        b"trades/+1/41",
        b"trades/01/41",
        b"trades/1/041",
        b"trades/1/",
        b"trades/99999999999/1",
        b"trades/1/99999999999999999999",
        b"trades/1/4\xff",
    ] {
        let e = read(&[bad]).unwrap_err();
        assert_eq!(e.kind, RejectKind::InvalidField, "{bad:?}");
        assert!(e.message.contains(H_REPLAY_OF), "{}", e.message);
    }
    let long = format!("{}/0/0", "t".repeat(250));
    assert!(read(&[long.as_bytes()]).is_err());
    assert!(read(&[b"trades/1/41", b"trades/1/41"]).is_err(), "twice");
    let null = vec![(H_REPLAY_OF.as_bytes().to_vec(), None)];
    assert!(replay_origin(&null).is_err());
    // Other headers, even of similar names, are not it.
    assert_eq!(
        replay_origin(&[h("tradebucket.replay", "x"), h("replay.of", "x")]),
        Ok(None)
    );
}

#[test]
fn a_replayed_trade_without_trade_id_is_keyed_as_its_original() {
    use crate::event::{decode, decode_as, Identity};
    let read_at = src("trades", 0, 900);
    let origin = src("trades", 1, 41);
    let no_id = br#"{"customerId":7,"type":"buy","ticker":"MDB","qty":1,"date":0}"#;
    let keys = |identity| {
        let t = decode_as(Some(no_id), identity, 1 << 20).unwrap();
        (t.key, t.legacy_key)
    };
    // Replayed: the key of the record it replays, so the unique index
    // stores the two once whichever is read first (issue #46), and the
    // key versions before stored replays under, to look up.
    assert_eq!(
        keys(Identity::ReplayOf(&origin)),
        ("o:trades/1/41".into(), Some("r:trades/1/41".into()))
    );
    assert_eq!(
        keys(Identity::Read(&read_at)),
        ("o:trades/0/900".into(), None)
    );
    assert_eq!(
        keys(Identity::ReplayOf(&read_at)).0,
        keys(Identity::Read(&read_at)).0
    );
    assert_eq!(
        decode(Some(no_id), &read_at, 1 << 20).unwrap().key,
        "o:trades/0/900"
    );
    let with_id =
        br#"{"tradeId":"T1","customerId":7,"type":"buy","ticker":"MDB","qty":1,"date":0}"#;
    let trade = decode_as(Some(with_id), Identity::ReplayOf(&origin), 1 << 20).unwrap();
    assert_eq!(
        (trade.key.as_str(), trade.legacy_key.as_deref()),
        ("t:T1", None)
    );
    assert_eq!(trade.entry().unwrap().get_str("key").unwrap(), "t:T1");
}
