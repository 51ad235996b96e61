"""Access policy: what a tenant may do once it is in, from the attributes in its table.

- ``models``: shell patterns of the model names it may use (default: all);
- ``max_priority``: the highest request ``priority`` it may ask for (default 0);
- ``labels``: for each label the server also has (``labels = { region = "eu-west" }`` in the
  server's config), the values the tenant accepts; a server elsewhere refuses it.

A denial is ``forbidden``. Roles (``user``, ``admin``) belong to credentials: only ``admin``
reaches the administrative endpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from seedance.protocol.errors import Forbidden
from seedance.tenants.auth import Principal


def may_use(principal: Principal, model: str) -> bool:
    patterns = principal.tenant.models
    return patterns is None or any(fnmatchcase(model, p) for p in patterns)


def check_model(principal: Principal, model: str, served: Iterable[str]) -> None:
    if may_use(principal, model):
        return
    allowed = sorted(m for m in served if may_use(principal, m))
    raise Forbidden(
        f"tenant {principal.name} may not use model {model!r}; "
        + (f"its models here: {', '.join(allowed)}" if allowed else "no model here is open to it")
    )


def check_priority(principal: Principal, priority: int) -> None:
    highest = principal.tenant.max_priority
    if priority > highest:
        raise Forbidden(
            f"priority {priority} is above tenant {principal.name}'s highest, {highest}"
        )


def check_labels(principal: Principal, server: Iterable[tuple[str, str]]) -> None:
    """The server's labels must be among those the tenant accepts, label by label."""
    for name, value in server:
        accepted = principal.tenant.labels.get(name)
        if accepted is None:
            continue
        values = [accepted] if isinstance(accepted, str) else accepted
        if value not in values:
            raise Forbidden(
                f"tenant {principal.name} is for {name} {', '.join(values)}; this server is "
                f"{name} {value}"
            )
