#!/usr/bin/env python3
"""Renders docs/benchmarks.md and its chart from the figures one run of
benches/pipeline/ wrote (scripts/bench calls this after the run).

    python3 benches/report.py RESULTS_JSON TIMELINE_CSV MD_OUT PNG_OUT FLAGS

FLAGS is the command line the run was made with (shown in the document).
"""
import csv, json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

results_path, timeline_path, md_path, png_path, flags = sys.argv[1:]
r = json.load(open(results_path))
m = r["machine"]
first, second = r["tradebucket_first"], r.get("tradebucket_second")
db = r["database_ceiling"]["events_per_second"]
kafka = r["kafka_read_ceiling"]["events_per_second"]
naive = r["naive_baseline"]["events_per_second"]
tb = first["events_per_second"]
delays = r["delays"]
d = delays[0]
args_latency = round(d["events"] / max(d["rate_events_per_second"], 1))
# The steady target load (issue #18's 1,000/s, no fraction) and the delay
# curve (fractions of the append ceiling), all at the default settings.
steadies = [x for x in delays if x.get("fraction_of_append_ceiling") is None]
steady = steadies[0] if steadies else None
curve = sorted((x for x in delays if x.get("fraction_of_append_ceiling") is not None),
               key=lambda x: x["rate_events_per_second"])
appends = (r.get("append_ceiling") or {}).get("appends_per_second")
hold_max_age = r.get("hold_max_age_seconds", 10.0)
# The steady capacity: the highest rate of the curve held with the worker's
# p99 within 1 s, every lower rate held too.
held, missed = None, None
for x in curve:
    if x["p99_seconds"] <= 1.0 and missed is None:
        held = x
    elif missed is None:
        missed = x
# Above the append ceiling the delay must stop at the documented bound:
# held trades go with the first batch `batch.hold_max_age` after they were
# held, and that batch's write and commit take at most the capacity's 1 s.
overloaded = [x for x in curve if x["fraction_of_append_ceiling"] > 1.0]

# CPU-seconds per million events (= microseconds per event) of each process.
def cpu(entry, proc):
    return (entry.get("cpu_per_million") or {}).get(proc)
kafka_cpu = cpu(r["kafka_read_ceiling"], "broker")
db_cpu = cpu(r["database_ceiling"], "database")
cores = m["cores"]
# Both servers at their ceilings' cost per event, sharing the machine's
# cores, and nothing else: the most events/s this machine could carry.
def bound_of(database_cpu):
    return cores * 1e6 / (kafka_cpu + database_cpu) if kafka_cpu and database_cpu else None
bound = bound_of(db_cpu)
# The second set's bound: the same broker cost (the Kafka ceiling reads the
# first million), and the database's for the least a restarted worker must
# do there (read each customer's newest bucket, complete the open ones,
# insert the rest), per trade of the set.
db2 = r.get("database_ceiling_second")
db2_cpu = cpu(db2, "database") if db2 else None
bound2 = bound_of(db2_cpu)

def rate(x): return f"{x:,.0f}"
# A target a server's own ceiling already misses: the server doing
# nothing but its part of the work falls short of it, so no client on
# this machine can meet it. The verdict says so, beside the miss.
SERVER_FLOOR = "server floor"
def verdict(ok):
    if ok == SERVER_FLOOR:
        return "**misses**: set by the server (the server alone, doing only its part, misses it)"
    return "not shown by this run" if ok is None else ("**holds**" if ok else "**misses**")
def us(x): return "–" if x is None else f"{x:.2f}"
def ratio(a, b): return a / b if a is not None and b else None

rows = [
    ("tradebucket, first set (fresh group and database)", first["events"], first["seconds"], tb),
]
def steady_rate(run):
    # Events per second between 10 % and 90 % of the run's events written
    # (absent from runs before session 19).
    c = (run or {}).get("steady_cpu_per_million") or {}
    return c.get("events_per_second")
def steady_row(label, run):
    c, r_ = run["steady_cpu_per_million"], steady_rate(run)
    n = c["to_written"] - c["from_written"]
    return (label + ", from 10 % to 90 % of its events written", n, n / r_, r_)
tb_steady = steady_rate(first)
if tb_steady:
    rows.append(steady_row("tradebucket, first set", first))
if second:
    rows.append(("tradebucket, second set (collection already holds the first)",
                 second["events"], second["seconds"], second["events_per_second"]))
    if steady_rate(second):
        rows.append(steady_row("tradebucket, second set", second))
rows += [
    ("database ceiling: final buckets, unordered bulk inserts", r["events"], r["database_ceiling"]["seconds"], db),
    ("Kafka read ceiling: consume without processing", r["events"], r["kafka_read_ceiling"]["seconds"], kafka),
    ("naive baseline: the manual's one upsert per trade", r["naive_baseline"]["events"], r["naive_baseline"]["events"] / naive, naive),
]

tb_cpu = first.get("cpu_per_million") or {}
# The same worker runs between 10 % and 90 % of their events written:
# without the worker's start (absent from runs before session 14).
def steady_of(run):
    c = (run or {}).get("steady_cpu_per_million")
    return {"cpu_per_million": c} if c else None
first_steady, second_steady = steady_of(first), steady_of(second)
db_ratio = ratio(tb_cpu.get("database"), db_cpu)
broker_ratio = ratio(tb_cpu.get("broker"), kafka_cpu)
# A broker spends CPU by the second whoever reads (a KRaft node's quorum,
# metadata log and timers; `servers_at_rest`, cores, from session 26).
# Over the worker's tens of seconds that is as large as the reading
# itself, over a full-speed read's few seconds nothing: so the target
# compares the worker with the same plain consumer read at the worker's
# pace, a phase as long as the worker's (absent before session 26: then
# the full-speed read, as before).
rest = r.get("servers_at_rest") or {}
paced = r.get("plain_consumer_paced")
paced_broker = cpu(paced, "broker") if paced else None
broker_ref = paced_broker if paced_broker is not None else kafka_cpu
broker_target_ratio = ratio(tb_cpu.get("broker"), broker_ref)
# A young broker's JVM keeps compiling its code for minutes, the more
# for a new kind of client (the worker's group and commits): a cost of
# the broker's start, not of the events read (session 31). From session
# 31 the phases count the compiler threads apart, and the target
# compares the rest.
def no_jit(c):
    b, j = (c or {}).get("broker"), (c or {}).get("broker_jit")
    return None if b is None or j is None else b - j
