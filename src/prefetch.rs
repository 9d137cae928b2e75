//! A hint to the CPU that memory is about to be read, for the hot path's
//! scattered reads: the write plans customer by customer, and a customer's
//! events lie anywhere in a batch of tens of thousands (megabytes no cache
//! level near the core holds), so each event's first read waits for
//! memory. Asking for the next customer's events while this one is planned
//! overlaps those waits with work (docs/benchmarks.md, "Session 37").

/// Asks for the cache lines that hold `value`. Never faults and changes
/// nothing the program can observe but time; a no-op off x86-64.
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    lines(std::ptr::from_ref(value).cast::<u8>(), size_of::<T>());
}

/// Asks for the cache lines of `bytes`, up to [`MAX_HINTED`] of them.
#[inline(always)]
pub fn prefetch_bytes(bytes: &[u8]) {
    lines(bytes.as_ptr(), bytes.len());
}

const LINE: usize = 64;

/// The bytes hinted at most, from the start: a trade's payload, entry or
/// event is a few lines, and longer bytes (a payload or an entry may be
/// megabytes) are read in order, which the CPU's own prefetchers follow;
/// a hint per line of those would only cost time.
pub const MAX_HINTED: usize = 4 * LINE;

#[inline(always)]
fn lines(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for offset in hinted(len) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: `_mm_prefetch` is a hint, not a load: it never faults,
        // whatever the address, and reads nothing into the program. `sse`,
        // which it needs, is part of the x86-64 baseline, so every CPU
        // this runs on has it.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset).cast()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// The offsets hinted for `len` bytes (their first [`MAX_HINTED`]): one
/// per line's width, and the last byte, whose line the others miss when
/// the bytes do not start a line.
#[inline(always)]
fn hinted(len: usize) -> impl Iterator<Item = usize> {
    let len = len.min(MAX_HINTED);
    (0..len).step_by(LINE).chain(len.checked_sub(1))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Every cache line of the bytes' first `MAX_HINTED` gets a hint,
        /// and no hint falls outside them.
        #[test]
        fn every_line_of_the_bytes_is_hinted(start in 0usize..4096, len in 0usize..1024) {
            let hints: Vec<usize> = hinted(len).map(|o| start + o).collect();
            let end = start + len.min(MAX_HINTED);
            prop_assert!(hints.iter().all(|&a| a >= start && a < end));
            for line in (start..end).map(|a| a / LINE) {
                prop_assert!(hints.iter().any(|&a| a / LINE == line), "line {line} not hinted");
            }
        }
    }
}
