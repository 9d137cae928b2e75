//! The decode comparisons: the default decode against a mapped one, the
//! libraries' floor, and Avro through the registry's cache.

use super::*;

// ---------------------------------------------------------------------
// A mapped decode (issue #28) against the default one: the same trades,
// once in the product's own schema and once as the FIX-style execution
// reports of docs/operations.md, read through their mapping.

const FIX_TOPIC: &str = "fix-execs";

const FIX_MAPPING: &str = r#"
[kafka]
topics = ["fix-execs"]

[[mappings]]
topic = "fix-execs"
keep = "none"
fields.customerId = { from = "/Account" }
fields.tradeId = { from = "/ExecID" }
fields.type = { from = "/Side", values = { buy = ["1"], sell = ["2"] }, unknown = "reject" }
fields.ticker = { from = "/Symbol" }
fields.qty = { from = "/LastQty" }
fields.price = { from = "/LastPx" }
fields.currency = { from = "/Currency" }
fields.date = { from = "/TransactTime", format = "fix" }
"#;

/// One of `produce`'s payloads as a FIX-style execution report: every
/// value a string, the side a code, the time a FIX `UTCTimestamp`.
fn as_fix_report(payload: &[u8]) -> anyhow::Result<Vec<u8>> {
    let t: serde_json::Value = serde_json::from_slice(payload)?;
    let text = |f: &str| match &t[f] {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let millis = t["date"].as_i64().unwrap_or_default();
    let time = chrono::DateTime::from_timestamp_millis(millis)
        .ok_or_else(|| anyhow::anyhow!("date out of range: {millis}"))?;
    let side = if text("type") == "buy" { "1" } else { "2" };
    let report = json!({
        "Account": text("customerId"), "Symbol": text("ticker"), "Side": side,
        "LastQty": text("qty"), "LastPx": text("price"), "Currency": text("currency"),
        "TransactTime": time.format("%Y%m%d-%H:%M:%S%.3f").to_string(),
        "ExecID": text("tradeId"),
    });
    Ok(serde_json::to_vec(&report)?)
}

/// `rounds` decodes of `records` by `mappings`.
fn decode_rounds(
    records: &[Record],
    mappings: &Mappings,
    max_bytes: usize,
    rounds: usize,
) -> (Meter, Decoded) {
    let mut meter = Meter::default();
    let mut last = None;
    for _ in 0..rounds.max(1) {
        last = Some(meter.run(records.len(), || {
            decode_batch(records, mappings, &Formats::default(), max_bytes)
        }));
    }
    (meter, last.expect("at least one round"))
}

// ---------------------------------------------------------------------
// The libraries' least per event (issue #29's "2.5 × a plain consumer"):
// serde_json's derive into borrowed fields, nothing else. Every worker
// that reads these trades with serde_json spends at least this before it
// checks, converts or stores a field (the product's decode does all of
// that, and writes the BSON entry, in its own stage above).

/// A trade as `produce` sends it, borrowed from the payload. Its fields
/// are only parsed: that is the work measured.
#[allow(dead_code)]
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct LeastTrade<'a> {
    trade_id: &'a str,
    customer_id: u64,
    #[serde(rename = "type")]
    side: &'a str,
    ticker: &'a str,
    qty: i64,
    price: &'a str,
    currency: &'a str,
    date: i64,
}

#[inline(never)]
fn stage_least(wire: &[Wire]) -> anyhow::Result<Vec<u64>> {
    wire.iter()
        .map(|w| {
            let t: LeastTrade = serde_json::from_slice(&w.payload)?;
            Ok(std::hint::black_box(t).customer_id)
        })
        .collect()
}

/// [`stage_least`] over the batch `rounds` times.
pub(crate) fn library_floor(wire: &[Wire], rounds: usize) -> anyhow::Result<Meter> {
    let mut meter = Meter::default();
    for _ in 0..rounds.max(1) {
        let customers = meter.run(wire.len(), || stage_least(wire))?;
        anyhow::ensure!(customers.len() == wire.len(), "a trade was lost");
    }
    Ok(meter)
}

