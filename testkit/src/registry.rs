//! A small Schema Registry: the part of Confluent's REST API that the
//! serializers of producers and tradebucket's reader use. No Schema
//! Registry server can be installed on these machines, so the tests run
//! this one; what it answers is what Confluent's documents (ids shared by
//! equal schemas across subjects, 404 with `error_code` 40403 for an
//! unknown id). It can be stopped and started again on the same port with
//! the same schemas, mid-test, and made to answer an id with something
//! that is not a schema.
//!
//! - `POST /subjects/{subject}/versions`: register, `{"id"}`;
//! - `POST /subjects/{subject}`: look a schema up, `{"subject", "id",
//!   "version", "schema"}`;
//! - `GET /schemas/ids/{id}`: `{"schema", "schemaType", "references"}`;
//! - `GET /subjects/{subject}/versions/{version|latest}`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, PartialEq)]
struct Stored {
    schema: String,
    schema_type: String,
    references: Value,
}

#[derive(Debug, Default)]
struct Inner {
    /// By id - 1.
    schemas: Vec<Stored>,
    /// Subject -> its versions' ids, version 1 first.
    subjects: Vec<(String, Vec<u32>)>,
    /// Ids answered with this body instead of their schema.
    garbled: Vec<(u32, String)>,
}

type Shared = Arc<Mutex<Inner>>;

/// The registry server; stopped when dropped.
pub struct SchemaRegistry {
    state: Shared,
    addr: SocketAddr,
    running: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
}

impl SchemaRegistry {
    /// Starts on a free loopback port.
    pub async fn start() -> SchemaRegistry {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut r = SchemaRegistry {
            state: Shared::default(),
            addr,
            running: None,
        };
        r.serve(listener);
        r
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops answering: connections are refused until [`Self::restart`].
    pub async fn stop(&mut self) {
        if let Some((token, task)) = self.running.take() {
            token.cancel();
            let _ = task.await;
        }
    }

    /// Answers again, on the same port, with the same schemas.
    pub async fn restart(&mut self) {
        self.stop().await;
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        };
        self.serve(listener);
    }

    /// Registers `schema` under `subject` as a producer would; its id.
    pub fn register(&self, subject: &str, schema_type: &str, schema: &str) -> u32 {
        let stored = Stored {
            schema: schema.to_string(),
            schema_type: schema_type.to_string(),
            references: json!([]),
        };
        register(&mut self.state.lock().unwrap(), subject, stored)
    }

    /// From now on `id` is answered with `body` (200), not its schema.
    pub fn garble(&self, id: u32, body: &str) {
        self.state
            .lock()
            .unwrap()
            .garbled
            .push((id, body.to_string()));
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let token = CancellationToken::new();
        let app = Router::new()
            .route("/subjects/{subject}/versions", post(register_route))
            .route("/subjects/{subject}", post(lookup_route))
            .route("/schemas/ids/{id}", get(by_id_route))
            .route("/subjects/{subject}/versions/{version}", get(version_route))
            .with_state(self.state.clone());
        let stop = token.clone();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
        self.running = Some((token, task));
    }
}

impl Drop for SchemaRegistry {
    fn drop(&mut self) {
        if let Some((token, _)) = &self.running {
            token.cancel();
        }
    }
}

fn register(inner: &mut Inner, subject: &str, stored: Stored) -> u32 {
    let id = match inner.schemas.iter().position(|s| *s == stored) {
        Some(i) => i as u32 + 1,
        None => {
            inner.schemas.push(stored);
            inner.schemas.len() as u32
        }
    };
    match inner.subjects.iter_mut().find(|(s, _)| s == subject) {
        Some((_, ids)) if ids.contains(&id) => {}
        Some((_, ids)) => ids.push(id),
        None => inner.subjects.push((subject.to_string(), vec![id])),
    }
    id
}

fn parse_body(body: &Bytes) -> Option<Stored> {
    let v: Value = serde_json::from_slice(body).ok()?;
    Some(Stored {
        schema: v.get("schema")?.as_str()?.to_string(),
        schema_type: v
            .get("schemaType")
            .and_then(Value::as_str)
            .unwrap_or("AVRO")
            .to_string(),
        references: v.get("references").cloned().unwrap_or(json!([])),
    })
}

fn not_found(code: u32, message: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        json!({"error_code": code, "message": message}).to_string(),
    )
        .into_response()
}

fn ok(v: Value) -> Response {
    (
        StatusCode::OK,
        [("content-type", "application/vnd.schemaregistry.v1+json")],
        v.to_string(),
    )
        .into_response()
}

