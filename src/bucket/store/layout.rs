//! The collection's layout: the indexes each mode's guarantees rest on,
//! how `init` creates and checks them, and sharding (`init_and_shard`).

use futures::TryStreamExt;
use mongodb::bson::{doc, Document};
use mongodb::options::IndexOptions;
use mongodb::results::{CollectionSpecification, CollectionType};
use mongodb::IndexModel;

use super::error::{command_code, InitError, StoreError};
use super::{bounded, in_time, whole_number, BucketStore};
use crate::event::CustomerId;

/// The shard key of sharded mode. Ranged, not hashed: MongoDB enforces a
/// unique index across shards only when it starts with the shard key, and
/// documents that for ranged shard keys; a hashed key index cannot be
/// unique itself. Ranged on the customer also keeps a customer's buckets
/// in one chunk, so its page query is one shard's.
pub const SHARD_KEY_FIELD: &str = "customerId";

/// The server's answer for a collection or database that does not exist.
const NAMESPACE_NOT_FOUND: i32 = 26;

/// The server's answer to a user without the privilege.
const UNAUTHORIZED: i32 = 13;

/// Where the collection stands with sharding, as `init` found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardState {
    /// Not connected to mongos: a replica set, where nothing is sharded.
    NoMongos,
    /// Through mongos; the collection is not sharded.
    NotSharded,
    /// Through mongos; sharded on `{customerId: 1}`.
    Sharded,
    /// Through mongos, but the user may not read `config.collections`:
    /// unknown.
    Unknown(String),
}

impl BucketStore {
    /// Creates the indexes the guarantees rest on, after checking that the
    /// collection is laid out for this mode (see [`layout_conflict`] and
    /// [`BucketStore::shard_state`]). Idempotent; what `run` does at
    /// start-up. Never shards: that takes privileges a worker should not
    /// need, and is [`BucketStore::init_and_shard`]'s.
    pub async fn init(&self) -> Result<ShardState, InitError> {
        let existing = self.index_models().await?;
        let spec = self.specification().await?;
        let ns = self.namespace();
        if let Some(why) = collection_conflict(spec.as_ref(), &existing, &ns) {
            return Err(InitError::Layout(why));
        }
        if let Some(conflict) = layout_conflict(&existing, self.sharded, &ns) {
            return Err(InitError::Layout(conflict));
        }
        let state = self.shard_state().await?;
        self.refuse_non_canonical_customers().await?;
        let create = self.coll.create_indexes(index_models(self.sharded));
        bounded("createIndexes", self.operation_limit, create).await?;
        match (&state, self.sharded) {
            (ShardState::NoMongos, true) => tracing::warn!(
                "mongodb.sharded is true but the server is not mongos: the customer-scoped \
                 indexes are in place, the shard layout was not applied"
            ),
            (ShardState::NotSharded, true) => tracing::warn!(
                collection = %self.namespace(),
                "mongodb.sharded is true but the collection is not sharded yet: \
                 `tradebucket init` shards it on {{customerId: 1}}"
            ),
            (ShardState::Unknown(why), _) => tracing::warn!(
                collection = %self.namespace(),
                reason = %why,
                "cannot tell how the collection is sharded"
            ),
            _ => {}
        }
        Ok(state)
    }

    /// In sharded mode, refuses buckets whose `customerId` is not in its
    /// canonical form (a collection moved from unsharded mode whose
    /// customer ids came as text of digits): sharded mode's filters and
    /// customer-scoped unique indexes carry the number, so they would not
    /// find those buckets, and the customer would get a second chain and
    /// its redelivered trades a second copy. Checked by `init` itself, so
    /// a worker started without `tradebucket init` refuses them too.
    async fn refuse_non_canonical_customers(&self) -> Result<(), InitError> {
        if !self.sharded {
            return Ok(());
        }
        match self.non_canonical_customer().await? {
            None => Ok(()),
            Some(id) => Err(InitError::Layout(format!(
                "{ns} holds buckets whose customerId is text of digits (bucket {id}); sharded \
                 mode stores such ids as numbers and would not find them. Convert them, with \
                 every worker stopped, as \"Moving an existing collection\" in \
                 docs/operations.md#sharding shows, then run init again",
                ns = self.namespace()
            ))),
        }
    }

