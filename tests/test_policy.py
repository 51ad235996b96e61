"""Access policies in Cedar (--policy, docs/policy.md): the tenants table's rules said in Cedar,
decided as the table decides; a policy set's decisions over real sockets (model allow-lists,
a priority cap, a region, a time window, an admin role) with their ids in the audit log; a
reload under load; a bad policy refused; ``seedance policy``."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from seedance.config_loader import load_access
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.errors import Forbidden
from seedance.tenants import cedar, policy
from seedance.tenants.auth import Principal
from seedance.tenants.config import Tenant
from seedance.tenants.keys import add_key
from tests.support.servers import SEEDANCE, TEST_WORKERS, RunningServer


def chat(model: str, priority: int = 0) -> dict[str, object]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "priority": priority,
    }


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_default_policy_decides_as_the_tenants_table() -> None:
    """default.cedar (``seedance policy default``) against the table's rules in Python, over
    every combination of allow-list, priority cap, role, action, model and priority."""
    policies = cedar.Policies(cedar.DEFAULT_POLICY)
    served = ("alpha-1", "beta-1")
    tried = 0
    for patterns, highest, role in itertools.product(
        (None, ("alpha-*",), ()), (-1, 0, 3), ("user", "admin")
    ):
        principal = Principal(Tenant(name="t", models=patterns, max_priority=highest), "k", role)
        for action, model, priority in itertools.product(
            ("generate", "embed", "use"), served, (-2, 0, 3, 4)
        ):
            ask = cedar.Ask(principal, action, model, "1.0.0", served, priority=priority)
            table = policy.may_use(principal, model) and (
                action != "generate" or priority <= highest
            )
            assert policies.decide(ask).allowed == table, (patterns, highest, role, ask)
            tried += 1
        for verb in cedar.ADMIN_ACTIONS:
            ask = cedar.Ask(principal, verb)
            assert policies.decide(ask).allowed == (role == "admin"), (role, verb)
            tried += 1
        assert policies.decide(cedar.Ask(principal, "resume")).allowed  # one's own replies
    assert tried == 18 * (24 + len(cedar.ADMIN_ACTIONS))


def policy_text(hour: int) -> str:
    """Model allow-lists per tenant, a priority cap, a region, a time window (open now for
    every tenant, closed now for globex on model big) and an admin role."""
    now = f"(context.hour == {hour} || context.hour == {(hour + 1) % 24})"
    return f"""
@id("acme-small")
permit (principal in Seedance::Tenant::"acme", action, resource == Seedance::Model::"small");

@id("globex-all")
permit (principal in Seedance::Tenant::"globex", action, resource is Seedance::Model);

@id("globex-priority-cap")
forbid (principal in Seedance::Tenant::"globex", action == Seedance::Action::"generate", resource)
when {{ context.priority > 2 }};

@id("initech-all")
permit (principal in Seedance::Tenant::"initech", action, resource is Seedance::Model);

@id("initech-us-only")
forbid (principal in Seedance::Tenant::"initech", action, resource)
unless {{ context.region == "us-east" }};

@id("big-in-hours")
forbid (principal, action == Seedance::Action::"generate", resource == Seedance::Model::"big")
unless {{ {now} }};

@id("globex-big-closed-now")
forbid (principal in Seedance::Tenant::"globex", action, resource == Seedance::Model::"big")
when {{ {now} }};

@id("admins")
permit (principal, action in Seedance::Action::"admin", resource)
when {{ principal.role == "admin" }};

@id("resume")
permit (principal, action == Seedance::Action::"resume", resource);

@id("acme-no-resume")
forbid (principal in Seedance::Tenant::"acme", action == Seedance::Action::"resume", resource);
"""


async def test_a_policy_set_decides_every_request_and_its_ids_are_audited(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    config = tmp_path / "seedance.toml"
    acme, globex, initech = (add_key(config, t).key for t in ("acme", "globex", "initech"))
    admin = add_key(config, "ops", role="admin").key
    rules = tmp_path / "policy.cedar"
    rules.write_text(policy_text(datetime.datetime.now(datetime.timezone.utc).hour))
    audit_file = tmp_path / "audit.jsonl"
    server = make_server(
        [SyntheticEngine(name="small"), SyntheticEngine(name="big")],
        config_file=str(config),
        access=load_access(config),
        labels=(("region", "eu-west"),),
        policy=str(rules),
        audit_file=str(audit_file),
    )
    async with httpx.AsyncClient(base_url=server.http_url) as http:

        async def status(key: str, model: str, priority: int = 0) -> tuple[int, str]:
            answer = await http.post(
                "/v1/chat/completions", json=chat(model, priority), headers=auth(key)
            )
            return answer.status_code, answer.text

        assert (await status(acme, "small"))[0] == 200
        code, text = await status(acme, "big")  # not on acme's list
        assert code == 403 and "no policy permits acme" in text and "'big'" in text
        assert (await status(globex, "small", priority=2))[0] == 200
        code, text = await status(globex, "small", priority=3)
        assert code == 403 and "policy globex-priority-cap forbids globex" in text
        code, text = await status(globex, "big")  # the time window is closed for it now
        assert code == 403 and "globex-big-closed-now" in text
        code, text = await status(initech, "small")  # this server is in eu-west
        assert code == 403 and "initech-us-only" in text
        assert (await status(admin, "small"))[0] == 403  # an admin generates only if permitted
        # The models listed are those each caller may use now.
        for key, listed in ((acme, ["small"]), (globex, ["small"]), (initech, [])):
            models = (await http.get("/v1/models", headers=auth(key))).json()["data"]
            assert [m["id"] for m in models] == listed
        for key, expected in ((globex, 410), (acme, 403)):  # allowed to look, or not
            answer = await http.get("/v1/streams/chatcmpl-none", headers=auth(key))
            assert answer.status_code == expected, answer.text
        assert "acme-no-resume" in answer.text
        for key, expected in ((admin, 200), (acme, 403)):
            runtime = await http.get("/admin/runtime", headers=auth(key))
            assert runtime.status_code == expected, runtime.text
        models = await http.post(
            "/v1/embeddings", json={"model": "big", "input": "x"}, headers=auth(acme)
        )
        assert models.status_code == 403 and "to embed" in models.text
    server.stop()
    records = [json.loads(line) for line in audit_file.read_text().splitlines()]
    allowed = [r for r in records if r["kind"] == "request" and r["outcome"] == "length"]
    assert [(r["tenant"], r["policies"]) for r in allowed] == [
        ("acme", ["acme-small"]),
        ("globex", ["globex-all"]),
    ]
    denied = [(r["tenant"], r.get("policies")) for r in records if r["kind"] == "refused"]
    assert ("globex", ["globex-priority-cap"]) in denied and ("acme", []) in denied
    assert ("initech", ["initech-us-only"]) in denied


async def test_a_reload_under_load_changes_decisions_and_drops_no_request(
    tmp_path: Path, make_server: Callable[..., RunningServer], caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "seedance.toml"
    acme = add_key(config, "acme").key
    rules = tmp_path / "policy.cedar"
    rules.write_text('@id("open") permit (principal, action, resource);\n')
    server = make_server(
        [SyntheticEngine(name="small", tokens_per_s=200)],
        config_file=str(config),
        access=load_access(config),
        policy=str(rules),
    )
    answers: list[int] = []
    sent_received: list[tuple[float, float, int]] = []  # each request's times and status
    stop = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            answer = await http.post("/v1/chat/completions", json=chat("small"), headers=auth(acme))
            answers.append(answer.status_code)
            sent_received.append((sent, time.monotonic(), answer.status_code))

    async with httpx.AsyncClient(base_url=server.http_url, timeout=30) as http:
        clients = [asyncio.create_task(client(http)) for _ in range(8)]
        await asyncio.sleep(1.0)
        # A policy that does not validate: the old one stays, and the log says why.
        rules.write_text('@id("bad") permit (principal, action, resource) when { context.nope };\n')
        await asyncio.sleep(2.5)
        if not TEST_WORKERS:  # the workers log in their own processes
            assert "policies not reloaded, the old ones stay" in caplog.text
            assert "nope" in caplog.text
        assert set(answers) == {200}, answers
        before = len(answers)
        rules.write_text(
            '@id("open") permit (principal, action, resource);\n'
            '@id("acme-closed") forbid (principal in Seedance::Tenant::"acme", action, resource);\n'
        )
        for _ in range(100):
            await asyncio.sleep(0.1)
            if answers[-8:] == [403] * 8:
                break
        stop.set()
        await asyncio.gather(*clients)  # any error (a dropped request) is raised here
    assert set(answers[:before]) == {200} and answers[-8:] == [403] * 8, answers
    assert set(answers) == {200, 403}, answers
    if not TEST_WORKERS:  # each worker reloads on its own, within a second of the others
        # A request sent once a refusal came is decided by the new policies: refused too.
        refused_at = min(received for _, received, status in sent_received if status == 403)
        later = {status for sent, _, status in sent_received if sent > refused_at}
        assert later == {403}, sent_received


def test_seedance_policy_checks_validates_and_prints(tmp_path: Path) -> None:
    config = tmp_path / "seedance.toml"
    key = add_key(config, "acme")
    add_key(config, "ops", role="admin")
    rules = tmp_path / "policy.cedar"
    rules.write_text(
        '@id("hours") permit (principal, action == Seedance::Action::"generate", resource)\n'
        "when { context.weekday <= 5 && context.hour >= 9 && context.hour < 17 };\n"
    )

    def seedance(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SEEDANCE, "policy", *args], capture_output=True, text=True, timeout=60
        )

    common = ("--config", str(config), "--action", "generate", "--model", "m")
    inside = seedance("check", "--policy", str(rules), "--key", key.id, *common,
                      "--at", "2026-12-07T10:30", "--timezone", "Europe/Paris")  # fmt: skip
    assert inside.returncode == 0 and inside.stdout.strip() == "allow (hours)", inside
    saturday = seedance("check", "--policy", str(rules), "--key", key.id, *common,
                        "--at", "2026-12-05T10:30")  # fmt: skip
    assert saturday.returncode == 1 and "no policy permits acme" in saturday.stdout
    evening = seedance("check", "--policy", str(rules), "--key", key.id, *common,
                       "--at", "2026-12-07T16:30", "--timezone", "Europe/Paris")  # fmt: skip
    assert evening.returncode == 1  # 17:30 in Paris
    admin = seedance("check", "--config", str(config), "--tenant", "ops", "--role", "admin",
                     "--action", "revoke_key")  # fmt: skip
    assert admin.returncode == 0 and admin.stdout.strip() == "allow (admins)"
    rules.write_text(
        '@id("quant") permit (principal, action, resource)\n'
        'when { principal.hasTag("group") && principal.getTag("group") == "quant" };\n'
    )
    quant = seedance("check", "--policy", str(rules), "--key", key.id, *common,
                     "--claim", "group=quant", "--claim", "desk=rates")  # fmt: skip
    assert quant.returncode == 0 and quant.stdout.strip() == "allow (quant)", quant
    assert seedance("check", "--policy", str(rules), "--key", key.id, *common).returncode == 1
    default = seedance("default")
    assert default.returncode == 0 and '@id("tenant-models")' in default.stdout
    (tmp_path / "default.cedar").write_text(default.stdout)
    valid = seedance("validate", str(tmp_path / "default.cedar"))
    assert valid.returncode == 0 and "4 policies, valid" in valid.stdout
    rules.write_text('permit (principal, action == Seedance::Action::"fly", resource);\n')
    bad = seedance("validate", str(rules))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "fly" in bad.stderr, bad
    assert "Traceback" not in bad.stderr


def test_a_server_refuses_to_start_on_a_bad_policy(tmp_path: Path) -> None:
    from tests.support.servers import serve_fails

    rules = tmp_path / "policy.cedar"
    rules.write_text("permit (principal, action, resource) when { context.nope };\n")
    stderr = serve_fails("--engine", "synthetic", "--policy", str(rules))
    assert "--policy:" in stderr and "nope" in stderr and "Traceback" not in stderr
    rules.write_text("// nothing yet\n")
    stderr = serve_fails("--engine", "synthetic", "--policy", str(rules))
    assert "no policy (a server with none would refuse everything)" in stderr
    stderr = serve_fails("--engine", "synthetic", "--policy", str(tmp_path / "missing.cedar"))
    assert "--policy:" in stderr and "missing.cedar" in stderr


def test_a_denial_names_its_policies() -> None:
    principal = Principal(Tenant(name="t"), "k", "user")
    rules = cedar.Policies('@id("no") forbid (principal, action, resource);\n')
    ask = cedar.Ask(principal, "generate", "m", served=("m",))
    decision = rules.decide(ask)
    assert not decision.allowed and decision.policies == ("no",)
    assert isinstance(cedar.Denied("x", ("no",)), Forbidden)
    # A forbid Cedar cannot evaluate (it skips it) denies; a permit so does not permit.
    rules = cedar.Policies(
        '@id("open") permit (principal, action, resource);\n'
        '@id("overflow") forbid (principal, action, resource)\n'
        "when { context.priority + 9223372036854775807 > 0 };\n"
    )
    high = rules.decide(cedar.Ask(principal, "generate", "m", served=("m",), priority=5))
    assert not high.allowed and high.policies == ("overflow",) and "overflow" in high.errors[0]
    assert "could not be evaluated" in high.explain(cedar.Ask(principal, "generate", "m"))
    low = rules.decide(cedar.Ask(principal, "generate", "m", served=("m",), priority=-5))
    assert not low.allowed and not low.errors  # evaluated: its condition held
    rules = cedar.Policies(
        '@id("overflow") permit (principal, action, resource)\n'
        "when { context.priority + 9223372036854775807 > 0 };\n"
    )
    assert not rules.decide(cedar.Ask(principal, "generate", "m", priority=5)).allowed


async def test_a_tokens_claims_are_its_tags_and_its_subject_and_kind_are_named(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    """A JWT's string claims are the caller's tags: a policy lets the "quant" group use the
    big model, and no one else (its subject and kind named too); a key cannot."""

    import jwt
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    (tmp_path / "jwt.pem").write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    config = tmp_path / "seedance.toml"
    config.write_text('[tenants.acme]\n[auth.jwt]\npublic_key = "jwt.pem"\n')
    key = add_key(config, "acme").key
    rules = tmp_path / "policy.cedar"
    rules.write_text(
        '@id("small") permit (principal, action, resource == Seedance::Model::"small");\n'
        '@id("quant") permit (principal, action, resource == Seedance::Model::"big")\n'
        'when { principal.kind == "token" && principal.hasTag("group")\n'
        '       && principal.getTag("group") == "quant" && principal.subject == "ada" };\n'
    )
    server = make_server(
        [SyntheticEngine(name="small"), SyntheticEngine(name="big")],
        config_file=str(config),
        access=load_access(config),
        policy=str(rules),
    )

    def token(**claims: object) -> str:
        body = {"tenant": "acme", "exp": int(time.time()) + 60, "sub": "ada", **claims}
        return jwt.encode(body, private, "EdDSA")

    async with httpx.AsyncClient(base_url=server.http_url) as http:

        async def status(credential: str, model: str) -> int:
            answer = await http.post(
                "/v1/chat/completions", json=chat(model), headers=auth(credential)
            )
            return answer.status_code

        assert await status(token(group="quant"), "big") == 200
        assert await status(token(group="retail"), "big") == 403
        assert await status(token(group="quant", sub="bob"), "big") == 403
        assert await status(token(), "small") == 200
        assert await status(key, "big") == 403 and await status(key, "small") == 200


def test_the_docs_example_is_a_valid_policy_set() -> None:
    import re

    text = (Path(__file__).parents[1] / "docs" / "policy.md").read_text()
    example = re.search(r"```cedar\n(.*?)```", text, re.S)
    assert example is not None
    assert cedar.Policies(example.group(1), "docs/policy.md").count == 5
