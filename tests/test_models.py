"""The model registry (``seedance.models``): manifests signed with real Ed25519 keys over real
files, and every reason a version is refused before an engine reads a byte of it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from seedance.client import connect
from seedance.config_loader import load_access
from seedance.engines.local import default_model_path
from seedance.models.registry import (
    MANIFEST,
    SIGNATURE,
    Limits,
    ModelRefused,
    Registry,
    place,
    semver,
    sign_version,
    verify,
)
from seedance.models.signing import TrustedKey, keygen, load_trusted
from seedance.tenants.keys import add_key
from tests.support.certs import write_key_pair
from tests.support.servers import RunningServer, ServerProcess, one_process_only, serve_fails
from tests.test_metrics import scrape, value


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Two signing keys: ``ci`` (trusted) and ``other`` (not); their ``.pub`` beside them."""
    made = {}
    for name in ("ci", "other"):
        private = tmp_path / f"{name}.key"
        keygen(private)
        made[name] = private
    return made


SIGNED = Limits(context_length=2048, max_tokens=512, temperature=(0.0, 1.5))


def make_version(
    root: Path,
    key: Path,
    version: str = "1.0.0",
    name: str = "tiny",
    limits: Limits = SIGNED,
    signature_format: str = "seedance",
    **files: bytes,
) -> Path:
    folder = root / name / version
    folder.mkdir(parents=True)
    for relative, data in (
        files or {"weights.bin": os.urandom(50_000), "sub/config.json": b"{}"}
    ).items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    sign_version(
        folder,
        key,
        name=name,
        version=version,
        git_commit="0123abcd",
        engine="synthetic",
        engine_options={"tokens_per_s": 100},
        limits=limits,
        signature_format=signature_format,
    )
    return folder


def trusted(keys: dict[str, Path], *names: str) -> dict[str, TrustedKey]:
    return load_trusted([keys[n].with_name(keys[n].name + ".pub") for n in names])


def test_a_signed_version_verifies_with_its_manifest(tmp_path: Path, keys: dict[str, Path]) -> None:
    folder = make_version(tmp_path / "registry", keys["ci"])
    model = verify(folder, trusted(keys, "ci"))
    assert (model.name, model.version, model.manifest.git_commit) == ("tiny", "1.0.0", "0123abcd")
    assert model.manifest.engine == "synthetic" and model.manifest.engine_options == {
        "tokens_per_s": 100
    }
    assert model.manifest.limits == Limits(
        context_length=2048, max_tokens=512, temperature=(0.0, 1.5)
    )
    assert sorted(s.name for s in model.files) == ["sub/config.json", "weights.bin"]
    assert model.file(".bin") == folder.resolve() / "weights.bin"
    # A rotation: the old and the new key trusted at once.
    assert verify(folder, trusted(keys, "other", "ci")).key.id == model.key.id


Change = Callable[[Path, dict[str, Path]], None]


def _extra(folder: Path, keys: dict[str, Path]) -> None:
    (folder / "sub" / "loot.py").write_text("print('hi')")


def _missing(folder: Path, keys: dict[str, Path]) -> None:
    (folder / "sub" / "config.json").unlink()


def _changed(folder: Path, keys: dict[str, Path]) -> None:
    data = bytearray((folder / "weights.bin").read_bytes())
    data[100] ^= 0xFF  # same size, one byte flipped
    (folder / "weights.bin").write_bytes(bytes(data))


def _symlink_out(folder: Path, keys: dict[str, Path]) -> None:
    (folder / "sub" / "config.json").unlink()
    os.symlink("/etc/hostname", folder / "sub" / "config.json")


def _manifest_edited(folder: Path, keys: dict[str, Path]) -> None:
    text = (folder / MANIFEST).read_text().replace('"0123abcd"', '"ffffffff"')
    (folder / MANIFEST).write_text(text)


def _signature_forged(folder: Path, keys: dict[str, Path]) -> None:
    sig = (folder / SIGNATURE).read_text()
    head, _, tail = sig.partition('"sig": "')
    (folder / SIGNATURE).write_text(head + '"sig": "' + ("A" if tail[0] != "A" else "B") + tail[1:])


def _resigned_by_other(folder: Path, keys: dict[str, Path]) -> None:
    sign_version(
        folder, keys["other"], name="tiny", version="1.0.0", git_commit="x", engine="synthetic"
    )


