"""keel.serve.heap: the start-up heap frozen for a serving process, finalised again at exit."""

import subprocess
import sys

SCRIPT = """
import gc
from keel.serve.heap import freeze_startup_heap

class Node:
    def __del__(self):
        print("finalised", flush=True)

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle: only the collector frees it
frozen = freeze_startup_heap()
assert frozen > 0 and gc.get_freeze_count() == frozen
del a, b
gc.collect()
print("after collection", flush=True)
"""


def test_frozen_objects_escape_collection_until_exit():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.split()
    # Frozen, the cycle outlives a full collection; unfrozen at exit, the final collection finalises it.
    assert out.stdout.splitlines()[0] == "after collection"
    assert lines.count("finalised") == 2
