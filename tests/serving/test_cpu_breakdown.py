"""benchmarks/cpu.py: each process of a process tree, in cores, between two snapshots."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import cpu
from benchmarks.cpu import ProcessTime

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

BUSY = "import time\nstart = time.time()\nwhile time.time() - start < 2.0:\n    pass\n"


def test_a_spinning_grandchild_is_counted_under_its_script(tmp_path):
    script = tmp_path / "busy.py"
    script.write_text(BUSY)
    # `; true` keeps the shell alive, so the Python process is a grandchild of the root
    root = subprocess.Popen(["sh", "-c", f"{sys.executable} {script}; true"])
    try:
        time.sleep(0.3)
        before, begin = cpu.snapshot(root.pid), time.perf_counter()
        time.sleep(0.8)
        after = cpu.snapshot(root.pid)
        cores = cpu.cores_by_process(before, after, time.perf_counter() - begin)
    finally:
        root.wait(timeout=30)
    name = f"{Path(sys.executable).name} busy.py"
    assert cores.get(name, 0.0) > 0.1, cores  # a spinning process takes most of a core
    assert os.getpid() not in after  # the tree is the root's, not its parent's


def test_cores_add_up_by_name_and_count_new_processes_from_zero():
    before = {1: ProcessTime("a", 1.0), 2: ProcessTime("b", 3.0)}
    after = {1: ProcessTime("a", 2.0), 2: ProcessTime("b", 3.0), 3: ProcessTime("a", 0.5)}
    assert cpu.cores_by_process(before, after, 2.0) == {"a": 0.75}
    with pytest.raises(ValueError, match="wall_s"):
        cpu.cores_by_process(before, after, 0.0)


def test_the_next_round_waits_while_a_core_still_spins(tmp_path):
    """A server that spins a core after its round (vLLM's CPU engine does, for about a second)
    would take it from the next server's round: the benchmark waits until the host is quiet."""
    script = tmp_path / "busy.py"
    script.write_text(BUSY)  # a full core for 2 s
    spinner = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.3)
        waited = cpu.wait_until_idle(busy_below=0.5, timeout_s=10.0)
    finally:
        spinner.wait()
    assert waited >= 1.2  # not before the spinner's last ~1.7 s had passed
