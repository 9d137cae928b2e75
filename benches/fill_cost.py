#!/usr/bin/env python3
"""What the local MongoDB-protocol server spends on one append statement.

5,000 half-full buckets (5 of 10 trades, the product's indexes), then one
guarded append each (`{_id, count}`, five more trades), in unordered
`update` commands of 1,000 statements: as `fill_statement` writes them
(`$push` of the entries, `$inc` of count and bytes, `$max` of the
watermark, `$addToSet` of the tickers), and without `$addToSet`, without
`$max`, and with only `$push` and `$inc`; the full form again last, as a
check on drift. A fresh collection for each. Prints the server's CPU
(from /proc) and the wall time per statement. Needs the stack running
(scripts/stack start) and pymongo. docs/benchmarks.md ("Session 20")
quotes its output.

    python3 benches/fill_cost.py
"""
import time
from pymongo import MongoClient
from stack_probe import cpu, entry, product_indexes, url
N = 5000
client = MongoClient(url)
db = client['fill_probe']
coll = db['b']
def setup():
    client.drop_database('fill_probe')
    product_indexes(coll)
    docs = [{'_id': f'{i}_1700000000', 'customerId': i, 'count': 5, 'cap': 10, 'bytes': 2000,
             'capBytes': 7864011, 'prev': f'{i}_', 'tickers': ['AAPL', 'MSFT'], 'wm': {'t:0': 5},
             'history': [entry(i, k) for k in range(5)]} for i in range(N)]
    for s in range(0, N, 1000):
        coll.insert_many(docs[s:s + 1000])
def statement(i, kind):
    u = {'$push': {'history': {'$each': [entry(i, k) for k in range(5, 10)]}},
         '$inc': {'count': 5, 'bytes': 1000}}
    if kind in ('as written', 'without $addToSet'):
        u['$max'] = {'wm.t:0': 10}
    if kind in ('as written', 'without $max'):
        u['$addToSet'] = {'tickers': {'$each': ['AAPL']}}
    return {'q': {'_id': f'{i}_1700000000', 'count': 5}, 'u': u}
for kind in ['as written', 'without $addToSet', 'without $max', '$push and $inc', 'as written']:
    setup()
    t0, c0 = time.time(), cpu()
    for s in range(0, N, 1000):
        r = db.command({'update': 'b', 'updates': [statement(i, kind) for i in range(s, s + 1000)],
                        'ordered': False})
        assert r['n'] == 1000, r
    print(f'{kind}: {(cpu() - c0) / N * 1e6:.0f} us of server CPU per statement, '
          f'{(time.time() - t0) / N * 1e6:.0f} us wall', flush=True)
client.drop_database('fill_probe')
