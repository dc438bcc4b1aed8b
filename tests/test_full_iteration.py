"""``cuda_graph_impl: full_iteration`` under zb1p and dualpipev: ``train``'s step function
wrapped as Megatron-LM wraps its own (:mod:`megatron_dualpipe.megatron.schedule.full_iteration`),
run on two forked CPU ranks with a stand-in of Megatron-Core's ``FullCudaGraphWrapper``
(``megatron/core/full_cuda_graph.py``, 0.16.1 to 0.19.2) in place of the real one, which
needs CUDA to capture.

The stand-in keeps the wrapper's contract as its source states it: keyword arguments
only (``model``, ``data_iterator``, ``num_microbatches``, ``seq_length``, ``forward_only``
required); ``data_read`` reads ``num_microbatches`` dictionaries from each chunk's
iterator into static buffers (cloned the first time, copied into in place after, as
``StaticBufferLoader`` does) and hands the function one iterator per chunk over them;
the first ``cuda_graph_warmup_steps`` calls of a stage (training, validation) run
eagerly; the next is the capture (here: run under the host-synchronisation detector of
``tests/test_graph_safe_step.py``, which a capture could not hold), and every later call
a replay: the captured result is returned again, its tensors rewritten in place (the
stand-in runs the step again on the same static buffers and copies its outputs in). So a
caller that read its losses inside the step, or kept the first result's values, would
see stale numbers; ``train`` reads them from the returned list after each call, and its
losses equal the eager run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_dualpipe.megatron.compat.version import installed_megatron_core
from megatron_dualpipe.megatron.training import ConfigError, load_config
from tests.multiproc import run_workers
from tests.test_graph_safe_step import host_sync_detector

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_gpt_cpu.yaml"
ITERATIONS = 4
WARMUP = 1  # step 1 eager, step 2 captured, steps 3 and 4 replayed


def _copy_into(target: Any, source: Any) -> None:
    """Rewrite ``target``'s tensors in place with ``source``'s (a replay's outputs)."""
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    elif isinstance(target, dict):
        for key in target:
            _copy_into(target[key], source[key])
    elif isinstance(target, list | tuple):
        for t, s in zip(target, source, strict=True):
            _copy_into(t, s)


def _static(item: Any, buffer: Any) -> Any:
    """StaticBufferLoader: a clone of ``item``'s tensors the first time, else ``item``
    copied into the buffer (non-tensors as given)."""
    if buffer is None:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in item.items()}
    for key, value in item.items():
        if isinstance(value, torch.Tensor):
            buffer[key].copy_(value)
        else:
            buffer[key] = value
    return buffer


class StandInFullGraph:
    """Megatron-Core's ``FullCudaGraphWrapper`` without CUDA (see the module docstring);
    records each stage's calls and the host synchronisations of its captures."""

    def __init__(self, forward_backward_func: Any, cuda_graph_warmup_steps: int) -> None:
        self.forward_backward_func = forward_backward_func
        self.cuda_graph_warmup_steps = cuda_graph_warmup_steps
        self.iteration = {"training": 0, "validation": 0}
        self.result: dict[str, Any] = {"training": None, "validation": None}
        self.buffers: dict[str, list[list[Any]]] = {"training": [], "validation": []}
        self.captured: dict[str, list[str] | None] = {"training": None, "validation": None}
        self.calls: list[tuple[str, str]] = []

    def _data_read(self, stage: str, kwargs: dict[str, Any]) -> list[Any]:
        model, iterators = kwargs["model"], kwargs["data_iterator"]
        chunks = len(model) if isinstance(model, list) else 1
        assert isinstance(iterators, list) and len(iterators) == chunks, iterators
        buffers = self.buffers[stage]
        while len(buffers) < chunks:
            buffers.append([])
        out = []
        for chunk, iterator in enumerate(iterators):
            if iterator is None:
                out.append(None)
                continue
            held = buffers[chunk]
            for b in range(kwargs["num_microbatches"]):
                item = next(iterator)
                assert isinstance(item, dict), type(item)
                if b == len(held):
                    held.append(_static(item, None))
                else:
                    _static(item, held[b])
            out.append(iter(held))
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        assert not args, "forward_backward_func does not accept positional args"
        for key in ("model", "data_iterator", "num_microbatches", "seq_length", "forward_only"):
            assert key in kwargs, key
        stage = "validation" if kwargs["forward_only"] else "training"
        kwargs["data_iterator"] = self._data_read(stage, kwargs)
        count = self.iteration[stage]
        if count < self.cuda_graph_warmup_steps:
            self.calls.append((stage, "eager"))
            self.result[stage] = self.forward_backward_func(**kwargs)
        elif count == self.cuda_graph_warmup_steps:
            self.calls.append((stage, "capture"))
            with host_sync_detector() as calls:
                self.result[stage] = self.forward_backward_func(**kwargs)
            self.captured[stage] = sorted(set(calls))
        else:
            self.calls.append((stage, "replay"))
            _copy_into(self.result[stage], self.forward_backward_func(**kwargs))
        self.iteration[stage] += 1
        return self.result[stage]


