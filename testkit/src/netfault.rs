//! A fault-injecting TCP proxy, put between the worker and a server to make
//! the network lie the ways a stopped server never does: a black hole
//! (connections accepted and kept open, nothing answered), a delay in each
//! direction, connections reset, and, for MongoDB, a write's reply dropped
//! after the server applied it (then the connection cut, as a lost reply
//! ends in a reset or a timeout).
//!
//! A black hole holds traffic rather than discarding it: a TCP connection
//! that survives a partition delivers what was sent once the network heals
//! (retransmission), it never loses bytes from the middle of a stream.
//! Clients that gave up meanwhile have closed their connections, but what
//! they sent before is still delivered, late, as a kernel retransmits a
//! closed socket's unacknowledged data for a while. `heal_closing` ends a
//! hole the other way: the connections died and their bytes with them.
//!
//! Kafka clients learn broker addresses from metadata, so a broker behind
//! this proxy must advertise the proxy's address
//! (`PrivateKafka::start_behind`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::proxy::{command_of, i32_at, read_message};

/// What the proxy understands of the bytes it carries.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Bytes only (Kafka): black hole, delay, reset.
    Tcp,
    /// MongoDB OP_MSG framing: also drops write replies.
    Mongo,
}

struct Controls {
    black_hole: watch::Sender<bool>,
    /// Milliseconds added to each direction: towards the server, back.
    delay_up: AtomicU64,
    delay_down: AtomicU64,
    /// Cancelled to reset every open connection; replaced after.
    resets: Mutex<CancellationToken>,
    /// Chance (per million) that a reply to `update`/`insert` is dropped
    /// and its connection cut, and the randomness deciding it.
    drop_writes_ppm: AtomicU64,
    rng: Mutex<StdRng>,
    dropped_replies: AtomicUsize,
    connections: AtomicUsize,
    /// [`Protocol::Tcp`] carrying Kafka: connections whose first request
    /// names this `client.id` are never held by a black hole.
    spared: Mutex<Option<String>>,
}

/// The proxy's address and its controls (cheap to clone).
#[derive(Clone)]
pub struct FaultProxy {
    pub port: u16,
    controls: Arc<Controls>,
}

impl FaultProxy {
    /// Listens on `port` (0 for any free one) and forwards every
    /// connection to `upstream` (`host:port`).
    pub async fn start(upstream: &str, port: u16, protocol: Protocol) -> FaultProxy {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        let controls = Arc::new(Controls {
            black_hole: watch::channel(false).0,
            delay_up: AtomicU64::new(0),
            delay_down: AtomicU64::new(0),
            resets: Mutex::new(CancellationToken::new()),
            drop_writes_ppm: AtomicU64::new(0),
            rng: Mutex::new(StdRng::seed_from_u64(17)),
            dropped_replies: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            spared: Mutex::new(None),
        });
        let (upstream, shared) = (upstream.to_string(), controls.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                shared.connections.fetch_add(1, Ordering::Relaxed);
                let (upstream, shared) = (upstream.clone(), shared.clone());
                tokio::spawn(connection(client, upstream, shared, protocol));
            }
        });
        FaultProxy { port, controls }
    }

    /// `127.0.0.1:<port>`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Holds all traffic, both ways, on open and new connections; new
    /// connections are accepted and never answered.
    pub fn black_hole(&self) {
        self.controls.black_hole.send_replace(true);
    }

    /// Kafka only: black holes spare the connections of the client whose
    /// `client.id` is `id` (read from each connection's first request), as
    /// a partition that cuts one host off and not another.
    pub fn spare_client(&self, id: &str) {
        *self.controls.spared.lock().unwrap() = Some(id.to_string());
    }

    /// Ends a black hole: held traffic flows again, in order.
    pub fn heal(&self) {
        self.controls.black_hole.send_replace(false);
    }

    /// Ends a black hole the way a partition that outlasted TCP's
    /// retransmissions ends: every connection open during it is closed, and
    /// what it held never reaches the other side. Connections made after
    /// this are served as before.
    pub fn heal_closing(&self) {
        self.reset_all();
        self.heal();
    }

    /// Delays every chunk towards the server by `up` and back by `down`
    /// (latency, not bandwidth: chunks stay in order and overlap).
    pub fn delay(&self, up: Duration, down: Duration) {
        let ms = |d: Duration| d.as_millis() as u64;
        self.controls.delay_up.store(ms(up), Ordering::Relaxed);
        self.controls.delay_down.store(ms(down), Ordering::Relaxed);
    }

    /// Resets every open connection (RST); new ones are served as before.
    pub fn reset_all(&self) {
        let mut token = self.controls.resets.lock().unwrap();
        token.cancel();
        *token = CancellationToken::new();
    }

    /// [`Protocol::Mongo`]: each reply to an `update` or `insert` command
    /// (the server has applied it) is, with `probability`, dropped and its
    /// connection reset. 0 stops it.
    pub fn drop_write_replies(&self, probability: f64) {
        let ppm = (probability.clamp(0.0, 1.0) * 1e6) as u64;
        self.controls.drop_writes_ppm.store(ppm, Ordering::Relaxed);
    }

    /// Write replies dropped so far.
    pub fn dropped_replies(&self) -> usize {
        self.controls.dropped_replies.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.controls.connections.load(Ordering::Relaxed)
    }
}

/// One chunk on its way, or the order to cut the connection.
enum Item {
    Data(Instant, Vec<u8>),
    Cut,
}

