#!/usr/bin/env python3
"""Whether the local MongoDB-protocol server's cost of one append grows
with the bucket it appends to.

For each size K given: 5,000 buckets of K trades (the product's indexes),
then one one-trade append each (`{_id, count}` guarded; `$push`, `$inc`,
`$max`, `$addToSet`, as `fill_statement` writes them) in unordered
`update` commands of 100 statements, one at a time, as the append ceiling
sends them. A fresh collection for each size. Prints the server's CPU
(from /proc) and the wall time per append. Needs the stack running
(scripts/stack start) and pymongo. docs/benchmarks.md ("Session 27")
quotes its output.

    python3 benches/append_size.py 1 8 1 8 2 9
"""
import sys, time
from pymongo import MongoClient
from stack_probe import cpu, entry, product_indexes, url
N = 5000
client = MongoClient(url)
db = client['append_probe']
coll = db['b']
def setup(k):
    client.drop_database('append_probe')
    product_indexes(coll)
    docs = [{'_id': f'{i}_1700000000', 'customerId': i, 'count': k, 'cap': 10, 'bytes': 200 * k,
             'capBytes': 7864011, 'prev': f'{i}_', 'tickers': ['AAPL'], 'wm': {'t:0': k},
             'history': [entry(i, j) for j in range(k)]} for i in range(N)]
    for s in range(0, N, 1000):
        coll.insert_many(docs[s:s + 1000])
def statement(i, k):
    return {'q': {'_id': f'{i}_1700000000', 'count': k},
            'u': {'$push': {'history': {'$each': [entry(i, k)]}}, '$inc': {'count': 1, 'bytes': 200},
                  '$max': {'wm.t:0': k + 1}, '$addToSet': {'tickers': {'$each': ['AAPL']}}}}
for k in [int(a) for a in sys.argv[1:]]:
    setup(k)
    time.sleep(1)  # let the setup's writes settle before the clock starts
    t0, c0 = time.time(), cpu()
    for s in range(0, N, 100):
        r = db.command({'update': 'b', 'updates': [statement(i, k) for i in range(s, s + 100)],
                        'ordered': False})
        assert r['nModified'] == 100, r
    t, c = time.time() - t0, cpu() - c0
    print(f'K={k}: {N / t:.0f} appends/s, server {c / N * 1e6:.0f} µs per append,'
          f' wall {t / N * 1e6:.0f} µs per append', flush=True)
client.drop_database('append_probe')