tb_broker_work = no_jit(tb_cpu)
paced_broker_work = no_jit(paced.get("cpu_per_million")) if paced else None
broker_work_ratio = ratio(tb_broker_work, paced_broker_work)
# From session 31 the pair runs again last, on the broker by then warm
# (its code compiled, as a broker's that has run for days): the target's
# figure when present; the young broker's above stays beside it.
warm = r.get("broker_warm") or {}
warm_tb = (warm.get("worker") or {}).get("cpu_per_million") or {}
warm_paced = (warm.get("plain_consumer_paced") or {}).get("cpu_per_million") or {}
warm_ratio = ratio(warm_tb.get("broker"), warm_paced.get("broker"))
# The worker's floor: a plain consumer of the same backlog in its own
# process (its own CPU, "consumer"); absent from runs before issue #29.
plain = r.get("plain_consumer")
plain_cpu = cpu(plain, "consumer") if plain else None
worker_plain_ratio = ratio(tb_cpu.get("worker"), plain_cpu)
# Where a sample of the worker's profile belongs, first match wins:
# (component, test on (dso, kind, symbol)). Rust symbols go by their first
# crate that is not core/alloc/std, so `drop_in_place<tradebucket::..>` is
# the product's and `<Vec<T> as ..>` of std stays std's.
STD_CRATES = {"core", "alloc", "std", "hashbrown", "foldhash"}
C_KAFKA = ("rd_", "thrd_", "cnd_", "mtx_", "tss_", "ZSTD", "LZ4", "crc32c", "snappy", "inflate",
           "deflate", "adler32", "crc32", "sasl_", "SSL_", "EVP_", "BIO_", "CRYPTO_")

def rust_crate(sym):
    # A path's first segment only: after the start, `<`, `&`, `*`, `(`,
    # `,` or a space (so `core::hash::sip` gives `core`, not `sip`).
    crates = re.findall(r"(?:^|[<\s&*(,])([A-Za-z_][A-Za-z0-9_]*)::", sym)
    own = [c for c in crates if c not in STD_CRATES]
    return own[0] if own else ("std" if crates else None)

def in_libc(dso):
    return not dso.startswith(("tradebucket", "[")) and ".so" in dso

COMPONENTS = [
    ("the kernel: system calls, the scheduler, page faults", lambda d, k, sym: k == "k"),
    ("the vDSO clock (`clock_gettime`)", lambda d, k, sym: d == "[vdso]"),
    # mimalloc is the worker's allocator (linked in: `mi_*`, `_mi_*`); glibc's
    # malloc still serves librdkafka and the other C code.
    ("the allocator: mimalloc (Rust's), glibc's malloc and free (C's), and Rust's calls into them",
     lambda d, k, sym: (
        in_libc(d) and any(w in sym for w in ("malloc", "free", "calloc", "realloc", "_int_",
                                              "tcache", "unlink_chunk")))
     or sym.startswith(("mi_", "_mi_")) or rust_crate(sym) == "__rustc"),
    ("glibc's memory copies and compares", lambda d, k, sym: in_libc(d) and sym.startswith(
        ("__mem", "__str", "memcpy", "memmove", "memset", "memcmp", "__wmem"))),
    ("glibc: locks, threads, system-call wrappers", lambda d, k, sym: in_libc(d)),
    ("librdkafka (C) and the rdkafka crate", lambda d, k, sym: sym.startswith(C_KAFKA)
     or rust_crate(sym) in ("rdkafka", "rdkafka_sys")),
    ("the MongoDB driver and bson", lambda d, k, sym: rust_crate(sym) in ("mongodb", "bson")),
    ("tokio", lambda d, k, sym: rust_crate(sym) in ("tokio", "mio")),
    ("serde_json (the decode's parsing)", lambda d, k, sym: rust_crate(sym) == "serde_json"),
    ("tradebucket's own code", lambda d, k, sym: rust_crate(sym) == "tradebucket"),
    ("prometheus (the worker's metrics)", lambda d, k, sym: rust_crate(sym) == "prometheus"),
    ("Rust's std, core, hashbrown (generic, not attributed)", lambda d, k, sym: rust_crate(sym) == "std"),
    ("other (other crates, unresolved addresses)", lambda d, k, sym: True),
]

def worker_profile(path):
    """The share of each component in `perf report`'s per-symbol table of
    the profiled worker (`--profile`, bench step 8), or None without one."""
    if not os.path.exists(path):
        return None
    shares = {name: 0.0 for name, _ in COMPONENTS}
    pattern = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)$")
    for line in open(path):
        hit = pattern.match(line)
        if hit:
            dso, kind, sym = hit[2], hit[3], hit[4].strip()
            name = next(n for n, test in COMPONENTS if test(dso, kind, sym))
            shares[name] += float(hit[1])
    total = sum(shares.values()) or 1.0
    return {name: share / total for name, share in shares.items()}

def worker_profile_lines(path, worker_us):
    profile = worker_profile(path)
    if not profile or not worker_us:
        return []
    out = ["", "The worker by library: a worker run again last over the first set's topic (fresh group",
           "and database) with `perf record -e cpu-clock` at 999 Hz over its whole life (`--profile`;",
           "the first set's worker, which the targets judge, runs without it); each symbol's own",
           "samples, sorted by the library it is in, as a share of its samples and of its",
           f"{us(worker_us)} µs per event:", "",
           "| where | share of samples | µs per event |", "|---|---:|---:|"]
    for name, share in profile.items():
        if share >= 0.0005:
            out.append(f"| {name} | {share:.1%} | {share * worker_us:.2f} |")
    return out

