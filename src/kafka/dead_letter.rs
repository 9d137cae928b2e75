//! Dead-letter records: the original record's key, payload and headers,
//! plus ours (what was wrong, and where the record came from). A record
//! too large for the dead-letter topic is sent shortened, so a bad event is
//! always recorded and never blocks its partition.

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::OwnedHeaders;
use rdkafka::types::RDKafkaErrorCode;
use sha2::{Digest, Sha256};

use super::acked::AckedProducer;
use super::headers::{self, Header};
use super::{
    H_ERROR_KIND, H_ERROR_MESSAGE, H_PAYLOAD_LENGTH, H_PAYLOAD_SHA256, H_SHORTENED,
    H_SOURCE_OFFSET, H_SOURCE_PARTITION, H_SOURCE_TOPIC,
};
use crate::event::{position_text, replay_origin, Reject, Source, H_REPLAY_OF};

/// How much of the payload, and of the key, a shortened dead letter keeps.
const KEPT_BYTES: usize = 1024;

/// One event bound for the dead-letter topic.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// Where the bad record was read.
    pub source: Source,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// The original record's headers, as bytes.
    pub headers: Vec<Header>,
    pub reject: Reject,
    /// Set when this is the shortened form (see [`DeadLetter::shortened`]).
    pub shortened: Option<Shortened>,
}

/// What a shortened dead letter says of its original, in its headers.
#[derive(Debug, Clone)]
pub struct Shortened {
    /// What was left out ([`H_SHORTENED`]).
    pub note: String,
    /// The original payload's length ([`H_PAYLOAD_LENGTH`]).
    pub payload_length: usize,
    /// The original payload's SHA-256, hex ([`H_PAYLOAD_SHA256`]).
    pub payload_sha256: String,
}

impl DeadLetter {
    /// Whether `e` is a refusal of the record for its size (by the
    /// producer's own `message.max.bytes` or by the broker's limit): the
    /// same record will never fit, so waiting for it would hold the
    /// partition forever.
    pub fn is_size_refusal(e: &KafkaError) -> bool {
        matches!(
            e,
            KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)
        )
    }

    /// This dead letter without its bulk: the first bytes of payload and
    /// key, no original headers, and headers saying what was left out and
    /// how to match the original (its length and SHA-256).
    pub fn shortened(&self) -> DeadLetter {
        let payload = self.payload.as_deref().unwrap_or_default();
        let digest: String = Sha256::digest(payload)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let cut = |b: &Option<Vec<u8>>| b.as_ref().map(|v| v[..v.len().min(KEPT_BYTES)].to_vec());
        let note = format!(
            "too large for the dead-letter topic: payload and key cut to their first {KEPT_BYTES} bytes, {} original headers left out",
            self.headers.len()
        );
        DeadLetter {
            key: cut(&self.key),
            payload: cut(&self.payload),
            headers: Vec::new(),
            shortened: Some(Shortened {
                note,
                payload_length: payload.len(),
                payload_sha256: digest,
            }),
            ..self.clone()
        }
    }
}

/// Sends one dead letter and waits for the broker's acknowledgement;
/// `queue_timeout` bounds the wait for room in librdkafka's local queue.
pub async fn send_dead_letter(
    producer: &AckedProducer,
    dlq_topic: &str,
    dl: &DeadLetter,
    queue_timeout: Duration,
) -> Result<(), rdkafka::error::KafkaError> {
    let (key, payload) = (dl.key.as_deref(), dl.payload.as_deref());
    let headers = dead_letter_headers(dl);
    producer
        .send(dlq_topic, key, payload, headers, queue_timeout)
        .await
}

/// The names of the headers tradebucket writes on a dead letter all start
/// with this; nobody else's may.
pub const OUR_HEADER_PREFIX: &[u8] = b"tradebucket.";

