//! The writer's database, in memory.

use super::*;

/// The writer's database, in memory: every customer's newest bucket as a
/// warmed-up worker would find it, and a count of what it is sent. Each
/// guard holds (one writer, no one else writing), so nothing conflicts.
pub(crate) struct MemDb {
    pub(crate) heads: Arc<HashMap<CustomerId, Option<Box<BucketHead>>>>,
    pub(crate) sent: Mutex<Sent>,
}

impl MemDb {
    pub(crate) fn sent(&self) -> std::sync::MutexGuard<'_, Sent> {
        self.sent.lock().expect("not poisoned")
    }
}

impl BucketDb for MemDb {
    fn shard_key(&self, _: &CustomerId) -> Option<CustomerId> {
        None
    }

    // A clone stands in for decoding the stored bucket the driver returns.
    async fn load_heads(
        &self,
        customers: Vec<CustomerId>,
    ) -> Result<Vec<(CustomerId, LoadedHead)>, StoreError> {
        let mut sent = self.sent();
        sent.head_loads += 1;
        sent.heads_loaded += customers.len() as u64;
        Ok(customers
            .into_iter()
            .map(|c| {
                let head = self.heads.get(&c).cloned().flatten().map(|h| *h);
                (c, Ok(head))
            })
            .collect())
    }

    // Asked only for redeliveries and conflicts, which this stream has not.
    async fn find_keys(
        &self,
        _: &[(CustomerId, String)],
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.sent().key_lookups += 1;
        Ok(Vec::new())
    }

    /// The `update` commands exactly as `BucketStore::apply_fills` builds
    /// them (its own chunking and command builder).
    async fn apply_fills(
        &self,
        statements: Vec<RawDocumentBuf>,
    ) -> Result<FillOutcome, StoreError> {
        let matched = statements.len() as u64;
        let mut sent = self.sent();
        let write_concern = rawdoc! {"w": "majority", "j": true, "wtimeout": 10_000_i64};
        for chunk in chunk_by_size(&statements) {
            for s in &statements[chunk.clone()] {
                sent.fill_statements += 1;
                sent.fill_statement_bytes += s.as_bytes().len() as u64;
            }
            let command = update_command("buckets", &statements[chunk], &write_concern);
            sent.update_commands += 1;
            sent.command_bytes += command.as_bytes().len() as u64;
        }
        Ok(FillOutcome {
            matched,
            errors: Vec::new(),
        })
    }

    /// The documents as the driver's `insert_many` lays them out: one
    /// command of the documents' bytes (its framing is not modelled).
    async fn insert_buckets(
        &self,
        docs: Vec<RawDocumentBuf>,
        _ordered: bool,
    ) -> Result<InsertOutcome, StoreError> {
        let total: usize = docs.iter().map(|d| d.as_bytes().len()).sum();
        let mut body = Vec::with_capacity(total);
        for d in &docs {
            body.extend_from_slice(d.as_bytes());
        }
        let mut sent = self.sent();
        sent.insert_commands += 1;
        sent.inserted_buckets += docs.len() as u64;
        sent.bucket_bytes += total as u64;
        sent.command_bytes += body.len() as u64;
        Ok(InsertOutcome::default())
    }
}
