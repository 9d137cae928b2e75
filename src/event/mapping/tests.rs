use super::*;
use crate::config::mapping::{validate, MappingSettings};
use proptest::prelude::*;

const MAX: usize = 65536;

fn src() -> Source {
    Source {
        topic: "t".into(),
        partition: 3,
        offset: 42,
    }
}

/// A mapping of topic `t` from the TOML of one `[[mappings]]` entry.
fn mapping(toml_text: &str) -> Mapping {
    let m: MappingSettings = toml::from_str(&format!("topic = \"t\"\n{toml_text}"))
        .unwrap_or_else(|e| panic!("{toml_text}: {e}"));
    let plans = validate(&["t".to_string()], &[m]).unwrap_or_else(|e| panic!("{e}"));
    Mapping::compile(&plans[0])
}

fn parts<'a>(payload: &'a str, key: Option<&'a str>, headers: &'a [Header]) -> RecordParts<'a> {
    RecordParts {
        payload: Some(payload.as_bytes()),
        key: key.map(str::as_bytes),
        headers,
    }
}

type Header = (Vec<u8>, Option<Vec<u8>>);

fn header(name: &str, value: &str) -> Header {
    (name.as_bytes().to_vec(), Some(value.as_bytes().to_vec()))
}

fn mapped(m: &Mapping, p: RecordParts<'_>) -> Result<Trade, Reject> {
    m.decode(p, Identity::Read(&src()), MAX)
}

fn default(json: &str) -> Trade {
    decode(Some(json.as_bytes()), &src(), MAX).unwrap_or_else(|e| panic!("{json}: {e}"))
}

const FIX: &str = r#"
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

const FIX_EXEC: &str = r#"{"Account":"123","Symbol":"MDB","Side":"1","LastQty":"419","LastPx":"61.25","Currency":"USD","TransactTime":"20231026-15:47:03.434","ExecID":"E-9001"}"#;

const NESTED: &str = r#"
keep = "none"
fields.customerId = { from = "/account/id" }
fields.type = { from = "/side", values = { buy = ["BUY"], sell = ["SELL"] }, unknown = "reject" }
fields.ticker = { from = "/instrument/ticker" }
fields.qty = { from = "/fill/qty" }
fields.price = { from = "/fill/px" }
fields.date = { from = "/ts", format = "epoch_millis" }
"#;

const NESTED_FILL: &str = r#"{"account":{"id":123},"instrument":{"ticker":"MDB"},"side":"BUY","fill":{"qty":419,"px":61.25},"ts":1698335223434}"#;

#[test]
fn a_fix_execution_report_is_stored_as_the_default_schema_stores_its_trade() {
    let t = mapped(&mapping(FIX), parts(FIX_EXEC, None, &[])).unwrap();
    let same = default(
        r#"{"tradeId":"E-9001","customerId":123,"type":"buy","ticker":"MDB","qty":419,"price":"61.25","currency":"USD","date":"2023-10-26T15:47:03.434Z"}"#,
    );
    assert_eq!(t, same);
    assert_eq!(t.customer, CustomerId::Int(123), "\"123\" is customer 123");
}

#[test]
fn a_nested_broker_fill_is_stored_as_the_default_schema_stores_its_trade() {
    let t = mapped(&mapping(NESTED), parts(NESTED_FILL, None, &[])).unwrap();
    let same = default(
        r#"{"customerId":123,"type":"buy","ticker":"MDB","qty":419,"price":61.25,"date":1698335223434}"#,
    );
    assert_eq!(t, same);
    assert_eq!(t.key, "o:t/3/42", "no trade id: the record's position");
}

