//! Avro and Protobuf topics: each topic's payload format, the writers'
//! schemas fetched from a Confluent Schema Registry by the id in each
//! record's header, and the decoding of such a record into the trade the
//! default schema or the topic's mapping makes of its JSON form
//! (`event::avro`, `event::protobuf` write that form).
//!
//! Decoding is split in two so that the loop never waits on the network:
//! a record whose schema is in memory decodes where JSON does (the loop,
//! as its batch closes); one whose schema is not is left *missing*, and
//! the write stage fetches the schemas its batch lacks before it writes
//! ([`Formats::fetch`]), retrying with backoff while the registry is
//! unavailable. The batch, and every later one, waits meanwhile, as for a
//! MongoDB outage: nothing is committed past a record neither stored nor
//! dead-lettered. A registry that answers "no such id" or with something
//! that is no schema is a permanent fault of those records: they are
//! dead-lettered (`unknown_schema`, `invalid_schema`).
//!
//! A schema never changes under its id, so the cache holds each schema
//! until it is the least recently used one and room is needed; no entry
//! expires by age. Failures are not cached: each batch that meets an id
//! the registry did not have asks again.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lru::LruCache;

pub mod client;

pub use crate::event::wire::SchemaId;
pub use client::{Client, ClientError, FetchError, RawSchema};

use crate::event::wire;

use crate::config::{PayloadFormat, RetrySettings, Settings};
use crate::event;
use crate::event::avro::AvroSchema;
use crate::event::protobuf::ProtoSchema;
use crate::event::{Mapping, RecordParts, Reject, RejectKind, Source, Trade};
use crate::metrics::{Metrics, RegistryErrorKind};
use crate::retry::Backoff;

/// How many times `kafka.max_message_bytes` the JSON form of a binary
/// record may take: Avro and Protobuf are denser than JSON (names, quotes,
/// base64), and the bound keeps a hostile record from growing without end.
pub const JSON_EXPANSION: usize = 4;

/// A writer's schema, parsed.
#[derive(Debug)]
pub enum Schema {
    Avro(AvroSchema),
    Protobuf(ProtoSchema),
}

impl Schema {
    /// Parses what the registry holds; `Err` says why it is not a schema.
    pub fn parse(raw: &RawSchema) -> Result<Schema, String> {
        match raw.schema_type.as_str() {
            "AVRO" => {
                let refs: Vec<String> = raw.references.iter().map(|(_, t)| t.clone()).collect();
                AvroSchema::parse(&raw.text, &refs).map(Schema::Avro)
            }
            "PROTOBUF" => ProtoSchema::parse(&raw.text, &raw.references).map(Schema::Protobuf),
            other => Err(format!("a {other} schema, which no topic format reads")),
        }
    }

    fn format(&self) -> PayloadFormat {
        match self {
            Schema::Avro(_) => PayloadFormat::Avro,
            Schema::Protobuf(_) => PayloadFormat::Protobuf,
        }
    }

    /// The datum after the 5-byte header as JSON text.
    pub fn to_json(&self, data: &[u8], max_bytes: usize) -> Result<String, Reject> {
        match self {
            Schema::Avro(s) => s.to_json(data, max_bytes),
            Schema::Protobuf(s) => s.to_json(data, max_bytes),
        }
    }
}

/// `data` read by its writer's `schema`, as the JSON path reads the same
/// trade: into the default schema's fields straight from an Avro datum
/// where the schema allows ([`AvroSchema::fields`]), else into JSON text,
/// at most `limit` bytes, read by the JSON path (the mapping, the replay
/// identity, every check).
fn decode_binary(
    schema: &Schema,
    data: &[u8],
    record: RecordParts<'_>,
    mapping: Option<&Mapping>,
    source: &Source,
    limit: usize,
) -> Result<Trade, Reject> {
    if let (Schema::Avro(avro), None) = (schema, mapping) {
        if let Some(fields) = avro.fields(data, limit) {
            let fields = fields?;
            return event::with_identity(record.headers, source, |id| fields.into_trade(id));
        }
    }
    let json = schema.to_json(data, limit)?;
    let parts = RecordParts {
        payload: Some(json.as_bytes()),
        ..record
    };
    event::decode_record(parts, mapping, source, limit)
}

/// A binary payload's writer's schema, and the datum after its header.
type Datum<'p> = (Arc<Schema>, &'p [u8]);

/// What a batch's fetch found for the ids it lacked: a schema, or why the
/// records naming it are dead letters.
pub type Resolved = HashMap<SchemaId, Result<Arc<Schema>, Reject>>;

/// A record's decoding, or the schema it waits for.
#[derive(Debug)]
pub enum Decode {
    Done(Result<Trade, Reject>),
    Missing(SchemaId),
}

/// The registry's client and the schemas already fetched.
#[derive(Debug)]
struct Registry {
    client: Client,
    cache: Mutex<LruCache<SchemaId, Arc<Schema>>>,
}