def target(name, measured, ok):
    return (name, measured, ok if ok is None or ok == SERVER_FLOOR else bool(ok))
def floor_verdict(ok, server_share, needed):
    if ok is None or ok:
        return ok
    return SERVER_FLOOR if server_share is not None and server_share < needed else False
def medians_text(values, what, unit, parenthesised=False):
    """A measurement repeated against the host's noise (from session 40):
    every value beside the median the target takes."""
    values = values or []
    if len(values) < 2:
        return ""
    listed = f"{', '.join(f'{v:.2f}' for v in values)} {unit}"
    return (f" (the median of {len(values)} {what}: {listed})" if parenthesised
            else f", the median of {len(values)} {what}: {listed}")
def broker_target():
    """The broker target, from the best pair the run has: the pair run
    again last on the warmed broker (from session 31); else the first
    pair without the broker's compiler threads (one run of session 31);
    else the first pair, or the full-speed read before session 26."""
    name = "broker CPU per event ≤ 1.25 × the plain consumer's"
    if warm_ratio is not None:
        return target(
            name + ", read at the worker's pace, on a broker that has compiled its code (both run again last)",
            f"{us(warm_tb.get('broker'))} vs {us(warm_paced.get('broker'))} µs = {warm_ratio:.2f} ×"
            f"{medians_text(warm.get('ratios'), 'alternating pairs', '×')}"
            f" (compiler threads {us(warm_tb.get('broker_jit'))} and {us(warm_paced.get('broker_jit'))} µs;"
            f" {warm['worker']['events_per_second']:,.0f} events/s); on the broker started for the run,"
            f" without its compiler threads: {us(tb_broker_work)} vs {us(paced_broker_work)} µs ="
            f" {'–' if broker_work_ratio is None else f'{broker_work_ratio:.2f}'} ×",
            warm_ratio <= 1.25)
    if paced_broker is not None:
        name += ", read at the worker's pace"
    if broker_work_ratio is not None:
        return target(
            name + ", without the JVM's JIT compiler threads",
            f"{us(tb_broker_work)} vs {us(paced_broker_work)} µs = {broker_work_ratio:.2f} ×; with the"
            f" compiler threads ({us(tb_cpu.get('broker_jit'))} and {us(paced['cpu_per_million'].get('broker_jit'))} µs)"
            f" {us(tb_cpu.get('broker'))} vs {us(broker_ref)} µs = {broker_target_ratio:.2f} ×",
            broker_work_ratio <= 1.25)
    if broker_target_ratio is None:
        return target(name, "–", None)
    return target(
        name,
        f"{us(tb_cpu.get('broker'))} vs {us(broker_ref)} µs = {broker_target_ratio:.2f} ×"
        + ("" if paced_broker is None else
           f" (the plain consumer at full speed: {us(kafka_cpu)} µs, {broker_ratio:.2f} ×)"),
        broker_target_ratio <= 1.25)
targets = [
    target("worker CPU ≤ 3 µs per event", f"{us(tb_cpu.get('worker'))} µs",
           tb_cpu.get("worker") is not None and tb_cpu["worker"] <= 3),
    target("database-server CPU per trade ≤ 1.25 × the final-bucket insert's",
           "–" if db_ratio is None else f"{us(tb_cpu.get('database'))} vs {us(db_cpu)} µs = {db_ratio:.2f} ×",
           None if db_ratio is None else db_ratio <= 1.25),
    broker_target(),
    target("throughput ≥ 0.8 × the co-located bound" + ("" if bound is None else f" = {rate(0.8 * bound)}/s"),
           "–" if bound is None else f"{rate(tb)}/s = {tb / bound:.2f} ×"
           + ("" if not tb_steady else
              f" (from 10 % to 90 % of its events written: {rate(tb_steady)}/s = {tb_steady / bound:.2f} ×)")
           + ("" if bound is None else f"; the database ceiling, inserting the final buckets and nothing else:"
              f" {rate(db)}/s = {db / bound:.2f} ×, and tradebucket {tb / db:.2f} × of it"),
           None if bound is None else floor_verdict(tb >= 0.8 * bound, db / bound, 0.8)),
    target(f"throughput ≥ 20 × the manual's per-event upsert = {rate(20 * naive)}/s",
           f"{tb / naive:.1f} ×; the database ceiling: {db / naive:.1f} ×",
           floor_verdict(tb >= 20 * naive, db / naive, 20)),
    target("worker CPU per event ≤ 2.5 × a plain consumer's (issue #29)",
           "–" if worker_plain_ratio is None else f"{us(tb_cpu.get('worker'))} vs {us(plain_cpu)} µs = {worker_plain_ratio:.2f} ×",
           None if worker_plain_ratio is None else worker_plain_ratio <= 2.5),
    target("worker CPU ≤ 5 µs per event (issue #29)", f"{us(tb_cpu.get('worker'))} µs"
           + ("" if not first_steady else
              f" (without its start: {us(first_steady['cpu_per_million'].get('worker'))} µs)"),
           None if tb_cpu.get("worker") is None else tb_cpu["worker"] <= 5),
]
if steady:
    sp = steady.get("sampled") or {}
    p99 = sp.get("p99_seconds")
    targets.append(target(
        f"p99 delay ≤ 100 ms at a steady {rate(steady['rate_events_per_second'])} events/s (acknowledged → readable;"
        " default settings)",
        "–" if p99 is None else f"p50 {sp['p50_seconds'] * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms ({sp['trades']} sampled trades)",
        None if p99 is None else p99 <= 0.1))
paced_appends = r.get("append_paced")
paced_beside = r.get("append_paced_beside")
# The database-alone checks at 0.8 × the append ceiling (appends.rs,
# `paced_appends`) that ran, by name, and those whose own p99 is above a
# second: with the machine to itself, or beside a steady phase's Kafka load
# (the producer, the broker and a plain consumer; no worker), which the
# phases share the machine with.
paced_checks = [(name, c) for name, c in (("with the machine to itself", paced_appends),
                                          ("beside the phase's Kafka load", paced_beside)) if c]
