"""Reading the KV-event captures in tests/fixtures: each message's frames, from their hex dump."""

from __future__ import annotations

import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
_FRAME = re.compile(r"\s+frame\[\d+\] len=\d+ hex=([0-9a-f]*)$")


def sglang_messages(name: str, source: str = "live") -> list[list[bytes]]:
    """The frames of each ``source`` ("live" or "replay") message of tests/fixtures/sglang/<name>.txt.
    A replayed message is given as the agent's replay client passes it on: without the DEALER's
    leading empty frame, and without the end marker."""
    messages: list[list[bytes]] = []
    taking = False
    for line in (FIXTURES / "sglang" / f"{name}.txt").read_text().splitlines():
        if line.startswith("--- msg #"):
            taking = line.endswith(f" {source}")
            if taking:
                messages.append([])
        elif taking and (match := _FRAME.match(line)):
            messages[-1].append(bytes.fromhex(match.group(1)))
    if source == "replay":
        messages = [frames[1:] for frames in messages[:-1]]  # the last is the end marker
    return messages
