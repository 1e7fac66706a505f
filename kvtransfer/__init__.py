"""Moving paged KV blocks between worker ranks with NIXL (RDMA/NVLink on GPUs, UCX/TCP on CPU).

``plan`` decides which byte ranges move (including head re-sharding when prefill TP != decode
TP: packed through ``staging`` by the sender, or slotted and put in place by the receiver,
``reshard``); ``agent`` owns the NIXL agent, memory registration, handshake and notifications.
"""

from pdserve.kvtransfer.agent import KVTransferAgent, TransferHandle
from pdserve.kvtransfer.errors import KVLayoutError, KVTransferError
from pdserve.kvtransfer.layout import PoolLayout, head_range, heads_overlap
from pdserve.kvtransfer.plan import PoolCopy, plan_copy, plan_pool_copy

__all__ = [
    "KVLayoutError", "KVTransferAgent", "KVTransferError", "PoolCopy", "PoolLayout",
    "TransferHandle", "head_range", "heads_overlap", "plan_copy", "plan_pool_copy",
]
