use apache_avro::types::Value as V;
use proptest::prelude::*;

use super::*;
use crate::event::{decode, Source};

/// The product's trade, as `produce` and the test kit write it.
pub(super) const TRADE: &str = r#"{"type":"record","name":"Trade","namespace":"t","fields":[
  {"name":"tradeId","type":"string"},
  {"name":"customerId","type":"long"},
  {"name":"type","type":{"type":"enum","name":"Side","symbols":["buy","sell"]}},
  {"name":"ticker","type":"string"},
  {"name":"qty","type":"long"},
  {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":20,"scale":4}},
  {"name":"currency","type":["null","string"],"default":null},
  {"name":"date","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;

// The deprecated one-call writer is enough to make test bytes.
#[allow(deprecated)]
fn encode(schema: &AvroSchema, value: V) -> Vec<u8> {
    apache_avro::to_avro_datum(schema.root(), value).unwrap()
}

fn trade_value(price_unscaled: &[u8]) -> V {
    V::Record(vec![
        ("tradeId".into(), V::String("E-1".into())),
        ("customerId".into(), V::Long(123)),
        ("type".into(), V::Enum(1, "sell".into())),
        ("ticker".into(), V::String("MDB".into())),
        ("qty".into(), V::Long(419)),
        ("price".into(), V::Decimal(price_unscaled.into())),
        (
            "currency".into(),
            V::Union(1, Box::new(V::String("USD".into()))),
        ),
        ("date".into(), V::TimestampMillis(1_698_335_223_434)),
    ])
}

#[test]
fn an_avro_trade_is_the_json_trade() {
    let schema = AvroSchema::parse(TRADE, &[]).unwrap();
    // 612500 at scale 4 is 61.2500.
    let datum = encode(&schema, trade_value(&612_500i32.to_be_bytes()));
    let json = schema.to_json(&datum, 1 << 20).unwrap();
    assert_eq!(
        json,
        r#"{"tradeId":"E-1","customerId":123,"type":"sell","ticker":"MDB","qty":419,"price":61.2500,"currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#
    );
    let source = Source {
        topic: "t".into(),
        partition: 0,
        offset: 0,
    };
    let from_avro = decode(Some(json.as_bytes()), &source, 1 << 20).unwrap();
    let written = r#"{"tradeId":"E-1","customerId":123,"type":"sell","ticker":"MDB","qty":419,
        "price":61.2500,"currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#;
    assert_eq!(
        from_avro,
        decode(Some(written.as_bytes()), &source, 1 << 20).unwrap()
    );
}

#[test]
fn bytes_that_are_not_a_datum_are_invalid_format_not_a_panic() {
    let schema = AvroSchema::parse(TRADE, &[]).unwrap();
    for bad in [
        &b""[..],
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        b"\x02a",
    ] {
        let e = schema.to_json(bad, 1 << 20).unwrap_err();
        assert_eq!(e.kind, RejectKind::InvalidFormat, "{e}");
    }
    let mut datum = encode(&schema, trade_value(&[1]));
    datum.push(0);
    assert_eq!(
        schema.to_json(&datum, 1 << 20).unwrap_err().kind,
        RejectKind::InvalidFormat
    );
}

#[test]
fn decimals_are_written_digit_for_digit() {
    assert_eq!(decimal_text(&[], 2).unwrap(), "0.00");
    assert_eq!(decimal_text(&[0x00], 0).unwrap(), "0");
    assert_eq!(decimal_text(&[0xff], 0).unwrap(), "-1");
    assert_eq!(decimal_text(&[0xff], 3).unwrap(), "-0.001");
    assert_eq!(decimal_text(&[0x30, 0x39], 2).unwrap(), "123.45");
    assert_eq!(decimal_text(&[0x80], 0).unwrap(), "-128");
    // 34 nines: Decimal128's largest coefficient, past any float.
    let big: u128 = 9_999_999_999_999_999_999_999_999_999_999_999;
    assert_eq!(
        decimal_text(&big.to_be_bytes(), 2).unwrap(),
        "99999999999999999999999999999999.99"
    );
    assert!(decimal_text(&[1; 65], 0).is_err());
}

#[test]
fn timestamps_keep_their_precision() {
    let mut out = String::new();
    push_instant(&mut out, 1_698_335_223_434_567, 1_000_000, true);
    assert_eq!(out, "\"2023-10-26T15:47:03.434567Z\"");
    out.clear();
    push_instant(&mut out, -1, 1_000, false);
    assert_eq!(out, "\"1969-12-31T23:59:59.999\"");
}

#[test]
fn base64_is_standard_with_padding() {
    for (bytes, text) in [
        (&b""[..], ""),
        (b"f", "Zg=="),
        (b"fo", "Zm8="),
        (b"foo", "Zm9v"),
    ] {
        let mut out = String::new();
        base64(&mut out, bytes);
        assert_eq!(out, text);
    }
}

proptest! {
    #[test]
    fn decimal_text_is_the_integer_at_its_scale(n in any::<i128>(), scale in 0usize..40) {
        let bytes = n.to_be_bytes();
        let text = decimal_text(&bytes, scale).unwrap();
        let digits: String = text.chars().filter(|c| c.is_ascii_digit()).collect();
        let unscaled: i128 = format!("{}{}", if n < 0 { "-" } else { "" }, digits).parse().unwrap();
        prop_assert_eq!(unscaled, n);
        prop_assert_eq!(text.split('.').nth(1).map_or(0, str::len), scale);
        prop_assert!(crate::event::values::is_json_number(&text), "{}", text);
    }
}

proptest! {
    /// The writer's own string path (no escapes needed) gives serde_json's
    /// text exactly, for any string, escapes and control characters
    /// included.
    #[test]
    fn strings_are_written_as_serde_json_writes_them(s in any::<String>(), plain in "[a-zA-Z0-9 ./_-]{0,20}") {
        for text in [&s, &plain] {
            let mut out = String::new();
            push_json_string(&mut out, text);
            prop_assert_eq!(out, serde_json::to_string(text).unwrap());
        }
    }
}
