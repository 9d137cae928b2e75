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
