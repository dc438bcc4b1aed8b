"""CUDA graphs under the pipeline schedules: which implementation may graph what, and the
order Transformer Engine captures per-layer graphs in (pure Python, no torch).

:func:`cuda_graph_problem` says, in one sentence, why a schedule cannot run under a
``cuda_graph_impl`` (``local``, ``transformer_engine`` or ``full_iteration``) with the
graphed modules (:data:`CUDA_GRAPH_MODULES`; none listed: the whole layer): a per-layer
graph may not cover a part that defers its dW. :func:`cuda_graph_order` is the ``_order``
TE's ``make_graphed_callables`` takes, for any schedule of the IR, and
:func:`check_cuda_graph_order` holds it to TE's rules. Each implementation, and why:
docs/megatron.md, "CUDA graphs".
"""

from __future__ import annotations

from collections.abc import Sequence

from .ir import Kind, Schedule, ScheduleError
from .registry import ScheduleSpec

__all__ = [
    "CUDA_GRAPH_IMPLS",
    "CUDA_GRAPH_MODULES",
    "CudaGraphOrderError",
    "check_cuda_graph_order",
    "cuda_graph_order",
    "cuda_graph_problem",
    "ep_overlap_graph_problem",
    "deferring_modules",
    "max_wgrads_waiting",
]

#: Megatron-Core's ``cuda_graph_impl`` values, as megatron-core 0.18 and newer spell them.
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
#: The parts of a layer a per-layer graph may cover (Megatron-Core's ``CudaGraphModule``;
#: 0.16/0.17: ``CudaGraphScope`` less ``full_iteration``). None listed: the whole layer.
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


class CudaGraphOrderError(ScheduleError):
    """A graph order Transformer Engine's ``make_graphed_callables`` would refuse."""


def deferring_modules(modules: Sequence[str], *, shared_expert_in_router_graph: bool) -> list[str]:
    """The parts of ``modules`` (none: the whole layer) whose layers defer their weight
    gradient under a schedule that splits the backward: attention (QKV and output
    projections), the dense MLP, the MoE experts, and under ``moe_router`` the shared expert
    when Megatron graphs it with the router (``TransformerLayer._get_submodules_under_cudagraphs``
    adds it unless ``moe_shared_expert_overlap``). The router's gate weight is a plain
    parameter whose gradient autograd computes at once, and ``moe_preprocess`` (the token
    permutation) has no weights: neither defers."""
    if not modules:
        return ["the whole layer"]
    deferring = [m for m in modules if m in ("attn", "mlp", "moe", "mamba")]
    if "moe_router" in modules and shared_expert_in_router_graph:
        deferring.append("moe_router (with the shared expert)")
    return deferring


