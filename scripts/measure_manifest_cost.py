"""What the checkpoint manifest costs (issue 57): a checkpoint built from a model's ``model.safetensors`` and an AdamW
state of the same parameters (what a Trainer's save writes, less the small files), timed in one run:

- the save's own writes: copying the weights, ``torch.save`` of the optimizer state;
- :func:`trl_integration.harness.manifest.write_manifest` (every file's size and CRC-32) and the resume-time
  verification, :func:`~trl_integration.harness.manifest.manifest_problem`.

    OMP_NUM_THREADS=1 python scripts/measure_manifest_cost.py ~/.cache/safevocab/smollm2-135m-instruct/model.safetensors
    OMP_NUM_THREADS=1 python scripts/measure_manifest_cost.py trl_integration/demo/assets/tiny-arith/model.safetensors

Writes the checkpoint into a temporary folder and deletes it. The figures go to docs/trl.md, "Checkpoints and resuming".
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from trl_integration.harness.manifest import manifest_problem, write_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", type=Path, help="a model.safetensors")
    weights = parser.parse_args().weights
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        start = time.perf_counter()
        shutil.copy(weights, out / "model.safetensors")
        copy_s = time.perf_counter() - start
        params = load_file(weights)
        moments = {
            i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
            for i, p in enumerate(params.values())
        }  # fmt: skip
        start = time.perf_counter()
        torch.save({"state": moments, "param_groups": [{"params": list(moments)}]}, out / "optimizer.pt")
        save_s = time.perf_counter() - start
        size = sum(p.stat().st_size for p in out.iterdir())
        start = time.perf_counter()
        write_manifest(out)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        problem = manifest_problem(out)
        verify_s = time.perf_counter() - start
    print(
        f"checkpoint {size / 1e9:.3f} GB: weights copy {copy_s:.2f} s, optimizer torch.save {save_s:.2f} s; manifest "
        f"write {write_s:.2f} s, verify {verify_s:.2f} s ({size / 1e9 / max(verify_s, 1e-9):.1f} GB/s); {problem=}"
    )


if __name__ == "__main__":
    main()
