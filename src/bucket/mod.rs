//! Bucket documents: their `_id`, planning (pure), the MongoDB store, and
//! the writer that runs plans and resolves conflicts.

pub mod id;
pub mod plan;
pub mod size;
pub mod store;
pub mod writer;
