//! The one retry policy: exponential backoff with jitter that never gives
//! up. Every retry loop of the worker (index creation at start-up, bucket
//! writes, dead-letter sends) waits through a [`Backoff`], so a transient
//! failure anywhere is retried the same way, from the `[retry]` settings.
//!
//! Why it never gives up: the alternative to retrying a batch is skipping
//! trades. The loops stay responsive while they wait (health ticks, and a
//! shutdown abandons the wait), and the operator sees them in metrics and
//! readiness.

use std::time::Duration;

use backoff::backoff::Backoff as _;
use backoff::{ExponentialBackoff, ExponentialBackoffBuilder};

use crate::config::RetrySettings;

/// The waits between attempts of one operation. Start a new one per
/// operation so every operation starts from the initial interval.
#[derive(Debug)]
pub struct Backoff {
    inner: ExponentialBackoff,
    /// What a wait never exceeds (also the answer should the crate ever
    /// report that it gives up, which it cannot without an elapsed limit).
    max: Duration,
}

impl Backoff {
    pub fn new(settings: &RetrySettings) -> Self {
        let inner = ExponentialBackoffBuilder::new()
            .with_initial_interval(settings.initial_interval)
            .with_max_interval(settings.max_interval)
            .with_multiplier(settings.multiplier)
            .with_randomization_factor(settings.randomization_factor)
            .with_max_elapsed_time(None)
            .build();
        Backoff {
            inner,
            max: settings.max_interval,
        }
    }

    /// How long to wait before the next attempt; grows with every call.
    pub fn next_wait(&mut self) -> Duration {
        self.inner.next_backoff().unwrap_or(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(randomization_factor: f64) -> RetrySettings {
        RetrySettings {
            initial_interval: Duration::from_millis(100),
            max_interval: Duration::from_secs(1),
            multiplier: 2.0,
            randomization_factor,
        }
    }

    #[test]
    fn waits_grow_to_the_maximum_and_stay_there() {
        let mut b = Backoff::new(&settings(0.0));
        let waits: Vec<u128> = (0..7).map(|_| b.next_wait().as_millis()).collect();
        assert_eq!(waits, vec![100, 200, 400, 800, 1000, 1000, 1000]);
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let mut b = Backoff::new(&settings(0.5));
        let first = b.next_wait();
        assert!(
            (Duration::from_millis(50)..=Duration::from_millis(150)).contains(&first),
            "{first:?}"
        );
        for _ in 0..100 {
            assert!(b.next_wait() <= Duration::from_millis(1500));
        }
    }
}
