//! What `tradebucket map --sample` prints for one payload: the trade as it
//! would be stored (its customer and its history entry, in MongoDB's
//! relaxed Extended JSON, so a Decimal128 shows as one), or the dead
//! letter it would be. Pure, so the command and its tests share it.

use mongodb::bson::Bson;
use serde_json::json;

use super::mapping::{decode_mapped, Mapping, RecordParts};
use super::*;

/// The outcome of decoding `record` read at `source`, as one JSON object:
/// `{"customerId": .., "entry": {..}}` or `{"deadLetter": {"kind", "message"}}`.
pub fn sample(
    mapping: Option<&Mapping>,
    record: RecordParts<'_>,
    source: &Source,
    max_bytes: usize,
) -> serde_json::Value {
    let decoded = decode_mapped(mapping, record, Identity::Read(source), max_bytes);
    sample_of(decoded)
}

/// What [`sample`] prints for a record already decoded (an Avro or
/// Protobuf one, through `registry::Formats`).
pub fn sample_of(decoded: Result<Trade, Reject>) -> serde_json::Value {
    match decoded.and_then(|t| {
        let entry = t.entry().map_err(|e| {
            Reject::new(
                RejectKind::Rejected,
                format!("the entry does not read back: {e}"),
            )
        })?;
        Ok((t.customer, entry))
    }) {
        Ok((customer, entry)) => json!({
            "customerId": customer.to_bson().into_relaxed_extjson(),
            "entry": Bson::Document(entry).into_relaxed_extjson(),
        }),
        Err(r) => json!({
            "deadLetter": { "kind": r.kind.as_str(), "message": r.message },
        }),
    }
}
