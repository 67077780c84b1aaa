"""safevocab.correction.importance_sampling_ratio: bounds, masks and infinite log-probabilities (issue 37, N4b).

trl's own semantics (the four modes, NaN rollout log-probs give ratio 1) are pinned against trl in
``tests/trl_integration/grpo/test_step.py``; these pin the inputs trl does not check.
"""

from __future__ import annotations

import math

import pytest
import torch

from safevocab.correction import importance_sampling_ratio

TRAIN = torch.tensor([[-1.0, -2.0, -0.5]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5]])
MASK = torch.ones(1, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"clip_max": math.nan}, ValueError, "clip_max=nan is out of range"),
        (
            {"clip_min": -1.0, "clip_max": -0.5},
            ValueError,
            "clip_min=-1.0 is out of range: accepted None (unbounded) or a finite ratio >= 0",
        ),
        ({"clip_min": None, "clip_max": -0.5}, ValueError, "clip_max=-0.5 is out of range"),
        (
            {"clip_min": 2.0, "clip_max": 1.0},
            ValueError,
            "clip_min=2.0 with clip_max=1.0: accepted clip_min < clip_max",
        ),
        ({"clip_max": "3"}, TypeError, "clip_max must be a real number, got str: '3'"),
        ({"clip_min": math.nan}, ValueError, "clip_min=nan is out of range"),
        (
            {"mask": torch.tensor([[1.0, 2.0, 1.0]])},
            ValueError,
            "mask has value 2.0 at (0, 1): accepted a bool mask or 0/1 values",
        ),
        ({"mask": torch.tensor([[0.5, 1.0, 1.0]])}, ValueError, "mask has value 0.5 at (0, 0)"),
    ],
)
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_bad_bounds_and_masks_raise_one_line_naming_the_argument(kwargs, error, message, mode):
    """clip_max=nan gave all-NaN ratios, negative bounds negative ratios, "3" a raw TypeError, a mask of 2 or 0.5
    scaled the log-ratio silently."""
    kwargs = {"mask": MASK, **kwargs}
    with pytest.raises(error) as err:
        importance_sampling_ratio(TRAIN, ROLLOUT, mode=mode, **kwargs)
    assert str(err.value) == message or str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_no_bounds_leave_the_ratio_unbounded_in_every_mode(mode):
    """None, None with a truncate mode was a raw RuntimeError from torch.clamp; the docstring says unbounded."""
    out = importance_sampling_ratio(TRAIN, ROLLOUT, MASK, mode=mode, clip_min=None, clip_max=None)
    torch.testing.assert_close(out.ratio, torch.exp(out.log_raw))
    assert not bool(out.clipped.any())
    assert (
        importance_sampling_ratio(TRAIN, ROLLOUT, MASK.float(), mode=mode, clip_max=math.inf).ratio.shape
        == out.ratio.shape
    )


def test_infinite_log_probs_are_taken_token_by_token():
    """A -inf train log-prob at one token and a -inf rollout log-prob at another gave ratio 1, unclipped (trl's
    nan_to_num made them -3.4e38 and +3.4e38, which cancel in the sum)."""
    train = torch.tensor([[-math.inf, -1.0, -1.0], [-math.inf, -1.0, -1.0], [-1.0, -1.0, -1.0], [-math.inf, 0.0, 0.0]])
    rollout = torch.tensor(
        [[-1.0, -math.inf, -1.0], [-1.0, -1.0, -1.0], [-1.0, -math.inf, -1.0], [-math.inf, 0.0, 0.0]]
    )
    mask = torch.ones(4, 3, dtype=torch.bool)
    for mode in ("sequence_mask", "sequence_truncate"):
        out = importance_sampling_ratio(train, rollout, mask, mode=mode, clip_min=0.5, clip_max=2.0)
        assert math.isnan(out.log_raw[0, 0].item()) and out.ratio[0, 0].item() == 0.0 and out.clipped[0, 0].item()
        assert out.log_raw[1, 0].item() == -math.inf and out.clipped[1, 0].item()  # pi_train(sequence) = 0
        assert out.log_raw[2, 0].item() == math.inf and out.clipped[2, 0].item()
        assert out.log_raw[3, 0].item() == 0.0 and out.ratio[3, 0].item() == 1.0  # both engines: impossible
        expected = [0.0, 0.0, 0.0, 1.0] if mode == "sequence_mask" else [0.0, 0.5, 2.0, 1.0]
        assert out.ratio.squeeze(-1).tolist() == expected, mode
    out = importance_sampling_ratio(train, rollout, mask, mode="token_truncate", clip_min=None, clip_max=2.0)
    assert out.ratio[0].tolist() == [0.0, 2.0, 1.0] and out.clipped[0].tolist() == [False, True, False]
    out = importance_sampling_ratio(train, rollout, mask, mode="token_mask", clip_min=None, clip_max=2.0)
    assert out.ratio[0].tolist() == [0.0, 0.0, 1.0] and out.clipped[0].tolist() == [False, True, False]
    padded = importance_sampling_ratio(train, rollout, torch.tensor([[False, True, True]] * 4), mode="sequence_mask")
    assert padded.log_raw[0, 0].item() == math.inf  # the -inf train token is padding: it does not count