paced_missed = [name for name, c in paced_checks if c["p99_seconds"] > 1.0]
def steady_verdict(ok):
    """Set by the server when a database-alone check misses p99 ≤ 1 s."""
    if ok or not paced_checks:
        return ok
    return SERVER_FLOOR if paced_missed else False
if curve and appends:
    capacity = held["rate_events_per_second"] if held else 0
    above = "" if missed is None else f", p99 {missed['p99_seconds']:.2f} s at {rate(missed['rate_events_per_second'])}/s"
    targets.append(target(
        f"steady capacity (p99 ≤ 1 s) ≥ 0.8 × the append ceiling ({rate(appends)}/s) = {rate(0.8 * appends)}/s",
        (f"held at {rate(capacity)}/s = {capacity / appends:.2f} × (p99 {held['p99_seconds']:.2f} s{medians_text(held.get('p99_repeats'), 'phases', 's')}){above}{medians_text((missed or {}).get('p99_repeats'), 'phases', 's', True)}"
         if held else "not held at the curve's lowest rate")
        + ("" if not paced_appends else
           f"; the database alone, its appends paced at {rate(paced_appends['rate'])}/s by one client:"
           f" p99 {paced_appends['p99_seconds']:.2f} s")
        + ("" if not paced_beside else
           f"; the same beside the phase's Kafka load (producer, broker, a plain consumer; no worker):"
           f" p99 {paced_beside['p99_seconds']:.2f} s"),
        steady_verdict(capacity >= 0.8 * appends * 0.999)))
def overload_holds(x):
    """Above the capacity a trade waits at most `batch.hold_max_age` held,
    then the write of the batch that takes it (the phase's own `writing`
    stage p99) and a second for the fetch, the linger and the commit; and
    the delay stops growing: the last third's worst sample (in the order
    sent) is no more than one write (that p99) and a second above the
    middle third's. At the plateau each third's worst is a trade held
    about `hold_max_age` plus the write that took it, so two thirds differ
    by the spread of those writes; a queue that still grows adds its
    whole growth over a third (at 3 × the capacity, about twice the
    third's length). The first third is left out: it starts from an
    empty backlog and climbs to the bound (delay.rs, `phase_figures`)."""
    write = ((x.get("stages") or {}).get("writing") or {}).get("p99_seconds") or 0.0
    thirds = x.get("sampled_thirds") or {}
    bounded = x["sampled"]["max_seconds"] <= hold_max_age + write + 1.0
    flat = (thirds.get("last_third_max_seconds", 0)
            <= thirds.get("middle_third_max_seconds", 0) + write + 1.0)
    stored = x.get("stored_trades") == x.get("expected_trades")
    return bounded and flat and stored, write, thirds
if overloaded:
    verdicts = [overload_holds(x) for x in overloaded]
    targets.append(target(
        f"above the steady capacity the delay stops at `batch.hold_max_age` ({hold_max_age:g} s) + the write of the"
        " batch that takes it + 1 s, and grows no further (the last third's worst within that write + 1 s of the"
        " middle third's); nothing lost",
        "; ".join(f"{rate(x['rate_events_per_second'])}/s: sampled max {x['sampled']['max_seconds']:.1f} s against"
                  f" {hold_max_age + w + 1:.1f} s (write p99 {w:.1f} s), worst of each third"
                  f" {h.get('first_third_max_seconds', 0):.1f}, {h.get('middle_third_max_seconds', 0):.1f}"
                  f" and {h.get('last_third_max_seconds', 0):.1f} s, {x.get('stored_trades', 0):,} of"
                  f" {x.get('expected_trades', 0):,} trades stored once"
                  for x, (_, w, h) in zip(overloaded, verdicts)),
        all(ok for ok, _, _ in verdicts)))
peak = max(first["peak_rss_mib"], second["peak_rss_mib"] if second else 0)
targets.append(target("peak RSS ≤ 150 MiB over the 1,000,000-event backlog",
                      f"{peak:.1f} MiB (backlog {r['events']:,})",
                      None if r["events"] < 1_000_000 else peak <= 150))
def reconcile_measured(rec):
    """The run's time beside the worker's, with its own CPU and the
    database server's over it (wall time is noisy on shared cores)."""
    cpu_of = [f"{name} {rec[k]:.1f} CPU-s" for name, k in
              (("reconcile", "cpu_seconds"), ("database", "database_cpu_seconds"))
              if rec.get(k) is not None]
    return (f"{rec['records']:,} records in {rec['seconds']:.1f} s vs the worker's {rec['worker_seconds']:.1f} s"
            + (f" ({', '.join(cpu_of)})" if cpu_of else ""))

for name, rec in (("keyed", r.get("reconcile")), ("unkeyed", r.get("reconcile_unkeyed"))):
    if not rec:
        continue
    targets.append(target(f"reconcile no slower than the worker took to store the same records, {name}",
                          reconcile_measured(rec), rec["seconds"] <= rec["worker_seconds"]))
    targets.append(target(f"reconcile peak RSS ≤ 150 MiB, {name}", f"{rec['peak_rss_mib']:.1f} MiB",
                          None if rec["records"] < 1_000_000 else rec["peak_rss_mib"] <= 150))
if second:
    second_ratio = second["events_per_second"] / tb
    # The second set's database ceiling is the least a restarted worker
    # must ask of the server there: if the server doing only that falls
    # short of 0.9 × the first set's rate, no worker meets the target.
    floor2 = db2.get("trades_per_second") if db2 else None
    # One-sided: the target guards against a collection that already
    # holds the first million slowing the second. A second set faster than
    # the first (the servers' quicker moment: its own database ceiling
    # then outruns the first set's rate too) is no such slowing.
    second_held = floor_verdict(second_ratio >= 0.90, floor2 / tb if floor2 else None, 0.9)
    targets.append(target(
        "second million within 10 % of the first (no more than 10 % slower)", f"{second_ratio:.2f} × the first"
        + (f"; the second set's database ceiling (the least a restart must do, nothing else):"
           f" {rate(floor2)}/s = {floor2 / tb:.2f} × the first's rate" if floor2 else ""),
        second_held))
    if bound and bound2:
        share, share2 = tb / bound, second["events_per_second"] / bound2
        targets.append(target(
            "second million within 10 % of the first, each as a share of its own co-located bound"
            " (the second's counts the least work a restart needs: the database's floor)",
            f"{share2:.2f} × its bound ({rate(bound2)}/s) against the first's {share:.2f} × = {share2 / share:.2f} ×",
            share2 >= 0.9 * share))

