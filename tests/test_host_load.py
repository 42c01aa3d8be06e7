"""Foreign load: the CPU time of processes this one started, however deep, is its own."""

import subprocess
import sys

import pytest

from parsim.calibrate import host_load
from parsim.calibrate.host_load import ForeignLoad

# A child that lives on (as a fork server does) while a grandchild it started burns a second of CPU and ends
# unreaped by us: neither reaches this process's RUSAGE_CHILDREN.
SERVER = """
import os, sys, time
pid = os.fork()
if pid == 0:
    end = time.process_time() + 1.0
    while time.process_time() < end:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print("done", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_descendant_of_a_running_child_counts_as_own_work():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        with ForeignLoad() as load:
            before = host_load._own_seconds()
            assert server.stdout.readline().strip() == "done"
            own = host_load._own_seconds() - before
        assert own >= 0.9  # the grandchild's second, through the running child's finished children
        # not the other programs' load: counted as foreign, the grandchild's second would read as ~0.9 cores
        assert load.cores is not None and load.cores < 0.5
    finally:
        server.stdin.close()
        server.wait(timeout=10)

