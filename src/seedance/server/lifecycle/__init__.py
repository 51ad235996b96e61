"""The request core that every API goes through (docs/architecture.md draws it).

- :mod:`.models`: the served models, the one place a model is resolved and its limits applied;
- :mod:`.admit`: the recipe before admission, and admission itself, written once;
- :mod:`.refusals`: the one reporter of calls that were not admitted;
- :mod:`.generation`: one admitted request, from its admission slot to its last frame;
- :mod:`.generations`: the running ones, where their stream logs open and close;
- :mod:`.reader`: the one reader of a stream log, from a cursor;
- :mod:`.peers`: every open connection, socket and HTTP call, behind one protocol;
- :mod:`.drain`: the server's drain; :mod:`.audit`: the audit gate;
- :mod:`.takeover`: a dead node's generation continued through admission's tail;
- :mod:`.services`: the parts above, as the APIs are handed them.
"""
