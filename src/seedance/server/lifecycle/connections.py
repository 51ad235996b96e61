"""A connection counted against its tenant's ``connections`` quota, by every API that keeps
one open (``/v2/infer``, the Realtime API): on this node, and across the cluster (or the
workers) when the tenant has that quota (:mod:`seedance.cluster.connections`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seedance.server.lifecycle.services import Services
    from seedance.tenants.config import Quotas


class Counted:
    """A connection's place in its tenant's count, given back once with :meth:`release`."""

    def __init__(self, services: Services, tenant: str, member: str | None) -> None:
        self.services = services
        self.tenant = tenant
        self.member = member  # the cluster's count (None: this node's alone)

    def release(self) -> None:
        services = self.services
        services.usage.close_connection(self.tenant)
        if self.member is not None and services.cluster is not None:
            services.cluster.connections.close(self.member)
            self.member = None


async def count_connection(services: Services, tenant: str, quotas: Quotas) -> Counted:
    """Count a new connection of ``tenant``, or refuse it (``quota_exceeded``)."""
    services.usage.open_connection(tenant, quotas)
    cluster, limit = services.cluster, quotas.connections
    if cluster is None or limit is None:
        return Counted(services, tenant, None)
    try:
        member = await cluster.connections.open(tenant, limit)
    except BaseException:
        services.usage.close_connection(tenant)
        raise
    return Counted(services, tenant, member)
