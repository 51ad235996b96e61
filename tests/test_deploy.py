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
RULES_TESTS = ROOT / "deploy" / "prometheus" / "rules.test.yml"
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
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    return found


@pytest.mark.subprocess
def test_the_alerts_fire_on_the_series_they_should_and_only_those() -> None:
    """rules.test.yml feeds series and names the alerts that fire (and those that do not):
    the design's thresholds, and the burn-rate alerts per SLA tag."""
    result = subprocess.run(
        [promtool(), "test", "rules", str(RULES_TESTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("threshold", "changed", "alert"),
    [
        ("seedance:request_errors:ratio_rate5m > 0.005", "> 0.05", "SeedanceErrorRateHigh"),
        ("seedance:time_to_first_token_seconds:p95_5m > 0.8", "> 1.5", "TimeToFirstTokenHigh"),
        ("seedance:slo_errors:ratio_rate5m > 0.072", "> 0.2", "SeedanceSLOErrorBudgetBurn"),
        ('_bucket{le="0.8"}[6h]', '_bucket{le="1"}[6h]', "SlowFirstTokenBudgetBurn"),
    ],
)
def test_the_alert_tests_fail_against_other_thresholds(
    tmp_path: Path, threshold: str, changed: str, alert: str
) -> None:
    """The same tests against rules whose threshold moved: promtool says which alert did not
    fire as expected."""
    rules = RULES.read_text()
    assert threshold in rules
    prefix = threshold.split(" > ")[0] + " " if " > " in threshold else ""
    (tmp_path / "rules.yml").write_text(rules.replace(threshold, prefix + changed))
    (tmp_path / "rules.test.yml").write_text(RULES_TESTS.read_text())
    result = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "rules.test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and alert in result.stdout + result.stderr, result.stdout


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


# --------------------------------------------------------------------------- Kubernetes

K8S = ROOT / "deploy" / "k8s"
CHART = ROOT / "deploy" / "helm" / "seedance"
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
#: What the chart's templates may hold: a value, nothing more (see values.yaml).
_PLACEHOLDER = re.compile(r"\{\{\s*\.(Values|Release|Chart)((?:\.[A-Za-z_]\w*)+)\s*\}\}")


def render_chart(chart: Path, release: str = "seedance") -> list[dict[str, object]]:
    """The chart's manifests as ``helm template RELEASE CHART`` renders them (its templates
    substitute values only, which this checks, so a substitution renders them exactly)."""
    import yaml

    values = yaml.safe_load((chart / "values.yaml").read_text())
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    scopes: dict[str, object] = {
        "Values": values,
        "Release": {"Name": release},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta["appVersion"],
        },
    }

    def value(match: re.Match[str]) -> str:
        found: object = scopes[match.group(1)]
        for part in match.group(2).strip(".").split("."):
            assert isinstance(found, dict) and part in found, f"no value {match.group(0)}"
            found = found[part]
        return str(found)

    documents = []
    for template in sorted((chart / "templates").glob("*.yaml")):
        text = template.read_text()
        rendered = _PLACEHOLDER.sub(value, text)
        assert "{{" not in rendered, f"{template.name}: a template beyond a value substitution"
        documents += [d for d in yaml.safe_load_all(rendered) if d]
    return documents


def manifests() -> list[dict[str, object]]:
    import yaml

    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_kubernetes_manifests_and_the_chart_validate_against_the_schemas(version: str) -> None:
    import kubernetes_validate

    documents = manifests()
    kinds = sorted(str(d["kind"]) for d in documents)
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    for document in [*documents, *render_chart(CHART, "seedance"), *render_chart(CHART, "other")]:
        kubernetes_validate.validate(document, version, strict=True)


def test_the_chart_with_its_defaults_renders_the_plain_manifests() -> None:
    def by_kind(documents: list[dict[str, object]]) -> dict[str, object]:
        return {str(d["kind"]): d for d in documents}

    assert by_kind(render_chart(CHART)) == by_kind(manifests())


def test_the_deployment_probes_are_the_servers_checks() -> None:
    deployment = next(d for d in manifests() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz?check=initial-load"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz?check=model+signature"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]  # type: ignore[index]
    drain = next(a for a in container["args"] if a.startswith("--drain-timeout="))
    assert grace > int(drain.split("=")[1]) + 5  # the preStop pause, then the drain