/// The original record's headers, then ours. An inbound header in our
/// namespace is left out: a producer could otherwise forge the error kind
/// or the provenance a consumer of the dead letters trusts (and a header
/// list can hold one name twice, so ours would not simply win).
fn dead_letter_headers(dl: &DeadLetter) -> OwnedHeaders {
    let mut out = OwnedHeaders::new_with_capacity(dl.headers.len() + 5);
    for (name, value) in &dl.headers {
        if !name.starts_with(OUR_HEADER_PREFIX) {
            headers::add(&mut out, name, value.as_deref());
        }
    }
    let partition = dl.source.partition.to_string();
    let offset = dl.source.offset.to_string();
    // A replayed event keeps its first position's identity through every
    // later dead letter; only a well-formed one is carried on (a malformed
    // one is why this record is here).
    if let Ok(Some(origin)) = replay_origin(&dl.headers) {
        let text = position_text(&origin);
        headers::add(&mut out, H_REPLAY_OF.as_bytes(), Some(text.as_bytes()));
    }
    for (name, value) in [
        (H_ERROR_KIND, dl.reject.kind.as_str()),
        (H_ERROR_MESSAGE, dl.reject.message.as_str()),
        (H_SOURCE_TOPIC, &*dl.source.topic),
        (H_SOURCE_PARTITION, partition.as_str()),
        (H_SOURCE_OFFSET, offset.as_str()),
    ] {
        headers::add(&mut out, name.as_bytes(), Some(value.as_bytes()));
    }
    if let Some(short) = &dl.shortened {
        let length = short.payload_length.to_string();
        for (name, value) in [
            (H_SHORTENED, short.note.as_str()),
            (H_PAYLOAD_LENGTH, length.as_str()),
            (H_PAYLOAD_SHA256, short.payload_sha256.as_str()),
        ] {
            headers::add(&mut out, name.as_bytes(), Some(value.as_bytes()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbound_headers_cannot_forge_ours_and_any_bytes_are_kept() {
        use crate::event::RejectKind;
        let dl = DeadLetter {
            source: Source {
                topic: "trades".into(),
                partition: 3,
                offset: 41,
            },
            key: None,
            payload: None,
            headers: vec![
                (b"trace-id".to_vec(), Some(b"abc".to_vec())),
                (vec![0xff, 0x00], Some(vec![0xfe])),
                (H_ERROR_KIND.as_bytes().to_vec(), Some(b"forged".to_vec())),
                (H_SOURCE_OFFSET.as_bytes().to_vec(), Some(b"0".to_vec())),
            ],
            reject: Reject::new(RejectKind::NotJson, "bad"),
            shortened: None,
        };
        let out = headers::read(Some(dead_letter_headers(&dl).as_borrowed()));
        let text = |n: &str| -> Vec<Vec<u8>> {
            out.iter()
                .filter(|(k, _)| k == n.as_bytes())
                .filter_map(|(_, v)| v.clone())
                .collect()
        };
        assert_eq!(text(H_ERROR_KIND), vec![b"not_json".to_vec()]);
        assert_eq!(text(H_SOURCE_OFFSET), vec![b"41".to_vec()]);
        assert_eq!(text("trace-id"), vec![b"abc".to_vec()]);
        // A NUL in a name: librdkafka's API cuts it there (see `headers`).
        assert!(out.contains(&(vec![0xff], Some(vec![0xfe]))), "{out:?}");
    }

    #[test]
    fn a_valid_replay_identity_is_carried_on_and_a_malformed_one_dropped() {
        use crate::event::RejectKind;
        let ours = |replay_of: &[u8]| {
            let dl = DeadLetter {
                source: Source {
                    topic: "trades".into(),
                    partition: 0,
                    offset: 900,
                },
                key: None,
                payload: None,
                headers: vec![(H_REPLAY_OF.as_bytes().to_vec(), Some(replay_of.to_vec()))],
                reject: Reject::new(RejectKind::InvalidField, "bad"),
                shortened: None,
            };
            headers::read(Some(dead_letter_headers(&dl).as_borrowed()))
                .into_iter()
                .filter(|(n, _)| n == H_REPLAY_OF.as_bytes())
                .filter_map(|(_, v)| v)
                .collect::<Vec<_>>()
        };
        assert_eq!(ours(b"trades/1/41"), vec![b"trades/1/41".to_vec()]);
        assert!(ours(b"trades/1/041").is_empty());
        assert!(ours(b"forged").is_empty());
    }

    #[test]
    fn a_shortened_dead_letter_keeps_provenance_and_a_digest() {
        use crate::event::RejectKind;
        let dl = DeadLetter {
            source: Source {
                topic: "trades".into(),
                partition: 1,
                offset: 7,
            },
            key: Some(vec![b'k'; 5000]),
            payload: Some(b"abc".repeat(1_000_000)),
            headers: vec![(b"big".to_vec(), Some(vec![0; 100_000]))],
            reject: Reject::new(RejectKind::Oversize, "too big"),
            shortened: None,
        };
        let short = dl.shortened();
        assert_eq!(short.payload.as_ref().map(Vec::len), Some(KEPT_BYTES));
        assert_eq!(short.key.as_ref().map(Vec::len), Some(KEPT_BYTES));
        assert!(short.headers.is_empty());
        let out = headers::read(Some(dead_letter_headers(&short).as_borrowed()));
        let value = |n: &str| {
            out.iter()
                .find(|(k, _)| k == n.as_bytes())
                .and_then(|(_, v)| v.clone())
                .map(|v| String::from_utf8(v).unwrap())
        };
        assert_eq!(value(H_PAYLOAD_LENGTH).as_deref(), Some("3000000"));
        // sha256 of "abc" x 1,000,000, as `sha256sum` prints it.
        assert_eq!(value(H_PAYLOAD_SHA256).map(|d| d.len()), Some(64));
        assert_eq!(value(H_SOURCE_OFFSET).as_deref(), Some("7"));
        assert_eq!(value(H_ERROR_KIND).as_deref(), Some("oversize"));
        assert!(value(H_SHORTENED).unwrap().contains("1 original headers"));
    }
}
