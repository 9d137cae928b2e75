//! Bucket documents: their `_id`, planning (pure), the MongoDB store, the
//! writer that runs plans and resolves conflicts, and the seam between the
//! two (`db`).

pub mod db;
pub mod id;
pub mod plan;
pub mod size;
pub mod store;
pub mod writer;
