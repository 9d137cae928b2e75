#!/usr/bin/env python3
"""A steady phase started cold or from a steady state, for an A/B.

One fresh worker (EXE, its own group and database) on a fresh 8-partition
topic; with WARM=1 it first stores customer c's (c mod 10) + 1 trades
(as the bench's steady phases now do, benches/pipeline/delay.rs
`warm_up`); then `tradebucket produce` sends RATE trades/s over 10,000
customers for SECS s. Prints the worker's end-to-end delay p50/p90/p99
(its own histogram, the warm-up's observations taken off), its MongoDB
requests and stages (p50 and p99 in ms, and count), and the cores and
µs per trade of the broker, the database and the worker over the load.
docs/benchmarks.md ("Session 31") quotes its output. Needs the stack
running (scripts/stack start; TRADEBUCKET_STACK_DIR and
TRADEBUCKET_KAFKA_PORT / TRADEBUCKET_MONGO_PORT as it sets them) and
confluent-kafka.

    [WARM=1] python3 benches/steady_warmup.py EXE LABEL RATE SECS [KEY=VALUE ...]

KEY=VALUE pairs go to the worker's environment
(TRADEBUCKET__MONGODB__FILL_CONCURRENCY=2, for instance).
"""
import atexit, os, sys, time, subprocess, re, urllib.request, json
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

exe, label, rate, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
extra = dict(a.split("=", 1) for a in sys.argv[5:])
stamp = int(time.time())
topic = f"st-{label}-{stamp}"
group = f"g-{label}-{stamp}"
BROKER = "127.0.0.1:" + os.environ.get("TRADEBUCKET_KAFKA_PORT", "19092")
STACK = os.environ.get("TRADEBUCKET_STACK_DIR", os.path.join(os.path.dirname(__file__), "..", ".stack"))
a = AdminClient({"bootstrap.servers": BROKER})
for f in a.create_topics([NewTopic(topic, 8, 1)]).values():
    f.result()
env = dict(os.environ)
env.update({
    "TRADEBUCKET__KAFKA__BROKERS": BROKER,
    "TRADEBUCKET__MONGODB__URI": "mongodb://127.0.0.1:" + os.environ.get("TRADEBUCKET_MONGO_PORT", "27117") + "/?directConnection=true",
    "TRADEBUCKET__KAFKA__TOPICS": topic,
    "TRADEBUCKET__KAFKA__GROUP_ID": group,
    "TRADEBUCKET__MONGODB__DATABASE": group.replace("-", "_"),
    "TRADEBUCKET__HTTP__LISTEN": "127.0.0.1:18089",
    "TRADEBUCKET__LOG__LEVEL": "warn",
})
env.update(extra)
tick = os.sysconf("SC_CLK_TCK")


