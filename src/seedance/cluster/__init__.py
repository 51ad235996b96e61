"""Cluster mode (``--redis URL``): several nodes share one Redis.

- :mod:`~seedance.cluster.urls`: what ``--redis`` names: one server, or the primary of a
  service that Redis Sentinels watch (``sentinel://``).
- :mod:`~seedance.cluster.link`: this node's connection to Redis, its health (a node whose
  Redis is gone refuses new requests at once, retryable, and ``/healthz`` says why; behind
  sentinels it waits for the failover instead), and the key names (hash-tagged by session or
  tenant, so that Redis Cluster can shard them).
- :mod:`~seedance.cluster.claims`: what a running generation holds in Redis: its session's lock
  (one generation per session across nodes, with a fencing token), its tenant's quota
  reservation (requests and tokens per minute, concurrent generations: exact across nodes),
  renewed as a lease while the node lives.
- :mod:`~seedance.cluster.sessions`: sessions in Redis, so that any node serves any session.
- :mod:`~seedance.cluster.revocations`: a key revoked on one node is refused on every node.

Without ``--redis`` none of this is loaded and the server keeps everything in memory.
"""
