#!/usr/bin/env python3
"""What the local MongoDB-protocol server spends on loading newest buckets.

N customers' newest buckets (highest `_id` in the customer's prefix
range, as `BucketStore::load_head` asks), loaded as one `find` each (16
at a time, as the worker does), as one `aggregate` of 16 `$unionWith`
branches (`$match` on the range, `$sort`, `$limit: 1`) or 64, and as one
`find` with an `$or` of 16 ranges (which returns every bucket of those
customers). PER buckets per customer are inserted first (0: an empty
collection). With `probe`, only the one-`find`-each loads against the
worker's probe (`bucket::store::heads`: one `find` of 64 customers'
ranges, `_id` only, highest first, limit 64, one `$in` read of the heads
found, and one `find` each for those it cannot settle). Prints the wall
time and the server's CPU (from /proc) of each. Needs the stack running
(scripts/stack start) and pymongo. docs/benchmarks.md ("Session 19",
"Session 20") quotes its output; with buckets in the collection the
`$unionWith` rows take minutes on the local server.

    python3 benches/head_loads.py N PER [probe]   # e.g. 10000 0, or 2000 3
"""
import sys, time
from concurrent.futures import ThreadPoolExecutor
from pymongo import MongoClient
from stack_probe import cpu, url
N = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
PER = int(sys.argv[2]) if len(sys.argv) > 2 else 0
client = MongoClient(url, maxPoolSize=32)
coll = client['head_probe']['b']
PROJ = {'count': 1, 'cap': 1, 'capBytes': 1, 'bytes': 1, 'customerId': 1, 'wm': 1, 'history.key': 1}
def setup():
    client.drop_database('head_probe')
    coll.create_index([('customerId', 1), ('tickers', 1)])
    coll.create_index('history.key')
    coll.create_index('prev', unique=True, sparse=True)
    docs = []
    for i in range(N):
        for j in range(PER):
            d = {'_id': f'{i}_{1000 + j}', 'customerId': i, 'count': 10, 'cap': 10, 'tickers': ['A'],
                 'history': [{'key': f't:{i}-{j}-{k}', 'pad': 'x' * 100} for k in range(10)]}
            if j:
                d['prev'] = f'{i}_{999 + j}'
            docs.append(d)
    for s in range(0, len(docs), 1000):
        coll.insert_many(docs[s:s + 1000], ordered=False)
def rng(i):
    return {'_id': {'$gte': f'{i}_', '$lt': f'{i}`'}}
def finds():
    one = lambda i: coll.find_one(rng(i), sort=[('_id', -1)], projection=PROJ)
    with ThreadPoolExecutor(16) as ex:
        return sum(1 for d in ex.map(one, range(N)) if d)
def unions(k):
    sub = lambda i: [{'$match': rng(i)}, {'$sort': {'_id': -1}}, {'$limit': 1}, {'$project': PROJ}]
    n = 0
    for s in range(0, N, k):
        ids = list(range(s, min(s + k, N)))
        pipe = sub(ids[0]) + [{'$unionWith': {'coll': 'b', 'pipeline': sub(i)}} for i in ids[1:]]
        n += len(list(coll.aggregate(pipe)))
    return n
def ors(k):
    n = 0
    for s in range(0, N, k):
        n += len(list(coll.find({'$or': [rng(i) for i in range(s, min(s + k, N))]}, projection=PROJ)))
    return n
def probes(k=64):
    n, rest = 0, []
    for s in range(0, N, k):
        group = list(range(s, min(s + k, N)))
        ids = [d['_id'] for d in coll.find({'$or': [rng(i) for i in group]}, {'_id': 1})
               .sort('_id', -1).limit(len(group))]
        heads = {}
        for i in ids:
            heads.setdefault(i.split('_')[0], i)
        if heads:
            n += len(list(coll.find({'_id': {'$in': list(heads.values())}}, PROJ)))
        cut = ids[-1] if len(ids) >= len(group) else None
        rest += [i for i in group if str(i) not in heads and cut is not None and f'{i}_' <= cut]
    one = lambda i: coll.find_one(rng(i), sort=[('_id', -1)], projection=PROJ)
    with ThreadPoolExecutor(16) as ex:
        return n + sum(1 for d in ex.map(one, rest) if d)
setup()
runs = [('find each, 16 at a time', finds), ('probe of 64', probes)] * 2
for name, f in runs if sys.argv[3:] == ['probe'] else [('find each, 16 at a time', finds), ('$unionWith of 16', lambda: unions(16)),
                ('find each, 16 at a time', finds), ('$unionWith of 16', lambda: unions(16)),
                ('$unionWith of 64', lambda: unions(64)), ('$or of 16 ranges', lambda: ors(16))]:
    t0, c0 = time.time(), cpu()
    n = f()
    print(f'{name}: {n} documents, {time.time() - t0:.2f} s wall, server CPU {cpu() - c0:.2f} s '
          f'({1e6 * (cpu() - c0) / N:.0f} us per customer)', flush=True)
client.drop_database('head_probe')
