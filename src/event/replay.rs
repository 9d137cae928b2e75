//! A replayed dead letter's identity, and decoding a record as the worker
//! does: by its topic's mapping, under its original position if it is a
//! replay (docs/design.md, "Replayed dead letters").

use super::mapping::{decode_mapped, Mapping, RecordParts};
use super::{Identity, Reject, RejectKind, Source, Trade};

/// The original position of a replayed dead letter, `<topic>/<partition>/<offset>`:
/// `tradebucket dlq replay` sets it, the worker takes a trade without
/// `tradeId` to be `r:<that position>` (never an `o:` or `t:` key, so a
/// forged one cannot touch a normally consumed trade), and a dead letter of
/// a replayed event carries it on, so a later replay is the same trade.
pub const H_REPLAY_OF: &str = "tradebucket.replay.of";

/// The replay identity in `headers`: `None` without [`H_REPLAY_OF`], an
/// `invalid_field` rejection for a malformed one (twice, null, not
/// UTF-8, not `<legal topic>/<partition>/<offset>` in canonical decimals),
/// so a replay whose identity is lost is dead-lettered, not stored under a
/// new one (which a second replay would store again).
pub fn replay_origin(headers: &[(Vec<u8>, Option<Vec<u8>>)]) -> Result<Option<Source>, Reject> {
    let mut found = headers
        .iter()
        .filter(|(name, _)| name == H_REPLAY_OF.as_bytes());
    let Some((_, value)) = found.next() else {
        return Ok(None);
    };
    let bad = |why: &str| {
        Reject::new(
            RejectKind::InvalidField,
            format!("header {H_REPLAY_OF}: {why}"),
        )
    };
    if found.next().is_some() {
        return Err(bad("appears more than once"));
    }
    let value = value.as_deref().ok_or_else(|| bad("is null"))?;
    let text = std::str::from_utf8(value).map_err(|_| bad("is not UTF-8"))?;
    parse_position(text)
        .map(Some)
        .ok_or_else(|| bad("is not <topic>/<partition>/<offset>"))
}

/// Decodes a record read at `source` by the worker's rules: by its topic's
/// `mapping` if it has one, else by the default schema; a replayed dead
/// letter (header [`H_REPLAY_OF`]) keeps its original identity, `source`
/// stays where it was read. What the worker and `reconcile` both decode by.
pub fn decode_record(
    record: RecordParts<'_>,
    mapping: Option<&Mapping>,
    source: &Source,
    max_bytes: usize,
) -> Result<Trade, Reject> {
    with_identity(record.headers, source, |identity| {
        decode_mapped(mapping, record, identity, max_bytes)
    })
}

/// `decode` under the identity of a record read at `source` with
/// `headers`: its original position if it is a replay, else `source`. A
/// malformed replay header is the record's rejection, before `decode`.
pub fn with_identity<T>(
    headers: &[(Vec<u8>, Option<Vec<u8>>)],
    source: &Source,
    decode: impl FnOnce(Identity<'_>) -> Result<T, Reject>,
) -> Result<T, Reject> {
    let origin = replay_origin(headers)?;
    decode(
        origin
            .as_ref()
            .map_or(Identity::Read(source), Identity::ReplayOf),
    )
}

/// `<topic>/<partition>/<offset>`: a legal topic name (which has no `/`),
/// and two non-negative decimals without sign or leading zeros, so each
/// position has exactly one spelling.
fn parse_position(text: &str) -> Option<Source> {
    let mut parts = text.split('/');
    let (topic, partition, offset) = (parts.next()?, parts.next()?, parts.next()?);
    let topic_ok = crate::config::legal_topic(topic);
    let canonical = |n: &str| {
        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && (n == "0" || !n.starts_with('0'))
    };
    if parts.next().is_some() || !topic_ok || !canonical(partition) || !canonical(offset) {
        return None;
    }
    Some(Source {
        topic: topic.into(),
        partition: partition.parse().ok()?,
        offset: offset.parse().ok()?,
    })
}

/// How [`H_REPLAY_OF`] spells `origin`.
pub fn position_text(origin: &Source) -> String {
    format!("{}/{}/{}", origin.topic, origin.partition, origin.offset)
}
