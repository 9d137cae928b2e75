//! `tradebucket produce`: synthetic trade events, for the demo, load tests
//! and the benchmarks.

use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureRecord;
use tokio::time::Instant;

use super::{progress_bar, CliError};
use crate::config::Settings;

/// What `produce` generates (also the `produce` command's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct ProduceOptions {
    /// Topic; defaults to the first of kafka.topics.
    #[arg(long)]
    pub topic: Option<String>,
    #[arg(long, default_value_t = 1000)]
    pub count: u64,
    #[arg(long, default_value_t = 100)]
    pub customers: u64,
    /// Give a few customers most of the trades.
    #[arg(long)]
    pub skewed: bool,
    /// Number of distinct tickers (1-20).
    #[arg(long, default_value_t = 8)]
    pub tickers: usize,
    /// Events per second; 0 means as fast as possible.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Do not key messages by customer (customers spread over partitions).
    #[arg(long)]
    pub no_keys: bool,
    /// Number of the first trade id, to continue an earlier run.
    #[arg(long, default_value_t = 0)]
    pub first_id: u64,
}

const TICKERS: [&str; 20] = [
    "MDB", "MSFT", "GOOG", "AAPL", "AMZN", "NVDA", "META", "TSLA", "ORCL", "IBM", "INTC", "AMD",
    "CRM", "ADBE", "NFLX", "CSCO", "SAP", "ASML", "BRK.B", "RDS-A",
];

/// One synthetic, valid trade event as JSON, and its customer.
pub fn synthetic_event(
    rng: &mut StdRng,
    n: u64,
    opts: &ProduceOptions,
    base_ms: i64,
) -> (String, String) {
    let customer = if opts.skewed {
        // Squaring a uniform draw piles mass on low ids: roughly 30% of
        // trades go to the first 10% of customers.
        let u: f64 = rng.random();
        ((u * u) * opts.customers as f64) as u64
    } else {
        rng.random_range(0..opts.customers.max(1))
    };
    let ticker = TICKERS[rng.random_range(0..opts.tickers.clamp(1, TICKERS.len()))];
    let side = if rng.random_bool(0.5) { "buy" } else { "sell" };
    let qty: u32 = rng.random_range(1..1000);
    let cents: u32 = rng.random_range(100..100_000);
    // Monotonic in the trade number, so a customer's trades are in time
    // order, also across runs continued with --first-id.
    let date = base_ms + ((opts.first_id + n) as i64) * 3;
    let json = serde_json::json!({
        "tradeId": format!("G{}-{}", opts.seed, opts.first_id + n),
        "customerId": customer,
        "type": side,
        "ticker": ticker,
        "qty": qty,
        "price": format!("{}.{:02}", cents / 100, cents % 100),
        "currency": "USD",
        "date": date,
    });
    (json.to_string(), customer.to_string())
}

