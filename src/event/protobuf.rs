//! Protobuf records (Confluent wire format) read into the JSON text the
//! default schema and the mappings read, by the canonical proto3 JSON
//! mapping (prost-reflect's): fields under their JSON names
//! (`customer_id` is `customerId`, the default schema's name), a
//! `google.protobuf.Timestamp` as RFC 3339 text in UTC (the date), enums
//! by name, bytes as base64.
//!
//! A proto3 field without presence always has a value: unset, it is its
//! default (0, `false`, the enum's first value, `""`), which the bytes
//! cannot tell from the same value set. Such fields are written, as the
//! mapping's `always_print_fields_with_no_presence` option writes them:
//! left out, a `Side` whose 0 is `buy` would make every buy a trade
//! without `type`, a dead letter. Fields with presence (`optional`,
//! messages such as the Timestamp, wrappers, oneofs) are written only when
//! set, so a trade field that may be absent (`price`, `currency`) is
//! declared `optional`: a plain `string price` left unset is `""`, which
//! the trade refuses as it would from JSON.
//!
//! Two choices differ from the mapping's defaults, so that the trade is
//! the one a JSON upstream's would be: 64-bit integers are written as
//! numbers, not strings (an `int64 trade_id` is stored as an integer id,
//! as `"tradeId": 7` is), and money written as a decimal string
//! (`"61.25"`) stays that text, read exactly into Decimal128 like any
//! number given as a string.
//!
//! The schema is what the registry holds under the record's id: `.proto`
//! text (compiled by protox, in memory, with its references and the
//! well-known types), or a base64 `FileDescriptorProto` (what some
//! serializers register). The record's message indexes pick the message.

use std::collections::HashMap;

use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

use super::wire;
use super::{Reject, RejectKind};

/// A file's schema, compiled, with what it imports.
#[derive(Debug)]
pub struct ProtoSchema {
    pool: DescriptorPool,
    /// The registered file's name in `pool`.
    file: String,
}

/// The registered files by import name: the schema's own under a name of
/// ours, its references under theirs.
struct Files(HashMap<String, String>);

impl FileResolver for Files {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        let Some(text) = self.0.get(name) else {
            return Err(protox::Error::file_not_found(name));
        };
        match descriptor_bytes(text) {
            Some(bytes) => {
                let mut proto =
                    <prost_types::FileDescriptorProto as prost::Message>::decode(bytes.as_slice())
                        .map_err(|e| protox::Error::new(format!("{name}: {e}")))?;
                // Imported under the name asked for, whatever it was
                // registered as (the schema's own is ours).
                proto.name = Some(name.to_string());
                Ok(File::from_file_descriptor_proto(proto))
            }
            None => File::from_source(name, text),
        }
    }
}

/// A base64 `FileDescriptorProto`, if `text` is one. `.proto` text always
/// has spaces or `;`, which base64 never does.
fn descriptor_bytes(text: &str) -> Option<Vec<u8>> {
    let t = text.trim();
    if t.is_empty() || t.bytes().any(|b| b.is_ascii_whitespace() || b == b';') {
        return None;
    }
    base64_decode(t)
}

impl ProtoSchema {
    /// Compiles the registry's schema `text`; `references` are the
    /// (import name, text) of the files it imports, transitively.
    pub fn parse(text: &str, references: &[(String, String)]) -> Result<ProtoSchema, String> {
        const ROOT: &str = "tradebucket-registered-schema.proto";
        let mut files: HashMap<String, String> = references.iter().cloned().collect();
        files.insert(ROOT.to_string(), text.to_string());
        let mut chain = ChainFileResolver::new();
        chain.add(Files(files));
        // The well-known types (google/protobuf/timestamp.proto, ...),
        // which serializers may leave out of the references.
        chain.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(chain);
        compiler.include_imports(true);
        compiler.open_file(ROOT).map_err(|e| e.to_string())?;
        let pool = compiler.descriptor_pool();
        if pool
            .get_file_by_name(ROOT)
            .is_none_or(|f| f.messages().len() == 0)
        {
            return Err("the schema defines no message".into());
        }
        Ok(ProtoSchema {
            pool,
            file: ROOT.to_string(),
        })
    }

    /// The message the indexes name: the file's i-th message, then its
    /// j-th nested message, and so on.
    fn message(&self, indexes: &[usize]) -> Option<MessageDescriptor> {
        let file = self.pool.get_file_by_name(&self.file)?;
        let (first, rest) = indexes.split_first()?;
        let mut message = file.messages().nth(*first)?;
        for &i in rest {
            let child = message.child_messages().nth(i)?;
            message = child;
        }
        Some(message)
    }

    /// The payload after the 5-byte header (message indexes, then the
    /// message) as JSON text, at most `max_bytes` long.
    pub fn to_json(&self, data: &[u8], max_bytes: usize) -> Result<String, Reject> {
        let invalid = |m: String| Reject::new(RejectKind::InvalidFormat, m);
        let (indexes, body) = wire::message_indexes(data).map_err(|e| invalid(e.to_string()))?;
        let desc = self.message(&indexes).ok_or_else(|| {
            invalid(format!(
                "message indexes {indexes:?} name no message of the schema"
            ))
        })?;
        let message = DynamicMessage::decode(desc.clone(), body)
            .map_err(|e| invalid(format!("not a Protobuf {} ({e})", desc.full_name())))?;
        let options = SerializeOptions::new()
            .stringify_64_bit_integers(false)
            .skip_default_fields(false);
        let mut out = serde_json::Serializer::new(Vec::with_capacity(body.len() * 2));
        message
            .serialize_with_options(&mut out, &options)
            .map_err(|e| invalid(format!("cannot be written as JSON ({e})")))?;
        let text = String::from_utf8(out.into_inner())
            .map_err(|e| invalid(format!("cannot be written as JSON ({e})")))?;
        if text.len() > max_bytes {
            return Err(Reject::new(
                RejectKind::Oversize,
                format!(
                    "the decoded record is {} bytes, over {max_bytes}",
                    text.len()
                ),
            ));
        }
        Ok(text)
    }
}

/// Standard base64 (padding optional); `None` for anything else.
pub(crate) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for b in text.bytes() {
        let v = match b {
            b'A'..=b'Z' => b - b'A',
            b'a'..=b'z' => b - b'a' + 26,
            b'0'..=b'9' => b - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests;
