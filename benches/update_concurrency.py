#!/usr/bin/env python3
"""Does the local MongoDB-protocol server run two update commands at once?

The same 20,000 guarded appends (the worker's fill statements, one per
bucket, under a multikey `history.key` index) sent as one `update`
command, or as two commands on two connections at once; prints the wall
time and the server's CPU (from /proc) of each, alternating. Needs the
stack running (scripts/stack start) and pymongo. docs/benchmarks.md
("Throughput against the co-located bound") quotes its output.

    python3 benches/update_concurrency.py
"""
import threading, time
from pymongo import MongoClient
from stack_probe import cpu, url
N = 20000
def setup(c):
    db = c['upd_probe']; db.drop_collection('b'); coll = db['b']
    coll.create_index('history.key')
    coll.insert_many([{'_id': f'{i}_1', 'count': 5,
                       'history': [{'key': f't:{i}-{j}', 'pad': 'x' * 100} for j in range(5)]}
                      for i in range(N)])
    return db
def stmts(lo, hi, round_):
    return [{'q': {'_id': f'{i}_1', 'count': 5 + round_},
             'u': {'$push': {'history': {'key': f't:{i}-r{round_}', 'pad': 'x' * 100}}, '$inc': {'count': 1}}}
            for i in range(lo, hi)]
def send(db, s):
    r = db.command({'update': 'b', 'updates': s, 'ordered': False})
    assert r['nModified'] == len(s), r
clients = [MongoClient(url) for _ in range(2)]
db0 = setup(clients[0]); db1 = clients[1]['upd_probe']
for round_, mode in enumerate(['one', 'two', 'one', 'two']):
    c0, t0 = cpu(), time.time()
    if mode == 'one':
        send(db0, stmts(0, N, round_))
    else:
        th = [threading.Thread(target=send, args=(d, stmts(lo, hi, round_)))
              for d, (lo, hi) in zip([db0, db1], [(0, N // 2), (N // 2, N)])]
        [t.start() for t in th]; [t.join() for t in th]
    print(f'{mode} command(s): {time.time() - t0:.2f} s wall, server CPU {cpu() - c0:.2f} s')
clients[0].drop_database('upd_probe')
