"""Runs the model on one rank: owns weights, the paged KV cache and the attention backends, and
turns a prefill of one request or a decode step of many into forward passes.

A step is first described as a `StepPlan` (token ids, positions, KV slots and block tables: what
the block bookkeeping decided), then executed. On a multi-rank worker only the leader keeps the
bookkeeping; its `group` hook broadcasts each plan so that every rank executes the same one on its
own KV heads, experts and vocabulary shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from pdserve.kernels.paged_batch import PagedBatch

from .checkpoint import load_weights
from .config import DEFAULT_PREFILL_CHUNK, ModelConfig
from .cuda_graphs import DecodeGraphs
from .kv_cache import PagedKVCache, sliding_first_page
from .model import GptOssModel, StepContext, make_batches, plan_step
from .parallel import ShardSpec
from .sampling import SamplingParams, TokenLogprob, prompt_logprob_rows, unpack_prompt_logprobs
from .sequence import Sequence

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A request the model cannot run: token ids out of range, empty or over-long prompt."""


class PrefillStopped(RuntimeError):
    """A chunked prefill's `stop` said so between two chunks (the request was cancelled)."""


def default_precision(device: torch.device) -> str:
    return "fp8" if device.type == "cuda" else "bf16"


@dataclass
class StepPlan:
    """One forward pass as every rank of a worker runs it (picklable: no KV, no weights; block
    tables travel as the attention batches' int32 tensors, which pickle as plain bytes).

    input_ids, positions : [T] token ids and their positions.
    slots : pool -> int64 tensor [T], flat KV slot (block * page_size + offset) of each new token.
    batches : pool -> PagedBatch (per request: query rows, pages, last-page length) for attention.
    qo_lens : new tokens per request (sum = T).
    all_logits : logits of every row, else of each request's last row.
    block_copies : pool -> [(source block, destination block)] copied before the forward (the
        partial last prompt page, and the sliding pages, of each choice forked from a prompt).
    device_ids : optional int64 device tensor [m]: the first m input ids, sampled on the device
        by the previous step and not read by the host (their `input_ids` entries are
        placeholders). Single-rank only: it does not travel to other ranks.
    keep_logits : False: the logits may be a view of a decode graph's static output, overwritten
        by the next step (the caller consumes them on the stream before it launches that step).
    """

    input_ids: list[int]
    positions: list[int]
    slots: dict[str, torch.Tensor]
    batches: dict[str, PagedBatch]
    qo_lens: list[int]
    all_logits: bool = False
    prompt_logprobs: int | None = None  # k: score the prompt instead (see ModelRunner.prefill_scored)
    score_next: int | None = None  # with prompt_logprobs: the token after these rows (a later chunk's first)
    block_copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    device_ids: torch.Tensor | None = None
    keep_logits: bool = True


