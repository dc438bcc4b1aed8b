"""``python -m megatron_dualpipe.cli``, as ``python -m megatron_dualpipe``."""

import sys

from .command import main

sys.exit(main())
