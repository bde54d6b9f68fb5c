"""The kernels' own threads (``engine/native/pool.c``) and when they spin
(``engine/native/threads.py``): numbers never depend on the threads, their number or their
spin; callers on several threads, or in a forked child, get theirs; the gate spins for decode
steps only while the machine has a CPU to spare."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.engine import SamplingParams, native, observability
from kvcellar.engine.native import threads
from kvcellar.quantization import quantize_int4, quantize_int8
from tests._models import chat_ids, make_engine

needs_native = pytest.mark.skipif(not native.available(), reason="kvcellar's kernels cannot be built on this machine")


def _weights() -> tuple[Any, Any, Any]:
    """Two int4 linears kept as panels (called together, as a layer's gate and up) and an
    int8 one, each large enough that a loop is shared with the workers."""
    gen = torch.Generator().manual_seed(0)
    panels = []
    for out in (512, 264):
        q = quantize_int4(torch.randn(out, 1024, generator=gen) * 0.05)
        assert q.offsets is not None
        panels.append(native.pack_int4(q.qweight, q.scales.half(), q.offsets.half(), 1))
    q8 = quantize_int8(torch.randn(2048, 1024, generator=gen) * 0.05)
    return native.Int4Group(panels, panels=True), panels[0], q8


def _run(weights: tuple[Any, Any, Any], x: torch.Tensor, n: int) -> list[torch.Tensor]:
    group, one, q8 = weights
    nibbles, scales, offsets = one
    return [*group(x, n), native.matmul_int4(x, nibbles, scales, offsets, n, panels=True),
            native.matmul_int8(x, q8.qweight, q8.scales, n)]


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_the_numbers_are_the_same_on_any_threads_spinning_or_not(rows: int) -> None:
    weights = _weights()
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
    alone = _run(weights, x, 1)
    loops, joined, _ = threads.counts()
    try:
        for spin in (0, threads.SPIN_US):
            threads.set_spin(spin)
            for n in (2, 3, 5):  # more threads than this machine's CPUs too
                for got, want in zip(_run(weights, x, n), alone, strict=True):
                    assert torch.equal(got, want), (spin, n)
        assert threads.counts()[0] > loops  # the loops were shared with workers
        # and a worker takes part sooner or later (a loop this small may be over before one wakes)
        deadline = time.monotonic() + 60
        while threads.counts()[1] == joined and time.monotonic() < deadline:
            _run(weights, x, 2)
        assert threads.counts()[1] > joined
    finally:
        threads.set_spin(0)


@needs_native
def test_callers_on_several_threads_at_once_each_get_their_numbers() -> None:
    """One loop runs on the workers at a time; a call meanwhile runs alone on its own thread."""
    weights = _weights()
    inputs = [torch.randn(4, 1024, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    wanted = [_run(weights, x, 1) for x in inputs]
    failures: list[str] = []

    def caller(i: int) -> None:
        for _ in range(20):
            for got, want in zip(_run(weights, inputs[i], 2), wanted[i], strict=True):
                if not torch.equal(got, want):
                    failures.append(f"caller {i}")
                    return

    threads.set_spin(threads.SPIN_US)
    try:
        callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in callers)
    finally:
        threads.set_spin(0)
    assert failures == []


@needs_native
def test_a_forked_child_runs_the_kernels_on_workers_of_its_own(tmp_path: Path) -> None:
    weights = _weights()
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(1))
    wanted = _run(weights, x, 2)  # the parent's workers exist now
    target = tmp_path / "child.pt"
    pid = os.fork()
    if pid == 0:  # the child: its workers are not the parent's
        code = 1
        try:
            before = threads.counts()[0]
            torch.save(_run(weights, x, 2), target)
            code = 0 if threads.counts()[0] > before else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for got, want in zip(torch.load(target), wanted, strict=True):
        assert torch.equal(got, want)


class _Machine:
    """/proc/stat and /proc/self/stat as files this test writes: the machine's busy ticks and
    this process's, at 100 ticks a second a CPU."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc_stat, self.self_stat = tmp_path / "stat", tmp_path / "self_stat"
        self.now = 0.0
        self.machine = self.own = 0
        self.write()

    def write(self) -> None:
        self.proc_stat.write_text(f"cpu  {self.machine} 0 0 99999 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")
        self.self_stat.write_text(f"42 (python (x) y) S {' '.join(['0'] * 10)} {self.own} 0 0 0\n")

    def run(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.now += seconds
        self.own += round(own_cpus * seconds * 100)
        self.machine += round((own_cpus + other_cpus) * seconds * 100)
        self.write()

    def gate(self, mode: str = "auto") -> threads.SpinGate:
        gate = threads.SpinGate(mode, cpus=2, proc_stat=self.proc_stat, self_stat=self.self_stat,
                                clock=lambda: self.now, quota=math.inf)
        gate.hz = 100
        return gate


@needs_native
def test_the_gate_runs_decode_steps_on_the_cpus_the_machine_leaves_and_spins_there(tmp_path: Path) -> None:
    machine = _Machine(tmp_path)
    gate = machine.gate()
    try:
        assert gate.step(True, 2) == 1 and not gate.spinning  # nothing measured yet: one thread
        machine.run(0.6, own_cpus=1.2, other_cpus=0.1)  # a client and an idle process beside it
        assert gate.step(True, 2) == 2 and gate.spinning
        assert gate.step(False, 2) == 2 and not gate.spinning  # a prefill step: every thread, no spin
        assert gate.step(True, 1) == 1 and not gate.spinning  # no workers to spin
        machine.run(threads.INTERVAL / 2, own_cpus=1.0, other_cpus=1.0)  # a busy process starts
        assert gate.step(True, 2) == 2  # read again only after INTERVAL seconds
        machine.run(threads.INTERVAL, own_cpus=1.0, other_cpus=1.0)
        assert gate.step(True, 2) == 1 and not gate.spinning  # a second thread would wait for a CPU
        assert gate.step(False, 2) == 2  # prefill keeps its threads
        machine.run(2.0, own_cpus=1.0, other_cpus=0.9)  # still busy
        assert gate.step(True, 2) == 1 and not gate.spinning
        machine.run(1.0, own_cpus=2.0, other_cpus=0.05)  # it stopped
        assert gate.step(True, 2) == 2 and gate.spinning
        (tmp_path / "big").mkdir()
        big = _Machine(tmp_path / "big")
        wide = threads.SpinGate("auto", cpus=16, proc_stat=big.proc_stat, self_stat=big.self_stat,
                                clock=lambda: big.now, quota=math.inf)
        wide.hz = 100
        wide.step(True, 16)
        big.run(1.0, own_cpus=12.0, other_cpus=3.5)  # 12.5 CPUs left: 12 threads, spinning
        assert wide.step(True, 16) == 12 and wide.spinning
    finally:
        threads.set_spin(0)


@needs_native
def test_under_a_cpu_quota_without_room_for_the_servers_other_threads_the_workers_do_not_spin(
        tmp_path: Path) -> None:
    """A process over its cgroup quota stops until the next period: spinning workers would take
    the room the server's other threads need."""
    machine = _Machine(tmp_path)
    try:
        for quota, spins in ((2.0, False), (2.5, True), (math.inf, True)):
            gate = machine.gate()
            gate.quota = quota
            machine.run(1.0, own_cpus=1.0, other_cpus=0.0)
            assert gate.step(True, 2) == 2 and gate.spinning == spins, quota
        (tmp_path / "cpu.max").write_text("200000 100000\n")
        assert threads.cpu_quota(tmp_path / "cpu.max", tmp_path / "none") == 2.0
        (tmp_path / "cpu.max").write_text("max 100000\n")
        assert threads.cpu_quota(tmp_path / "cpu.max", tmp_path / "none") is None
        (tmp_path / "v1").mkdir()
        (tmp_path / "v1" / "cpu.cfs_quota_us").write_text("150000\n")
        (tmp_path / "v1" / "cpu.cfs_period_us").write_text("100000\n")
        assert threads.cpu_quota(tmp_path / "none", tmp_path / "v1" / "cpu.cfs_quota_us") == 1.5
        (tmp_path / "v1" / "cpu.cfs_quota_us").write_text("-1\n")
        assert threads.cpu_quota(tmp_path / "none", tmp_path / "v1" / "cpu.cfs_quota_us") is None
    finally:
        threads.set_spin(0)


@needs_native
def test_the_gate_can_be_set_on_or_off_and_runs_one_thread_where_it_cannot_read(tmp_path: Path) -> None:
    machine = _Machine(tmp_path)
    try:
        on, off = machine.gate("on"), machine.gate("off")
        assert on.step(True, 2) == 2 and on.spinning
        assert on.step(False, 2) == 2 and not on.spinning
        machine.run(1.0, own_cpus=1.0, other_cpus=1.0)
        assert on.step(True, 2) == 2 and on.spinning  # on: whatever the others do
        assert off.step(True, 2) == 2 and not off.spinning
        blind = threads.SpinGate("auto", cpus=2, proc_stat=tmp_path / "missing", self_stat=machine.self_stat)
        assert blind.step(True, 2) == 1 and not blind.spinning
        assert blind.step(False, 2) == 2
        with blind.forced("on"):  # warm-up measures decode threads as they run uncontended
            assert blind.step(True, 2) == 2 and blind.spinning
        assert blind.step(True, 2) == 1 and not blind.spinning
    finally:
        threads.set_spin(0)


@needs_native
def test_outputs_do_not_depend_on_the_threads_spin(model: Any) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompts = [chat_ids(model, q) for q in ("Name a colour.", "Why is the sky blue?")]
        results = {}
        for spin in ("on", "off"):
            engine = make_engine(model, decode_threads=2, thread_spin=spin)
            results[spin] = [r.token_ids for r in engine.generate(prompts, greedy)]
            assert observability.snapshot(engine)["runner_spinning"] == int(spin == "on")  # the last step: a decode
        assert results["on"] == results["off"]
    finally:
        threads.set_spin(0)
        torch.set_num_threads(before)
