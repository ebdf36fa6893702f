"""Simulated engines that share their compute (sim_engine/shared_compute.py): real files, real
processes' ids, the event loop's clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from sim_engine.shared_compute import SharedCompute


async def _timed(*engines_and_seconds: tuple[SharedCompute, float]) -> list[float]:
    async def one(engine: SharedCompute, seconds: float) -> float:
        started = time.perf_counter()
        await engine.compute(seconds)
        return time.perf_counter() - started

    return await asyncio.gather(*(one(e, s) for e, s in engines_and_seconds))


async def test_engines_computing_at_once_on_one_core_take_as_long_as_all_their_work(tmp_path):
    engines = [SharedCompute(tmp_path, cores=1) for _ in range(4)]
    alone = (await _timed((engines[0], 0.05)))[0]
    together = await _timed(*((e, 0.05) for e in engines))
    assert alone == pytest.approx(0.05, abs=0.02)
    assert min(together) > 0.15  # four steps of 50 ms on one core: ~200 ms each
    assert not list(tmp_path.iterdir())  # no engine left marked busy


async def test_as_many_cores_as_engines_leave_each_its_own(tmp_path):
    engines = [SharedCompute(tmp_path, cores=2) for _ in range(2)]
    assert max(await _timed(*((e, 0.05) for e in engines))) < 0.08


async def test_a_marker_of_a_process_gone_is_not_counted(tmp_path):
    (tmp_path / "999999999.0").touch()  # no such process
    engine = SharedCompute(tmp_path, cores=1)
    assert engine.computing() == 0 and not (tmp_path / "999999999.0").exists()


def test_shared_cores_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="> 0"):
        SharedCompute(tmp_path, cores=0)
