"""A real headless Chromium (Debian's ``chromium``, which ``.ci/run`` installs) driven by
Playwright for Python, for the browser SDK's and the playground's tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from playwright.async_api import Browser, Page, async_playwright

from tests.support.tools import tool


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    path = tool("chromium", "chromium")
    async with async_playwright() as driver:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = await driver.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            await browser.close()


class Tab:
    """A page whose script errors fail the test (``check()``), with the SDK a call away."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        page.on(
            "console",
            lambda message: (
                self.errors.append(f"console error: {message.text}")
                if message.type == "error"
                else None
            ),
        )

    async def sdk(self, body: str, arg: Any = None) -> Any:
        """Run ``body`` (the inside of an async function of ``sd``, the SDK module, and
        ``arg``) in the page; its return value comes back as JSON."""
        script = f"async (arg) => {{ const sd = await import('/sdk/index.js'); {body} }}"
        return await self.page.evaluate(script, arg)

    async def wait_until(self, expression: str, timeout_s: float = 15.0) -> None:
        """Poll ``expression`` (JavaScript) until it is true. (Playwright's wait_for_function
        evaluates a string, which the playground's content security policy forbids.)"""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.page.evaluate(f"() => Boolean({expression})"):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"not true after {timeout_s} s: {expression}")
            await asyncio.sleep(0.05)

    def check(self) -> None:
        assert not self.errors, self.errors


@contextlib.asynccontextmanager
async def tab(browser: Browser, url: str, *, bypass_csp: bool = False) -> AsyncIterator[Tab]:
    """A page at ``url``; ``bypass_csp`` for a page that talks to other origins than its own
    (Seedance's pages allow their own origin only)."""
    context = await browser.new_context(bypass_csp=bypass_csp)
    page = await context.new_page()
    opened = Tab(page)
    try:
        await page.goto(url)
        yield opened
    finally:
        await context.close()
