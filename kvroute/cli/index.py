"""``kvroute index ...``: the index as a person sees it (the same views as docs/index-schema.md's
redis-cli recipes), as tables or, with --json, as stable JSON for machines.

Exit status: 0 answered (an empty answer too, with a hint on stderr naming where it looked); 2 a
mistake, one line on stderr: a bad flag, a Redis that cannot be used or refuses the user (NOPERM),
a model with no registered worker."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from redis.exceptions import NoPermissionError, RedisError, ResponseError

from kvindex.errors import KVIndexError
from kvindex.hashing import sequence_hashes
from kvindex.keys import KeySchema
from kvindex.pages import PAGE_BLOCKS, pages_of
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings, add_redis_arguments, redact_url
from kvindex.types import WorkerRecord
from kvroute.bench.common import text_table
from kvroute.cli.argtypes import DefaultsShown, positive_int, token_ids
from kvroute.devstack.embedded_redis import redis_unusable, usable_redis_url
from kvservice.lifecycle import StartupError
from kvtokens.tokenizer import ModelPrompts, PromptError

WORKER_COLUMNS = ["model", "id", "engine_kind", "tier", "role", "url", "alive", "blocks", "block_size", "dp_rank"]
WORKER_COLUMNS += ["gid", "epoch"]
WORKER_COLUMNS += ["heartbeat_age_ms"]
WORKER_COLUMNS += ["running", "waiting", "kv_usage", "adapters"]
STATS_COLUMNS = ["model", "block_size", "workers", "alive_workers", "entries", "pages", "block_keys", "gids_pending_gc"]


def add_parser(commands: Any) -> None:
    index = commands.add_parser(
        "index", help="inspect the shared index", description=__doc__.split("\n\n")[0].replace("``", "'")
    )
    sub = index.add_subparsers(dest="index_command", metavar="VIEW", required=True)

    def view(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsShown)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(handler=handler, prog=p.prog)
        return p

    def with_redis(p: argparse.ArgumentParser) -> None:
        add_redis_arguments(p)

    def identity(p: argparse.ArgumentParser) -> None:
        prompt = p.add_mutually_exclusive_group(required=True)
        prompt.add_argument(
            "--tokens",
            type=token_ids,
            help="the prompt's token ids: 1,2,3 or [1,2,3] (an engine's POST /tokenize gives them: "
            "'tokens' in its answer); or --text",
        )
        prompt.add_argument("--text", help="the prompt as text, tokenized with --tokenizer (special tokens added)")
        p.add_argument("--tokenizer", metavar="DIR", help="a model directory with tokenizer.json, for --text")
        p.add_argument("--salt", help="the request's cache_salt")
        p.add_argument("--lora", help="the LoRA adapter name")

    p = view("hash", "block hashes of a token sequence (no Redis needed)", _run_hash)
    identity(p)
    p.add_argument("--block-size", type=positive_int, required=True, help="tokens per block (the engine's)")

    p = view("lookup", "who holds each block of a prompt, and each alive worker's match", _run_lookup)
    with_redis(p)
    p.add_argument("--model", required=True, help="the model whose workers to look in")
    identity(p)
    p.add_argument("--block-size", type=positive_int, help="default: the model's registered block size")

    p = view("workers", "registered workers, alive or not", _run_workers)
    with_redis(p)
    p.add_argument("--model", help="default: every model")

    p = view("stats", "size of the index per model", _run_stats)
    with_redis(p)
    p.add_argument("--model", help="default: every model")

    p = view("gc", "collect dead workers' entries now", _run_gc)
    with_redis(p)
    p.add_argument("--model", required=True, help="the model whose dead workers to collect")
    p.add_argument("--budget", type=positive_int, default=100_000, help="most entries to remove")
    p.add_argument("--grace-ms", type=int, default=30_000, help="how long past its TTL a worker counts as gone")


def _prompt_tokens(args: argparse.Namespace) -> list[int]:
    """--tokens, or --text tokenized with --tokenizer (a mistake: one line, exit 2)."""
    if args.text is None:
        return list(args.tokens)
    if args.tokenizer is None:
        raise StartupError("--text needs --tokenizer DIR (the model's directory with tokenizer.json)")
    try:
        return ModelPrompts(args.tokenizer).encode(args.text)
    except (OSError, ValueError, PromptError) as exc:
        raise StartupError(f"--tokenizer {args.tokenizer}: {exc}") from None


def _emit(args: argparse.Namespace, data: Any, table: Callable[[Any], str]) -> int:
    print(json.dumps(data) if args.json else table(data))
    return 0


def _settings(args: argparse.Namespace) -> RedisSettings:
    """The flags over KVROUTE_REDIS_URL / KVROUTE_PREFIX, checked as every kvroute process checks them."""
    try:
        return RedisSettings.from_args(args)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def _where(settings: RedisSettings) -> str:
    return f"under prefix {settings.prefix!r} on {redact_url(settings.url)}"


def _run_with_index(args: argparse.Namespace, body: Callable[[RedisIndex, RedisSettings], Awaitable[Any]]) -> Any:
    """Run ``body`` against the index. A Redis that cannot be used or refuses the user, and an
    index that cannot answer (an unknown model), are a :class:`StartupError` (one line, exit 2)."""
    settings = _settings(args)
    usable_redis_url(settings.url, settings)

    async def run() -> Any:
        client = settings.client()
        try:
            return await body(RedisIndex(client, KeySchema(settings.prefix)), settings)
        finally:
            await client.aclose()

    try:
        return asyncio.run(run())
    except ResponseError as exc:
        if not _denied(exc):
            raise redis_unusable(settings.url, exc) from None
        user = urlsplit(settings.url).username or "default"  # reached and logged in: this user may not do this
        raise StartupError(
            f"Redis refused user {user!r}: {exc} ({args.prog} needs a user allowed to run the index's "
            "scripts: the agent's or the admin one, docs/security.md)"
        ) from None
    except RedisError as exc:  # it went away while we read
        raise redis_unusable(settings.url, exc) from None
    except KVIndexError as exc:
        raise StartupError(str(exc)) from None


def _denied(error: ResponseError) -> bool:
    """Whether Redis refused a command for the user's rights (NOPERM, or a script's command that
    the calling user may not run), not for something else."""
    text = str(error)
    return isinstance(error, NoPermissionError) or "NOPERM" in text or "The user executing the script can't" in text


def _hint_if_empty(found: bool, what: str, settings: RedisSettings) -> None:
    """Nothing found is a valid answer, but mostly a wrong server or prefix: say where we looked."""
    if not found:
        print(f"no {what} found {_where(settings)} (is this the right --redis-url / --prefix?)", file=sys.stderr)


def _run_hash(args: argparse.Namespace) -> int:
    hashes = sequence_hashes(_prompt_tokens(args), args.block_size, lora_name=args.lora, cache_salt=args.salt)
    # the hashes are uint64: as numbers they lose precision in jq and JavaScript, hence hex strings too
    data = {"block_size": args.block_size, "hashes": hashes, "hashes_hex": [f"{h:016x}" for h in hashes]}
    rows = [[i, h, f"{h:016x}"] for i, h in enumerate(hashes)]
    return _emit(args, data, lambda _: text_table(["index", "hash", "hex"], rows))


def _run_lookup(args: argparse.Namespace) -> int:
    tokens = _prompt_tokens(args)

    async def body(index: RedisIndex, settings: RedisSettings) -> dict[str, Any]:
        block_size = args.block_size or await index.block_size(args.model)
        if block_size is None:
            raise KVIndexError(
                f"model {args.model!r} has no registered workers; pass --block-size "
                f"(looked {_where(settings)}: is this the right --redis-url / --prefix?)"
            )
        chain = sequence_hashes(tokens, block_size, lora_name=args.lora, cache_salt=args.salt)
        owners = await index.owners_of_chain(args.model, chain)
        matches = await index.match(args.model, chain)
        _hint_if_empty(bool(await index.workers(args.model)), f"workers of model {args.model!r}", settings)
        keys = index.keys(args.model)
        # Each block's holdings live in its page's segment key (docs/index-schema.md, "Pages, segments and buckets").
        segments = [keys.segment(page.segment) for page in pages_of(chain) for _ in range(page.length)]
        return {
            "model": args.model,
            "block_size": block_size,
            "blocks": [
                {
                    "index": i,
                    "hash": h,
                    "hash_hex": f"{h:016x}",  # uint64: exact in jq and JavaScript, where the number is not
                    "key": segments[i],
                    "page": i // PAGE_BLOCKS,
                    "owners": sorted(owners[i]),
                }
                for i, h in enumerate(chain)
            ],
            "workers": [
                {"id": w, "matched_blocks": m} for w, m in sorted(matches.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
        }

    def table(d: dict[str, Any]) -> str:
        blocks = text_table(
            ["block", "hash", "owners"],
            [[b["index"], f"{b['hash']:016x}", ",".join(b["owners"]) or "-"] for b in d["blocks"]],
        )
        workers = text_table(["worker", "matched_blocks"], [[w["id"], w["matched_blocks"]] for w in d["workers"]])
        return f"model {d['model']}, block size {d['block_size']}, {len(d['blocks'])} blocks\n\n{blocks}\n\n{workers}"

    return _emit(args, _run_with_index(args, body), table)


def _record_json(record: WorkerRecord) -> dict[str, Any]:
    load = record.load
    return {
        "id": record.worker_id,
        "model": record.model,
        "url": record.url,
        "alive": record.alive,
        "blocks": record.blocks,
        "block_size": record.block_size,
        "dp_rank": record.dp_rank,
        "gid": record.gid,
        "epoch": record.epoch,
        "heartbeat_age_ms": record.heartbeat_age_ms,
        "ttl_ms": record.ttl_ms,
        "running": load.running if load else None,
        "waiting": load.waiting if load else None,
        "kv_usage": load.kv_usage if load else None,
        "load_age_ms": record.load_age_ms,
        "adapters": list(record.adapters),  # the LoRA adapters its engine serves
        "tier": record.tier,  # GPU: the worker; CPU, DISK, REMOTE: a tier holder of tier_of (kvindex/tiers.py)
        "tier_of": record.tier_of,
        "role": record.role,  # both, prefill or decode (kvindex/roles.py)
        # a hybrid model's KV-cache groups (kvindex/groups.py), '' for one group
        "kv_groups": record.kv_groups,
        "max_model_len": record.max_model_len,  # its engine's context length (null: not known)
        "engine_kind": record.engine_kind,  # how its agent reads the engine (null: not said)
    }


def _models_in_view(args: argparse.Namespace) -> str:
    return f"workers of model {args.model!r}" if args.model else "workers"


def _run_workers(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex, settings: RedisSettings) -> list[dict[str, Any]]:
        models = [args.model] if args.model else await index.models()
        workers = [_record_json(r) for model in models for r in await index.workers(model)]
        _hint_if_empty(bool(workers), _models_in_view(args), settings)
        return workers

    def table(workers: list[dict[str, Any]]) -> str:
        rows = [[",".join(w[c]) if c == "adapters" else w[c] for c in WORKER_COLUMNS] for w in workers]
        return text_table(WORKER_COLUMNS, rows)

    return _emit(args, _run_with_index(args, body), table)


def _run_stats(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex, settings: RedisSettings) -> dict[str, Any]:
        models = [args.model] if args.model else await index.models()
        out = [vars(await index.stats(m)) for m in models]
        _hint_if_empty(any(s["workers"] for s in out), _models_in_view(args), settings)
        return {
            "models": [{k: v for k, v in s.items() if k != "extra"} for s in out],
            "redis": await index.server_memory(),
        }

    def table(d: dict[str, Any]) -> str:
        mem = d["redis"]
        return text_table(STATS_COLUMNS, [[s[c] for c in STATS_COLUMNS] for s in d["models"]]) + (
            f"\n\nRedis used_memory {mem['used_memory']} bytes, {mem['keys']} keys in the database"
        )

    return _emit(args, _run_with_index(args, body), table)


def _run_gc(args: argparse.Namespace) -> int:
    async def body(index: RedisIndex, settings: RedisSettings) -> dict[str, Any]:
        _hint_if_empty(bool(await index.workers(args.model)), f"workers of model {args.model!r}", settings)
        return vars(await index.gc(args.model, budget=args.budget, grace_ms=args.grace_ms))

    return _emit(args, _run_with_index(args, body), lambda d: text_table(list(d), [list(d.values())]))
