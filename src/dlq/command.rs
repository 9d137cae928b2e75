//! The `dlq` subcommands' flags and what each prints. `main` only hands
//! them the settings.

use std::io::IsTerminal;
use std::time::Duration;

use super::io::{self, DlqError};
use super::{Filter, LetterView, Listing};
use crate::config::Settings;
use crate::event::{Mappings, RecordParts, Reject, Trade};
use crate::metrics::Metrics;
use crate::registry::{Formats, Unavailable};

#[derive(Debug, clap::Subcommand)]
pub enum DlqCommand {
    /// Count and list dead letters: a summary by error kind, then one line each.
    List {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: Filter,
        /// List at most this many (0: all); the counts cover every match.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print one JSON object: scanned, matched, by_kind, letters.
        #[arg(long)]
        json: bool,
    },
    /// Print one dead letter: its headers decoded, key and payload.
    Show {
        #[command(flatten)]
        target: Target,
        /// The dead letter, as PARTITION:OFFSET of the dead-letter topic.
        #[arg(value_parser = super::parse_at)]
        at: (i32, i64),
        #[arg(long)]
        json: bool,
    },
    /// Put the selected dead letters back on their source topics, with
    /// their original key and headers; replaying one twice stores it once.
    Replay {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: Filter,
        /// Replay every dead letter of the topic (required when no filter is given).
        #[arg(long)]
        all: bool,
        /// Records per second at most; 0 is as fast as the broker takes them.
        #[arg(long, default_value_t = 100)]
        rate: u64,
        /// Print what would be replayed and what the worker would make of
        /// each (a trade, or a dead letter again), decoded by its topic's
        /// format and mapping as the worker decodes it; send nothing.
        #[arg(long)]
        dry_run: bool,
        /// Send this file's content as the payload instead of the dead
        /// letter's (a corrected event); the selection must be one dead letter.
        #[arg(long)]
        payload: Option<std::path::PathBuf>,
    },
}

/// Which dead-letter topic, and how long reading it may take.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The dead-letter topic; default: that of the first of kafka.topics.
    #[arg(long)]
    pub topic: Option<String>,
    /// Fail if the topic is not read to its end offsets within this long.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl Target {
    fn topic(&self, settings: &Settings) -> String {
        self.topic
            .clone()
            .unwrap_or_else(|| io::default_topics(settings).remove(0))
    }
}

/// Runs one `dlq` subcommand; `Ok(false)` when it found nothing to act
/// on where the operator expected something (exit 1).
pub async fn execute(settings: &Settings, command: DlqCommand) -> Result<bool, DlqError> {
    match command {
        DlqCommand::List {
            target,
            filter,
            limit,
            json,
        } => list(settings, &target, &filter, limit, json),
        DlqCommand::Show { target, at, json } => {
            let topic = target.topic(settings);
            let letter = io::read_one(settings, &topic, at.0, at.1, target.timeout)?;
            let view = LetterView::of(&letter);
            if json {
                println!("{}", serde_json::to_string(&view).expect("plain data"));
            } else {
                print!("{}", view.detail());
            }
            Ok(true)
        }
        DlqCommand::Replay {
            target,
            filter,
            all,
            rate,
            dry_run,
            payload,
        } => {
            let options = ReplayOptions {
                all,
                rate,
                dry_run,
                payload,
            };
            replay(settings, &target, &filter, &options).await
        }
    }
}

fn list(
    settings: &Settings,
    target: &Target,
    filter: &Filter,
    limit: usize,
    json: bool,
) -> Result<bool, DlqError> {
    let topic = target.topic(settings);
    let mut listing = Listing::default();
    io::read_topic(settings, &topic, target.timeout, |l| {
        listing.add(&l, filter, limit)
    })?;
    if json {
        println!("{}", serde_json::to_string(&listing).expect("plain data"));
        return Ok(true);
    }
    println!(
        "{topic}: {} dead letters, {} matched",
        listing.scanned, listing.matched
    );
    for (kind, n) in &listing.by_kind {
        println!("  {kind:<24} {n}");
    }
    for v in &listing.letters {
        println!("{}", v.line());
    }
    if (listing.letters.len() as u64) < listing.matched {
        println!(
            "... {} more (--limit)",
            listing.matched - listing.letters.len() as u64
        );
    }
    Ok(true)
}

