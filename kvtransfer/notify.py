"""The notifications a prefill worker sends its decode worker over NIXL, one wire format for both.

- KV written: every write carries b"<request id>#<first head>:<end head>"; NIXL delivers it once all
  the write's bytes landed. A decode worker has a request's KV once these cover every KV head of
  every one of its ranks (`KVArrivals`). A bare b"<request id>" covers the receiving rank's heads.
- Push begun / ended: the prefill worker's leader tells the decode worker's rank 0 when it starts
  writing a request's KV (b"<request id>#push@<writer>") and when every write has ended, by
  completing (b"...#ok@<writer>") or by being aborted or failing (b"...#failed@<writer>"), after which
  nothing of that writer can land in the request's blocks any more. The decode worker times the
  transfer from "push" and releases the blocks of a cancelled request only after "ok"/"failed"
  (a fence, see decode_worker.request). `writer` names the prefill worker's NIXL agent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

PUSH, OK, FAILED, WRITE = "push", "ok", "failed", "write"
_CONTROL = (PUSH, OK, FAILED)


def kv_notification(request_id: str, heads: tuple[int, int]) -> bytes:
    return f"{request_id}#{heads[0]}:{heads[1]}".encode()


def push_notification(request_id: str, kind: str, writer: str) -> bytes:
    """Push begun (PUSH) or ended (OK / FAILED) for `request_id`, from prefill agent `writer`."""
    if kind not in _CONTROL:
        raise ValueError(f"unknown push notification kind {kind!r}")
    return f"{request_id}#{kind}@{writer}".encode()


@dataclass(frozen=True)
class Notification:
    request_id: str
    kind: str  # WRITE | PUSH | OK | FAILED
    heads: tuple[int, int] | None = None  # WRITE: heads carried (None: all of the receiving rank)
    writer: str = ""  # PUSH / OK / FAILED: the prefill agent


def parse_notification(notif: bytes | str) -> Notification:
    text = notif.decode() if isinstance(notif, (bytes, bytearray)) else notif
    rid, sep, tail = text.rpartition("#")
    if sep:
        lo, colon, hi = tail.partition(":")
        if colon and lo.isdigit() and hi.isdigit():
            return Notification(rid, WRITE, heads=(int(lo), int(hi)))
        kind, at, writer = tail.partition("@")
        if at and kind in _CONTROL:
            return Notification(rid, kind, writer=writer)
    return Notification(text, WRITE)


def parse_kv_notification(notif: bytes | str) -> tuple[str, tuple[int, int] | None]:
    """-> (request id, heads) of a KV-written notification; a bare request id -> (id, None)."""
    n = parse_notification(notif)
    return n.request_id, n.heads


def covers(got: list[tuple[int, int]], want: tuple[int, int]) -> bool:
    """Do the head ranges `got` together cover [want[0], want[1])?"""
    reach = want[0]
    for lo, hi in sorted(got):
        if lo > reach:
            return False
        reach = max(reach, hi)
        if reach >= want[1]:
            return True
    return reach >= want[1]


class KVArrivals:
    """Which heads of each request reached each rank; reports requests complete on all ranks.

    head_ranges : global KV heads [lo, hi) of each rank of this worker, by rank.
    Partial arrivals are dropped by `forget` (the request ended) or after `ttl_s`. One thread.
    """

    def __init__(self, head_ranges: list[tuple[int, int]], ttl_s: float = 600.0, clock=time.monotonic):
        self.head_ranges = list(head_ranges)
        self.ttl_s = ttl_s
        self.clock = clock
        self._got: dict[str, tuple[float, list[list[tuple[int, int]]]]] = {}

    def __len__(self) -> int:
        return len(self._got)

    def add(self, rank: int, request_id: str, heads: tuple[int, int] | None) -> bool:
        """Record one write on `rank`; True when the request's KV is now complete (reported once)."""
        now = self.clock()
        entry = self._got.setdefault(request_id, (now, [[] for _ in self.head_ranges]))
        entry[1][rank].append(heads or self.head_ranges[rank])
        if all(covers(g, want) for g, want in zip(entry[1], self.head_ranges)):
            del self._got[request_id]
            return True
        return False

    def feed(self, rank: int, notifs) -> list[str]:
        """Record rank `rank`'s KV-written notifications; the request ids now complete."""
        done = [n.request_id for n in map(parse_notification, notifs)
                if n.kind == WRITE and self.add(rank, n.request_id, n.heads)]
        self.expire()
        return done

    def forget(self, request_id: str) -> None:
        self._got.pop(request_id, None)

    def expire(self) -> None:
        if self._got:
            now = self.clock()
            for rid in [r for r, (t, _) in self._got.items() if now - t > self.ttl_s]:
                del self._got[rid]
