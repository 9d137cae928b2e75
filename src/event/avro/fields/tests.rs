//! The direct reader held to `to_json` and the JSON path, its oracle:
//! every datum of several schemas, at every size limit around its text,
//! and corrupted.

use apache_avro::types::Value as V;
use apache_avro::Decimal;
use proptest::collection::vec;
use proptest::prelude::*;

use super::super::tests::TRADE;
use super::super::AvroSchema;
use crate::event::{decode_as, Identity, Reject, RejectKind, Source, Trade};

/// Every scalar kind, in trade fields and extras: unions of several
/// branches, fixed decimals, a reused named type, a nanosecond date,
/// a trade id that is a number or text, text where numbers go.
const VARIED: &str = r#"{"type":"record","name":"Varied","namespace":"v","fields":[
  {"name":"tradeId","type":["null","long","string"]},
  {"name":"customerId","type":["string","long","double"]},
  {"name":"type","type":["string",{"type":"enum","name":"Side","symbols":["buy","sell","BUY","hold"]}]},
  {"name":"ticker","type":["null","string","int"]},
  {"name":"quantity","type":["long",{"type":"bytes","logicalType":"decimal","precision":30,"scale":3},"string","float"]},
  {"name":"price","type":["null",{"type":"fixed","name":"Cents","size":3,"logicalType":"decimal","precision":7,"scale":2},"double"]},
  {"name":"currency","type":["null","string","boolean"]},
  {"name":"date","type":[{"type":"long","logicalType":"timestamp-nanos"},"string","null"]},
  {"name":"side2","type":"Side"},
  {"name":"flag","type":"boolean"},
  {"name":"ratio","type":"float"},
  {"name":"blob","type":"bytes"},
  {"name":"tag","type":{"type":"fixed","name":"Tag","size":2}},
  {"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}},
  {"name":"clock","type":{"type":"int","logicalType":"time-millis"}},
  {"name":"nothing","type":"null"},
  {"name":"note","type":["null","string"]}]}"#;

/// The trade schema after evolution, its date in microseconds: a text
/// field last, where apache-avro reads a datum cut off inside it as null.
const EVOLVED: &str = r#"{"type":"record","name":"Trade","namespace":"t","fields":[
  {"name":"tradeId","type":"string"},
  {"name":"customerId","type":"long"},
  {"name":"type","type":{"type":"enum","name":"Side","symbols":["buy","sell"]}},
  {"name":"ticker","type":"string"},
  {"name":"qty","type":"long"},
  {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":20,"scale":2}},
  {"name":"date","type":{"type":"long","logicalType":"timestamp-micros"}},
  {"name":"venue","type":"string","default":"XNAS"}]}"#;

const SCHEMAS: [&str; 3] = [TRADE, VARIED, EVOLVED];

fn source() -> Source {
    Source {
        topic: "trades".into(),
        partition: 3,
        offset: 77,
    }
}

/// The oracle: the datum's JSON text read by the JSON path.
fn by_json(schema: &AvroSchema, datum: &[u8], limit: usize) -> Result<Trade, Reject> {
    let json = schema.to_json(datum, limit)?;
    decode_as(Some(json.as_bytes()), Identity::Read(&source()), limit)
}

fn direct(schema: &AvroSchema, datum: &[u8], limit: usize) -> Result<Trade, Reject> {
    let fields = schema
        .fields(datum, limit)
        .expect("a scalar schema has a plan");
    fields?.into_trade(Identity::Read(&source()))
}

/// The same trade, or the same rejection; a datum's own faults are
/// reported in words of each reader's own.
fn assert_same(got: &Result<Trade, Reject>, want: &Result<Trade, Reject>) {
    match (got, want) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) if a.kind == RejectKind::InvalidFormat => assert_eq!(a.kind, b.kind),
        (Err(a), Err(b)) => assert_eq!(a, b),
        _ => panic!("direct {got:?}, by JSON {want:?}"),
    }
}

