//! Scenario 8's event set: record shapes a real cluster can deliver and a
//! well-behaved producer never sends, between valid trades. Header names
//! and values of any bytes (on valid trades, which must be stored, and on
//! bad records), records just over 1 MB, tombstones, forged
//! `tradebucket.*` headers, extras nested one level over the limit and
//! exactly at it; produced in batches compressed with each codec Kafka
//! defines.

use std::collections::HashSet;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use testkit::Produced;
use tradebucket::kafka::headers::Header;

use crate::harness::*;

/// The codecs the batches are compressed with, chunk after chunk: every
/// one Kafka defines.
pub const CODECS: [&str; 5] = ["none", "gzip", "snappy", "lz4", "zstd"];

/// A record just over 1 MB: over the dead-letter producer's default
/// 1,000,000-byte `message.max.bytes`, under the consumer's 1 MiB fetch
/// size, and under the broker's default `message.max.bytes` (1 MiB).
const OVER_1MB: usize = 1_000_100;

/// What our producers allow instead of librdkafka's 1,000,000 bytes, so
/// the records over 1 MB leave them.
const PRODUCER_MAX_BYTES: &str = "2000000";

/// The deepest nesting of objects and arrays the README allows in an extra
/// field (`MAX_EXTRA_NESTING` in src/event.rs).
const MAX_NESTING: usize = 97;

/// The bad recipes: name, and the dead-letter kind README.md specifies.
pub const HOSTILE: [(&str, &str); 5] = [
    ("odd_headers_not_json", "not_json"),
    ("forged_headers_missing_field", "missing_field"),
    ("tombstone", "empty"),
    ("nesting_98", "invalid_field"),
    ("over_1mb", "oversize"),
];
/// `HOSTILE`'s index of the record over 1 MB (the one made rarely).
const OVER_1MB_RECIPE: usize = 4;

/// `n` bytes of anything.
fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

/// Headers a Go or C producer can send: names that are not UTF-8, hold a
/// NUL (also as their first byte) or are empty; values that are not UTF-8
/// or null. A random non-empty selection, in random order.
fn odd_headers(rng: &mut StdRng) -> Vec<Header> {
    let mut all: Vec<Header> = vec![
        (vec![0xff, 0xfe, rng.random()], Some(vec![0xc3, 0x28])),
        (b"nul\0name".to_vec(), Some(random_bytes(rng, 8))),
        (vec![0, b'x'], None),
        (Vec::new(), Some(Vec::new())),
        (b"null-value".to_vec(), None),
        (b"binary-value".to_vec(), Some(random_bytes(rng, 16))),
    ];
    all.shuffle(rng);
    let keep = rng.random_range(1..=all.len());
    all.truncate(keep);
    all
}

/// Headers in tradebucket's namespace that would pass a record off as
/// something else (another kind, another position, a shortened one). None
/// may reach its dead letter.
fn forged_headers() -> Vec<Header> {
    let h = |name: &[u8], value: Option<&[u8]>| (name.to_vec(), value.map(<[u8]>::to_vec));
    vec![
        h(b"tradebucket.error.kind", Some(b"forged")),
        h(b"tradebucket.source.offset", Some(b"0")),
        h(b"tradebucket.source.partition", Some(b"99")),
        h(b"tradebucket.source.topic", Some(b"elsewhere")),
        h(b"tradebucket.shortened", None),
        // Cut at the NUL by librdkafka's API, the name is ours again.
        h(b"tradebucket.error.kind\0x", Some(b"forged-too")),
    ]
}

/// A number inside `levels` objects and arrays, alternately.
fn nested(levels: usize) -> Value {
    (0..levels).fold(json!(1), |v, i| {
        if i % 2 == 0 {
            json!([v])
        } else {
            json!({ "n": v })
        }
    })
}

/// `t` with a `pad` field making it exactly `len` bytes of JSON.
fn padded(mut t: Value, len: usize) -> Vec<u8> {
    t["pad"] = json!("");
    let base = t.to_string().len();
    t["pad"] = json!("x".repeat(len - base));
    let bytes = t.to_string().into_bytes();
    assert_eq!(bytes.len(), len);
    bytes
}

/// The payload of recipe `name`, made from the valid trade `t`.
fn hostile_payload(name: &str, mut t: Value) -> Option<Vec<u8>> {
    match name {
        "odd_headers_not_json" => {
            let s = t.to_string();
            Some(s.as_bytes()[..s.len() / 2].to_vec())
        }
        "forged_headers_missing_field" => {
            t.as_object_mut().unwrap().remove("ticker");
            Some(t.to_string().into_bytes())
        }
        "tombstone" => None,
        "nesting_98" => {
            t["depth"] = nested(MAX_NESTING + 1);
            Some(t.to_string().into_bytes())
        }
        "over_1mb" => Some(padded(t, OVER_1MB)),
        other => unreachable!("{other}"),
    }
}

