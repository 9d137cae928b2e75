//! The settings of mimalloc, the binary's global allocator (src/main.rs).
//!
//! A batch allocates its buffers (its records, their trades, the write's
//! work list, the driver's wire message: megabytes each) and frees them
//! when it is done, and the next batch allocates as much again a fraction
//! of a second later. mimalloc 2 gives freed memory back to the kernel
//! after 10 ms (`purge_delay`), so every batch faulted its buffers in
//! anew: about 250,000 page faults per million events, a tenth of the
//! worker's CPU. Kept for a second instead, the next batch reuses them
//! (docs/benchmarks.md, "Session 19").

use std::ffi::c_long;

use libmimalloc_sys::{mi_option_set_default, mi_option_t};

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`, where it is 15 in
/// mimalloc 2 and 3 alike). libmimalloc-sys names only the stable options;
/// the test below holds this number to the option that the environment
/// variable `MIMALLOC_PURGE_DELAY` sets.
const PURGE_DELAY: mi_option_t = 15;

/// How long mimalloc keeps memory freed before giving it back to the
/// kernel, in milliseconds: longer than a batch takes (hundreds of
/// milliseconds under a backlog), so one batch's buffers serve the next.
/// It is mimalloc 3's default.
pub const PURGE_DELAY_MS: c_long = 1000;

/// Sets mimalloc's purge delay to [`PURGE_DELAY_MS`], unless the
/// environment set it (`MIMALLOC_PURGE_DELAY`, which mimalloc reads at
/// process start): an operator's value wins. Call it first thing in
/// `main`, before any other thread runs: mimalloc's option setters are not
/// thread-safe.
pub fn configure() {
    // SAFETY: plain calls into mimalloc with an option number mimalloc.h
    // defines; the caller runs before any other thread exists.
    unsafe { mi_option_set_default(PURGE_DELAY, PURGE_DELAY_MS) }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use libmimalloc_sys::mi_option_get;

    use super::*;

    /// mimalloc's purge delay in effect, in milliseconds.
    fn purge_delay_ms() -> c_long {
        // SAFETY: reading an option mimalloc.h defines.
        unsafe { mi_option_get(PURGE_DELAY) }
    }

    /// Set by the parent test in the child it runs.
    const CHILD: &str = "TRADEBUCKET_ALLOCATOR_TEST_CHILD";
    const TEST: &str = "allocator::tests::the_purge_delay_is_ours_unless_the_environment_sets_it";

    /// mimalloc reads its environment once per process (at its start when
    /// it is the global allocator, as in the binary; here, where it is
    /// not, when first asked), so each case runs in a child process of
    /// this test binary: without
    /// `MIMALLOC_PURGE_DELAY` the delay is ours; with it, the
    /// environment's, which also shows that option 15 is the one that
    /// variable names.
    #[test]
    fn the_purge_delay_is_ours_unless_the_environment_sets_it() {
        if let Ok(expected) = std::env::var(CHILD) {
            configure();
            assert_eq!(purge_delay_ms().to_string(), expected);
            return;
        }
        for (env, expected) in [(None, PURGE_DELAY_MS), (Some("777"), 777)] {
            let mut child = Command::new(std::env::current_exe().unwrap());
            child
                .args(["--exact", TEST, "--test-threads=1", "--nocapture"])
                .env(CHILD, expected.to_string());
            match env {
                Some(value) => child.env("MIMALLOC_PURGE_DELAY", value),
                None => child.env_remove("MIMALLOC_PURGE_DELAY"),
            };
            let out = child.output().unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{env:?}: {stdout}");
            // The filter matched: the child ran this test, not nothing.
            assert!(stdout.contains("1 passed"), "{env:?}: {stdout}");
        }
    }
}
