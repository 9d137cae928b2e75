//! The real `tradebucket` binary as a child process: started with an
//! environment, killed with -9, stopped with SIGTERM/SIGINT, its exit code
//! and its log. Also `tradebucket audit --json`.
//!
//! Every function takes the binary's path: `env!("CARGO_BIN_EXE_tradebucket")`
//! exists only in the root package's tests and benches.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tradebucket::cli::AuditReport;

/// Where a worker's log (stderr) goes.
#[derive(Debug, Clone)]
pub enum Log {
    /// Discarded, unless `TEST_LOG` is set: then the test's stderr.
    Quiet,
    /// The caller's stderr.
    Inherit,
    /// A file of its own (created or truncated).
    File(PathBuf),
}

/// `kill -SIG pid` through the `kill` command, to avoid a libc dependency
/// for one call.
pub fn send_signal(pid: u32, sig: i32) -> bool {
    Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success())
}

pub const SIGINT: i32 = 2;
pub const SIGTERM: i32 = 15;

/// A running `tradebucket run`.
pub struct WorkerProcess {
    child: Child,
}

impl WorkerProcess {
    /// Starts `binary run` with `vars` added to this process's environment.
    pub fn start<K, V>(binary: &Path, vars: impl IntoIterator<Item = (K, V)>, log: Log) -> Self
    where
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        Self::spawn(binary, vars, log, false)
    }

    /// The same with only `vars` as environment, so nothing of the caller's
    /// leaks into the worker's configuration.
    pub fn start_clean<K, V>(
        binary: &Path,
        vars: impl IntoIterator<Item = (K, V)>,
        log: Log,
    ) -> Self
    where
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        Self::spawn(binary, vars, log, true)
    }

    fn spawn<K, V>(
        binary: &Path,
        vars: impl IntoIterator<Item = (K, V)>,
        log: Log,
        clean: bool,
    ) -> Self
    where
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let mut command = Command::new(binary);
        command.arg("run");
        if clean {
            command.env_clear();
        }
        let stderr = match log {
            Log::Quiet if std::env::var_os("TEST_LOG").is_some() => Stdio::inherit(),
            Log::Quiet => Stdio::null(),
            Log::Inherit => Stdio::inherit(),
            Log::File(path) => std::fs::File::create(&path)
                .unwrap_or_else(|e| panic!("log file {path:?}: {e}"))
                .into(),
        };
        let child = command
            .envs(vars)
            // Text, not JSON: the logs are read by people.
            .env("TRADEBUCKET__LOG__FORMAT", "text")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("start {binary:?}: {e}"));
        WorkerProcess { child }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// A memory figure of the running process from `/proc/PID/status`, in
    /// KiB: `"VmRSS:"` (resident now) or `"VmHWM:"` (the peak resident
    /// size since it started). `None` once it has exited.
    pub fn status_kib(&self, field: &str) -> Option<u64> {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix(field))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    /// Its exit status if it has exited (without waiting).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// kill -9, and reap it.
    pub fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// Sends `sig` (SIGTERM, SIGINT...) and returns at once.
    pub fn signal(&self, sig: i32) {
        assert!(send_signal(self.child.id(), sig), "kill -{sig}");
    }

    /// Its exit status, or `None` after a kill -9 if it did not exit
    /// within `timeout`.
    fn wait_status(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for exit: the exit code, or `None` if it was killed, also by
    /// us when it did not exit within `timeout`.
    pub fn exit_code_within(mut self, timeout: Duration) -> Option<i32> {
        self.wait_status(timeout).and_then(|s| s.code())
    }

    /// Waits for exit; returns the exit code. Panics (after a kill -9) if
    /// it does not exit within `timeout`.
    pub fn wait(mut self, timeout: Duration) -> Option<i32> {
        match self.wait_status(timeout) {
            Some(status) => status.code(),
            None => panic!("worker did not exit within {timeout:?}"),
        }
    }

    /// SIGTERM, then [`WorkerProcess::exit_code_within`]. Sent once the
    /// worker handles SIGTERM (at most 30 s after it started): a signal in
    /// its first milliseconds, before its handler exists (it is installed
    /// before the worker logs "starting"), ends it by the signal's default
    /// action (no exit code), as it would any process. A
    /// test that finds nothing left to wait for signals a worker just
    /// started (chaos s1 once did, when an earlier life had committed
    /// everything).
    pub fn sigterm(self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.handles(SIGTERM) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.signal(SIGTERM);
        self.exit_code_within(timeout)
    }

    /// Whether it has a handler for `sig` (`SigCgt` in /proc/PID/status, a
    /// hexadecimal mask with bit `sig - 1` set for each caught signal).
    pub fn handles(&self, sig: i32) -> bool {
        let caught = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|status| {
                let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
                u64::from_str_radix(mask.trim(), 16).ok()
            });
        caught.is_some_and(|mask| mask & (1 << (sig - 1)) != 0)
    }
}

/// A worker a test lets go of while it still runs (a panic, or a test
/// that ends without stopping it) is killed -9 and reaped, so no
/// `tradebucket run` outlives its test and reads the next test's topics.
impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Workers of one run, each logging to its own file in `dir`
/// (`worker-0.log`, `worker-1.log`, ...). Dropping the fleet kills -9 those
/// still running, so a failed test leaves no worker behind.
pub struct Fleet {
    binary: PathBuf,
    vars: BTreeMap<String, String>,
    dir: PathBuf,
    started: usize,
    pids: Vec<u32>,
}

impl Fleet {
    /// Empties `dir` (logs of an earlier run) and starts no worker yet.
    pub fn new(binary: &Path, vars: BTreeMap<String, String>, dir: PathBuf) -> Fleet {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("log dir");
        Fleet {
            binary: binary.to_path_buf(),
            vars,
            dir,
            started: 0,
            pids: Vec::new(),
        }
    }

    pub fn start(&mut self) -> WorkerProcess {
        self.start_with(&[])
    }

    /// A worker with `extra` variables on top of the fleet's.
    pub fn start_with(&mut self, extra: &[(&str, String)]) -> WorkerProcess {
        let log = self.dir.join(format!("worker-{}.log", self.started));
        self.started += 1;
        let vars = self
            .vars
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(extra.iter().map(|(k, v)| (*k, v.as_str())));
        let w = WorkerProcess::start(&self.binary, vars, Log::File(log));
        self.pids.push(w.id());
        w
    }
}

impl Drop for Fleet {
    /// Only processes still running our binary: a reaped pid may belong to
    /// someone else by now.
    fn drop(&mut self) {
        let ours = std::fs::canonicalize(&self.binary).ok();
        for pid in &self.pids {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            if exe.is_some() && exe == ours {
                send_signal(*pid, 9);
            }
        }
    }
}

/// `tradebucket audit --json` with `vars`: its exit code and report.
pub fn audit_json<K, V>(
    binary: &Path,
    vars: impl IntoIterator<Item = (K, V)>,
) -> (Option<i32>, AuditReport)
where
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(binary)
        .args(["audit", "--json"])
        .envs(vars)
        .env("TRADEBUCKET__LOG__FORMAT", "text")
        .output()
        .unwrap_or_else(|e| panic!("run {binary:?} audit: {e}"));
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "audit --json printed no report ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), report)
}
