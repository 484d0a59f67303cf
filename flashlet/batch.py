"""Turns a SchedulerOutput into the step's model inputs and AttentionMetadata, written in place
into persistent buffers (pinned host memory, copied to the device once per step) so that no
tensor is allocated per step and a CUDA graph can capture the step."""

from __future__ import annotations

import numpy as np
import torch

from flashlet.attention.base import AttentionMetadata
from flashlet.request import PLACEHOLDER
from flashlet.scheduler import SchedulerOutput


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, page_size: int, device):
        self.page_size = page_size
        self.device = torch.device(device)
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "qo_indptr": max_seqs + 1, "paged_kv_indptr": max_seqs + 1,
                 "paged_kv_indices": max_pages, "paged_kv_last_page_len": max_seqs,
                 "kv_lens": max_seqs, "logits_indices": max_seqs,
                 "feed_rows": max_seqs, "feed_src": max_seqs}
        int64 = {"input_ids", "positions", "slot_mapping", "logits_indices", "feed_rows",
                 "feed_src"}
        pin = self.device.type == "cuda"
        self.host, self.dev, self.np = {}, {}, {}
        for name, size in sizes.items():
            dtype = torch.int64 if name in int64 else torch.int32
            self.host[name] = torch.zeros(size, dtype=dtype, pin_memory=pin)
            self.np[name] = self.host[name].numpy()
            self.dev[name] = self.host[name] if not pin else torch.zeros(size, dtype=dtype, device=device)
        # Decode rows whose input token is still a placeholder (overlap): input_ids[feed_rows]
        # must take the previous step's sampled tokens[feed_src]. None when there are none.
        self.feed: tuple[torch.Tensor, torch.Tensor] | None = None

    def fill(self, sched: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, list]:
        """Write the step's inputs; returns (input_ids, metadata, requests that sample)."""
        ps = self.page_size
        ids, pos, slots, qo, kv_ptr, kv_idx, last, kv_lens, logit_rows = ([] for _ in range(9))
        feed_rows, feed_src = [], []
        qo.append(0)
        kv_ptr.append(0)
        sampling = []
        for req, n in sched.scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            pages = req.page_ids
            if n == 1:  # a decode: the common case, kept free of temporaries
                token = req.token_at(start)
                if token == PLACEHOLDER:
                    feed_rows.append(len(ids))
                    feed_src.append(req.sample_row)
                    token = 0
                ids.append(token)
                pos.append(start)
                slots.append(pages[start // ps] * ps + start % ps)
            else:
                ids += req.token_slice(start, end)
                pos += range(start, end)
                slots += [pages[p // ps] * ps + p % ps for p in range(start, end)]
            num_pages = (end + ps - 1) // ps
            kv_idx += pages[:num_pages]
            qo.append(qo[-1] + n)
            kv_ptr.append(kv_ptr[-1] + num_pages)
            last.append(end - (num_pages - 1) * ps)
            kv_lens.append(end)
            if end == req.num_tokens:
                logit_rows.append(qo[-1] - 1)
                sampling.append(req)
        values = dict(input_ids=ids, positions=pos, slot_mapping=slots, qo_indptr=qo,
                      paged_kv_indptr=kv_ptr, paged_kv_indices=kv_idx,
                      paged_kv_last_page_len=last, kv_lens=kv_lens, logits_indices=logit_rows,
                      feed_rows=feed_rows, feed_src=feed_src)
        input_ids, meta = self.write(values, sched.is_pure_decode)
        return input_ids, meta, sampling

    def write(self, values: dict, is_pure_decode: bool) -> tuple[torch.Tensor, AttentionMetadata]:
        """Copy a step's layout ({field: list or int array}) into the buffers; `fill` builds it
        from a schedule, a tensor-parallel worker receives it from rank 0."""
        views, host = {}, {}
        for name, vals in values.items():
            n = len(vals)
            if isinstance(vals, np.ndarray):
                self.np[name][:n] = vals
            else:
                # fromiter: faster than from a list
                self.np[name][:n] = np.fromiter(vals, self.np[name].dtype, n)
            host[name] = self.host[name][:n]
            if self.dev[name] is not self.host[name]:
                self.dev[name][:n].copy_(host[name], non_blocking=True)
            views[name] = self.dev[name][:n]
        feeds = len(values.get("feed_rows", ()))
        self.feed = (views["feed_rows"], views["feed_src"]) if feeds else None
        qo, kv_ptr, kv_lens = (_as_list(values[k]) for k in ("qo_indptr", "paged_kv_indptr",
                                                              "kv_lens"))
        meta = AttentionMetadata(
            num_tokens=len(values["input_ids"]), num_seqs=len(qo) - 1, positions=views["positions"],
            slot_mapping=views["slot_mapping"], qo_indptr=views["qo_indptr"],
            paged_kv_indptr=views["paged_kv_indptr"], paged_kv_indices=views["paged_kv_indices"],
            paged_kv_last_page_len=views["paged_kv_last_page_len"], kv_lens=views["kv_lens"],
            logits_indices=views["logits_indices"], qo_indptr_host=qo,
            paged_kv_indptr_host=kv_ptr, kv_lens_host=kv_lens,
            is_pure_decode=is_pure_decode, host_tensors=host,
        )
        return views["input_ids"], meta


def _as_list(values) -> list:
    return values if isinstance(values, list) else values.tolist()
