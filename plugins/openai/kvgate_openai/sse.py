"""A minimal Server-Sent Events decoder: bytes in, `data:` payloads out.

Lines end with \\n or \\r\\n (sse-starlette, used by llama.cpp's Python server, sends \\r\\n);
an event ends at a blank line; several `data:` lines of one event are joined with \\n.
An event may hold at most `max_event_bytes`: an upstream that never ends its line (or its event)
cannot make us buffer without end.
"""

from __future__ import annotations

DEFAULT_MAX_EVENT = 8 * 1024 * 1024


class EventTooLarge(ValueError):
    pass


class SSEDecoder:
    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT):
        self.max_event_bytes = max_event_bytes
        # An unfinished line, in the pieces it came in: joined once, when its end arrives (copying
        # it at every read would make one long line cost its length squared).
        self._tail: list[bytes] = []
        self._tail_bytes = 0
        self._data: list[bytes] = []
        self._held = 0  # bytes in self._data

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of every event completed by `chunk`; EventTooLarge past the bound."""
        if b"\n" not in chunk:
            self._tail.append(chunk)
            self._tail_bytes += len(chunk)
            self._check_size()
            return []
        lines = (b"".join(self._tail) + chunk if self._tail else chunk).split(b"\n")
        last = lines.pop()  # an unfinished line waits for the next chunk
        self._tail, self._tail_bytes = ([last], len(last)) if last else ([], 0)
        out = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data, self._held = [], 0
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
                self._held += len(line)
            # comments (":"), event:, id: and retry: lines carry nothing we use
        self._check_size()
        return out

    def _check_size(self) -> None:
        if self._held + self._tail_bytes > self.max_event_bytes:
            raise EventTooLarge(f"a stream event is over {self.max_event_bytes} bytes")

    def close(self) -> list[bytes]:
        """Whatever a stream that ended without a final blank line still holds."""
        return self.feed(b"\n\n") if (self._tail or self._data) else []
