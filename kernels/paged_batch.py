"""One step's requests over one paged KV pool, as every attention backend plans from it
(FlashInfer's description: query rows, pages and last-page lengths per request; kernels.attention
says how queries and keys line up)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """Host-side description of one step's requests over one paged KV pool (int32 tensors)."""

    qo_indptr: torch.Tensor  # [B + 1] query rows of request i: qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [B + 1] pages of request i: kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [num_pages] physical page ids, in logical order
    kv_last_page_len: torch.Tensor  # [B] valid entries in each request's last page (1..page_size)
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def kv_lens(self) -> torch.Tensor:
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (pages - 1) * self.page_size + self.kv_last_page_len

    @property
    def is_decode(self) -> bool:
        return bool(((self.qo_indptr[1:] - self.qo_indptr[:-1]) == 1).all())

    @classmethod
    def from_tables(
        cls, qo_lens: list[int], kv_lens: list[int], tables: list[list[int]], page_size: int
    ) -> "PagedBatch":
        if not (len(qo_lens) == len(kv_lens) == len(tables)):
            raise ValueError("qo_lens, kv_lens and tables differ in length")
        qo, kv, idx, last = [0], [0], [], []
        for q, k, table in zip(qo_lens, kv_lens, tables):
            pages = -(-k // page_size)
            if q > k or pages > len(table) or k <= 0:
                raise ValueError(f"bad request shape: qo_len={q} kv_len={k} pages={len(table)}")
            qo.append(qo[-1] + q)
            kv.append(kv[-1] + pages)
            idx.extend(table[:pages])
            last.append(k - (pages - 1) * page_size)
        i32 = dict(dtype=torch.int32)
        return cls(
            torch.tensor(qo, **i32), torch.tensor(kv, **i32), torch.tensor(idx, **i32),
            torch.tensor(last, **i32), page_size,
        )
