"""compose.yaml is consistent with our command-line parsers (no Docker here to run it).

Every kvroute command in it must parse and validate exactly as the CLI would; every agent must
point at an engine service of its profile, at that engine's HTTP port and KV-event endpoints;
Redis URLs name the redis service; published ports are unique; variables have defaults.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvroute.cli import build_parser
from router.settings import settings_from_args as router_settings
from sim_engine.settings import settings_from_args as sim_settings
from worker_agent.settings import settings_from_args as agent_settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
SERVICES = yaml.safe_load(COMPOSE.read_text())["services"]


def kvroute_services() -> list[str]:
    return [name for name, s in SERVICES.items() if s.get("command", [None])[0] == "kvroute"]


def parsed(name: str):
    command = SERVICES[name]["command"]
    try:
        return build_parser().parse_args(command[1:])
    except SystemExit as exc:  # argparse rejected it
        pytest.fail(f"{name}: {' '.join(command)} is rejected by the CLI ({exc})")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def engine_endpoints(name: str) -> tuple[int, int, int, str]:
    """(http port, events port, replay port, topic) of an engine service."""
    command = SERVICES[name]["command"]
    if name.startswith("vllm-"):
        config = json.loads(flag(command, "--kv-events-config"))
        assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
        return (
            int(flag(command, "--port")),
            int(config["endpoint"].rsplit(":", 1)[1]),
            int(config["replay_endpoint"].rsplit(":", 1)[1]),
            config["topic"],
        )
    return (
        int(flag(command, "--port")),
        int(flag(command, "--events-endpoint").rsplit(":", 1)[1]),
        int(flag(command, "--replay-endpoint").rsplit(":", 1)[1]),
        flag(command, "--topic"),
    )


@pytest.mark.parametrize("name", kvroute_services())
def test_every_kvroute_command_is_accepted_by_its_parser(name):
    args = parsed(name)
    if args.command == "router":
        settings = router_settings(args, env={})
        assert urlsplit(settings.redis.url).hostname == "redis"
    elif args.command == "agent":
        settings = agent_settings(args, env={})
        assert urlsplit(settings.redis.url).hostname == "redis"
    else:
        assert args.command == "sim-engine"
        sim_settings(args)


@pytest.mark.parametrize("name", [n for n in kvroute_services() if SERVICES[n]["command"][1] == "agent"])
def test_each_agent_points_at_an_engine_of_its_profile(name):
    command = SERVICES[name]["command"]
    engine_url = urlsplit(flag(command, "--engine-url"))
    engine = engine_url.hostname
    assert engine in SERVICES and set(SERVICES[name]["profiles"]) <= set(SERVICES[engine]["profiles"])
    http_port, events_port, replay_port, topic = engine_endpoints(engine)
    assert engine_url.port == http_port
    assert flag(command, "--events") == f"tcp://{engine}:{events_port}"
    assert flag(command, "--replay") == f"tcp://{engine}:{replay_port}"
    assert flag(command, "--topic") == topic


def test_every_engine_has_one_agent():
    engines = [n for n in SERVICES if n.startswith(("vllm-", "sim-")) and not n.startswith("sim-agent")]
    followed = [
        urlsplit(flag(SERVICES[n]["command"], "--engine-url")).hostname
        for n in kvroute_services()
        if SERVICES[n]["command"][1] == "agent"
    ]
    assert sorted(followed) == sorted(engines)


def test_published_ports_are_unique_and_variables_have_defaults():
    published = [p.split(":")[0] for s in SERVICES.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published))
    for variable in re.findall(r"\$\{([^}]*)\}", COMPOSE.read_text()):
        assert ":-" in variable, f"${{{variable}}} has no default"


def test_long_running_services_have_health_checks_and_restart_policies():
    for name, service in SERVICES.items():
        assert "healthcheck" in service, name
        assert service.get("restart") == "unless-stopped", name
