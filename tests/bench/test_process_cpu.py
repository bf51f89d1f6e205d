"""CPU time of a process tree from /proc: children and grandchildren found, the root in or out,
and the CPU between two readings counted per pid."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tandem.bench.process_cpu import cpu_seconds, cpu_used, process_role, tree_cpu_seconds

SPIN = "import time\nend = time.process_time() + {burn}\nwhile time.process_time() < end: pass\ntime.sleep(60)"
# A child that starts a grandchild, says its pid, and both burn a little CPU before sleeping.
PARENT = ("import subprocess, sys\n"
          f"grandchild = subprocess.Popen([sys.executable, '-c', {SPIN.format(burn=0.2)!r}])\n"
          "print(grandchild.pid, flush=True)\n" + SPIN.format(burn=0.2))


def test_a_process_tree_counts_its_childrens_cpu() -> None:
    # A child that burns 0.6 s of CPU, then sleeps: its time is in the tree, a stranger's is not.
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(burn=0.6)])
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_seconds(os.getpid()).get(child.pid, 0.0) < 0.6:
            assert time.monotonic() < deadline, "the child's CPU time never showed"
            time.sleep(0.1)
        tree = tree_cpu_seconds(os.getpid())
        assert os.getpid() in tree and child.pid in tree and 1 not in tree
        assert tree[child.pid] == pytest.approx(0.6, abs=0.15)
    finally:
        child.kill()
        child.wait()


def test_grandchildren_are_in_the_tree_and_the_root_can_be_left_out() -> None:
    child = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        before = tree_cpu_seconds(os.getpid(), include_root=False)
        after = tree_cpu_seconds(os.getpid(), include_root=False)
        assert {child.pid, grandchild} <= after.keys() and os.getpid() not in after
        assert all(seconds >= 0.0 for seconds in after.values())
        assert cpu_used(before, after) >= 0.0
        assert os.getpid() in tree_cpu_seconds(os.getpid())  # include_root, the default
    finally:
        os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()
        child.stdout.close()


def test_cpu_used_counts_per_pid() -> None:
    # pid 1: +0.5 s; pid 2 gone (lost); pid 3 new: counts from 0.
    assert cpu_used({1: 2.0, 2: 5.0}, {1: 2.5, 3: 0.25}) == 0.75
    # pid 4's time went down: a reused pid, a new process, counted from 0.
    assert cpu_used({4: 9.0}, {4: 1.5}) == 1.5


def test_a_process_role_is_what_ray_or_the_program_names_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"up\n"  # it runs Python now: its command line is set
        assert process_role(child.pid) == os.path.basename(sys.executable)
    finally:
        child.kill()
        child.wait()
    assert process_role(child.pid) == ""


def test_a_process_cpu_time_is_what_its_clock_says() -> None:
    before, clock = cpu_seconds(os.getpid()), time.process_time()
    hashlib.sha256(bytes(64 << 20)).digest()  # work: tens of ms of CPU
    used = time.process_time() - clock
    assert used > 0.02
    assert abs((cpu_seconds(os.getpid()) - before) - used) <= 0.03  # /proc counts in 10 ms ticks, read twice
