"""Server-sent events as vLLM's OpenAI server writes them: the ``data:`` payloads of a stream, in order."""

from __future__ import annotations


def data_payloads(body: bytes) -> list[bytes]:
    """Each event's ``data:`` lines joined, in order; events without data (comments, keep-alives) and the
    closing ``[DONE]`` are left out. Events end at a blank line (``\\n\\n`` or ``\\r\\n\\r\\n``)."""
    out = []
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
        if data and data.strip() != b"[DONE]":
            out.append(data)
    return out