#[test]
fn the_customer_from_the_key_and_the_trade_id_from_a_header() {
    let m = mapping(
        r#"
fields.customerId = { from = "key" }
fields.tradeId = { from = "header:exec-id" }
"#,
    );
    let payload = r#"{"type":"sell","ticker":"MDB","qty":"1.5","date":"2023-10-26T15:47:03Z"}"#;
    let hs = [header("exec-id", "E-1")];
    let t = mapped(&m, parts(payload, Some("0042"), &hs)).unwrap();
    assert_eq!(t.customer, CustomerId::Str("0042".into()));
    assert_eq!(t.key, "t:E-1");
    let t = mapped(&m, parts(payload, Some("42"), &hs)).unwrap();
    assert_eq!(
        t.customer,
        CustomerId::Int(42),
        "canonical, as in a payload"
    );
    // No header: the position is the identity, as without tradeId.
    let t = mapped(&m, parts(payload, Some("42"), &[])).unwrap();
    assert_eq!(t.key, "o:t/3/42");
    let twice = [header("exec-id", "E-1"), header("exec-id", "E-2")];
    let e = mapped(&m, parts(payload, Some("42"), &twice)).unwrap_err();
    assert_eq!(e.kind, RejectKind::InvalidField);
    assert!(e.message.contains("header:exec-id"), "{e}");
    let e = mapped(&m, parts(payload, None, &hs)).unwrap_err();
    assert_eq!(e.kind, RejectKind::MissingField);
    assert_eq!(e.message, "customerId is required: nothing at key");
    let e = mapped(&m, parts(payload, Some("a_b"), &hs)).unwrap_err();
    assert!(e.message.starts_with("customerId (from key): "), "{e}");
}

