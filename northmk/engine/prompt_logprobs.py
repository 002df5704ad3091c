"""Prompt logprobs: each prompt token's logprob given the tokens before it.

A request that asks for them is prefilled with logits at every position of each chunk
([n, V] float32). Row j of a chunk that starts at `start` predicts prompt token
start + j + 1; the whole prompt is known up front, so that token is named even when it
opens the next chunk. The last row of the last chunk predicts the first generated token,
which is the sampler's business, not ours. The distribution is the raw log-softmax, the
same one generated-token logprobs report.
"""

from __future__ import annotations

import torch

from .types import TokenLogprob

SLICE_ROWS = 64  # rows log-softmaxed at a time: temporaries stay at [64, V] float32


class PromptScorer:
    """Collects one request's prompt logprobs chunk by chunk, in order."""

    def __init__(self, prompt_ids: list[int], num_top: int):
        self.prompt_ids = prompt_ids
        self.num_top = num_top
        self.items: list[TokenLogprob | None] = [None]  # the first token has no context

    @property
    def complete(self) -> bool:
        return len(self.items) == len(self.prompt_ids)

    def score(self, logits: torch.Tensor, start: int) -> None:
        """logits [n, V] of prompt positions start..start+n-1 -> the logprobs of the tokens they predict."""
        assert len(self.items) == start + 1, f"chunk at {start} after {len(self.items)} scored tokens"
        targets = self.prompt_ids[start + 1: start + 1 + logits.shape[0]]
        for lo in range(0, len(targets), SLICE_ROWS):
            ids = targets[lo: lo + SLICE_ROWS]
            self.items += token_logprobs(logits[lo: lo + len(ids)], ids, self.num_top)


def token_logprobs(logits: torch.Tensor, ids: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [r, V], one given token per row -> its logprob and rank, and the row's top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [r, V]
    index = torch.tensor(ids, dtype=torch.long, device=logprobs.device).unsqueeze(1)  # [r, 1]
    chosen = logprobs.gather(1, index)  # [r, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [r]
    top_ids, top_vals = [[] for _ in ids], [[] for _ in ids]
    if num_top > 0:
        vals, top = torch.topk(logprobs, min(num_top, logprobs.shape[1]), dim=-1)  # [r, k]
        top_ids, top_vals = top.tolist(), vals.tolist()
    return [
        TokenLogprob(token_id=t, logprob=lp, top=list(zip(ti, tv)), rank=rank)
        for t, lp, rank, ti, tv in zip(ids, chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_vals)
    ]
