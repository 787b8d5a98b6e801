"""Who runs: the admission gate (at most `active` requests at once, `waiting` more queued, 503
beyond), and `Serving`, what every route shares (the engine, the gate, the worker threads)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from ..engine import CacheClipEngine
from ..storage.backends.base import StoreUnavailableError


class Gate:
    """At most `active` requests run; up to `waiting` more queue; beyond that, 503."""

    def __init__(self, active: int, waiting: int):
        self.active, self.waiting = active, waiting
        self._sem: asyncio.Semaphore | None = None
        self.running = 0
        self.queued = 0

    async def enter(self) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.active)
        if self._sem.locked():
            if self.queued >= self.waiting:
                raise HTTPException(503, f"server busy: {self.active} requests running and {self.queued} waiting; retry later")
            self.queued += 1
            try:
                await self._sem.acquire()
            finally:
                self.queued -= 1
        else:
            await self._sem.acquire()
        self.running += 1

    def leave(self) -> None:
        self.running -= 1
        self._sem.release()


@dataclass
class Serving:
    """What the routes share, kept on `app.state.serving`: the engine, the gate, the worker
    threads, the model name answered with, and the default max_tokens."""

    engine: CacheClipEngine
    gate: Gate
    pool: ThreadPoolExecutor
    served: str
    default_max_tokens: int

    async def in_thread(self, fn: Callable, *args) -> Any:
        """fn(*args) on a worker thread; the engine's ValueError is a 400, a store outage a 503."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except StoreUnavailableError as err:  # a ValueError too: caught first
            raise HTTPException(503, f"store unavailable: {err}") from err
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
