//! The payload format of each source topic (`[[formats]]`) and the Schema
//! Registry that Avro and Protobuf topics are read through
//! (`[schema_registry]`). A topic not listed is JSON, as before.
//!
//! One registry per deployment: the Confluent wire format names a schema
//! by a number that only means something in one registry, and upstreams
//! that share topics share their registry.

use std::path::PathBuf;
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use super::validate::invalid;
use super::{ConfigError, Settings};

/// How a topic's payloads are encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PayloadFormat {
    /// UTF-8 JSON, read by the default schema or the topic's mapping.
    #[default]
    Json,
    /// Confluent wire format: magic byte 0, schema id, Avro binary datum.
    Avro,
    /// Confluent wire format: magic byte 0, schema id, message indexes,
    /// Protobuf binary message.
    Protobuf,
}

impl PayloadFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            PayloadFormat::Json => "json",
            PayloadFormat::Avro => "avro",
            PayloadFormat::Protobuf => "protobuf",
        }
    }

    /// Whether records of this format name a schema in the registry.
    pub fn uses_registry(self) -> bool {
        self != PayloadFormat::Json
    }
}

/// One `[[formats]]` entry.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicFormat {
    /// A source topic (one of `kafka.topics`).
    pub topic: String,
    /// Its payloads' encoding.
    pub format: PayloadFormat,
}

/// `[schema_registry]`: where Avro and Protobuf schemas are fetched by id.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrySettings {
    /// Base URL, `http://` or `https://`, without credentials (they have
    /// settings of their own, so they are never printed with the URL).
    pub url: String,
    /// HTTP basic authentication (Confluent Cloud: the API key).
    #[serde(default)]
    pub username: Option<String>,
    /// Its password (Confluent Cloud: the API secret). Secret.
    #[serde(default, serialize_with = "serialize_secret")]
    pub password: Option<SecretString>,
    /// A bearer token (OAuth), sent as `Authorization: Bearer`. Secret.
    #[serde(default, serialize_with = "serialize_secret")]
    pub bearer_token: Option<SecretString>,
    /// PEM file of the CA certificates that sign the registry's
    /// certificate, instead of the bundled web PKI roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM file of a client certificate followed by its private key, for a
    /// registry that asks for mutual TLS.
    #[serde(default)]
    pub client_identity_file: Option<PathBuf>,
    /// Time limit of one request to the registry; an expired one is a
    /// transient failure, retried with backoff while the partition waits.
    #[serde(default = "default_request_timeout", with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Schemas kept in memory, least recently used evicted first. A schema
    /// never changes under its id, so none expires by age.
    #[serde(default = "default_cache_schemas")]
    pub cache_schemas: usize,
}

fn default_request_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_cache_schemas() -> usize {
    1000
}

fn serialize_secret<S: serde::Serializer>(
    secret: &Option<SecretString>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match secret {
        Some(_) => s.serialize_some(super::REDACTED),
        None => s.serialize_none(),
    }
}

impl RegistrySettings {
    /// The secrets, for [`super::Scrubber`].
    pub fn secrets(&self) -> impl Iterator<Item = &SecretString> {
        self.password.iter().chain(self.bearer_token.iter())
    }

    fn validate(&self, timeout_bound: Duration) -> Result<(), ConfigError> {
        let url = self.url.trim();
        let Some(rest) = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"))
        else {
            return Err(invalid(
                "schema_registry.url",
                "must start with http:// or https://",
            ));
        };
        let authority = rest.split('/').next().unwrap_or("");
        if authority.is_empty() {
            return Err(invalid("schema_registry.url", "has no host"));
        }
        if authority.contains('@') {
            return Err(invalid(
                "schema_registry.url",
                "must not carry credentials: set schema_registry.username and password",
            ));
        }
        if self.password.is_some() != self.username.is_some() {
            return Err(invalid(
                "schema_registry.username",
                "username and password go together",
            ));
        }
        if self.password.is_some() && self.bearer_token.is_some() {
            return Err(invalid(
                "schema_registry.bearer_token",
                "set basic authentication or a bearer token, not both",
            ));
        }
        if self
            .bearer_token
            .as_ref()
            .is_some_and(|t| t.expose_secret().is_empty())
        {
            return Err(invalid("schema_registry.bearer_token", "must not be empty"));
        }
        if self.cache_schemas == 0 {
            return Err(invalid("schema_registry.cache_schemas", "must be positive"));
        }
        // A fetch blocks the write stage, not the loop, but a request
        // longer than the liveness bound would look like a wedge in logs.
        if self.request_timeout.is_zero() || self.request_timeout >= timeout_bound {
            return Err(invalid(
                "schema_registry.request_timeout",
                format!("must be positive and below timeouts.liveness_stall ({timeout_bound:?})"),
            ));
        }
        Ok(())
    }
}

impl Settings {
    /// The format of `topic`'s payloads.
    pub fn format_of(&self, topic: &str) -> PayloadFormat {
        self.formats
            .iter()
            .find(|f| f.topic == topic)
            .map_or(PayloadFormat::Json, |f| f.format)
    }

    /// `[[formats]]` and `[schema_registry]`: each entry names a source
    /// topic once, and a registry is configured when any topic needs one.
    pub(super) fn validate_formats(&self) -> Result<(), ConfigError> {
        for (i, f) in self.formats.iter().enumerate() {
            if !self.kafka.topics.contains(&f.topic) {
                return Err(invalid(
                    "formats",
                    format!("topic {:?} is not one of kafka.topics", f.topic),
                ));
            }
            if self.formats[..i].iter().any(|g| g.topic == f.topic) {
                return Err(invalid(
                    "formats",
                    format!("topic {:?} is listed twice", f.topic),
                ));
            }
        }
        let needed = self.formats.iter().find(|f| f.format.uses_registry());
        match (&self.schema_registry, needed) {
            (Some(r), _) => r.validate(self.timeouts.liveness_stall),
            (None, Some(f)) => Err(invalid(
                "schema_registry.url",
                format!(
                    "topic {:?} is {}: set [schema_registry] url",
                    f.topic,
                    f.format.as_str()
                ),
            )),
            (None, None) => Ok(()),
        }
    }
}
