//! What a write command carries and what its reply says: the write
//! concern, fill statements cut to the command size limit, the raw
//! `update` command's bytes, and the statement errors (or the unknown
//! outcome) of an `update` or `insert_many` reply.

use std::ops::Range;

use mongodb::bson::{Bson, Document, RawDocument, RawDocumentBuf};
use mongodb::error::{ErrorKind, WriteFailure};
use mongodb::options::{Acknowledgment, WriteConcern};

use super::bson_out::{self, document, element, BsonOut};
use super::codec::{describe, stored_number};
use super::error::{InsertOutcome, StatementError, StoreError, CLIENT_REFUSED};
use crate::config::{Settings, WriteAcknowledgment};

/// Bytes of fill statements per `update` command (a byte budget, not a
/// statement count). A command over MongoDB's 16 MiB limit is refused
/// whole, so the fills are cut into several commands at half of it, which
/// leaves room for the command's other fields; a statement larger than the
/// budget goes alone. At typical trade sizes a command this big also stays
/// far under the 100,000-statement limit.
const MAX_STATEMENT_BYTES: usize = 8 * 1024 * 1024;

/// What an `insert_many` of `sent` documents that failed says: the
/// refused documents, or an error (its outcome unknown) to retry.
pub(super) fn insert_failure(
    e: mongodb::error::Error,
    sent: usize,
) -> Result<InsertOutcome, StoreError> {
    let refused = |index: usize, code: i32, message: String| StatementError {
        index,
        code,
        message,
    };
    match *e.kind {
        ErrorKind::InsertMany(ref failure) if failure.write_concern_error.is_none() => {
            match failure.write_errors.as_deref() {
                Some(errors) if errors.iter().any(|w| w.index >= sent) => {
                    let bad = errors.iter().map(|w| w.index).max().unwrap_or(0);
                    Err(malformed(format!("a write error's index is {bad}"), sent))
                }
                Some(errors) if !errors.is_empty() => Ok(InsertOutcome {
                    errors: errors
                        .iter()
                        .map(|w| refused(w.index, w.code, w.message.clone()))
                        .collect(),
                }),
                _ => Err(StoreError::Transient(e)),
            }
        }
        ErrorKind::Write(WriteFailure::WriteError(ref w)) => Ok(InsertOutcome {
            errors: vec![refused(0, w.code, w.message.clone())],
        }),
        // Refused by the driver before anything was sent: every document
        // is suspect, and the writer's isolation finds the one at fault.
        ErrorKind::InvalidArgument { ref message, .. } => {
            let why = format!("the MongoDB driver refused the document: {message}");
            Ok(InsertOutcome {
                errors: (0..sent)
                    .map(|i| refused(i, CLIENT_REFUSED, why.clone()))
                    .collect(),
            })
        }
        _ => Err(StoreError::Transient(e)),
    }
}

/// `mongodb.write_concern` and `mongodb.journal`, with `wtimeout`: a replica
/// set that lost its majority answers with a write-concern error instead of
/// holding the write without bound.
pub(super) fn write_concern(settings: &Settings) -> WriteConcern {
    let w = match settings.mongodb.write_concern {
        WriteAcknowledgment::Majority => Acknowledgment::Majority,
        WriteAcknowledgment::Nodes(n) => Acknowledgment::Nodes(n),
    };
    WriteConcern::builder()
        .w(w)
        .journal(settings.mongodb.journal)
        .w_timeout(settings.timeouts.mongodb_write_concern)
        .build()
}

/// The `writeConcern` field of a raw command.
pub(super) fn write_concern_doc(wc: &WriteConcern) -> RawDocumentBuf {
    let mut d = RawDocumentBuf::new();
    match &wc.w {
        Some(Acknowledgment::Nodes(n)) => d.append("w", i64::from(*n)),
        Some(Acknowledgment::Custom(s)) => d.append("w", s.as_str()),
        _ => d.append("w", "majority"),
    }
    if let Some(j) = wc.journal {
        d.append("j", j);
    }
    if let Some(limit) = wc.w_timeout {
        d.append(
            "wtimeout",
            i64::try_from(limit.as_millis()).unwrap_or(i64::MAX),
        );
    }
    d
}

