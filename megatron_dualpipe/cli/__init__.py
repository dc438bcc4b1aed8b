"""The ``megatron-dualpipe`` command (entry-point layer), a module per command; it may
import every layer, and torch and megatron only inside a command that needs them.

- :mod:`.command`: the top parser, :func:`main`, and each error's message and exit status;
- :mod:`.common`: what several commands share (unwinding on SIGTERM and SIGHUP, output
  checks, ``--json-keys``);
- :mod:`.simulate`, :mod:`.train` (and ``--dry-run``), :mod:`.preprocess`,
  :mod:`.make_tokenizer`, :mod:`.patch_megatron_lm`: each parses its arguments and calls
  the layer that does the work.

Importing this package imports neither torch nor megatron: ``simulate`` is pure Python, and
``train`` and ``preprocess`` import what they need when they run. The benchmark is no
command of the installed package: ``python -m bench`` in the checkout (``bench/``).
"""

from .command import main

__all__ = ["main"]