    /// [`BucketStore::init`], and in sharded mode through mongos, shards
    /// the collection on `{customerId: 1}` if it is not yet: what
    /// `tradebucket init` does.
    pub async fn init_and_shard(&self) -> Result<ShardState, InitError> {
        let state = self.init().await?;
        if !self.sharded || state != ShardState::NotSharded {
            return Ok(state);
        }
        // Bounded too: `init` run again after a timeout finds the
        // collection sharded, or shards it.
        let admin = self.client.database("admin");
        let shard = admin.run_command(doc! {
            "shardCollection": self.namespace(),
            "key": {SHARD_KEY_FIELD: 1},
        });
        bounded("shardCollection", self.operation_limit, shard).await?;
        Ok(ShardState::Sharded)
    }

    /// Whether the collection has the unique index on trade keys that this
    /// mode creates (`init`): with it, MongoDB refuses a second bucket
    /// holding a key (per customer, sharded), so a bucket read once tells
    /// where each of its keys is, and nowhere else. Reconcile trusts
    /// that only while the index is there.
    pub async fn trade_keys_are_unique(&self) -> Result<bool, StoreError> {
        let wanted = index_models(self.sharded)
            .into_iter()
            .find(|m| m.keys.contains_key("history.key"))
            .map(|m| m.keys);
        let unique = |m: &IndexModel| m.options.as_ref().and_then(|o| o.unique) == Some(true);
        let have = self.index_models().await?;
        Ok(have
            .iter()
            .any(|m| unique(m) && Some(&m.keys) == wanted.as_ref()))
    }

    /// Why the collection cannot hold buckets as the guarantees need, if
    /// it cannot ([`collection_conflict`]): what reconcile checks before
    /// it trusts a key lookup.
    pub async fn collection_conflict(&self) -> Result<Option<String>, StoreError> {
        let indexes = self.index_models().await?;
        let spec = self.specification().await?;
        let ns = self.namespace();
        Ok(collection_conflict(spec.as_ref(), &indexes, &ns))
    }

    /// What `listCollections` says of the collection; none if it does not
    /// exist yet.
    async fn specification(&self) -> Result<Option<CollectionSpecification>, StoreError> {
        let list = async {
            let listed = self
                .db
                .list_collections()
                .filter(doc! {"name": self.coll.name()});
            let specs: Vec<_> = listed.await?.try_collect().await?;
            Ok::<_, mongodb::error::Error>(specs.into_iter().next())
        };
        bounded("listCollections", self.operation_limit, list).await
    }