/// `(matched, statement errors)` from an `update` reply to `sent`
/// statements. A write-concern error makes the whole outcome unknown: an
/// error, so the batch is retried. So does a reply that names a statement
/// we did not send, or counts more matches than statements: a server (or a
/// proxy) saying that cannot be trusted about the others either, and
/// indexing with its numbers would crash the worker on the same batch
/// after every restart.
pub(super) fn parse_write_reply(
    reply: &Document,
    sent: usize,
) -> Result<(u64, Vec<StatementError>), StoreError> {
    if let Ok(wce) = reply.get_document("writeConcernError") {
        let code = wce.get_i32("code").unwrap_or(-1);
        let message = wce.get_str("errmsg").unwrap_or_default();
        return Err(StoreError::WriteConcern {
            code,
            message: message.to_string(),
        });
    }
    let n = stored_number(reply, "n")
        .filter(|&n| n <= sent as u64)
        .ok_or_else(|| malformed(format!("n is {}", describe(reply.get("n"))), sent))?;
    let mut errors = Vec::new();
    if let Ok(list) = reply.get_array("writeErrors") {
        for e in list.iter().filter_map(Bson::as_document) {
            let index = stored_number(e, "index")
                .and_then(|i| usize::try_from(i).ok())
                .filter(|&i| i < sent)
                .ok_or_else(|| {
                    let index = describe(e.get("index"));
                    malformed(format!("a write error's index is {index}"), sent)
                })?;
            errors.push(StatementError {
                index,
                code: e.get_i32("code").unwrap_or(-1),
                message: e.get_str("errmsg").unwrap_or_default().to_string(),
            });
        }
    }
    Ok((n, errors))
}

/// A write reply that does not fit the request: retried like a failed
/// request (its outcome is unknown), and said plainly in the log.
fn malformed(what: String, sent: usize) -> StoreError {
    StoreError::Failed(format!(
        "malformed write reply to {sent} statements: {what}"
    ))
}