def _train(rank: int, world: int, settings: list[str], graphed: bool) -> dict[str, Any]:
    from megatron_dualpipe.megatron.training.loop import run_rank

    cfg = load_config(TINY, settings)
    made: list[StandInFullGraph] = []

    def wrapper(func: Any, warmup: int) -> StandInFullGraph:
        made.append(StandInFullGraph(func, warmup))
        return made[0]

    result = run_rank(cfg, graph_wrapper=wrapper if graphed else None)
    graph = made[0] if made else None
    return {
        "losses": dict(result.losses),
        "validation": dict(result.validation),
        "calls": graph.calls if graph else None,
        "captured": graph.captured if graph else None,
    }


def _settings(schedule: str, impl: str) -> list[str]:
    return [
        f"pipeline_schedule={schedule}",
        f"train_iters={ITERATIONS}",
        "output_dir=null",
        "eval_interval=2",
        "eval_iters=1",
        f"cuda_graph_impl={impl}",
        f"cuda_graph_warmup_steps={WARMUP}",
    ]


#: 0.16/0.17 spell full_iteration as ``local`` with that scope, and then every module
#: builds a ``CudaGraphManager``, which asks the CUDA device its capability even unused.
BUILDS_ON_CPU = tuple(int(x) for x in installed_megatron_core().split(".")[:2]) >= (0, 18)


@pytest.mark.slow
@pytest.mark.skipif(not BUILDS_ON_CPU, reason="megatron-core < 0.18 builds no model on CPU here")
@pytest.mark.parametrize("schedule", ["dualpipev", "zb1p"])
def test_train_under_a_whole_step_graph_gives_the_eager_losses(schedule: str) -> None:
    eager = run_workers(_train, 2, args=(_settings(schedule, "none"), False), timeout_s=240)
    graphed = run_workers(
        _train, 2, args=(_settings(schedule, "full_iteration"), True), timeout_s=240
    )
    for rank in range(2):
        assert graphed[rank]["losses"] == eager[rank]["losses"]
        assert graphed[rank]["validation"] == eager[rank]["validation"]
        assert len(graphed[rank]["losses"]) == ITERATIONS
        calls = graphed[rank]["calls"]
        training = [kind for stage, kind in calls if stage == "training"]
        assert training == ["eager", "capture", "replay", "replay"]
        assert [kind for stage, kind in calls if stage == "validation"] == ["eager", "capture"]
        # Nothing in the captured steps synchronises with the host.
        assert graphed[rank]["captured"] == {"training": [], "validation": []}
    losses = list(graphed[0]["losses"].values())
    assert len(set(losses)) == ITERATIONS  # each replay's own loss, not the capture's


def test_full_iteration_is_refused_under_dualpipe_in_one_sentence() -> None:
    with pytest.raises(ConfigError, match="FullCudaGraphWrapper reads every micro-batch") as err:
        load_config(TINY, ["pipeline_schedule=dualpipe", "cuda_graph_impl=full_iteration"])
    assert "use dualpipev or zb1p" in str(err.value)


def test_full_iteration_refuses_the_schedule_optimiser() -> None:
    with pytest.raises(ConfigError, match="records none: set one of them"):
        load_config(TINY, ["cuda_graph_impl=full_iteration", "optimize_schedule=true"])


def test_full_iteration_warms_up_at_least_one_step() -> None:
    with pytest.raises(ConfigError, match="would capture the first step, which builds"):
        load_config(TINY, ["cuda_graph_impl=full_iteration", "cuda_graph_warmup_steps=0"])
    cfg = load_config(TINY, ["cuda_graph_impl=full_iteration", "cuda_graph_warmup_steps=1"])
    assert cfg.cuda_graph_warmup_steps == 1


def test_the_wrapper_wants_a_graph_safe_function() -> None:
    from megatron_dualpipe.megatron.schedule.checks import DualPipeConfigError
    from megatron_dualpipe.megatron.schedule.forward_backward import DualPipeForwardBackward
    from megatron_dualpipe.megatron.schedule.full_iteration import full_iteration_step

    made: list[Any] = []
    with pytest.raises(ValueError, match="build it with graph_safe=True"):
        full_iteration_step(DualPipeForwardBackward("dualpipev"), 1, lambda f, w: made.append(f))
    assert made == []
    safe = DualPipeForwardBackward("dualpipev", graph_safe=True)
    full_iteration_step(safe, 2, lambda f, w: made.append((f, w)))
    assert made == [(safe, 2)]
    with (
        pytest.raises(DualPipeConfigError, match="records no timeline"),
        safe.recording(lambda timeline, schedule: None),
    ):
        pass