# The chart: trades stored over time for both sets (writes land a batch
# at a time, so the cumulative count shows the shape where a per-sample
# rate would only show the batches), against the ceilings' and the
# baseline's rates drawn as straight lines from the start.
series = {}
for row in csv.DictReader(open(timeline_path)):
    series.setdefault(row["phase"], []).append((float(row["seconds"]), int(row["written"]), float(row["rss_mib"])))
fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
t_max = 0.0
for phase, pts in series.items():
    base = pts[0][1]
    xs = [t for t, _, _ in pts]
    t_max = max(t_max, xs[-1])
    label = "tradebucket, first set" if phase == "first" else "tradebucket, second set (on top of the first)"
    ax.plot(xs, [(w - base) / 1e6 for _, w, _ in pts], label=label, linewidth=1.5)
    ax2.plot(xs, [m for _, _, m in pts], label=label, linewidth=1)
for value, label, style in [(db, "database ceiling", "--"), (kafka, "Kafka read ceiling", ":"),
                            (naive, "naive baseline", "-.")]:
    end = min(t_max, r["events"] / value)
    ax.plot([0, end], [0, value * end / 1e6], linestyle=style, color="grey", linewidth=1,
            label=f"{label}, {rate(value)}/s")
ax.set_ylabel("trades stored (millions)")
ax.set_title(f"tradebucket, {r['events']:,} trades, {r['customers']:,} customers, {r['partitions']} partitions, {m['cores']} cores")
ax.legend(loc="upper left", fontsize=8)
ax.set_ylim(0, r["events"] / 1e6 * 1.05)
ax2.set_ylabel("worker RSS (MiB)")
ax2.set_xlabel("seconds since the worker started")
ax2.axhline(150, linestyle="--", color="grey", linewidth=1)
ax2.text(0, 150, " 150 MiB target", va="bottom", fontsize=8, color="dimgrey")
ax2.set_ylim(0, 180)
fig.tight_layout()
fig.savefig(png_path, dpi=100)

cmd = "scripts/bench" + (f" {flags}" if flags else "")
lines = [
    "# Benchmarks",
    "",
    f"Generated by `{cmd}` (run `{r['run_id']}`); every figure below is from that one",
    "run, on one pre-loaded event set, against the same local servers. Rerun",
    "the same command to reproduce; `target/bench/results.json` has the raw",
    "figures and `target/bench/timeline.csv` the worker's progress.",
    "",
    "## Machine and versions",
    "",
    "| | |",
    "|---|---|",
    f"| CPU | {m['cpu']} ({m['cores']} cores) |",
    f"| tradebucket | {m['tradebucket']}, release build, default settings |",
    f"| librdkafka | {m['librdkafka']} |",
    f"| Kafka-protocol server | {m['kafka_server']} |",
    f"| MongoDB-protocol server | {m['mongodb_server']} |",
    f"| event set | {r['events']:,} trades, {r['customers']:,} customers (uniform), {r['partitions']} partitions, keyed by customer |",
    "",
    "Both servers and the worker share the same cores, as they would not in",
    "production: the figures compare the approaches with each other on one",
    "machine, they are not what a cluster would do.",
    "",
    "## Throughput",
    "",
    "| what | events | seconds | events/s |",
    "|---|---:|---:|---:|",
]
for name, n, s, v in rows:
    lines.append(f"| {name} | {n:,} | {s:.1f} | {rate(v)} |")
lines += [
    "",
    "- **tradebucket**: the release binary from a fresh consumer group and",
    "  database, timed from its start until the group's committed offsets",
    "  reach the end of every partition (offsets are committed only after",
    "  the writes are durable, so that is when every trade is stored); the",
    "  stored trade count is then checked. The second set is another",
    "  equally large set produced into the same topic after the first, read",
    "  by the same group into the same collection. The rows \"from 10 % to",
    "  90 % of its events written\" time the same run between the bench's",
    "  samples nearest those points: its rate once started (connecting,",
    "  joining the group, the first batch and the first head loads) and",
    "  before its backlog ends; the co-located bound (below) is a rate",
    "  computed from CPU per event, which has no start either.",
    "- **database ceiling**: the same trades planned offline into their final",
    "  bucket documents by the product's planner and inserted with unordered",
    f"  `insert_many` of 1,000 documents, {r['database_ceiling']['concurrency']} in flight,",
    f"  at the worker's write concern ({r['database_ceiling']['documents']:,} documents).",
    "- **Kafka read ceiling**: one consumer with librdkafka's default fetch settings",
    "  reading every partition from the beginning, doing nothing with the messages.",
    "- **naive baseline**: the manual's `updateOne({customerId, count: {$lt: cap}},",
    "  {$push, $inc, $setOnInsert}, {upsert: true})`, one round trip per trade,",
    "  with an index on `{customerId, count}`, on the first",
    f"  {r['naive_baseline']['events']:,} trades of the set.",
    "",
    "![trades stored and worker memory over time](benchmarks.png)",
]
cpu_rows = [("tradebucket, first set", first),
            ("tradebucket, first set, from 10 % to 90 % of its events written (without its start)",
             first_steady),
            ("tradebucket, second set", second),
            ("tradebucket, second set, from 10 % to 90 % of its events written", second_steady),
            ("database ceiling (inserts only)", r["database_ceiling"]),
            ("database ceiling, second set: the least a restarted worker must do in the collection"
             " holding the first set's final buckets (each customer's newest bucket read, the open ones"
             " completed, the rest inserted), per trade of the set", db2),
            ("Kafka ceiling: a plain consumer", r["kafka_read_ceiling"]),
            ("a plain consumer in its own process (worker column: its own CPU)", plain),
            ("the same plain consumer at the worker's pace (its first set's events/s)", r.get("plain_consumer_paced")),
            ("naive baseline", r["naive_baseline"])]
