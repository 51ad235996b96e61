"""Suite 12 of ``make bench``: the browser SDK's rendering, measured in headless Chromium.

The design document's targets for the main thread's time per appended render window: under
16 ms at 128 tokens, 22 ms at 64 and 12 ms at 32. A page of the playground (its styles, a chat
that grows as replies are added) renders replies of markdown with code blocks through the SDK's
``TokenView``: the render worker cuts the tokens into windows for the round trip given (80 ms:
128 tokens, 160 ms: 64, 200 ms: 32), escapes and highlights them, and the main thread appends
each window's fragments and lays the page out; that append is what is timed, per window
(``performance.now()`` around the append and a forced layout). Beside it, in the same page and
run, the same windows parsed, escaped and appended on the main thread (no worker), which is what
a page without the worker pays.

``python -m benchmarks.browser_suite`` prints the table alone.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
from typing import TYPE_CHECKING, Any

from benchmarks.harness import fmt, seedance, servers
from seedance.bench.metrics import percentile

if TYPE_CHECKING:
    from benchmarks.harness import Report, Server

# (window in tokens, the round trip that asks for it, the design's target in ms)
WINDOWS = ((128, 80, 16.0), (64, 160, 22.0), (32, 200, 12.0))

# A reply as a small model writes one: prose with inline markup, a list, code blocks.
SAMPLE = """Here is how the **merge step** works, with `heapq` doing the ordering:

1. Take the first item of each sorted run and push it on a heap.
2. Pop the smallest, write it out, and push the next item of its run.
3. Stop when every run is empty.

```python
import heapq

def merge(runs):
    # each entry: (value, run index, position)
    heap = [(run[0], i, 0) for i, run in enumerate(runs) if run]
    heapq.heapify(heap)
    out = []
    while heap:
        value, i, pos = heapq.heappop(heap)
        out.append(value)
        if pos + 1 < len(runs[i]):
            heapq.heappush(heap, (runs[i][pos + 1], i, pos + 1))
    return out
```

The heap never holds more than `k` items, so the merge costs **O(n log k)** for `n` items in
`k` runs. In JavaScript the same loop reads:

```js
function merge(runs) {
  const out = [];
  let heads = runs.map((run) => 0);
  while (true) {
    let best = -1;
    for (let i = 0; i < runs.length; i++) {
      if (heads[i] < runs[i].length && (best < 0 || runs[i][heads[i]] < runs[best][heads[best]])) best = i;
    }
    if (best < 0) return out;
    out.push(runs[best][heads[best]++]);
  }
}
```

That version is simpler but costs O(n k); with a handful of runs it is just as fast.

"""

MEASURE = """
async ({sample, windows, replies, tokens}) => {
  const sd = await import('/sdk/index.js');
  const pieces = sample.match(/\\s*[\\w']+|\\s*[^\\w\\s]|\\s+/g);
  const chat = document.getElementById('messages');
  const reply = () => {
    const box = document.createElement('div');
    box.className = 'msg assistant';
    chat.append(box);
    return box;
  };
  const results = {};
  for (const [window, rtt] of windows) {
    const worker = [];
    const inline = [];
    for (let r = -1; r < replies; r++) {  // reply -1 warms up the page, the JIT and the worker
      const keep = r >= 0;
      const view = new sd.TokenView(reply(), {maxWaitMs: 60000});
      for (let i = 0; i < tokens; i++) view.push(pieces[(i + 13 * r) % pieces.length], 1, rtt);
      await view.end();
      if (keep) worker.push(...view.stats.filter((s) => s.tokens === s.window).map((s) => s.appendMs));
      view.terminate();
      // The same windows without the worker: parse, escape and append on the main thread.
      const box = reply();
      const markdown = new sd.MarkdownStream();
      const bare = Object.create(sd.TokenView.prototype);
      Object.assign(bare, {container: box, _text: null, _code: null});
      for (let i = 0; i + window <= tokens; i += window) {
        const text = [];
        for (let j = i; j < i + window; j++) text.push(pieces[(j + 13 * r) % pieces.length]);
        const started = performance.now();
        bare.append(markdown.push(text.join('')));
        void box.offsetHeight;
        if (keep) inline.push(performance.now() - started);
        await new Promise((resolve) => setTimeout(resolve, 0));
      }
    }
    results[window] = {worker, inline};
  }
  return {results, browser: navigator.userAgent};
}
"""


def _http(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


async def measure(http_url: str, replies: int, tokens: int) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise RuntimeError("chromium is not installed (Debian package chromium)")
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1200, "height": 800})
            await page.goto(f"{http_url}/")
            version = browser.version
            found: dict[str, Any] = await page.evaluate(
                MEASURE,
                {
                    "sample": SAMPLE,
                    "windows": [[w, rtt] for w, rtt, _ in WINDOWS],
                    "replies": replies,
                    "tokens": tokens,
                },
            )
        finally:
            await browser.close()
    found["version"] = version
    return found


def table(found: dict[str, Any]) -> tuple[list[str], list[tuple[int, float, float]]]:
    rows = [
        "| window (round trip) | windows | main thread per window with the worker: p50 / p95 / max ms "
        "| target | on the main thread alone: p50 / p95 ms |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for window, rtt, target in WINDOWS:
        cell = found["results"][str(window)]
        worker, inline = cell["worker"], cell["inline"]
        p95 = percentile(sorted(worker), 95)
        verdicts.append((window, p95, target))
        rows.append(
            f"| {window} tokens ({rtt} ms) | {len(worker)} "
            f"| {fmt(statistics.median(worker), 2)} / {fmt(p95, 2)} / {fmt(max(worker), 2)} "
            f"| < {target:g} ms | {fmt(statistics.median(inline), 2)} "
            f"/ {fmt(percentile(sorted(inline), 95), 2)} |"
        )
    return rows, verdicts


def browser_suite(report: Report) -> None:
    replies, tokens = (4, 1024) if report.quick else (8, 2048)
    contender = seedance("Seedance", "seedance")
    with servers([contender]) as running:
        url = _http(running["seedance"])
        report.log(f"[12 browser] {replies} replies of {tokens} tokens per window size")
        found = asyncio.run(measure(url, replies, tokens))
    rows, verdicts = table(found)
    for window, p95, target in verdicts:
        report.goals.append(
            (
                f"12. Browser: main thread per appended window of {window} tokens, p95 < {target:g} ms",
                f"{fmt(p95, 2)} ms",
                p95 < target,
            )
        )
    report.sections.append(
        "\n".join(
            [
                "## 12. Rendering in the browser",
                "",
                f"Headless Chromium {found['version']} (Debian's), on the machine above, renders "
                f"{replies} replies of {tokens} tokens per window size into the playground's page "
                "through the browser SDK's `TokenView`: the render worker cuts the tokens into "
                "windows for the round trip given, escapes them and highlights code, and the main "
                "thread appends each window and lays the page out. Timed: that append and layout, "
                "per full window, after one reply of warm-up (the chat grows over the run, as a real one does). Beside it, in "
                "the same page, the same windows parsed, escaped and appended on the main thread.",
                "",
                *rows,
                "",
                "```",
                contender.display(),
                "python -m benchmarks.browser_suite",
                "```",
                "",
            ]
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="the browser suite's table alone")
    parser.add_argument("--replies", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    with servers([seedance("Seedance", "seedance")]) as running:
        found = asyncio.run(measure(_http(running["seedance"]), args.replies, args.tokens))
    print(f"Chromium {found['version']}")
    print("\n".join(table(found)[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
