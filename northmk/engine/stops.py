"""Stop strings over a growing text: find a match, withhold what could still become one."""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to release.

    Text that could be the start of a stop string stays withheld until later text rules
    it out. On a match the text ends before the stop string (or after it with
    `include_stop`), and everything up to there is released.
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.include_stop = include_stop
        self.text = ""  # everything received
        self.released = 0  # len of the prefix of text already handed out
        self.matched: str | None = None

    def push(self, delta: str, check: bool = True) -> str:
        """Append a delta; return newly releasable text (empty if all of it is withheld).

        check=False (below min_tokens): no stop string may end in this delta; release it all.
        """
        assert self.matched is None, "push after a stop string matched"
        longest = max((len(s) for s in self.stops), default=0)
        search_from = max(self.released, len(self.text) - longest + 1)
        self.text += delta
        if not check:
            return self._release(len(self.text))
        end = self._match(search_from)
        if end is None:
            end = len(self.text) - self._partial_suffix()
        return self._release(end)

    def flush(self) -> str:
        """The sequence ended for another reason: release whatever is withheld."""
        return self._release(len(self.text)) if self.matched is None else ""

    def _match(self, search_from: int) -> int | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, self.matched = best
        self.text = self.text[: at + len(self.matched)]
        return at + len(self.matched) if self.include_stop else at

    def _partial_suffix(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        out = self.text[self.released : end]
        self.released = end
        return out
