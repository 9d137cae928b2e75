//! What the store's requests can fail with, and the server codes that
//! decide it: a request that failed (retried), a statement MongoDB refused
//! (a duplicate key is a conflict; a refusal of the data is for good), and
//! what `init` refuses.

use std::time::Duration;

use mongodb::error::{ErrorKind, WriteFailure};

use crate::metrics::TimeoutOperation;

/// Duplicate key: another writer (or an earlier delivery) got there first.
pub const DUPLICATE_KEY: i32 = 11000;

/// The per-statement codes that refuse the statement's *data*, and would
/// refuse it again on any server at any time: only these dead-letter the
/// events of the statement. Every other code (a shard's election seen
/// through mongos, a write conflict, an interrupted operation, an
/// authorization change) says nothing about the events, and the batch is
/// retried like a failed request. From MongoDB's `error_codes.yml`.
const REFUSALS_OF_DATA: [i32; 19] = [
    2,     // BadValue
    9,     // FailedToParse
    14,    // TypeMismatch
    15,    // Overflow
    16,    // InvalidLength
    22,    // InvalidBSON
    28,    // PathNotViable
    30,    // InvalidPath
    40,    // ConflictingUpdateOperators
    52,    // DollarPrefixedFieldName
    53,    // InvalidIdField
    55,    // InvalidDBRef
    56,    // EmptyFieldName
    57,    // DottedFieldName
    66,    // ImmutableField
    121,   // DocumentValidationFailure
    10334, // BSONObjectTooLarge
    17419, // an update's result over 16 MiB (older servers)
    CLIENT_REFUSED,
];

/// Not a server code: the driver refused the documents before sending them
/// (one too large to encode, say): a refusal of their data too.
pub const CLIENT_REFUSED: i32 = -2;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Worth retrying: network, elections, write-concern timeouts, a server
    /// restarting. The outcome of the failed request is unknown.
    #[error("MongoDB unavailable: {0}")]
    Transient(#[source] mongodb::error::Error),
    /// A statement failed with a code that does not refuse its data (see
    /// [`StatementError::refuses_data`]): retried like a failed request.
    #[error("MongoDB failed a statement (code {code}): {message}")]
    Statement { code: i32, message: String },
    /// The operation did not answer within `timeouts.mongodb_operation`
    /// and was abandoned (the driver closes a connection dropped mid-
    /// operation, so its late reply is never read as another's). Like
    /// [`StoreError::Transient`], the outcome is unknown: a write may have
    /// been applied. Retried with backoff; the guards make that safe.
    #[error("MongoDB {operation} did not answer within {limit:?} (timeouts.mongodb_operation); it may have been applied")]
    TimedOut {
        operation: &'static str,
        limit: Duration,
    },
    /// The server applied the write but could not satisfy the write
    /// concern (`wtimeout` expired, a majority lost): unknown whether it
    /// will survive. Retried like a failed request.
    #[error("MongoDB write concern not satisfied (code {code}): {message}")]
    WriteConcern { code: i32, message: String },
    /// A response we cannot interpret, or an error that retrying will not
    /// change (bad credentials, missing privileges). Still retried by the
    /// pipeline, loudly, because dropping the batch would lose trades.
    #[error("MongoDB request failed: {0}")]
    Failed(String),
}

impl StoreError {
    /// The `operation` label of `tradebucket_timeouts_total` when this is
    /// a time limit that expired: ours, or the server's `wtimeout`.
    pub fn timeout_operation(&self) -> Option<TimeoutOperation> {
        match self {
            // What reads: the finds, and the start-up's questions about
            // the server and the collection.
            StoreError::TimedOut { operation, .. }
                if matches!(
                    *operation,
                    "find" | "hello" | "listCollections" | "listIndexes"
                ) =>
            {
                Some(TimeoutOperation::MongodbRead)
            }
            StoreError::TimedOut {
                operation: "ping", ..
            } => Some(TimeoutOperation::MongodbPing),
            StoreError::TimedOut { .. } => Some(TimeoutOperation::MongodbWrite),
            StoreError::WriteConcern { .. } => Some(TimeoutOperation::MongodbWriteConcern),
            StoreError::Transient(e) if is_write_concern_timeout(e) => {
                Some(TimeoutOperation::MongodbWriteConcern)
            }
            _ => None,
        }
    }

    /// Why writes fail, for `/readyz` (no secret: never the URI).
    pub fn readiness_reason(&self) -> String {
        match self {
            StoreError::TimedOut { operation, limit } => format!(
                "MongoDB writes failing: a {operation} exceeded its {limit:?} time limit (timeouts.mongodb_operation); being retried"
            ),
            StoreError::WriteConcern { code, .. } => format!(
                "MongoDB writes failing: write concern not satisfied (code {code}, timeouts.mongodb_write_concern); being retried"
            ),
            _ if self.timeout_operation().is_some() => "MongoDB writes failing: write concern not satisfied in time (timeouts.mongodb_write_concern); being retried".to_string(),
            _ => "MongoDB writes failing: being retried".to_string(),
        }
    }
}

/// A write-concern error the driver reports (on `insert_many`): the
/// server's `wtimeout` or a majority it cannot reach.
fn is_write_concern_timeout(e: &mongodb::error::Error) -> bool {
    match *e.kind {
        ErrorKind::Write(WriteFailure::WriteConcernError(_)) => true,
        ErrorKind::InsertMany(ref f) => f.write_concern_error.is_some(),
        _ => false,
    }
}

impl From<mongodb::error::Error> for StoreError {
    fn from(e: mongodb::error::Error) -> Self {
        StoreError::Transient(e)
    }
}

/// What happened to one statement that failed on its own.
#[derive(Debug, Clone, PartialEq)]
pub struct StatementError {
    pub index: usize,
    pub code: i32,
    pub message: String,
}

impl StatementError {
    pub fn is_duplicate_key(&self) -> bool {
        self.code == DUPLICATE_KEY
    }

    /// Refuses the statement's data for good (see [`REFUSALS_OF_DATA`]).
    pub fn refuses_data(&self) -> bool {
        REFUSALS_OF_DATA.contains(&self.code)
    }
}

/// Result of one `update` command.
#[derive(Debug, Default)]
pub struct FillOutcome {
    /// Statements that matched their guard (total only: see module docs).
    pub matched: u64,
    pub errors: Vec<StatementError>,
}

/// Result of an insert: the documents that were refused. An ordered insert
/// stops at its first refusal (everything before it was inserted, nothing
/// after it attempted); an unordered one attempts every document.
#[derive(Debug, Default)]
pub struct InsertOutcome {
    pub errors: Vec<StatementError>,
}

/// `init` refused the collection: retrying will not help, an operator must
/// act (the message says how).
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Layout(String),
}

impl From<mongodb::error::Error> for InitError {
    fn from(e: mongodb::error::Error) -> Self {
        InitError::Store(StoreError::Transient(e))
    }
}

/// The server's error code, for a command error.
pub(super) fn command_code(e: &mongodb::error::Error) -> Option<i32> {
    match *e.kind {
        ErrorKind::Command(ref c) => Some(c.code),
        _ => None,
    }
}
