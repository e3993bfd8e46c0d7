"""uvicorn's server with a prompt shutdown: the engine's jobs are cancelled first, so open streams end at
once with their last chunk and `data: [DONE]` instead of being cut off after the grace period. A connection
that does not send a whole request's headers within the app's `request_timeout_s` is closed (uvicorn times
out only the idle time after a response), so idle and half-sent connections do not pile up."""

from __future__ import annotations

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class Server(uvicorn.Server):
    def __init__(self, app, **config):
        timeout = app.state.settings.request_timeout_s
        protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": timeout})
        super().__init__(uvicorn.Config(app, http=protocol, **config))
        self.worker = app.state.worker

    async def shutdown(self, sockets=None) -> None:
        self.worker.cancel_all()
        await super().shutdown(sockets=sockets)


class TimedH11Protocol(H11Protocol):
    """Closes a connection whose request headers have not all arrived `header_timeout` seconds after it opened or
    after its first bytes past a response (between requests, uvicorn's keep-alive timeout applies)."""

    header_timeout = 30.0
    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout, self._no_request)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        in_request = self.cycle is not None and not self.cycle.response_complete
        if in_request and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        elif not in_request and self._header_timer is None:  # bytes of a next request after a response
            self._header_timer = self.loop.call_later(self.header_timeout, self._no_request)

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _no_request(self) -> None:
        self._header_timer = None
        in_request = self.cycle is not None and not self.cycle.response_complete
        if not in_request and not self.transport.is_closing():
            self.transport.close()
