"""``simulate --config``'s work, without its flags: a training config read into the model
and pipeline the cost model needs, the balance advisor run on it, its report and files.
Pure Python: a key the config leaves out takes Megatron-LM's default (the model's fields
say theirs; :data:`MEGATRON_LM_UNSET` the ones Megatron-LM leaves for later)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..schedules.config_values import override_origins, read_values
from .advisor import GIB, Advice, ParallelSetup, advise
from .memory import MemorySettings
from .model_cost import ModelShape
from .nccl_memory import NcclBuffers

__all__ = ["MEGATRON_LM_UNSET", "ConfigModel", "advice_text", "advise_config", "write_advice"]

#: Keys the model needs that Megatron-LM's arguments leave unset until the run: the
#: vocabulary (``--vocab-size`` defaults to the tokenizer's, known only once it is built).
MEGATRON_LM_UNSET: dict[str, Any] = {"vocab_size": None}


@dataclass(frozen=True)
class ConfigModel:
    """A config's model and pipeline, with where each value came from."""

    source: str
    values: dict[str, Any]
    origins: dict[str, str]
    shape: ModelShape
    setup: ParallelSetup

    @staticmethod
    def read(config: str | Path, overrides: Iterable[str]) -> ConfigModel:
        """``config`` with ``overrides`` (a key left out: Megatron-LM's default)."""
        overrides = list(overrides)
        source, origins = override_origins(config, overrides)
        values = {**MEGATRON_LM_UNSET, **read_values(config, overrides)}
        shape = ModelShape.from_values(values, source, origins)
        setup = ParallelSetup.from_values(values, source, origins)
        return ConfigModel(source, values, origins, shape, setup)

    def memory_settings(self) -> MemorySettings:
        return MemorySettings.from_values(self.values, self.source, self.origins)


def advise_config(
    model: ConfigModel,
    settings: MemorySettings,
    *,
    schedule: str | None,
    microbatches: int | None,
    memory_cap_gib: float | None,
    progress: Callable[[str], None] | None = None,
) -> Advice:
    """The balance advisor on ``model`` (``memory_cap_gib``: GiB per rank)."""
    return advise(
        model.shape,
        model.setup,
        schedule=schedule,
        microbatches=microbatches,
        memory_cap=None if memory_cap_gib is None else memory_cap_gib * GIB,
        settings=settings,
        progress=progress,
    )


def advice_text(
    advice: Advice, model: ConfigModel, settings: MemorySettings, env: Mapping[str, str]
) -> Iterator[str]:
    """The advice, the memory per rank and NCCL's buffers (read from ``env``), a block each
    as it is made."""
    from .report import advice_report, memory_report, nccl_memory_report

    yield advice_report(advice, model.shape.summary(), model.source)
    yield memory_report(advice, model.setup, settings)
    yield nccl_memory_report(advice.schedule, NcclBuffers.from_env(env))


def write_advice(
    advice: Advice, *, png: Path | None = None, json_path: Path | None = None
) -> Iterator[str]:
    """Write the before and after timelines (``png``, suffixed) and the advice as JSON,
    yielding ``wrote PATH`` for each."""
    from .export import to_png
    from .simulation import suffixed

    if png:
        for label, candidate in (("before", advice.before), ("after", advice.after)):
            path = suffixed(png, label, True)
            title = f"{advice.schedule.name}, {label}"
            to_png(advice.simulate(candidate), str(path), title=title, unit="FLOP")
            yield f"wrote {path}"
    if json_path:
        json_path.write_text(json.dumps(advice.to_json()), encoding="utf-8")
        yield f"wrote {json_path}"
