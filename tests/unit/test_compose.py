"""compose.yaml is consistent with our command-line parsers (no Docker here to run it).

Every kvroute command in it must parse and validate exactly as the CLI would; every agent must
point at an engine service of its profile, at that engine's HTTP port and KV-event endpoints;
Redis URLs name the redis service; published ports are unique; variables have defaults.
Security (docs/security.md): Redis is not published on the host; routers and agents log in as
their own ACL users with passwords from compose secrets; routers take their API keys from a secret.
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
from tests.support import ROOT
from worker_agent.settings import settings_from_args as agent_settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
DOCUMENT = yaml.safe_load(COMPOSE.read_text())
SERVICES = DOCUMENT["services"]
SECRETS = "/run/secrets/"


def kvroute_services() -> list[str]:
    return [name for name, s in SERVICES.items() if s.get("command", [None])[0] == "kvroute"]


def parsed(name: str, secrets_dir: Path | None = None):
    """The service's command parsed by the CLI; secret paths point into ``secrets_dir``, where a
    file stands in for each secret (compose mounts them under /run/secrets/)."""
    command = SERVICES[name]["command"]
    if secrets_dir is not None:
        for word in command:
            if word.startswith(SECRETS):
                (secrets_dir / word.removeprefix(SECRETS)).write_text("a-secret\n")
        command = [str(secrets_dir / w.removeprefix(SECRETS)) if w.startswith(SECRETS) else w for w in command]
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
def test_every_kvroute_command_is_accepted_by_its_parser(name, tmp_path):
    args = parsed(name, tmp_path)
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
    for variable in re.findall(r"(?<!\$)\$\{([^}]*)\}", COMPOSE.read_text()):  # not $${shell}
        assert ":-" in variable, f"${{{variable}}} has no default"


def test_long_running_services_have_health_checks_and_restart_policies():
    for name, service in SERVICES.items():
        if service.get("restart") == "no":  # one-shot set-up: whoever needs it waits for it to finish
            waiting = [s for s in SERVICES.values() if name in s.get("depends_on", {})]
            assert waiting, name
            assert all(s["depends_on"][name]["condition"] == "service_completed_successfully" for s in waiting)
            continue
        assert "healthcheck" in service, name
        assert service.get("restart") == "unless-stopped", name


def test_redis_is_not_published_and_accepts_only_its_acl_users():
    redis = SERVICES["redis"]
    assert "ports" not in redis and "network_mode" not in redis
    command = redis["command"]
    assert flag(command, "--aclfile") == "/acl/users.acl"
    assert "--requirepass" not in command
    setup = SERVICES["redis-acl"]
    script = setup["command"][0]
    assert "user default off" in script  # no login without a user
    for role in ("router", "agent", "admin"):
        assert f"redis_{role}_password" in setup["secrets"]
    assert (
        "kvroute redis acl --aclfile --role $$role --user $$role --password-file /run/secrets/redis_$${role}_password"
        in script
    )
    assert "redis-cli --user admin" in redis["healthcheck"]["test"][1]


@pytest.mark.parametrize("name", kvroute_services())
def test_routers_and_agents_log_in_as_their_own_user_with_secrets_from_files(name, tmp_path):
    service = SERVICES[name]
    command = service["command"]
    role = command[1]
    if role == "sim-engine":
        return
    assert role in ("router", "agent")
    assert urlsplit(flag(command, "--redis-url")).username == role
    password_file = flag(command, "--redis-password-file")
    assert password_file == f"{SECRETS}redis_{role}_password"
    assert f"redis_{role}_password" in service["secrets"]
    assert not any("password" in w.lower() and w.startswith(("redis://", "rediss://")) for w in command)
    if role == "router":
        assert flag(command, "--api-key-file") == f"{SECRETS}router_api_keys"
        assert "router_api_keys" in service["secrets"]
        assert router_settings(parsed(name, tmp_path), env={}).api_keys == {"a-secret"}
    settings = (router_settings if role == "router" else agent_settings)(parsed(name, tmp_path), env={})
    assert settings.redis.password == "a-secret"


def test_secrets_are_files_made_by_the_one_start_command_and_never_committed():
    secrets = DOCUMENT["secrets"]
    assert set(secrets) == {"redis_router_password", "redis_agent_password", "redis_admin_password", "router_api_keys"}
    root = COMPOSE.parent
    create = (root / "secrets" / "create.sh").read_text()
    for secret in secrets.values():
        path = secret["file"]
        assert path.startswith("./secrets/")
        assert path.removeprefix("./secrets/") in create
    ignored = (root / "secrets" / ".gitignore").read_text().split()
    assert ignored[0] == "*" and set(ignored[1:]) == {"!.gitignore", "!create.sh"}
    assert "./secrets/create.sh && docker compose --profile sim up" in COMPOSE.read_text()


def test_the_image_copies_every_package_the_wheel_ships():
    """A wheel built from the image's files must import: every package pyproject.toml ships, and
    the Lua scripts, are copied (kvservice was missing, and every command failed in the image)."""
    import tomllib

    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and len(line.split()) == 3
    }
    assert set(shipped["packages"]) | set(shipped["force-include"]) <= copied


def test_the_image_runs_as_a_user_of_its_own():
    """No USER line: every service ran as root, though secrets/create.sh says they read their
    secrets as their own users. The last USER wins, after the install, and is not root."""
    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    users = [n for n, words in enumerate(lines) if words[:1] == ["USER"]]
    install = max(n for n, words in enumerate(lines) if words[:3] == ["RUN", "pip", "install"])
    assert users and users[-1] > install, "the Dockerfile has no USER after the install"
    assert lines[users[-1]][1] not in {"root", "0"}
