"""``python -m megatron_dualpipe`` is the ``megatron-dualpipe`` command."""

import sys

from .cli import main

sys.exit(main())