/// Every source topic's format, and the registry if any topic needs one.
pub struct Formats {
    /// The non-JSON topics.
    topics: Vec<(String, PayloadFormat)>,
    registry: Option<Registry>,
    /// `None` for [`Formats::default`] (JSON only: nothing to count).
    metrics: Option<Metrics>,
}

impl std::fmt::Debug for Formats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Formats")
            .field("topics", &self.topics)
            .field("registry", &self.registry)
            .finish()
    }
}

impl Default for Formats {
    /// Every topic JSON.
    fn default() -> Self {
        Formats {
            topics: Vec::new(),
            registry: None,
            metrics: None,
        }
    }
}

impl Formats {
    /// From `[[formats]]` and `[schema_registry]` (checked when loaded).
    pub fn from_settings(settings: &Settings, metrics: Metrics) -> Result<Formats, ClientError> {
        let registry = match &settings.schema_registry {
            Some(r) => Some(Registry {
                client: Client::new(r, settings.scrubber())?,
                cache: Mutex::new(LruCache::new(
                    NonZeroUsize::new(r.cache_schemas).unwrap_or(NonZeroUsize::MIN),
                )),
            }),
            None => None,
        };
        Ok(Formats {
            topics: settings
                .formats
                .iter()
                .filter(|f| f.format.uses_registry())
                .map(|f| (f.topic.clone(), f.format))
                .collect(),
            registry,
            metrics: Some(metrics),
        })
    }

    /// `topic`'s payload format.
    pub fn format_of(&self, topic: &str) -> PayloadFormat {
        self.topics
            .iter()
            .find(|(t, _)| t == topic)
            .map_or(PayloadFormat::Json, |(_, f)| *f)
    }

    /// Decodes a record read at `source` by its topic's format: JSON as
    /// always ([`event::decode_record`]), Avro and Protobuf by their
    /// writer's schema ([`decode_binary`]). `resolved`: what the stage
    /// fetched for this batch.
    pub fn decode(
        &self,
        record: RecordParts<'_>,
        mapping: Option<&Mapping>,
        source: &Source,
        max_bytes: usize,
        resolved: Option<&Resolved>,
    ) -> Decode {
        let format = self.format_of(&source.topic);
        if format == PayloadFormat::Json {
            return Decode::Done(event::decode_record(record, mapping, source, max_bytes));
        }
        let (schema, data) = match self.writer_schema(format, record.payload, max_bytes, resolved) {
            Ok(Some(found)) => found,
            Ok(None) => {
                // No payload: rejected as for JSON (`empty`).
                return Decode::Done(event::decode_record(record, mapping, source, max_bytes));
            }
            Err(Err(id)) => return Decode::Missing(id),
            Err(Ok(reject)) => return Decode::Done(Err(reject)),
        };
        let limit = max_bytes.saturating_mul(JSON_EXPANSION);
        Decode::Done(decode_binary(&schema, data, record, mapping, source, limit))
    }

