"""The server: the ASGI app (:func:`seedance.server.app.create_app`), the request core every
API goes through (:mod:`seedance.server.lifecycle`), the APIs, the transport and the runner."""
