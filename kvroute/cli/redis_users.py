"""``kvroute redis acl``: the ACL SETUSER commands of a least-privilege user (docs/security.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvindex.acl import ROLES, acl_commands
from kvindex.keys import DEFAULT_PREFIX
from kvindex.settings import read_secret_file
from kvservice.lifecycle import StartupError


def add_parser(commands: Any) -> None:
    redis = commands.add_parser(
        "redis", help="Redis set-up: least-privilege users", description=__doc__.replace("``", "'")
    )
    sub = redis.add_subparsers(dest="redis_command", metavar="ACTION", required=True)
    p = sub.add_parser(
        "acl",
        help="print the ACL SETUSER commands of a router, agent or admin user",
        description="Print redis-cli-ready commands, one a line, that create (or replace) a user with the rights "
        "of a role: router (reads the index, writes only the routers' shared state), agent (writes ownership and "
        "worker records), admin (everything). The password is printed only as its SHA-256. "
        "Apply them with: kvroute redis acl ... | redis-cli -h HOST -p PORT --user admin --askpass",
    )
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--user", required=True, help="the Redis user name")
    secret = p.add_mutually_exclusive_group(required=True)
    secret.add_argument("--password", help="the user's password (prefer --password-file: flags show in ps)")
    secret.add_argument("--password-file", help="read the password from this file's first line")
    p.add_argument("--prefix", help=f"index key prefix (env KVROUTE_PREFIX; default {DEFAULT_PREFIX})")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        help="limit the keys to this model (repeatable; default: every model of the prefix)",
    )
    p.add_argument("--aclfile", action="store_true", help="print lines of a Redis ACL file (user NAME RULES) instead")
    p.set_defaults(handler=_run_acl, prog=p.prog)


def _run_acl(args: argparse.Namespace) -> int:
    try:
        password = args.password
        if args.password_file is not None:
            password = read_secret_file(args.password_file, "--password-file")
        prefix = args.prefix or os.environ.get("KVROUTE_PREFIX") or DEFAULT_PREFIX
        lines = acl_commands(args.role, args.user, password, prefix, args.model, args.aclfile)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    for line in lines:
        print(line)
    return 0
