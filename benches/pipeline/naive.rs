//! The naive baseline: the manual's one conditional upsert per trade.

use std::time::Instant;

use mongodb::bson::{doc, Bson, Document};
use mongodb::options::{Acknowledgment, WriteConcern};
use secrecy::ExposeSecret;

use crate::target::{decode_all, Msg, Target};

/// The manual's way: one conditional upsert per trade, one round trip each,
/// with an index on what the filter uses.
pub(crate) async fn naive_baseline(
    target: &Target,
    messages: &[Msg],
    count: usize,
) -> anyhow::Result<f64> {
    let settings = target.settings();
    let (trades, _) = decode_all(&target.topic, &messages[..count.min(messages.len())])?;
    let client = mongodb::Client::with_uri_str(settings.mongodb.uri.expose_secret()).await?;
    let coll = client.database(&target.db).collection::<Document>("naive");
    coll.create_index(
        mongodb::IndexModel::builder()
            .keys(doc! {"customerId": 1, "count": 1})
            .build(),
    )
    .await?;
    let wc = WriteConcern::builder()
        .w(Acknowledgment::Majority)
        .journal(settings.mongodb.journal)
        .build();
    let cap = i64::from(settings.buckets.capacity);
    let started = Instant::now();
    for t in &trades {
        let id = format!("{}_{}", t.customer.id_text(), t.epoch_seconds());
        coll.update_one(
            doc! {"customerId": t.customer.to_bson(), "count": {"$lt": cap}},
            doc! {
                "$push": {"history": Bson::Document(t.entry()?)},
                "$inc": {"count": 1},
                "$setOnInsert": {"_id": id},
            },
        )
        .upsert(true)
        .write_concern(wc.clone())
        .await?;
    }
    Ok(trades.len() as f64 / started.elapsed().as_secs_f64())
}