/// Produces synthetic trades; returns (topic, sent, seconds).
///
/// With a rate, the first event is sent alone and pacing starts when it is
/// acknowledged. A new producer cannot send until it is connected and, being
/// idempotent, has its producer id: librdkafka 2.12 asks for the id again
/// only on a 500 ms timer when no broker was up at its first try, which is
/// the usual case at start. Events paced from the producer's creation would
/// wait in its queue meanwhile, each timestamped when it was handed over, so
/// a consumer would see the producer's start-up as the first half second's
/// events' time in Kafka.
pub async fn produce(
    settings: &Settings,
    opts: &ProduceOptions,
    progress: bool,
) -> Result<(String, u64, f64), CliError> {
    let producer = crate::kafka::bulk_producer(settings)?;
    let topic = opts
        .topic
        .clone()
        .unwrap_or_else(|| settings.kafka.topics[0].clone());
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let base_ms = 1_700_000_000_000i64;
    let started = Instant::now();
    let mut pace = Pace::new(opts.rate);
    let mut in_flight = FuturesUnordered::new();
    let bar = progress_bar(progress, opts.count, "trades");
    for n in 0..opts.count {
        if let Some(due) = pace.due(n) {
            tokio::time::sleep_until(due).await;
        }
        let (json, key) = synthetic_event(&mut rng, n, opts, base_ms);
        let mut record: FutureRecord<'_, str, str> = FutureRecord::to(&topic).payload(&json);
        if !opts.no_keys {
            record = record.key(&key);
        }
        // Enqueued at once, so --rate paces the real sends.
        in_flight.push(crate::kafka::enqueue(&producer, record).await?);
        // Bound memory: at most this many unacknowledged sends; and the
        // first of a paced run acknowledged before the rest.
        while in_flight.len() >= 50_000 || pace.awaits_first() {
            let Some(ack) = in_flight.next().await else {
                break;
            };
            delivered(ack)?;
            pace.acknowledged(Instant::now());
        }
        // Counts handed to the producer; the wait below covers the acks.
        bar.inc(1);
    }
    while let Some(ack) = in_flight.next().await {
        delivered(ack)?;
    }
    bar.finish_and_clear();
    Ok((topic, opts.count, started.elapsed().as_secs_f64()))
}

/// When each event of a paced run is due: event 0 at once, then, from the
/// first acknowledgement on, event n at (n - 1) ÷ rate seconds after it.
#[derive(Debug)]
struct Pace {
    /// Events per second; 0: not paced.
    rate: u64,
    /// When event 0 was acknowledged.
    from: Option<Instant>,
}

impl Pace {
    fn new(rate: u64) -> Pace {
        Pace { rate, from: None }
    }

    /// Whether sending waits for the first event's acknowledgement.
    fn awaits_first(&self) -> bool {
        self.rate > 0 && self.from.is_none()
    }

    /// An event was acknowledged at `now`; the first one starts the clock.
    fn acknowledged(&mut self, now: Instant) {
        if self.rate > 0 {
            self.from.get_or_insert(now);
        }
    }

    /// When event `n` may be sent; `None`: at once.
    fn due(&self, n: u64) -> Option<Instant> {
        let from = self.from?;
        let after = Duration::from_secs_f64(n.saturating_sub(1) as f64 / self.rate as f64);
        Some(from + after)
    }
}

/// The broker's verdict on one produced event.
fn delivered(
    ack: Result<
        rdkafka::producer::future_producer::OwnedDeliveryResult,
        futures::channel::oneshot::Canceled,
    >,
) -> Result<(), CliError> {
    match ack {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(e.into()),
        // The producer dropped the delivery report: it is shutting down.
        Err(_) => Err(KafkaError::Canceled.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unpaced_run_never_waits() {
        let mut pace = Pace::new(0);
        assert!(!pace.awaits_first());
        pace.acknowledged(Instant::now());
        assert_eq!(pace.due(0), None);
        assert_eq!(pace.due(5_000), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_paced_run_starts_its_clock_at_the_first_acknowledgement() {
        let mut pace = Pace::new(1_000);
        // Event 0 goes at once, and nothing else until it is acknowledged.
        assert_eq!(pace.due(0), None);
        assert!(pace.awaits_first());
        // The producer's start-up: half a second before the first ack.
        tokio::time::advance(Duration::from_millis(500)).await;
        let acked = Instant::now();
        pace.acknowledged(acked);
        assert!(!pace.awaits_first());
        // Event 1 at the ack, then one every millisecond from there.
        assert_eq!(pace.due(1), Some(acked));
        assert_eq!(pace.due(2), Some(acked + Duration::from_millis(1)));
        assert_eq!(pace.due(1_001), Some(acked + Duration::from_secs(1)));
        // Later acknowledgements do not move the clock.
        tokio::time::advance(Duration::from_millis(3)).await;
        pace.acknowledged(Instant::now());
        assert_eq!(pace.due(2), Some(acked + Duration::from_millis(1)));
    }
}
