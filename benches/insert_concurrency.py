#!/usr/bin/env python3
"""Does the local MongoDB-protocol server run concurrent inserts at once?

The same 20 rounds of 2,000 bucket-like documents (10 history entries
each, under the product's indexes), each round sent as one unordered
insert, or split into 2 or 4 inserts on as many connections at once;
the documents are encoded before the clock starts. Prints the wall time
and the server's CPU (from /proc) of each, twice. Needs the stack
running (scripts/stack start) and pymongo. docs/benchmarks.md ("Where a
million-event run's time goes") quotes its output.

    python3 benches/insert_concurrency.py
"""
import time
from concurrent.futures import ThreadPoolExecutor
import bson
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient, WriteConcern
from stack_probe import cpu, url
ROUNDS, PER = 20, 2000
def docs(variant, r):
    return [{'_id': f'{variant}-{r}-{i}_1000', 'customerId': i, 'count': 10, 'cap': 10, 'tickers': ['AAA', 'BBB'],
             'history': [{'key': f't:{variant}-{r}-{i}-{k}', 'price': 1.5, 'qty': 10, 'ticker': 'AAA', 'pad': 'x' * 60}
                         for k in range(10)]}
            for i in range(PER)]
def run(split, coll):
    pool = ThreadPoolExecutor(split)
    rounds = [[RawBSONDocument(bson.encode(x)) for x in docs(split, r)] for r in range(ROUNDS)]
    t0, c0 = time.time(), cpu()
    for d in rounds:
        n = len(d) // split
        parts = [d[k * n:(k + 1) * n] for k in range(split)]
        list(pool.map(lambda p: coll.insert_many(p, ordered=False), parts))
    return time.time() - t0, cpu() - c0
client = MongoClient(url, maxPoolSize=16)
for rep in range(2):
    for split in (1, 2, 4):
        db = client[f'ins_probe_{rep}_{split}']; db.drop_collection('b')
        coll = db.get_collection('b', write_concern=WriteConcern(w='majority'))
        coll.create_index([('customerId', 1), ('tickers', 1)])
        coll.create_index('history.key')
        coll.create_index('prev', unique=True, sparse=True)
        wall, server = run(split, coll)
        n = ROUNDS * PER
        print(f'{split} insert(s) per round: {wall:.2f} s wall, server CPU {server:.2f} s ({1e6 * server / n:.1f} us per document)', flush=True)
        client.drop_database(f'ins_probe_{rep}_{split}')
