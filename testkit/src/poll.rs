//! The one polling helper. Tests wait for conditions on real servers
//! (commits, stored trades, readiness), never for fixed times where a
//! condition can be observed.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every `every` until it holds or `timeout` passes; whether
/// it held. For callers that record a miss instead of failing at once (the
/// chaos suite writes its report first).
pub async fn poll_until<F, Fut>(timeout: Duration, every: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}

/// Polls `check` every 100 ms until it holds; panics naming `what` if it
/// does not within `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    if !poll_until(timeout, Duration::from_millis(100), check).await {
        panic!("timed out after {timeout:?} waiting for: {what}");
    }
}