#[test]
fn a_side_outside_the_map_is_rejected_naming_the_value_and_the_pointer() {
    let m = mapping(FIX);
    let e = mapped(
        &m,
        parts(
            &FIX_EXEC.replace(r#""Side":"1""#, r#""Side":"5""#),
            None,
            &[],
        ),
    )
    .unwrap_err();
    assert_eq!(e.kind, RejectKind::InvalidField);
    assert_eq!(
        e.message,
        "type (from /Side): \"5\" is not in the value map, and unknown values are rejected"
    );
    // Numbers match their text.
    let t = mapped(
        &m,
        parts(&FIX_EXEC.replace(r#""Side":"1""#, r#""Side":2"#), None, &[]),
    );
    assert_eq!(t.unwrap().entry().unwrap().get_str("type").unwrap(), "sell");
    let lenient =
        mapping(r#"fields.type = { from = "/type", values = { buy = ["B"] }, unknown = "sell" }"#);
    let payload = r#"{"customerId":1,"type":"X","ticker":"A","qty":1,"date":0}"#;
    let t = mapped(&lenient, parts(payload, None, &[])).unwrap();
    assert_eq!(t.entry().unwrap().get_str("type").unwrap(), "sell");
}

#[test]
fn what_does_not_fit_names_the_field_and_the_pointer() {
    let m = mapping(NESTED);
    let cases = [
        (
            r#""fill":{"qty":419,"px":61.25}"#,
            r#""fill":{"px":61.25}"#,
            RejectKind::MissingField,
            "qty is required: nothing at /fill/qty",
        ),
        (
            r#""fill":{"qty":419,"px":61.25}"#,
            r#""fill":5"#,
            RejectKind::MissingField,
            "qty is required: nothing at /fill/qty",
        ),
        (
            r#""qty":419"#,
            r#""qty":-1"#,
            RejectKind::InvalidField,
            "qty (from /fill/qty): must be positive",
        ),
        (
            r#""px":61.25"#,
            r#""px":"x""#,
            RejectKind::InvalidField,
            "price (from /fill/px): must be a finite decimal number",
        ),
        (
            r#""ts":1698335223434"#,
            r#""ts":"soon""#,
            RejectKind::InvalidField,
            "date (from /ts): must be an integer count of epoch milliseconds",
        ),
        (
            r#""px":61.25"#,
            r#""px":61.25,"px":1"#,
            RejectKind::DuplicateField,
            "duplicate field \"px\"",
        ),
    ];
    for (from, to, kind, message) in cases {
        let e = mapped(&m, parts(&NESTED_FILL.replace(from, to), None, &[])).unwrap_err();
        assert_eq!(e.kind, kind, "{to}: {e}");
        assert!(e.message.starts_with(message), "{to}: {e}");
    }
}

#[test]
fn money_read_through_pointers_and_strings_stays_exact() {
    let m = mapping(NESTED);
    let exact = "1234567890123456789012345678.901234";
    for px in [exact.to_string(), format!("\"{exact}\"")] {
        let payload = NESTED_FILL.replace("61.25", &px);
        let t = mapped(&m, parts(&payload, None, &[])).unwrap();
        match t.entry().unwrap().get("price") {
            Some(Bson::Decimal128(d)) => assert_eq!(d.to_string(), exact),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn kept_fields_all_a_list_or_none() {
    let payload = r#"{"cust":7,"type":"buy","ticker":"A","qty":1,"date":0,"venue":"X","legs":[{"mic":"XNAS"}]}"#;
    let all = mapping(r#"fields.customerId = { from = "/cust" }"#);
    let entry = mapped(&all, parts(payload, None, &[]))
        .unwrap()
        .entry()
        .unwrap();
    assert_eq!(entry.get_str("venue").unwrap(), "X");
    assert!(
        entry.get("cust").is_none(),
        "read as the customer, not kept"
    );
    let table = mapping(
        r#"
fields.customerId = { from = "/cust" }
keep = { mic = "/legs/0/mic", place = "/venue" }
"#,
    );
    let entry = mapped(&table, parts(payload, None, &[]))
        .unwrap()
        .entry()
        .unwrap();
    assert_eq!(entry.get_str("mic").unwrap(), "XNAS");
    assert_eq!(entry.get_str("place").unwrap(), "X");
    assert!(entry.get("venue").is_none() && entry.get("legs").is_none());
    let none = mapping("fields.customerId = { from = \"/cust\" }\nkeep = \"none\"");
    let entry = mapped(&none, parts(payload, None, &[]))
        .unwrap()
        .entry()
        .unwrap();
    assert!(entry.get("venue").is_none());
    // A trade field's name, read elsewhere, is never kept as another field.
    let e = mapped(
        &all,
        parts(
            &payload.replace("\"cust\":7", "\"cust\":7,\"customerId\":8"),
            None,
            &[],
        ),
    )
    .unwrap_err();
    assert!(e.message.contains("reads customerId from /cust"), "{e}");
}

#[test]
fn every_date_format_reads_one_instant() {
    let instant = 1_698_335_223_434;
    let cases: [(&str, &str, i64, Option<i32>); 9] = [
        (
            "format = \"rfc3339\"",
            r#""2023-10-26T11:47:03.434-04:00""#,
            instant,
            Some(-240),
        ),
        (
            "format = \"epoch_seconds\"",
            "1698335223",
            1_698_335_223_000,
            None,
        ),
        (
            "format = \"epoch_millis\"",
            r#""1698335223434""#,
            instant,
            None,
        ),
        (
            "format = \"epoch_micros\"",
            "1698335223434999",
            instant,
            None,
        ),
        (
            "format = \"epoch_nanos\"",
            "1698335223434000001",
            instant,
            None,
        ),
        (
            "format = \"fix\"",
            r#""20231026-15:47:03.434""#,
            instant,
            None,
        ),
        (
            "format = \"fix\"",
            r#""20231026-15:47:03""#,
            1_698_335_223_000,
            None,
        ),
        (
            "format = \"pattern\", pattern = \"%d/%m/%Y %H:%M:%S%.3f %z\"",
            r#""26/10/2023 17:47:03.434 +0200""#,
            instant,
            Some(120),
        ),
        (
            "format = \"pattern\", pattern = \"%d.%m.%Y %H:%M:%S%.3f\", offset = \"+05:30\"",
            r#""26.10.2023 21:17:03.434""#,
            instant,
            Some(330),
        ),
    ];
    for (rule, value, ms, offset) in cases {
        let m = mapping(&format!("fields.date = {{ from = \"/d\", {rule} }}"));
        let payload =
            format!(r#"{{"customerId":1,"type":"buy","ticker":"A","qty":1,"d":{value}}}"#);
        let t = mapped(&m, parts(&payload, None, &[])).unwrap_or_else(|e| panic!("{rule}: {e}"));
        assert_eq!(t.date_ms, ms, "{rule}");
        assert_eq!(
            t.entry().unwrap().get_i32("offsetMinutes").ok(),
            offset,
            "{rule}"
        );
    }
    let m = mapping("fields.date = { from = \"/d\", format = \"fix\" }");
    let payload = r#"{"customerId":1,"type":"buy","ticker":"A","qty":1,"d":"2023-10-26"}"#;
    let e = mapped(&m, parts(payload, None, &[])).unwrap_err();
    assert!(
        e.message
            .starts_with("date (from /d): must be a FIX UTCTimestamp"),
        "{e}"
    );
}

#[test]
fn the_default_qty_alias_and_payload_rejects_behave_as_the_default_schema() {
    let m = mapping("fields.customerId = { from = \"/c\" }");
    let t = mapped(
        &m,
        parts(
            r#"{"c":1,"type":"buy","ticker":"A","quantity":3,"date":0}"#,
            None,
            &[],
        ),
    );
    assert_eq!(t.unwrap().entry().unwrap().get_i64("qty").unwrap(), 3);
    let e = mapped(
        &m,
        parts(
            r#"{"c":1,"type":"buy","ticker":"A","qty":1,"quantity":3,"date":0}"#,
            None,
            &[],
        ),
    );
    assert_eq!(e.unwrap_err().kind, RejectKind::DuplicateField);
    for (payload, kind) in [
        ("[1]", RejectKind::NotObject),
        ("{", RejectKind::NotJson),
        (r#"{"c":1,"c":2}"#, RejectKind::DuplicateField),
    ] {
        assert_eq!(
            mapped(&m, parts(payload, None, &[])).unwrap_err().kind,
            kind,
            "{payload}"
        );
    }
    let e = m
        .decode(RecordParts::default(), Identity::Read(&src()), MAX)
        .unwrap_err();
    assert_eq!(e.kind, RejectKind::Empty);
}

// The property: a trade, renamed and reshaped by a generated mapping,
// is stored exactly as the original under the default mapping.

#[derive(Debug, Clone)]
struct Original {
    trade_id: Option<Result<u32, String>>,
    customer: Result<u32, String>,
    buy: bool,
    ticker: String,
    qty: String,
    price: Option<String>,
    currency: Option<String>,
    /// UTC milliseconds, and an offset in minutes.
    date: (i64, i32),
    extras: Vec<(String, u32)>,
}

fn original() -> impl Strategy<Value = Original> {
    (
        proptest::option::of(prop_oneof![
            any::<u32>().prop_map(Ok),
            "[A-Za-z0-9-]{1,12}".prop_map(Err)
        ]),
        prop_oneof![
            any::<u32>().prop_map(Ok),
            "[A-Za-z0-9-]{1,12}".prop_map(Err)
        ],
        any::<bool>(),
        "[A-Z]{1,5}",
        prop_oneof!["[1-9][0-9]{0,8}", "(0|[1-9][0-9]{0,5})\\.[0-9]{0,6}[1-9]"],
        proptest::option::of("(0|[1-9][0-9]{0,8})(\\.[0-9]{1,4})?"),
        proptest::option::of("[A-Z]{3}"),
        (0i64..4_000_000_000_000, prop_oneof![Just(0), -720i32..=840]),
        proptest::collection::vec(("[a-z]{1,6}", any::<u32>()), 0..4),
    )
        .prop_map(
            |(trade_id, customer, buy, ticker, qty, price, currency, date, extras)| {
                let mut seen = Vec::new();
                let extras = extras
                    .into_iter()
                    .filter(|(n, _)| {
                        let fresh = !seen.contains(n);
                        seen.push(n.clone());
                        fresh
                    })
                    .map(|(n, v)| (format!("x{n}"), v))
                    .collect();
                Original {
                    trade_id,
                    customer,
                    buy,
                    ticker,
                    qty,
                    price,
                    currency,
                    date,
                    extras,
                }
            },
        )
}

fn id_json(id: &Result<u32, String>) -> String {
    match id {
        Ok(n) => n.to_string(),
        Err(s) => format!("{s:?}"),
    }
}

fn rfc3339(ms: i64, offset_minutes: i32) -> String {
    let at = chrono::FixedOffset::east_opt(offset_minutes * 60).unwrap();
    let dt = chrono::DateTime::from_timestamp_millis(ms)
        .unwrap()
        .with_timezone(&at);
    dt.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl Original {
    /// The default schema's payload.
    fn payload(&self) -> String {
        let mut f = vec![("customerId".to_string(), id_json(&self.customer))];
        if let Some(id) = &self.trade_id {
            f.push(("tradeId".into(), id_json(id)));
        }
        f.push((
            "type".into(),
            format!("{:?}", if self.buy { "buy" } else { "sell" }),
        ));
        f.push(("ticker".into(), format!("{:?}", self.ticker)));
        f.push(("qty".into(), self.qty.clone()));
        if let Some(p) = &self.price {
            f.push(("price".into(), p.clone()));
        }
        if let Some(c) = &self.currency {
            f.push(("currency".into(), format!("{c:?}")));
        }
        f.push((
            "date".into(),
            format!("{:?}", rfc3339(self.date.0, self.date.1)),
        ));
        f.extend(self.extras.iter().map(|(n, v)| (n.clone(), v.to_string())));
        object(&f)
    }
}

fn object(fields: &[(String, String)]) -> String {
    let body: Vec<String> = fields.iter().map(|(k, v)| format!("{k:?}:{v}")).collect();
    format!("{{{}}}", body.join(","))
}

/// A JSON tree being built from pointers.
#[derive(Default)]
struct Tree(Vec<(String, Result<String, Tree>)>);

impl Tree {
    fn put(&mut self, path: &[String], value: String) {
        match path {
            [last] => self.0.push((last.clone(), Ok(value))),
            [first, rest @ ..] => {
                let at = match self.0.iter().position(|(n, v)| n == first && v.is_err()) {
                    Some(i) => i,
                    None => {
                        self.0.push((first.clone(), Err(Tree::default())));
                        self.0.len() - 1
                    }
                };
                if let Err(t) = &mut self.0[at].1 {
                    t.put(rest, value);
                }
            }
            [] => {}
        }
    }

    fn json(&self) -> String {
        let f: Vec<(String, String)> = self
            .0
            .iter()
            .map(|(n, v)| (n.clone(), v.as_ref().map_or_else(Tree::json, Clone::clone)))
            .collect();
        object(&f)
    }
}

/// The mapped record: payload, key, headers and the mapping's TOML.
struct Reshaped {
    payload: String,
    key: Option<String>,
    headers: Vec<Header>,
    toml: String,
}

/// Builds a reshaped record field by field, each in a place `rng` picks.
struct Shaper {
    rng: rand::rngs::StdRng,
    r: Reshaped,
    tree: Tree,
}

impl Shaper {
    /// Places one field's value (`json`; `text` is what a key or header
    /// holds, `None` when only JSON can say it) and maps it (`rule`).
    fn place(&mut self, field: &str, json: String, text: Option<String>, rule: &str) {
        use rand::Rng;
        let from = match (self.rng.random_range(0..6), text) {
            (0, Some(t)) if self.r.key.is_none() => {
                self.r.key = Some(t);
                "key".to_string()
            }
            (1, Some(t)) => {
                let name = format!("h-{field}");
                self.r.headers.push(header(&name, &t));
                format!("header:{name}")
            }
            _ => {
                let depth = self.rng.random_range(0..3);
                let mut path = vec![format!("{field}F")];
                path.extend((0..depth).map(|_| format!("{field}{}", self.rng.random_range(0..3))));
                self.tree.put(&path, json);
                path.iter().map(|s| format!("/{s}")).collect()
            }
        };
        self.r.toml += &format!("fields.{field} = {{ from = {from:?}{rule} }}\n");
    }

    /// A decimal as a JSON number or a JSON string, at random.
    fn number(&mut self, text: &str) -> String {
        use rand::Rng;
        if self.rng.random() {
            text.to_string()
        } else {
            format!("{text:?}")
        }
    }

    /// The extras, under their names (`keep = "all"`) or renamed and kept
    /// by a table.
    fn keep(&mut self, extras: &[(String, u32)]) {
        use rand::Rng;
        let renamed = self.rng.random::<bool>();
        let mut keep = Vec::new();
        for (n, v) in extras {
            let stored = if renamed { format!("k{n}") } else { n.clone() };
            self.tree.0.push((stored.clone(), Ok(v.to_string())));
            keep.push(format!("{n} = \"/{stored}\""));
        }
        self.r.toml += &if renamed {
            format!("keep = {{ {} }}\n", keep.join(", "))
        } else {
            "keep = \"all\"\n".into()
        };
    }
}

const SIDES: &str =
    r#", values = { buy = ["B", "1", "BUY"], sell = ["S", "2", "SELL"] }, unknown = "reject""#;

/// `original` reshaped by choices drawn from `seed`.
fn reshape(o: &Original, seed: u64) -> Reshaped {
    use rand::{Rng, SeedableRng};
    let mut s = Shaper {
        rng: rand::rngs::StdRng::seed_from_u64(seed),
        r: Reshaped {
            payload: String::new(),
            key: None,
            headers: Vec::new(),
            toml: String::new(),
        },
        tree: Tree::default(),
    };
    let text = |id: &Result<u32, String>| id.as_ref().map_or_else(Clone::clone, u32::to_string);
    s.place(
        "customerId",
        id_json(&o.customer),
        Some(text(&o.customer)),
        "",
    );
    if let Some(id) = &o.trade_id {
        // An integer id is an integer only in JSON; a key or header is text.
        s.place("tradeId", id_json(id), id.as_ref().err().cloned(), "");
    }
    let spellings = if o.buy {
        ["B", "1", "BUY"]
    } else {
        ["S", "2", "SELL"]
    };
    let spelling = spellings[s.rng.random_range(0..3)];
    s.place(
        "type",
        format!("{spelling:?}"),
        Some(spelling.into()),
        SIDES,
    );
    s.place(
        "ticker",
        format!("{:?}", o.ticker),
        Some(o.ticker.clone()),
        "",
    );
    let qty = s.number(&o.qty);
    s.place("qty", qty, Some(o.qty.clone()), "");
    if let Some(p) = &o.price {
        let price = s.number(p);
        s.place("price", price, Some(p.clone()), "");
    }
    if let Some(c) = &o.currency {
        s.place("currency", format!("{c:?}"), Some(c.clone()), "");
    }
    let (date_json, rule) = date_as(o.date, &mut s.rng);
    let date_text = serde_json::from_str::<String>(&date_json).unwrap_or(date_json.clone());
    s.place("date", date_json, Some(date_text), &rule);
    s.keep(&o.extras);
    s.r.payload = s.tree.json();
    s.r
}

/// The date in a format chosen by `rng`, and the rule that reads it.
fn date_as((ms, off): (i64, i32), rng: &mut rand::rngs::StdRng) -> (String, String) {
    use rand::Rng;
    let at = chrono::FixedOffset::east_opt(off * 60).unwrap();
    let local = chrono::DateTime::from_timestamp_millis(ms)
        .unwrap()
        .with_timezone(&at);
    let offset = format!(
        "{}{:02}:{:02}",
        if off < 0 { '-' } else { '+' },
        off.abs() / 60,
        off.abs() % 60
    );
    match (rng.random_range(0..6), off) {
        (0, _) => (format!("{:?}", rfc3339(ms, off)), ", format = \"rfc3339\"".into()),
        (1, _) => (format!("{:?}", local.format("%Y/%m/%d %H:%M:%S%.3f %:z").to_string()), ", format = \"pattern\", pattern = \"%Y/%m/%d %H:%M:%S%.3f %:z\"".into()),
        (2, _) => (format!("{:?}", local.format("%d-%m-%Y %H.%M.%S%.3f").to_string()), format!(", format = \"pattern\", pattern = \"%d-%m-%Y %H.%M.%S%.3f\", offset = \"{offset}\"")),
        (3, 0) => (format!("{:?}", local.format("%Y%m%d-%H:%M:%S%.3f").to_string()), ", format = \"fix\"".into()),
        (4, 0) => (format!("\"{}\"", ms * 1000 + rng.random_range(0..1000)), ", format = \"epoch_micros\"".into()),
        (_, 0) => (ms.to_string(), ", format = \"epoch_millis\"".into()),
        _ => (format!("{:?}", rfc3339(ms, off)), String::new()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn a_reshaped_trade_is_stored_as_the_original(o in original(), seed in any::<u64>()) {
        let want = default(&o.payload());
        let r = reshape(&o, seed);
        let m = mapping(&r.toml);
        let got = mapped(&m, parts(&r.payload, r.key.as_deref(), &r.headers));
        let got = got.unwrap_or_else(|e| panic!("{}\n{}\n{:?} {:?}\n{e}", r.toml, r.payload, r.key, r.headers));
        prop_assert_eq!(got, want, "\n{}\n{}", r.toml, r.payload);
    }

    #[test]
    fn mapped_decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), cut in 0usize..200) {
        let m = mapping(NESTED);
        let _ = m.decode(RecordParts { payload: Some(&bytes), key: Some(&bytes), headers: &[] }, Identity::Read(&src()), MAX);
        let text = NESTED_FILL.as_bytes();
        let cut = cut.min(text.len());
        let _ = m.decode(RecordParts { payload: Some(&text[..cut]), ..RecordParts::default() }, Identity::Read(&src()), MAX);
    }
}