class StepGroup(Protocol):
    """What a multi-rank worker's leader plugs in: run `execute(plan)` here and on every rank."""

    def run(self, plan: StepPlan, execute: Callable[[StepPlan], Any]) -> Any: ...


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        *,
        device: str | torch.device = "cpu",
        precision: str | None = None,
        page_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_memory_fraction: float = 0.85,
        shard: ShardSpec = ShardSpec(),
        attention_backend: str = "auto",
        cuda_graph_max_batch: int = 0,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
        attention_precision: str = "bf16",
        unembedding_precision: str = "bf16",
    ):
        """attention_precision: the QKV and O projection weights in bf16 or FP8 (e4m3, 128x128 block
        scales, quantised at load; kernels.triton_fp8_linear on CUDA); unembedding_precision: the
        vocabulary projection's (lm_head) likewise.
        cuda_graph_max_batch > 0 (CUDA with FlashInfer only): decode batches up to that size
        replay CUDA graphs captured here (engine.cuda_graphs); larger ones and prefills run eagerly.
        prefill_chunk_tokens: a prompt longer than this is prefilled in forward passes of at most
        this many tokens (docs/engine.md, chunked prefill)."""
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be positive, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.device = torch.device(device)
        self.cfg = ModelConfig.load(model_dir)
        self.precision = precision or default_precision(self.device)
        self.attention_precision = attention_precision
        self.unembedding_precision = unembedding_precision
        self.shard = shard
        weights = load_weights(model_dir, self.cfg, shard=shard, precision=self.precision, device=self.device,
                               attention_precision=attention_precision, unembedding_precision=unembedding_precision)
        self.model = GptOssModel(
            self.cfg, weights, shard=shard, device=self.device, page_size=page_size,
            attention_backend=attention_backend,
        )
        if num_kv_blocks is None:
            num_kv_blocks = self._size_kv_cache(page_size, kv_memory_fraction)
        self.cache = PagedKVCache(
            self.cfg, num_blocks=num_kv_blocks,
            page_size=page_size, num_kv_heads=self.model.num_kv_heads, device=self.device,
        )
        self.attention = self.model.make_attention()
        self.group: StepGroup | None = None  # set on a multi-rank worker's leader
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch > 0:
            if self.device.type != "cuda" or type(self.attention["full"]).__name__ != "FlashInferSinkAttention":
                log.warning("decode runs eagerly: CUDA graphs need a CUDA device with FlashInfer")
            else:
                self.decode_graphs = DecodeGraphs(self.model, self.cache, cuda_graph_max_batch,
                                                  max_context=self.max_context)
                # every rank of a worker builds its runner the same way, so all capture in lockstep
                # (multi-rank: the sizes are checked across ranks, engine/cuda_graphs.py)
                self.decode_graphs.capture_all()

    @property
    def max_context(self) -> int:
        return self.cfg.max_context

    def _size_kv_cache(self, page_size: int, fraction: float) -> int:
        """Blocks that fit: on CUDA a fraction of free memory after the weights; on CPU a fixed
        64k tokens of a full-attention layer."""
        if self.device.type != "cuda":
            return max(1, 65536 // page_size)
        free, _ = torch.cuda.mem_get_info(self.device)
        per_block = PagedKVCache.bytes_per_block(self.cfg, page_size, self.model.num_kv_heads)
        blocks = max(1, int(free * fraction) // per_block)
        if self.shard.world_size > 1:  # block ids are shared by all ranks: take what all can hold
            t = torch.tensor([blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            blocks = int(t.item())
        return blocks

    def validate_prompt(self, ids: list[int], max_new_tokens: int = 1) -> None:
        if not ids:
            raise InvalidRequest("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_context:
            raise InvalidRequest(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_context} tokens"
            )

    # -- steps ---------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run one planned forward pass on this rank: float32 logits [rows, V] (rows: see
        StepPlan.all_logits), gathered over vocabulary shards."""
        self._copy_blocks(plan.block_copies)
        graphs = self.decode_graphs
        if (graphs is not None and not plan.all_logits and len(plan.input_ids) == len(plan.qo_lens)
                and len(plan.qo_lens) <= graphs.max_batch):
            return graphs.run(plan.input_ids, plan.positions, plan.slots, plan.batches, plan.device_ids,
                              copy=plan.keep_logits)
        plan_step(self.attention, plan.batches)
        step = StepContext(self.cache, {g: s.to(self.device) for g, s in plan.slots.items()}, self.attention)
        input_ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        if plan.device_ids is not None:
            input_ids[: plan.device_ids.numel()] = plan.device_ids
        pos = torch.tensor(plan.positions, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, pos, step)
        if plan.prompt_logprobs is not None:
            return self._score(hidden, input_ids, plan.prompt_logprobs, plan.score_next)
        if not plan.all_logits and len(plan.qo_lens) != hidden.shape[0]:
            last = torch.tensor(plan.qo_lens, device=self.device).cumsum(0) - 1
            hidden = hidden[last]
        return self.model.logits(hidden)

    score_chunk = 1024  # prompt positions whose vocabulary-wide logits exist at once when scoring

    def _score(self, hidden: torch.Tensor, input_ids: torch.Tensor, k: int,
               next_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the last position [V], prompt_logprob_rows of the rows' next tokens: the
        rows' own ids shifted by one, then `next_id` for the last row when a later chunk follows),
        the vocabulary-wide logits made `score_chunk` rows at a time (every rank runs the same)."""
        targets = input_ids[1:]
        if next_id is not None:
            targets = torch.cat([targets, targets.new_tensor([next_id])])
        n, chunk = targets.numel(), self.score_chunk
        parts = [prompt_logprob_rows(self.model.logits(hidden[s:min(n, s + chunk)]), targets[s:s + chunk], k)
                 for s in range(0, n, chunk)]
        packed = torch.cat(parts) if parts else torch.zeros(0, 1 + 2 * k, dtype=torch.float64, device=hidden.device)
        return self.model.logits(hidden[-1:])[0], packed

    def _step(self, plan: StepPlan) -> torch.Tensor:
        if self.group is not None:
            if plan.device_ids is not None:
                raise ValueError("device-side input ids are single-rank only")
            return self.group.run(plan, self.execute)
        return self.execute(plan)

    def prefill(self, seq: Sequence, all_logits: bool = False, *, finish: bool = True,
                stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run the prompt (batch size 1) into the request's blocks from position `seq.num_cached`
        on: the KV of the positions before it are already in its pages (a cached prefix; its
        sliding table must start at the window of that position). Float32 logits of the last
        position [V] (or of every computed position [L - num_cached, V] with all_logits).
        `finish=False` keeps every sliding page in the table (a prefix cache adopts them).

        More than `prefill_chunk_tokens` positions run as consecutive chunks, each a suffix
        prefill over the KV the chunks before it wrote (the same path as a cached prefix);
        `stop()` true before a chunk raises PrefillStopped (seq.num_cached: the positions done)."""
        parts = []
        for plan in self._prefill_plans(seq, stop):
            plan.all_logits = all_logits
            if not all_logits:
                parts.clear()  # an earlier chunk's last row is no answer: free it before the next pass
            parts.append(self._step(plan))
            seq.num_cached += len(plan.input_ids)
        self._prefilled(seq, finish)
        return torch.cat(parts) if all_logits else parts[-1][0]

    def prefill_scored(self, seq: Sequence, k: int, *, finish: bool = True,
                       stop: Callable[[], bool] | None = None) -> tuple[torch.Tensor, list[TokenLogprob]]:
        """`prefill` of a whole prompt (no cached prefix) that also scores it: (float32 logits of
        the last position [V], the logprob of every prompt token after the first with the k most
        likely tokens at its position). No [L, V] buffer: logits are made in chunks."""
        if seq.num_cached:
            raise ValueError("scoring a prompt needs every position computed (no cached prefix)")
        packed = []
        for plan in self._prefill_plans(seq, stop):
            end = seq.num_cached + len(plan.input_ids)
            plan.prompt_logprobs = k
            plan.score_next = seq.prompt_ids[end] if end < len(seq.prompt_ids) else None
            last, rows = self._step(plan)
            packed.append(rows)
            seq.num_cached = end
        self._prefilled(seq, finish)
        return last, unpack_prompt_logprobs(torch.cat(packed), seq.prompt_ids, k)

    def _prefill_plans(self, seq: Sequence, stop: Callable[[], bool] | None = None):
        """The prompt's forward passes from `seq.num_cached`, `prefill_chunk_tokens` at a time;
        each is planned when the one before it has run (the caller advances seq.num_cached)."""
        n, first = len(seq.prompt_ids), seq.num_cached
        if not 0 <= first < n:
            raise ValueError(f"prefill from position {first} of a {n}-token prompt computes nothing")
        while seq.num_cached < n:
            start = seq.num_cached
            if start > first and stop is not None and stop():
                raise PrefillStopped(f"request {seq.request_id} stopped after {start - first} of "
                                     f"{n - first} prompt positions")
            yield self._prefill_plan(seq, start, min(n, start + self.prefill_chunk_tokens))
            if seq.num_cached == start:
                raise RuntimeError("prefill chunk ran but the sequence did not advance")

    def _prefill_plan(self, seq: Sequence, start: int, end: int) -> StepPlan:
        """Positions [start, end) over the KV of every position before them. The request keeps
        all its sliding pages while it prefills (a prefix cache adopts them); the sliding layers'
        attention gets only the pages from the window of `start` on."""
        cache, b = self.cache, seq.blocks
        slots = cache.prepare(b, start, end - start, slide=False)
        tables = cache.tables(b, end)
        if "sliding" in tables:
            skip = sliding_first_page(start, cache.window, cache.page_size) - b.sliding_first_page
            if skip > 0:
                tables["sliding"] = (b.sliding[skip:], end - (b.sliding_first_page + skip) * cache.page_size)
        batches = make_batches(cache, [tables], [end - start])
        return StepPlan(list(seq.prompt_ids[start:end]), list(range(start, end)), slots, batches, [end - start])

    def _prefilled(self, seq: Sequence, finish: bool) -> None:
        n = len(seq.prompt_ids)
        seq.num_cached = n
        if finish:
            self.cache.finish_prefill(seq.blocks, n)

    def _copy_blocks(self, copies: dict[str, list[tuple[int, int]]]) -> None:
        """Copy whole blocks (every layer of the pool) on this rank's KV."""
        for pool, pairs in copies.items():
            if pairs:
                src = torch.tensor([a for a, _ in pairs], device=self.device)
                dst = torch.tensor([b for _, b in pairs], device=self.device)
                self.cache.pools[pool][:, dst] = self.cache.pools[pool][:, src]

    def decode(self, seqs: list[Sequence], block_copies: dict[str, list[tuple[int, int]]] | None = None,
               device_ids: torch.Tensor | None = None, keep_logits: bool = True) -> torch.Tensor:
        """One token for each request (its last sampled one at position num_cached): [B, V].
        `block_copies` (see StepPlan) run first, on every rank; device_ids: the first
        len(device_ids) requests' tokens, still on the device; keep_logits: see StepPlan."""
        plan = self.decode_plan(seqs, device_ids)
        plan.block_copies = block_copies or {}
        plan.keep_logits = keep_logits
        logits = self._step(plan)
        for s in seqs:
            s.num_cached += 1
        return logits

    def decode_plan(self, seqs: list[Sequence], device_ids: torch.Tensor | None = None) -> StepPlan:
        """The step that feeds each request its last token (makes the KV slots writable)."""
        ids, positions, tables = [], [], []
        slot_parts: dict[str, list[int]] = {}
        on_device = 0 if device_ids is None else device_ids.numel()
        for i, s in enumerate(seqs):
            pos = s.num_cached
            for g, slot in self.cache.prepare_one(s.blocks, pos).items():
                slot_parts.setdefault(g, []).append(slot)
            ids.append(s.last_token if i >= on_device else 0)
            positions.append(pos)
            tables.append(self.cache.tables(s.blocks, pos + 1))
        slots = {g: torch.tensor(v, dtype=torch.long) for g, v in slot_parts.items()}
        qo_lens = [1] * len(seqs)
        return StepPlan(ids, positions, slots, make_batches(self.cache, tables, qo_lens), qo_lens,
                        device_ids=device_ids)

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """Float32 logits of every prompt position [L, V], through the paged path."""
        self.validate_prompt(ids)
        seq = Sequence("logits", list(ids), SamplingParams(max_new_tokens=1, temperature=0))
        seq.blocks = self.cache.reserve(len(ids), local_prompt_tokens=len(ids))
        try:
            return self.prefill(seq, all_logits=True)
        finally:
            self.cache.release(seq.blocks)
