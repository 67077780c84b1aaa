"""Writes ``length_decay_first_release.pt``: states and LR sequences of the first release's length-decay classes.

The first release (``safevocab/schedulers.py`` at commit 6ce8c0d, before ``LengthDecayLR`` could wrap a schedule and
before the cooldown, the decay cap and the EMA baseline) is read from git, so the file records that code's own
output. ``tests/safevocab/test_length_decay_resume.py`` loads these states into today's classes and checks that they resume
the run exactly as the first release continued it. Rerun (from the repository root):

    python tests/safevocab/data/make_length_decay_first_release.py
"""

import importlib.util
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

COMMIT = "6ce8c0d"
HERE = Path(__file__).resolve().parent


def first_release():
    source = subprocess.run(
        ["git", "show", f"{COMMIT}:safevocab/schedulers.py"], capture_output=True, text=True, check=True, cwd=HERE
    ).stdout
    path = Path(tempfile.mkdtemp()) / "first_release_schedulers.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("first_release_schedulers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def lengths(steps=400):
    rng = random.Random(3)
    return [(500.0 if step < 70 else 1500.0) * (1 + 0.05 * rng.gauss(0, 1)) for step in range(1, steps + 1)]


def record(make, series, save_at):
    """Run ``make()``'s (optimizer, scheduler) over ``series``; the per-step LRs and the states after ``save_at``."""
    optimizer, scheduler = make()
    lrs, states = [], {}
    for step, length in enumerate(series, 1):
        optimizer.step()
        scheduler.step()
        if scheduler.detector is not None:
            scheduler.observe_length(step, length)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        if step in save_at:
            states[step] = {"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()}
    return lrs, states


def main():
    old = first_release()

    def optimizer():
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
        return torch.optim.SGD([{"params": [params[0]], "lr": 1e-3}, {"params": [params[1]], "lr": 2e-4}])

    def on_surge():  # what SafeVocabGRPOTrainer builds with length_decay_period="auto"
        opt = optimizer()
        return opt, old.LengthDecayLR(opt, decay_period=1, detector=old.SurgeDetector(), auto_period=True)

    def step0():
        opt = optimizer()
        return opt, old.LengthDecayLR(opt, decay_period=7, min_lr_ratio=0.2, start="step0")

    series = lengths()
    save_at = (30, 71, 75, 150, 250)  # before the surge, just before its detection, after it, while decaying
    out = {"commit": COMMIT, "lengths": series}
    for name, make in (("on_surge", on_surge), ("step0", step0)):
        lrs, states = record(make, series, save_at)
        out[name] = {"lrs": lrs, "states": states}
    detector = old.SurgeDetector()
    out["detector"] = {"states": {}, "fired": []}
    for step, length in enumerate(series, 1):
        if detector.update(step, length):
            out["detector"]["fired"].append(step)
        if step in save_at:
            out["detector"]["states"][step] = detector.state_dict()
    out["detector"]["surge_step"] = detector.surge_step
    torch.save(out, HERE / "length_decay_first_release.pt")


if __name__ == "__main__":
    main()
