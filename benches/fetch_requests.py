#!/usr/bin/env python3
"""How many fetch requests a consumer sends to read a topic at a pace.

A librdkafka consumer (confluent-kafka's, the same library the worker
links) is assigned every partition of TOPIC from the start and reads
EVENTS records at RATE a second, with librdkafka's defaults or the
KEY=VALUE properties given (the worker's prefetch bounds, for instance:
src/kafka/clients.rs `PREFETCH`). Its `debug=fetch` log is counted:
fetch requests sent, and fetch responses that brought records. Each
fetch request costs the broker CPU whatever it carries, so this is what
the broker-CPU target compares (docs/benchmarks.md, "Session 39"). Needs
the stack running (scripts/stack start; TRADEBUCKET_KAFKA_PORT as it
sets it) and confluent-kafka.

    python3 benches/fetch_requests.py TOPIC PARTITIONS RATE EVENTS [KEY=VALUE ...]

The worker's settings:

    python3 benches/fetch_requests.py T 8 40000 1000000 fetch.max.bytes=1048576 \\
        queued.max.messages.kbytes=16384 queued.min.messages=2000 fetch.queue.backoff.ms=10
"""
import logging, os, re, sys, time
from confluent_kafka import Consumer, TopicPartition, OFFSET_BEGINNING

topic, partitions, rate, events = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
counts = {"fetch_requests": 0, "responses_with_records": 0}


class Counter(logging.Handler):
    def emit(self, record):
        m = record.getMessage()
        if re.search(r"Fetch \d+/\d+/\d+ toppar", m):
            counts["fetch_requests"] += 1
        if "Enqueue" in m and "fetch queue" in m:
            counts["responses_with_records"] += 1


log = logging.getLogger("librdkafka")
log.setLevel(logging.DEBUG)
log.addHandler(Counter())
port = os.environ.get("TRADEBUCKET_KAFKA_PORT", "19092")
conf = {"bootstrap.servers": f"127.0.0.1:{port}", "group.id": "fetch-requests",
        "debug": "fetch", "logger": log}
conf.update(dict(a.split("=", 1) for a in sys.argv[5:]))
consumer = Consumer(conf)
consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
read, started = 0, time.time()
while read < events:
    read += len(consumer.consume(1000, 0.1))
    ahead = read / rate - (time.time() - started)
    if ahead > 0:
        time.sleep(ahead)
seconds = time.time() - started
consumer.close()
print({"events": read, "seconds": round(seconds, 1), **counts,
       "requests_per_million": round(counts["fetch_requests"] / read * 1e6)})