/// The default and the mapped decode of the same batch, interleaved
/// round by round so both see the same machine; checks that both store
/// the same entries.
pub(crate) fn mapped_decode(wire: &[Wire], rounds: usize) -> anyhow::Result<(Meter, Meter)> {
    let dir = PathBuf::from("target/bench");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("hotpath-mapping.toml");
    std::fs::write(&file, FIX_MAPPING)?;
    let settings = Settings::load_from(Some(&file), Some(BTreeMap::new()))?;
    let mappings = Mappings::from_settings(&settings)?;
    let fix: Vec<Wire> = wire
        .iter()
        .map(|w| {
            Ok(Wire {
                payload: as_fix_report(&w.payload)?,
                key: w.key.clone(),
                ..*w
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let (plain, mapped) = (stage_intake("trades", wire), stage_intake(FIX_TOPIC, &fix));
    let (none, max) = (Mappings::default(), settings.kafka.max_message_bytes);
    let (mut d, mut m) = (Meter::default(), Meter::default());
    for _ in 0..rounds.max(1) {
        let (dr, default_out) = decode_rounds(&plain, &none, max, 1);
        let (mr, mapped_out) = decode_rounds(&mapped, &mappings, max, 1);
        let same = default_out.events.len() == wire.len()
            && mapped_out
                .events
                .iter()
                .zip(&default_out.events)
                .all(|(a, b)| a.0.doc == b.0.doc);
        anyhow::ensure!(same, "the mapped trades are not stored as the default ones");
        d.add(dr);
        m.add(mr);
    }
    Ok((d, m))
}

// ---------------------------------------------------------------------
// Avro decode (issue #48) against the default JSON one: the same trades,
// once as `produce` writes them and once in the Confluent wire format
// under the product's Avro shape (docs/operations.md, tests/it/registry.rs),
// decoded through a registry whose cache holds the schema already, so no
// request is made and the decode alone is timed.

const AVRO_TOPIC: &str = "trades-avro";

/// The id the records' header names; any id, the cache is filled by hand.
const AVRO_SCHEMA_ID: u32 = 1;

/// Price at scale 2: `produce` writes cents, so the stored Decimal128s are
/// the JSON ones exactly and the check below can compare entries.
static AVRO_TRADE: LazyLock<String> =
    LazyLock::new(|| testkit::registry::avro_trade_schema(2, false));

/// The registry's URL in the settings: never contacted (nothing is
/// missing from the cache), and a closed port if it were.
const AVRO_CONFIG: &str = r#"
[kafka]
topics = ["trades-avro"]

[[formats]]
topic = "trades-avro"
format = "avro"

[schema_registry]
url = "http://127.0.0.1:9"
"#;

/// The decode's formats, with [`AVRO_TRADE`] in memory under its id.
fn avro_formats() -> anyhow::Result<(Formats, usize)> {
    let file = PathBuf::from("target/bench/hotpath-avro.toml");
    std::fs::create_dir_all("target/bench")?;
    std::fs::write(&file, AVRO_CONFIG)?;
    let settings = Settings::load_from(Some(&file), Some(BTreeMap::new()))?;
    let formats = Formats::from_settings(&settings, Metrics::new())?;
    let raw = RawSchema {
        schema_type: "AVRO".into(),
        text: AVRO_TRADE.clone(),
        references: Vec::new(),
    };
    let schema = Schema::parse(&raw).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(formats.remember(AVRO_SCHEMA_ID, schema), "no registry");
    Ok((formats, settings.kafka.max_message_bytes))
}

/// One of `produce`'s payloads as an upstream's Avro producer writes it:
/// magic byte, schema id, then the datum.
// The deprecated one-call writer is enough to make the bench's bytes.
#[allow(deprecated)]
fn as_avro_record(schema: &apache_avro::Schema, payload: &[u8]) -> anyhow::Result<Vec<u8>> {
    use apache_avro::types::Value as V;
    let t: serde_json::Value = serde_json::from_slice(payload)?;
    let text = |f: &str| t[f].as_str().unwrap_or_default().to_string();
    let long = |f: &str| t[f].as_i64().unwrap_or_default();
    let side = text("type");
    let cents: i64 = text("price").replace('.', "").parse()?;
    let value = V::Record(vec![
        ("tradeId".into(), V::String(text("tradeId"))),
        ("customerId".into(), V::Long(long("customerId"))),
        ("type".into(), V::Enum(u32::from(side == "sell"), side)),
        ("ticker".into(), V::String(text("ticker"))),
        ("qty".into(), V::Long(long("qty"))),
        ("price".into(), V::Decimal(cents.to_be_bytes().into())),
        (
            "currency".into(),
            V::Union(1, Box::new(V::String(text("currency")))),
        ),
        ("date".into(), V::TimestampMillis(long("date"))),
    ]);
    let mut record = vec![0];
    record.extend_from_slice(&AVRO_SCHEMA_ID.to_be_bytes());
    record.extend(apache_avro::to_avro_datum(schema, value)?);
    Ok(record)
}

/// The default decode and the Avro one of the same batch, interleaved
/// round by round; checks that both store the same entries.
pub(crate) fn avro_decode(wire: &[Wire], rounds: usize) -> anyhow::Result<(Meter, Meter, usize)> {
    let (formats, max) = avro_formats()?;
    let schema = apache_avro::Schema::parse_str(&AVRO_TRADE)?;
    let avro: Vec<Wire> = wire
        .iter()
        .map(|w| {
            Ok(Wire {
                payload: as_avro_record(&schema, &w.payload)?,
                key: w.key.clone(),
                ..*w
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let avro_bytes = avro.iter().map(|w| w.payload.len()).sum::<usize>() / avro.len().max(1);
    let (plain, binary) = (
        stage_intake("trades", wire),
        stage_intake(AVRO_TOPIC, &avro),
    );
    let none = Mappings::default();
    let (mut d, mut a) = (Meter::default(), Meter::default());
    for _ in 0..rounds.max(1) {
        let (mut dr, mut ar) = (Meter::default(), Meter::default());
        let default_out = dr.run(plain.len(), || stage_decode_json_twin(&plain, &none, max));
        let avro_out = ar.run(binary.len(), || stage_decode_avro(&binary, &formats, max));
        let same = default_out.events.len() == wire.len()
            && avro_out.events.len() == wire.len()
            && avro_out
                .events
                .iter()
                .zip(&default_out.events)
                .all(|(a, b)| a.0.doc == b.0.doc && a.0.key == b.0.key);
        anyhow::ensure!(same, "the Avro trades are not stored as the JSON ones");
        d.add(dr);
        a.add(ar);
    }
    Ok((d, a, avro_bytes))
}

/// The JSON decode beside the Avro one, a function of its own so that
/// callgrind's inclusive counts show the two side by side.
#[inline(never)]
fn stage_decode_json_twin(records: &[Record], none: &Mappings, max_bytes: usize) -> Decoded {
    decode_batch(records, none, &Formats::default(), max_bytes)
}

/// The Avro decode of a batch.
#[inline(never)]
fn stage_decode_avro(records: &[Record], formats: &Formats, max_bytes: usize) -> Decoded {
    decode_batch(records, &Mappings::default(), formats, max_bytes)
}
