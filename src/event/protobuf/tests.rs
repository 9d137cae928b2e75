use mongodb::bson::Bson;
use proptest::prelude::*;
use prost::Message as _;
use prost_reflect::{DynamicMessage, MessageDescriptor};

use super::*;
use crate::event::{decode, Source};

/// The trade as an upstream would define it: the date a
/// `google.protobuf.Timestamp`, money as decimal strings, the side an enum
/// whose 0 is a real value (`buy`), as many upstreams have it. `Book` is
/// a second top-level message with one nested, for the message indexes.
const TRADE: &str = r#"
syntax = "proto3";
package example.trades;
import "google/protobuf/timestamp.proto";

enum Side { buy = 0; sell = 1; }

message Trade {
  string trade_id = 1;
  int64 customer_id = 2;
  Side type = 3;
  string ticker = 4;
  int64 qty = 5;
  string price = 6;
  optional string currency = 7;
  google.protobuf.Timestamp date = 8;
  Venue venue = 9;
  message Venue { string mic = 1; int32 lane = 2; }
}

message Book {
  string name = 1;
  message Entry { int64 customer_id = 1; string ticker = 2; }
}
"#;

fn source() -> Source {
    Source {
        topic: "t".into(),
        partition: 0,
        offset: 0,
    }
}

/// `indexes` in the wire format (zig-zag varints, a lone 0 for `[0]`),
/// then the message built from its proto3 JSON form `json`.
fn payload(schema: &ProtoSchema, indexes: &[usize], json: &str) -> Vec<u8> {
    let desc = schema.message(indexes).expect("a message at these indexes");
    let mut de = serde_json::Deserializer::from_str(json);
    let message = DynamicMessage::deserialize(desc, &mut de).expect("the JSON form of a message");
    let mut out = if indexes == [0] {
        vec![0]
    } else {
        let mut v = zigzag(indexes.len() as i64);
        indexes.iter().for_each(|&i| v.extend(zigzag(i as i64)));
        v
    };
    out.extend(message.encode_to_vec());
    out
}

fn zigzag(v: i64) -> Vec<u8> {
    let mut u = ((v << 1) ^ (v >> 63)) as u64;
    let mut out = Vec::new();
    while u >= 0x80 {
        out.push((u as u8) | 0x80);
        u >>= 7;
    }
    out.push(u as u8);
    out
}

const A_TRADE: &str = r#"{"tradeId":"E-1","customerId":"123","type":"sell","ticker":"MDB",
    "qty":"419","price":"61.2500","currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#;

#[test]
fn a_protobuf_trade_is_the_json_trade() {
    let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
    let json = schema
        .to_json(&payload(&schema, &[0], A_TRADE), 1 << 20)
        .unwrap();
    // JSON names, 64-bit integers as numbers, the money's text as written
    // (its scale kept), the Timestamp as the RFC 3339 date.
    assert_eq!(
        json,
        r#"{"tradeId":"E-1","customerId":123,"type":"sell","ticker":"MDB","qty":419,"price":"61.2500","currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#
    );
    let from_proto = decode(Some(json.as_bytes()), &source(), 1 << 20).unwrap();
    let written = r#"{"tradeId":"E-1","customerId":123,"type":"sell","ticker":"MDB","qty":419,
        "price":"61.2500","currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#;
    assert_eq!(
        from_proto,
        decode(Some(written.as_bytes()), &source(), 1 << 20).unwrap()
    );
    match from_proto.entry().unwrap().get("price") {
        Some(Bson::Decimal128(d)) => assert_eq!(d.to_string(), "61.2500", "exact, scale kept"),
        other => panic!("price is not a Decimal128: {other:?}"),
    }
}

