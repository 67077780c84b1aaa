#!/usr/bin/env python
"""Build and train the bundled tiny arithmetic model: ``python scripts/train_tiny_model.py [--help]``.

A thin wrapper: the code is :mod:`trl_integration.demo.train` (it writes ``trl_integration/demo/assets/tiny-arith``
by default; see ``docs/tiny_model.md``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from trl_integration.demo.train import main  # noqa: E402

if __name__ == "__main__":
    main()