def cuda_graph_problem(
    found: ScheduleSpec,
    impl: str,
    modules: Sequence[str],
    *,
    shared_expert_in_router_graph: bool = False,
) -> str | None:
    """Why ``impl`` graphing ``modules`` cannot run under ``schedule``, in one sentence, or
    None. Megatron's own schedules (1f1b, interleaved-1f1b) take every implementation as
    Megatron does. Under this project's schedules:

    - ``local`` and ``transformer_engine`` only where no graphed part defers its dW
      (:func:`deferring_modules`) when the schedule splits the backward (zb1p, dualpipe,
      dualpipev): ``local``'s replayed backward graph computes dW inside it, and TE would
      need a wgrad graph per deferred W, which it captures for a chunk's latest backward
      only (:func:`check_cuda_graph_order`), while these schedules keep several backwards
      of one chunk waiting for their W at most sizes (:func:`max_wgrads_waiting`). TE's
      graphs are captured in the schedule's own order
      (``megatron.schedule.te_graphs.schedule_te_cuda_graph_helper``);
    - ``full_iteration``: the graph-safe executor runs under zb1p and dualpipev; dualpipe's
      two chunks on a rank each take half of the step's micro-batches, while
      ``FullCudaGraphWrapper.data_read`` reads all of them for every chunk.
    """
    if impl not in CUDA_GRAPH_IMPLS:
        return f"cuda_graph_impl {impl!r} is not one of {', '.join(CUDA_GRAPH_IMPLS)}"
    unknown = [m for m in modules if m not in CUDA_GRAPH_MODULES]
    if unknown:
        return (
            f"cuda_graph_modules {unknown[0]!r} is not one of {', '.join(CUDA_GRAPH_MODULES)} "
            "(none listed: the whole layer)"
        )
    schedule = found.name
    if impl == "none" or not found.runs_ours:
        return None
    if impl in ("local", "transformer_engine"):
        deferring = deferring_modules(
            modules, shared_expert_in_router_graph=shared_expert_in_router_graph
        )
        if not found.splits_backward or not deferring:
            return None
        graphed = " ".join(modules) if modules else "the whole layer"
        cannot = (
            "that the replayed backward graph cannot leave out"
            if impl == "local"
            else "that TE graphs apart for a chunk's latest backward only, and "
            f"{schedule} keeps several backwards of a chunk waiting for theirs"
        )
        return (
            f"cuda_graph_impl {impl} under {schedule} graphs {graphed}, and {deferring[0]} "
            f"defers its weight gradient to a W {cannot}: graph only moe_router / "
            "moe_preprocess (without the shared expert, or with moe_shared_expert_overlap), "
            "or choose 1f1b or interleaved-1f1b to graph whole layers"
        )
    if found.placement == "mirror":
        return (
            f"cuda_graph_impl full_iteration under {schedule}: FullCudaGraphWrapper reads "
            "every micro-batch of the step for each of a rank's model chunks, and each of "
            f"{schedule}'s two chunks takes half of them: use dualpipev or zb1p for "
            "whole-step graphs"
        )
    return None


def ep_overlap_graph_problem(schedule: ScheduleSpec, impl: str, ep_overlap: bool) -> str | None:
    """Why ``impl`` cannot graph under ``schedule`` with ``overlap_moe_expert_parallel_comm``
    (``ep_overlap``), as the rest of a sentence after that key's name, or None: Megatron
    then captures TE's per-layer graphs in its combined 1F1B order, which our schedules do
    not run."""
    if impl != "transformer_engine" or not ep_overlap or not schedule.runs_ours:
        return None
    return (
        "under cuda_graph_impl: transformer_engine has Megatron graph each layer in its "
        f"combined 1F1B order, which {schedule.name} does not run: turn one of them off"
    )


