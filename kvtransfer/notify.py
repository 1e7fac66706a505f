"""The notification a KV write carries to its decode rank: which request, which KV heads.

One wire format for both sides: a prefill rank writes b"<request id>#<first head>:<end head>";
a decode leader admits the request once notifications cover every head of every rank.
"""

from __future__ import annotations


def kv_notification(request_id: str, heads: tuple[int, int]) -> bytes:
    return f"{request_id}#{heads[0]}:{heads[1]}".encode()


def parse_kv_notification(notif: bytes | str) -> tuple[str, tuple[int, int] | None]:
    """-> (request id, heads); a bare request id -> (id, None): it covers every head of the
    receiving rank."""
    text = notif.decode() if isinstance(notif, (bytes, bytearray)) else notif
    rid, sep, tail = text.rpartition("#")
    if sep:
        lo, colon, hi = tail.partition(":")
        if colon and lo.isdigit() and hi.isdigit():
            return rid, (int(lo), int(hi))
    return text, None
