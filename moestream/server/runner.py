"""uvicorn's server with a prompt shutdown: the engine's jobs are cancelled first, so open streams end at
once with their last chunk and `data: [DONE]` instead of being cut off after the grace period."""

from __future__ import annotations

import uvicorn


class Server(uvicorn.Server):
    def __init__(self, app, **config):
        super().__init__(uvicorn.Config(app, **config))
        self.worker = app.state.worker

    async def shutdown(self, sockets=None) -> None:
        self.worker.cancel_all()
        await super().shutdown(sockets=sockets)
