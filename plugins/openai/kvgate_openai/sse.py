"""A minimal Server-Sent Events decoder: bytes in, `data:` payloads out.

Lines end with \\n or \\r\\n (sse-starlette, used by llama.cpp's Python server, sends \\r\\n);
an event ends at a blank line; several `data:` lines of one event are joined with \\n.
"""

from __future__ import annotations


class SSEDecoder:
    def __init__(self):
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of every event completed by `chunk`."""
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()  # an unfinished line waits for the next chunk
        out = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            # comments (":"), event:, id: and retry: lines carry nothing we use
        return out

    def close(self) -> list[bytes]:
        """Whatever a stream that ended without a final blank line still holds."""
        return self.feed(b"\n\n") if (self._tail or self._data) else []
