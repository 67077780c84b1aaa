#!/usr/bin/env python
"""Build and pretrain the bundled testbed model: ``python scripts/train_testbed_model.py [--help]``.

A thin wrapper: the code is :mod:`trl_integration.demo.testbed_train` (it writes ``trl_integration/demo/assets/testbed``
by default; see its docstring for what is reproducible and ``docs/testbed.md`` for the recorded build).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from trl_integration.demo.testbed_train import main  # noqa: E402

if __name__ == "__main__":
    main()
