//! The Schema Registry's REST API, the part a reader needs: a schema by id
//! (`GET /schemas/ids/{id}`) and the schemas it references
//! (`GET /subjects/{subject}/versions/{version}`). Each answer is sorted
//! into what it means for the records that wait on it: the schema, a
//! permanent "no such schema" (404), a permanent "not a schema", or a
//! transient failure (no answer, a time limit, a 5xx, 429, or a refusal
//! of our credentials, which the operator fixes without the records being
//! at fault).

use std::time::Duration;

use reqwest::StatusCode;
use secrecy::ExposeSecret;
use serde::Deserialize;

use crate::config::{RegistrySettings, Scrubber};
use crate::event::wire::SchemaId;

/// Deepest chain of references followed; a cycle or a deeper chain is
/// not a schema this worker reads.
const MAX_REFERENCE_DEPTH: usize = 16;

/// Why a schema could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// The registry says the id does not exist.
    #[error("schema id {0} does not exist in the registry")]
    NotFound(SchemaId),
    /// The registry answered, but not with a schema this worker reads.
    #[error("schema id {id}: {why}")]
    Invalid { id: SchemaId, why: String },
    /// No usable answer now; asking again later may work.
    #[error("{0}")]
    Unavailable(String),
}

/// What the registry holds under an id: its type, text and references'
/// texts (each by the name the schema imports it under), dependencies
/// first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSchema {
    /// `AVRO`, `PROTOBUF` or `JSON`; the registry leaves it out for Avro.
    pub schema_type: String,
    pub text: String,
    pub references: Vec<(String, String)>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaAnswer {
    schema: String,
    #[serde(default)]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<Reference>,
}

#[derive(Debug, Clone, Deserialize)]
struct Reference {
    name: String,
    subject: String,
    version: i64,
}

/// An HTTP client of one registry.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    auth: Auth,
    scrubber: Scrubber,
}

#[derive(Debug, Clone)]
enum Auth {
    None,
    Basic(String, secrecy::SecretString),
    Bearer(secrecy::SecretString),
}

/// The client could not be built (a TLS file unreadable or invalid).
#[derive(Debug, thiserror::Error)]
#[error("Schema Registry client: {0}")]
pub struct ClientError(String);

impl Client {
    pub fn new(settings: &RegistrySettings, scrubber: Scrubber) -> Result<Client, ClientError> {
        let mut builder = reqwest::Client::builder()
            .timeout(settings.request_timeout)
            .connect_timeout(settings.request_timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("tradebucket/", env!("CARGO_PKG_VERSION")));
        if let Some(path) = &settings.ca_file {
            let pem = read(path)?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| ClientError(format!("{}: {e}", path.display())))?;
            builder = certs
                .into_iter()
                .fold(builder.tls_built_in_root_certs(false), |b, c| {
                    b.add_root_certificate(c)
                });
        }
        if let Some(path) = &settings.client_identity_file {
            let identity = reqwest::Identity::from_pem(&read(path)?)
                .map_err(|e| ClientError(format!("{}: {e}", path.display())))?;
            builder = builder.identity(identity);
        }
        let http = builder.build().map_err(|e| ClientError(e.to_string()))?;
        let auth = match (
            &settings.username,
            &settings.password,
            &settings.bearer_token,
        ) {
            (Some(u), Some(p), _) => Auth::Basic(u.clone(), p.clone()),
            (_, _, Some(t)) => Auth::Bearer(t.clone()),
            _ => Auth::None,
        };
        Ok(Client {
            http,
            base: settings.url.trim().trim_end_matches('/').to_string(),
            auth,
            scrubber,
        })
    }

    /// The schema registered under `id`, with its references resolved.
    pub async fn schema(&self, id: SchemaId) -> Result<RawSchema, FetchError> {
        let answer = match self
            .get(&format!("/schemas/ids/{id}"))
            .await
            .map_err(|e| e.of(id))?
        {
            Some(a) => a,
            None => return Err(FetchError::NotFound(id)),
        };
        let mut references = Vec::new();
        self.references(id, &answer.references, 0, &mut references)
            .await?;
        Ok(RawSchema {
            schema_type: answer.schema_type.unwrap_or_else(|| "AVRO".into()),
            text: answer.schema,
            references,
        })
    }

    /// Each reference's text, its own references first; a name seen once.
    async fn references(
        &self,
        id: SchemaId,
        refs: &[Reference],
        depth: usize,
        out: &mut Vec<(String, String)>,
    ) -> Result<(), FetchError> {
        if depth >= MAX_REFERENCE_DEPTH && !refs.is_empty() {
            return Err(invalid(id, "references nest deeper than 16 levels"));
        }
        for r in refs {
            if out.iter().any(|(name, _)| *name == r.name) {
                continue;
            }
            let path = format!(
                "/subjects/{}/versions/{}",
                percent_encode(&r.subject),
                r.version
            );
            let Some(answer) = self.get(&path).await.map_err(|e| e.of(id))? else {
                return Err(invalid(
                    id,
                    &format!(
                        "its reference {:?} ({} version {}) does not exist",
                        r.name, r.subject, r.version
                    ),
                ));
            };
            Box::pin(self.references(id, &answer.references, depth + 1, out)).await?;
            out.push((r.name.clone(), answer.schema));
        }
        Ok(())
    }

    /// One GET: `Ok(None)` for a 404, the schema answer for a 200.
    async fn get(&self, path: &str) -> Result<Option<SchemaAnswer>, FetchError> {
        let mut request = self.http.get(format!("{}{path}", self.base)).header(
            "Accept",
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        request = match &self.auth {
            Auth::None => request,
            Auth::Basic(u, p) => request.basic_auth(u, Some(p.expose_secret())),
            Auth::Bearer(t) => request.bearer_auth(t.expose_secret()),
        };
        let unavailable = |e: &dyn std::fmt::Display| {
            FetchError::Unavailable(self.scrubber.scrub(&format!("GET {path}: {e}")))
        };
        let response = request
            .send()
            .await
            .map_err(|e| unavailable(&crate::errors::error_chain(&e)))?;
        let status = response.status();
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(unavailable(&format!("answered {status}")));
        }
        let body = response
            .bytes()
            .await
            .map_err(|e| unavailable(&crate::errors::error_chain(&e)))?;
        serde_json::from_slice::<SchemaAnswer>(&body)
            .map(Some)
            .map_err(|e| FetchError::Invalid {
                id: 0,
                why: format!("GET {path} answered 200 without a schema ({e})"),
            })
    }
}

impl FetchError {
    /// An answer that is not a schema, as the record's schema id's.
    fn of(self, id: SchemaId) -> FetchError {
        match self {
            FetchError::Invalid { why, .. } => FetchError::Invalid { id, why },
            other => other,
        }
    }
}

fn invalid(id: SchemaId, why: &str) -> FetchError {
    FetchError::Invalid {
        id,
        why: why.to_string(),
    }
}

fn read(path: &std::path::Path) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path).map_err(|e| ClientError(format!("{}: {e}", path.display())))
}

/// A subject as one path segment (subjects may hold `/`, `:`, spaces).
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
