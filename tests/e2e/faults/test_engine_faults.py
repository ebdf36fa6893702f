"""Engines that misbehave without dying: KV-event messages lost on the way (sequence gaps the
agent repairs from the replay buffer), and /metrics pages with +Inf, NaN or text where numbers
belong (the worker stays registered and routable)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.e2e.faults.measure import MODEL, Scene, open_scene
from tests.support import ROOT, wait_until
from tests.support.traffic import BLOCK

pytestmark = pytest.mark.faults


KINDS = {"vllm": (), "vllm_and_sglang": ("vllm", "sglang", "sglang"), "trtllm": ("trtllm",) * 3}


@pytest.mark.parametrize("fleet", list(KINDS))
async def test_dropped_kv_event_messages(redis_server, fleet):
    """Every third batch lost on the way. vLLM and SGLang replay them: the index ends equal to
    what the engines hold. TensorRT-LLM cannot (no replay, no snapshot): each gap rebuilds the
    worker from new events, so the index lists too few (blocks the engine still holds and does not
    store again are not indexed) and never credits a block the engine does not hold."""
    async with open_scene(redis_server, engine_kinds=KINDS[fleet]) as scene:
        engines = [running.faults for running in scene.fleet.engines]
        for faults in engines:
            faults.drop_events_every = 3
        await scene.prime()
        await scene.traffic.progressed(60)
        for faults in engines:
            faults.drop_events_every = 0
        since = time.monotonic()
        await publish_once_more(scene)
        recovery = await scene.recover(since)
        gaps = [int(await agent.metric("kvroute_agent_gaps_total")) for agent in scene.fleet.agents]
        resyncs = [int(await agent.metric("kvroute_agent_resyncs_total")) for agent in scene.fleet.agents]
        dropped = [f.events_dropped for f in engines]
        name = "zmq_messages_dropped" if fleet == "vllm" else f"kv_events_dropped_{fleet}"
        figures = scene.figures(name, [recovery], batches_dropped=sum(dropped), gaps=sum(gaps), resyncs=sum(resyncs))
        assert sum(dropped) > 0 and gaps == dropped  # drops are never consecutive: one gap each
        if fleet == "trtllm":
            assert resyncs == gaps and figures.wrong_credits == 0 and figures.failed == 0, figures.line()
        else:
            scene.check(figures, [recovery])


async def publish_once_more(scene: Scene) -> None:
    """A new prompt straight to each engine: a batch after the last dropped one, which is how a
    subscriber learns of the loss (a lost last message shows only when the next one comes)."""
    for i, engine in enumerate(scene.fleet.engines):
        body = {"model": MODEL, "prompt": [7 + i] * (2 * BLOCK + 1), "max_tokens": 1}
        async with scene.session.post(engine.url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()


def gauges_set_to(value: str, *names: str) -> Callable[[str], str]:
    pattern = re.compile(rf"^((?:{'|'.join(map(re.escape, names))})(?:\{{[^}}]*\}})?) \S+$", re.M)
    return lambda text: pattern.sub(lambda m: f"{m.group(1)} {value}", text)


GARBAGE = [
    gauges_set_to("+Inf", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
    gauges_set_to("NaN", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    lambda _: "<html>502 Bad Gateway</html>\nvllm:num_requests_running lots\n",
]
SCRAPES = 20  # the agent reads /metrics every 250 ms: 5 s of garbage, longer than the 3 s TTL


async def test_engine_metrics_garbage(redis_server):
    async with open_scene(redis_server) as scene:
        engines = [running.faults for running in scene.fleet.engines]
        await scene.prime()
        for faults, rewrite in zip(engines, GARBAGE, strict=True):
            faults.metrics_rewrite = rewrite

        async def scraped() -> bool:
            return all(f.metrics_rewritten >= SCRAPES for f in engines)

        await wait_until(scraped, 30)
        recovery = await scene.recover(time.monotonic())  # with the garbage still served: ~0 if never lost
        assert all(agent.process.poll() is None for agent in scene.fleet.agents), "an agent died"
        await scene.traffic.pause()
        await scene.prime()  # again: the traffic of the garbage phase may have evicted them (LRU)

        async def probes_routed_to_holders() -> bool:
            """The agents have indexed the probes again, garbage metrics and all."""
            for k, probe in enumerate(scene.probes):
                body = {"model": MODEL, "prompt": [*probe, 9]}
                async with scene.session.post(scene.router_urls[0] + "/debug/route", json=body) as response:
                    if (await response.json())["chosen"] != scene.worker(k % 3):
                        return False
            return True

        await wait_until(probes_routed_to_holders, 15, interval=0.1)
        chosen = []
        for k, probe in enumerate(scene.probes):  # each probe goes to the worker that holds it
            body = {"model": MODEL, "prompt": [*probe, 9], "max_tokens": 1}
            async with scene.session.post(scene.router_urls[0] + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                chosen.append(response.headers["x-kvroute-worker"] == scene.worker(k % 3))
        figures = scene.figures("engine_metrics_garbage", [recovery], probes_to_holder=f"{sum(chosen)}/{len(chosen)}")
        scene.check(figures, [recovery])
        assert all(chosen), chosen


def test_a_negative_drop_events_every_is_refused_in_one_line():
    command = [sys.executable, "-m", "sim_engine", "--port", "0", "--drop-events-every", "-1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "error: --drop-events-every must be >= 0 (0: drop none), got -1 (" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr
