"""Tenants' WebAssembly modules in a real server (docs/modules.md): a registry of signed modules
built from C, a pre-processor, stream filters (the shipped redaction example) and a
post-processor on /v2/infer and the OpenAI API, a tenant whose every request goes through its
filter, a pipeline served as an Open Inference Protocol model that calls served models through
WASI-NN, and hostile modules that end only their own request, each with its reason, counted and
audited."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from seedance.config import ConfigError, ModulesConfig
from seedance.config_loader import load_access
from seedance.models.registry import Registry, sign_version
from seedance.models.signing import keygen
from seedance.server.modules import ModuleTable
from seedance.tenants.keys import add_key
from seedance.wasm import WasmHost
from tests.support.servers import RunningServer, one_process_only
from tests.support.waits import eventually
from tests.support.wasm import Builder
from tests.support.ws import generate, open_session

EMBEDDER = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Builder:
    return Builder(tmp_path_factory.mktemp("wasm-build"))


def publish(
    root: Path, key: Path, name: str, wasm: bytes, version: str = "1.0.0", **options: Any
) -> Path:
    """``wasm`` as version ``version`` of module ``name``, signed with ``key``."""
    folder = root / name / version
    folder.mkdir(parents=True)
    (folder / f"{name}.wasm").write_bytes(wasm)
    sign_version(
        folder, key, name=name, version=version, git_commit="0" * 40, engine="wasm",
        engine_options=options,
    )  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def registry(build: Builder, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A registry of the test modules (and the key that signed them)."""
    where = tmp_path_factory.mktemp("modules")
    key = where / "signing.key"
    public, _ = keygen(key)
    root = where / "registry"
    publish(root, key, "redact", build("redact"))
    publish(root, key, "upper", build("upper"))
    publish(root, key, "post", build("post"))
    publish(root, key, "stopper", build("stopper"))
    publish(root, key, "wild", build("wild"), fuel=2_000_000, memory_mb=4)
    publish(root, key, "ask", build("ask"), wall_ms=5000)
    publish(root, key, "ask-embedder", build("ask"), models=EMBEDDER)
    publish(root, key, "hostile", build("hostile"), fuel=2_000_000, memory_mb=4, wall_ms=500)
    publish(root, key, "acme-only", build("upper"), tenant="acme")
    publish(root, key, "printer", build("printf"), imports="wasi_snapshot_preview1")
    return root, str(public)


@pytest.fixture
def served(
    make_server: Callable[..., RunningServer], registry: tuple[Path, str], tmp_path: Path
) -> RunningServer:
    root, public = registry
    return make_server(
        echo=True,
        embedding_model=EMBEDDER,
        module_registry=str(root),
        module_trust=(public,),
        audit_file=str(tmp_path / "audit.log"),
    )


def text_of(frames: list[dict[str, Any]]) -> str:
    return "".join(f["token"] for f in frames if f["type"] == "token")


async def test_a_stream_filter_redacts_the_reply_wherever_the_tokens_split_it(
    served: RunningServer,
) -> None:
    prompt = "Mail bob.smith@example.com or call 0612345678 today, not 12345."
    ws, _ = await open_session(served.url)
    async with ws:
        plain = await generate(ws, prompt=prompt, reset=True)
        filtered = await generate(ws, prompt=prompt, modules=["redact"], reset=True)
    assert text_of(plain) == prompt  # the echo engine repeats the prompt
    assert text_of(filtered) == "Mail [redacted] or call [redacted] today, not 12345."
    usage = [frames[-1]["usage"]["completion_tokens"] for frames in (plain, filtered)]
    assert usage[0] == usage[1]  # every generated token counted, held or not
    seqs = [f["seq"] for f in filtered if f["type"] == "token"]
    assert seqs == sorted(seqs) and filtered[-1]["finish_reason"] == "stop"


