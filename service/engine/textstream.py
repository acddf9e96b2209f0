"""Per-request text out of generated token ids: complete UTF-8 only, stop sequences cut out.

What `push` returns is final: it is valid text and never holds the start of a stop sequence, since
every suffix that could still grow into one is held back until it either completes a stop or is
ruled out. Which stop wins does not depend on how the ids were chunked: the one that completes
first (smallest end offset; at equal ends the longer one, so less text goes out). Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from service.model.tokenizer import IncrementalDecoder, Tokenizer


class TextStream:
    """Wraps an IncrementalDecoder with stop sequences. After a stop, nothing more comes out."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special: bool = False):
        self._decoder = IncrementalDecoder(tokenizer, skip_special)
        self._stops = tuple(dict.fromkeys(s for s in stop if s))  # ordered, unique, non-empty
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stop: str | None = None  # the stop sequence that ended the text, once one has
        # False: stop sequences are not looked for (min_tokens not reached): text goes out whole
        self.armed = True

    @property
    def pending(self) -> str:
        """Decoded text held back because it may be the start of a stop sequence."""
        return self._held

    def push(self, ids: Iterable[int]) -> tuple[str, str | None]:
        """Feed generated ids; returns (text safe to emit, matched stop or None)."""
        if self.stop is not None:
            return "", self.stop
        return self._feed(self._decoder.push(ids))

    def finish(self) -> str:
        """End of generation: everything still held, up to a stop if the tail completes one."""
        if self.stop is not None:
            return ""
        text, stop = self._feed(self._decoder.flush())
        if stop is not None:
            return text
        rest, self._held = self._held, ""
        return text + rest

    def _feed(self, text: str) -> tuple[str, str | None]:
        buf = self._held + text
        if not self.armed:
            self._held = ""
            return buf, None
        hit = self._first_stop(buf)
        if hit is not None:
            start, self.stop = hit
            self._held = ""
            return buf[:start], self.stop
        keep = self._holdback(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        return None if best is None else (best[0] + best[1], best[2])

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop sequence."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