#[test]
fn an_enum_or_number_at_its_proto3_default_is_still_written() {
    // `buy` is the enum's 0 and qty 0 is a number like any other: left
    // out, the trade would miss `type` or `qty` and be dead-lettered.
    let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
    let buy = A_TRADE.replace(r#""sell""#, r#""buy""#);
    let json = schema
        .to_json(&payload(&schema, &[0], &buy), 1 << 20)
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["type"], "buy", "{json}");
    let trade = decode(Some(json.as_bytes()), &source(), 1 << 20).unwrap();
    assert_eq!(trade.doc.get_str("type").unwrap(), "buy");
    // An unset optional field (with presence) stays absent, not "".
    let no_currency = A_TRADE.replace(r#""currency":"USD","#, "");
    let json = schema
        .to_json(&payload(&schema, &[0], &no_currency), 1 << 20)
        .unwrap();
    assert!(!json.contains("currency"), "{json}");
    assert!(decode(Some(json.as_bytes()), &source(), 1 << 20).is_ok());
    // A plain string left unset is "", refused by name as from JSON.
    let no_price = A_TRADE.replace(r#""price":"61.2500","#, "");
    let json = schema
        .to_json(&payload(&schema, &[0], &no_price), 1 << 20)
        .unwrap();
    assert!(json.contains(r#""price":"""#), "{json}");
    let e = decode(Some(json.as_bytes()), &source(), 1 << 20).unwrap_err();
    assert_eq!(e.kind, RejectKind::InvalidField, "{e}");
    assert!(e.to_string().contains("price"), "{e}");
}

#[test]
fn a_nested_message_is_an_object_kept_as_an_extra() {
    let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
    let with_venue = A_TRADE.replace(r#""qty""#, r#""venue":{"mic":"XNAS","lane":3},"qty""#);
    let json = schema
        .to_json(&payload(&schema, &[0], &with_venue), 1 << 20)
        .unwrap();
    let trade = decode(Some(json.as_bytes()), &source(), 1 << 20).unwrap();
    let venue = trade.doc.get_document("venue").unwrap();
    assert_eq!(venue.get_str("mic").unwrap(), "XNAS");
    assert_eq!(venue.get_i32("lane").unwrap(), 3);
}

#[test]
fn message_indexes_pick_the_message() {
    let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
    let desc = |i: &[usize]| schema.message(i).map(|m| m.full_name().to_string());
    assert_eq!(desc(&[0]).as_deref(), Some("example.trades.Trade"));
    assert_eq!(desc(&[0, 0]).as_deref(), Some("example.trades.Trade.Venue"));
    assert_eq!(desc(&[1]).as_deref(), Some("example.trades.Book"));
    assert_eq!(desc(&[1, 0]).as_deref(), Some("example.trades.Book.Entry"));
    assert_eq!(desc(&[2]), None);
    assert_eq!(desc(&[]), None);

    let entry = payload(&schema, &[1, 0], r#"{"customerId":"7","ticker":"MDB"}"#);
    assert_eq!(entry[..3], [4, 2, 0], "count 2, then 1 and 0, zig-zag");
    assert_eq!(
        schema.to_json(&entry, 1 << 20).unwrap(),
        r#"{"customerId":7,"ticker":"MDB"}"#
    );
    // Indexes past the file's messages: a clear rejection.
    let mut bad = zigzag(1);
    bad.extend(zigzag(5));
    let e = schema.to_json(&bad, 1 << 20).unwrap_err();
    assert_eq!(e.kind, RejectKind::InvalidFormat);
    assert!(e.to_string().contains("name no message"), "{e}");
}

#[test]
fn a_registered_file_descriptor_reads_as_its_text_does() {
    // What confluent-kafka's ProtobufSerializer registers: the file's
    // FileDescriptorProto in base64, the well-known import unreferenced.
    let from_text = ProtoSchema::parse(TRADE, &[]).unwrap();
    let file = from_text
        .pool
        .get_file_by_name(&from_text.file)
        .unwrap()
        .file_descriptor_proto()
        .clone();
    let mut proto = file;
    proto.name = Some("example/trades.proto".into());
    let text = base64_encode(&proto.encode_to_vec());
    let from_descriptor = ProtoSchema::parse(&text, &[]).unwrap();
    let data = payload(&from_text, &[0], A_TRADE);
    assert_eq!(
        from_descriptor.to_json(&data, 1 << 20).unwrap(),
        from_text.to_json(&data, 1 << 20).unwrap()
    );
}

#[test]
fn a_reference_is_imported_under_its_name() {
    let money =
        "syntax = \"proto3\"; package m; message Money { string amount = 1; string currency = 2; }";
    let order = "syntax = \"proto3\"; import \"shared/money.proto\"; message Order { string id = 1; m.Money total = 2; }";
    let schema = ProtoSchema::parse(order, &[("shared/money.proto".into(), money.into())]).unwrap();
    let data = payload(&schema, &[0], r#"{"id":"o","total":{"amount":"1.50"}}"#);
    assert_eq!(
        schema.to_json(&data, 1 << 20).unwrap(),
        r#"{"id":"o","total":{"amount":"1.50","currency":""}}"#
    );
    // Without it the schema is refused, with the reason.
    let e = ProtoSchema::parse(order, &[]).unwrap_err();
    assert!(e.contains("shared/money.proto"), "{e}");
}

#[test]
fn text_that_is_no_schema_is_refused_with_its_reason() {
    for (text, why) in [
        ("syntax = \"proto3\"; message {", "expected"),
        ("syntax = \"proto3\"; enum E { A = 0; }", "no message"),
        ("", "no message"),
        ("AAAA", ""),
    ] {
        let e = ProtoSchema::parse(text, &[]).unwrap_err();
        assert!(e.contains(why), "{text:?}: {e}");
    }
}

#[test]
fn bytes_that_are_not_the_message_are_invalid_format_not_a_panic() {
    let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
    let good = payload(&schema, &[0], A_TRADE);
    for bad in [
        &b""[..],
        &[0x80],
        // The first message, then a field 1 whose length runs past the end.
        &[0x00, 0x0a, 0x7f, b'x'],
        // A field of wire type 7, which does not exist.
        &[0x00, 0x0f],
        &good[..good.len() - 3],
    ] {
        let e = schema.to_json(bad, 1 << 20).unwrap_err();
        assert_eq!(e.kind, RejectKind::InvalidFormat, "{bad:?}: {e}");
    }
}

#[test]
fn a_record_over_the_limit_is_oversize() {
    let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
    let e = schema
        .to_json(&payload(&schema, &[0], A_TRADE), 40)
        .unwrap_err();
    assert_eq!(e.kind, RejectKind::Oversize, "{e}");
}

#[test]
fn standard_base64_is_read_and_anything_else_is_not() {
    assert_eq!(base64_decode("Zm9v").unwrap(), b"foo");
    assert_eq!(base64_decode("Zm8=").unwrap(), b"fo");
    assert_eq!(base64_decode("Zg==").unwrap(), b"f");
    assert_eq!(base64_decode("Zm9v-"), None);
    assert_eq!(descriptor_bytes("message A {}"), None);
    assert_eq!(descriptor_bytes("Zm9v").unwrap(), b"foo");
}

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    crate::event::avro::base64(&mut out, bytes);
    out
}

fn trade_descriptor() -> MessageDescriptor {
    ProtoSchema::parse(TRADE, &[])
        .unwrap()
        .message(&[0])
        .unwrap()
}

proptest! {
    #[test]
    fn any_bytes_give_json_or_a_rejection(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
        let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
        if let Err(e) = schema.to_json(&bytes, 1 << 20) {
            prop_assert!(matches!(e.kind, RejectKind::InvalidFormat | RejectKind::Oversize), "{}", e);
        }
    }

    #[test]
    fn a_mangled_trade_gives_json_or_a_rejection(cut in 0usize..60, flip in 0usize..60, bit in 0u8..8) {
        let desc = trade_descriptor();
        let mut de = serde_json::Deserializer::from_str(A_TRADE);
        let mut bytes = vec![0];
        bytes.extend(DynamicMessage::deserialize(desc, &mut de).unwrap().encode_to_vec());
        if let Some(b) = bytes.get_mut(flip) {
            *b ^= 1 << bit;
        }
        bytes.truncate(bytes.len().saturating_sub(cut));
        let schema = ProtoSchema::parse(TRADE, &[]).unwrap();
        let _ = schema.to_json(&bytes, 1 << 20);
    }
}
