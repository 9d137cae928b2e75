#!/usr/bin/env python3
"""What one command costs the local MongoDB-protocol server on its own.

4,000 one-trade buckets (the product's indexes), then two one-trade
appends each (guarded on `count`, as `fill_statement` writes them), then
a new one-trade bucket each, in unordered `update` / `insert` commands of
1, 5, 20 and 100 statements, and of 1 again as a check on drift; a fresh
collection for each size, at the worker's write concern (majority,
journal). Prints the server's CPU per statement. Under a steady load the
worker's commands carry whatever arrived during the last write, so at low
rates they are small and this fixed cost is much of a trade's.
docs/benchmarks.md ("Session 31") quotes its output. Needs the stack
running (scripts/stack start) and pymongo.

    python3 benches/command_size.py [SIZE ...]
"""
import sys
from pymongo import MongoClient
from stack_probe import cpu, entry, product_indexes, url
N = 4000
WC = {'w': 'majority', 'j': True}
client = MongoClient(url)
db = client['command_probe']
coll = db['b']
def bucket(i, start, prev, k):
    return {'_id': f'{i}_{start}', 'customerId': i, 'count': 1, 'cap': 10, 'bytes': 400,
            'capBytes': 7864011, 'prev': prev, 'tickers': ['AAPL'], 'wm': {'t:0': k},
            'history': [entry(i, k)]}
def setup():
    client.drop_database('command_probe')
    product_indexes(coll)
    for s in range(0, N, 1000):
        coll.insert_many([bucket(i, 1700000000, f'{i}_', 0) for i in range(s, s + 1000)])
def fill(i, k):
    return {'q': {'_id': f'{i}_1700000000', 'count': k},
            'u': {'$push': {'history': {'$each': [entry(i, k)]}}, '$inc': {'count': 1, 'bytes': 200},
                  '$max': {'wm.t:0': k}, '$addToSet': {'tickers': {'$each': ['AAPL']}}}}
def per_statement(commands, statements):
    c0 = cpu()
    for command in commands:
        db.command(command)
    return (cpu() - c0) / statements * 1e6
for size in [int(a) for a in sys.argv[1:]] or [1, 5, 20, 100, 1]:
    setup()
    chunks = [range(s, min(N, s + size)) for s in range(0, N, size)]
    appends = per_statement(
        ({'update': 'b', 'updates': [fill(i, k) for i in r], 'ordered': False, 'writeConcern': WC}
         for k in (1, 2) for r in chunks), 2 * N)
    inserts = per_statement(
        ({'insert': 'b', 'documents': [bucket(i, 1800000000, f'{i}_1700000000', 3) for i in r],
          'ordered': False, 'writeConcern': WC} for r in chunks), N)
    print(f'{size} statements a command: {appends:.0f} us of server CPU per append, '
          f'{inserts:.0f} per new bucket', flush=True)
client.drop_database('command_probe')
