"""kvtransfer: descriptor planning (pure numpy, exhaustive over TP pairs) and real NIXL/UCX
transfers between processes on 127.0.0.1 (page writes, reads, head re-sharding, failures)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
import traceback

import numpy as np
import pytest
import torch

from pdserve.kvtransfer import (
    KVLayoutError,
    KVTransferAgent,
    KVTransferError,
    PoolLayout,
    head_range,
    heads_overlap,
    plan_copy,
    plan_pool_copy,
)
from pdserve.kvtransfer.handshake import decode_peer_info, encode_peer_info, peer_info_message
from pdserve.kvtransfer.notify import kv_notification
from pdserve.kvtransfer.plan import (
    can_stage,
    merge_contiguous,
    pack_pages,
    plan_staging_nbytes,
    staged_nbytes,
)
from pdserve.kvtransfer.reshard import (
    SlottedArrivals,
    decode_blocks,
    encode_blocks,
    encode_slots,
    unpack_slotted,
)
from pdserve.kvtransfer.staging import StagingBuffer

H = 8  # gpt-oss KV heads


def _layout(name="full", *, layers=2, blocks=5, page=4, heads=(0, H), dim=4, dtype="bfloat16",
            addr=4096, device="cpu"):
    return PoolLayout(name, addr, (layers, blocks, 2, page, heads[1] - heads[0], dim), dtype,
                      device, heads[0], heads[1])


# ------------------------------------------------------------------------------------------------
# plan: which bytes go where (no NIXL)
# ------------------------------------------------------------------------------------------------

def _apply(copy, src_bytes: np.ndarray, dst_bytes: np.ndarray, writer: np.ndarray,
           writes: np.ndarray, rank: int) -> None:
    """Execute a plan on flat byte buffers, recording who wrote each byte and how often."""
    for s, d, n in zip(copy.src_offsets.tolist(), copy.dst_offsets.tolist(),
                       copy.lengths.tolist()):
        dst_bytes[d:d + n] = src_bytes[s:s + n]
        writer[d:d + n] = rank
        writes[d:d + n] += 1


@pytest.mark.parametrize("mode", ["direct", "staged", "slotted"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_plan_reshards_every_byte_exactly_once_from_its_owner(p, d, mode):
    staged, slotted = mode == "staged", mode == "slotted"
    gen = torch.Generator().manual_seed(1000 * len(mode) + 100 * p + d)
    layers, page, dim, src_blocks, dst_blocks = 2, 4, 3, 6, 7
    # truth[l, b, kv, t, h, :] as the prefill TP group computed it (bf16, random bits).
    truth = torch.randint(-2**15, 2**15, (layers, src_blocks, 2, page, H, dim), generator=gen,
                          dtype=torch.int16).view(torch.bfloat16)
    perm = torch.randperm(dst_blocks, generator=gen)[:4].tolist()
    pairs = list(zip(torch.randperm(src_blocks, generator=gen)[:4].tolist(), perm))

    srcs = []
    for r in range(p):
        hr = head_range(H, p, r)
        t = truth[..., hr[0]:hr[1], :].contiguous()
        srcs.append((PoolLayout.from_tensor("full", t, hr), t))
    for r in range(d):
        hr = head_range(H, d, r)
        poison = torch.full((layers, dst_blocks, 2, page, hr[1] - hr[0], dim), -7.0,
                            dtype=torch.bfloat16)
        dst = PoolLayout.from_tensor("full", poison, hr)
        dst_bytes = poison.view(torch.uint8).numpy().ravel()
        writer = np.full(dst_bytes.shape, -1)
        writes = np.zeros(dst_bytes.shape, dtype=np.int64)
        for sr, (src, src_t) in enumerate(srcs):
            if heads_overlap(src.heads, dst.heads) is None:
                with pytest.raises(KVLayoutError, match="do not intersect"):
                    plan_pool_copy(src, dst, pairs)
                continue
            copy = plan_pool_copy(src, dst, pairs, staging_offset=512 if staged else None,
                                  slotted=slotted)
            assert copy.slotted == (slotted and p > d)
            src_bytes = src_t.view(torch.uint8).numpy().ravel()
            if copy.staged:  # pack into a scratch buffer first, as the sender does
                assert staged and can_stage(src, dst)
                staging = torch.full((512 + staged_nbytes(dst, len(pairs)),), 0xAB,
                                     dtype=torch.uint8)
                pack_pages(src_t, src, dst, copy, staging)
                assert (staging[:512] == 0xAB).all()
                src_bytes = staging.numpy()
            if copy.staged or copy.slotted or src.heads == dst.heads:
                assert copy.num_descs == layers * len(pairs)
                assert (copy.lengths == min(src.page_nbytes, dst.page_nbytes)).all()
            else:
                lo, hi = heads_overlap(src.heads, dst.heads)
                assert copy.num_descs == layers * len(pairs) * 2 * page
                assert (copy.lengths == (hi - lo) * dim * 2).all()
            merged = merge_contiguous(copy)  # what the agent sends: same bytes
            assert merged.nbytes == copy.nbytes and merged.num_descs <= copy.num_descs
            _apply(merged, src_bytes, dst_bytes, writer, writes, sr)

        if slotted and p > d:  # the receiver puts the senders' slots in place
            unpack_slotted(poison, np.array([db for _, db in pairs]), p // d)
        # Written pages hold exactly this rank's heads of the truth; everything else is poison.
        expect = torch.full_like(poison, -7.0)
        for sb, db in pairs:
            expect[:, db] = truth[:, sb, ..., hr[0]:hr[1], :]
        assert torch.equal(poison.view(torch.int16), expect.view(torch.int16))
        # Every byte of a mapped page written once, by the prefill rank owning that head.
        shape6 = (layers, dst_blocks, 2, page, hr[1] - hr[0], dim * 2)
        writes6, writer6 = writes.reshape(shape6), writer.reshape(shape6)
        mapped = np.zeros(dst_blocks, dtype=bool)
        mapped[[db for _, db in pairs]] = True
        assert (writes6[:, mapped] == 1).all() and (writes6[:, ~mapped] == 0).all()
        if not (slotted and p > d):  # (slotted: written whole, moved into place by the receiver)
            owner = np.arange(hr[0], hr[1]) // (H // p)  # global head -> prefill rank
            assert (writer6[:, mapped] == owner[None, None, None, None, :, None]).all()


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)])
def test_resharded_32k_prompt_is_a_few_ranges_per_layer(p, d):
    """A 32k-token prompt (2048 pages, 20b: 12 full-attention layers) re-sharded between TP p and
    TP d costs O(layers x block runs) descriptors, not O(tokens)."""
    n, layers, runs = 2048, 12, 3
    src = _layout(layers=layers, blocks=4096, page=16, heads=head_range(H, p, 0), dim=64)
    dst = _layout(layers=layers, blocks=8192, page=16, heads=head_range(H, d, 0), dim=64)
    starts = [100, 3000, 6000]  # destination blocks in three runs, source blocks in one
    dst_blocks = np.concatenate([np.arange(s, s + n // runs + (i < n % runs))
                                 for i, s in enumerate(starts)])
    pairs = np.stack([np.arange(7, 7 + n), dst_blocks], axis=1)
    copy = merge_contiguous(plan_pool_copy(src, dst, pairs, staging_offset=0, slotted=True))
    assert copy.staged or copy.slotted
    assert copy.nbytes == layers * n * min(src.page_nbytes, dst.page_nbytes)
    assert layers <= copy.num_descs <= layers * runs
    one_run = merge_contiguous(plan_pool_copy(src, dst, np.stack([pairs[:, 0], 5 + np.arange(n)], 1),
                                              staging_offset=0, slotted=True))
    assert one_run.num_descs == layers


def test_slotted_blocks_round_trip_and_arrivals_unpack_once_covered(random_seed):
    gen = torch.Generator().manual_seed(random_seed)
    blocks = np.array([5, 6, 7, 2, 9, 10], dtype=np.int64)
    assert np.array_equal(decode_blocks(encode_blocks({"full": blocks}))["full"], blocks)
    assert encode_blocks({"full": blocks}) == b"full=5+3.2+1.9+2"
    with pytest.raises(KVLayoutError):
        decode_blocks(b"full=5+x")
    # a decode rank with heads [0, 4) fed by two senders of heads [0, 2) and [2, 4)
    truth = torch.randint(-2**15, 2**15, (2, 6, 2, 4, 4, 8), generator=gen,
                          dtype=torch.int16).view(torch.bfloat16)
    pool = torch.zeros(2, 12, 2, 4, 4, 8, dtype=torch.bfloat16)
    dst = PoolLayout.from_tensor("full", pool, (0, 4))
    flat = pool.view(torch.uint8).numpy().ravel()
    pairs = np.stack([np.arange(6), blocks], 1)
    notifs = []
    for lo in (0, 2):
        part = truth[..., lo:lo + 2, :].contiguous()
        copy = plan_pool_copy(PoolLayout.from_tensor("full", part, (lo, lo + 2)), dst, pairs, slotted=True)
        src_bytes = part.view(torch.uint8).numpy().ravel()
        _apply(copy, src_bytes, flat, np.zeros_like(flat, dtype=np.int64), np.zeros_like(flat, dtype=np.int64), 0)
        notifs.append(f"req-1#{lo}:{lo + 2}".encode() + b"|" + encode_slots("p1", {"full": copy.dst_blocks}))
    now = [0.0]
    arrivals = SlottedArrivals({"full": pool}, (0, 4), ttl_s=10, clock=lambda: now[0])
    assert arrivals.feed(b"other#0:4") == [b"other#0:4"]  # not slotted: delivered at once
    # nor are notifications with SEP in them that a slotted write does not send: as they came
    for plain in (b"\x9b|\x00req-1", b"a|b#0:2", b"x|y|z", b"\xff#0:2|p1|full=1+1", b"r#0:2|p|full=1+1|z"):
        assert arrivals.feed(plain) == [plain] and len(arrivals) == 0
    assert arrivals.feed(b"req-1#0:2|p0|full=99+1") == [] and len(arrivals) == 0  # outside the pool
    assert arrivals.feed(notifs[0].replace(b"|p1|", b"|p0|")) == []  # an earlier push's slot...
    assert arrivals.feed(notifs[1]) == [] and len(arrivals) == 1  # ...never completes this one
    assert not torch.equal(pool[:, blocks], truth)  # nothing touched before every slot arrived
    assert arrivals.feed(notifs[0]) == [b"req-1#2:4", b"req-1#0:2"]
    assert torch.equal(pool[:, blocks].view(torch.int16), truth.view(torch.int16))
    # a push that never completes is dropped after the TTL, its pages untouched
    arrivals.feed(notifs[0].replace(b"req-1", b"req-2"))
    now[0] = 11.0
    assert arrivals.feed(b"x#0:4") == [b"x#0:4"] and len(arrivals) == 0


def test_deferred_slotted_arrivals_unpack_only_when_told_and_only_in_the_blocks_held(random_seed):
    """A decode rank (unpack_on_arrival=False) releases the notifications once its slots are all
    here but moves nothing until its leader says so, naming the blocks the request holds; a later
    write for the request, or the TTL, drops what was ready."""
    gen = torch.Generator().manual_seed(random_seed)
    blocks = np.random.default_rng(random_seed).permutation(12)[:5].astype(np.int64)
    truth = torch.randint(-2**15, 2**15, (2, 5, 2, 4, 4, 8), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    pool = torch.zeros(2, 12, 2, 4, 4, 8, dtype=torch.bfloat16)
    dst = PoolLayout.from_tensor("full", pool, (0, 4))
    flat = pool.view(torch.uint8).numpy().ravel()

    def slots(rid: str, push: str) -> list[bytes]:
        out = []
        for lo in (0, 2):
            part = truth[..., lo:lo + 2, :].contiguous()
            copy = plan_pool_copy(PoolLayout.from_tensor("full", part, (lo, lo + 2)), dst,
                                  np.stack([np.arange(5), blocks], 1), slotted=True)
            scratch = np.zeros_like(flat, dtype=np.int64)
            _apply(copy, part.view(torch.uint8).numpy().ravel(), flat, scratch, scratch.copy(), 0)
            out.append(kv_notification(rid, (lo, lo + 2)) + b"|" + encode_slots(push, {"full": copy.dst_blocks}))
        return out

    now = [0.0]
    arrivals = SlottedArrivals({"full": pool}, (0, 4), ttl_s=10, clock=lambda: now[0], unpack_on_arrival=False)
    holds = {"full": np.concatenate([blocks, [99]])}
    assert arrivals.unpack("r", holds) is False  # nothing arrived
    first, second = slots("r", "p1")
    assert arrivals.feed(first) == []
    assert arrivals.feed(second) == [kv_notification("r", (0, 2)), kv_notification("r", (2, 4))]
    raw = pool.clone()
    assert arrivals.unpack("r", {"full": blocks[1:]}) is False  # not all its blocks: never moved
    assert torch.equal(pool.view(torch.int16), raw.view(torch.int16)) and len(arrivals) == 0
    for later in (kv_notification("r", (0, 4)), slots("r", "p2")[0]):  # another push rewrites it
        for n in slots("r", "p1"):
            arrivals.feed(n)
        arrivals.feed(later)
        assert arrivals.unpack("r", holds) is False
        assert torch.equal(pool.view(torch.int16), raw.view(torch.int16))
    arrivals.forget("r")
    for n in slots("r", "p1"):
        arrivals.feed(n)
    now[0] = 11.0  # the request ended and nobody said unpack: dropped after the TTL
    arrivals.feed(b"x#0:4")
    assert len(arrivals) == 0 and arrivals.unpack("r", holds) is False
    for n in slots("r", "p3"):
        arrivals.feed(n)
    assert arrivals.unpack("r", holds) is True
    assert torch.equal(pool[:, blocks].view(torch.int16), truth.view(torch.int16))


def test_plan_copy_packs_stageable_pools_back_to_back():
    src = {"full": _layout(heads=(0, 8)), "sliding": _layout("sliding", layers=1, heads=(0, 8))}
    dst = {"full": _layout(heads=(2, 4)), "sliding": _layout("sliding", layers=1, heads=(2, 4))}
    pages = {"full": [(0, 1), (2, 3)], "sliding": [(4, 0)]}
    need = plan_staging_nbytes(src, dst, pages)
    assert need == (2 * 2 + 1 * 1) * dst["full"].page_nbytes
    full, sliding = plan_copy(src, dst, pages, staging_offset=1024)
    assert full.staged and sliding.staged
    assert full.staging_offset == 1024
    assert sliding.staging_offset == 1024 + 4 * dst["full"].page_nbytes
    assert sliding.src_offsets.max() + sliding.lengths[-1] == 1024 + need
    # Same heads or a destination wider than the source: nothing to stage.
    assert plan_staging_nbytes(src, src, pages) == 0
    assert plan_staging_nbytes(dst, src, pages) == 0
    assert not plan_copy(dst, src, pages, staging_offset=0)[0].staged


def test_staging_allocator_first_fit_and_reuse():
    buf = StagingBuffer(torch.empty(4096, dtype=torch.uint8))
    a, b, c = buf.alloc(1000), buf.alloc(1000), buf.alloc(1000)
    assert (a, b, c) == (0, 1024, 2048) and buf.alloc(1100) is None
    buf.free(b)
    assert buf.alloc(1024) == 1024 and buf.alloc(1) == 3072
    buf.free(a)
    buf.free(c)
    assert buf.used == 1024 + 256 and buf.alloc(2048) is None and buf.alloc(1024) == 0
    with pytest.raises(ValueError):
        buf.free(5)


def test_plan_matching_heads_is_one_desc_per_layer_page_with_exact_offsets():
    src = _layout(blocks=5, heads=(2, 4), addr=1000)
    dst = _layout(blocks=9, heads=(2, 4), addr=5000)
    c = plan_pool_copy(src, dst, [(4, 0), (1, 8)])
    pb = src.page_nbytes
    assert pb == 2 * 4 * 2 * 4 * 2
    assert c.src_offsets.tolist() == [4 * pb, 1 * pb, 5 * pb + 4 * pb, 5 * pb + 1 * pb]
    assert c.dst_offsets.tolist() == [0, 8 * pb, 9 * pb, 9 * pb + 8 * pb]
    assert (c.lengths == pb).all() and c.nbytes == 4 * pb


def test_merge_fuses_ranges_adjacent_on_both_sides_only():
    src, dst = _layout(blocks=8), _layout(blocks=8)
    pb, lb = src.page_nbytes, src.layer_nbytes
    # Blocks 2,3,4 -> 5,6,7 are one run per layer; 0 -> 0 then 7 -> 1 are not adjacent.
    c = merge_contiguous(plan_pool_copy(src, dst, [(2, 5), (3, 6), (4, 7), (0, 0), (7, 1)]))
    assert c.src_offsets.tolist() == [2 * pb, 0, 7 * pb, lb + 2 * pb, lb, lb + 7 * pb]
    assert c.dst_offsets.tolist() == [5 * pb, 0, 1 * pb, lb + 5 * pb, lb, lb + pb]
    assert c.lengths.tolist() == [3 * pb, pb, pb] * 2
    # Every block of every layer in order: the whole pool is one range.
    whole = merge_contiguous(plan_pool_copy(src, dst, [(i, i) for i in range(8)]))
    assert whole.num_descs == 1 and whole.lengths[0] == src.nbytes
    # Per-token rows with gaps on one side do not fuse.
    half = _layout(heads=(0, 4), blocks=8)
    rows = plan_pool_copy(src, half, [(0, 0), (1, 1)])
    assert merge_contiguous(rows).num_descs == rows.num_descs


def test_plan_rejects_bad_requests():
    src, dst = _layout(blocks=5), _layout(blocks=3)
    with pytest.raises(KVLayoutError, match=r"source block ids \[5\]"):
        plan_pool_copy(src, dst, [(0, 0), (5, 1)])
    with pytest.raises(KVLayoutError, match=r"destination block ids \[-1\]"):
        plan_pool_copy(src, dst, [(0, -1)])
    with pytest.raises(KVLayoutError, match="more than once"):
        plan_pool_copy(src, dst, [(0, 1), (2, 1)])
    with pytest.raises(KVLayoutError, match="integers"):
        plan_pool_copy(src, dst, [(0.0, 1.0)])
    with pytest.raises(KVLayoutError, match="pairs"):
        plan_pool_copy(src, dst, [0, 1, 2])
    for other, what in ((_layout(page=8), "page_size"), (_layout(dim=8), "head_dim"),
                        (_layout(layers=3), "n_layers"), (_layout(dtype="float16"), "dtype")):
        with pytest.raises(KVLayoutError, match=what):
            plan_pool_copy(src, other, [(0, 0)])
    with pytest.raises(KVLayoutError, match="does not exist on the destination"):
        plan_copy({"full": src, "sliding": src}, {"full": dst}, {"sliding": [(0, 0)]})
    # Empty lists need no pool on either side; a source copy of one block to two places is fine.
    assert plan_copy({"full": src}, {"full": dst}, {"sliding": [], "full": []}) == []
    (c,) = plan_copy({"full": src}, {"full": dst}, {"full": [(1, 0), (1, 2)]})
    assert c.num_descs == 2 * 2


def test_layout_and_peer_info_validation():
    with pytest.raises(KVLayoutError, match="does not match num_kv_heads_local"):
        PoolLayout("full", 64, (1, 2, 2, 4, 4, 8), "bfloat16", "cpu", 0, 2)
    with pytest.raises(KVLayoutError, match="not cpu or cuda"):
        _layout(device="gpu0")
    with pytest.raises(KVLayoutError, match="contiguous"):
        PoolLayout.from_tensor("full", torch.zeros(1, 2, 2, 4, 8, 4).transpose(4, 5), (0, 4))
    with pytest.raises(KVLayoutError, match="divide"):
        head_range(8, 3, 0)
    assert [head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    pools = {"full": _layout(), "sliding": _layout("sliding", layers=0)}
    info = decode_peer_info(encode_peer_info("d0", pools, b"\x00nixl-md"))
    assert info.name == "d0" and info.pools == pools and info.nixl_metadata == b"\x00nixl-md"
    blob = encode_peer_info("d0", pools, b"md")
    assert blob == encode_peer_info("d0", dict(pools), b"md")  # deterministic: add_peer dedups on it

    def mutated(change) -> bytes:
        m = peer_info_message("d0", pools, b"md")
        change(m)
        return m.SerializeToString()

    for bad in (b"garbage", blob[:-2],
                mutated(lambda m: m.pools[0].shape.pop()),
                mutated(lambda m: setattr(m.pools[0], "head_end", 9)),
                mutated(lambda m: setattr(m, "agent_name", "")),
                mutated(lambda m: m.ClearField("nixl_metadata")),
                mutated(lambda m: m.ClearField("pools")),
                mutated(lambda m: m.pools.add().CopyFrom(m.pools[0]))):
        with pytest.raises(KVLayoutError):
            decode_peer_info(bad)


# ------------------------------------------------------------------------------------------------
# real NIXL + UCX between processes
# ------------------------------------------------------------------------------------------------

def _make_pools(seed: int, spec: dict, heads: tuple[int, int],
                device: str = "cpu") -> dict[str, torch.Tensor]:
    """spec: pool -> (n_layers, n_blocks[, page_size, head_dim]) (default page 4, head_dim 8);
    random bf16 bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for g, dims in spec.items():
        nl, nb, page, dim = (*dims, 4, 8)[:4]
        out[g] = torch.randint(-2**15, 2**15, (nl, nb, 2, page, heads[1] - heads[0], dim),
                               generator=gen, dtype=torch.int16).view(torch.bfloat16).to(device)
    return out