    /// A binary payload's writer's schema and its datum; `Ok(None)`
    /// without a payload. The error is a rejection, or the id of a schema
    /// not in memory.
    fn writer_schema<'p>(
        &self,
        format: PayloadFormat,
        payload: Option<&'p [u8]>,
        max_bytes: usize,
        resolved: Option<&Resolved>,
    ) -> Result<Option<Datum<'p>>, Result<Reject, SchemaId>> {
        let payload = match payload {
            None | Some([]) => return Ok(None),
            Some(p) => p,
        };
        event::check_payload_len(payload.len(), max_bytes).map_err(Ok)?;
        let (id, data) = wire::split(payload)
            .map_err(|e| Ok(Reject::new(RejectKind::InvalidFormat, e.to_string())))?;
        let schema = match self.cached(id) {
            Some(s) => s,
            None => match resolved.and_then(|r| r.get(&id)) {
                Some(Ok(s)) => s.clone(),
                Some(Err(reject)) => return Err(Ok(reject.clone())),
                None => return Err(Err(id)),
            },
        };
        if schema.format() != format {
            return Err(Ok(Reject::new(
                RejectKind::InvalidSchema,
                format!(
                    "schema id {id} is a {} schema, and this topic's format is {}",
                    schema.format().as_str(),
                    format.as_str()
                ),
            )));
        }
        Ok(Some((schema, data)))
    }

    /// The schema `id` if it is in memory (counted as a cache hit).
    fn cached(&self, id: SchemaId) -> Option<Arc<Schema>> {
        let registry = self.registry.as_ref()?;
        let found = registry.cache.lock().ok()?.get(&id).cloned();
        if let (Some(_), Some(m)) = (&found, &self.metrics) {
            m.schema_cache_hits.inc();
        }
        found
    }

    /// Puts `schema` in memory under `id`, as a fetch would have; `false`
    /// without a registry (nothing is read through one). For a caller that
    /// holds the writer's schema already: the hot-path bench measures the
    /// decode with no network on the way.
    pub fn remember(&self, id: SchemaId, schema: Schema) -> bool {
        let Some(registry) = &self.registry else {
            return false;
        };
        match registry.cache.lock() {
            Ok(mut cache) => {
                cache.put(id, Arc::new(schema));
                true
            }
            Err(_) => false,
        }
    }

    /// Fetches the schemas `ids` that are not in memory. `Err` says why
    /// the registry is unavailable: the caller retries the whole fetch
    /// later (what was fetched meanwhile is cached). An id the registry
    /// answers for with no schema is resolved to the rejection of the
    /// records that name it.
    pub async fn fetch(&self, ids: &[SchemaId]) -> Result<Resolved, String> {
        let mut resolved = Resolved::new();
        for &id in ids {
            if resolved.contains_key(&id) {
                continue;
            }
            if let Some(s) = self.cached(id) {
                resolved.insert(id, Ok(s));
                continue;
            }
            resolved.insert(id, self.fetch_one(id).await?);
        }
        Ok(resolved)
    }

    async fn fetch_one(&self, id: SchemaId) -> Result<Result<Arc<Schema>, Reject>, String> {
        let Some(registry) = &self.registry else {
            // Formats without a registry have no binary topics; kept total.
            return Err("no schema_registry is configured".into());
        };
        let fetched = || self.count(|m| m.schema_fetches.inc());
        let error = |kind| self.count(|m| m.registry_error(kind).inc());
        let raw = match registry.client.schema(id).await {
            Ok(raw) => raw,
            Err(FetchError::Unavailable(why)) => {
                error(RegistryErrorKind::Unavailable);
                return Err(why);
            }
            Err(e @ FetchError::NotFound(_)) => {
                fetched();
                error(RegistryErrorKind::NotFound);
                return Ok(Err(Reject::new(RejectKind::UnknownSchema, e.to_string())));
            }
            Err(e @ FetchError::Invalid { .. }) => {
                fetched();
                error(RegistryErrorKind::InvalidSchema);
                return Ok(Err(Reject::new(RejectKind::InvalidSchema, e.to_string())));
            }
        };
        fetched();
        match Schema::parse(&raw) {
            Ok(schema) => {
                let schema = Arc::new(schema);
                if let Ok(mut cache) = registry.cache.lock() {
                    cache.put(id, schema.clone());
                }
                Ok(Ok(schema))
            }
            Err(why) => {
                error(RegistryErrorKind::InvalidSchema);
                Ok(Err(Reject::new(
                    RejectKind::InvalidSchema,
                    format!("schema id {id} is not a valid schema: {why}"),
                )))
            }
        }
    }

    fn count(&self, f: impl FnOnce(&Metrics)) {
        if let Some(m) = &self.metrics {
            f(m);
        }
    }

    /// Whether any topic is read through the registry.
    pub fn uses_registry(&self) -> bool {
        !self.topics.is_empty()
    }

    /// Decodes a record for a command (`reconcile`, `dlq replay
    /// --dry-run`, `map --sample`), which has no stage to wait in: a
    /// schema not in memory is fetched there and then, retried with
    /// `retry`'s backoff while the registry is unavailable, for at most
    /// `patience`. After that the command fails ([`Unavailable`]) rather
    /// than call a record bad for the registry's sake.
    pub async fn decode_now(
        &self,
        record: RecordParts<'_>,
        mapping: Option<&Mapping>,
        source: &Source,
        max_bytes: usize,
        (retry, patience): (&RetrySettings, Duration),
    ) -> Result<Result<Trade, Reject>, Unavailable> {
        let id = match self.decode(record, mapping, source, max_bytes, None) {
            Decode::Done(r) => return Ok(r),
            Decode::Missing(id) => id,
        };
        let deadline = tokio::time::Instant::now() + patience;
        let mut backoff = Backoff::new(retry);
        let resolved = loop {
            match self.fetch(&[id]).await {
                Ok(r) => break r,
                Err(why) if tokio::time::Instant::now() >= deadline => {
                    return Err(Unavailable(why))
                }
                Err(_) => tokio::time::sleep(backoff.next_wait()).await,
            }
        };
        Ok(
            match self.decode(record, mapping, source, max_bytes, Some(&resolved)) {
                Decode::Done(r) => r,
                // `fetch` resolved the id; kept total all the same.
                Decode::Missing(id) => Err(Reject::new(
                    RejectKind::InvalidSchema,
                    format!("schema id {id} could not be resolved"),
                )),
            },
        )
    }
}

/// A command gave up waiting for the Schema Registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Schema Registry unavailable: {0}")]
pub struct Unavailable(pub String);

/// The schema id a binary record names, if its header is readable.
pub fn schema_id_of(payload: Option<&[u8]>) -> Option<SchemaId> {
    wire::split(payload?).ok().map(|(id, _)| id)
}
