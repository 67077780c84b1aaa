"""``python -m trl_integration.commands COMMAND [ARGS...]``: the ``safevocab`` console script without the script."""

import sys

from trl_integration.commands import main

sys.exit(main())