async fn register_route(
    State(state): State<Shared>,
    Path(subject): Path<String>,
    body: Bytes,
) -> Response {
    let Some(stored) = parse_body(&body) else {
        return (StatusCode::UNPROCESSABLE_ENTITY, "bad schema").into_response();
    };
    let id = register(&mut state.lock().unwrap(), &subject, stored);
    ok(json!({ "id": id }))
}

async fn lookup_route(
    State(state): State<Shared>,
    Path(subject): Path<String>,
    body: Bytes,
) -> Response {
    let Some(stored) = parse_body(&body) else {
        return (StatusCode::UNPROCESSABLE_ENTITY, "bad schema").into_response();
    };
    let inner = state.lock().unwrap();
    let Some((_, ids)) = inner.subjects.iter().find(|(s, _)| *s == subject) else {
        return not_found(40401, "Subject not found");
    };
    for (v, id) in ids.iter().enumerate() {
        if inner.schemas[*id as usize - 1] == stored {
            return ok(json!({"subject": subject, "id": id, "version": v + 1,
                "schema": stored.schema, "schemaType": stored.schema_type,
                "references": stored.references}));
        }
    }
    not_found(40403, "Schema not found")
}

async fn by_id_route(State(state): State<Shared>, Path(id): Path<u32>) -> Response {
    let inner = state.lock().unwrap();
    if let Some((_, body)) = inner.garbled.iter().find(|(g, _)| *g == id) {
        return (StatusCode::OK, body.clone()).into_response();
    }
    match id
        .checked_sub(1)
        .and_then(|i| inner.schemas.get(i as usize))
    {
        Some(s) => ok(json!({"schema": s.schema, "schemaType": s.schema_type,
            "references": s.references})),
        None => not_found(40403, "Schema not found"),
    }
}

async fn version_route(
    State(state): State<Shared>,
    Path((subject, version)): Path<(String, String)>,
) -> Response {
    let inner = state.lock().unwrap();
    let Some((_, ids)) = inner.subjects.iter().find(|(s, _)| *s == subject) else {
        return not_found(40401, "Subject not found");
    };
    let index = match version.as_str() {
        "latest" | "-1" => ids.len(),
        v => v.parse().unwrap_or(0),
    };
    let Some(id) = index.checked_sub(1).and_then(|i| ids.get(i)) else {
        return not_found(40402, "Version not found");
    };
    let s = &inner.schemas[*id as usize - 1];
    ok(
        json!({"subject": subject, "id": id, "version": index, "schema": s.schema,
        "schemaType": s.schema_type, "references": s.references}),
    )
}

/// The Python with confluent-kafka's serializers (`scripts/stack install`
/// makes it; run here if it is missing, so a fresh machine gets it).
fn producers_python() -> std::path::PathBuf {
    let tools = std::env::var_os("TRADEBUCKET_TOOLS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_default();
            std::path::PathBuf::from(home).join(".cache/tradebucket/tools")
        });
    let venv = tools.join("python-producers-2.16.1");
    if !venv.join("installed").exists() {
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let status = std::process::Command::new("bash")
            .arg(repo.join("scripts/stack"))
            .arg("install")
            .status()
            .expect("run scripts/stack install");
        assert!(status.success(), "scripts/stack install failed");
    }
    venv.join("bin/python")
}

/// Produces `records` (JSON objects; decimal fields as strings) to `topic`
/// with confluent-kafka's `AvroSerializer` under `schema`, registering it
/// in `registry` as `<topic>-value`, as a real upstream's producer does.
pub async fn produce_avro(
    brokers: &str,
    registry: &str,
    topic: &str,
    schema: &str,
    records: &[Value],
) {
    let args = avro_args(
        brokers,
        registry,
        topic,
        schema,
        &format!("{}", records.len()),
    );
    run_producer(args, records).await;
}

/// The producer's arguments for `schema` on `topic`, the schema written to
/// a file named by the topic and `tag`.
fn avro_args(brokers: &str, registry: &str, topic: &str, schema: &str, tag: &str) -> Vec<String> {
    let schema_file = std::env::temp_dir().join(format!("{topic}-{tag}.avsc"));
    std::fs::write(&schema_file, schema).expect("write the schema file");
    let file = schema_file.display().to_string();
    ["avro", brokers, registry, topic, &file]
        .map(String::from)
        .to_vec()
}

/// A record for [`produce_avro_placed`]: its key, its headers, and the
/// value as [`produce_avro`] takes it.
pub type Enveloped = (Option<String>, Vec<(String, String)>, Value);

