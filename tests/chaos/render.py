#!/usr/bin/env python3
"""Prints the per-scenario tables of docs/reliability.md from the JSON
reports a chaos run wrote (default: target/chaos/*.json), so the figures in
the document are copied by a program, not by hand.

    python3 tests/chaos/render.py [REPORT_DIR]
"""
import json
import pathlib
import sys

directory = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/chaos")
for path in sorted(p for p in directory.glob("s*.json") if not p.stem.startswith("storm")):
    r = json.loads(path.read_text())
    print(f"### {r['scenario']}: {r['title']}\n")
    print(f"Size: {r['size']}; {r['seconds_total']} s in all, "
          f"committed to the end after {r['seconds_until_committed_to_end']} s.\n")
    print("| | expected | actual |")
    print("|---|---:|---:|")
    rows = [
        ("events produced", r["events_produced"], r["events_produced"]),
        ("distinct trades stored", r["trades_expected"], r["trades_stored"]),
        ("trades lost", 0, r["lost"]),
        ("trades duplicated", 0, r["duplicated"]),
        ("unexpected trades stored", 0, r["unexpected"]),
        ("partition-order violations", 0, r["order_violations"]),
        ("dead-lettered (records)", r["dead_letters_expected"], r["dead_letters_actual"]),
        ("dead letters with wrong headers/key/payload", 0, r["dead_letters_wrong"]),
    ]
    shortened = r.get("dead_letters_shortened_expected_actual", [0, 0])
    if shortened != [0, 0]:
        rows.append(("dead letters shortened (over 1 MB)", shortened[0], shortened[1]))
    rows += [
        ("`tradebucket audit` violations", 0, r["audit"].get("violations")),
        ("`audit` trades", r["trades_expected"], r["audit"].get("trades")),
        ("committed offsets at the end of the topic", "yes",
         "yes" if r["committed_to_end"] else "no"),
        ("SIGTERM exit codes", "all 0", ", ".join(str(c) for c in r["sigterm_exit_codes"])),
    ]
    for name, want, got in rows:
        print(f"| {name} | {want} | {got} |")
    print()
    print(f"Setup: {r['partitions']} partitions, {r['customers']} customers, "
          f"bucket capacity {r['capacity']}, "
          f"{r['upstream_duplicates_produced']} upstream duplicates, "
          f"{r['bad_events_produced']} bad events.\n")
    faults = r["faults"]
    print(f"Faults injected ({r['faults_injected']}):\n")
    shown = faults if len(faults) <= 8 else faults[:4] + ["..."] + faults[-3:]
    for f in shown:
        print(f"- {f}")
    print()
    if r.get("poison_kinds"):
        kinds = r["dead_letter_kinds_expected_actual"]
        print("Poison produced: " + ", ".join(f"{k} {v}" for k, v in r["poison_kinds"].items()) + ".\n")
        print("Dead letters per kind (expected / actual): "
              + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in kinds.items()) + ".\n")
    if r.get("notes"):
        print("Also measured: " + "; ".join(f"{k} = {json.dumps(v)}" for k, v in r["notes"].items()) + ".\n")
    # Test functions are named after the scenario's number (s1_..., s2_...).
    size = "TRADEBUCKET_CHAOS=full " if r["size"] == "full" else ""
    number = r["scenario"].split("-")[0]
    print(f"Rerun: `{size}cargo test --test chaos {number}_ -- --nocapture`\n")
fuzz = directory / "fuzz.json"
if fuzz.exists():
    f = json.loads(fuzz.read_text())
    print(f"### Decoder fuzz\n\n{f['inputs']} inputs ({f['accepted']} accepted as trades) "
          f"in {f['seconds']} s; failure: {f['failure'] or 'none'}.\n")


def storm_verdict(r):
    """The checks of Scenario::assert_verdict (dead letters at least once)."""
    failed = list(r["failures"])
    checks = [
        ("lost", r["lost"] == 0),
        ("doubled", r["duplicated"] == 0),
        ("unexpected", r["unexpected"] == 0),
        ("order", r["order_violations"] == 0),
        ("keys", r.get("wrong_keys", 0) == 0),
        ("stored", r["trades_stored"] == r["trades_expected"]),
        ("audit", r["audit_exit_code"] == 0 and r["audit"].get("violations") == 0
         and r["audit"].get("trades") == r["trades_expected"]),
        ("dead letters", r["dead_letters_distinct"] == r["dead_letters_expected"]
         and r["dead_letters_missing"] == 0 and r["dead_letters_wrong"] == 0),
        ("offsets", r["committed_to_end"]),
        ("exit codes", all(c == 0 for c in r["sigterm_exit_codes"])),
    ]
    failed += [name for name, ok in checks if not ok]
    return "pass" if not failed else "FAIL: " + "; ".join(failed)


storms = sorted(directory.glob("storm-*.json"),
                key=lambda p: int(p.stem.split("-")[1]))
if storms:
    print("| seed | size | conditions drawn | events | distinct trades | lost | doubled "
          "| dead letters (records / sent) | replayed | chains | reconcile | time | verdict |")
    print("|---:|---|---|---:|---:|---:|---:|---|---:|---|---|---:|---|")
    for path in storms:
        r = json.loads(path.read_text())
        seed = r["scenario"].split("-")[1]
        notes = r["notes"]
        drawn = notes.get("drawn", notes.get("conditions"))
        verdict = storm_verdict(r)
        rec = notes.get("reconcile")
        refused = notes.get("reconcile_dead_lettered_and_stored_after_refusal", 0)
        rec = (f"{rec['records']} records, {rec['problems']} problems" if rec else "not run")
        if refused:
            rec += f" (all {refused} refused trades, replayed)"
        refused_dl = r.get("trades_refused_dead_lettered", 0)
        dead = (f"{r['dead_letters_distinct']} of {r['dead_letters_expected']}"
                + (f" + {refused_dl} refused" if refused_dl else "")
                + f" / {r['dead_letters_actual']}")
        c = notes.get("chains")
        chains = (f"{c['buckets']} buckets, {c['closed_by_size']} closed by size, "
                  f"{c['violations']} violations" if c else "not checked")
        print(f"| {seed} | {r['size']} | {drawn} | {r['events_produced']} "
              f"| {r['trades_stored']} of {r['trades_expected']} | {r['lost']} "
              f"| {r['duplicated']} | {dead} | {notes.get('records_replayed', '')} "
              f"| {chains} | {rec} | {r['seconds_total']} s | {verdict} |")
    print()
