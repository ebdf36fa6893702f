"""A real headless Chromium for the web pages' tests: found on PATH (Debian's ``chromium``;
``.ci/run`` installs it), awaited so that a router in the test's own event loop keeps serving."""

from __future__ import annotations

import asyncio
import shutil

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
NO_BROWSER = "no chromium, chromium-browser or google-chrome on PATH (apt-get install chromium)"


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


async def chromium(browser: str, *args: str) -> str:
    # The router runs in this event loop: the browser must be awaited, never waited on blocking.
    # Any host but the router's resolves to nothing: the page may fetch nothing from the network.
    process = await asyncio.create_subprocess_exec(
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=10000",  # lets the page's fetches and rendering finish first
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()
