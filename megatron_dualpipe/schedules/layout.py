"""Megatron's ``pipeline_model_parallel_layout`` string, read over our model stages.

Megatron-LM's ``--pipeline-model-parallel-layout`` lists the pipeline stages separated by
``|``. In a stage, ``E`` is the embedding, ``t`` one decoder (transformer) layer, ``m`` one
multi-token-prediction (MTP) layer and ``L`` the output layer with the loss; ``x*N``
repeats one character and ``(...)*N`` a group (groups do not nest); commas are cosmetic.
So ``"Et*3|(tt|)*29,m|L"`` is 32 stages: the embedding and three layers, 29 stages of two
layers, an MTP stage and a loss stage.

Megatron-Core numbers the stages of an interleaved pipeline ``vpp_rank x PP + pp_rank``,
which is the order data flows through them. Our schedules read the list in the same
*pipeline order* (as :mod:`.layer_split` reads the first/last counts): under dualpipev
entry k is stage k of the V (on rank k for k < PP, on rank 2PP-1-k after), under dualpipe
the PP model stages (each held twice), under 1f1b and zb1p the PP stages.
"""

from __future__ import annotations

import re

from .ir import ScheduleError

__all__ = ["EMBEDDING", "LOSS", "MTP", "DECODER", "check_layout", "format_layout", "parse_layout"]

EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT = re.compile(r"([^()|*])\*(\d+)")


def parse_layout(text: str) -> list[str]:
    """The stages of a layout string, each as its characters with repetitions unrolled
    (``"Et*2|tt|tmL"`` -> ``["Ett", "tt", "tmL"]``); :class:`ScheduleError` if unreadable."""
    flat = text.replace(",", "").replace(" ", "")
    flat = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), flat)
    flat = _REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), flat)
    stray = sorted(set(flat) - {EMBEDDING, DECODER, MTP, LOSS, "|"})
    if stray:
        raise ScheduleError(
            f"cannot read the pipeline layout {text!r} at {''.join(stray)!r}: write stages "
            "of E (embedding), t (decoder layer), m (MTP layer) and L (loss) separated by |, "
            "with x*N and (...)*N for repeats, e.g. 'Et*3|(tt|)*29,m|L'"
        )
    return flat.split("|")


def check_layout(
    stages: list[str], num_layers: int, mtp_num_layers: int, model_stages: int
) -> list[int]:
    """Decoder layers per stage of a parsed layout, after checking it holds what Megatron-Core
    requires for ``num_layers`` and ``mtp_num_layers`` over ``model_stages`` stages; else
    one :class:`ScheduleError` sentence."""
    joined = "".join(stages)
    if len(stages) != model_stages:
        raise ScheduleError(
            f"the pipeline layout has {len(stages)} stages but the schedule cuts the model into "
            f"{model_stages}: give {model_stages} stages separated by |"
        )
    if joined.count(EMBEDDING) != 1 or not stages[0].startswith(EMBEDDING):
        raise ScheduleError("the pipeline layout must start with E (the embedding), once")
    if joined.count(LOSS) != 1 or not stages[-1].endswith(LOSS):
        raise ScheduleError("the pipeline layout must end with L (the loss), once")
    if joined.count(DECODER) != num_layers:
        raise ScheduleError(
            f"the pipeline layout holds {joined.count(DECODER)} decoder layers (t) but "
            f"num_layers is {num_layers}"
        )
    if joined.count(MTP) != mtp_num_layers:
        raise ScheduleError(
            f"the pipeline layout holds {joined.count(MTP)} MTP layers (m) but mtp_num_layers "
            f"is {mtp_num_layers}"
        )
    if mtp_num_layers and DECODER in joined[joined.index(MTP) :]:
        raise ScheduleError("the pipeline layout must place every MTP layer (m) after the decoder")
    if sum(MTP in stage for stage in stages) > 1:
        raise ScheduleError("the pipeline layout must place all MTP layers (m) in one stage")
    return [stage.count(DECODER) for stage in stages]


def format_layout(stages: list[str]) -> str:
    """A short layout string for ``stages`` that :func:`parse_layout` (and Megatron-LM)
    reads back: ``x*N`` for three or more of a character, ``(...|)*N`` for three or more
    equal stages in a row."""
    parts = [_short_stage(stage) for stage in stages]
    pieces: list[str] = []
    i = 0
    while i < len(parts):
        run = 1
        while i + run < len(parts) and parts[i + run] == parts[i]:
            run += 1
        if run >= 3 and i + run < len(parts):
            pieces.append(f"({parts[i]}|)*{run},")
        else:
            pieces.extend(f"{part}|" for part in parts[i : i + run])
        i += run
    return "".join(pieces)[:-1]


def _short_stage(stage: str) -> str:
    runs = re.finditer(r"(.)\1*", stage)
    return "".join(
        f"{m.group(1)}*{len(m.group(0))}" if len(m.group(0)) >= 3 else m.group(0) for m in runs
    )