/// One bad record of recipe `HOSTILE[k]`, from a complete trade with its
/// own `tradeId` (stored anyway, it would show as unexpected). Its own
/// recipe's headers always, odd and forged ones often on the others too.
fn hostile(k: usize, i: usize, rng: &mut StdRng) -> Rec {
    let (name, kind) = HOSTILE[k];
    let customer = rng.random_range(0..CUSTOMERS);
    let t = bad_trade(format!("HOSTILE-{i}"), customer);
    let mut raw = Vec::new();
    if name == "odd_headers_not_json" || rng.random_bool(0.7) {
        raw.extend(odd_headers(rng));
    }
    if name == "forged_headers_missing_field" || rng.random_bool(0.5) {
        raw.extend(forged_headers());
    }
    raw.shuffle(rng);
    // Half the tombstones without a key, as log-compaction deletes send.
    let keyed = name != "tombstone" || rng.random_bool(0.5);
    Rec {
        msg: Produced {
            key: keyed.then(|| customer.to_string()),
            payload: hostile_payload(name, t),
            headers: vec![("chaos.origin".into(), "hostile".into())],
            raw_headers: raw,
            ..Produced::default()
        },
        class: Class::Bad {
            poison: name,
            kind,
            shortened: k == OVER_1MB_RECIPE,
        },
    }
}

/// Gives good trades shapes that must not change their fate: `odd` of them
/// odd and forged headers, `deep` of them an extra field nesting exactly
/// the README's limit. Both kinds are stored as usual.
pub fn harden_goods(goods: &mut [Rec], odd: usize, deep: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let chosen = rand::seq::index::sample(&mut rng, goods.len(), odd + deep);
    for (j, i) in chosen.into_iter().enumerate() {
        let msg = &mut goods[i].msg;
        if j < odd {
            msg.raw_headers.extend(odd_headers(&mut rng));
            if rng.random_bool(0.5) {
                msg.raw_headers.extend(forged_headers());
            }
        } else {
            let mut t: Value = serde_json::from_slice(msg.payload.as_ref().unwrap()).unwrap();
            t["depth"] = nested(MAX_NESTING);
            msg.payload = Some(t.to_string().into_bytes());
        }
    }
}

/// `goods` with `bad` hostile records at random positions: every recipe
/// at least once, `big` of them over 1 MB, the rest spread evenly over the
/// other recipes.
pub fn with_hostile(goods: Vec<Rec>, bad: usize, big: usize, seed: u64) -> Vec<Rec> {
    assert!(big >= 1 && bad >= HOSTILE.len() - 1 + big);
    let mut rng = StdRng::seed_from_u64(seed);
    let others = HOSTILE.len() - 1;
    let mut recipes: Vec<usize> = (0..bad - big)
        .map(|j| {
            if j < others {
                j
            } else {
                rng.random_range(0..others)
            }
        })
        .collect();
    recipes.extend(std::iter::repeat_n(OVER_1MB_RECIPE, big));
    recipes.shuffle(&mut rng);
    let total = goods.len() + bad;
    let positions: HashSet<usize> = rand::seq::index::sample(&mut rng, total, bad)
        .into_iter()
        .collect();
    let mut goods = goods.into_iter();
    let mut recipes = recipes.into_iter().enumerate();
    (0..total)
        .map(|i| {
            if positions.contains(&i) {
                let (made, k) = recipes.next().unwrap();
                hostile(k, made, &mut rng)
            } else {
                goods.next().unwrap()
            }
        })
        .collect()
}

/// Produces `recs` in order, in `chunks` chunks, each by a producer of its
/// own that compresses with the next of [`CODECS`] and lets records over
/// 1 MB through; returns each record's (partition, offset).
pub async fn produce_compressed(
    brokers: &str,
    topic: &str,
    recs: &[Rec],
    chunks: usize,
) -> Vec<(i32, i64)> {
    let size = recs.len().div_ceil(chunks.max(1)).max(1);
    let mut out = Vec::with_capacity(recs.len());
    for (c, chunk) in recs.chunks(size).enumerate() {
        let options = [
            ("compression.type", CODECS[c % CODECS.len()]),
            ("message.max.bytes", PRODUCER_MAX_BYTES),
        ];
        out.extend(produce_with(brokers, topic, chunk, &options).await);
    }
    out
}
