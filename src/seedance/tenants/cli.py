"""``seedance policy check | validate | default | schema``: access policies in Cedar from the
command line (docs/policy.md)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    policy = commands.add_parser(
        "policy",
        help="check and try Cedar access policies",
        description="A server started with --policy FILE decides who may do what with the Cedar "
        "policies in FILE (docs/policy.md).",
    )
    actions = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    validate = actions.add_parser("validate", help="check FILE against Seedance's schema")
    validate.add_argument("file", type=Path, metavar="FILE")
    actions.add_parser("default", help="print the tenants table's rules as Cedar")
    actions.add_parser("schema", help="print Seedance's Cedar schema")
    check = actions.add_parser(
        "check",
        help="may a caller do an action? (exit 0: allowed, 1: denied)",
        description="Answers as a server with --policy FILE and the tenants of --config would.",
    )
    check.add_argument("--policy", type=Path, metavar="FILE", help="default: the table's rules")
    check.add_argument(
        "--config",
        metavar="FILE.toml",
        default=os.environ.get("SEEDANCE_CONFIG"),
        help="the server's TOML config file, with its tenants (env SEEDANCE_CONFIG)",
    )
    who = check.add_mutually_exclusive_group(required=True)
    who.add_argument("--key", metavar="KEY_ID", help="the caller: an API key, by its id")
    who.add_argument("--tenant", metavar="NAME", help="the caller: a tenant (with --role)")
    check.add_argument("--role", choices=("user", "admin"), default="user")
    check.add_argument("--subject", default="", help="a certificate's subject, a token's sub")
    check.add_argument(
        "--claim",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a token's string claim (its caller's tag); repeatable",
    )
    check.add_argument(
        "--action", required=True, help="generate, embed, use, or an administrative verb"
    )
    check.add_argument("--model", help="the model (not for administrative verbs)")
    check.add_argument("--version", default="", help="the model's version")
    check.add_argument("--served", help="the models the server serves (default: --model)")
    check.add_argument("--priority", type=int, default=0)
    check.add_argument("--qos", default="")
    check.add_argument("--region", default="", help="the server's region label")
    check.add_argument("--client", help="the client's IP address")
    check.add_argument("--e2e", action="store_true", help="an end-to-end encrypted stream")
    check.add_argument("--tools", action="store_true", help="the request offers tools")
    check.add_argument(
        "--at", type=datetime.datetime.fromisoformat, help="when (ISO 8601; default: now)"
    )
    check.add_argument("--timezone", default="UTC", help="the policy time zone")


def run(args: argparse.Namespace) -> int:
    from seedance.config import ConfigError
    from seedance.tenants import cedar

    command = args.policy_command
    if command == "default":
        print(cedar.DEFAULT_POLICY, end="")
        return 0
    if command == "schema":
        print(cedar.SCHEMA, end="")
        return 0
    try:
        if command == "validate":
            policies = cedar.load(args.file)
            print(f"{args.file}: {policies.count} policies, valid against Seedance's schema")
            return 0
        return _check(args)
    except (cedar.PolicyError, ConfigError) as exc:
        print(f"seedance policy {command}: error: {exc}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> int:
    from seedance.config import ConfigError
    from seedance.config_loader import load_access
    from seedance.tenants import cedar
    from seedance.tenants.auth import Principal
    from seedance.tenants.config import AccessConfig

    access = (load_access(Path(args.config)) if args.config else None) or AccessConfig()
    where = args.config or "the config (--config)"
    claims = []
    for claim in args.claim:
        name, equals, value = claim.partition("=")
        if not equals or not name:
            raise ConfigError(f"--claim: NAME=VALUE, got {claim!r}")
        claims.append((name, value))
    who = {"subject": args.subject, "claims": tuple(sorted(claims))}
    if args.key is not None:
        found = [(t, k) for t in access.tenants.values() for k in t.keys if k.id == args.key]
        if not found:
            raise ConfigError(f"no key {args.key} in {where}")
        tenant, key = found[0]
        principal = Principal(tenant, key.id, key.role, **who)
    else:
        named = access.tenants.get(args.tenant)
        if named is None:
            raise ConfigError(f"no tenant {args.tenant} in {where}")
        principal = Principal(named, f"{named.name}:{args.role}", args.role, **who)
    served = tuple(args.served.split(",")) if args.served else tuple(filter(None, [args.model]))
    at = args.at
    if at is not None and at.tzinfo is None:
        at = at.replace(tzinfo=datetime.timezone.utc)
    ask = cedar.Ask(
        principal, args.action, args.model, args.version, served, priority=args.priority,
        qos=args.qos, region=args.region, e2e=args.e2e, tools=args.tools, client=args.client,
        at=at,
    )  # fmt: skip
    if args.policy is None:
        policies = cedar.Policies(cedar.DEFAULT_POLICY, "the default policy", args.timezone)
    else:
        policies = cedar.load(args.policy, args.timezone)
    decision = policies.decide(ask)
    for error in decision.errors:
        print(f"note: {error}", file=sys.stderr)
    if decision.allowed:
        print(f"allow ({', '.join(decision.policies)})")
        return 0
    print(f"deny: {decision.explain(ask)}")
    return 1
