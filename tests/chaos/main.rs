//! The chaos suite: the real `tradebucket` binary against real protocol
//! servers (private ones per scenario), with faults injected, checked trade
//! by trade against an independent recount of what was produced.
//!
//! Sizes: by default the reduced run CI takes on every submission;
//! `TRADEBUCKET_CHAOS=full` for the sizes `docs/reliability.md` reports.
//! `TRADEBUCKET_CHAOS_EVENTS` / `TRADEBUCKET_CHAOS_KILLS` override either.
//! Each scenario writes a JSON report to `<target dir>/chaos/`.
//!
//! Run one scenario at a time (`--test-threads 1`): every scenario has its
//! own servers, but six servers and several workers on two cores at once
//! would measure the machine, not the product.

mod chains;
mod cluster;
mod fuzz;
mod harness;
mod hostile;
mod network;
mod registry;
mod scenarios;
mod storm;
mod verdict;
