"""The F&B overlap path enters the contexts Megatron's ``combined_forward_backward_step``
enters (megatron-core 0.16.1, ``pipeline_parallel/combined_1f1b.py``): ``torch.autocast``
while the plan is built and run when ``enable_autocast``, and one outer ``get_fp8_context``
around the run for FP8's delayed recipe only. Recorded here on stand-ins (no CUDA, no TE);
and a run whose chunks cannot use the plan while TE layers wait for it is refused before
its first step, naming the chunk's type.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from megatron.core.enums import Fp8Recipe

from megatron_dualpipe.megatron.grads import deferral
from megatron_dualpipe.megatron.grads.deferral import enable_weight_grad_deferral
from megatron_dualpipe.megatron.schedule import schedule_plan
from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
from megatron_dualpipe.megatron.schedule.forward_backward import DualPipeForwardBackward
from megatron_dualpipe.megatron.schedule.schedule_plan import PlanHandle, run_plans, start_forward

pytestmark = pytest.mark.megatron


class _Recorder:
    """Stand-ins for ``torch.autocast`` and ``get_fp8_context``: each entered context is
    pushed on ``active`` while open; ``seen`` keeps what was open at each recorded event."""

    def __init__(self) -> None:
        self.active: list[str] = []
        self.seen: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def _entered(self, name: str):
        self.active.append(name)
        try:
            yield
        finally:
            self.active.remove(name)

    def autocast(self, device: str, dtype: torch.dtype) -> Any:
        return self._entered(f"autocast({device}, {dtype})")

    def fp8(self, config: Any, layer_no: int = -1, is_init: bool = False) -> Any:
        assert layer_no == -1 and not is_init  # the whole pass, not one layer
        return self._entered("fp8")

    def note(self, event: str) -> None:
        self.seen[event] = list(self.active)


class _Plan:
    """A schedule plan with no layers whose ``run`` records the contexts open around it."""

    recorder: _Recorder

    def num_layers(self) -> int:
        return 0

    @staticmethod
    def run(f_plan: Any, b_plan: Any, b_grad: Any = None) -> torch.Tensor:
        _Plan.recorder.note("run")
        return torch.zeros(1)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    found = _Recorder()
    monkeypatch.setattr(schedule_plan.torch, "autocast", found.autocast)
    monkeypatch.setattr(schedule_plan, "get_fp8_context", found.fp8)
    monkeypatch.setattr(schedule_plan, "set_streams", lambda: None)
    _Plan.recorder = found
    return found


def _config(autocast: bool, fp8: str | None, recipe: Fp8Recipe = Fp8Recipe.delayed) -> Any:
    return SimpleNamespace(
        enable_autocast=autocast,
        autocast_dtype=torch.bfloat16,
        fp8=fp8,
        fp8_recipe=recipe,
        timers=None,
    )


class _Model(torch.nn.Module):
    """What ``start_forward`` needs of a chunk: ``set_input_tensor`` and
    ``build_schedule_plan`` (found through Megatron's ``get_attr_wrapped_model``)."""

    def set_input_tensor(self, tensors: Any) -> None:
        self.inputs = tensors

    def build_schedule_plan(self) -> None:
        raise AssertionError("the forward_step_func builds the plan")


def _forward_step(recorder: _Recorder):
    def forward_step_func(data: Any, model: Any, return_schedule_plan: bool = False):
        assert return_schedule_plan
        recorder.note("build")
        return _Plan(), None

    return forward_step_func


@pytest.mark.parametrize(
    ("autocast", "fp8", "recipe", "at_build", "at_run"),
    [
        (True, "e4m3", Fp8Recipe.delayed, ["autocast"], ["autocast", "fp8"]),
        (False, "hybrid", Fp8Recipe.delayed, [], ["fp8"]),
        (True, None, Fp8Recipe.delayed, ["autocast"], ["autocast"]),
        (False, "e4m3", Fp8Recipe.tensorwise, [], []),
        (False, None, Fp8Recipe.delayed, [], []),
    ],
    ids=["autocast+delayed", "delayed", "autocast", "tensorwise-per-layer", "bf16"],
)
def test_overlap_path_enters_megatrons_contexts(
    recorder: _Recorder,
    autocast: bool,
    fp8: str | None,
    recipe: Fp8Recipe,
    at_build: list[str],
    at_run: list[str],
) -> None:
    config = _config(autocast, fp8, recipe)
    started = start_forward(
        _Model(),
        torch.zeros(1),
        None,
        forward_step_func=_forward_step(recorder),
        config=config,
        is_first_microbatch=True,
        loss_stage=False,
        num_microbatches=2,
        forward_data_store=[],
        collect_non_loss_data=False,
        cp_group_size=1,
    )
    started.finish = lambda output: (output, torch.zeros(()), None)
    run_plans(started, None)
    short = {"build": recorder.seen["build"], "run": recorder.seen["run"]}
    short = {k: [c.split("(")[0] for c in v] for k, v in short.items()}
    assert short == {"build": at_build, "run": at_run}
    if autocast:
        assert recorder.seen["run"][0] == "autocast(cuda, torch.bfloat16)"
    # A backward alone (a B outside a pair) runs under the same contexts.
    recorder.seen.clear()
    handle = PlanHandle(_Plan(), None, None, config)
    run_plans(None, (handle, torch.zeros(1), torch.ones(1)))
    assert [c.split("(")[0] for c in recorder.seen["run"]] == at_run


class _StandInTE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 2))
        self.config = SimpleNamespace(
            delay_wgrad_compute=True, overlap_moe_expert_parallel_comm=True
        )


class CustomChunk(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _StandInTE()


def test_te_layers_waiting_for_a_plan_that_cannot_run_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overlap configured, chunks that are not GPTModels: Megatron's plan is not used, so
    the TE layers deferral left to it would never run their dW (silently zero)."""
    monkeypatch.setattr(deferral, "_te_layer_classes", lambda: (_StandInTE,))
    monkeypatch.setattr(deferral, "_check_te_version", lambda: None)
    chunk = CustomChunk()
    assert enable_weight_grad_deferral(chunk) == 1
    forward_backward = DualPipeForwardBackward("dualpipev")
    config = SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    with pytest.raises(DualPipeConfigError, match="chunk 0 is a CustomChunk") as err:
        forward_backward._overlap(config, [chunk])
    assert "proj" in str(err.value) and "\n" not in str(err.value)
    # Without TE layers waiting for the plan, such chunks fall back to sequential FB pairs.
    assert forward_backward._overlap(config, [torch.nn.Linear(2, 2)]) is False
