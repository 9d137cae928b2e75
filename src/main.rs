//! The `tradebucket` binary: flags, logging, config, signals. Everything
//! else lives in the library.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

use tradebucket::cli::{self, MapOptions, ProduceOptions};
use tradebucket::config::{LogFormat, Settings};
use tradebucket::dlq::command::DlqCommand;
use tradebucket::event::CustomerId;
use tradebucket::pipeline;
use tradebucket::reconcile::io::{self as reconcile, Report};

/// mimalloc, not glibc's malloc: the worker allocates a batch's records and
/// trades together and frees them together, a pattern glibc serves by
/// splitting and coalescing chunks (a quarter of the worker's CPU in its
/// profile). Measured end to end, alternating on the same backlog: about 15 %
/// less CPU per event for 5 to 13 MiB more peak RSS (docs/benchmarks.md, "The
/// allocator"). The crate's `no_thp` feature is why the memory stays close,
/// and its `v2` (mimalloc 2, not 3) kept 15 to 25 MiB more of it off the
/// peak (Cargo.toml). Its settings: `tradebucket::allocator`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// sysexits EX_USAGE: what operators' tooling expects for bad configuration.
const EXIT_CONFIG: u8 = 64;

#[derive(Parser)]
#[command(
    version,
    about = "Kafka trade events into per-customer MongoDB bucket documents, exactly once"
)]
struct Cli {
    /// A TOML file overriding config/default.toml (env TRADEBUCKET__* overrides both).
    #[arg(long, global = true, env = "TRADEBUCKET_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the worker until SIGTERM/SIGINT.
    Run,
    /// Create the MongoDB indexes (idempotent; `run` does it too).
    Init {
        /// Also create the source and dead-letter topics that are missing,
        /// with this many partitions.
        #[arg(long)]
        create_topics: Option<i32>,
    },
    /// Print page N of a customer's trade history as JSON.
    Page {
        #[arg(long)]
        customer: String,
        #[arg(long, default_value_t = 1)]
        page: u64,
    },
    /// Check the bucket invariants; exits 1 on any violation.
    Audit {
        #[arg(long)]
        customer: Option<String>,
        /// Print the report as JSON instead of text (same exit code).
        #[arg(long)]
        json: bool,
    },
    /// Produce synthetic trade events (demo and load).
    Produce(ProduceOptions),
    /// Print the effective configuration (secrets redacted); exits 64 if invalid.
    CheckConfig,
    /// Show what sample payloads would become under a topic's mapping: the
    /// trade as stored, or the dead letter; exits 1 if any is dead-lettered.
    Map(MapOptions),
    /// Read and replay the dead-letter topic.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Check every record the group committed past: stored once under its
    /// customer, or dead-lettered; exits 1 on any problem.
    Reconcile(reconcile::Options),
}

fn init_logging(settings: &Settings) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{},rdkafka=warn", settings.log.level)));
    let json = match settings.log.format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}