lines += [
    "",
    "## Where the CPU goes",
    "",
    "CPU-seconds per million events (= µs per event), user + system, read from",
    "`/proc/PID/stat` of each process before and after each phase: the worker (a",
    "fresh process per set, so its whole life; and, on the rows that say so, only",
    "between two of the bench's samples of it, at 10 % and 90 % of its events written),",
    "the Kafka-protocol broker and the",
    "MongoDB-protocol server (whatever else they did meanwhile counts too), and",
    "the plain consumer's own process, which reads its own just before it exits.",
    "",
    "| phase | worker | broker | database server | total |",
    "|---|---:|---:|---:|---:|",
]
for name, entry in cpu_rows:
    if not entry:
        continue
    c = entry.get("cpu_per_million") or {}
    own = c.get("worker") if c.get("worker") is not None else c.get("consumer")
    parts = [own, c.get("broker"), c.get("database")]
    total = sum(x for x in parts if x is not None)
    lines.append(f"| {name} | {' | '.join(us(x) for x in parts)} | {total:.2f} |")
lines += [
    "",
    "- database server per trade, tradebucket ÷ the final-bucket insert: "
    + ("–" if db_ratio is None else f"{db_ratio:.2f} ×"),
    "- database server per trade, second set ÷ first set: tradebucket "
    + ("–" if not second else f"{ratio(cpu(second, 'database'), tb_cpu.get('database')):.2f} ×")
    + ", the database ceiling (the second's with the least restart work) "
    + ("–" if not db2 else f"{ratio(db2_cpu, db_cpu):.2f} ×"),
    "- broker per event, tradebucket ÷ a plain consumer of the same backlog: "
    + ("–" if broker_ratio is None else f"{broker_ratio:.2f} ×"),
    "- the servers at rest, no client connected"
    + (": –" if rest.get("broker_cores") is None or rest.get("database_cores") is None else
       f" ({rest['seconds']:.0f} s before the first worker run): the broker {rest['broker_cores']:.3f} cores,"
       f" the database {rest['database_cores']:.3f} cores; the broker's at that rate over the worker's first set"
       f" ({first['seconds']:.1f} s): {rest['broker_cores'] * first['seconds'] * 1e6 / first['events']:.2f} µs per event,"
       f" over the full-speed read ({r['kafka_read_ceiling']['seconds']:.1f} s):"
       f" {rest['broker_cores'] * r['kafka_read_ceiling']['seconds'] * 1e6 / r['events']:.2f}"),
    "- broker per event, tradebucket ÷ the plain consumer at the worker's pace: "
    + ("–" if paced_broker is None else
       f"{broker_target_ratio:.2f} × ({paced['seconds']:.1f} s against the worker's {first['seconds']:.1f} s)"),
    "- of the broker column, its JVM's JIT compiler threads (a young broker compiling its code),"
    " µs per event: " + ("– (not counted apart before session 31)" if tb_cpu.get("broker_jit") is None else
       f"the worker's first set {us(tb_cpu.get('broker_jit'))}, the plain consumer at its pace"
       f" {us((paced or {}).get('cpu_per_million', {}).get('broker_jit'))}, the full-speed read"
       f" {us(r['kafka_read_ceiling']['cpu_per_million'].get('broker_jit'))}"),
    "- plain consumer µs/event (the consumer process's own CPU, librdkafka's defaults, reading"
    " the same backlog and only looking at each payload): " + us(plain_cpu)
    + ("" if worker_plain_ratio is None else f"; the worker's ratio to it: {worker_plain_ratio:.2f} ×"),
    "- the database ceiling's own client (the MongoDB driver sending the final buckets, already encoded,"
    " in the bench's process) µs/trade: " + us(r["database_ceiling"].get("client_cpu_per_million"))
    + " (with the plain consumer's, the CPU a worker cannot avoid: reading the records and sending the trades)",
    "- co-located bound: " + ("–" if bound is None else
      f"{cores} cores ÷ ({us(kafka_cpu)} µs broker + {us(db_cpu)} µs database) = {rate(bound)} events/s;"
      f" tradebucket reached {tb / bound:.2f} × of it"
      + ("" if not tb_steady else f" ({tb_steady / bound:.2f} × from 10 % to 90 % of its events written)")),
    f"- the database ceiling's own rate, the server doing nothing but inserting the final buckets: {rate(db)} events/s;"
    f" tradebucket reached {tb / db:.2f} × of it"
    + ("" if not tb_steady else f" ({tb_steady / db:.2f} × from 10 % to 90 % of its events written)"),
    "- the second set's co-located bound: " + ("–" if bound2 is None else
      f"{cores} cores ÷ ({us(kafka_cpu)} µs broker + {us(db2_cpu)} µs database, the least restart work) ="
      f" {rate(bound2)} events/s; tradebucket's second set reached {second['events_per_second'] / bound2:.2f} × of it"),
    "- the second set's database ceiling, its restart work: " + ("–" if not (db2 or {}).get("restart") else
      f"{db2['restart']['heads']:,} newest buckets read in {db2['restart']['head_seconds']:.1f} s,"
      f" {db2['restart']['fills']:,} open buckets completed ({db2['restart']['filled_trades']:,} trades)"
      f" in {db2['restart']['fill_seconds']:.1f} s, then {db2['documents']:,} buckets inserted;"
      f" {db2['seconds']:.1f} s in all against the first set's ceiling's {r['database_ceiling']['seconds']:.1f} s"),
    "- the ceiling collection has the product's indexes (checked against the worker's): "
    + ", ".join(f"`{k}`" for k in r["database_ceiling"].get("indexes", [])),
]
WORK = [("load", "`load`: newest buckets read (16 at a time)", "buckets read"),
        ("find_keys", "`find_keys`: where trade ids are stored", None),
        ("fill", "`fill`: appends to open buckets (update commands)", "appends"),
        ("insert", "`insert`: new buckets", "buckets")]
