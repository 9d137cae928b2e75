//! The label sets of tradebucket's metrics, one enum each: every value is
//! spelled once, in its `as_str`, and each set can be listed (`ALL`) to
//! create its series at 0 before the first incident.

/// An enum of label values with `ALL` and `as_str`.
macro_rules! label_set {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal,)+ }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($variant,)+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }
    };
}

label_set! {
    /// `kind` of `tradebucket_consumer_errors_total`: what kind of consumer
    /// error (see `kafka::consumer_error_kind`).
    ConsumerErrorKind {
        Transport => "transport",
        OffsetReset => "offset_reset",
        UnknownTopicOrPartition => "unknown_topic_or_partition",
        Authorization => "authorization",
        Fatal => "fatal",
        SkippedRecords => "skipped_records",
        Other => "other",
    }
}

label_set! {
    /// `reason` of `tradebucket_events_skipped_total`.
    SkipReason {
        AlreadyApplied => "already_applied",
        Duplicate => "duplicate",
    }
}

label_set! {
    /// `result` of `tradebucket_offset_commits_total`.
    CommitResult {
        Ok => "ok",
        Error => "error",
    }
}

label_set! {
    /// `kind` of `tradebucket_retries_total`: what was retried.
    RetryKind {
        Mongodb => "mongodb",
        DeadLetter => "dead_letter",
        Commit => "commit",
        SchemaRegistry => "schema_registry",
    }
}

label_set! {
    /// `kind` of `tradebucket_schema_registry_errors_total`: what a schema
    /// fetch met. `unavailable` holds the partition and is retried; the
    /// others dead-letter the records that name the schema.
    RegistryErrorKind {
        Unavailable => "unavailable",
        NotFound => "not_found",
        InvalidSchema => "invalid_schema",
    }
}

label_set! {
    /// `operation` of `tradebucket_timeouts_total`: which time limit expired.
    TimeoutOperation {
        MongodbRead => "mongodb_read",
        MongodbWrite => "mongodb_write",
        MongodbWriteConcern => "mongodb_write_concern",
        MongodbPing => "mongodb_ping",
        KafkaRequest => "kafka_request",
        DeadLetter => "dead_letter",
    }
}

label_set! {
    /// `operation` of `tradebucket_mongodb_request_duration_seconds`: the
    /// writer's requests (see `bucket::writer`).
    WriteOperation {
        Load => "load",
        FindKeys => "find_keys",
        Fill => "fill",
        Insert => "insert",
    }
}

label_set! {
    /// `stage` of `tradebucket_stage_delay_seconds`: where an event's delay
    /// goes, from the producer to the committed offset (see the metric's
    /// help for what each one times).
    DelayStage {
        InKafka => "in_kafka",
        Batching => "batching",
        Decode => "decode",
        Queued => "queued",
        Writing => "writing",
        Commit => "commit",
    }
}

label_set! {
    /// `kind` of `tradebucket_rebalances_total`.
    RebalanceKind {
        Assigned => "assigned",
        Revoked => "revoked",
    }
}
