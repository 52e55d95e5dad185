"""Graceful shutdown: a uvicorn server whose first SIGTERM (or Ctrl-C) drains the engine.

Draining: new requests get 503 (and ``/health/ready`` turns 503, so a load balancer stops
sending them), requests in flight run to their end for up to ``grace`` seconds, then whatever
still runs is cancelled (finish reason "abort"); then the server stops and the process exits
with status 0. A second signal stops at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, app: FastAPI, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.app = app
        self.grace = grace
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        engine = getattr(self.app.state, "engine", None)
        if self._draining or self.should_exit or engine is None or engine.loop is None:
            # A second signal, or one before the engine started: stop now (uvicorn re-raises
            # nothing, so the exit status stays that of a clean stop).
            self.force_exit = self._draining or self.should_exit
            self.should_exit = True
            return
        self._draining = True
        logger.warning("%s: draining %d request(s) for up to %.0f s; new requests get 503",
                       signal.Signals(sig).name, engine.metrics.in_flight, self.grace)
        future = asyncio.run_coroutine_threadsafe(engine.drain(self.grace), engine.loop)
        future.add_done_callback(lambda _: setattr(self, "should_exit", True))