/// Relays one client connection until either side closes, a reset, or a
/// dropped reply cuts it. Connects upstream only once no black hole holds
/// (a partitioned client never reaches the server).
async fn connection(mut client: TcpStream, upstream: String, c: Arc<Controls>, protocol: Protocol) {
    let reset = c.resets.lock().unwrap().clone();
    // A Kafka client speaks first: its first request says who it is.
    let first = match protocol {
        Protocol::Tcp => first_chunk(&mut client).await,
        Protocol::Mongo => Vec::new(),
    };
    let spared = c
        .spared
        .lock()
        .unwrap()
        .as_deref()
        .is_some_and(|id| kafka_client_id(&first) == Some(id));
    let mut held = c.black_hole.subscribe();
    tokio::select! {
        _ = held.wait_for(|on| spared || !on) => {}
        _ = reset.cancelled() => return cut(client),
    }
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return cut(client);
    };
    let (client_rx, client_tx) = client.into_split();
    let (server_rx, server_tx) = server.into_split();
    let (up_tx, up_rx) = mpsc::unbounded_channel();
    let (down_tx, down_rx) = mpsc::unbounded_channel();
    if !first.is_empty() {
        let _ = up_tx.send(Item::Data(Instant::now(), first));
    }
    let commands: Mutex<HashMap<i32, String>> = Mutex::default();
    let work = async {
        tokio::join!(
            read_side(client_rx, up_tx, &c, protocol, &commands, true),
            read_side(server_rx, down_tx, &c, protocol, &commands, false),
            write_side(up_rx, server_tx, &c, spared),
            write_side(down_rx, client_tx, &c, spared),
        )
    };
    tokio::select! {
        _ = work => {}
        _ = reset.cancelled() => {}
    }
}

/// The first bytes a client sends (empty if it closes first).
async fn first_chunk(client: &mut TcpStream) -> Vec<u8> {
    let mut buf = vec![0u8; 64 * 1024];
    match client.read(&mut buf).await {
        Ok(n) => {
            buf.truncate(n);
            buf
        }
        Err(_) => Vec::new(),
    }
}

/// The `client_id` of a Kafka request (header v1 and later: size, API
/// key, version, correlation id, then the id as a length-prefixed string).
fn kafka_client_id(request: &[u8]) -> Option<&str> {
    let len = i16::from_be_bytes(request.get(12..14)?.try_into().ok()?);
    let id = request.get(14..14 + usize::try_from(len).ok()?)?;
    std::str::from_utf8(id).ok()
}

/// Drops `stream` with an RST rather than a FIN.
fn cut(stream: TcpStream) {
    let _ = stream.set_zero_linger();
}

/// Reads chunks (bytes, or whole OP_MSG messages) and queues them with
/// their due time. `up`: from the client. Replies to writes may be turned
/// into a cut here.
async fn read_side(
    mut from: impl AsyncRead + Unpin,
    to: mpsc::UnboundedSender<Item>,
    c: &Controls,
    protocol: Protocol,
    commands: &Mutex<HashMap<i32, String>>,
    up: bool,
) {
    loop {
        let chunk = match protocol {
            Protocol::Tcp => {
                let mut buf = vec![0u8; 64 * 1024];
                match from.read(&mut buf).await {
                    Ok(0) | Err(_) => None,
                    Ok(n) => {
                        buf.truncate(n);
                        Some(buf)
                    }
                }
            }
            Protocol::Mongo => read_message(&mut from).await,
        };
        let Some(chunk) = chunk else {
            let _ = to.send(Item::Cut);
            return;
        };
        if protocol == Protocol::Mongo {
            if up {
                if let Some((id, name)) = command_of(&chunk) {
                    commands.lock().unwrap().insert(id, name);
                }
            } else if drops_reply(&chunk, commands, c) {
                let _ = to.send(Item::Cut);
                return;
            }
        }
        let delay = if up { &c.delay_up } else { &c.delay_down };
        let due = Instant::now() + Duration::from_millis(delay.load(Ordering::Relaxed));
        if to.send(Item::Data(due, chunk)).is_err() {
            return;
        }
    }
}

/// Whether this server message is a write's reply chosen to be dropped.
fn drops_reply(reply: &[u8], commands: &Mutex<HashMap<i32, String>>, c: &Controls) -> bool {
    let name = commands.lock().unwrap().remove(&i32_at(reply, 8));
    let ppm = c.drop_writes_ppm.load(Ordering::Relaxed);
    if ppm == 0 || !matches!(name.as_deref(), Some("update" | "insert")) {
        return false;
    }
    let chosen = c.rng.lock().unwrap().random_range(0..1_000_000) < ppm;
    if chosen {
        c.dropped_replies.fetch_add(1, Ordering::Relaxed);
    }
    chosen
}

/// Writes queued chunks when due and no black hole holds them; a cut (or
/// the reading side's end) resets the connection.
async fn write_side(
    mut from: mpsc::UnboundedReceiver<Item>,
    mut to: OwnedWriteHalf,
    c: &Controls,
    spared: bool,
) {
    let mut held = c.black_hole.subscribe();
    while let Some(item) = from.recv().await {
        let Item::Data(due, bytes) = item else {
            break;
        };
        tokio::time::sleep_until(due).await;
        if held.wait_for(|on| spared || !on).await.is_err() || to.write_all(&bytes).await.is_err() {
            break;
        }
    }
    let _ = to.as_ref().set_zero_linger();
}
