//! Rate limit for log lines on hot paths. A flood of bad events or a broker
//! that stays away would otherwise write a warning per message; one line per
//! interval, carrying how many were held back, says the same thing.

use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

/// At most one warning per this interval on a hot path.
pub const HOT_PATH_EVERY: Duration = Duration::from_secs(1);

impl Throttle {
    /// One line per [`HOT_PATH_EVERY`]: the loop's and the stage's
    /// warnings.
    pub fn hot_path() -> Self {
        Throttle::new(HOT_PATH_EVERY)
    }

    pub fn new(every: Duration) -> Self {
        Throttle {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(n)` when a line may be written now, `n` being how many were
    /// held back since the last one; `None` when this one is held back.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.every => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_rest_is_counted() {
        let mut t = Throttle::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(t.admit(t0), Some(0));
        for i in 1..=5 {
            assert_eq!(t.admit(t0 + Duration::from_millis(100 * i)), None);
        }
        assert_eq!(t.admit(t0 + Duration::from_millis(1000)), Some(5));
        assert_eq!(t.admit(t0 + Duration::from_millis(1500)), None);
        assert_eq!(t.admit(t0 + Duration::from_millis(2500)), Some(1));
    }
}