def cpu(pid):
    f = open(f"/proc/{pid}/stat").read()
    f = f[f.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / tick


def metrics():
    return urllib.request.urlopen("http://127.0.0.1:18089/metrics", timeout=5).read().decode()


def hist(text, name, sel=""):
    b = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{") and sel in line:
            le = re.search(r'le="([^"]+)"', line).group(1)
            b.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
    b.sort()
    return b


def minus(b, base):
    d = dict(base)
    return [(le, c - d.get(le, 0.0)) for le, c in b]


def q(b, p):
    if not b or b[-1][1] == 0:
        return float("nan")
    want = p * b[-1][1]
    lo, lc = 0.0, 0.0
    for le, c in b:
        if c >= want:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((want - lc) / max(c - lc, 1e-9))
        lo, lc = le, c
    return lo


pids = {k: int(open(os.path.join(STACK, f"{k}.pid")).read()) for k in ("kafka", "mongodb")}
w = subprocess.Popen([exe, "run"], env=env, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
# Also when a wait below fails: a worker left behind holds the metrics port.
atexit.register(w.kill)
warm_text = ""
t0 = time.time()
while True:
    time.sleep(0.2)
    try:
        m = re.search(r"^tradebucket_assigned_partitions (\S+)", metrics(), re.M)
        if m and float(m.group(1)) >= 8:
            break
    except OSError:
        pass
    assert time.time() - t0 < 60, "not assigned"
if os.environ.get("WARM"):
    # Buckets of every size, as a long steady load leaves them: customer c
    # gets (c % 10) + 1 trades before the load, dated earlier.
    from confluent_kafka import Producer
    pr = Producer({"bootstrap.servers": BROKER, "linger.ms": 20})
    base = 1_699_000_000_000
    n = 0
    for c in range(10000):
        for i in range(c % 10 + 1):
            ev = {"tradeId": f"W{c}-{i}", "customerId": c, "type": "buy", "ticker": "MDB",
                  "qty": 5, "price": "10.00", "currency": "USD", "date": base + n * 3}
            n += 1
            while True:
                try:
                    pr.produce(topic, json.dumps(ev, separators=(",", ":")), str(c))
                    break
                except BufferError:
                    pr.poll(0.1)
    pr.flush()
    cw = Consumer({"bootstrap.servers": BROKER, "group.id": group, "enable.auto.commit": False})
    pw = [TopicPartition(topic, p) for p in range(8)]
    ew = [cw.get_watermark_offsets(tp)[1] for tp in pw]
    tw = time.time()
    while not all(tp.offset >= e for tp, e in zip(cw.committed(pw, timeout=5), ew)):
        assert time.time() - tw < 300, "warm-up not drained"
        time.sleep(0.5)
    cw.close()
    time.sleep(2)
    warm_text = metrics()
count = rate * secs
before = {k: cpu(p) for k, p in pids.items()}
before["worker"] = cpu(w.pid)
start = time.time()
subprocess.run([exe, "produce", "--topic", topic, "--count", str(count), "--customers", "10000",
                "--rate", str(rate)], env=env, check=True, stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)
load_secs = time.time() - start
loaded = {k: cpu(p) for k, p in pids.items()}
loaded["worker"] = cpu(w.pid)
c = Consumer({"bootstrap.servers": BROKER, "group.id": group, "enable.auto.commit": False})
parts = [TopicPartition(topic, p) for p in range(8)]
ends = [c.get_watermark_offsets(tp)[1] for tp in parts]
while True:
    com = c.committed(parts, timeout=5)
    if all(tp.offset >= e for tp, e in zip(com, ends)):
        break
    assert time.time() - start < secs + 180, "not drained"
    time.sleep(0.2)
drain = time.time() - start - load_secs
time.sleep(0.5)
text = metrics()
after = {k: cpu(p) for k, p in pids.items()}
after["worker"] = cpu(w.pid)
w.terminate()
w.wait()
warm = warm_text
e2e = minus(hist(text, "tradebucket_end_to_end_delay_seconds"), hist(warm, "tradebucket_end_to_end_delay_seconds"))
out = {"warm": bool(warm), "label": label, "rate": rate, "drain_s": round(drain, 2),
       "e2e": [round(q(e2e, p), 3) for p in (0.5, 0.9, 0.99)]}
for op in ("load", "fill", "insert"):
    b = minus(hist(text, "tradebucket_mongodb_request_duration_seconds", f'operation="{op}"'),
              hist(warm, "tradebucket_mongodb_request_duration_seconds", f'operation="{op}"'))
    out[op] = [round(q(b, p) * 1000, 1) for p in (0.5, 0.99)] + [int(b[-1][1]) if b else 0]
for st in ("batching", "writing"):
    b = minus(hist(text, "tradebucket_stage_delay_seconds", f'stage="{st}"'),
              hist(warm, "tradebucket_stage_delay_seconds", f'stage="{st}"'))
    out[st] = [round(q(b, p) * 1000, 1) for p in (0.5, 0.99)] + [int(b[-1][1]) if b else 0]
for k in before:
    out[k + "_cores"] = round((loaded[k] - before[k]) / load_secs, 2)
    out[k + "_us"] = round((after[k] - before[k]) / count * 1e6, 1)
print(json.dumps(out))
