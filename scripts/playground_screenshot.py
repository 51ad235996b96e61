"""The README's picture of the playground: ``seedance serve`` (the embedded model), a short chat
in headless Chromium, a screenshot into docs/images/playground.png.

    .venv/bin/python scripts/playground_screenshot.py [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.async_api import async_playwright

PROMPTS = ("Write a Python function that reverses a string, in a code block.",)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def shoot(url: str, out: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium is not installed (Debian package chromium)")
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1200, "height": 760})
        await page.goto(url)
        await page.locator("#state.ok").wait_for()
        await page.fill("#temperature", "0")
        for prompt in PROMPTS:
            await page.fill("#prompt", prompt)
            await page.press("#prompt", "Enter")
            await page.locator(".msg.assistant[data-state=done]").last.wait_for(timeout=120_000)
        await asyncio.sleep(2.5)  # a heartbeat or two more for the RTT figure
        out.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(out))
        await browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images/playground.png"))
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "seedance"), "serve", "--port", str(port)]
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit("seedance serve did not start")
                time.sleep(0.2)
        asyncio.run(shoot(f"http://127.0.0.1:{port}/", args.out))
    finally:
        server.terminate()
        server.wait(30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