    /// The collection's indexes; none if it does not exist yet.
    async fn index_models(&self) -> Result<Vec<IndexModel>, StoreError> {
        let listed = async { self.coll.list_indexes().await?.try_collect().await };
        match in_time("listIndexes", self.operation_limit, listed).await? {
            Ok(models) => Ok(models),
            Err(e) if command_code(&e) == Some(NAMESPACE_NOT_FOUND) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    /// Through mongos (`hello` says `msg: "isdbgrid"`), the collection's
    /// entry in `config.collections`, which has its shard key under `key`
    /// on MongoDB 6, 7 and 8 (8.0 also lists unsharded collections it
    /// tracks, as `unsplittable`, and those are not sharded). Refuses a
    /// collection sharded on another key, and in unsharded mode any
    /// sharded one: its global unique indexes cannot exist there.
    async fn shard_state(&self) -> Result<ShardState, InitError> {
        let limit = self.operation_limit;
        let hello = bounded("hello", limit, self.db.run_command(doc! {"hello": 1})).await?;
        if hello.get_str("msg") != Ok("isdbgrid") {
            return Ok(ShardState::NoMongos);
        }
        let collections = self
            .client
            .database("config")
            .collection::<Document>("collections");
        let find = collections
            .find_one(doc! {"_id": self.namespace()})
            .max_time(limit);
        let entry = match in_time("find", limit, find).await? {
            Ok(entry) => entry,
            Err(e) if command_code(&e) == Some(UNAUTHORIZED) => {
                return Ok(ShardState::Unknown(e.to_string()))
            }
            Err(e) => return Err(e.into()),
        };
        let key = entry
            .filter(|c| {
                !c.get_bool("dropped").unwrap_or(false)
                    && !c.get_bool("unsplittable").unwrap_or(false)
            })
            .and_then(|c| c.get_document("key").ok().cloned());
        let ns = self.namespace();
        match key {
            None => Ok(ShardState::NotSharded),
            Some(key) if !self.sharded => Err(InitError::Layout(format!(
                "{ns} is sharded (on {key}) but mongodb.sharded is false: set it to true \
                 (see docs/operations.md#sharding)"
            ))),
            Some(key) if is_key(&key, &[SHARD_KEY_FIELD]) => Ok(ShardState::Sharded),
            Some(key) => Err(InitError::Layout(format!(
                "{ns} is sharded on {key}; tradebucket's sharded mode needs {{customerId: 1}} \
                 (ranged), which its unique indexes start with. Reshard it \
                 (reshardCollection) or use another collection"
            ))),
        }
    }

    /// The `_id` of a bucket whose `customerId` is text that sharded mode
    /// would store as a number, if there is one.
    async fn non_canonical_customer(&self) -> Result<Option<String>, StoreError> {
        let find = self
            .coll
            .find(doc! {SHARD_KEY_FIELD: {"$type": "string", "$regex": "^(0|[1-9][0-9]*)$"}})
            .projection(doc! {SHARD_KEY_FIELD: 1});
        let mut cursor = bounded("find", self.operation_limit, find).await?;
        while let Some(d) = self.next_of(&mut cursor).await? {
            let text = d.get_str(SHARD_KEY_FIELD).unwrap_or_default();
            // Twenty digits and more stay text: no Int64 holds them.
            if CustomerId::Str(text.to_string()).canonical() != CustomerId::Str(text.to_string()) {
                return Ok(Some(d.get_str("_id").unwrap_or("?").to_string()));
            }
        }
        Ok(None)
    }
}

/// The indexes of each mode. Unsharded: `prev` and `history.key` unique
/// across the collection. Sharded: both unique per customer (MongoDB
/// allows a unique index on a sharded collection only if it starts with
/// the shard key), and `{customerId: 1, _id: 1}`, which serves `load_head`
/// (customer equality, `_id` range, newest first) and is the index the
/// shard key needs: `{customerId: 1, tickers: 1}` cannot be, being
/// multikey, and the unique ones cannot, being partial.
fn index_models(sharded: bool) -> Vec<IndexModel> {
    let unique = |name: &str, field: &str| {
        let keys = if sharded {
            doc! {SHARD_KEY_FIELD: 1, field: 1}
        } else {
            doc! {field: 1}
        };
        IndexModel::builder()
            .keys(keys)
            .options(
                IndexOptions::builder()
                    .name(name.to_string())
                    .unique(true)
                    // Buckets written by other tools (the manual's own
                    // upsert) have neither field; they must not collide
                    // with each other on a missing value.
                    .partial_filter_expression(doc! {field: {"$exists": true}})
                    .build(),
            )
            .build()
    };
    let plain = |name: &str, keys: Document| {
        IndexModel::builder()
            .keys(keys)
            .options(IndexOptions::builder().name(name.to_string()).build())
            .build()
    };
    let mut models = if sharded {
        vec![
            // One successor per bucket: no two writers can both open page n+1.
            unique("customer_prev_unique", "prev"),
            // One copy of each trade in a customer's buckets.
            unique("customer_history_key_unique", "history.key"),
            plain("customer_id", doc! {SHARD_KEY_FIELD: 1, "_id": 1}),
        ]
    } else {
        vec![
            unique("prev_unique", "prev"),
            // One copy of each trade across all buckets.
            unique("history_key_unique", "history.key"),
        ]
    };
    // The keyword-search index (multikey over `tickers`).
    models.push(plain(
        "customer_tickers",
        doc! {SHARD_KEY_FIELD: 1, "tickers": 1},
    ));
    models
}

/// Why the collection is laid out for the other mode, if it is: its unique
/// indexes on `prev` and `history.key` are scoped to the collection
/// (unsharded) or start with `customerId` (sharded). Found by key pattern,
/// whatever they are named. A collection with both is half-way through a
/// move and refused by both modes.
pub fn layout_conflict(indexes: &[IndexModel], sharded: bool, ns: &str) -> Option<String> {
    let unique_on = |fields: &[&str]| -> Vec<String> {
        indexes
            .iter()
            .filter(|m| m.options.as_ref().and_then(|o| o.unique) == Some(true))
            .filter(|m| is_key(&m.keys, fields))
            .map(|m| {
                m.options
                    .as_ref()
                    .and_then(|o| o.name.clone())
                    .unwrap_or_else(|| m.keys.to_string())
            })
            .collect()
    };
    let global: Vec<String> = [&["prev"][..], &["history.key"]]
        .iter()
        .flat_map(|f| unique_on(f))
        .collect();
    let scoped: Vec<String> = [
        &[SHARD_KEY_FIELD, "prev"][..],
        &[SHARD_KEY_FIELD, "history.key"],
    ]
    .iter()
    .flat_map(|f| unique_on(f))
    .collect();
    if sharded && !global.is_empty() {
        Some(format!(
            "mongodb.sharded is true but {ns} has the unsharded layout's unique indexes {} \
             (trade ids unique across customers), which MongoDB does not allow on a sharded \
             collection. Move it to sharded mode with every worker stopped: drop them \
             (dropIndex) and run `tradebucket init` with mongodb.sharded = true; see \
             \"Moving an existing collection\" in docs/operations.md#sharding",
            global.join(", ")
        ))
    } else if !sharded && !scoped.is_empty() {
        Some(format!(
            "mongodb.sharded is false but {ns} has the sharded layout's unique indexes {} \
             (trade ids unique per customer): set mongodb.sharded = true, or go back to \
             the unsharded layout as docs/operations.md#sharding says",
            scoped.join(", ")
        ))
    } else {
        None
    }
}

/// Why the collection cannot hold buckets as the guarantees need, if it
/// cannot: it is not a plain collection, the server deletes its documents
/// on its own (capped, a TTL), or it compares text other than byte by
/// byte (a collation). Each would lose trades with no error: a deleted
/// bucket takes its trades, and under a case-insensitive collation
/// customers `abc` and `ABC` share an `_id`, trade keys `t1` and `T1` one
/// slot, so the second trade is taken for a copy of the first. Every
/// guarantee keyed on text rests on byte comparison: a customer's `_id`
/// range, its newest bucket (the sort), a trade key's lookup and the
/// unique indexes.
pub fn collection_conflict(
    spec: Option<&CollectionSpecification>,
    indexes: &[IndexModel],
    ns: &str,
) -> Option<String> {
    spec.and_then(|s| options_conflict(s, ns))
        .or_else(|| index_conflict(indexes, ns))
        .map(|why| format!("{why} (see docs/operations.md#the-collection)"))
}

/// What the collection's own options make impossible. The options are
/// fixed at creation: only another collection fixes them.
fn options_conflict(spec: &CollectionSpecification, ns: &str) -> Option<String> {
    let o = &spec.options;
    let why = if spec.collection_type != CollectionType::Collection {
        format!(
            "{ns} is a {:?}, not a collection of documents",
            spec.collection_type
        )
    } else if o.capped == Some(true) {
        format!("{ns} is capped: MongoDB removes its oldest buckets when it is full")
    } else if o.expire_after_seconds.is_some() {
        format!("{ns} expires its documents (expireAfterSeconds): MongoDB removes buckets")
    } else if let Some(c) = o.collation.as_ref().filter(|c| c.locale != "simple") {
        format!(
            "{ns} was created with the default collation {{locale: {:?}}}: tradebucket \
             compares customer ids and trade keys byte by byte, and under this one two \
             different ids can compare equal, so a trade would be taken for a copy",
            c.locale
        )
    } else {
        return None;
    };
    Some(format!(
        "{why}, and trades would be lost without an error. Use a collection created \
         by `tradebucket init`, without these options"
    ))
}

/// What an index adds that loses trades: a TTL index removes buckets; a
/// unique one under a collation makes two different keys collide. Other
/// collated indexes are harmless: a query without that collation (all of
/// tradebucket's) never uses them.
fn index_conflict(indexes: &[IndexModel], ns: &str) -> Option<String> {
    let named = |keep: &dyn Fn(&IndexOptions) -> bool| -> Vec<String> {
        let options = indexes.iter().filter_map(|m| m.options.as_ref());
        options
            .filter(|o| keep(o))
            .map(|o| o.name.clone().unwrap_or_default())
            .collect()
    };
    let ttl = named(&|o| o.expire_after.is_some());
    let collated = named(&|o| {
        o.unique == Some(true) && o.collation.as_ref().is_some_and(|c| c.locale != "simple")
    });
    let why = if !ttl.is_empty() {
        format!(
            "{ns} has TTL indexes ({}): MongoDB removes buckets",
            ttl.join(", ")
        )
    } else if !collated.is_empty() {
        format!(
            "{ns} has unique indexes with a collation other than the simple one ({}): \
             two different trade keys can collide, so a trade would be taken for a copy",
            collated.join(", ")
        )
    } else {
        return None;
    };
    Some(format!(
        "{why}, and trades would be lost without an error. Drop them (dropIndex) and \
         run `tradebucket init`"
    ))
}

/// Whether an index key pattern is exactly `fields`, in order, ascending.
fn is_key(keys: &Document, fields: &[&str]) -> bool {
    keys.len() == fields.len()
        && keys
            .iter()
            .zip(fields)
            .all(|((name, direction), field)| name == field && whole_number(direction) == Some(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;

    fn index(name: &str, keys: Document, unique: bool) -> IndexModel {
        IndexModel::builder()
            .keys(keys)
            .options(
                IndexOptions::builder()
                    .name(name.to_string())
                    .unique(unique)
                    .build(),
            )
            .build()
    }

    #[test]
    fn each_mode_creates_what_the_other_refuses() {
        let ns = "db.trades";
        for sharded in [false, true] {
            let own = index_models(sharded);
            assert_eq!(layout_conflict(&own, sharded, ns), None, "{sharded}");
            let refused = layout_conflict(&own, !sharded, ns).expect("the other mode refuses");
            assert!(refused.contains("docs/operations.md#sharding"), "{refused}");
            // Half-way through a move, both sets: both modes refuse.
            let mut both = own.clone();
            both.extend(index_models(!sharded));
            assert!(layout_conflict(&both, sharded, ns).is_some());
        }
        // Sharded, every index starts with the shard key, and one that
        // can support it is neither partial nor multikey: `customer_id`.
        for m in index_models(true) {
            assert_eq!(
                m.keys.keys().next().map(String::as_str),
                Some(SHARD_KEY_FIELD)
            );
        }
        assert!(index_models(true)
            .iter()
            .any(|m| is_key(&m.keys, &[SHARD_KEY_FIELD, "_id"])
                && m.options
                    .as_ref()
                    .unwrap()
                    .partial_filter_expression
                    .is_none()));
    }

    #[test]
    fn layouts_are_told_by_key_pattern_not_name() {
        let ns = "db.trades";
        let renamed = vec![index("mine", doc! {"history.key": 1.0}, true)];
        let why = layout_conflict(&renamed, true, ns).expect("a global unique key index");
        assert!(why.contains("mine") && why.contains(ns), "{why}");
        // Not unique, or descending, or another key: not the layout's.
        for other in [
            index("a", doc! {"history.key": 1}, false),
            index("b", doc! {"prev": -1}, true),
            index("c", doc! {"prev": 1, "count": 1}, true),
        ] {
            assert_eq!(layout_conflict(&[other], true, ns), None);
        }
        let scoped = vec![index("s", doc! {"customerId": 1_i64, "prev": 1}, true)];
        assert!(layout_conflict(&scoped, false, ns).is_some());
    }

    /// A `listCollections` entry as the server sends it.
    fn spec(kind: &str, options: Document) -> CollectionSpecification {
        let entry = doc! {"name": "trades", "type": kind, "options": options,
        "info": {"readOnly": false}};
        mongodb::bson::from_document(entry).expect("a listCollections entry")
    }

    fn with_options(name: &str, keys: Document, options: Document) -> IndexModel {
        let mut listed = doc! {"key": keys, "name": name};
        listed.extend(options);
        mongodb::bson::from_document(listed).expect("a listIndexes entry")
    }

    #[test]
    fn a_collection_that_would_lose_trades_is_refused() {
        let ns = "db.trades";
        let ours = index_models(false);
        let plain = spec("collection", doc! {});
        assert_eq!(collection_conflict(None, &ours, ns), None);
        assert_eq!(collection_conflict(Some(&plain), &ours, ns), None);
        // mongod lists a collation in full, with its ICU version.
        let english = doc! {"locale": "en", "strength": 2, "numericOrdering": false,
        "version": "57.1"};
        let simple = spec("collection", doc! {"collation": {"locale": "simple"}});
        assert_eq!(collection_conflict(Some(&simple), &ours, ns), None);
        for (entry, says) in [
            (
                spec("collection", doc! {"collation": english.clone()}),
                "\"en\"",
            ),
            (
                spec("collection", doc! {"capped": true, "size": 4096}),
                "capped",
            ),
            (
                spec(
                    "collection",
                    doc! {"expireAfterSeconds": 60_i64,
                    "clusteredIndex": {"key": {"_id": 1}, "unique": true}},
                ),
                "expireAfterSeconds",
            ),
            (
                spec("timeseries", doc! {"timeseries": {"timeField": "t"}}),
                "Timeseries",
            ),
            (
                spec("view", doc! {"viewOn": "other", "pipeline": []}),
                "View",
            ),
        ] {
            let why = collection_conflict(Some(&entry), &ours, ns).expect(says);
            assert!(why.contains(says) && why.contains(ns), "{why}");
            assert!(why.contains("docs/operations.md#the-collection"), "{why}");
        }
        // A unique index under a collation, or a TTL index, is refused by
        // name; a collated index that is not unique is not.
        let refused = [
            with_options(
                "keys_ci",
                doc! {"history.key": 1},
                doc! {"unique": true, "collation": english.clone()},
            ),
            with_options(
                "old_pages",
                doc! {"history.date": 1},
                doc! {"expireAfterSeconds": 86_400},
            ),
        ];
        for index in refused {
            let name = index.options.as_ref().unwrap().name.clone().unwrap();
            let mut with = ours.clone();
            with.push(index);
            let why = collection_conflict(Some(&plain), &with, ns).expect("refused");
            assert!(why.contains(&name), "{why}");
        }
        let mut harmless = ours.clone();
        harmless.push(with_options(
            "tickers_ci",
            doc! {"tickers": 1},
            doc! {"collation": english},
        ));
        harmless.push(with_options(
            "prev_simple",
            doc! {"prev": 1},
            doc! {"unique": true, "collation": {"locale": "simple"}},
        ));
        assert_eq!(collection_conflict(Some(&plain), &harmless, ns), None);
    }
}
