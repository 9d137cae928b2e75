//! The write-rate limit (`rate_limit.events_per_second`): a GCRA-style
//! virtual schedule, pure (the caller passes the time and does the
//! waiting), shared by the worker loop and `dlq replay`.
//!
//! Each reservation of `n` events moves a virtual clock `n / rate` seconds
//! forward; the caller waits until the real clock reaches it. Idle time
//! earns credit for at most `burst` (one second of the rate), so after a
//! pause a batch goes out at once, and over any long window no more than
//! `rate x window + rate x burst` events pass. Nothing is ever dropped: a
//! caller over the rate is told how long to wait, which is backpressure.

use std::time::Duration;

use tokio::time::Instant;

/// How much idle time turns into credit: one second of the rate.
const BURST: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct RateLimit {
    /// Events per second; 0 is no limit.
    rate: u64,
    /// The virtual time at which everything reserved so far is paid for.
    paid_until: Option<Instant>,
}

impl RateLimit {
    /// A limit of `rate` events per second; `0` never waits.
    pub fn new(rate: u64) -> Self {
        RateLimit {
            rate,
            paid_until: None,
        }
    }

    pub fn is_limited(&self) -> bool {
        self.rate > 0
    }

    /// Reserves `n` events at `now`; returns how long to wait before
    /// sending them (zero when within the rate).
    pub fn reserve(&mut self, n: usize, now: Instant) -> Duration {
        if self.rate == 0 || n == 0 {
            return Duration::ZERO;
        }
        let earliest = now.checked_sub(BURST).unwrap_or(now);
        let start = self.paid_until.map_or(earliest, |p| p.max(earliest));
        let cost = Duration::from_secs_f64(n as f64 / self.rate as f64);
        let end = start + cost;
        self.paid_until = Some(end);
        end.saturating_duration_since(now)
    }

    /// The largest batch to collect: one second of the rate (at least one
    /// event), so no single wait exceeds about a second and polling never
    /// stops for long (`max.poll.interval.ms`); `max_events` when off.
    pub fn batch_cap(&self, max_events: usize) -> usize {
        if self.rate == 0 {
            return max_events;
        }
        max_events.min(usize::try_from(self.rate).unwrap_or(usize::MAX).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reserves `n` and sleeps what the limit says, as callers do.
    async fn take(limit: &mut RateLimit, n: usize) -> Duration {
        let wait = limit.reserve(n, Instant::now());
        tokio::time::sleep(wait).await;
        wait
    }

    #[tokio::test(start_paused = true)]
    async fn off_never_waits_and_keeps_batches_whole() {
        let mut limit = RateLimit::new(0);
        for _ in 0..100 {
            assert_eq!(take(&mut limit, 10_000).await, Duration::ZERO);
        }
        assert_eq!(limit.batch_cap(5000), 5000);
        assert!(!limit.is_limited());
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_run_holds_the_rate_after_one_burst() {
        let mut limit = RateLimit::new(1000);
        let started = Instant::now();
        // 60,000 events in batches of 250: 60 s at 1000/s, less the one
        // second of credit the first batches may use.
        for _ in 0..240 {
            take(&mut limit, 250).await;
        }
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_secs(59) && elapsed <= Duration::from_secs(60),
            "{elapsed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn idle_time_earns_at_most_one_second_of_credit() {
        let mut limit = RateLimit::new(100);
        take(&mut limit, 100).await;
        tokio::time::advance(Duration::from_secs(3600)).await;
        // An hour idle: 100 events (one second) go at once, not 360,000.
        assert_eq!(take(&mut limit, 100).await, Duration::ZERO);
        assert_eq!(take(&mut limit, 100).await, Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_over_the_rate_waits_in_proportion() {
        let mut limit = RateLimit::new(50);
        assert_eq!(limit.batch_cap(5000), 50);
        assert_eq!(limit.batch_cap(10), 10);
        assert_eq!(RateLimit::new(1).batch_cap(5000), 1);
        // The first second is credit; then 50 events cost one second each.
        assert_eq!(take(&mut limit, 50).await, Duration::ZERO);
        assert_eq!(take(&mut limit, 50).await, Duration::from_secs(1));
        assert_eq!(take(&mut limit, 25).await, Duration::from_millis(500));
    }
}
