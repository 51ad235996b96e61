"""``seedance models keygen | sign | verify | list | promote``: the registry's commands, for the
CI pipeline that signs a model and the operators who promote it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    models = commands.add_parser(
        "models",
        help="sign, verify and promote models of a registry",
        description="A registry is a directory of NAME/VERSION/ holding a model's files, a "
        "manifest (every file's SHA-256 and size, the version, the git commit, the engine, the "
        "limits) and its signature: Seedance's (Ed25519) or OpenSSF model-signing's (an EC "
        "key) (docs/models.md).",
    )
    actions = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    new_key = actions.add_parser("keygen", help="make a signing key (KEYFILE) and KEYFILE.pub")
    new_key.add_argument("key", type=Path, metavar="KEYFILE")
    signing = actions.add_parser(
        "sign", help="write DIR's manifest (every file hashed) and sign it"
    )
    signing.add_argument("directory", type=Path, metavar="DIR")
    signing.add_argument(
        "--key",
        type=Path,
        required=True,
        help="the private key: Ed25519 (keygen), or EC P-256/384/521 for --format openssf",
    )
    signing.add_argument(
        "--format",
        choices=("seedance", "openssf"),  # registry.SIGNATURE_FORMATS, not imported here
        default="seedance",
        help="seedance: manifest.sig; openssf: OpenSSF model-signing's model.sig over every "
        "file, manifest.json included, which `model_signing verify key` accepts",
    )
    signing.add_argument("--name", required=True, help="the model's served name")
    signing.add_argument("--version", required=True, help="a semantic version: 1.4.0")
    signing.add_argument("--commit", required=True, help="the git commit it was built from")
    signing.add_argument("--engine", required=True, help="the engine that serves it")
    signing.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine option (repeat): n_ctx=4096",
    )
    signing.add_argument("--context-length", type=int, help="the longest context a request may use")
    signing.add_argument("--max-tokens", type=int, help="the largest max_tokens a request may ask")
    checking = actions.add_parser("verify", help="check DIR's signature and every file")
    checking.add_argument("directory", type=Path, metavar="DIR")
    listing = actions.add_parser("list", help="the registry's models, versions and promoted ones")
    listing.add_argument("root", type=Path, metavar="REGISTRY")
    for command in (checking, listing):
        command.add_argument(
            "--trust",
            type=Path,
            action="append",
            default=[],
            metavar="KEY.pub",
            help="a trusted public key (repeat; list: also verifies every version)",
        )
    checking.add_argument("--served", help="the version served now (a lower one is refused)")
    promoting = actions.add_parser("promote", help="serve VERSION of NAME by default")
    canary = actions.add_parser(
        "canary", help="give VERSION of NAME a share of the sessions (--off: no canary)"
    )
    for command in (promoting, canary):
        command.add_argument("root", type=Path, metavar="REGISTRY")
        command.add_argument("name", metavar="NAME")
    promoting.add_argument("version", metavar="VERSION")
    canary.add_argument("version", metavar="VERSION", nargs="?")
    canary.add_argument("--share", type=float, default=0.1, help="the share (default 0.1)")
    canary.add_argument("--off", action="store_true", help="remove the canary")


def _option(text: str) -> tuple[str, str | int | float | bool]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--option: NAME=VALUE, got {text!r}")
    for parse in (int, float):
        try:
            return name, parse(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, value


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: every seedance command builds this parser.
    from seedance.models.registry import Limits, ModelRefused, Registry, sign_version, verify
    from seedance.models.signing import keygen, load_trusted

    command = args.models_command
    if command == "keygen":
        public, key_id = keygen(args.key)
        print(f"wrote {args.key} (private: keep it in your CI's secrets) and {public}")
        print(f"key id {key_id}")
        return 0
    if command == "sign":
        try:
            manifest = sign_version(
                args.directory,
                args.key,
                name=args.name,
                version=args.version,
                git_commit=args.commit,
                engine=args.engine,
                engine_options=dict(_option(o) for o in args.option),
                limits=Limits(context_length=args.context_length, max_tokens=args.max_tokens),
                signature_format=args.format,
            )
        except (OSError, ValueError) as exc:
            print(f"sign: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {manifest} and its signature")
        return 0
    if command == "promote":
        Registry(args.root).promote(args.name, args.version)
        print(f"{args.name}: {args.version} promoted")
        return 0
    if command == "canary":
        if args.off or args.version is None:
            Registry(args.root).set_canary(args.name, None)
            print(f"{args.name}: no canary")
        else:
            Registry(args.root).set_canary(args.name, args.version, args.share)
            print(f"{args.name}: {args.version} takes {args.share:g} of the sessions")
        return 0
    try:
        trusted = load_trusted(args.trust)
    except ValueError as exc:
        print(f"--trust: {exc}", file=sys.stderr)
        return 2
    if command == "verify":
        if not trusted:
            raise SystemExit("verify: give the trusted public key(s) with --trust")
        try:
            model = verify(args.directory, trusted, served=args.served)
        except ModelRefused as exc:
            print(f"refused ({exc.reason}): {exc.message}", file=sys.stderr)
            return 1
        commit = model.manifest.git_commit
        built = f"commit {commit}, engine " if commit else "engine "
        print(
            f"ok: {model.name} {model.version} ({built}{model.manifest.engine}), "
            f"{len(model.files)} file(s), signed by key {model.key.id}"
        )
        return 0
    registry = Registry(args.root)
    for name in registry.names():
        promoted = registry.promoted(name)
        for version in registry.versions(name):
            state = ""
            if trusted:
                try:
                    verify(registry.path(name, version), trusted)
                    state = "  verified"
                except ModelRefused as exc:
                    state = f"  REFUSED ({exc.reason}: {exc.message})"
            mark = "*" if version == promoted else " "
            print(f"{mark} {name} {version}{state}")
    return 0