// The deprecated one-call writer is enough to make test bytes.
#[allow(deprecated)]
fn encode(schema: &AvroSchema, value: V) -> Vec<u8> {
    apache_avro::to_avro_datum(schema.root(), value).unwrap()
}

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        "[A-Za-z0-9 ._-]{0,10}",
        Just("buy".to_string()),
        Just("SELL".to_string()),
        Just("USD".to_string()),
        Just("42".to_string()),
        Just("2023-10-26T15:47:03.434+02:00".to_string()),
        Just("a\"b\\c\u{1}".to_string()),
        any::<String>(),
    ]
    .boxed()
}

fn instant(per_second: i64) -> BoxedStrategy<i64> {
    let ms = 1_000_000_000_000i64;
    prop_oneof![
        (0..12 * ms).prop_map(move |t| t.saturating_mul(per_second / 1_000)),
        (-1_000..1_000i64),
        any::<i64>(),
    ]
    .boxed()
}

/// Any value of `schema` (`names`: the named types a `Ref` stands for).
fn value(schema: &apache_avro::Schema, names: &AvroSchema) -> BoxedStrategy<V> {
    use apache_avro::schema::{InnerDecimalSchema, Schema as S};
    match schema {
        S::Null => Just(V::Null).boxed(),
        S::Boolean => any::<bool>().prop_map(V::Boolean).boxed(),
        S::Int => any::<i32>().prop_map(V::Int).boxed(),
        S::TimeMillis => any::<i32>().prop_map(V::TimeMillis).boxed(),
        S::Long => prop_oneof![1..1_000i64, any::<i64>()]
            .prop_map(V::Long)
            .boxed(),
        S::Float => any::<f32>().prop_map(V::Float).boxed(),
        S::Double => any::<f64>().prop_map(V::Double).boxed(),
        S::String => text().prop_map(V::String).boxed(),
        S::Bytes => vec(any::<u8>(), 0..6).prop_map(V::Bytes).boxed(),
        S::Fixed(f) => {
            let size = f.size;
            vec(any::<u8>(), size)
                .prop_map(move |b| V::Fixed(size, b))
                .boxed()
        }
        S::Enum(e) => {
            let symbols = e.symbols.clone();
            (0..symbols.len())
                .prop_map(move |i| V::Enum(i as u32, symbols[i].clone()))
                .boxed()
        }
        S::Decimal(d) => match &d.inner {
            InnerDecimalSchema::Bytes => vec(any::<u8>(), 1..20),
            InnerDecimalSchema::Fixed(f) => vec(any::<u8>(), f.size..=f.size),
        }
        .prop_map(|b| V::Decimal(Decimal::from(b)))
        .boxed(),
        S::TimestampMillis => instant(1_000).prop_map(V::TimestampMillis).boxed(),
        S::TimestampMicros => instant(1_000_000).prop_map(V::TimestampMicros).boxed(),
        S::TimestampNanos => instant(1_000_000_000).prop_map(V::TimestampNanos).boxed(),
        S::Union(u) => {
            let branches: Vec<_> = u.variants().iter().map(|v| value(v, names)).collect();
            (0..branches.len(), branches)
                .prop_map(|(i, mut values)| V::Union(i as u32, Box::new(values.swap_remove(i))))
                .boxed()
        }
        S::Ref { name } => value(&names.names[name], names),
        other => panic!("no values drawn for {other:?}"),
    }
}

