"""GPT pretraining through Megatron-LM's own ``pretrain()`` with ``--pipeline-schedule``:
this project's ``pretrain_gpt.py`` (:mod:`megatron_dualpipe.megatron.pretrain_gpt`), for
torchrun. Every flag is Megatron-LM's; ``--pipeline-schedule`` is ours.

    megatron-dualpipe patch-megatron-lm --out megatron-lm-patched
    PYTHONPATH=$PWD/megatron-lm-patched torchrun --nproc-per-node 8 \\
        scripts/pretrain_gpt_megatron_lm.py --pipeline-schedule dualpipev ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from megatron_dualpipe.lifetime import forks_die_with_forker  # noqa: E402
from megatron_dualpipe.megatron.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    forks_die_with_forker()  # a save's checkpoint writers die with this rank
    step = main()
    if step is not None:  # --pipeline-timeline, on global rank 0
        from megatron_dualpipe.planner.measured_step import report_measured_step

        print("\n".join(report_measured_step(*step)))
