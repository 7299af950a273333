"""Where a served run's CPU went: each process of an app's process tree, in cores, from /proc.

On a host whose every core runs the engine, whatever the processes around it (Serve's proxy, the
ingress, the controller, Ray's own daemons, the client) use is taken from the engine's threads,
and the served figure falls below the offline one by about twice that share. `snapshot` before
and after a round and `cores_by_process` between them say which process took how much. Linux
only (it reads /proc); elsewhere the snapshots are empty.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class ProcessTime:
    name: str
    cpu_s: float  # user + system time so far


def snapshot(root: int) -> dict[int, ProcessTime]:
    """CPU time so far of `root` and every process descended from it."""
    stats = _stats()
    parents = {pid: int(fields[1]) for pid, fields in stats.items()}
    wanted = {root}
    for pid in parents:
        wanted |= _chain_to(pid, parents, wanted)
    return {pid: ProcessTime(_name(pid), _cpu_s(stats[pid])) for pid in wanted if pid in stats}


def seconds_by_process(
    before: dict[int, ProcessTime], after: dict[int, ProcessTime]
) -> dict[str, float]:
    """CPU seconds each process name used between two snapshots (processes of one name summed;
    one started in between counts from zero)."""
    used: dict[str, float] = defaultdict(float)
    for pid, now in after.items():
        then = before.get(pid)
        used[now.name] += now.cpu_s - (then.cpu_s if then is not None else 0.0)
    return dict(used)


def cores_by_process(
    before: dict[int, ProcessTime], after: dict[int, ProcessTime], wall_s: float
) -> dict[str, float]:
    """Cores each process name used between two snapshots `wall_s` apart, largest first."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    return _in_cores(seconds_by_process(before, after), wall_s)


def own_cpu_s() -> float:
    """This process's CPU time so far (the client's share of a round)."""
    times = os.times()
    return times.user + times.system


class CpuUse:
    """CPU seconds per process name over the rounds run against one app, with the client's (this
    process's) under CLIENT, and the wall time they took: `before = use.start(pid)`, the round,
    `use.stop(pid, before)`; `cores()` over them all."""

    CLIENT = "client (this program)"

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.wall_s = 0.0

    def start(self, pid: int) -> tuple[dict, float, float]:
        return snapshot(pid), own_cpu_s(), time.perf_counter()

    def stop(self, pid: int, before: tuple[dict, float, float]) -> None:
        processes, client_s, begin = before
        used = seconds_by_process(processes, snapshot(pid))
        used[self.CLIENT] = own_cpu_s() - client_s
        for name, seconds in used.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds
        self.wall_s += time.perf_counter() - begin

    def cores(self) -> dict[str, float]:
        return _in_cores(self.cpu_s, max(self.wall_s, 1e-9))


def wait_until_idle(busy_below: float = 0.15, window_s: float = 0.25, timeout_s: float = 10.0
                    ) -> float:
    """Waits until the host's cores together are busy less than `busy_below` of one core over a
    `window_s` window (or `timeout_s` has passed); returns the seconds waited. A server whose
    round has just ended may keep a core spinning for a second (vLLM's CPU engine does), which
    the next server's round would otherwise pay for."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        before = _busy_s()
        if before is None:
            break
        time.sleep(window_s)
        after = _busy_s()
        if after is None or (after - before) / window_s < busy_below:
            break
    return time.monotonic() - start


def _busy_s() -> float | None:
    """Seconds this host's cores have spent running its own work (user, nice, system, irq,
    softirq; not idle, I/O wait, or time a hypervisor gave other guests), from /proc/stat."""
    try:
        fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields[:7]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = ticks
    return (user + nice + system + irq + softirq) / TICKS_PER_S


def _in_cores(seconds: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds per name as cores over `wall_s`, largest first, names that used none left out."""
    return dict(sorted(((n, s / wall_s) for n, s in seconds.items() if s > 0),
                       key=lambda item: -item[1]))


def _chain_to(pid: int, parents: dict[int, int], known: set[int]) -> set[int]:
    """`pid` and its ancestors below the first one in `known`; nothing if none is."""
    chain = []
    while pid not in known and pid in parents:
        chain.append(pid)
        pid = parents[pid]
    return set(chain) if pid in known else set()


def _stats() -> dict[int, list[str]]:
    """Every live process's /proc/PID/stat fields, read once."""
    out = {}
    for entry in PROC.glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            out[int(entry.name)] = fields
    return out


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime + stime


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat past the command name (which may hold spaces): state, ppid, ..."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _name(pid: int) -> str:
    """Ray's worker title (`ray::ServeReplica:app:Deployment`, `ray::ServeController`), else the
    program's name and, for Python, its script or module."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    argv = [a for a in argv if a]
    if not argv:
        return str(pid)
    if argv[0].startswith("ray::"):  # less the method it runs now, which changes
        return argv[0].split()[0].split(".")[0]
    program = Path(argv[0]).name
    if program.startswith("python"):
        rest = argv[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return f"{program} -m {rest[1]}"
        scripts = [a for a in rest if not a.startswith("-")]
        return f"{program} {Path(scripts[0]).name}" if scripts else program
    return program
