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


def expected_log_ratios(model, sequences) -> torch.Tensor:
    """``log softmax(z) - log softmax(z + DELTA on even ids)`` at each counted token of ``sequences`` (``(ids,
    counted)`` pairs), ``z`` the model's own logits in float64: what ``BatchDependent`` moves, micro-batch 1 minus a
    batch of several rows."""
    expected = []
    for ids, counted in sequences:
        with torch.no_grad():
            z = model(ids[None]).logits[0, :-1][counted].double()
        lifted = z.clone()
        lifted[:, ::2] += BatchDependent.DELTA
        y = ids[1:][counted][:, None]
        expected.append((z.log_softmax(-1).gather(-1, y) - lifted.log_softmax(-1).gather(-1, y))[:, 0])
    return torch.cat(expected)