async def test_pre_and_post_processors_and_a_filter_that_stops(served: RunningServer) -> None:
    ws, _ = await open_session(served.url, "session_id=modules")
    async with ws:
        upper = await generate(ws, prompt="hello there", modules=["upper"])
        assert text_of(upper) == "HELLO THERE"
        refused = await generate(ws, prompt="this is forbidden", modules=["upper"])
        error = refused[-1]["error"]
        assert error["code"] == "module_error" and error["reason"] == "refused"
        assert "prompt refused: it says forbidden" in error["message"]
        stopped = await generate(ws, prompt="go on STOP never seen", modules=["stopper"])
        assert text_of(stopped) == "go on " and stopped[-1]["finish_reason"] == "stop"
        whole = await generate(ws, prompt="one\r\ntwo", modules=["post"], stream=False)
        assert whole[-1]["text"] == "one\ntwo\n-- lines: 2"
        streamed = await generate(ws, prompt="x", modules=["post"])
        assert "post-processes whole replies; this one streams" in str(streamed[-1])
        unknown = await generate(ws, prompt="x", modules=["nope"])
        assert unknown[-1]["error"]["code"] == "invalid_request"
        theirs = await generate(ws, prompt="x", modules=["acme-only"])  # another tenant's
        assert theirs[-1]["error"]["code"] == "invalid_request"
        assert "'acme-only' is not served here" in theirs[-1]["error"]["message"]
        printer = await generate(ws, prompt="x", modules=["printer"])
        assert printer[-1]["error"]["code"] == "forbidden"
        assert "wasi_snapshot_preview1" in printer[-1]["error"]["message"]


async def test_hostile_filters_end_only_their_own_request(served: RunningServer) -> None:
    async def run(prompt: str) -> list[dict[str, Any]]:
        ws, _ = await open_session(served.url)
        async with ws:
            return await generate(ws, prompt=prompt, modules=["wild"])

    calm = asyncio.ensure_future(run("a calm reply " * 20))
    outcomes = await asyncio.gather(run("x TRAP"), run("x SPIN"), run("x BOMB"), run("x HUGE"))
    reasons = [frames[-1]["error"]["reason"] for frames in outcomes]
    assert reasons == ["trap", "fuel", "memory", "output_too_large"]
    assert all(frames[-1]["error"]["code"] == "module_error" for frames in outcomes)
    assert text_of(await calm) == "a calm reply " * 20  # the request beside them: untouched
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{served.http_url}/metrics")).text
    assert 'seedance_module_calls_total{module="wild",outcome="trap",role="filter"} 1.0' in metrics

    def records() -> list[dict[str, Any]]:
        lines = Path(served.config.audit.file or "").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("module_error")]

    await eventually(lambda: len(records()) == 4, 5, "the four failures' audit records")
    assert sorted(r["module_error"] for r in records()) == sorted(reasons)
    assert all(r["modules"] == ["wild@1.0.0"] for r in records())


