"""A forced batch-dependent kernel for the batch-shape tests (tests/trl_integration/lab/): with more than one row per
call, every even token id's logit gains ``DELTA``; a call of one row (micro-batch 1, the packed row) is the model's
own."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class BatchDependent(torch.nn.Module):
    DELTA = 0.3

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, **kwargs):
        logits = self.inner(input_ids=input_ids, **kwargs).logits
        if input_ids.shape[0] > 1:
            logits = logits.clone()
            logits[..., ::2] += self.DELTA
        return SimpleNamespace(logits=logits)
