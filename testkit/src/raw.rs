//! Record batches written byte by byte, for the shapes a Kafka cluster
//! delivers and no client library produces: offset gaps inside a batch
//! (what log compaction leaves) and control batches (transaction markers).
//!
//! A Kafka broker checks that a produced batch's offsets are consecutive
//! and refuses control batches from clients; the local broker (Tansu 0.6.0)
//! stores them as sent and serves them, which is what these tests use
//! (docs/testing.md). What the consumer then reads is byte for byte what a
//! compacted or transactional topic serves. Tansu has no `EndTxn`, so a real
//! transactional producer cannot be used against it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// One record of a batch.
pub struct RawRecord {
    /// Its offset relative to the batch's first.
    pub delta: i32,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
}

/// A control record's key (version 0, type 0 = abort, 1 = commit) and
/// value (version 0, coordinator epoch 0).
pub fn marker(delta: i32, commit: bool) -> RawRecord {
    RawRecord {
        delta,
        key: Some(vec![0, 0, 0, u8::from(commit)]),
        value: Some(vec![0, 0, 0, 0, 0, 0]),
    }
}

/// Produces one batch (v2 format) to `topic`/`partition` on the broker at
/// `address` (a single-node cluster: it leads every partition), as a
/// control batch of producer `pid` if `control`. Returns the batch's base
/// offset. Panics on any failure: it is a test helper.
pub fn produce_batch(
    address: &str,
    topic: &str,
    partition: i32,
    records: &[RawRecord],
    control: Option<i64>,
) -> i64 {
    let batch = record_batch(records, control);
    let request = produce_request(topic, partition, &batch);
    let mut conn = TcpStream::connect(address).expect("connect to the broker");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    conn.write_all(&request).expect("send Produce");
    let mut size = [0u8; 4];
    conn.read_exact(&mut size).expect("Produce response size");
    let mut reply = vec![0u8; i32::from_be_bytes(size) as usize];
    conn.read_exact(&mut reply).expect("Produce response");
    base_offset_of(&reply, topic)
}

fn record_batch(records: &[RawRecord], control: Option<i64>) -> Vec<u8> {
    let mut body = Vec::new(); // from attributes on: what the CRC covers
                               // Attributes: bit 4 transactional, bit 5 control.
    let attributes: i16 = if control.is_some() { 0x30 } else { 0 };
    body.extend(attributes.to_be_bytes());
    let last = records.iter().map(|r| r.delta).max().unwrap_or(0);
    body.extend(last.to_be_bytes());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    body.extend(now.to_be_bytes()); // base timestamp
    body.extend(now.to_be_bytes()); // max timestamp
    body.extend(control.unwrap_or(-1).to_be_bytes()); // producer id
    body.extend(0i16.to_be_bytes()); // producer epoch
    body.extend((-1i32).to_be_bytes()); // base sequence
    body.extend((records.len() as i32).to_be_bytes());
    for r in records {
        body.extend(record(r));
    }
    let mut batch = Vec::new();
    batch.extend(0i64.to_be_bytes()); // base offset: the broker assigns it
    batch.extend((4 + 1 + 4 + body.len() as i32).to_be_bytes()); // length
    batch.extend((-1i32).to_be_bytes()); // partition leader epoch
    batch.push(2); // magic
    batch.extend(crc32c::crc32c(&body).to_be_bytes());
    batch.extend(body);
    batch
}

fn record(r: &RawRecord) -> Vec<u8> {
    let mut rec = vec![0u8]; // attributes
    varint(&mut rec, 0); // timestamp delta
    varint(&mut rec, i64::from(r.delta));
    bytes(&mut rec, r.key.as_deref());
    bytes(&mut rec, r.value.as_deref());
    varint(&mut rec, 0); // headers
    let mut out = Vec::new();
    varint(&mut out, rec.len() as i64);
    out.extend(rec);
    out
}

/// Produce v3: the first version that carries v2 batches.
fn produce_request(topic: &str, partition: i32, batch: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend(0i16.to_be_bytes()); // api key: Produce
    m.extend(3i16.to_be_bytes()); // api version
    m.extend(1i32.to_be_bytes()); // correlation id
    string(&mut m, "testkit-raw");
    m.extend((-1i16).to_be_bytes()); // transactional id: null
    m.extend((-1i16).to_be_bytes()); // acks: all
    m.extend(30_000i32.to_be_bytes()); // timeout
    m.extend(1i32.to_be_bytes()); // one topic
    string(&mut m, topic);
    m.extend(1i32.to_be_bytes()); // one partition
    m.extend(partition.to_be_bytes());
    m.extend((batch.len() as i32).to_be_bytes());
    m.extend(batch);
    let mut framed = (m.len() as i32).to_be_bytes().to_vec();
    framed.extend(m);
    framed
}

/// The base offset from a Produce v3 response with one topic and one
/// partition; panics on an error code.
fn base_offset_of(reply: &[u8], topic: &str) -> i64 {
    // correlation id, topic count, topic name, partition count, index.
    let at = 4 + 4 + 2 + topic.len() + 4 + 4;
    let error = i16::from_be_bytes(reply[at..at + 2].try_into().unwrap());
    assert_eq!(error, 0, "the broker refused the raw batch");
    i64::from_be_bytes(reply[at + 2..at + 10].try_into().unwrap())
}

fn varint(out: &mut Vec<u8>, v: i64) {
    let mut z = ((v << 1) ^ (v >> 63)) as u64; // zigzag
    while z >= 0x80 {
        out.push((z as u8) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

fn bytes(out: &mut Vec<u8>, b: Option<&[u8]>) {
    match b {
        None => varint(out, -1),
        Some(b) => {
            varint(out, b.len() as i64);
            out.extend(b);
        }
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as i16).to_be_bytes());
    out.extend(s.as_bytes());
}