def cuda_graph_order(schedule: Schedule, rank: int) -> list[float]:
    """Transformer Engine's ``_order`` for ``rank`` of ``schedule``, one layer per chunk.

    Entries follow the rank's compute actions in order: ``+c`` a forward of the rank's
    chunk ``c`` (1-based, as TE numbers chunks; an ``int``, as TE requires), ``-c`` its
    backward (an input-gradient B, or the dX half of a full backward), ``-c-0.5`` its
    weight-gradient graph (a W; a full backward BW gives ``-c`` then ``-c-0.5``). An
    overlapped FB gives its forward's entry then its backward's. With
    ``delay_wgrad_compute`` TE graphs the wgrad of every backward apart, so every backward
    here has its ``-c-0.5``. This is the order the rank runs its layers in (the order
    graphs sharing TE's memory pool must be replayed in); whether TE can capture it is
    :func:`check_cuda_graph_order`'s answer: not where a chunk has two backwards waiting
    for their wgrads (:func:`max_wgrads_waiting`), as zb1p has, and dualpipe and dualpipev
    at larger PP.
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ScheduleError(f"rank {rank} is out of range 0..{schedule.num_ranks - 1}")
    order: list[float] = []
    for action in schedule.ranks[rank]:
        for half in action.computes:
            chunk = half.chunk + 1
            if half.kind is Kind.F:
                order.append(chunk)
            elif half.kind is Kind.B:
                order.append(-chunk)
            elif half.kind is Kind.W:
                order.append(-chunk - 0.5)
            elif half.kind is Kind.BW:
                order += [-chunk, -chunk - 0.5]
    return order


def check_cuda_graph_order(
    order: Sequence[float], num_chunks: int, num_microbatches: int, *, wgrad: bool
) -> None:
    """Raise :class:`CudaGraphOrderError`, naming the entry, where Transformer Engine's
    ``_make_graphed_callables`` (``transformer_engine/pytorch/graph.py``) would refuse or
    miscapture ``order`` for ``num_chunks`` model chunks of one layer each and
    ``num_microbatches`` micro-batches per chunk, with (``wgrad``: ``delay_wgrad_compute``)
    or without wgrad graphs. TE's rules, as it checks the order and then walks it capturing:

    - a forward is a Python ``int`` ``+c`` (TE raises TypeError otherwise), a backward
      ``-c``, a wgrad ``-c-0.5`` (only with wgrad graphs), ``1 <= c <= num_chunks``;
    - the entries without wgrad number ``num_chunks x num_microbatches x 2`` (TE's
      "order dimension mismatch"), and each chunk has ``num_microbatches`` forwards and as
      many backwards (and wgrads): TE indexes each chunk's graphs by a per-chunk counter;
    - the k-th backward of a chunk is captured on the graphs of its k-th forward, so no
      backward comes before a forward of its chunk not yet backed;
    - a wgrad entry captures the wgrad graph of its chunk's *latest* backward (TE uses
      ``bwd_idx - 1``): it must come after that backward and before the chunk's next one,
      else the earlier backward's wgrad graph is never captured and the later one's twice.
    """
    forwards, backwards = [0] * num_chunks, [0] * num_chunks
    waiting = [False] * num_chunks  # the chunk's latest backward has no wgrad yet
    for index, entry in enumerate(order):
        chunk = int(abs(entry))
        wgrad_entry = abs(entry) - chunk == 0.5
        where = f"entry {index} ({entry:g})"
        if (
            not 1 <= chunk <= num_chunks
            or abs(entry) - chunk not in (0.0, 0.5)
            or (wgrad_entry and entry > 0)
        ):
            raise CudaGraphOrderError(
                f"{where} names no chunk: write +c, -c or -c-0.5 for c in 1..{num_chunks}"
            )
        c = chunk - 1
        if entry > 0:
            if not isinstance(entry, int):
                raise CudaGraphOrderError(f"{where}: TE takes a forward only as a Python int")
            forwards[c] += 1
        elif wgrad_entry:
            if not wgrad:
                raise CudaGraphOrderError(
                    f"{where} is a wgrad graph, and without delay_wgrad_compute TE graphs none"
                )
            if not waiting[c]:
                raise CudaGraphOrderError(
                    f"{where}: chunk {chunk}'s latest backward already has its wgrad (TE "
                    "captures a wgrad entry for the chunk's latest backward)"
                )
            waiting[c] = False
        else:
            if backwards[c] >= forwards[c]:
                raise CudaGraphOrderError(
                    f"{where}: a backward of chunk {chunk} before any forward of it not yet "
                    "backed (TE captures a chunk's k-th backward on its k-th forward's graphs)"
                )
            if waiting[c]:
                raise CudaGraphOrderError(
                    f"{where}: backward {backwards[c] + 1} of chunk {chunk} comes before the "
                    f"wgrad of backward {backwards[c]}, and TE captures a wgrad entry for the "
                    "chunk's latest backward only: the earlier one's wgrad graph would never "
                    "be captured"
                )
            backwards[c] += 1
            waiting[c] = wgrad
    for c in range(num_chunks):
        for kind, count in (("forward", forwards[c]), ("backward", backwards[c])):
            if count != num_microbatches:
                raise CudaGraphOrderError(
                    f"chunk {c + 1} has {count} {kind} entries, and TE captures "
                    f"{num_microbatches} (one per micro-batch) for every chunk"
                )
        if waiting[c]:
            raise CudaGraphOrderError(f"chunk {c + 1}'s last backward has no wgrad entry")


def max_wgrads_waiting(order: Sequence[float]) -> int:
    """The most backwards of one chunk whose wgrad entries are still to come, over
    ``order``: 1 at most is what TE's capture takes (:func:`check_cuda_graph_order`)."""
    waiting: dict[int, int] = {}
    most = 0
    for entry in order:
        chunk = int(abs(entry))
        if entry < 0 and entry == chunk * -1:
            waiting[chunk] = waiting.get(chunk, 0) + 1
        elif entry < 0:
            waiting[chunk] -= 1
        most = max(most, waiting.get(chunk, 0))
    return most
