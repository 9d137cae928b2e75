pub mod bucket;
pub mod config;
pub mod event;
pub mod offsets;
