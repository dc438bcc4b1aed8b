"""One rank's pretraining run: the loop Megatron-LM's ``pretrain`` runs, on megatron-core.

Per iteration: zero DDP's gradient buffers, run the schedule's forward-backward function
over ``global_batch_size / (micro_batch_size x DP)`` micro-batches of this data-parallel
rank, step Megatron's optimizer (gradient clipping inside) and, when the step succeeded,
the learning-rate scheduler. The loss of an iteration is the mean over every micro-batch
of the global batch, reduced over all ranks in float64. Global rank 0 prints every line
(Megatron-LM's log lines, checkpoint messages, the summary), each batch of lines in one
write, so the log has one order however the ranks are scheduled. Evaluation runs the same
forward-backward function with ``forward_only=True`` on ``eval_iters`` fixed batches of the
validation split. The last iteration is measured (:mod:`..schedule.step_recorder`) and
summarised; with ``optimize_schedule`` iteration OPTIMIZE_AFTER (counted from the start or
the resumed iteration) is measured too, and the schedule switches to the optimised order
after it (:mod:`.schedule_order`).

The process group must be initialised; this module initialises and destroys Megatron's
``parallel_state``.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from ...planner.measured_step import (
    StepSummary,
    predict,
    summary_lines,
    write_side_by_side_png,
)
from ...planner.megatron_flops import megatron_lm_flops
from ...planner.model_cost import ModelShape
from ...schedules.limits import TRAIN_BUILD_NOTICE_S, train_build_estimate
from ...schedules.registry import SCHEDULES
from ...writable import unwritable
from ..grads.loss_reports import mtp_losses
from ..model.placement import embedding_ranks
from ..schedule.full_iteration import GraphWrapper, chunk_iterators, full_iteration_step
from ..schedule.registry import get_forward_backward_func
from ..schedule.step_recorder import StepRecorder
from . import finite
from .checkpoint.save_load import TrainState, load_checkpoint, save_checkpoint
from .config import OPTIMIZE_AFTER, TrainConfig
from .data.samples import MicroBatchReader, PendingMicroBatch, SyntheticSamples
from .data.tokenizer import build_tokenizer, model_vocab_size
from .errors import TrainError
from .layer_graphs import LayerGraphs
from .model import build_model, transformer_config
from .optim import build_optimizer
from .profiling import StepProfiler
from .report import (
    LogWindow,
    ProgressBar,
    iteration_line,
    timestamp,
    validation_lines,
)
from .schedule_order import optimise_from_measured, saved_schedule
from .tensorboard import StepScalars, open_log

__all__ = [
    "TrainResult",
    "eager_on_cpu",
    "forward_step",
    "initialize_parallel_state",
    "run_rank",
]

LOSS_KEY = "lm loss"


@dataclass
class TrainResult:
    """What one rank reports: per iteration the global-batch loss (identical on all
    ranks) and the MTP losses, validation losses by iteration, the lines this rank printed,
    the iteration it resumed from, the iterations it saved and (rank 0) the measured
    step."""

    losses: dict[int, float] = field(default_factory=dict)
    mtp_losses: dict[int, tuple[float, ...]] = field(default_factory=dict)
    validation: dict[int, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    resumed_from: int | None = None
    saved: list[int] = field(default_factory=list)
    summary: StepSummary | None = None


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = loss_mask.float()
    loss = (output_tensor.float() * mask).sum() / mask.sum()
    # Megatron's schedules divide the returned loss in place: report a copy.
    return loss, {LOSS_KEY: loss.detach().clone()}


def forward_step(
    data_iterator: Iterator[PendingMicroBatch],
    model: torch.nn.Module,
    return_schedule_plan: bool = False,
) -> tuple[Any, Callable[..., Any]]:
    """Megatron's ``forward_step_func``: the next micro-batch through ``model`` (causal
    attention, or the dataset's per-document mask), with the masked mean token loss as loss
    function; with ``return_schedule_plan`` (MoE all-to-all overlap) the GPTModel's schedule
    plan of that forward instead of its output, as Megatron-LM's pretrain_gpt.py does. The
    micro-batch is read only where ``model`` holds the embedding or the loss
    (:meth:`~.data.PendingMicroBatch.for_chunk`)."""
    item = next(data_iterator)  # a dictionary already where the step was read up front
    batch = item if isinstance(item, dict) else item.for_chunk(model)
    loss_func = partial(_loss_func, batch["loss_mask"])
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if return_schedule_plan:
        return model.build_schedule_plan(*inputs, labels=batch["labels"]), loss_func
    return model(*inputs, labels=batch["labels"]), loss_func


class _Run:
    """The state of one rank's run; see the module docstring. ``graph_wrapper`` makes the
    whole-step graph wrapper under ``cuda_graph_impl: full_iteration`` (default:
    Megatron's ``FullCudaGraphWrapper``, :mod:`..full_iteration`)."""

    def __init__(self, cfg: TrainConfig, graph_wrapper: GraphWrapper | None = None):
        self.cfg = cfg
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.rank = dist.get_rank()
        self.result = TrainResult()
        self.forward_backward = get_forward_backward_func(
            pipeline_schedule=cfg.pipeline_schedule,
            timeout_s=60.0 * cfg.distributed_timeout_minutes,
            graph_safe=self.whole_step_graphs,
        )
        if cfg.schedule_file is not None:
            self.forward_backward.use_schedule(saved_schedule(cfg.schedule_file))
        #: What each step calls: the forward-backward function, or its whole-step graph.
        self.step_function = (
            full_iteration_step(self.forward_backward, cfg.cuda_graph_warmup_steps, graph_wrapper)
            if self.whole_step_graphs
            else self.forward_backward
        )
        self.config = transformer_config(cfg, on_gpu=self.device.type == "cuda")
        self.tokenizer = build_tokenizer(cfg)
        self.vocab_size = model_vocab_size(cfg, self.tokenizer)
        self.model = build_model(cfg, self.config, self.vocab_size)
        self.optimizer, self.scheduler = build_optimizer(cfg, self.model)
        self.config.grad_scale_func = self.optimizer.scale_loss
        #: TE's per-layer graphs under ``cuda_graph_impl: transformer_engine``.
        self.layer_graphs = (
            LayerGraphs(cfg, self.forward_backward, self.model, self.config, self.optimizer)
            if cfg.cuda_graph_impl == "transformer_engine"
            else None
        )
        self.loss_scaling = finite.uses_loss_scaling(self.optimizer)
        self.bar: ProgressBar | None = None
        self.mtp: tuple[float, ...] = ()  # the last step's MTP losses
        self.train_data, self.valid_data = self._readers()
        self.state = TrainState()
        self.board = open_log(cfg, self.rank)
        self.flops = _iteration_flops(cfg, self.vocab_size) if cfg.log_throughput else None

    @property
    def whole_step_graphs(self) -> bool:
        """``cuda_graph_impl: full_iteration``: each step is captured once and replayed."""
        return self.cfg.cuda_graph_impl == "full_iteration"

    def _reads_data(self) -> bool:
        """Whether a local chunk reads samples: it holds the embedding or the loss, or every
        chunk needs the per-document attention mask (see :mod:`.data`)."""
        from megatron.core.utils import get_attr_wrapped_model

        ends = [get_attr_wrapped_model(m, "pre_process", return_model_obj=True) for m in self.model]
        return self.cfg.reset_attention_mask or any(e.pre_process or e.post_process for e in ends)

    def _readers(self) -> tuple[MicroBatchReader, MicroBatchReader]:
        """The training and validation readers: Megatron-Core's datasets (built collectively,
        held where a chunk reads), or the synthetic samples."""
        cfg = self.cfg
        if self.tokenizer is None:
            train: Any = SyntheticSamples(cfg.seed, "train", cfg.seq_length, self.vocab_size)
            valid: Any = SyntheticSamples(cfg.seed, "valid", cfg.seq_length, self.vocab_size)
        else:
            from .data.datasets import build_datasets

            train, valid = build_datasets(cfg, self.tokenizer, self._reads_data())
        layout = dict(
            micro_batch_size=cfg.micro_batch_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=cfg.data_parallel_size,
            device=self.device,
            every_chunk_reads=cfg.reset_attention_mask,
        )
        return MicroBatchReader(train, **layout), MicroBatchReader(valid, **layout)

    # -- output ------------------------------------------------------------------------
    def say(self, lines: list[str]) -> None:
        """On global rank 0 (which also draws the progress bar): print ``lines`` whole, in
        one write, and keep them in the result; other ranks print nothing."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.clear()
        sys.stdout.write("".join(f"{line}\n" for line in lines))
        sys.stdout.flush()
        self.result.lines.extend(lines)

    def parameter_lines(self) -> list[str]:
        """Megatron-LM's parameter count of each (tensor, pipeline) model-parallel rank of
        the first data-parallel replica, in rank order; collective."""
        count = sum(p.nelement() for chunk in self.model for p in chunk.parameters())
        mine = None
        if parallel_state.get_data_parallel_rank() == 0:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            mine = (tp_rank, parallel_state.get_pipeline_model_parallel_rank(), count)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return [
            f" > number of parameters on (tensor, pipeline) model parallel rank ({t}, {p}): {n}"
            for t, p, n in sorted(item for item in every if item is not None)
        ]

    def _ranks_tag(self) -> str:
        """Megatron-LM's ``[ t 1/TP, p 1/PP ]`` of rank 0 in checkpoint messages."""
        return (
            f"[ t 1/{self.cfg.tensor_model_parallel_size}, "
            f"p 1/{self.cfg.pipeline_model_parallel_size} ]"
        )

    # -- one step ----------------------------------------------------------------------
    def _data_iterator(self, data: MicroBatchReader, first_sample: int) -> Any:
        batches = data.step(first_sample, self.cfg.num_microbatches)
        if self.whole_step_graphs:  # FullCudaGraphWrapper.data_read: dictionaries, per chunk
            return chunk_iterators(batches, self.model, PendingMicroBatch.for_chunk)
        if self.cfg.pipeline_schedule == "interleaved-1f1b":
            return [iter(batches) for _ in self.model]
        return iter(batches)

    def _run_schedule(
        self,
        data_iterator: Any,
        forward_only: bool,
        step_func: Callable[..., Any] | None = None,
    ) -> tuple[float, str | None]:
        """One forward-backward call (``step_func``, default :func:`forward_step`); returns
        the global mean loss and, with ``check_for_nan_in_loss_and_grad``, what was not
        finite where (:mod:`.finite`); the same on all ranks."""
        loss_dicts = self.step_function(
            forward_step_func=step_func or forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=self.cfg.num_microbatches,
            seq_length=self.cfg.seq_length,
            micro_batch_size=self.cfg.micro_batch_size,
            forward_only=forward_only,
        )
        # One read of this rank's losses per step (each float() of a GPU tensor would wait).
        losses = [d[LOSS_KEY].detach().double() for d in loss_dicts]
        local = torch.stack(losses).tolist() if losses else []
        world = dist.get_world_size()
        flags = torch.zeros(world, len(finite.FINDINGS), dtype=torch.float64)
        if self.cfg.check_for_nan_in_loss_and_grad:
            grads = [] if forward_only or self.loss_scaling else finite.grad_buffers(self.model)
            flags[self.rank] = torch.tensor(finite.local_flags(local, grads), dtype=torch.float64)
        total = torch.cat([torch.tensor([math.fsum(local), len(local)]), flags.flatten()])
        total = total.to(dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        found = finite.describe(total[2:].view(world, -1).tolist())
        return float(total[0] / total[1]), found

    def _stop(self, when: str, found: str) -> None:
        """Raise the one-sentence error for a non-finite loss or gradient (every rank);
        ``when`` names the iteration and whether it was a training step."""
        if self.result.saved:
            last = f"the last checkpoint is iteration {self.result.saved[-1]} in {self.cfg.save}"
        elif self.result.resumed_from is not None:
            last = f"the last checkpoint is iteration {self.result.resumed_from} in {self.cfg.load}"
        else:
            last = "no checkpoint was saved"
        raise TrainError(
            f"{when}: found {found} (check_for_nan_in_loss_and_grad): stopped "
            f"{'before the optimizer step ' if when.startswith('iteration') else ''}"
            f"and saved nothing ({last}); lower lr ({self.cfg.lr:g}) or "
            "clip_grad, or set check_for_nan_in_loss_and_grad: false to carry on regardless",
            every_rank=True,
        )

    def train_step(self, measure: bool) -> tuple[float, bool, float | None, StepRecorder | None]:
        """One iteration; with ``measure``, its forward-backward call is recorded."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        data = self._data_iterator(self.train_data, self.state.consumed_train_samples)
        recorder = None
        if measure:
            recorder = StepRecorder(
                self.cfg.pipeline_schedule,
                self.forward_backward,
                self.model,
                self.config,
                self.cfg.num_microbatches,
            )
            with recorder:
                loss, found = self._run_schedule(data, False, recorder.forward_step(forward_step))
        else:
            loss, found = self._run_schedule(data, forward_only=False)
        if self.cfg.mtp_num_layers:
            self.mtp = tuple(mtp_losses(self.cfg.mtp_num_layers, self.cfg.num_microbatches))
        if found is not None:
            self._stop(f"iteration {self.state.iteration + 1}", found)
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=1)
        self.state.iteration += 1
        self.state.consumed_train_samples += self.cfg.global_batch_size
        norm = None if grad_norm is None else float(grad_norm)
        return loss, success, norm, recorder

    def evaluate(self) -> float:
        """The mean loss over ``eval_iters`` validation batches (forward only)."""
        for chunk in self.model:
            chunk.eval()
        losses = []
        with torch.no_grad():
            for k in range(self.cfg.eval_iters):
                data = self._data_iterator(self.valid_data, k * self.cfg.global_batch_size)
                loss, found = self._run_schedule(data, forward_only=True)
                if found is not None:
                    self._stop(f"validation at iteration {self.state.iteration}", found)
                losses.append(loss)
        for chunk in self.model:
            chunk.train()
        return math.fsum(losses) / len(losses)

    # -- the run -----------------------------------------------------------------------
    def resume(self) -> None:
        """Load the latest checkpoint under ``load``, if there is one."""
        if self.cfg.load is None:
            return
        loaded = load_checkpoint(
            self.cfg, self.model, self.optimizer, self.scheduler, self.vocab_size
        )
        if loaded is None:
            self.say([f" no checkpoint under {self.cfg.load}: training from scratch"])
            return
        self.state, _, note = loaded
        self.result.resumed_from = self.state.iteration
        self.say(
            [
                f"  successfully loaded checkpoint from {self.cfg.load} {self._ranks_tag()} "
                f"at iteration {self.state.iteration}",
                *([note] if note else []),
            ]
        )

    def save(self) -> None:
        """Save a checkpoint of the current iteration under ``save``."""
        save_checkpoint(
            self.cfg, self.model, self.optimizer, self.scheduler, self.state, self.vocab_size
        )
        self.result.saved.append(self.state.iteration)
        self.say(
            [
                f"  {timestamp()} successfully saved checkpoint from iteration "
                f"{self.state.iteration:7d} to {self.cfg.save} {self._ranks_tag()}"
            ]
        )

    def train(self) -> None:
        """Iterate up to ``train_iters`` (or the next ``exit_interval``), logging,
        evaluating and saving on their intervals; measure and summarise the last step."""
        last = self._last_iteration()
        if self.state.iteration >= self.cfg.train_iters:
            self.say([self._nothing_to_train()])
            return
        if self.rank == 0:
            self.bar = ProgressBar(self.cfg.train_iters)
        if self.cfg.log_memory_to_tensorboard and self.device.type != "cuda":
            self.say([" log_memory_to_tensorboard: CPU ranks have no CUDA memory to write"])
        window = LogWindow()
        building = _build_notice(self.cfg)
        if building is not None:
            self.say([building])
        saved_at = self.state.iteration if self.result.resumed_from is not None else None
        # optimize_schedule: measure this iteration, then switch (when iterations follow).
        switch_at = self.state.iteration + OPTIMIZE_AFTER if self.cfg.optimize_schedule else None
        profiler = StepProfiler(self.cfg, self.rank, self.forward_backward)
        try:
            recorder = self._iterate(
                last, window, saved_at, switch_at, profiler, announced=building is not None
            )
        finally:
            profiler.close()
        if profiler.path is not None:
            print(f" wrote the profile of rank {self.rank}: {profiler.path}", flush=True)
        if recorder is not None:
            self.summarise(recorder)
        self.report_overlap()

    def _iterate(
        self,
        last: int,
        window: LogWindow,
        saved_at: int | None,
        switch_at: int | None,
        profiler: StepProfiler,
        *,
        announced: bool,
    ) -> StepRecorder | None:
        """The iterations of :meth:`train`; the last measured step's recorder. ``announced``:
        a slow step build was announced, so the first step's time is said."""
        recorder = None
        while self.state.iteration < last:
            start = time.perf_counter()
            upcoming = self.state.iteration + 1
            switching = upcoming == switch_at and upcoming < last
            boarded = self.board is not None and self._logs(upcoming, last)
            measure = upcoming == last or switching or self._board_measures(upcoming, last)
            measure = measure and not self.whole_step_graphs  # a graph records no timeline
            profiler.before_step(self.state.iteration)
            if self.layer_graphs is not None:
                self.layer_graphs.before_step(self.state.iteration)
            loss, success, grad_norm, recorder = self.train_step(measure)
            if self.layer_graphs is not None:
                self.layer_graphs.after_step(self.state.iteration, success)
            profiler.after_step(self.state.iteration)
            if announced:
                took = time.perf_counter() - start
                self.say([f" the step was built, and run once, in {took:.1f} s"])
                announced = False
            window.add(loss, time.perf_counter() - start, success, self.mtp)
            self.result.losses[self.state.iteration] = loss
            if self.mtp:
                self.result.mtp_losses[self.state.iteration] = self.mtp
            if self._after_step(window, loss, grad_norm, last):
                saved_at = self.state.iteration
            if self._board_measures(upcoming, last):
                self._board_step(recorder, boarded)
            if switching:
                self.say([optimise_from_measured(self.forward_backward, recorder, upcoming)])
            if self.bar is not None:
                self.bar.update(self.state.iteration)
        if self.bar is not None:
            self.bar.clear()
            self.bar = None
        if self.cfg.save and saved_at != self.state.iteration:
            self.save()
        if self.state.iteration < self.cfg.train_iters:
            self.say([f" exiting program at iteration {self.state.iteration:8d}"])
        return recorder

    def _logs(self, iteration: int, last: int) -> bool:
        """Whether ``iteration`` prints a log line (every ``log_interval``, and the last)."""
        return iteration % self.cfg.log_interval == 0 or iteration == last

    def _board_measures(self, iteration: int, last: int) -> bool:
        """Whether ``iteration`` is measured for TensorBoard (the same on every rank)."""
        return self.cfg.tensorboard_dir is not None and self._logs(iteration, last)

    def _board_step(self, recorder: StepRecorder, write: bool) -> None:
        """The measured step's bubbles and overlapped FB pairs into TensorBoard (rank 0
        writes); collective."""
        measured = recorder.gather()
        pairs = self._overlapped_pairs()
        if write and measured is not None:
            bubbles = [r.bubble_ratio for r in measured.ranks]
            self.board.measured(self.state.iteration, bubbles, None if pairs is None else pairs[0])

    def _after_step(
        self, window: LogWindow, loss: float, grad_norm: float | None, last: int
    ) -> bool:
        """Log (the line every ``log_interval``, TensorBoard's step scalars every
        ``tensorboard_log_interval``), evaluate and save as their intervals say; True when a
        checkpoint was saved."""
        cfg, iteration = self.cfg, self.state.iteration
        learning_rate = self.optimizer.param_groups[0]["lr"]
        loss_scale = float(self.optimizer.get_loss_scale())
        if self.board is not None and iteration % cfg.tensorboard_log_interval == 0:
            step = StepScalars(
                iteration=iteration,
                consumed_samples=self.state.consumed_train_samples,
                lm_loss=loss,
                learning_rate=learning_rate,
                global_batch_size=cfg.global_batch_size,
                loss_scale=loss_scale,
                grad_norm=grad_norm,
                mtp_losses=self.mtp,
            )
            self.board.step(step)
            if cfg.log_memory_to_tensorboard and self.device.type == "cuda":
                self.board.memory(iteration, torch.cuda.memory_stats())
        if self._logs(iteration, last):
            log = window.flush(
                iteration=iteration,
                train_iters=cfg.train_iters,
                consumed_samples=self.state.consumed_train_samples,
                learning_rate=learning_rate,
                global_batch_size=cfg.global_batch_size,
                loss_scale=loss_scale,
                grad_norm=grad_norm,
            )
            if self.flops is not None:
                seconds = log.elapsed_ms / 1e3
                log = replace(log, throughput=self.flops / (seconds * 1e12 * dist.get_world_size()))
            self.say([iteration_line(log)])
            if self.board is not None:
                self.board.iteration_time(iteration, log.elapsed_ms / 1e3)
                if log.throughput is not None:
                    self.board.throughput(iteration, log.throughput)
        if cfg.eval_interval and iteration % cfg.eval_interval == 0:
            value = self.evaluate()
            self.result.validation[iteration] = value
            self.say(validation_lines(iteration, value))
            if self.board is not None:
                self.board.validation(iteration, self.state.consumed_train_samples, value)
        if cfg.save and cfg.save_interval and iteration % cfg.save_interval == 0:
            self.save()
            return True
        return False

    def _nothing_to_train(self) -> str:
        """The line for a resumed checkpoint that already reached ``train_iters``."""
        iteration = self.state.iteration
        return (
            f" the checkpoint's iteration {iteration} already reached train_iters "
            f"({self.cfg.train_iters}): nothing to train; to train further raise train_iters "
            "and choose the learning-rate schedule (e.g. --set "
            f"train_iters={iteration + self.cfg.train_iters} --set "
            "override_opt_param_scheduler=true)"
        )

    def _last_iteration(self) -> int:
        """``train_iters``, or the first multiple of ``exit_interval`` after the start."""
        exit_interval = self.cfg.exit_interval
        if exit_interval is None:
            return self.cfg.train_iters
        following = (self.state.iteration // exit_interval + 1) * exit_interval
        return min(self.cfg.train_iters, following)

    def _overlapped_pairs(self) -> tuple[int, int] | None:
        """Under a schedule with FB pairs: how many of the last step's FB actions (over this
        replica's pipeline) ran overlapped, and how many there were; None under the others.
        Collective, so every rank joins it even where its own part of the schedule has no
        FB pair (an optimised order may pair on one rank only)."""
        report = getattr(self.forward_backward, "last_overlap", None)
        if report is None:
            return None
        counts = torch.tensor([report.overlapped, report.fb_actions], device=self.device)
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        pairs, actions = (int(c) for c in counts)
        return (pairs, actions) if actions else None

    def report_overlap(self) -> None:
        """The line of :meth:`_overlapped_pairs` (data-parallel replica 0's); collective."""
        found = self._overlapped_pairs()
        if found is not None:
            pairs, actions = found
            lines = [f" overlapped FB pairs per step: {pairs} (of {actions} FB actions)"]
            if not pairs:
                needs = "" if self.cfg.is_moe else " a MoE model with"
                lines.append(
                    f"   F&B overlap needs{needs} overlap_moe_expert_parallel_comm: each FB "
                    "pair ran as its forward, then its backward"
                )
            self.say(lines)

    def summarise(self, recorder: StepRecorder) -> None:
        """Gather the measured step; rank 0 prints the summary and writes the PNG."""
        measured = recorder.gather()
        if measured is None or self.rank != 0:
            return
        predicted = predict(measured)
        png = None
        if self.cfg.run_dir is not None:
            out = Path(self.cfg.run_dir)
            out.mkdir(parents=True, exist_ok=True)
            png = out / "timeline.png"
            write_side_by_side_png(measured, predicted, png)
        summary = StepSummary.of(self.state.iteration, measured, predicted, png and str(png))
        self.result.summary = summary
        self.say(summary_lines(summary))


def _iteration_flops(cfg: TrainConfig, padded_vocab_size: int) -> float:
    """FLOPs of one iteration of ``cfg``'s model, as Megatron-LM counts them for
    ``--log-throughput``."""
    values = {f.name: getattr(cfg, f.name) for f in fields(ModelShape) if hasattr(cfg, f.name)}
    shape = ModelShape.from_values(values, "config")
    return megatron_lm_flops(shape, cfg.global_batch_size, padded_vocab_size)


def _seed(cfg: TrainConfig) -> None:
    """Megatron-LM's seeding: offset by pipeline rank; the tracker adds TP/EP offsets, and
    is graph-safe under any CUDA-graph implementation (as Megatron-LM's ``initialize``
    seeds it: ``use_cudagraphable_rng`` unless ``cuda_graph_impl`` is none)."""
    seed = cfg.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cfg.cuda_graph_impl != "none")


def _header_line(cfg: TrainConfig, backend: str) -> str:
    """The run's one-line description."""
    device = "GPU" if backend == "nccl" else "CPU"
    return (
        f" megatron-dualpipe train: {cfg.launch_world_size} {device} ranks ({backend}), "
        f"{cfg.pipeline_schedule}, PP={cfg.pipeline_model_parallel_size} "
        f"TP={cfg.tensor_model_parallel_size} EP={cfg.expert_model_parallel_size} "
        f"DP={cfg.data_parallel_size}, {cfg.num_layers} layers"
        f"{f', {cfg.num_experts} experts' if cfg.is_moe else ''}, "
        f"{cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} per step, "
        f"{cfg.train_iters} iterations"
    )


def _check_writable(cfg: TrainConfig) -> None:
    """Refuse, before any work, a ``save`` some rank cannot write its shards to, or an
    ``output_dir`` rank 0 cannot write the timeline to; collective."""
    mine = []
    if cfg.save is not None:
        mine.append(("save", cfg.save, unwritable(cfg.save)))
    if cfg.output_dir is not None and dist.get_rank() == 0:
        mine.append(("output_dir", cfg.output_dir, unwritable(cfg.output_dir)))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for key, path, why in [item for items in every for item in items]:
        if why is None:
            continue
        ranks = [r for r, items in enumerate(every) if (key, path, why) in items]
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        raise TrainError(
            f"{key}: cannot write to {path} on {where} ({why}): set {key} to a directory "
            f"{'every rank' if key == 'save' else 'rank 0'} can write to",
            every_rank=True,
        )


def _done_line(run: _Run, seconds: float) -> str:
    """The last line: the iteration reached, the time taken and where the outputs are."""
    outputs = []
    if run.result.summary is not None and run.result.summary.png is not None:
        outputs.append(f"timeline {run.result.summary.png}")
    if run.result.saved:
        outputs.append(f"checkpoints in {run.cfg.save}")
    if run.cfg.tensorboard_run_dir is not None:
        outputs.append(f"TensorBoard events in {run.cfg.tensorboard_run_dir}")
    where = f"; outputs: {', '.join(outputs)}" if outputs else ""
    return f" training done: iteration {run.state.iteration} after {seconds:.1f} s{where}"


def eager_on_cpu() -> contextlib.AbstractContextManager[None]:
    """Without a GPU, a context in which ``torch.compile`` compiles nothing, so that
    Megatron-Core's fused functions (``megatron.core.jit.jit_fuser`` is ``torch.compile``;
    e.g. the MoE router's ``_apply_expert_bias`` under ``moe_router_enable_expert_bias``)
    run eagerly. Compiling one on a CPU builds C++ kernels with inductor in its first call,
    on every rank at once, to fuse a few element-wise operations (docs/training.md has the
    measured cost). With a GPU a null context: they compile, as under Megatron-LM."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def _build_notice(cfg: TrainConfig) -> str | None:
    """The line said before the first step where building it (our schedules only: the
    schedule, its checks, its communication plan on every rank) takes more than a few
    seconds, or None."""
    spec = SCHEDULES[cfg.pipeline_schedule]
    if not spec.runs_ours:
        return None
    pp, m = cfg.pipeline_model_parallel_size, cfg.num_microbatches
    seconds, need = train_build_estimate(pp, m, cfg.virtual_pipeline_model_parallel_size)
    if seconds <= TRAIN_BUILD_NOTICE_S:
        return None
    return (
        f" building the {cfg.pipeline_schedule} step for PP={pp} x {m:,} micro-batches on every "
        f"rank before the first iteration: about {seconds:.0f} s and {need / 2**20:,.0f} MB each"
    )


def run_rank(cfg: TrainConfig, *, graph_wrapper: GraphWrapper | None = None) -> TrainResult:
    """Train on this rank (the default process group must exist), with
    :func:`eager_on_cpu`; collective. ``graph_wrapper``: see :class:`_Run`."""
    with eager_on_cpu():
        return _train_here(cfg, graph_wrapper)


def initialize_parallel_state(cfg: TrainConfig, *, gloo_groups: bool | None = None) -> None:
    """Megatron's ``parallel_state`` for ``cfg`` (the default process group must exist),
    with the embedding ranks our placements use; ``gloo_groups``: whether Megatron makes
    gloo twins of its data-parallel groups (None: the release's default, on in 0.16, off
    from 0.19; False on torch's fake backend, as under Megatron-LM's
    ``--fake-process-group``). Collective: every rank of the world takes part in each
    group's creation."""
    ranks = embedding_ranks(cfg.pipeline_schedule)  # where our placements keep them
    gloo = {} if gloo_groups is None else {"create_gloo_process_groups": gloo_groups}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        distributed_timeout_minutes=cfg.distributed_timeout_minutes,
        **gloo,
        **({"get_embedding_ranks": ranks} if ranks else {}),
    )


def _train_here(cfg: TrainConfig, graph_wrapper: GraphWrapper | None = None) -> TrainResult:
    """:func:`run_rank`'s work: Megatron's parallel state around one :class:`_Run`."""
    initialize_parallel_state(cfg)
    try:
        _check_writable(cfg)
        _seed(cfg)
        run = _Run(cfg, graph_wrapper)
        run.say([_header_line(cfg, dist.get_backend()), *run.parameter_lines()])
        began = time.perf_counter()
        run.resume()
        try:
            run.train()
        finally:
            if run.board is not None:
                run.board.close()
            if run.layer_graphs is not None:
                run.layer_graphs.close()
        seconds = time.perf_counter() - began
        run.say([_done_line(run, seconds)])
        return run.result
    finally:
        parallel_state.destroy_model_parallel()
