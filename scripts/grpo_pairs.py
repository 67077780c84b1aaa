"""Paired, interleaved GRPO steps: stock trl against ``SafeVocabGRPOTrainer`` in one process, step by step.

Two trainers on the same model path run their own ``train()`` loops on two threads that take turns at each optimizer
step (a callback holds a trainer at ``on_step_begin`` until its turn), so the two never overlap and every
measurement of one sits between two of the other: a drift of the machine (clocks, other jobs, the allocator's
cache) hits both alike. The order within a pair alternates (stock first in odd pairs, SafeVocab first in even
ones: ABBA), which cancels a first-in-pair effect. The first step of each trainer is a warm-up and is not counted.

Reported: every step time, the per-pair ratio ``SafeVocab / stock``, its median and a distribution-free 95 %
interval of that median (order statistics of the binomial, as for a sign test), so the overhead goal "≤ 3 % at the
upper end of the 95 % interval" is decided from the interval, not from two medians.

Used by ``scripts/gpu_bench.py --grpo-pairs N``; tooling, not product code.
"""

from __future__ import annotations

import math
import statistics
import threading
import time


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval of the median: ``[x_(k), x_(n+1-k)]`` with the largest ``k`` whose two-sided
    binomial(n, 1/2) tail stays within ``1 - confidence``; the full range when ``n`` is too small for that."""
    xs, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("values: expected at least one value, got none")
    alpha, k = 1.0 - confidence, 0
    for j in range(1, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(j)) / 2**n  # P(Bin(n, 1/2) <= j - 1)
        if 2 * tail <= alpha:
            k = j
    if k == 0:
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]


def turn_schedule(pairs: int) -> list[str]:
    """The order of steps: one warm-up each, then ``pairs`` pairs in ABBA order."""
    order = ["stock", "safevocab"]
    for i in range(pairs):
        order += ["stock", "safevocab"] if i % 2 == 0 else ["safevocab", "stock"]
    return order


class TurnTaking:
    """Hands the turn between the two trainers' threads by a fixed schedule; a trainer that stops (done or failed)
    releases the other."""

    def __init__(self, schedule: list[str], synchronize) -> None:
        self.schedule, self.position, self.synchronize = schedule, 0, synchronize
        self.condition = threading.Condition()
        self.stopped: set[str] = set()
        self.times: dict[str, list[float]] = {"stock": [], "safevocab": []}
        self.order: list[str] = []  # who ran each step, in order: checks the interleaving
        self._started = 0.0

    def callback(self, name: str):
        from transformers import TrainerCallback

        turns = self

        class Turn(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                with turns.condition:
                    turns.condition.wait_for(lambda: turns._my_turn(name))
                turns.synchronize()
                turns.order.append(name)
                turns._started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                turns.synchronize()
                turns.times[name].append(time.perf_counter() - turns._started)
                with turns.condition:
                    turns.position += 1
                    turns.condition.notify_all()

            def on_train_end(self, args, state, control, **kwargs):
                turns.stop(name)

        return Turn()

    def _my_turn(self, name: str) -> bool:
        if self.position >= len(self.schedule):
            return True  # past the schedule: no more pairing
        return self.schedule[self.position] == name or self._other(name) in self.stopped

    @staticmethod
    def _other(name: str) -> str:
        return "safevocab" if name == "stock" else "stock"

    def stop(self, name: str) -> None:
        with self.condition:
            self.stopped.add(name)
            self.condition.notify_all()


def pair_ratios(times: dict[str, list[float]], pairs: int) -> list[float]:
    """``SafeVocab / stock`` per pair, warm-ups left out."""
    stock, ours = times["stock"][1 : pairs + 1], times["safevocab"][1 : pairs + 1]
    return [b / a for a, b in zip(stock, ours)]


def run_pairs(make_trainer, pairs: int, synchronize=lambda: None) -> dict:
    """Build both trainers (``make_trainer(kind, max_steps, callbacks)``), run them interleaved, return the figures."""
    turns = TurnTaking(turn_schedule(pairs), synchronize)
    trainers = {kind: make_trainer(kind, pairs + 1, [turns.callback(kind)]) for kind in ("stock", "safevocab")}
    errors: dict[str, str] = {}

    def train(kind: str) -> None:
        try:
            trainers[kind].train()
        except Exception as err:  # recorded; the other trainer is released and the row says what failed
            errors[kind] = f"{type(err).__name__}: {err}"[:400]
        finally:
            turns.stop(kind)

    threads = [threading.Thread(target=train, args=(kind,), name=f"grpo-{kind}") for kind in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out: dict = {
        "pairs": pairs,
        "order": turns.order,
        "stock_seconds": turns.times["stock"],
        "safevocab_seconds": turns.times["safevocab"],
    }
    if errors:
        out["error"] = "; ".join(f"{k}: {v}" for k, v in errors.items())
        return out
    ratios = pair_ratios(turns.times, pairs)
    low, high = median_interval(ratios)
    out.update(
        ratios=[round(r, 4) for r in ratios],
        median_ratio=round(statistics.median(ratios), 4),
        ratio_95=[round(low, 4), round(high, 4)],
        stock_median_seconds=round(statistics.median(turns.times["stock"][1:]), 4),
        safevocab_median_seconds=round(statistics.median(turns.times["safevocab"][1:]), 4),
        overhead_goal_met=high <= 1.03,
    )
    return out
