//! The one builder of valid trade events, as the JSON the worker consumes.
//!
//! The default is the README's example trade; tests change only the fields
//! they vary. Fields come out in the README's order (`serde_json` keeps
//! insertion order in this build), so payloads read like the documented
//! input and text edits on them (`replace("\"price\":...")`) keep working.

use serde_json::{Map, Value};

/// A valid trade event under construction. Every field is a JSON value so
/// tests can give a number where a string is usual (`customerId` 123 or
/// "c-7", `date` as epoch milliseconds or RFC 3339, `qty` as a decimal
/// string).
#[derive(Debug, Clone)]
pub struct TradeEvent {
    /// `None` for an event without `tradeId` (identity by offset).
    trade_id: Option<Value>,
    customer: Value,
    side: Value,
    ticker: Value,
    qty: Value,
    /// Optional in the input format.
    price: Option<Value>,
    /// Optional in the input format.
    currency: Option<Value>,
    date: Value,
}

impl Default for TradeEvent {
    /// The README's example trade.
    fn default() -> Self {
        TradeEvent {
            trade_id: Some("T-9001".into()),
            customer: 123.into(),
            side: "buy".into(),
            ticker: "MDB".into(),
            qty: 419.into(),
            price: Some("61.25".into()),
            currency: Some("USD".into()),
            date: "2023-10-26T15:47:03.434Z".into(),
        }
    }
}

/// The README's example trade with the given `tradeId`.
pub fn trade(id: impl Into<String>) -> TradeEvent {
    TradeEvent::default().id(id)
}

impl TradeEvent {
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.trade_id = Some(Value::String(id.into()));
        self
    }

    /// No `tradeId`: the worker identifies the trade by its offset.
    pub fn no_id(mut self) -> Self {
        self.trade_id = None;
        self
    }

    pub fn customer(mut self, customer: impl Into<Value>) -> Self {
        self.customer = customer.into();
        self
    }

    /// `buy` or `sell`.
    pub fn side(mut self, side: &str) -> Self {
        self.side = side.into();
        self
    }

    pub fn ticker(mut self, ticker: &str) -> Self {
        self.ticker = ticker.into();
        self
    }

    pub fn qty(mut self, qty: impl Into<Value>) -> Self {
        self.qty = qty.into();
        self
    }

    pub fn price(mut self, price: impl Into<Value>) -> Self {
        self.price = Some(price.into());
        self
    }

    pub fn no_price(mut self) -> Self {
        self.price = None;
        self
    }

    pub fn currency(mut self, currency: &str) -> Self {
        self.currency = Some(currency.into());
        self
    }

    pub fn no_currency(mut self) -> Self {
        self.currency = None;
        self
    }

    /// RFC 3339 text or epoch milliseconds.
    pub fn date(mut self, date: impl Into<Value>) -> Self {
        self.date = date.into();
        self
    }

    /// The fields present, in the README's order.
    pub fn fields(&self) -> Vec<(&'static str, Value)> {
        [
            ("tradeId", self.trade_id.clone()),
            ("customerId", Some(self.customer.clone())),
            ("type", Some(self.side.clone())),
            ("ticker", Some(self.ticker.clone())),
            ("qty", Some(self.qty.clone())),
            ("price", self.price.clone()),
            ("currency", self.currency.clone()),
            ("date", Some(self.date.clone())),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k, v?)))
        .collect()
    }

    /// The event as a JSON object (to edit further or to produce).
    pub fn json(&self) -> Value {
        let map: Map<String, Value> = self
            .fields()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        Value::Object(map)
    }

    /// The event as a Kafka payload.
    pub fn payload(&self) -> Vec<u8> {
        self.json().to_string().into_bytes()
    }
}

/// `payload` decoded as the worker decodes it, read at `offset` of
/// partition 0 of `topic`, for tests that drive the bucket writer
/// directly; panics if the decoder rejects it.
pub fn decoded(
    payload: &[u8],
    topic: &str,
    offset: i64,
    max_message_bytes: usize,
) -> (tradebucket::event::Trade, tradebucket::event::Source) {
    let source = tradebucket::event::Source {
        topic: topic.into(),
        partition: 0,
        offset,
    };
    let trade = tradebucket::event::decode(Some(payload), &source, max_message_bytes)
        .unwrap_or_else(|r| panic!("test event at offset {offset} rejected: {r:?}"));
    (trade, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_readme_example_in_its_order() {
        assert_eq!(
            TradeEvent::default().json().to_string(),
            r#"{"tradeId":"T-9001","customerId":123,"type":"buy","ticker":"MDB","qty":419,"price":"61.25","currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#
        );
    }

    #[test]
    fn every_built_event_is_accepted_by_the_decoder() {
        let source = tradebucket::event::Source {
            topic: "t".into(),
            partition: 0,
            offset: 7,
        };
        for e in [
            TradeEvent::default(),
            trade("x").no_id().no_price().no_currency(),
            trade("y")
                .customer("c-7")
                .side("sell")
                .qty("0.5")
                .date(1_700_000_000_000i64),
        ] {
            let decoded = tradebucket::event::decode(Some(&e.payload()), &source, 1 << 20);
            assert!(decoded.is_ok(), "{}: {decoded:?}", e.json());
        }
    }
}
