//! Reading the worker's `/metrics` (the Prometheus text format): counters,
//! gauges, histograms and their quantiles, a reading less an earlier one,
//! and what they say of the worker's database work and delay.

use serde_json::json;

/// The writer's MongoDB operations (the `operation` label of
/// `tradebucket_mongodb_request_duration_seconds`), each with the counter
/// of what its requests carry, if there is one.
pub(crate) const OPERATIONS: [(&str, Option<&str>); 4] = [
    ("load", Some("tradebucket_bucket_heads_loaded_total")),
    ("find_keys", None),
    ("fill", Some("tradebucket_bucket_updates_total")),
    ("insert", Some("tradebucket_buckets_created_total")),
];

/// What a worker asked of the database over its life, by command type:
/// its requests, their summed duration (the local server applies them one
/// at a time, so about its time on them), and the newest buckets read,
/// appends sent or buckets inserted that they carried.
pub(crate) fn write_work(text: &str) -> serde_json::Value {
    let name = "tradebucket_mongodb_request_duration_seconds";
    let mut out = serde_json::Map::new();
    for (operation, items) in OPERATIONS {
        let labels = format!("operation=\"{operation}\"");
        out.insert(
            operation.to_string(),
            json!({
                "requests": gauge(text, &format!("{name}_count{{{labels}}}")),
                "seconds": gauge(text, &format!("{name}_sum{{{labels}}}")),
                "items": items.and_then(|c| counter(text, c)),
            }),
        );
    }
    serde_json::Value::Object(out)
}

pub(crate) fn counter(text: &str, name: &str) -> Option<u64> {
    gauge(text, name).map(|v| v as u64)
}

pub(crate) fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The stages of the worker's delay (`tradebucket_stage_delay_seconds`)
/// and its MongoDB requests by operation, each with its observations,
/// mean, p50 and p99: where a steady phase's delay went.
pub(crate) fn stage_breakdown(text: &str) -> serde_json::Value {
    let stages = [
        "in_kafka", "batching", "decode", "queued", "writing", "commit",
    ]
    .map(|s| ("tradebucket_stage_delay_seconds", "stage", s));
    let requests = OPERATIONS.map(|(o, _)| {
        let name = "tradebucket_mongodb_request_duration_seconds";
        (name, "operation", o)
    });
    let mut out = serde_json::Map::new();
    for (name, label, value) in stages.into_iter().chain(requests) {
        let labels = format!("{label}=\"{value}\"");
        let buckets = histogram_with(text, name, &labels);
        let count = buckets.last().map_or(0.0, |b| b.1);
        let sum = gauge(text, &format!("{name}_sum{{{labels}}}")).unwrap_or(0.0);
        let key = if label == "stage" {
            value.to_string()
        } else {
            format!("mongodb_{value}")
        };
        out.insert(
            key,
            json!({
                "observations": count,
                "mean_seconds": if count > 0.0 { sum / count } else { f64::NAN },
                "p50_seconds": quantile(&buckets, 0.50),
                "p99_seconds": quantile(&buckets, 0.99),
            }),
        );
    }
    serde_json::Value::Object(out)
}

/// (upper bound, cumulative count) of a Prometheus histogram.
pub(crate) fn histogram(text: &str, name: &str) -> Vec<(f64, f64)> {
    histogram_with(text, name, "")
}

/// [`histogram`] of the series with these `labels` (`name="value"`, as
/// the text format writes them before `le`).
pub(crate) fn histogram_with(text: &str, name: &str, labels: &str) -> Vec<(f64, f64)> {
    let labels = if labels.is_empty() {
        String::new()
    } else {
        format!("{labels},")
    };
    let prefix = format!("{name}_bucket{{{labels}le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// Prometheus's `histogram_quantile`: linear within the bucket.
pub(crate) fn quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map(|b| b.1).unwrap_or(0.0);
    if total == 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return prev.0;
            }
            let within = if count > prev.1 {
                (rank - prev.1) / (count - prev.1)
            } else {
                0.0
            };
            return prev.0 + (le - prev.0) * within;
        }
        prev = (le, count);
    }
    prev.0
}

/// `text` with `baseline`'s counts taken off: every counter and histogram
/// series (`_total`, `_bucket`, `_sum`, `_count`) less its value there;
/// gauges and series new since are as they are.
pub(crate) fn since(text: &str, baseline: &str) -> String {
    let cumulative = |series: &str| {
        let name = series.split('{').next().unwrap_or(series);
        ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .any(|s| name.ends_with(s))
    };
    let before: std::collections::HashMap<&str, f64> = baseline
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series, value.parse().ok()?))
        })
        .collect();
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let less = line
            .rsplit_once(' ')
            .filter(|(series, _)| !line.starts_with('#') && cumulative(series))
            .and_then(|(series, value)| {
                let value: f64 = value.parse().ok()?;
                Some(format!("{series} {}", value - before.get(series)?))
            });
        out.push_str(less.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}
