"""The kernels' threads (``pool.c``): whether their workers spin between a decode step's loops.

A decode step runs a few kernel loops a layer with a little Python between them. A worker that
sleeps between loops must be woken for each (on a VM, an idle vCPU brought back), and the
step's thread waits on it or does the loop alone; one that spins is there at once. Spinning
pays only while there is a CPU for every thread that wants one: beside a busy process a
spinning worker takes the CPU the step's own thread needs (docs/performance.md has the
figures). So ``SpinGate`` spins for decode steps only, and only on the CPUs the machine leaves
free: every ``INTERVAL`` seconds of decoding it reads the CPU time the whole machine spent
(``/proc/stat``) and this process spent (``/proc/self/stat``), and runs a decode step on no
more threads than the CPUs the other processes left (their share rounded down, ``SPARE``
forgiven), spinning if that is more than one and a container's CPU quota leaves room for the
server's other threads. Beside a busy process on two CPUs a step then runs on one thread, as
fast as it can there: a second would wait for a CPU and hold the step at every loop's end.
(Counting runnable threads at a step's start does not work: the previous token is on its way
to the client then.) Prefill steps never spin: their loops are long, and torch runs its
operations between them on every CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvcellar.engine.native import lib

# How long a worker spins for the next loop before it sleeps: longer than a decode step's
# gaps between loops, short enough that a worker left spinning after a step costs little.
SPIN_US = 1000
# Seconds of decoding between two readings of the CPU time spent, and the share of a CPU the
# other processes may take and still leave it free.
INTERVAL = 0.5
SPARE = 0.25
PROC_STAT = Path("/proc/stat")
SELF_STAT = Path("/proc/self/stat")
# A container's CPU quota (cgroup v2, then v1), as its own namespace shows it.
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CFS_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
# CPUs' worth a quota must leave beyond the kernels' threads for workers to spin: the server's
# other threads (HTTP, tiers) run too, and a process over its quota stops until the next period.
QUOTA_ROOM = 0.5


# The spin last set (the pool's is one for the process, whichever gate set it).
_spin_us = 0


def set_spin(microseconds: int) -> None:
    """Workers spin this long for the next loop before sleeping (0: sleep at once)."""
    global _spin_us
    if lib.available():
        lib.call("kvc_pool_spin", microseconds=microseconds)
        _spin_us = microseconds


def spinning() -> bool:
    return _spin_us > 0


def counts() -> tuple[int, int, int]:
    """Loops shared with workers, loops a worker joined, times a worker went to sleep."""
    out = (ctypes.c_int64 * 3)()
    if lib.available():
        lib.call("kvc_pool_counts", out=ctypes.addressof(out))
    return out[0], out[1], out[2]


def machine_ticks(path: Path = PROC_STAT) -> int | None:
    """Clock ticks every CPU of the machine spent busy (idle and waiting for I/O not counted)."""
    try:
        fields = path.read_text().split("\n", 1)[0].split()
        if fields[0] != "cpu":
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    except (OSError, ValueError, IndexError):
        return None
    return user + nice + system + irq + softirq + steal


def own_ticks(path: Path = SELF_STAT) -> int | None:
    """Clock ticks this process's threads spent (user and system)."""
    try:
        fields = path.read_text().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None


def cpu_quota(cpu_max: Path = CPU_MAX, cfs_quota: Path = CFS_QUOTA) -> float | None:
    """The CPUs a cgroup quota allows this process (None: no quota, or none readable)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(cfs_quota.read_text())
        period_us = int((cfs_quota.parent / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


class SpinGate:
    """Per step, the threads the kernels run on and whether they spin (``mode`` on / off, or
    auto: see the module; ``EngineConfig.thread_spin``)."""

    def __init__(self, mode: str, cpus: int | None = None, proc_stat: Path = PROC_STAT,
                 self_stat: Path = SELF_STAT, clock: Callable[[], float] = time.monotonic,
                 quota: float | None = None) -> None:
        """``quota``: the CPUs a cgroup quota allows (None: read, ``cpu_quota``; inf: none)."""
        self.mode = mode
        self.quota = cpu_quota() if quota is None else quota
        self.cpus = cpus or os.cpu_count() or 1
        self.proc_stat, self.self_stat, self.clock = proc_stat, self_stat, clock
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        # auto: CPUs the other processes left over the last interval; one until a first interval
        # is measured (the first reading is taken now)
        self.free = 1
        self.last: tuple[float, int, int] | None = None  # (time, machine ticks, own ticks) of the last reading
        self.usable = lib.available()
        if mode == "auto" and self.usable:
            self._free()

    @property
    def spinning(self) -> bool:
        return spinning()

    @contextlib.contextmanager
    def forced(self, mode: str) -> Iterator[None]:
        """Run steps under ``mode`` for a while (warm-up measures threads as they run uncontended)."""
        before, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = before

    def step(self, decode: bool, threads: int) -> int:
        """Set the workers' spin for a step (``decode``: at most a few tokens a sequence) that would
        run the kernels on ``threads`` threads; the threads it runs them on (auto: a decode step on
        no more than the CPUs other processes leave, so a step does not wait on a thread that has
        no CPU)."""
        quota_room = True
        if decode and self.mode == "auto" and self.usable:
            threads = min(threads, self._free())
            quota_room = self.quota is None or self.quota >= threads + QUOTA_ROOM
        spin = decode and threads > 1 and self.usable and self.mode != "off" and quota_room
        if spin != spinning():
            set_spin(SPIN_US if spin else 0)
        return threads

    def reading(self) -> tuple[float, int, int] | None:
        """(time, the machine's busy ticks, this process's), or None where they cannot be read."""
        machine, own = machine_ticks(self.proc_stat), own_ticks(self.self_stat)
        return None if machine is None or own is None else (self.clock(), machine, own)

    def others(self, since: tuple[float, int, int], until: tuple[float, int, int]) -> float:
        """CPUs' worth of time other processes took between two readings."""
        seconds = max(until[0] - since[0], 1e-9)
        return max(0, (until[1] - since[1]) - (until[2] - since[2])) / self.hz / seconds

    def _free(self) -> int:
        if self.last is not None and self.clock() - self.last[0] < INTERVAL:
            return self.free
        now = self.reading()
        if now is None:
            self.free = 1  # blind: no worker to wait on, none spinning
            return self.free
        if self.last is not None:
            # an interval long after the last (prefill or idle in between) still says who else ran
            self.free = max(1, min(self.cpus, int(self.cpus - self.others(self.last, now) + SPARE)))
        self.last = now
        return self.free