def _peer_main(conn):
    """Child process: hosts named agents and runs agent methods sent over the pipe."""
    agents, pools = {}, {}
    while True:
        try:
            cmd, name, args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "create":
                pools[name] = _make_pools(*args)
                heads = args[2]
                agents[name] = KVTransferAgent(name, pools[name], head_range=heads)
                out = agents[name].peer_info()
            elif cmd == "digest":
                out = {g: hashlib.sha256(_i16(t).tobytes()).hexdigest()
                       for g, t in pools[name].items()}
            elif cmd == "pools":
                out = {g: t.view(torch.int16).cpu().numpy() for g, t in pools[name].items()}
            elif cmd == "wait_then_read":  # the blocks' bytes the moment the notification is seen
                notif, pool, blocks, timeout = args
                arrived = agents[name].wait_notification(notif, timeout)
                out = arrived, pools[name][pool][:, blocks].view(torch.int16).cpu().numpy()
            else:
                out = getattr(agents[name], cmd)(*args)
            conn.send(("ok", out))
        except Exception as e:  # report to the test instead of dying
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _thread_states(pid: int) -> list[str]:
    """One-letter scheduler state of each thread of ``pid`` (``T``: stopped by a signal)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:  # the thread exited meanwhile
            pass
    return states


class Peer:
    """Handle on a spawned process hosting agents."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def __call__(self, cmd, name, *args):
        self.conn.send((cmd, name, args))
        if not self.conn.poll(60):
            raise TimeoutError(f"peer process did not answer {cmd}")
        status, out = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"peer {cmd} failed: {out}")
        return out

    def pause(self, timeout: float = 10.0):
        """SIGSTOP the process and return once every thread of it is stopped: kill() returns
        before they are (0.2-0.6 ms later on an idle host), and a transfer posted in between
        may still be answered."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while any(state != "T" for state in _thread_states(self.proc.pid)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer process {self.proc.pid} did not stop")
            time.sleep(1e-4)

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self):
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture(scope="module")
def _processes():
    """Two peer processes, started together so their (slow) imports overlap."""
    procs = {"peer": Peer(), "doomed": Peer()}
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture
def peer(_processes):
    return _processes["peer"]


@pytest.fixture
def doomed_peer(_processes):
    """A peer process the test may kill."""
    return _processes["doomed"]


def _i16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).cpu().numpy()


@pytest.mark.slow
def test_write_pages_lands_bit_exact_and_notifies(peer, random_seed):
    rng = np.random.default_rng(random_seed)
    spec_a, spec_b = {"full": (3, 10), "sliding": (2, 6)}, {"full": (3, 12), "sliding": (2, 7)}
    blob_b = peer("create", "b-write", int(rng.integers(1 << 30)), spec_b, (0, 4))
    before = peer("pools", "b-write")
    pools_a = _make_pools(int(rng.integers(1 << 30)), spec_a, (0, 4))
    with KVTransferAgent("a-write", pools_a, head_range=(0, 4)) as a:
        name = a.add_peer(blob_b)
        assert name == "b-write" and a.add_peer(blob_b) == name  # idempotent
        pages = {"full": list(zip(rng.permutation(10)[:5].tolist(),
                                  rng.permutation(12)[:5].tolist())),
                 "sliding": list(zip(rng.permutation(6)[:3].tolist(),
                                     rng.permutation(7)[:3].tolist()))}
        notif = bytes(rng.integers(0, 256, 16, dtype=np.uint8)) + b"\x00req-1"
        h = a.write_pages(name, pages, notif)
        h.wait(10)
        assert h.done()
        assert h.nbytes == sum(len(v) * pools_a[g][:, 0].numel() * 2 for g, v in pages.items())
        assert peer("wait_notification", "b-write", notif, 10) is True
        after = peer("pools", "b-write")
        for g in spec_b:
            expect = before[g].copy()
            for lb, rb in pages[g]:
                expect[:, rb] = _i16(pools_a[g])[:, lb]
            np.testing.assert_array_equal(after[g], expect)  # copied pages and poison intact

        # Other notifications stay queued while waiting for a specific one; an empty page
        # list still notifies.
        a.write_pages(name, {"full": [(0, 0)]}, b"first").wait(10)
        a.write_pages(name, {"full": []}, b"second").wait(10)
        assert peer("wait_notification", "b-write", b"second", 10) is True
        assert peer("wait_notification", "b-write", b"never", 0.05) is False
        assert peer("take_notifications", "b-write") == [b"first"]

        # Pull: read B's page 11 of each full layer back into A's block 9.
        h = a.read_pages(name, {"full": [(9, 11)]}, b"read-done")
        h.wait(10)
        assert peer("wait_notification", "b-write", b"read-done", 10) is True
        np.testing.assert_array_equal(_i16(pools_a["full"])[:, 9], after["full"][:, 11])


def _tp_agents(peer, p: int, d: int, tag: str, truth: dict, dst_spec: dict, staging: int,
               rng: np.random.Generator):
    """Decode TP=d agents in the peer process ({name: (heads, peer-info blob)}, their pools before)
    and prefill TP=p agents here holding their heads of `truth`."""
    nh = next(iter(truth.values())).shape[4]
    dec = {}
    for r in range(d):
        hr = head_range(nh, d, r)
        dec[f"dec-{tag}-{r}"] = (hr, peer("create", f"dec-{tag}-{r}", int(rng.integers(1 << 30)), dst_spec, hr))
    before = {n: peer("pools", n) for n in dec}
    pre = []
    for r in range(p):
        hr = head_range(nh, p, r)
        pools = {g: t[..., hr[0]:hr[1], :].contiguous() for g, t in truth.items()}
        pre.append(KVTransferAgent(f"pre-{tag}-{r}", pools, head_range=hr, staging_bytes=staging))
    return dec, before, pre


def _assert_pages_moved(peer, dec: dict, before: dict, truth: dict, pages: dict) -> None:
    for n, (hr, _) in dec.items():
        after = peer("pools", n)
        for g in truth:
            expect = before[n][g].copy()
            for sb, db in pages[g]:
                expect[:, db] = _i16(truth[g])[:, sb, ..., hr[0]:hr[1], :]
            np.testing.assert_array_equal(after[g], expect)


@pytest.mark.slow
def test_notification_follows_every_byte_and_source_pages_are_free_once_done(peer, random_seed):
    """What the decode and prefill workers rely on: the receiver reads a WRITE's pages the moment
    its notification arrives, without waiting for anything else, and finds every byte; the
    sender overwrites its source pages as soon as the write is done (a prefill frees its own
    blocks then, and the next prompt may write them at once) and the receiver's copy keeps the
    old bytes. Scattered pages and long contiguous runs (one large descriptor a layer)."""
    rng = np.random.default_rng(random_seed)
    spec = {"full": (4, 64, 16, 64)}  # 32 KiB a block and layer: runs of up to 768 KiB
    blob = peer("create", "b-order", int(rng.integers(1 << 30)), spec, (0, 8))
    pools = _make_pools(int(rng.integers(1 << 30)), spec, (0, 8))
    src_i16 = pools["full"].view(torch.int16)
    with KVTransferAgent("a-order", pools, head_range=(0, 8)) as a:
        name = a.add_peer(blob)
        for i in range(300):
            n = int(rng.integers(1, 24))
            if i % 2:
                s0, d0 = (int(x) for x in rng.integers(0, 64 - n, 2))
                src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
            else:
                src, dst = rng.permutation(64)[:n].tolist(), rng.permutation(64)[:n].tolist()
            src_i16[:, src] = torch.from_numpy(rng.integers(-2**15, 2**15, src_i16[:, src].shape, dtype=np.int16))
            want = src_i16[:, src].numpy().copy()
            notif = f"order-{i}".encode()
            peer.conn.send(("wait_then_read", "b-order", (notif, "full", dst, 30)))  # waits first
            a.write_pages(name, {"full": list(zip(src, dst))}, notif).wait(30)
            src_i16[:, src] = 7  # reused at once
            assert peer.conn.poll(60)
            status, out = peer.conn.recv()
            assert status == "ok", out
            arrived, got = out
            assert arrived, i
            np.testing.assert_array_equal(got, want, err_msg=f"write {i}: {n} pages")


@pytest.mark.slow
@pytest.mark.parametrize("p,d,staging", [(2, 1, 1 << 20), (1, 2, 0), (1, 2, 1 << 20),
                                         (1, 2, 1024)])
def test_tp_resharding_over_nixl(peer, p, d, staging, random_seed):
    """Prefill TP=p (agents in this process) -> decode TP=d (agents in the peer process), with
    notifications that name no request (per-token descriptors), packed pages (staging), or
    staging too small (falls back)."""
    rng = np.random.default_rng(random_seed)
    truth = _make_pools(int(rng.integers(1 << 30)), {"full": (2, 6), "sliding": (1, 5)}, (0, 4))
    pages = {"full": [(1, 7), (4, 0), (5, 3)], "sliding": [(2, 4), (0, 1)]}
    dec, before, pre = _tp_agents(peer, p, d, f"{p}{d}{staging}", truth, {"full": (2, 8), "sliding": (1, 5)},
                                  staging, rng)
    try:
        handles = []
        for a in pre:
            for n, (hr, blob) in dec.items():
                name = a.add_peer(blob)
                if heads_overlap(a.head_range, a.peer_pools(name)["full"].heads) is None:
                    continue
                handles.append(a.write_pages(name, pages, f"{a.name}->{n}".encode()))
        assert len(handles) == max(p, d)
        packed = p < d and staging >= 1 << 20
        per_page = 2 * 3 + 1 * 2  # layers x pages over both pools
        for h in handles:
            assert h.num_descs == per_page * (1 if packed else 2 * 4)
            h.wait(10)
        assert all(a._staging is None or a._staging.used == 0 for a in pre)
        for a in pre:
            for n in dec:
                if heads_overlap(a.head_range, dec[n][0]):
                    assert peer("wait_notification", n, f"{a.name}->{n}".encode(), 10)
        _assert_pages_moved(peer, dec, before, truth, pages)
    finally:
        for a in pre:
            a.close()


@pytest.mark.slow
@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_tp_resharding_over_nixl_is_one_range_per_layer(peer, p, d, random_seed):
    """Workers' notifications (request id + heads) and a staging buffer on the senders: every
    prefill TP p -> decode TP d pairing moves consecutive blocks as one range per layer and pool
    (packed when d > p, slotted and unpacked by the receiver when p > d), bit-exact."""
    rng = np.random.default_rng(random_seed)
    truth = _make_pools(int(rng.integers(1 << 30)), {"full": (2, 6), "sliding": (1, 5)}, (0, 4))
    pages = {"full": [(1, 3), (2, 4), (3, 5)], "sliding": [(2, 1), (3, 2)]}
    rid = f"req-{p}{d}-{rng.integers(1 << 20)}"
    dec, before, pre = _tp_agents(peer, p, d, rid, truth, {"full": (2, 8), "sliding": (1, 5)}, 1 << 20,
                                  rng)
    try:
        sent = []
        for a in pre:
            for n, (hr, blob) in dec.items():
                heads = heads_overlap(a.head_range, hr)
                if heads is None:
                    continue
                notif = kv_notification(rid, heads)
                h = a.write_pages(a.add_peer(blob), pages, notif, push_id=rid)
                assert h.num_descs == 2 + 1  # full: 2 layers, sliding: 1 layer
                sent.append((h, n, notif))
        assert len(sent) == max(p, d)
        for h, _, _ in sent:
            h.wait(10)
        for _, n, notif in sent:
            assert peer("wait_notification", n, notif, 10)
        _assert_pages_moved(peer, dec, before, truth, pages)
    finally:
        for a in pre:
            a.close()


@pytest.mark.slow
def test_bad_requests_and_dead_peer_raise_and_agent_survives(peer, doomed_peer, random_seed):
    rng = np.random.default_rng(random_seed)
    blob_ok = peer("create", "b-alive", int(rng.integers(1 << 30)), {"full": (2, 4)}, (0, 4))
    doomed = doomed_peer
    blob_dead = doomed("create", "b-doomed", 1, {"full": (2, 4096)}, (0, 4))
    pools = _make_pools(int(rng.integers(1 << 30)), {"full": (2, 4096)}, (0, 4))
    with KVTransferAgent("a-fail", pools, head_range=(0, 4)) as a:
        ok, dead = a.add_peer(blob_ok), a.add_peer(blob_dead)
        for bad, match in (({"full": [(0, 4)]}, r"destination block ids \[4\]"),
                           ({"full": [(-1, 0)]}, "source block ids"),
                           ({"sliding": [(0, 0)]}, "does not exist"),
                           ({"full": [(0, 0), (1, 0)]}, "more than once")):
            with pytest.raises(KVTransferError, match=match):
                a.write_pages(ok, bad, b"bad")
        with pytest.raises(KVTransferError, match="unknown peer"):
            a.write_pages("nobody", {"full": [(0, 0)]}, b"x")
        with pytest.raises(KVTransferError, match="not a KV peer-info message"):
            a.add_peer(b"PDSKV1\n\x00\x00\x00\x02{}md")
        a.write_pages(ok, {"full": [(3, 1)]}, b"ok-1").wait(10)
        assert peer("wait_notification", "b-alive", b"ok-1", 10)
        assert not peer("take_notifications", "b-alive")  # the bad requests sent nothing

        a.write_pages(dead, {"full": [(0, 0)]}, b"warm").wait(10)  # connection is up
        # A stalled peer: wait() times out, the NIXL request is cancelled and released.
        doomed.pause()
        t0 = time.monotonic()
        h = a.write_pages(dead, {"full": [(i, i) for i in range(4096)]}, b"stalled")
        with pytest.raises(KVTransferError, match="timed out"):
            h.wait(1.0)
        assert time.monotonic() - t0 < 5 and not a._inflight and not a._stuck
        with pytest.raises(KVTransferError, match="timed out"):
            h.done()  # the failure sticks to the handle
        os.kill(doomed.proc.pid, signal.SIGCONT)
        a.write_pages(dead, {"full": [(1, 1)]}, b"resumed").wait(10)
        assert doomed("wait_notification", "b-doomed", b"resumed", 10)

        # A dead peer: write or wait raises promptly instead of hanging.
        doomed.kill()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            for _ in range(3):  # the first post may be accepted before UCX sees the reset
                a.write_pages(dead, {"full": [(i, i) for i in range(4096)]},
                              b"lost").wait(5)
        assert time.monotonic() - t0 < 16
        assert not a._inflight and not a._stuck
        a.remove_peer(dead)
        with pytest.raises(KVTransferError, match="unknown peer"):
            a.write_pages(dead, {"full": [(0, 0)]}, b"gone")

        a.write_pages(ok, {"full": [(2, 2)]}, b"ok-2").wait(10)
        assert peer("wait_notification", "b-alive", b"ok-2", 10)
        after = peer("pools", "b-alive")["full"]
        np.testing.assert_array_equal(after[:, 2], _i16(pools["full"])[:, 2])

        # The peer restarts under the same name: its new blob replaces the old one.
        peer("close", "b-alive")
        blob_new = peer("create", "b-alive", int(rng.integers(1 << 30)), {"full": (2, 6)}, (0, 4))
        assert a.add_peer(blob_new) == ok and a.peer_pools(ok)["full"].n_blocks == 6
        a.write_pages(ok, {"full": [(0, 5)]}, b"ok-3").wait(10)
        assert peer("wait_notification", "b-alive", b"ok-3", 10)
        np.testing.assert_array_equal(peer("pools", "b-alive")["full"][:, 5],
                                      _i16(pools["full"])[:, 0])


@pytest.mark.slow
def test_64mib_write_throughput(peer):
    """Not a timed test: prints the rate of a 64 MiB WRITE (4 layers x 1024 pages of 16 KiB,
    page_size 16, 4 heads, head_dim 64) and checks the bytes; run with -s to see it."""
    spec = {"full": (4, 1024, 16, 64)}
    blob = peer("create", "b-64mib", 1, spec, (0, 4))
    pools = _make_pools(2, spec, (0, 4))
    pages = {"full": [(i, 1023 - i) for i in range(1024)]}
    with KVTransferAgent("a-64mib", pools, head_range=(0, 4)) as a:
        name = a.add_peer(blob)
        a.write_pages(name, pages, b"warm-up").wait(30)
        rates = []
        for i in range(2):
            t0 = time.perf_counter()
            h = a.write_pages(name, pages, b"t%d" % i)
            h.wait(30)
            assert peer("wait_notification", "b-64mib", b"t%d" % i, 30)
            rates.append(h.nbytes / (time.perf_counter() - t0) / 1e9)
        assert h.nbytes == 64 << 20 and h.num_descs == 4 * 1024
        print(f"\n64 MiB WRITE + notification, UCX_TLS={os.environ.get('UCX_TLS', '<default>')}: "
              + ", ".join(f"{r:.2f}" for r in rates) + " GB/s")
        expect = hashlib.sha256(_i16(pools["full"])[:, ::-1].tobytes()).hexdigest()
        assert peer("digest", "b-64mib")["full"] == expect


@pytest.mark.slow
def test_agent_listens_on_listen_host_only_and_idles_quietly():
    """UCX's TCP listeners of an agent sit on 127.0.0.1 only (never 0.0.0.0 or eth0), and its
    progress thread sleeps when idle instead of spinning a core."""
    import ipaddress

    if os.environ.get("UCX_NET_DEVICES"):
        pytest.skip("UCX_NET_DEVICES set by the user overrides listen_host")

    def listening() -> set[str]:
        """host:port of this process's listening TCP sockets (from /proc, no tools needed)."""
        ours = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                ours.add(link[8:-1])
        out = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for row in f.read().splitlines()[1:]:
                    cols = row.split()
                    if cols[3] != "0A" or cols[9] not in ours:  # 0A: LISTEN
                        continue
                    hexip, hexport = cols[1].split(":")
                    raw = bytes.fromhex(hexip)  # 32-bit words in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    out.add(f"{ipaddress.ip_address(raw)}:{int(hexport, 16)}")
        return out

    before = listening()
    with KVTransferAgent("a-listen", _make_pools(0, {"full": (1, 2)}, (0, 4)),
                         head_range=(0, 4)):
        new = listening() - before
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        idle = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    assert new and all(addr.startswith("127.0.0.1:") for addr in new), new
    assert idle < 0.1, f"idle agent used {idle:.0%} of a core"


