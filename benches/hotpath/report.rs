//! What a run prints and writes.

use super::*;

pub(crate) struct Report<'a> {
    pub(crate) args: &'a Args,
    pub(crate) batch: usize,
    pub(crate) meters: &'a BTreeMap<Stage, Meter>,
    pub(crate) cold: Option<&'a (Meter, Sent)>,
    pub(crate) sent: &'a Sent,
    pub(crate) payload_bytes: usize,
    /// A trade's history entry as stored (BSON), on average.
    pub(crate) entry_bytes: usize,
    pub(crate) load: [f64; 2],
    /// The default and the mapped decode of the same trades.
    pub(crate) mapped: Option<&'a (Meter, Meter)>,
    /// The parse floor ([`stage_least`]).
    pub(crate) floor: Option<&'a Meter>,
    /// The default and the Avro decode of the same trades, and the Avro
    /// records' mean size.
    pub(crate) avro: Option<&'a (Meter, Meter, usize)>,
}

impl Report<'_> {
    fn events(&self) -> f64 {
        (self.args.batches * self.batch) as f64
    }

    pub(crate) fn print(&self) {
        let a = self.args;
        println!(
            "hot path: {} batches of {} events ({} warm-up), {} customers, {} partitions; \
             allocator {ALLOCATOR}; load average {:.2} → {:.2}",
            a.batches, self.batch, a.warmup, a.customers, a.partitions, self.load[0], self.load[1]
        );
        println!(
            "\n{:<14} {:>10} {:>10} {:>13} {:>13} {:>12}",
            "stage", "ns/event", "min", "allocs/event", "frees/event", "bytes/event"
        );
        let mut rows: Vec<(String, &Meter)> = Stage::ALL
            .iter()
            .filter_map(|s| Some((s.name().to_string(), self.meters.get(s)?)))
            .collect();
        if let Some((cold, _)) = self.cold {
            rows.push(("write (cold)".to_string(), cold));
        }
        for (name, m) in rows {
            println!(
                "{name:<14} {:>10.0} {:>10.0} {:>13.2} {:>13.2} {:>12.0}",
                m.median(),
                m.min(),
                m.per_event(m.counts.allocs),
                m.per_event(m.counts.frees),
                m.per_event(m.counts.bytes)
            );
        }
        let total: f64 = self.meters.values().map(Meter::median).sum::<f64>()
            - self.meters.get(&Stage::Plan).map_or(0.0, Meter::median)
            - self.meters.get(&Stage::Encode).map_or(0.0, Meter::median);
        println!("{:<14} {total:>10.0}   (intake + decode + write + free; write plans and encodes itself)", "worker path");
        self.print_sent();
        self.print_mapped();
        self.print_avro();
        if let Some(f) = self.floor {
            println!(
                "\nthe parse floor (serde_json's derive into borrowed fields, nothing else; {} rounds): \
                 {:.0} ns, {:.2} allocs per event",
                f.ns_per_event.len(),
                f.median(),
                f.per_event(f.counts.allocs)
            );
        }
    }

    /// Issue #28's bound: a mapped decode at most 1.2 × the default one.
    fn print_mapped(&self) {
        let Some((d, m)) = self.mapped else {
            return;
        };
        println!(
            "\ndecode of the same trades ({} rounds, median ns/event, allocs/event): \
             default schema {:.0} ns, {:.2}; FIX-style through its mapping {:.0} ns, {:.2}; \
             ratio {:.2}",
            d.ns_per_event.len(),
            d.median(),
            d.per_event(d.counts.allocs),
            m.median(),
            m.per_event(m.counts.allocs),
            m.median() / d.median()
        );
    }

    /// Issue #48's bound: an Avro decode no slower than the default one.
    fn print_avro(&self) {
        let Some((d, a, bytes)) = self.avro else {
            return;
        };
        println!(
            "\ndecode of the same trades ({} rounds, median ns/event, allocs/event): \
             JSON default schema {:.0} ns, {:.2}; Avro ({bytes} B records) through the \
             registry's cache {:.0} ns, {:.2}; ratio {:.2}",
            d.ns_per_event.len(),
            d.median(),
            d.per_event(d.counts.allocs),
            a.median(),
            a.per_event(a.counts.allocs),
            a.median() / d.median()
        );
    }

    fn print_sent(&self) {
        let s = self.sent;
        let per = |x: u64| x as f64 / self.events();
        let per_batch = |x: u64| x as f64 / self.args.batches as f64;
        println!("\nsent, steady state (per trade unless said):");
        println!(
            "  fill statements {:.3}, new buckets {:.3}, statements {:.3}",
            per(s.fill_statements),
            per(s.inserted_buckets),
            per(s.fill_statements + s.inserted_buckets)
        );
        println!(
            "  BSON bytes: fills {:.0}, new buckets {:.0}, commands {:.0} \
             (payload JSON {} B/event, history entry {} B)",
            per(s.fill_statement_bytes),
            per(s.bucket_bytes),
            per(s.command_bytes),
            self.payload_bytes,
            self.entry_bytes
        );
        println!(
            "  per batch: {:.1} update commands, {:.1} insert commands, {:.1} head loads, {:.1} key lookups",
            per_batch(s.update_commands),
            per_batch(s.insert_commands),
            per_batch(s.head_loads),
            per_batch(s.key_lookups)
        );
        if let Some((_, cold)) = self.cold {
            println!(
                "  cold write: {} heads loaded in {} request(s)",
                cold.heads_loaded, cold.head_loads
            );
        }
    }

    pub(crate) fn write_json(&self) -> anyhow::Result<()> {
        let stages: serde_json::Map<String, serde_json::Value> = self
            .meters
            .iter()
            .map(|(s, m)| (s.name().to_string(), m.json()))
            .collect();
        let value = json!({
            "allocator": ALLOCATOR,
            "batch": self.batch,
            "batches": self.args.batches,
            "warmup": self.args.warmup,
            "customers": self.args.customers,
            "partitions": self.args.partitions,
            "load_average": self.load,
            "stages": stages,
            "write_cold": self.cold.map(|(m, s)| json!({"meter": m.json(), "sent": s})),
            "sent_steady": self.sent,
            "events_steady": self.events(),
            "payload_bytes_per_event": self.payload_bytes,
            "history_entry_bytes": self.entry_bytes,
            "decode_mapped": self.mapped.map(|(d, m)| json!({
                "default": d.json(),
                "mapped_fix_style": m.json(),
                "ratio_median": m.median() / d.median(),
            })),
            "library_floor": self.floor.map(Meter::json),
            "decode_avro": self.avro.map(|(d, a, bytes)| json!({
                "default_json": d.json(),
                "avro": a.json(),
                "avro_record_bytes": bytes,
                "ratio_median": a.median() / d.median(),
            })),
        });
        if let Some(dir) = self.args.json.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&self.args.json, serde_json::to_string_pretty(&value)?)?;
        println!("\nwrote {}", self.args.json.display());
        Ok(())
    }
}
