"""What the probes of the local MongoDB-protocol server share: where it
listens and how much CPU it has used (from /proc), for the stack that
scripts/stack started (TRADEBUCKET_STACK_DIR and TRADEBUCKET_MONGO_PORT
as scripts/stack sets them)."""
import os, pathlib
stack = pathlib.Path(os.environ.get('TRADEBUCKET_STACK_DIR', pathlib.Path(__file__).parent.parent / '.stack'))
pid = int((stack / 'mongodb.pid').read_text())
port = os.environ.get('TRADEBUCKET_MONGO_PORT', '27117')
url = f'mongodb://127.0.0.1:{port}/?directConnection=true'
tick = os.sysconf('SC_CLK_TCK')
def cpu():
    """The server's user + system CPU-seconds so far."""
    f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick
def product_indexes(coll):
    """The product's secondary indexes on a probe's collection: customer and
    tickers, and the unique trade keys and `prev` links (partial, as
    `tradebucket init` creates them unsharded)."""
    coll.create_index([('customerId', 1), ('tickers', 1)])
    exists = lambda f: {'partialFilterExpression': {f: {'$exists': True}}}
    coll.create_index('history.key', unique=True, **exists('history.key'))
    coll.create_index('prev', unique=True, **exists('prev'))
def entry(i, k):
    """History entry k of bucket or customer i, about a product entry's size."""
    return {'key': f't:{i}-{k}', 'ticker': 'AAPL', 'qty': 1, 'price': 10.5, 'pad': 'x' * 60}