@pytest.mark.gpu
@pytest.mark.slow
def test_vram_pools_write_and_reshard_between_processes(peer, random_seed):
    """CUDA pools register as VRAM; whole-page and head-resharded writes land bit-exact."""
    dev_a = "cuda:0"
    dev_b = f"cuda:{torch.cuda.device_count() - 1}"
    rng = np.random.default_rng(random_seed)
    spec = {"full": (3, 16, 16, 64), "sliding": (2, 8, 16, 64)}
    pools = _make_pools(int(rng.integers(1 << 30)), spec, (0, 4), dev_a)
    dec = {n: (hr, peer("create", n, int(rng.integers(1 << 30)), spec, hr, dev_b))
           for n, hr in (("g-tp1", (0, 4)), ("g-tp2-1", (2, 4)))}
    before = {n: peer("pools", n) for n in dec}
    pages = {"full": [(0, 15), (7, 3), (15, 0)], "sliding": [(1, 2), (6, 7)]}
    with KVTransferAgent("a-gpu", pools, head_range=(0, 4), staging_bytes=1 << 20) as a:
        assert all(lay.mem_type == "VRAM" for lay in a.layouts.values())
        assert a._staging.buf.device == pools["full"].device
        for n, (hr, blob) in dec.items():
            h = a.write_pages(a.add_peer(blob), pages, n.encode())
            h.wait(30)
            assert peer("wait_notification", n, n.encode(), 30)
            after = peer("pools", n)
            for g in spec:
                expect = before[n][g].copy()
                for sb, db in pages[g]:
                    expect[:, db] = _i16(pools[g])[:, sb, ..., hr[0]:hr[1], :]
                np.testing.assert_array_equal(after[g], expect)