/// The statements cut into `update` commands of at most
/// `MAX_STATEMENT_BYTES` of statements each (one larger goes alone), in
/// order: the ranges of `statements` each command carries.
pub fn chunk_by_size(statements: &[RawDocumentBuf]) -> Vec<Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, s) in statements.iter().enumerate() {
        let size = s.as_bytes().len();
        if i > start && bytes + size > MAX_STATEMENT_BYTES {
            chunks.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < statements.len() {
        chunks.push(start..statements.len());
    }
    chunks
}

/// `len` items in `runs` consecutive runs (fewer only if there are fewer
/// items), in order, whose counts differ by one at most: how a round's
/// fills and inserts are shared out over commands sent at once.
pub fn even_runs(len: usize, runs: usize) -> impl Iterator<Item = Range<usize>> {
    let runs = runs.clamp(1, len.max(1));
    let (base, longer) = (len / runs, len % runs);
    (0..runs).scan(0, move |start, run| {
        let end = *start + base + usize::from(run < longer);
        let range = *start..end;
        *start = end;
        Some(range)
    })
}

/// The commands a round's fill statements go out in, so that up to
/// `streams` of them can run at once: the statements in `streams`
/// [`even_runs`], each run then cut by size ([`chunk_by_size`]). Each
/// statement is one customer's, so any split keeps every customer's
/// writes in order.
pub fn fill_commands(statements: &[RawDocumentBuf], streams: usize) -> Vec<Range<usize>> {
    even_runs(statements.len(), streams)
        .flat_map(|run| {
            let cut = chunk_by_size(&statements[run.clone()]);
            cut.into_iter()
                .map(move |r| run.start + r.start..run.start + r.end)
        })
        .collect()
}

/// The raw `update` command of `statements`, unordered: `{update:
/// <collection>, updates: [..], ordered: false, writeConcern: {..}}`. Each
/// statement's bytes are copied once, into one buffer of the command's
/// exact size (building `updates` as an array first copied them twice).
pub fn update_command(
    collection: &str,
    statements: &[RawDocumentBuf],
    write_concern: &RawDocument,
) -> RawDocumentBuf {
    let updates = bson_out::array(statements.iter().map(|s| s.as_bytes().len()));
    let size = document(
        element("update", bson_out::string(collection))
            + element("updates", updates)
            + element("ordered", 1)
            + element("writeConcern", write_concern.as_bytes().len()),
    );
    let mut out = BsonOut::with_capacity(size);
    let top = out.begin();
    // A collection name holds no NUL (MongoDB refuses one), and were it
    // to, a string value is length-delimited: the bytes stay well formed.
    out.string("update", collection);
    let array = out.array("updates");
    for (i, s) in statements.iter().enumerate() {
        out.raw_document(i, s);
    }
    out.end(array);
    out.boolean("ordered", false);
    out.raw_document("writeConcern", write_concern);
    out.end(top);
    out.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::{doc, rawdoc};
    use std::time::Duration;

    #[test]
    fn the_raw_write_concern_carries_wtimeout() {
        let wc = WriteConcern::builder()
            .w(Acknowledgment::Majority)
            .journal(true)
            .w_timeout(Duration::from_secs(20))
            .build();
        let d = write_concern_doc(&wc);
        assert_eq!(d.get_i64("wtimeout").unwrap(), 20_000);
    }

    #[test]
    fn write_replies_are_parsed_with_indexes() {
        let reply = doc! {"ok": 1.0, "n": 3, "nModified": 3, "writeErrors": [
            {"index": 4, "code": 11000, "errmsg": "E11000 duplicate key"},
            {"index": 7, "code": 121, "errmsg": "Document failed validation"},
        ]};
        let (n, errs) = parse_write_reply(&reply, 8).unwrap();
        assert_eq!(n, 3);
        assert_eq!(errs.len(), 2);
        assert!(errs[0].is_duplicate_key());
        assert_eq!((errs[1].index, errs[1].code), (7, 121));
        let wce = doc! {"ok": 1.0, "n": 1, "writeConcernError": {"code": 64}};
        assert!(parse_write_reply(&wce, 8).is_err());
    }

    /// A reply that names a statement we did not send (or counts more
    /// matches than statements) is an error to retry, not an index to
    /// crash on (indexing the statements with it would panic on the same
    /// batch after every restart).
    #[test]
    fn a_reply_naming_statements_never_sent_is_an_error_not_an_index() {
        let error_at = |index: Bson| {
            doc! {"ok": 1.0, "n": 0, "writeErrors": [
                {"index": index, "code": 11000, "errmsg": "E11000"},
            ]}
        };
        for index in [
            Bson::Int32(3),
            Bson::Int32(-1),
            Bson::Int64(1 << 40),
            Bson::Null,
        ] {
            let e = parse_write_reply(&error_at(index.clone()), 3).unwrap_err();
            assert!(
                matches!(e, StoreError::Failed(ref m) if m.contains("malformed")),
                "{index}: {e}"
            );
        }
        assert!(parse_write_reply(&error_at(Bson::Int32(2)), 3).is_ok());
        let too_many = doc! {"ok": 1.0, "n": 4};
        assert!(parse_write_reply(&too_many, 3).is_err());
        let no_n = doc! {"ok": 1.0};
        assert!(parse_write_reply(&no_n, 3).is_err());
    }

    #[test]
    fn even_runs_differ_by_one_at_most() {
        let runs = |len, n| even_runs(len, n).collect::<Vec<_>>();
        assert_eq!(runs(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(runs(3, 5), vec![0..1, 1..2, 2..3]);
        assert_eq!(runs(4, 0), vec![0..4]);
        // Nothing to share out: one empty run, which the callers skip.
        assert_eq!(runs(0, 3), vec![0..0]);
    }

    #[test]
    fn fill_commands_split_into_runs_of_about_equal_count_then_by_size() {
        let small: Vec<RawDocumentBuf> = (0..7).map(|i| rawdoc! {"i": i}).collect();
        assert_eq!(fill_commands(&small, 1), vec![0..7]);
        assert_eq!(fill_commands(&small, 2), vec![0..4, 4..7]);
        assert_eq!(fill_commands(&small, 3), vec![0..3, 3..5, 5..7]);
        // More streams than statements: one statement each, none empty.
        assert_eq!(fill_commands(&small[..2], 4), vec![0..1, 1..2]);
        assert!(fill_commands(&[], 2).is_empty());
        let big = "x".repeat(3 * 1024 * 1024);
        let large: Vec<RawDocumentBuf> = (0..5)
            .map(|i| rawdoc! {"i": i, "pad": big.as_str()})
            .collect();
        // Each run is cut by size on its own: 0..3 is 0..2 and 2..3.
        assert_eq!(fill_commands(&large, 2), vec![0..2, 2..3, 3..5]);
    }

    proptest::proptest! {
        /// Whatever the statements' sizes and the streams asked: the
        /// commands cover every statement once, in order, none empty; at
        /// least as many as the streams allow (one statement each at
        /// most), and each within the size budget unless it is one
        /// statement alone.
        #[test]
        fn fill_commands_cover_every_statement_once_in_order(
            sizes in proptest::collection::vec(0usize..3 * 1024 * 1024, 0..24),
            streams in 1usize..6,
        ) {
            let statements: Vec<RawDocumentBuf> =
                sizes.iter().map(|&n| rawdoc! {"pad": "x".repeat(n)}).collect();
            let commands = fill_commands(&statements, streams);
            let mut next = 0;
            for c in &commands {
                proptest::prop_assert_eq!(c.start, next);
                proptest::prop_assert!(!c.is_empty());
                let bytes: usize = statements[c.clone()].iter().map(|s| s.as_bytes().len()).sum();
                proptest::prop_assert!(c.len() == 1 || bytes <= MAX_STATEMENT_BYTES);
                next = c.end;
            }
            proptest::prop_assert_eq!(next, statements.len());
            proptest::prop_assert!(commands.len() >= streams.min(statements.len()));
        }
    }

    #[test]
    fn chunks_respect_the_size_budget_and_keep_order() {
        let big = "x".repeat(3 * 1024 * 1024);
        let statements: Vec<RawDocumentBuf> = (0..5)
            .map(|i| rawdoc! {"i": i, "pad": big.as_str()})
            .collect();
        let chunks = chunk_by_size(&statements);
        assert_eq!(chunks, vec![0..2, 2..4, 4..5]);
        assert!(chunk_by_size(&[]).is_empty());
        let huge = rawdoc! {"pad": "x".repeat(MAX_STATEMENT_BYTES + 1)};
        let alone = [statements[0].clone(), huge, statements[1].clone()];
        assert_eq!(chunk_by_size(&alone), vec![0..1, 1..2, 2..3]);
    }
}