@one_process_only("a pipeline reads the pieces of a stream as one process delivers them")
def test_a_pipeline_is_a_model_of_the_inference_protocol_that_calls_served_models(
    served: RunningServer,
) -> None:
    url = f"{served.http_url}/v2/models"

    def ask(module: str, text: str) -> httpx.Response:
        body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [text]}]}
        return httpx.post(f"{url}/{module}/infer", json=body, timeout=30)

    metadata = httpx.get(f"{url}/ask").json()
    assert metadata["platform"] == "seedance_wasm" and metadata["versions"] == ["1.0.0"]
    assert metadata["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [1]}]
    reply = ask("ask", "c synthetic\nthe sea is calm")
    assert reply.json()["outputs"][0]["data"] == ["the sea is calm"]  # the echo engine's reply
    streamed = ask("ask", "s synthetic\nthe sea is calm").json()["outputs"][0]["data"][0]
    assert streamed.replace("|", "") == "the sea is calm" and "|" in streamed
    assert ask("ask", "f synthetic\nthe sea is calm tonight").status_code == 200
    body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}  # fmt: skip
    head = f"c {EMBEDDER}\nthe sea is calm".encode()
    body["inputs"][0]["data"] = [head.decode()]
    raw = httpx.post(f"{url}/ask/infer", json=body, timeout=30)
    start = int(raw.headers["inference-header-content-length"])
    vector = np.frombuffer(raw.content[start + 4 :], dtype="<f4")  # after BYTES' length
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1.0) < 1e-3
    missing = ask("ask", "c nowhere\nhi")
    assert missing.status_code == 500 and "refused (code 203)" in missing.json()["error"]
    narrowed = ask("ask-embedder", "c synthetic\nhi")  # its manifest names only the embedder
    assert narrowed.status_code == 500 and "refused (code 203)" in narrowed.json()["error"]
    vector = ask("ask-embedder", f"c {EMBEDDER}\nhi")  # raw f32 bytes: JSON cannot carry them
    assert vector.status_code == 400 and "binary_data" in vector.json()["error"]
    not_pipeline = httpx.get(f"{url}/redact")
    assert not_pipeline.status_code == 404 and "not a pipeline" in not_pipeline.json()["error"]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("trap", "trap"), ("div", "trap"), ("oob", "trap"), ("loop", "fuel"), ("bomb", "memory"),
     ("bigout", "output_too_large")],
)  # fmt: skip
def test_a_hostile_pipeline_ends_its_call_with_its_reason(
    served: RunningServer, mode: str, reason: str
) -> None:
    body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [mode]}]}
    url = f"{served.http_url}/v2/models/hostile/infer"
    reply = httpx.post(url, json=body, timeout=30)
    assert reply.status_code == 500 and f"{reason}" in reply.json()["error"], reply.text
    body["inputs"][0]["data"] = ["ok"]
    assert httpx.post(url, json=body, timeout=30).json()["outputs"][0]["data"] == ["fine"]


