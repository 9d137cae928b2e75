//! Whether the consumer group settles: a member whose group rebalances and
//! never hands out an assignment reads nothing, while every connection is
//! up and every request answered. Neither the broker links nor the
//! partition watcher see that (a member with no partitions has none to
//! watch), so the group's join state is watched instead, from librdkafka's
//! statistics (`cgrp.join_state`: "steady" once an assignment is in place,
//! `wait-join`, `wait-sync` and the like while a rebalance runs).
//!
//! A rebalance lasts at most the rebalance timeout (librdkafka sends
//! `max.poll.interval.ms`) for the members to rejoin, and a member that
//! died is noticed within `session.timeout.ms`; a group unsettled for
//! longer than both is not rebalancing, it is stuck.

use std::time::{Duration, Instant};

/// Tracks how long the group has been unsettled. Pure: the caller supplies
/// the time and the join state.
#[derive(Debug)]
pub struct Settling {
    limit: Duration,
    /// When the join state last left "steady" (or was first seen).
    since: Option<Instant>,
}

impl Settling {
    /// A group unsettled for longer than `limit` is reported.
    pub fn new(limit: Duration) -> Self {
        Settling { limit, since: None }
    }

    /// The limit that follows from the group's settings: the rebalance
    /// timeout plus the session timeout.
    pub fn limit(max_poll_interval: Duration, session_timeout: Duration) -> Duration {
        max_poll_interval + session_timeout
    }

    /// One statistics report's join state, seen at `now`: why the member
    /// reads nothing, once the group has been unsettled beyond the limit.
    pub fn observe(&mut self, join_state: &str, now: Instant) -> Option<String> {
        if join_state == "steady" {
            self.since = None;
            return None;
        }
        let since = *self.since.get_or_insert(now);
        let unsettled = now.saturating_duration_since(since);
        (unsettled > self.limit).then(|| {
            format!(
                "the consumer group has not settled for {} s (join state \"{join_state}\"): \
                 this member is assigned nothing",
                unsettled.as_secs()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(60);

    #[test]
    fn a_rebalance_within_the_limit_is_not_reported() {
        let t0 = Instant::now();
        let mut s = Settling::new(LIMIT);
        assert_eq!(s.observe("steady", t0), None);
        assert_eq!(s.observe("wait-join", t0 + Duration::from_secs(5)), None);
        assert_eq!(s.observe("wait-sync", t0 + Duration::from_secs(65)), None);
        assert_eq!(s.observe("steady", t0 + Duration::from_secs(70)), None);
    }

    #[test]
    fn a_group_unsettled_beyond_the_limit_is_reported_until_it_settles() {
        let t0 = Instant::now();
        let mut s = Settling::new(LIMIT);
        assert_eq!(s.observe("wait-join", t0), None);
        assert_eq!(s.observe("wait-sync", t0 + LIMIT), None);
        let why = s.observe("wait-join", t0 + LIMIT + Duration::from_secs(1));
        assert_eq!(
            why.as_deref(),
            Some(
                "the consumer group has not settled for 61 s (join state \"wait-join\"): \
                 this member is assigned nothing"
            )
        );
        assert_eq!(s.observe("steady", t0 + LIMIT * 2), None);
        // Unsettled again: the time counts from the new start.
        assert_eq!(s.observe("init", t0 + LIMIT * 3), None);
        assert!(s
            .observe("init", t0 + LIMIT * 4 + Duration::from_secs(1))
            .is_some());
    }

    #[test]
    fn the_limit_is_the_rebalance_timeout_plus_the_session_timeout() {
        assert_eq!(
            Settling::limit(Duration::from_secs(300), Duration::from_secs(45)),
            Duration::from_secs(345)
        );
    }
}
