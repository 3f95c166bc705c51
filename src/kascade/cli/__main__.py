"""``python -m kascade.cli``: the `kascade` command."""

import sys

from . import main

sys.exit(main())
