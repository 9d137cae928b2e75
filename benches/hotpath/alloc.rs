//! The counting allocator: every allocation of this program passes
//! through it, so a stage's count is the difference of two readings around
//! it (the program is single-threaded while measuring).

use super::*;

#[cfg(feature = "bench-system-alloc")]
type Inner = std::alloc::System;
#[cfg(feature = "bench-system-alloc")]
const INNER: Inner = std::alloc::System;
#[cfg(not(feature = "bench-system-alloc"))]
type Inner = mimalloc::MiMalloc;
#[cfg(not(feature = "bench-system-alloc"))]
const INNER: Inner = mimalloc::MiMalloc;

pub(crate) const ALLOCATOR: &str = if cfg!(feature = "bench-system-alloc") {
    "system (glibc)"
} else {
    "mimalloc"
};

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

struct Counting;

// SAFETY: every call is passed on unchanged to the inner allocator; the
// counters are only read.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        unsafe { INNER.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        unsafe { INNER.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        FREES.fetch_add(1, Relaxed);
        unsafe { INNER.dealloc(ptr, layout) }
    }

    // A growing Vec or String: counted as an allocation of its new size,
    // since that is what it may cost (a new block and a copy).
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        unsafe { INNER.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counts {
    pub(crate) allocs: u64,
    pub(crate) frees: u64,
    pub(crate) bytes: u64,
}

pub(crate) fn counts() -> Counts {
    Counts {
        allocs: ALLOCS.load(Relaxed),
        frees: FREES.load(Relaxed),
        bytes: BYTES.load(Relaxed),
    }
}