/// `--dry-run`: each selected dead letter, where it would go, and what the
/// worker would make of it now (the cause may have been fixed since: a
/// mapping, a topic's format, a schema registered).
async fn dry_run_report(
    settings: &Settings,
    chosen: &[(super::Letter, super::Replay)],
    patience: Duration,
) -> Result<(), DlqError> {
    let mappings = Mappings::from_settings(settings)?;
    let formats = Formats::from_settings(settings, Metrics::new())?;
    for (l, r) in chosen {
        let outcome = match outcome(settings, (&mappings, &formats), r, patience).await? {
            Ok(t) => format!(
                "a trade of customer {}, key {}",
                t.customer.id_text(),
                t.key
            ),
            Err(reject) => format!("a dead letter again ({reject})"),
        };
        println!(
            "would replay {}:{} to {} as {}: {outcome}",
            l.partition,
            l.offset,
            r.topic,
            crate::event::position_text(&r.identity)
        );
    }
    println!("dry run: {} dead letters, nothing sent", chosen.len());
    Ok(())
}

/// The replay `r` decoded as the worker will read it: by its topic's
/// format (an Avro or Protobuf payload through its writer's schema) and
/// mapping, with its replay identity.
async fn outcome(
    settings: &Settings,
    (mappings, formats): (&Mappings, &Formats),
    r: &super::Replay,
    patience: Duration,
) -> Result<Result<Trade, Reject>, Unavailable> {
    let parts = RecordParts {
        payload: r.payload.as_deref(),
        key: r.key.as_deref(),
        headers: &r.headers,
    };
    // Read where it will be read: its topic (the identity names it), at a
    // position not known before it is sent; the replay header, not the
    // position, gives a trade without `tradeId` its key.
    let at = r.identity.clone();
    let mapping = mappings.get(&r.topic).map(AsRef::as_ref);
    let max = settings.kafka.max_message_bytes;
    formats
        .decode_now(parts, mapping, &at, max, (&settings.retry, patience))
        .await
}

/// `dlq replay`'s flags besides the topic and the filter.
struct ReplayOptions {
    all: bool,
    rate: u64,
    dry_run: bool,
    payload: Option<std::path::PathBuf>,
}

async fn replay(
    settings: &Settings,
    target: &Target,
    filter: &Filter,
    options: &ReplayOptions,
) -> Result<bool, DlqError> {
    let ReplayOptions {
        all,
        rate,
        dry_run,
        payload,
    } = options;
    if filter.is_empty() && !all {
        return Err(DlqError::Refused(
            "no dead letters selected: give a filter (--kind, --at, ...) or --all".into(),
        ));
    }
    let topic = target.topic(settings);
    let mut chosen = io::select(settings, &topic, filter, target.timeout)?;
    if chosen.is_empty() {
        println!("no dead letter of {topic} matches");
        return Ok(false);
    }
    if let Some(path) = payload {
        let [(_, replay)] = chosen.as_mut_slice() else {
            return Err(DlqError::Refused(format!(
                "--payload replaces one dead letter's payload, and {} are selected (use --at)",
                chosen.len()
            )));
        };
        let corrected = std::fs::read(path)
            .map_err(|e| DlqError::Refused(format!("cannot read {}: {e}", path.display())))?;
        replay.payload = Some(corrected);
    }
    if *dry_run {
        dry_run_report(settings, &chosen, target.timeout).await?;
        return Ok(true);
    }
    let bar = crate::cli::progress_bar(
        std::io::stderr().is_terminal(),
        chosen.len() as u64,
        "replayed",
    );
    let replays: Vec<_> = chosen.into_iter().map(|(_, r)| r).collect();
    let sent = io::replay(settings, &replays, *rate, &bar).await?;
    bar.finish_and_clear();
    println!("replayed {sent} dead letters of {topic}");
    Ok(true)
}
