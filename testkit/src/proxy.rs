//! A MongoDB wire-protocol proxy that can rewrite replies: put between the
//! worker and the local server, it makes the server say what a real
//! deployment says and the stand-in never does (a statement failed with a
//! shard's election error, say), while the server really did the work.
//!
//! It understands just enough of OP_MSG (MongoDB 3.6+) to pair a reply
//! with its command and rewrite a reply's body; everything else is passed
//! through byte for byte. The driver does not compress unless asked to.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use mongodb::bson::{doc, Bson, Document};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const OP_MSG: i32 = 2013;
const CHECKSUM_PRESENT: u32 = 1;

#[derive(Default)]
struct Faults {
    /// Replies to `update` commands still to be given a write error on
    /// their first statement: (code, how many).
    statement_errors: Option<(i32, usize)>,
    injected: usize,
}

/// The proxy's address and its controls.
#[derive(Clone)]
pub struct MongoProxy {
    pub port: u16,
    faults: Arc<Mutex<Faults>>,
}

impl MongoProxy {
    /// Listens on a free local port and forwards every connection to
    /// `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> MongoProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        let faults = Arc::new(Mutex::new(Faults::default()));
        let (upstream, shared) = (upstream.to_string(), faults.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = match TcpStream::connect(&upstream).await {
                    Ok(s) => s,
                    Err(_) => continue, // the client sees its connection close
                };
                tokio::spawn(relay(client, server, shared.clone()));
            }
        });
        MongoProxy { port, faults }
    }

    /// The next `times` replies to an `update` command that applied at
    /// least one statement report its first statement as failed with
    /// `code` (and one fewer matched): the statement was applied, the
    /// reply says it failed, as a reply lost to a failover would leave it.
    pub fn fail_first_statement(&self, code: i32, times: usize) {
        self.faults.lock().unwrap().statement_errors = Some((code, times));
    }

    /// How many replies were rewritten so far.
    pub fn injected(&self) -> usize {
        self.faults.lock().unwrap().injected
    }
}

/// Client to server as is, remembering each request's command name;
/// server to client through [`rewrite`].
async fn relay(client: TcpStream, server: TcpStream, faults: Arc<Mutex<Faults>>) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let commands: Arc<Mutex<HashMap<i32, String>>> = Arc::default();
    let asked = commands.clone();
    let requests = async move {
        while let Some(message) = read_message(&mut client_rx).await {
            if let Some((request_id, name)) = command_of(&message) {
                asked.lock().unwrap().insert(request_id, name);
            }
            if server_tx.write_all(&message).await.is_err() {
                break;
            }
        }
    };
    let replies = async move {
        while let Some(message) = read_message(&mut server_rx).await {
            let response_to = i32_at(&message, 8);
            let command = commands.lock().unwrap().remove(&response_to);
            let message = match command.as_deref() {
                Some("update") => rewrite(message, &faults),
                _ => message,
            };
            if client_tx.write_all(&message).await.is_err() {
                break;
            }
        }
    };
    // Either side closing ends the connection, as TCP would.
    tokio::select! {
        _ = requests => {}
        _ = replies => {}
    }
}

pub(crate) async fn read_message(from: &mut (impl AsyncReadExt + Unpin)) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await.ok()?;
    let total = i32::from_le_bytes(len) as usize;
    let mut message = len.to_vec();
    message.resize(total.max(4), 0);
    from.read_exact(&mut message[4..]).await.ok()?;
    Some(message)
}

pub(crate) fn i32_at(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The request id and command name of an OP_MSG whose first section is its
/// body.
pub(crate) fn command_of(message: &[u8]) -> Option<(i32, String)> {
    let (_, body) = body_of(message)?;
    let name = body.keys().next()?.clone();
    Some((i32_at(message, 4), name))
}

/// The flag bits and the body (section kind 0) of an OP_MSG.
fn body_of(message: &[u8]) -> Option<(u32, Document)> {
    if message.len() < 21 || i32_at(message, 12) != OP_MSG || message[20] != 0 {
        return None;
    }
    let flags = u32::from_le_bytes(message[16..20].try_into().unwrap());
    let body = Document::from_reader(&message[21..]).ok()?;
    Some((flags, body))
}

/// Applies a pending statement error to an `update` reply, if one is due
/// and the reply can carry it.
fn rewrite(message: Vec<u8>, faults: &Mutex<Faults>) -> Vec<u8> {
    let Some((flags, mut body)) = body_of(&message) else {
        return message;
    };
    let mut f = faults.lock().unwrap();
    let Some((code, left)) = f.statement_errors.filter(|(_, left)| *left > 0) else {
        return message;
    };
    let n = match body.get("n") {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        _ => return message,
    };
    if n < 1 || body.contains_key("writeErrors") {
        return message;
    }
    body.insert("n", n - 1);
    let error = doc! {"index": 0, "code": code, "errmsg": "injected by testkit::proxy"};
    body.insert("writeErrors", vec![Bson::Document(error)]);
    f.statement_errors = Some((code, left - 1));
    f.injected += 1;
    encode(&message, flags, &body)
}

/// `message` with its body replaced (and its checksum dropped: nothing
/// checks a missing one).
fn encode(message: &[u8], flags: u32, body: &Document) -> Vec<u8> {
    let mut bytes = Vec::new();
    body.to_writer(&mut bytes).expect("a document encodes");
    let mut out = message[..16].to_vec();
    out.extend((flags & !CHECKSUM_PRESENT).to_le_bytes());
    out.push(0);
    out.extend(bytes);
    let len = out.len() as i32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}