def test_a_tenants_modules_run_on_every_request_and_every_api(
    make_server: Callable[..., RunningServer], registry: tuple[Path, str], tmp_path: Path
) -> None:
    root, public = registry
    path = tmp_path / "seedance.toml"
    key = add_key(path, "acme").key
    path.write_text('[tenants.acme]\nmodules = ["redact"]\n\n' + path.read_text())
    server = make_server(
        echo=True, module_registry=str(root), module_trust=(public,), config_file=str(path),
        access=load_access(path),
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "write to ann@corp.example"}]
    )
    assert reply.choices[0].message.content == "write to [redacted]"
    chunks = client.chat.completions.create(
        model="synthetic",
        messages=[{"role": "user", "content": "ann@corp.example again"}],
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "[redacted] again"
    upper = client.completions.create(  # its own module too, after the tenant's
        model="synthetic",
        prompt="mail ann@corp.example",
        extra_body={"seedance": {"modules": ["upper"]}},
    )
    assert upper.choices[0].text == "MAIL [redacted]"


def test_a_module_that_does_not_verify_stops_the_server_from_starting(
    build: Builder, tmp_path: Path
) -> None:
    key = tmp_path / "k"
    public, _ = keygen(key)
    root = tmp_path / "registry"
    folder = publish(root, key, "redact", build("redact"))
    (folder / "redact.wasm").write_bytes(build("upper"))  # swapped after signing
    config = ModulesConfig(path=str(root), trust=(str(public),))
    with WasmHost() as host, pytest.raises(ConfigError, match="changed_file"):
        ModuleTable.load(config, host)
    publish(root, key, "printer", build("printf"))  # imports WASI without asking
    (folder / "redact.wasm").write_bytes(build("redact"))
    with WasmHost() as host, pytest.raises(ConfigError, match="without asking for it"):
        ModuleTable.load(config, host)


async def test_a_reload_swaps_a_new_promoted_version_in_and_keeps_a_refused_one_out(
    make_server: Callable[..., RunningServer], build: Builder, tmp_path: Path
) -> None:
    """``POST /admin/modules/reload``: a newly promoted version verified and served, one whose
    file changed after signing refused (the served one goes on), one removed no longer
    served; each audited."""
    key = tmp_path / "k"
    public, _ = keygen(key)
    root = tmp_path / "registry"
    publish(root, key, "swap", build("upper"))
    path = tmp_path / "seedance.toml"
    admin = add_key(path, "ops", role="admin").key
    user = add_key(path, "acme").key
    audit_file = tmp_path / "audit.log"
    server = make_server(
        echo=True, module_registry=str(root), module_trust=(str(public),), config_file=str(path),
        access=load_access(path), audit_file=str(audit_file), module_watch_s=0,
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {admin}"}

    async def reply(prompt: str) -> str:
        ws, _ = await open_session(server.url, f"api_key={user}")
        async with ws:
            return text_of(await generate(ws, prompt=prompt, modules=["swap"]))

    assert await reply("mail me@corp.example") == "MAIL ME@CORP.EXAMPLE"
    publish(root, key, "swap", build("redact"), version="1.1.0")
    Registry(root).promote("swap", "1.1.0")
    async with httpx.AsyncClient(base_url=server.http_url, headers=headers) as http:
        done = (await http.post("/admin/modules/reload")).json()["reloads"]
        assert done == [
            {"action": "loaded", "module": "swap", "version": "1.1.0", "key": done[0]["key"],
             "manifest_sha256": done[0]["manifest_sha256"]}
        ]  # fmt: skip
        assert await reply("mail me@corp.example") == "mail [redacted]"
        bad = publish(root, key, "swap", build("redact"), version="1.2.0")
        (bad / "swap.wasm").write_bytes(build("upper"))  # changed after it was signed
        Registry(root).promote("swap", "1.2.0")
        refused = (await http.post("/admin/modules/reload")).json()["reloads"]
        assert refused == [
            {"action": "refused", "module": "swap", "version": "1.2.0", "reason": "changed_file"}
        ]
        assert await reply("mail me@corp.example") == "mail [redacted]"  # 1.1.0 goes on
        as_user = {"Authorization": f"Bearer {user}"}
        forbidden = await http.post("/admin/modules/reload", headers=as_user)
        assert forbidden.status_code == 403

    def events() -> list[tuple[str, str]]:
        """Each process's reload is a record (``--workers``: the same, once each)."""
        records = map(json.loads, audit_file.read_text().splitlines())
        events = [(r["action"], r["version"]) for r in records if r["kind"] == "module"]
        return list(dict.fromkeys(events))

    await eventually(lambda: len(events()) == 2, 5, "the reloads' audit records")
    assert events() == [("loaded", "1.1.0"), ("refused", "1.2.0")]


@one_process_only("reads the server's models in its process")
async def test_the_watcher_serves_a_newly_promoted_version(
    make_server: Callable[..., RunningServer], build: Builder, tmp_path: Path
) -> None:
    key = tmp_path / "k"
    public, _ = keygen(key)
    root = tmp_path / "registry"
    publish(root, key, "swap", build("upper"))
    server = make_server(
        echo=True, module_registry=str(root), module_trust=(str(public),), module_watch_s=0.1
    )

    async def reply() -> str:
        ws, _ = await open_session(server.url)
        async with ws:
            return text_of(await generate(ws, prompt="mail me@corp.example", modules=["swap"]))

    assert await reply() == "MAIL ME@CORP.EXAMPLE"
    publish(root, key, "swap", build("redact"), version="1.1.0")
    Registry(root).promote("swap", "1.1.0")
    await eventually(lambda: server.state.modules.modules["swap"].version == "1.1.0", 10, "1.1.0")
    assert await reply() == "mail [redacted]"
