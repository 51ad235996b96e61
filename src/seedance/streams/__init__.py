"""Stream logs: every frame of a generation, kept so that a reply outlives its connection.

- :mod:`~seedance.streams.log`: one generation's log and the readers that follow it;
- :mod:`~seedance.streams.store`: the logs of every session, their epoch and retention (in
  memory here; the cluster mode keeps them in Redis behind the same interface).
"""
