"""The evaluation loop the demo tasks share: generate completions in batches and average a reward over them.

``mean_reward = (1 / N) * sum_i reward(prompt_i, generate(prompt_i), target_i)`` over ``N`` prompts, generated with
left padding in batches, decoded with ``skip_special_tokens=True`` as trl does. The model is in eval mode and under
``no_grad`` throughout; its training mode and torch's global RNG state are restored afterwards, so an evaluation in
the middle of a run leaves the run's sampling stream as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Reward = Callable[[list[str], list[str], list[str]], list[float]]


def mean_reward(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    targets: Sequence[str],
    reward: Reward,
    *,
    batch_size: int,
    max_new_tokens: int,
    sampling: dict[str, Any],
    seed: int | None,
    progress: bool | str = False,
    unit: str = "prompt",
) -> float:
    """Mean of ``reward(prompts, completions, targets)`` over ``prompts``.

    Args:
        model: a causal LM on any device; tokenizer: its tokenizer (needs a pad token).
        prompts, targets: ``N`` prompts and what each one's reward compares against (``N >= 1``).
        reward: ``(prompts, completions, targets) -> rewards`` for one batch.
        sampling: keyword arguments of ``model.generate`` that choose the decoding (``do_sample``, ...).
        seed: seeds torch's global RNG for the evaluation (restored afterwards); ``None`` leaves it alone.
        progress: a tqdm bar over the prompts on stderr, labelled with ``progress`` when it is a string, counting
            ``unit`` (default "prompt").
    """
    import torch
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rng_state = torch.random.get_rng_state()
    label = progress if isinstance(progress, str) else "evaluation"
    bar = tqdm(total=len(prompts), desc=label, unit=unit, disable=not progress, dynamic_ncols=True)
    total = 0.0
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                batch = list(prompts[start : start + batch_size])
                enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left").to(device)
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                total += sum(reward(batch, texts, list(targets[start : start + batch_size])))
                bar.update(len(batch))
    finally:
        bar.close()
        torch.random.set_rng_state(rng_state)
        model.train(was_training)
    return total / len(prompts)
