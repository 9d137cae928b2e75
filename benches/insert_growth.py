#!/usr/bin/env python3
"""Whether the local MongoDB-protocol server's cost per inserted bucket
grows with the collection, and with how many inserts are in flight.

Two sets of B buckets (10 trades each, a unique key per trade, the
product's indexes) inserted one after the other into the same collection
in unordered commands of 1,000, with IN_FLIGHT commands at once (the
worker sends one; the bench's database ceiling four). Prints the server's
CPU (from /proc) and the wall time per bucket of each set. Needs the
stack running (scripts/stack start) and pymongo. docs/benchmarks.md
("Session 20") quotes its output.

    python3 benches/insert_growth.py B IN_FLIGHT     # e.g. 100000 1
"""
import sys, time
from concurrent.futures import ThreadPoolExecutor
from pymongo import MongoClient
from stack_probe import cpu, entry, product_indexes, url
B = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
IN_FLIGHT = int(sys.argv[2]) if len(sys.argv) > 2 else 1
client = MongoClient(url, maxPoolSize=8)
coll = client['insert_growth']['b']
client.drop_database('insert_growth')
product_indexes(coll)
def bucket(n):
    c, j = n % 10000, n // 10000
    return {'_id': f'{c}_{1700000000 + j:010d}', 'customerId': c, 'count': 10, 'cap': 10,
            'bytes': 3000, 'capBytes': 7864011, 'prev': f'{c}_{1700000000 + j - 1:010d}' if j else f'{c}_',
            'tickers': ['AAPL'], 'wm': {'t:0': n},
            'history': [entry(n, k) for k in range(10)]}
def insert(first):
    coll.insert_many([bucket(n) for n in range(first, first + 1000)], ordered=False)
for name, start in [('first set', 0), ('second set', B)]:
    t0, c0 = time.time(), cpu()
    with ThreadPoolExecutor(IN_FLIGHT) as ex:
        list(ex.map(insert, range(start, start + B, 1000)))
    print(f'{name}, {IN_FLIGHT} in flight: {(cpu() - c0) / B * 1e6:.0f} us of server CPU per bucket, '
          f'{(time.time() - t0) / B * 1e6:.0f} us wall', flush=True)
client.drop_database('insert_growth')
