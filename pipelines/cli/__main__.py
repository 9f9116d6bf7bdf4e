"""``python -m pipelines.cli``: the ``freescale`` command."""

import sys

from pipelines.cli import main

sys.exit(main())
