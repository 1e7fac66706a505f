"""Typed errors of KV transfer, so callers can tell bad input from a failed move."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A KV transfer could not be planned, started or completed (peer gone, timeout, bad input).

    The agent stays usable for other peers and requests after raising it.
    """


class KVLayoutError(KVTransferError, ValueError):
    """The request itself is wrong: block ids out of range, incompatible pool layouts, unknown
    pool or peer. Nothing was moved."""
