//! The writer's view of the database: the four requests it makes, as a
//! trait. [`BucketStore`] is the real one (MongoDB); the writer's model
//! test runs the real [`super::writer::BucketWriter`] against an in-memory
//! database that applies the same statements with the same guarantees
//! (guarded updates, unique indexes, one atomic statement at a time) while
//! other writers' statements interleave between any two.
//!
//! The futures are `Send` so that the pipeline's future is: the product
//! runs it on a single-threaded runtime of its own (`pipeline::run`), but
//! the tests spawn it on multi-threaded ones (`tokio::spawn`).

use std::future::Future;

use mongodb::bson::RawDocumentBuf;

use super::plan::LoadedHead;
use super::store::{BucketStore, FillOutcome, InsertOutcome, StoreError};
use crate::event::CustomerId;

/// What the writer asks of the database. Every method is one request
/// (or, for many customers, a few), bounded by the store's time limits.
pub trait BucketDb {
    /// In sharded mode the value every filter of `customer`'s buckets
    /// carries (the shard key); `None` otherwise.
    fn shard_key(&self, customer: &CustomerId) -> Option<CustomerId>;

    /// Each customer's newest bucket.
    fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> impl Future<Output = Result<Vec<(CustomerId, LoadedHead)>, StoreError>> + Send;

    /// Where the `wanted` keys are stored: `(key, bucket _id)`, each pair
    /// in a bucket of any customer (unsharded) or of the customer that
    /// asked (sharded).
    fn find_keys(
        &self,
        wanted: &[(CustomerId, String)],
    ) -> impl Future<Output = Result<Vec<(String, String)>, StoreError>> + Send;

    /// Runs guarded fill statements, unordered.
    fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> impl Future<Output = Result<FillOutcome, StoreError>> + Send;

    /// Inserts new buckets, `ordered` or not.
    fn insert_buckets(
        &self,
        docs: Vec<RawDocumentBuf>,
        ordered: bool,
    ) -> impl Future<Output = Result<InsertOutcome, StoreError>> + Send;
}

impl BucketDb for BucketStore {
    fn shard_key(&self, customer: &CustomerId) -> Option<CustomerId> {
        BucketStore::shard_key(self, customer)
    }

    async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        BucketStore::load_heads(self, customers).await
    }

    async fn find_keys(
        &self,
        wanted: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        BucketStore::find_keys(self, wanted).await
    }

    async fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> Result<FillOutcome, StoreError> {
        BucketStore::apply_fills(self, statements).await
    }

    async fn insert_buckets(
        &self,
        docs: Vec<RawDocumentBuf>,
        ordered: bool,
    ) -> Result<InsertOutcome, StoreError> {
        BucketStore::insert_buckets(self, docs, ordered).await
    }
}