/// A schema of [`SCHEMAS`] and a datum of it.
fn datum() -> impl Strategy<Value = (usize, Vec<u8>)> {
    (0..SCHEMAS.len()).prop_flat_map(|i| {
        let schema = AvroSchema::parse(SCHEMAS[i], &[]).unwrap();
        let apache_avro::Schema::Record(record) = schema.root() else {
            unreachable!("every schema here is a record")
        };
        let fields: Vec<_> = record
            .fields
            .iter()
            .map(|f| {
                let name = f.name.clone();
                value(&f.schema, &schema).prop_map(move |v| (name.clone(), v))
            })
            .collect();
        fields.prop_map(move |fields| (i, encode(&schema, V::Record(fields))))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    /// Every datum: the same trade or refusal, with no limit, and at the
    /// limits around its JSON text's length (where it is refused for its
    /// size, or just not).
    #[test]
    fn a_datum_reads_as_its_json_text_does((i, datum) in datum(), cut in 0usize..400) {
        let schema = AvroSchema::parse(SCHEMAS[i], &[]).unwrap();
        assert_same(&direct(&schema, &datum, 1 << 20), &by_json(&schema, &datum, 1 << 20));
        let len = schema.to_json(&datum, 1 << 20).map_or(cut, |j| j.len());
        for limit in [len.saturating_sub(1), len, len + 1, cut.min(len)] {
            assert_same(&direct(&schema, &datum, limit), &by_json(&schema, &datum, limit));
        }
    }

    /// A corrupted datum (a byte changed, cut short, bytes added) is
    /// never read into a trade the JSON path refuses or reads otherwise.
    /// The direct reader refuses more, and only as `invalid_format`:
    /// apache-avro reads a string or boolean cut off at the end as null.
    #[test]
    fn a_corrupted_datum_is_never_read_into_another_trade(
        (i, mut datum) in datum(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        how in 0..3u8,
    ) {
        let schema = AvroSchema::parse(SCHEMAS[i], &[]).unwrap();
        let at = at.index(datum.len().max(1));
        match how {
            0 if !datum.is_empty() => datum[at] = byte,
            1 => datum.truncate(at),
            _ => datum.extend([byte, 0]),
        }
        let (got, want) = (direct(&schema, &datum, 1 << 20), by_json(&schema, &datum, 1 << 20));
        match (&got, &want) {
            (Err(a), Ok(_)) => prop_assert_eq!(a.kind, RejectKind::InvalidFormat),
            (Err(a), Err(b)) if a.kind != b.kind => {
                prop_assert_eq!(a.kind, RejectKind::InvalidFormat)
            }
            (Err(_), Err(_)) => {}
            _ => assert_same(&got, &want),
        }
    }
}

#[test]
fn a_schema_with_a_record_array_map_or_date_field_has_no_plan() {
    for field in [
        r#"{"type":"record","name":"In","fields":[{"name":"a","type":"long"}]}"#,
        r#"{"type":"array","items":"long"}"#,
        r#"{"type":"map","values":"long"}"#,
        r#"{"type":"int","logicalType":"date"}"#,
        r#"{"type":"long","logicalType":"local-timestamp-millis"}"#,
        r#"{"type":"string","logicalType":"uuid"}"#,
        r#"["null",{"type":"array","items":"long"}]"#,
    ] {
        let text = format!(
            r#"{{"type":"record","name":"R","fields":[{{"name":"ticker","type":"string"}},{{"name":"x","type":{field}}}]}}"#
        );
        let schema = AvroSchema::parse(&text, &[]).unwrap();
        assert!(schema.fields(&[0, 0], 1 << 20).is_none(), "{field}");
    }
    let scalar = AvroSchema::parse(TRADE, &[]).unwrap();
    assert!(scalar.fields(&[], 1 << 20).is_some());
}

/// The one departure, shown: a datum cut inside its last string.
#[test]
fn a_datum_cut_inside_its_last_string_is_invalid_format_where_apache_avro_reads_null() {
    let schema = AvroSchema::parse(EVOLVED, &[]).unwrap();
    let datum = encode(
        &schema,
        V::Record(vec![
            ("tradeId".into(), V::String("E-1".into())),
            ("customerId".into(), V::Long(7)),
            ("type".into(), V::Enum(0, "buy".into())),
            ("ticker".into(), V::String("MDB".into())),
            ("qty".into(), V::Long(5)),
            ("price".into(), V::Decimal(Decimal::from(vec![0x30, 0x39]))),
            ("date".into(), V::TimestampMicros(1_698_335_223_434_567)),
            ("venue".into(), V::String("XNYS".into())),
        ]),
    );
    let whole = direct(&schema, &datum, 1 << 20).unwrap();
    assert_eq!(whole.entry().unwrap().get_str("venue"), Ok("XNYS"));
    let cut = &datum[..datum.len() - 2];
    assert!(schema
        .to_json(cut, 1 << 20)
        .unwrap()
        .ends_with(r#""venue":null}"#));
    let e = direct(&schema, cut, 1 << 20).unwrap_err();
    assert_eq!(e.kind, RejectKind::InvalidFormat, "{e}");
}