@pytest.mark.gpu
@pytest.mark.slow
def test_vram_slotted_writes_are_unpacked_on_the_receiving_gpu(peer, random_seed):
    """TP2 -> TP1 in VRAM: both senders' whole pages land in slots and the receiving agent puts
    the heads in place on its GPU before the notifications show; bit-exact, one range per layer."""
    dev_a = "cuda:0"
    dev_b = f"cuda:{torch.cuda.device_count() - 1}"
    rng = np.random.default_rng(random_seed)
    spec = {"full": (3, 16, 16, 64), "sliding": (2, 8, 16, 64)}
    truth = _make_pools(int(rng.integers(1 << 30)), spec, (0, 4), dev_a)
    blob = peer("create", "g-slots", int(rng.integers(1 << 30)), spec, (0, 4), dev_b)
    before = peer("pools", "g-slots")
    pages = {"full": [(3, 8), (4, 9), (5, 10)], "sliding": [(1, 2), (2, 3)]}
    senders = [KVTransferAgent(f"a-gpu-slot{lo}", {g: t[..., lo:lo + 2, :].contiguous() for g, t in truth.items()},
                               head_range=(lo, lo + 2)) for lo in (0, 2)]
    try:
        handles = [a.write_pages(a.add_peer(blob), pages, kv_notification("g-req", a.head_range)) for a in senders]
        assert all(h.num_descs == 3 + 2 for h in handles)
        for h in handles:
            h.wait(30)
        for a in senders:
            assert peer("wait_notification", "g-slots", kv_notification("g-req", a.head_range), 30)
        after = peer("pools", "g-slots")
        for g in spec:
            expect = before[g].copy()
            for sb, db in pages[g]:
                expect[:, db] = _i16(truth[g])[:, sb]
            np.testing.assert_array_equal(after[g], expect)
    finally:
        for a in senders:
            a.close()