@pytest.mark.parametrize(
    ("change", "reason", "says"),
    [
        (_extra, "extra_file", "sub/loot.py is not in the signed manifest"),
        (_missing, "missing_file", "sub/config.json is in the manifest but not on disk"),
        (_changed, "changed_file", "weights.bin is not the file that was signed (SHA-256)"),
        (_symlink_out, "symlink_escape", "sub/config.json links out of the directory"),
        (_manifest_edited, "bad_signature", "manifest.json differs from what manifest.sig signed"),
        (_signature_forged, "bad_signature", "does not verify"),
        (_resigned_by_other, "unknown_key", "none of them trusted"),
    ],
)
def test_each_refusal_says_why(
    tmp_path: Path, keys: dict[str, Path], change: Change, reason: str, says: str
) -> None:
    folder = make_version(tmp_path / "registry", keys["ci"])
    change(folder, keys)
    with pytest.raises(ModelRefused) as refused:
        verify(folder, trusted(keys, "ci"))
    assert refused.value.reason == reason and says in refused.value.message


def test_a_version_below_the_served_one_is_a_rollback(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    root = tmp_path / "registry"
    older = make_version(root, keys["ci"], "1.2.0-rc.1")
    with pytest.raises(
        ModelRefused, match=r"rollback: tiny 1\.2\.0-rc\.1 is older than the version served"
    ):
        verify(older, trusted(keys, "ci"), served="1.2.0")
    assert verify(older, trusted(keys, "ci"), served="1.1.9").version == "1.2.0-rc.1"
    assert semver("1.2.0-rc.1") < semver("1.2.0-rc.2") < semver("1.2.0") < semver("1.10.0")
    with pytest.raises(ValueError, match="not a semantic version"):
        semver("1.2")


def test_the_registry_lists_and_promotes(tmp_path: Path, keys: dict[str, Path]) -> None:
    root = tmp_path / "registry"
    for version in ("1.0.0", "1.10.0", "1.9.0"):
        make_version(root, keys["ci"], version)
    registry = Registry(root)
    assert registry.names() == ["tiny"] and registry.versions("tiny") == [
        "1.0.0",
        "1.9.0",
        "1.10.0",
    ]
    assert registry.promoted("tiny") == "1.10.0"  # none promoted: the newest
    registry.promote("tiny", "1.9.0")
    assert registry.promoted("tiny") == "1.9.0"
    with pytest.raises(ValueError, match=r"no version 2\.0\.0 of tiny"):
        registry.promote("tiny", "2.0.0")


def seedance_models(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "seedance.cli", "models", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_the_command_line_signs_verifies_lists_and_promotes(tmp_path: Path) -> None:
    seedance = seedance_models
    key = tmp_path / "ci.key"
    made = seedance("keygen", str(key))
    assert made.returncode == 0 and "key id " in made.stdout
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    folder = tmp_path / "registry" / "tiny" / "2.0.0"
    folder.mkdir(parents=True)
    (folder / "model.gguf").write_bytes(b"GGUF" + os.urandom(1000))
    signed = seedance(
        *("sign", str(folder), "--key", str(key), "--name", "tiny", "--version", "2.0.0"),
        *("--commit", "deadbeef", "--engine", "llamacpp", "--option", "n_ctx=4096"),
    )
    assert signed.returncode == 0, signed.stderr
    pub = str(key) + ".pub"
    ok = seedance("verify", str(folder), "--trust", pub)
    assert ok.returncode == 0 and "ok: tiny 2.0.0 (commit deadbeef, engine llamacpp)" in ok.stdout
    (folder / "model.gguf").write_bytes(b"GGUF" + os.urandom(1000))
    bad = seedance("verify", str(folder), "--trust", pub)
    assert bad.returncode == 1 and "refused (changed_file)" in bad.stderr
    listed = seedance("list", str(tmp_path / "registry"), "--trust", pub)
    assert "* tiny 2.0.0  REFUSED (changed_file" in listed.stdout
    assert seedance("promote", str(tmp_path / "registry"), "tiny", "2.0.0").returncode == 0


# --------------------------------------------------------------------------- OpenSSF model-signing


def ec_key(folder: Path, name: str = "ec") -> tuple[Path, Path]:
    """An EC P-256 key pair in PEM, the kind ``model_signing sign key`` takes."""
    key, pub = folder / f"{name}.key", folder / f"{name}.pub"
    write_key_pair(ec.generate_private_key(ec.SECP256R1()), key, pub)
    return key, pub


def model_signing(action: str, key: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    """The ``model_signing`` package's own command line, unchanged: ``sign`` with the private
    ``key`` or ``verify`` with the public one, the bundle ``model.sig`` in ``folder``."""
    option = "--private_key" if action == "sign" else "--public_key"
    argv = [sys.executable, "-m", "model_signing", action, "key", option, str(key)]
    argv += ["--signature", str(folder / "model.sig"), str(folder)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_seedance_verifies_what_model_signing_signed(tmp_path: Path) -> None:
    key, pub = ec_key(tmp_path)
    folder = tmp_path / "registry" / "tiny" / "1.2.0"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.gguf").write_bytes(b"GGUF" + os.urandom(5000))
    (folder / "sub" / "config.json").write_text("{}")
    signed = model_signing("sign", key, folder)
    assert signed.returncode == 0, signed.stderr
    ok = seedance_models("verify", str(folder), "--trust", str(pub))
    assert ok.returncode == 0, ok.stderr
    # No Seedance manifest: the name and version are the directories', the engine the file's.
    assert "ok: tiny 1.2.0 (engine llamacpp), 2 file(s), signed by key " in ok.stdout
    model = verify(folder, load_trusted([pub]))
    assert model.file(".gguf") == folder.resolve() / "model.gguf"
    assert model.manifest_sha256 and model.key.path == str(pub)

    _, other = ec_key(tmp_path, "other")
    for change, reason, words in (
        (lambda: (folder / "sub" / "loot.py").write_text("x"), "extra_file", "sub/loot.py"),
        (lambda: (folder / "sub" / "loot.py").unlink(), None, ""),
        (lambda: (folder / "sub" / "config.json").write_text("{ }"), "changed_file", "config"),
        (lambda: (folder / "sub" / "config.json").unlink(), "missing_file", "sub/config.json"),
    ):
        change()
        if reason is None:
            continue
        refused = seedance_models("verify", str(folder), "--trust", str(pub))
        assert refused.returncode == 1 and f"refused ({reason}): " in refused.stderr, refused
        assert words in refused.stderr and "Traceback" not in refused.stderr
    (folder / "sub" / "config.json").write_text("{}")
    assert seedance_models("verify", str(folder), "--trust", str(pub)).returncode == 0
    untrusted = seedance_models("verify", str(folder), "--trust", str(other))
    assert untrusted.returncode == 1 and "refused (unknown_key)" in untrusted.stderr
    # The signed statement rewritten to say what the changed file's digest now is.
    bundle = json.loads((folder / "model.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"][0]["digest"] = "00" * 32
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (folder / "model.sig").write_text(json.dumps(bundle))
    forged = seedance_models("verify", str(folder), "--trust", str(pub))
    assert forged.returncode == 1 and "refused (bad_signature)" in forged.stderr


def test_model_signing_verifies_what_seedance_signed(tmp_path: Path) -> None:
    key, pub = ec_key(tmp_path)
    folder = tmp_path / "registry" / "tiny" / "2.0.0"
    folder.mkdir(parents=True)
    (folder / "model.gguf").write_bytes(b"GGUF" + os.urandom(5000))
    signed = seedance_models(
        *("sign", str(folder), "--key", str(key), "--format", "openssf", "--name", "tiny"),
        *("--version", "2.0.0", "--commit", "deadbeef", "--engine", "llamacpp"),
    )
    assert signed.returncode == 0, signed.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "model.gguf", "model.sig"]
    checked = model_signing("verify", pub, folder)
    assert checked.returncode == 0 and "Verification succeeded" in checked.stdout, checked
    ok = seedance_models("verify", str(folder), "--trust", str(pub))
    assert "ok: tiny 2.0.0 (commit deadbeef, engine llamacpp), 1 file(s)" in ok.stdout, ok
    # Seedance's manifest is one of the files signed: its limits cannot be edited either.
    manifest = folder / MANIFEST
    manifest.write_text(manifest.read_text().replace('"llamacpp"', '"transformers"'))
    checked = model_signing("verify", pub, folder)
    assert checked.returncode != 0 and "manifest.json" in checked.stdout + checked.stderr
    refused = seedance_models("verify", str(folder), "--trust", str(pub))
    assert refused.returncode == 1 and "refused (changed_file): manifest.json" in refused.stderr


def test_a_key_seedance_cannot_use_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    folder = tmp_path
    rsa_pub = tmp_path / "rsa.pub"
    write_key_pair(rsa.generate_private_key(65537, 2048), tmp_path / "rsa.key", rsa_pub)
    for trust, words in (
        (rsa_pub, "the key is RSA; trusted keys are Ed25519"),
        (
            tmp_path / "absent.pub",
            "No such file",
        ),
    ):
        answer = seedance_models("verify", str(folder), "--trust", str(trust))
        assert answer.returncode == 2 and "Traceback" not in answer.stderr
        assert answer.stderr.strip().count("\n") == 0 and words in answer.stderr
    ed_key = tmp_path / "ed.key"
    keygen(ed_key)
    wrong = seedance_models(
        *("sign", str(folder), "--key", str(ed_key), "--format", "openssf", "--name", "x"),
        *("--version", "1.0.0", "--commit", "c", "--engine", "synthetic"),
    )
    assert wrong.returncode == 2 and "an EC P-256, P-384 or P-521 key" in wrong.stderr
    assert not (folder / MANIFEST).exists()  # nothing written


# --------------------------------------------------------------------------- serving from it


def registry_server(
    make_server: Callable[..., RunningServer], root: Path, keys: dict[str, Path], **fields: object
) -> RunningServer:
    trust = (str(keys["ci"]) + ".pub",)
    return make_server(model_registry=str(root), model_trust=trust, **fields)


def admin_config(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "seedance.toml"
    return path, add_key(path, "ops", role="admin").key


def admin_registry_server(
    make_server: Callable[..., RunningServer], root: Path, keys: dict[str, Path], tmp_path: Path
) -> tuple[RunningServer, str, Path]:
    """A server of the registry's model ``tiny``, reloaded only when asked, with an admin key
    and an audit log."""
    config, admin = admin_config(tmp_path)
    audit_file = tmp_path / "audit.jsonl"
    server = registry_server(
        make_server,
        root,
        keys,
        model="tiny",
        model_watch_s=0,
        config_file=str(config),
        access=load_access(config),
        audit_file=str(audit_file),
    )
    return server, admin, audit_file


@one_process_only("--model-registry is refused with workers")
async def test_a_registry_model_is_verified_served_reloaded_and_refused_with_reasons(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    root = tmp_path / "registry"
    make_version(root, keys["ci"], "1.0.0")
    server, admin, audit_file = admin_registry_server(make_server, root, keys, tmp_path)
    headers = {"Authorization": f"Bearer {admin}"}

    async def version_of_a_reply() -> str:
        async with connect(server.url, api_key=admin) as session:
            return (await session.complete("hi", max_tokens=3)).model_version or ""

    async with httpx.AsyncClient(base_url=server.http_url, headers=headers) as http:
        ready = await http.get("/healthz", params={"check": "model+signature"})
        assert ready.status_code == 200 and ready.json()["models"] == {"tiny": "1.0.0"}
        assert (await http.get("/healthz", params={"check": "initial-load"})).status_code == 200
        assert (await http.get("/healthz", params={"check": "nope"})).status_code == 400
        assert await version_of_a_reply() == "1.0.0"
        kept = await connect(server.url, api_key=admin)  # open across the reload below
        assert (await kept.complete("hi", max_tokens=2)).model_version == "1.0.0"
        unchanged = (await http.post("/admin/models/reload")).json()["reloads"][0]
        assert unchanged["outcome"] == "unchanged" and unchanged["version"] == "1.0.0"

        make_version(root, keys["ci"], "1.1.0")
        stable, canary = (await http.post("/admin/models/reload")).json()["reloads"]
        assert stable == {
            "model": "tiny",
            "role": "stable",
            "outcome": "loaded",
            "version": "1.1.0",
            "share": None,
            "reason": None,
            "message": None,
        }
        assert canary["role"] == "canary" and canary["outcome"] == "unchanged"
        assert await version_of_a_reply() == "1.1.0"
        # A connection's next request goes to the version served now.
        assert (await kept.complete("hi", max_tokens=2)).model_version == "1.1.0"
        await kept.close()

        _changed(make_version(root, keys["ci"], "1.2.0"), keys)  # tampered after signing
        refused = (await http.post("/admin/models/reload")).json()["reloads"][0]
        assert refused["outcome"] == "refused" and refused["reason"] == "changed_file"
        assert refused["version"] == "1.1.0" and "weights.bin" in refused["message"]
        assert await version_of_a_reply() == "1.1.0"  # the running version goes on
        ready = await http.get("/healthz", params={"check": "model+signature"})
        assert ready.status_code == 200 and ready.json()["models"] == {"tiny": "1.1.0"}

        Registry(root).promote("tiny", "1.0.0")  # a rollback is a promote
        back = (await http.post("/admin/models/reload")).json()["reloads"][0]
        assert back["outcome"] == "loaded" and back["version"] == "1.0.0"
    server.stop()
    records = [json.loads(line) for line in audit_file.read_text().splitlines()]
    events = [(r["action"], r["version"], r.get("reason")) for r in records if r["kind"] == "model"]
    assert events == [
        ("loaded", "1.0.0", None),
        ("loaded", "1.1.0", None),
        ("retired", "1.0.0", None),
        ("refused", "1.2.0", "changed_file"),
        ("loaded", "1.0.0", None),
        ("retired", "1.1.0", None),
    ]


def test_a_refused_version_stops_the_start_with_its_reason(
    tmp_path: Path, keys: dict[str, Path]
) -> None:
    root = tmp_path / "registry"
    _extra(make_version(root, keys["ci"], "1.0.0"), keys)
    trust = str(keys["ci"]) + ".pub"
    stderr = serve_fails("--model-registry", str(root), "--model-trust", trust, "--model", "tiny")
    assert (
        "model tiny 1.0.0 refused (extra_file): sub/loot.py is not in the signed manifest" in stderr
    )
    stderr = serve_fails("--model-registry", str(root), "--model", "tiny")
    assert "--model-registry needs --model-trust" in stderr


@one_process_only("--model-registry is refused with workers")
async def test_a_registry_serves_versions_in_model_signings_format(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    key, pub = ec_key(tmp_path)
    root = tmp_path / "registry"
    make_version(root, key, "1.0.0", signature_format="openssf")
    config, admin = admin_config(tmp_path)
    server = make_server(
        model_registry=str(root),
        model_trust=(str(pub),),
        model="tiny",
        model_watch_s=0,
        config_file=str(config),
        access=load_access(config),
    )

    async def version_of_a_reply() -> str:
        async with connect(server.url, api_key=admin) as session:
            return (await session.complete("hi", max_tokens=3)).model_version or ""

    async def reload() -> dict[str, object]:
        answer = await http.post("/admin/models/reload")
        return answer.json()["reloads"][0]  # type: ignore[no-any-return]

    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=server.http_url, headers=headers) as http:
        assert await version_of_a_reply() == "1.0.0"
        _changed(make_version(root, key, "1.1.0", signature_format="openssf"), {})
        refused = await reload()
        assert refused["outcome"] == "refused" and refused["reason"] == "changed_file"
        assert "weights.bin" in str(refused["message"]) and await version_of_a_reply() == "1.0.0"
        # Seedance's manifest written, then the whole version signed with model_signing's tool.
        folder = make_version(root, key, "1.2.0", signature_format="openssf")
        (folder / "model.sig").unlink()
        assert model_signing("sign", key, folder).returncode == 0
        loaded = await reload()
        assert loaded["outcome"] == "loaded" and loaded["version"] == "1.2.0"
        assert await version_of_a_reply() == "1.2.0"


@pytest.mark.model
@one_process_only("--model-registry is refused with workers")
async def test_a_new_version_is_swapped_in_while_8_streams_run_on_the_old_one(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    """The embedded model, twice in the registry: eight streams start on 1.0.0, 1.1.0 is
    promoted and swapped in by the watcher while they run, and every stream ends on the
    version it started with; a request after the swap gets 1.1.0."""
    gguf = default_model_path()
    root = tmp_path / "registry"
    for version in ("1.0.0", "1.1.0"):
        folder = root / "smollm2" / version
        folder.mkdir(parents=True)
        place(gguf, folder)
        sign_version(
            folder,
            keys["ci"],
            name="smollm2",
            version=version,
            git_commit="0123abcd",
            engine="llamacpp",
            # repack fixed: "auto" would measure both layouts while the streams run ("off":
            # the layout every CPU runs).
            engine_options={"parallel": 8, "n_ctx": 8 * 512, "threads": 2, "repack": "off"},
        )
    Registry(root).promote("smollm2", "1.0.0")
    server = registry_server(make_server, root, keys, model="smollm2", model_watch_s=0.2)

    async def stream(i: int) -> str:
        async with connect(server.url) as session:
            reply = session.generate(f"Count to twenty, story {i}.", max_tokens=60, temperature=0)
            async for _ in reply:
                pass
            assert reply.done is not None and reply.done.usage.completion_tokens > 0
            return reply.done.model_version or ""

    probes: list[tuple[int, str | None]] = []

    async def probe() -> None:  # readiness all through the reload
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            while True:
                answer = await http.get("/healthz", params={"check": "model+signature"})
                probes.append((answer.status_code, answer.json()["models"]["smollm2"]))
                await asyncio.sleep(0.05)

    running = [asyncio.create_task(stream(i)) for i in range(8)]
    probing = asyncio.create_task(probe())
    await asyncio.sleep(0.5)  # all eight admitted on 1.0.0
    old_engine = server.state.models["smollm2"].engine
    Registry(root).promote("smollm2", "1.1.0")
    versions = await asyncio.gather(*running)
    assert versions == ["1.0.0"] * 8
    for _ in range(100):
        if server.state.models["smollm2"].version == "1.1.0":
            break
        await asyncio.sleep(0.1)
    async with connect(server.url) as session:
        after = await session.complete("Hello", max_tokens=4)
    assert after.model_version == "1.1.0"
    assert server.state.models["smollm2"].engine is not old_engine
    probing.cancel()
    await asyncio.gather(probing, return_exceptions=True)
    assert {status for status, _ in probes} == {200}  # ready before, during and after
    assert {version for _, version in probes} == {"1.0.0", "1.1.0"}


@one_process_only("--model-registry is refused with workers")
async def test_a_canary_takes_its_share_of_sessions_sticky_then_is_promoted(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    root = tmp_path / "registry"
    make_version(root, keys["ci"], "1.0.0")
    make_version(root, keys["ci"], "1.1.0")
    registry = Registry(root)
    registry.promote("tiny", "1.0.0")
    registry.set_canary("tiny", "1.1.0", 0.2)
    server = registry_server(make_server, root, keys, model="tiny", model_watch_s=0.1)
    for _ in range(100):
        if "tiny" in server.state.models.canaries:
            break
        await asyncio.sleep(0.05)
    gate = asyncio.Semaphore(25)

    async def version(session_id: str) -> str:
        async with gate, connect(server.url, session_id=session_id) as session:
            return (await session.complete("x", max_tokens=1)).model_version or ""

    ids = [f"canary-{i}" for i in range(2000)]
    first = await asyncio.gather(*(version(i) for i in ids))
    share = first.count("1.1.0") / len(ids)
    assert set(first) == {"1.0.0", "1.1.0"} and 0.15 <= share <= 0.25, share
    again = await asyncio.gather(*(version(i) for i in ids[:200]))  # sticky per session
    assert again == first[:200]
    registry.promote("tiny", "1.1.0")  # the canary becomes the stable version
    for _ in range(100):
        if server.state.models["tiny"].version == "1.1.0" and not server.state.models.canaries:
            break
        await asyncio.sleep(0.05)
    assert await asyncio.gather(*(version(i) for i in ids[:50])) == ["1.1.0"] * 50
    samples, _ = scrape(server)  # the two versions, side by side on the dashboard
    ended = "seedance_model_version_requests_total"
    old = value(samples, ended, model="tiny", version="1.0.0", outcome="length")
    new = value(samples, ended, model="tiny", version="1.1.0", outcome="length")
    assert old == first.count("1.0.0") + again.count("1.0.0")
    assert new == first.count("1.1.0") + again.count("1.1.0") + 50
    ttft = "seedance_model_version_time_to_first_token_seconds_count"
    assert value(samples, ttft, model="tiny", version="1.1.0") == new


@one_process_only("--model-registry is refused with workers")
async def test_a_server_serves_several_registry_models_and_reloads_each(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    root = tmp_path / "registry"
    make_version(root, keys["ci"], "1.0.0", name="tiny")
    make_version(root, keys["ci"], "2.0.0", name="small")
    server = registry_server(make_server, root, keys, model_watch_s=0.1)  # no --model: all
    assert sorted(server.state.models) == ["small", "tiny"]

    async def version_of(model: str) -> str:
        async with connect(server.url, model=model) as session:
            return (await session.complete("x", max_tokens=1)).model_version or ""

    assert (await version_of("tiny"), await version_of("small")) == ("1.0.0", "2.0.0")
    make_version(root, keys["ci"], "2.1.0", name="small")
    for _ in range(100):
        if server.state.models["small"].version == "2.1.0":
            break
        await asyncio.sleep(0.05)
    assert (await version_of("tiny"), await version_of("small")) == ("1.0.0", "2.1.0")
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        ready = (await http.get("/healthz", params={"check": "model+signature"})).json()
    assert ready["models"] == {"tiny": "1.0.0", "small": "2.1.0"}


@pytest.mark.subprocess
@one_process_only("--registry is one process's")
async def test_readiness_fails_while_a_server_drains(
    tmp_path: Path, keys: dict[str, Path], server_process: Callable[..., ServerProcess]
) -> None:
    """The probes of a registry server through its drain: ready while it serves, refused
    (connection refused) once SIGTERM started the drain, which a running stream outlives."""
    root = tmp_path / "registry"
    folder = make_version(root, keys["ci"], "1.0.0")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["predicate"]["engine_options"] == {"tokens_per_s": 100}
    server = server_process(
        *("--model-registry", str(root), "--model-trust", str(keys["ci"]) + ".pub"),
        *("--model", "tiny", "--drain-timeout", "10"),
    )
    http = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=http) as client:
        for check in ("initial-load", "model+signature"):
            answer = await client.get("/healthz", params={"check": check})
            assert answer.status_code == 200 and answer.json()["models"] == {"tiny": "1.0.0"}
    async with connect(server.url) as session:
        stream = session.generate("x", max_tokens=300)  # 3 s at 100 tokens/s
        await stream.__anext__()
        server.signal()
        await server.logged("shutting down")
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=http) as client:
                await client.get("/healthz", params={"check": "model+signature"})
        done = await stream.collect()
    assert done.finish_reason == "length" and done.model_version == "1.0.0"


@one_process_only("--model-registry is refused with workers")
async def test_the_watcher_refuses_a_bad_version_once_and_a_reload_does_not_wait_for_streams(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    root = tmp_path / "registry"
    make_version(root, keys["ci"], "1.0.0")
    audit_file = tmp_path / "audit.jsonl"
    server = registry_server(
        make_server, root, keys, model="tiny", model_watch_s=0.05, audit_file=str(audit_file)
    )
    async with connect(server.url) as session:
        # A long reply on 1.0.0 runs through the reload: the swap does not wait for it.
        long = session.generate("x", max_tokens=400, temperature=0)  # 4 s at 100 tokens/s
        await long.__anext__()
        make_version(root, keys["ci"], "1.1.0")
        for _ in range(100):
            if server.state.models["tiny"].version == "1.1.0":
                break
            await asyncio.sleep(0.05)
        assert server.state.models["tiny"].version == "1.1.0"
        assert not long.done  # still streaming, on the old version
        done = await long.collect()
    assert done.model_version == "1.0.0" and done.usage.completion_tokens == 400
    # Published as a careful publisher does: signed elsewhere, then moved in at once.
    staging = tmp_path / "staging"
    _extra(make_version(staging, keys["ci"], "1.2.0"), keys)
    (staging / "tiny" / "1.2.0").rename(root / "tiny" / "1.2.0")
    await asyncio.sleep(1.0)  # some twenty ticks of the watcher
    server.stop()
    records = [json.loads(line) for line in audit_file.read_text().splitlines()]
    refused = [r for r in records if r["kind"] == "model" and r["action"] == "refused"]
    assert len(refused) == 1 and refused[0]["reason"] == "extra_file"
    retired = [r["version"] for r in records if r["kind"] == "model" and r["action"] == "retired"]
    assert retired[0] == "1.0.0"


@one_process_only("--model-registry is refused with workers")
async def test_a_version_copied_in_file_by_file_is_waited_for_then_checked_as_its_files_come(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    """``cp -r`` writes a version's files in any order: until its signature is there the version
    is waited for, and one refused for a file not there yet is checked again when it comes."""
    root = tmp_path / "registry"
    make_version(root, keys["ci"], "1.0.0")
    signed = make_version(tmp_path / "staging", keys["ci"], "1.1.0")
    server, admin, audit_file = admin_registry_server(make_server, root, keys, tmp_path)
    copy = root / "tiny" / "1.1.0"
    (copy / "sub").mkdir(parents=True)

    def copy_in(*names: str) -> None:
        for name in names:
            (copy / name).write_bytes((signed / name).read_bytes())

    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=server.http_url, headers=headers) as http:

        async def reload() -> dict[str, object]:
            return (await http.post("/admin/models/reload")).json()["reloads"][0]  # type: ignore[no-any-return]

        copy_in("weights.bin")
        waiting = await reload()
        assert waiting["outcome"] == "waiting" and waiting["reason"] == "unsigned"
        assert waiting["version"] == "1.0.0" and SIGNATURE in str(waiting["message"])
        copy_in(MANIFEST, SIGNATURE)
        refused = await reload()
        assert refused["outcome"] == "refused" and refused["reason"] == "missing_file"
        copy_in("sub/config.json")
        loaded = await reload()
        assert loaded["outcome"] == "loaded" and loaded["version"] == "1.1.0"
    server.stop()
    records = [json.loads(line) for line in audit_file.read_text().splitlines()]
    events = [(r["action"], r["version"], r.get("reason")) for r in records if r["kind"] == "model"]
    assert events[1:3] == [("refused", "1.1.0", "missing_file"), ("loaded", "1.1.0", None)]


# --------------------------------------------------------------------------- signed limits


@one_process_only("--model-registry is refused with workers")
async def test_signed_limits_refuse_on_every_api_naming_the_limit_and_the_version(
    tmp_path: Path, keys: dict[str, Path], make_server: Callable[..., RunningServer]
) -> None:
    """``seedance models sign --max-tokens 32``: a request for more is refused, on every API,
    with ``invalid_request`` naming the limit and the version; one that leaves a field out
    gets a default inside the limits."""
    import openai

    from tests.support.ws import generate, open_session

    root = tmp_path / "registry"
    limits = Limits(context_length=64, max_tokens=32, temperature=(0.0, 0.5), top_p=(0.5, 1.0))
    make_version(root, keys["ci"], "1.2.0", limits=limits)
    server = registry_server(make_server, root, keys, model="tiny", model_watch_s=0)
    named = "signed for model tiny version 1.2.0"

    ws, _ = await open_session(server.url)
    async with ws:
        for fields, what in (
            ({"max_tokens": 100}, "max_tokens: 100 is over the limit of 32"),
            ({"temperature": 0.9}, "temperature: 0.9 is outside the range 0 to 0.5"),
            ({"top_p": 0.2}, "top_p: 0.2 is outside the range 0.5 to 1"),
            ({"prompt": "word " * 80}, "over the context length of 64"),
        ):
            frames = await generate(ws, **{"prompt": "hi", **fields})
            error = frames[-1]["error"]
            assert error["code"] == "invalid_request" and what in error["message"], error
            assert named in error["message"]
        frames = await generate(ws, prompt="hi")  # no max_tokens, no temperature: inside
        assert frames[-1]["type"] == "done" and frames[-1]["usage"]["completion_tokens"] == 32

    client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100
        )
    assert "max_tokens: 100 is over the limit of 32" in str(chat.value) and named in str(chat.value)
    reply = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 32
    with pytest.raises(openai.BadRequestError) as responses:
        await client.responses.create(model="tiny", input="hi", max_output_tokens=100)
    assert "max_output_tokens: 100 is over the limit of 32" in str(responses.value)
    assert named in str(responses.value)

    realtime = openai.AsyncOpenAI(
        base_url=f"{server.http_url}/v1",
        websocket_base_url=f"ws://127.0.0.1:{server.port}/v1",
        api_key="x",
    )
    async with realtime.realtime.connect(model="tiny") as connection:
        await connection.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            }
        )
        await connection.response.create(response={"max_output_tokens": 100})
        async for event in connection:
            if event.type == "error":
                break
        assert "max_output_tokens: 100 is over the limit of 32" in event.error.message
        assert named in event.error.message
