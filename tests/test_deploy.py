"""The files operators load: Prometheus rules and the Grafana dashboard (``deploy/``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seedance.client import connect
from seedance.observability.metrics import CONDITIONAL_METRICS
from tests.support.servers import RunningServer
from tests.test_metrics import scrape

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "seedance.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def base_name(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def used_metrics(text: str) -> set[str]:
    """Metric names in PromQL expressions (recording rules' own names contain a colon)."""
    return {base_name(m) for m in re.findall(r"\bseedance_[a-z0-9_]+", text)}


@pytest.mark.subprocess
def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    result = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_dashboard_is_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "seedance"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10 and all("seedance_" in e for e in exprs)


async def test_rules_dashboard_and_docs_use_only_exported_metrics(server: RunningServer) -> None:
    async with connect(server.url) as session:
        await session.complete("hello", max_tokens=3)
    _, text = scrape(server)
    families = {base_name(f.name) for f in text_string_to_metric_families(text)}
    exported = families | set(CONDITIONAL_METRICS)
    for path in (RULES, DASHBOARD):
        unknown = used_metrics(path.read_text()) - exported
        assert not unknown, f"{path.name} uses metrics the server does not export: {unknown}"
    documented = used_metrics((ROOT / "docs" / "observability.md").read_text())
    assert families <= documented
    assert documented <= exported