/// SIGTERM and SIGINT, caught from the moment this returns. The worker
/// installs them before it logs "starting": a handler installed later (by
/// a task on its first poll, as before) left a window in which SIGTERM's
/// default action ended the worker with no drain and no exit code.
#[cfg(unix)]
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl StopSignals {
    fn install() -> std::io::Result<StopSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(StopSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Returns at the first of them.
    async fn first(mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

#[cfg(not(unix))]
struct StopSignals;

#[cfg(not(unix))]
impl StopSignals {
    fn install() -> std::io::Result<StopSignals> {
        Ok(StopSignals)
    }

    async fn first(self) {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Cancels `token` at the first stop signal.
async fn cancel_on_stop(signals: StopSignals, token: CancellationToken) {
    signals.first().await;
    tracing::info!("shutdown requested: draining");
    token.cancel();
}

fn parse_customer(text: &str) -> Result<CustomerId, ExitCode> {
    CustomerId::parse_cli(text).map_err(|e| {
        eprintln!("invalid --customer: {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

fn main() -> ExitCode {
    // Before the runtime starts its threads: mimalloc's setters are not
    // thread-safe.
    tradebucket::allocator::configure();
    run()
}

#[tokio::main]
async fn run() -> ExitCode {
    let args = Cli::parse();
    let settings = match Settings::load(args.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tradebucket: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Command::CheckConfig = args.command {
        // librdkafka judges the pass-through options. No broker is contacted;
        // with OAUTHBEARER/OIDC it asks the token endpoint, and with GSSAPI
        // it runs kinit, as those clients do at creation.
        if let Err(e) = tradebucket::kafka::check_options(&settings) {
            eprintln!("tradebucket: invalid setting kafka.options: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
        print!("{}", settings.redacted_toml());
        return ExitCode::SUCCESS;
    }
    init_logging(&settings);
    match execute(args.command, settings).await {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = %tradebucket::errors::error_chain(e.as_ref()), "failed");
            eprintln!(
                "tradebucket: {}",
                tradebucket::errors::error_chain(e.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

async fn execute(command: Command, settings: Settings) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run => {
            let signals =
                StopSignals::install().context("installing the SIGTERM/SIGINT handlers")?;
            let token = CancellationToken::new();
            tokio::spawn(cancel_on_stop(signals, token.clone()));
            tracing::info!(config = %settings.redacted_toml().replace('\n', " "), "starting");
            pipeline::run(settings, token).await?;
        }
        Command::Init { create_topics } => {
            let done = cli::init(&settings, create_topics).await?;
            println!("indexes ready ({})", done.layout);
            for t in done.topics {
                println!("created topic {t}");
            }
        }
        Command::Page { customer, page } => return show_page(&settings, &customer, page).await,
        Command::Audit { customer, json } => return audit(&settings, customer, json).await,
        Command::Produce(opts) => {
            let (topic, sent, secs) =
                cli::produce(&settings, &opts, std::io::stderr().is_terminal()).await?;
            println!(
                "produced {sent} trades for {} customers to {topic} in {secs:.2} s ({:.0} events/s)",
                opts.customers,
                sent as f64 / secs.max(1e-9)
            );
        }
        Command::Dlq(command) => {
            if !tradebucket::dlq::command::execute(&settings, command).await? {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Reconcile(opts) => return reconcile(&settings, &opts).await,
        Command::Map(opts) => {
            let dead = cli::map_samples(&settings, &opts, &mut std::io::stdout().lock()).await?;
            if dead > 0 {
                eprintln!("{dead} samples would be dead-lettered");
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::CheckConfig => unreachable!("handled before logging starts"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `tradebucket page`: the page as pretty JSON, or exit 1 if there is none.
async fn show_page(settings: &Settings, customer: &str, page: u64) -> anyhow::Result<ExitCode> {
    let customer = match parse_customer(customer) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    match cli::page(settings, &customer, page).await? {
        Some(doc) => println!("{}", serde_json::to_string_pretty(&doc)?),
        None => {
            eprintln!("customer {} has no page {page}", customer.id_text());
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `tradebucket audit`: the report (text or `--json`); exit 1 on any
/// violation.
async fn audit(
    settings: &Settings,
    customer: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let customer = match customer.map(|c| parse_customer(&c)).transpose() {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    let report = cli::audit(settings, customer.as_ref()).await?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_audit(&report);
    }
    Ok(if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_audit(report: &cli::AuditReport) {
    println!(
        "audit: {} customers, {} buckets, {} trades, {} violations",
        report.customers,
        report.buckets,
        report.trades,
        report.violations.len()
    );
    if report.text_digit_customers > 0 {
        println!(
            "note: {} customers stored as text of digits (docs/operations.md#customer-ids-stored-as-text)",
            report.text_digit_customers
        );
    }
    for v in &report.violations {
        println!("violation: {v}");
    }
}

/// `tradebucket reconcile`: the report (text or `--json`); exit 1 on any
/// problem.
async fn reconcile(settings: &Settings, opts: &reconcile::Options) -> anyhow::Result<ExitCode> {
    let report = reconcile::run(settings, opts, std::io::stderr().is_terminal()).await?;
    if opts.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_reconcile(&report);
    }
    Ok(if report.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_reconcile(r: &Report) {
    let t = &r.total;
    println!(
        "reconcile: group {}, {} records in {} partitions: {} stored, {} upstream duplicates, \
         {} dead-lettered ({} more than once, {} replayed and stored), {} offsets without a \
         record; {} problems",
        r.group,
        t.records,
        r.partitions.len(),
        t.stored,
        t.upstream_duplicates,
        t.dead_lettered,
        t.dead_letters_repeated,
        t.dead_letters_replayed,
        t.gaps,
        t.problems
    );
    for p in &r.partitions {
        let s = &p.span;
        let mut line = format!("{}/{}: offsets {}..{}", s.topic, s.partition, s.from, s.to);
        if let Some(low) = s.retained_from {
            line += &format!(
                " (retention kept records from offset {low} on: the answer holds from there)"
            );
        }
        if s.uncommitted && s.from == s.to {
            line += " (the group has committed nothing here)";
        }
        let c = &p.counts;
        println!(
            "  {line}: {} records, {} stored, {} upstream duplicates, {} dead-lettered, {} problems",
            c.records, c.stored, c.upstream_duplicates, c.dead_lettered, c.problems
        );
    }
    for (kind, n) in &r.problems_by_kind {
        println!("problems {}: {n}", kind.as_str());
    }
    for p in &r.problems {
        let key = p.key.as_deref().unwrap_or("(not a trade)");
        println!(
            "problem {} at {}/{}/{}: {key} {}",
            p.kind.as_str(),
            p.topic,
            p.partition,
            p.offset,
            p.buckets.join(" ")
        );
    }
    if r.replayed > 0 {
        println!("replayed {} missing records to their topics", r.replayed);
    }
}
