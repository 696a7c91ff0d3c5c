"""Incremental detokenization with stop strings held back until they are ruled out."""

from __future__ import annotations

from typing import Protocol


class _Tok(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into safe-to-send text.

    Decodes a short window of tokens per step (vLLM's prefix/read offsets), so the cost
    per token is constant. Text that could be the start of a stop string is held back;
    when a stop string appears, the text is cut before it (or after it with
    include_stop_str_in_output) and `stopped` is set.
    """

    def __init__(self, tokenizer: _Tok, stop: list[str], include_stop: bool = False):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.text = ""          # all text decoded so far
        self.sent = 0           # chars of self.text already handed out
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped: str | None = None

    def add(self, token_id: int) -> str:
        """Adds one generated token; returns newly safe text (may be "")."""
        if self.stopped is not None:
            return ""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.stop:
                self._find_stop(max(0, start - self.max_stop + 1))
        return self._release()

    def _find_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped = s

    def _release(self) -> str:
        end = len(self.text)
        if self.stopped is None and self.stop:
            # Hold back the longest suffix that is a proper prefix of some stop string.
            for k in range(min(self.max_stop - 1, end - self.sent), 0, -1):
                tail = self.text[end - k:]
                if any(s.startswith(tail) for s in self.stop):
                    end -= k
                    break
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def flush(self) -> str:
        """At the end of generation: everything not yet sent (a partial stop string is text)."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out