/// [`produce_avro`] with each record's key and headers; where each landed
/// (partition, offset), in the order given.
pub async fn produce_avro_placed(
    brokers: &str,
    registry: &str,
    topic: &str,
    schema: &str,
    records: &[Enveloped],
) -> Vec<(i32, i64)> {
    let tag = format!("{}-placed", records.len());
    let mut args = avro_args(brokers, registry, topic, schema, &tag);
    args.insert(0, "--envelope".to_string());
    let lines: Vec<Value> = records
        .iter()
        .map(|(key, headers, value)| json!({"key": key, "headers": headers, "value": value}))
        .collect();
    let out = run_producer(args, &lines).await;
    let placed: Vec<(i32, i64)> = out
        .lines()
        .map(|l| {
            let (p, o) = l.split_once(' ').expect("PARTITION OFFSET");
            (p.parse().unwrap(), o.parse().unwrap())
        })
        .collect();
    assert_eq!(placed.len(), records.len(), "every record was placed");
    placed
}

/// Produces `records` (the proto3 JSON form of `message`: a Timestamp as
/// RFC 3339 text, 64-bit integers as strings or numbers) to `topic` with
/// confluent-kafka's `ProtobufSerializer`, registering the file `proto`
/// (`.proto` text, compiled here by protox as protoc would, with its
/// well-known imports) in `registry` as `<topic>-value`.
pub async fn produce_protobuf(
    brokers: &str,
    registry: &str,
    topic: &str,
    proto: &str,
    message: &str,
    records: &[Value],
) {
    let dir = std::env::temp_dir().join(format!("{topic}-{}-proto", records.len()));
    std::fs::create_dir_all(&dir).expect("make the .proto folder");
    std::fs::write(dir.join("trade.proto"), proto).expect("write the .proto file");
    let mut set = protox::compile(["trade.proto"], [&dir]).expect("a valid .proto file");
    // As generated code holds it: no source info.
    set.file.iter_mut().for_each(|f| f.source_code_info = None);
    let set_file = dir.join("trade.pb");
    std::fs::write(&set_file, prost::Message::encode_to_vec(&set)).expect("write the set");
    let set_file = set_file.display().to_string();
    let args = ["protobuf", brokers, registry, topic, &set_file, message]
        .map(String::from)
        .to_vec();
    run_producer(args, records).await;
}

/// Runs `produce_registry.py` with `args`, `records` on its input, one
/// JSON object a line; what it printed.
async fn run_producer(args: Vec<String>, records: &[Value]) -> String {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/produce_registry.py");
    let input: String = records.iter().map(|r| format!("{r}\n")).collect();
    let python = producers_python();
    let out = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = std::process::Command::new(python)
            .arg(script)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run the Python producer");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "the Python producer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The Avro schema of a trade as the registry tests and the hot-path bench
/// write it: money an exact `decimal` at `scale`, the date
/// `timestamp-millis`. The first version has an optional `currency`; the
/// evolved one drops it and adds `venue` with a default (a field removed,
/// one added: what a compatible schema change may do).
pub fn avro_trade_schema(scale: u32, evolved: bool) -> String {
    let head = format!(
        r#"{{"type":"record","name":"Trade","namespace":"example.trades","fields":[
  {{"name":"tradeId","type":"string"}},
  {{"name":"customerId","type":"long"}},
  {{"name":"type","type":{{"type":"enum","name":"Side","symbols":["buy","sell"]}}}},
  {{"name":"ticker","type":"string"}},
  {{"name":"qty","type":"long"}},
  {{"name":"price","type":{{"type":"bytes","logicalType":"decimal","precision":18,"scale":{scale}}}}},"#
    );
    let date = r#"{"name":"date","type":{"type":"long","logicalType":"timestamp-millis"}}"#;
    let tail = if evolved {
        format!(
            r#"  {date},
  {{"name":"venue","type":"string","default":"XNAS"}}]}}"#
        )
    } else {
        format!(
            r#"  {{"name":"currency","type":["null","string"],"default":null}},
  {date}]}}"#
        )
    };
    format!("{head}\n{tail}")
}

#[cfg(test)]
mod tests {
    use super::avro_trade_schema;

    fn fields(schema: &str) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(schema).expect("the schema is JSON");
        v["fields"]
            .as_array()
            .expect("fields")
            .iter()
            .map(|f| f["name"].as_str().expect("a name").to_string())
            .collect()
    }

    #[test]
    fn the_evolved_trade_schema_drops_currency_and_adds_venue() {
        let first = ["tradeId", "customerId", "type", "ticker", "qty", "price"];
        let v1 = avro_trade_schema(4, false);
        let v2 = avro_trade_schema(4, true);
        assert_eq!(fields(&v1), [&first[..], &["currency", "date"]].concat());
        assert_eq!(fields(&v2), [&first[..], &["date", "venue"]].concat());
        let v: serde_json::Value = serde_json::from_str(&v2).unwrap();
        assert_eq!(v["fields"][5]["type"]["scale"], 4);
        assert_eq!(v["fields"][7]["default"], "XNAS");
    }
}
