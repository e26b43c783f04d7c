"""One routed request as the HTTP server sees it: submitted on the engine's loop, read as batches of token
records plus the text that is final so far, and aborted when its reader goes away."""
from __future__ import annotations

import asyncio

from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.service.output import RoutedOutput


class RoutedRequest:
    """Must be created and used on the engine's event loop. Raises what `Runtime.submit` raises:
    ValueError (bad request), EngineOverloaded, or a RuntimeError when the engine has failed."""

    def __init__(self, svc, prompt_ids: list[int], params, policy):
        self.svc = svc
        self.runtime = svc.runtime
        self.seq = self.runtime.submit(prompt_ids, params, policy)
        self.queue: asyncio.Queue = self.seq.stream
        self.done = False  # the finish sentinel was read (or `drain` saw the end)
        self.sent = 0  # characters of text handed out so far
        self.closed = False
        self._output: RoutedOutput | None = None

    async def records(self) -> list[TokenRecord]:
        """Every record that is ready (waits for at least one, or for the finish); [] once finished."""
        batch: list[TokenRecord] = []
        if self.done:
            return batch
        item = await self.queue.get()
        while item is not None:
            batch.append(item)
            if self.queue.empty():
                return batch
            item = self.queue.get_nowait()
        self.done = True
        return batch

    def new_text(self) -> str:
        """Text added since the last call. NOTE: while the request runs, a tail that could be the start of a
        stop string is held back, so streamed text never has to be taken back and always adds up to the
        final text."""
        if self.done:
            text = self.output().text
        else:
            text = self.seq.text
            text = text[:len(text) - held_back(text, self.seq.params.stop)]
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def output(self) -> RoutedOutput:
        """The finished request; only after `records()` returned the finish."""
        assert self.done, "output() before the request finished"
        if self._output is None:
            self._output = self.svc._output(self.seq)
        return self._output

    async def drain(self) -> RoutedOutput:
        """The finished request, without reading its records one step at a time (they are all in the output)."""
        await self.seq.ended.wait()
        self.done = True
        return self.output()

    def close(self, reason: str) -> None:
        """Abort the request if it still runs; its blocks are freed in every model at the next step boundary.
        Only the first call acts."""
        if self.closed:
            return
        self.closed = True
        if not self.done:
            self.runtime.abort(self.seq, reason)

    @property
    def aborted(self) -> str:
        """Why the engine aborted the request ("" unless it finished with reason abort)."""
        reason = self.seq.finish_reason
        return (reason.detail or "aborted") if reason is not None and reason.kind == "abort" else ""


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    for n in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0
