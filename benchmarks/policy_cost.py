"""What an access decision costs per request: the tenants table's rules in Python against Cedar
(``--policy``), side by side in one run, no server.

Each mode decides ``--decisions`` generation requests of one caller (a warm entity set, as a
server has for a caller it has seen), and prints the p50, p99 and p99.9 microseconds of a
decision, as JSON lines, and the CPU:

- ``table``: :func:`seedance.tenants.policy.check_model` and ``check_priority``;
- ``cedar-default``: ``default.cedar``, the same rules in Cedar;
- ``cedar-enterprise``: the default policy plus a model allow-list, a priority cap, a region
  condition, a business-hours window and a client network condition;

each Cedar mode twice: every decision asked of Cedar (``memo`` off: the cost of a caller, a
model or a context not seen before), and decisions kept (the server's way: the same caller
asking the same thing in the same context is answered from memory).

    python -m benchmarks.policy_cost
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from benchmarks.harness import cpu
from seedance.tenants import cedar, policy
from seedance.tenants.auth import Principal
from seedance.tenants.config import Tenant

ENTERPRISE = (
    cedar.DEFAULT_POLICY
    + """
@id("acme-models")
forbid (principal in Seedance::Tenant::"acme", action, resource is Seedance::Model)
unless { ["small", "medium"].contains(resource.name) };

@id("acme-priority")
forbid (principal in Seedance::Tenant::"acme", action == Seedance::Action::"generate", resource)
when { context.priority > 2 };

@id("acme-region")
forbid (principal in Seedance::Tenant::"acme", action, resource)
unless { context.region == "eu-west" };

@id("big-in-hours")
forbid (principal, action == Seedance::Action::"generate", resource == Seedance::Model::"big")
unless { context.weekday <= 5 && context.hour >= 8 && context.hour < 18 };

@id("lan-only")
forbid (principal, action, resource)
when { context has client && !context.client.isInRange(ip("10.0.0.0/8")) };
"""
)


def percentiles(samples: list[float]) -> dict[str, float]:
    samples.sort()
    n = len(samples)
    return {f"p{q}": round(samples[min(n - 1, int(n * q / 100))] * 1e6, 1) for q in (50, 99, 99.9)}


def timed(decide: Callable[[], object], count: int) -> list[float]:
    for _ in range(1000):  # warm
        decide()
    samples = []
    clock = time.perf_counter
    for _ in range(count):
        start = clock()
        decide()
        samples.append(clock() - start)
    return samples


def measure(decisions: int) -> dict[str, dict[str, float]]:
    """Each mode's percentiles (µs) over ``decisions`` decisions (see the module)."""
    served = ("small", "medium", "big")
    tenant = Tenant(name="acme", models=("small*", "medium"), max_priority=3)
    principal = Principal(tenant, "0a1b2c3d", "user")
    ask = cedar.Ask(
        principal, "generate", "small", "1.0.0", served, priority=2, qos="interactive",
        region="eu-west", client="10.1.2.3",
    )  # fmt: skip

    def table() -> None:
        policy.check_model(principal, "small", served)
        policy.check_priority(principal, 2)

    modes: dict[str, Callable[[], object]] = {"the tenants table (Python)": table}
    for name, text in (("cedar-default", cedar.DEFAULT_POLICY), ("cedar-enterprise", ENTERPRISE)):
        for memo in (False, True):
            policies = cedar.Policies(text, name)
            policies.memo = memo
            assert policies.decide(ask).allowed, name
            mode = f"{name}, {'kept' if memo else 'each by Cedar'}"
            modes[mode] = lambda policies=policies: policies.decide(ask)  # type: ignore[misc]
    return {name: percentiles(timed(decide, decisions)) for name, decide in modes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decisions", type=int, default=20_000)
    args = parser.parse_args()
    print(json.dumps({"cpu": cpu()}))
    for name, figures in measure(args.decisions).items():
        print(json.dumps({"mode": name, **figures}))


if __name__ == "__main__":
    main()