worked = [(name, run) for name, run in (("first set", first), ("second set", second))
          if run and run.get("write_work")]
if worked:
    lines += [
        "",
        "The worker's database work by command type, from its own metrics at the end of",
        "each set (`tradebucket_mongodb_request_duration_seconds{operation}` with the",
        "counters of what the requests carried): the requests' summed duration is about",
        "the server's time on them, as the local server applies them one at a time,",
        "so it splits the database column above.",
        "",
        "| set | command | requests | carrying | seconds | µs per event | ms per request, or µs per item carried |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in worked:
        for key, label, unit in WORK:
            w = run["write_work"].get(key) or {}
            n, secs, items = w.get("requests") or 0, w.get("seconds") or 0.0, w.get("items")
            carrying = "–" if items is None else f"{items:,} {unit}"
            if items:
                each = f"{secs / items * 1e6:.0f} µs"
            elif n:
                each = f"{secs / n * 1000:.1f} ms"
            else:
                each = "–"
            lines.append(f"| {name} | {label} | {n:,.0f} | {carrying} | {secs:.2f} | "
                         f"{secs / run['events'] * 1e6:.2f} | {each} |")
lines += worker_profile_lines(os.path.join(os.path.dirname(results_path), "perf.worker.txt"),
                              ((r.get("tradebucket_profiled") or {}).get("cpu_per_million") or {}).get("worker"))
def load_of(x):
    f = x.get("fraction_of_append_ceiling")
    return "steady target load" if f is None else f"{f:g} × the append ceiling"

def paced_lines(pa):
    """The database-alone checks (`paced_checks`, `pa` the first) and what
    they say about the knee."""
    def cores(x, k): return "–" if x.get(k) is None else f"{x[k]:.2f}"
    lines = [
        "",
        f"The database alone at 0.8 × its ceiling: the same appends ({pa['appends']:,}, to buckets of their own,"
        " each customer's a tenth of the run apart so that buckets of every size take appends at once, as"
        f" under a steady load), due at a steady {rate(pa['rate'])}/s and sent by one client as the worker"
        " sends them (whenever the previous command has answered, everything due goes in the next, one"
        " statement per customer), with no decoding and no planning. Each append from its due time"
        f" to its command's answer, over the {pa.get('measured', pa['appends']):,} due while every size was"
        " appended to (the ramps at both ends left out)"
        + ("; run twice: with the machine to itself, and beside the Kafka side of a steady phase at the"
           " same rate (the load's producer in the bench's process, the broker, and a plain consumer"
           " process reading the records as they arrive; no worker, no delay sampler), which the steady"
           " phases share the machine with:" if paced_beside else ":"),
        "",
        "| the database alone, paced | p50 | p99 | max | database cores | broker cores | bench cores | machine cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in paced_checks:
        lines.append(f"| {name} | {secs(c['p50_seconds'])} | {secs(c['p99_seconds'])} | {secs(c['max_seconds'])}"
                     f" | {cores(c, 'database_cores')} | {cores(c, 'broker_cores')} | {cores(c, 'bench_cores')}"
                     f" | {cores(c, 'machine_cores')} |")
    lines += ["", (
        f"Above a second {paced_missed[0]}: a client sending the server these appends as the worker does holds"
        " no p99 ≤ 1 s at 0.8 × its append ceiling on this machine, so the server sets that knee."
        if paced_missed else
        "Within a second in every check: the server holds 0.8 × its append ceiling as the worker sends"
        " to it, so a worker that misses it there misses by its own delay, not the server's.")]
    return lines

def secs(x): return "–" if x is None else (f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s")
lines += [
    "",
    "## Delay under a steady load",
    "",
    f"The generator produced at a steady rate for {args_latency} s into a fresh topic",
    f"({r['customers']:,} customers, uniform), the worker at its default settings.",
    "Each phase starts as a long steady load leaves the collection and the worker:",
    "before the load, the same worker stores (untimed, not counted below) a few trades",
    "for every customer, customer c getting c mod the bucket capacity + 1 of them, so",
    "open buckets of every size, as many of each, and every customer's newest bucket",
    "in the worker's cache. Started on an empty collection instead, every bucket opens",
    "within the first seconds, they all fill in step, and the middle of the phase",
    "appends only to nearly full buckets, this server's dearest appends (\"Session 31\"",
    "below). Two",
    "measures: the worker's own histogram `tradebucket_end_to_end_delay_seconds` (from",
    "each message's Kafka timestamp to the commit of its offset, every event, read with",
    "`histogram_quantile`'s interpolation), and one extra trade every 200 ms timed from",
    "the producer's acknowledgement (`acks=all`) to its key being readable in MongoDB",
    "(an indexed lookup every 5 ms, or every fiftieth of the delay so far once that is",
    "longer; read concern majority). After each phase the audit found every trade",
    "stored once. The generator and the broker's intake run on the same two cores as",
    "the worker and both servers.",
    "",
    "| load | events/s | observations | p50 | p90 | p99 | sampled trades | sampled p50 | sampled p99 | sampled max |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]
for x in delays:
    sp = x.get("sampled") or {}
    lines.append(f"| {load_of(x)} | {rate(x['rate_events_per_second'])} | {x['observed']:,.0f} | "
                 f"{secs(x['p50_seconds'])} | {secs(x['p90_seconds'])} | {secs(x['p99_seconds'])} | "
                 f"{sp.get('trades', 0)} | {secs(sp.get('p50_seconds'))} | {secs(sp.get('p99_seconds'))} | "
                 f"{secs(sp.get('max_seconds'))} |")
ac = r.get("append_ceiling")
if ac:
    lines += [
        "",
        f"The append ceiling ({rate(ac['appends_per_second'])} appends/s): the database's own capacity for",
        "the product's one-trade appends to open buckets, which every trade of a steady load",
        f"over {ac['customers']:,} customers is. Each level on customers of its own, each",
        "customer's bucket opened with one trade (not timed), then the product's own fill",
        "statements, one trade each, until the bucket is full"
        + (f" ({ac['appends_per_bucket']} appends: every size a steady load appends to)"
           if ac.get("appends_per_bucket") else "") + ", in `update` commands of",
        f"{ac['per_command']} statements (one batch's worth at 2,000 events/s), a customer's appends",
        "in order in one stream, at the worker's write concern; the best level counts:",
        "",
        "| concurrent streams | customers | appends | seconds | appends/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for lv in ac["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv.get('customers', ac['customers']):,} | "
                     f"{lv['appends']:,.0f} | {lv['seconds']:.1f} | "
                     f"{rate(lv['appends_per_second'])} |")
    if paced_appends:
        lines += paced_lines(paced_appends)
    loads = [(x, x["servers"]) for x in delays if x.get("servers")]
    if loads and any(lv.get("database_us_per_append") is not None for lv in ac["levels"]):
        best = max(ac["levels"], key=lambda lv: lv["appends_per_second"])
        lines += [
            "",
            "What each phase asked of the servers: the cores each used while the load was sent,",
            "and CPU per trade over the whole phase (drain included), beside the append ceiling's",
            f"best level: the database {best['database_us_per_append']:.0f} µs per append on"
            f" {best['database_cores']:.2f} cores, so at most"
            f" {rate(best['database_cores'] / best['database_us_per_append'] * 1e6)} trades/s"
            " of appends alone on those cores.",
            "",
            "The worker's, the bench's own (the load's producer and the delay sampler) and the whole",
            "machine's cores under the load (of its "
            f"{next((sv.get('machine_cores') for _, sv in loads if sv.get('machine_cores')), '?')}) follow:"
            " the append ceiling had the machine to itself.",
            "",
            "| load | events/s | database cores | database µs per trade | broker cores | broker µs per trade"
            " | worker cores | bench cores | machine cores | p99 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        num = lambda v, f: "–" if v is None else format(v, f)
        for x, sv in loads:
            lines.append(f"| {load_of(x)} | {rate(x['rate_events_per_second'])} | "
                         f"{num(sv['database_cores_under_load'], '.2f')} | {num(sv['database_us_per_trade'], '.0f')} | "
                         f"{num(sv['broker_cores_under_load'], '.2f')} | {num(sv['broker_us_per_trade'], '.0f')} | "
                         f"{num(sv.get('worker_cores_under_load'), '.2f')} | {num(sv.get('bench_cores_under_load'), '.2f')} | "
                         f"{num(sv.get('machine_cores_under_load'), '.2f')} | "
                         f"{secs(x['p99_seconds'])} |")
    if held:
        lines += ["", f"Steady capacity (the highest rate of the curve held with p99 ≤ 1 s):"
                  f" {rate(held['rate_events_per_second'])}/s ="
                  f" {held['rate_events_per_second'] / ac['appends_per_second']:.2f} × the append ceiling"
                  + ("" if missed is None else f"; the next rate, {rate(missed['rate_events_per_second'])}/s,"
                     f" had p99 {secs(missed['p99_seconds'])}") + "."]
STAGES = [
    ("in_kafka", "in Kafka: message timestamp → received by the worker (per event)"),
    ("batching", "batching: first record received → batch closed (per batch)"),
    ("decode", "decoding the closed batch (per batch)"),
    ("queued", "queued: closed → taken by the write stage (per batch)"),
    ("writing", "writing: the write stage, all requests and retries (per batch)"),
    ("mongodb_load", "of which MongoDB `load` requests (newest buckets)"),
    ("mongodb_find_keys", "of which MongoDB `find_keys` requests"),
    ("mongodb_fill", "of which MongoDB `fill` requests (update command)"),
    ("mongodb_insert", "of which MongoDB `insert` requests (new buckets)"),
    ("commit", "commit: oldest unanswered offset commit → the coordinator's answer"),
]
def ms(x): return "–" if x is None else f"{x * 1000:.1f} ms"
staged = [x for x in delays if x.get("stages")]
if staged:
    lines += [
        "",
        "Where the delay goes in each phase: the worker's",
        "`tradebucket_stage_delay_seconds{stage}` and `tradebucket_mongodb_request_duration_seconds{operation}`",
        "(p50 / p99 interpolated within histogram buckets, so read them to a bucket's precision),",
        "one column per phase by its rate:",
        "",
        "| stage | " + " | ".join(f"{rate(x['rate_events_per_second'])}/s" for x in staged) + " |",
        "|---|" + "---:|" * len(staged),
    ]
    for key, name in STAGES:
        cells = []
        for x in staged:
            v = x["stages"].get(key) or {}
            cells.append(f"{ms(v.get('p50_seconds'))} / {ms(v.get('p99_seconds'))}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
lines += [
    "",
    "## Targets (issues #18, #29 and #45)",
    "",
    "| target | measured | |",
    "|---|---|---|",
]
for name, measured, ok in targets:
    lines.append(f"| {name} | {measured} | {verdict(ok)} |")
lines += [
    "",
    f"Peak RSS is the worker's `VmHWM`: first set {first['peak_rss_mib']:.1f} MiB"
    + (f", second set {second['peak_rss_mib']:.1f} MiB" if second else "") + ".",
    "",
]
# Hand-written analysis below the marker survives a regeneration.
MARKER = "<!-- Everything below this line is kept by scripts/bench. -->"
try:
    kept = open(md_path).read().split(MARKER, 1)[1]
except (OSError, IndexError):
    kept = "\n"
open(md_path, "w").write("\n".join(lines) + "\n" + MARKER + kept)
print(f"bench: wrote {md_path} and {png_path}")
