//! Servers of a test's own, for tests that stop, kill or restart them
//! without disturbing the shared stack: a MongoDB-protocol server
//! (secantusd-rs) and Apache Kafka (one node, or a cluster of several)
//! from the stack's tools folder, and Prometheus; plus free ports and HTTP
//! probes.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use mongodb::bson::doc;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::env::unique;
use crate::poll::{eventually, poll_until};

/// Where `scripts/stack install` put the servers.
fn tools_dir() -> PathBuf {
    let tools = std::env::var("TRADEBUCKET_TOOLS").unwrap_or_else(|_| {
        format!(
            "{}/.cache/tradebucket/tools",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    PathBuf::from(tools)
}

/// `scripts/stack` of the repository. `CARGO_MANIFEST_DIR` is the kit's own
/// directory (`<repo>/testkit`), hence the `..`: the script is the root
/// package's, and the kit lives inside that repository by design.
fn stack_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/stack")
}

/// Where [`free_port`] looks: below Linux's ephemeral range (32768 and up
/// by default) and clear of the stacks' default ports (scripts/test's and
/// scripts/test-fresh's shards: 19092 to 19213, 27117 to 27237).
const TEST_PORTS: std::ops::Range<u32> = 20_000..27_000;

/// A port free at the time of asking, for a server that binds it later (a
/// JVM that binds seconds after, a broker restarted on its port).
///
/// Not one the kernel hands out (`bind(":0")`): a port from the ephemeral
/// range can be taken, between the asking and the server's bind, as the
/// source port of any outgoing connection on the machine, and the test
/// shards' clients open thousands; that failed a private broker's start in
/// CI ("Address already in use"). Below the range only another explicit
/// bind can take it. Each process walks the range from its own place (set
/// by its pid) so that the shards, running at once, ask for different
/// ports; each port is handed out once per process.
pub fn free_port() -> u16 {
    static ASKED: AtomicU32 = AtomicU32::new(0);
    let span = TEST_PORTS.end - TEST_PORTS.start;
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let asked = ASKED.fetch_add(1, Ordering::Relaxed);
        let port = (TEST_PORTS.start + (start + asked) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {TEST_PORTS:?}")
}

/// GET `url`: (status, body), or `None` when nothing answers.
pub async fn http_get(url: &str) -> Option<(u16, String)> {
    let response = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

/// A fresh data directory under the system's temporary one.
fn data_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(unique(what));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
    dir
}

/// A private MongoDB-protocol server, restartable on the same port and data.
pub struct PrivateMongo {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl PrivateMongo {
    pub fn binary() -> PathBuf {
        tools_dir().join("secantus-0.5.3-beta.196/bin/secantusd-rs")
    }

    pub async fn start() -> PrivateMongo {
        let mut m = PrivateMongo {
            port: free_port(),
            dir: data_dir("mongo"),
            child: None,
        };
        m.restart().await;
        m
    }

    pub fn uri(&self) -> String {
        format!("mongodb://127.0.0.1:{}/?directConnection=true", self.port)
    }

    /// Starts the server on the same port and data, and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new(Self::binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .arg("--storage-path")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {:?}: {e} (scripts/stack install builds it)",
                    Self::binary()
                )
            });
        self.child = Some(child);
        let client = mongodb::Client::with_uri_str(self.uri()).await.unwrap();
        let admin = client.database("admin");
        eventually("private MongoDB up", Duration::from_secs(30), || async {
            admin.run_command(doc! {"ping": 1}).await.is_ok()
        })
        .await;
    }

    /// SIGTERM and wait for exit: this server loses acknowledged writes on
    /// kill -9 (STACK.md), which would test the surrogate, not us.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while child.try_wait().unwrap().is_none() {
                if std::time::Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for PrivateMongo {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One Apache Kafka node (broker and controller in one JVM) run by
/// `scripts/stack kafka-node`, restartable on the same ports and data.
struct KafkaNode {
    id: u32,
    port: u16,
    controller_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl KafkaNode {
    fn new(id: u32) -> KafkaNode {
        KafkaNode {
            id,
            port: free_port(),
            controller_port: free_port(),
            dir: data_dir("kafka"),
            child: None,
        }
    }

    fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn voter(&self) -> String {
        format!("{}@127.0.0.1:{}", self.id, self.controller_port)
    }

    /// Starts the JVM (the script execs it, so the child is the broker
    /// itself and `kill` is a kill -9 of the broker). Its output goes to
    /// its own log, appended across restarts: what a failed scenario shows
    /// of the broker ([`PrivateKafka::log_tail`]).
    fn spawn(&mut self, voters: &str, advertised: &str, replication: usize) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("kafka.log"))
            .expect("broker log file");
        let child = Command::new(stack_script())
            .arg("kafka-node")
            .arg(&self.dir)
            .arg(self.id.to_string())
            .arg(self.port.to_string())
            .arg(self.controller_port.to_string())
            .args([voters, advertised, &replication.to_string()])
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start a Kafka node: {e} (scripts/stack install)"));
        self.child = Some(child);
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_tail(&self, lines: usize) -> Vec<String> {
        let text = std::fs::read_to_string(self.dir.join("kafka.log")).unwrap_or_default();
        let all: Vec<String> = text.lines().map(str::to_string).collect();
        all[all.len().saturating_sub(lines)..].to_vec()
    }
}

impl Drop for KafkaNode {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Metadata from `brokers`: how many brokers it lists, or `None` when
/// nothing answers within `timeout`.
fn brokers_listed(brokers: &str, timeout: Duration) -> Option<usize> {
    let probe: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("client");
    probe
        .fetch_metadata(None, timeout)
        .ok()
        .map(|m| m.brokers().len())
}

/// Whether `brokers` lists `expected` brokers within 90 s: each node has
/// caught up with the controller's metadata and serves clients.
async fn brokers_up(brokers: &str, expected: usize) -> bool {
    poll_until(Duration::from_secs(90), Duration::from_millis(250), || {
        let brokers = brokers.to_string();
        async move { brokers_listed(&brokers, Duration::from_secs(2)) == Some(expected) }
    })
    .await
}

/// Private Apache Kafka: one node, or a cluster of several, each broker
/// and controller (a static quorum of all of them, so that any one of
/// three can die and the rest keep a quorum and every partition's
/// in-sync replicas); restartable on the same ports and data.
pub struct PrivateKafka {
    /// The first node's port.
    pub port: u16,
    nodes: Vec<KafkaNode>,
    /// The address clients are told to use (metadata), when it is not
    /// the broker's own: a fault proxy in front of a single node.
    advertised: Option<String>,
}

impl PrivateKafka {
    pub async fn start() -> PrivateKafka {
        Self::start_advertising(free_port(), None).await
    }

    /// A broker on `port` that advertises `advertised` (`host:port`) in its
    /// metadata, so every client, once bootstrapped, connects there: how a
    /// [`crate::FaultProxy`] gets between the broker and its clients.
    pub async fn start_advertising(port: u16, advertised: Option<String>) -> PrivateKafka {
        let mut node = KafkaNode::new(1);
        node.port = port;
        let mut k = PrivateKafka {
            port,
            nodes: vec![node],
            advertised,
        };
        k.restart().await;
        k
    }

    /// A cluster of `size` nodes (ids 1 to `size`); Kafka's internal
    /// topics get `size` replicas.
    pub async fn cluster(size: usize) -> PrivateKafka {
        let nodes: Vec<KafkaNode> = (1..=size as u32).map(KafkaNode::new).collect();
        let mut k = PrivateKafka {
            port: nodes[0].port,
            nodes,
            advertised: None,
        };
        k.restart().await;
        k
    }

    /// Every node's address: clients bootstrap from any that answers.
    pub fn brokers(&self) -> String {
        let all: Vec<String> = self.nodes.iter().map(KafkaNode::address).collect();
        all.join(",")
    }

    /// Starts every node that is down, on its ports and data; waits until
    /// the cluster lists every node.
    pub async fn restart(&mut self) {
        for index in 0..self.nodes.len() {
            if self.nodes[index].child.is_none() {
                self.spawn(index);
            }
        }
        if !brokers_up(&self.brokers(), self.nodes.len()).await {
            let logs: Vec<Vec<String>> = self.nodes.iter().map(|n| n.log_tail(15)).collect();
            panic!(
                "private Kafka ({} node(s)) did not list every node within 90 s; \
                 the nodes' last log lines: {logs:#?}",
                self.nodes.len()
            );
        }
    }

    fn spawn(&mut self, index: usize) {
        let voters: Vec<String> = self.nodes.iter().map(KafkaNode::voter).collect();
        let replication = self.nodes.len();
        let node = &mut self.nodes[index];
        let advertised = self.advertised.clone().unwrap_or_else(|| node.address());
        node.spawn(&voters.join(","), &advertised, replication);
    }

    /// Whether the first node answers a metadata request on its own port,
    /// not through any proxy, within `timeout`.
    pub fn answers_directly(&self, timeout: Duration) -> bool {
        brokers_listed(&self.nodes[0].address(), timeout).is_some()
    }

    /// The last `lines` lines of the first node's log (its warnings and
    /// errors).
    pub fn log_tail(&self, lines: usize) -> Vec<String> {
        self.nodes[0].log_tail(lines)
    }

    /// kill -9 every node, and wait until the processes are gone (the
    /// ports are free).
    pub fn kill9(&mut self) {
        self.nodes.iter_mut().for_each(KafkaNode::kill9);
    }

    /// kill -9 node `id` (1-based) only.
    pub fn kill9_node(&mut self, id: u32) {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .expect("node id")
            .kill9();
    }

    /// The node id that leads `topic`'s `partition` now, as the cluster's
    /// metadata says.
    pub fn leader_of(&self, topic: &str, partition: i32) -> Option<u32> {
        let probe: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.brokers())
            .create()
            .expect("client");
        let metadata = probe
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .ok()?;
        let t = metadata.topics().first()?;
        let p = t.partitions().iter().find(|p| p.id() == partition)?;
        u32::try_from(p.leader()).ok()
    }
}

/// A real Prometheus (Debian's package, installed by scripts/stack) of the
/// test's own, scraping `target` every second.
pub struct Prometheus {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

impl Prometheus {
    pub async fn start(target: &str) -> Prometheus {
        let port = free_port();
        let dir = data_dir("prometheus");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tradebucket\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("start prometheus: {e} (scripts/stack install installs Debian's package)")
            });
        let p = Prometheus { port, dir, child };
        let ready = format!("http://127.0.0.1:{port}/-/ready");
        eventually("Prometheus ready", Duration::from_secs(30), || async {
            matches!(http_get(&ready).await, Some((200, _)))
        })
        .await;
        p
    }

    /// The value of an instant query returning one sample, if it returns one.
    pub async fn query(&self, promql: &str) -> Option<f64> {
        let url = format!("http://127.0.0.1:{}/api/v1/query", self.port);
        let body: serde_json::Value = reqwest::Client::new()
            .get(&url)
            .query(&[("query", promql)])
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let result = body["data"]["result"].as_array()?;
        if result.len() != 1 {
            return None;
        }
        result[0]["value"][1].as_str()?.parse().ok()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
