"""``cuda_graph_impl: transformer_engine`` under zb1p, dualpipe and dualpipev on CPU:
Megatron-Core's own ``TECudaGraphHelper.create_cudagraphs`` (the installed release) with
our ``_get_sample_arguments`` override (``megatron.schedule.te_graphs``), capturing through a
stand-in of TE's ``make_graphed_callables`` that follows ``_make_graphed_callables``
(``tests/te_graph_stand_in.py``). Each rank's order is accepted, the rank's step replays
the graphs in the order they were captured (each chunk's graph picked by its own forward
count, as ``set_current_microbatch`` gives it), and losses and gradients equal the eager
step's. One or two layers per chunk; a rank's chunks are independent (no pipeline messages):
what is checked is the graph bookkeeping, not the model. Then Megatron-LM's ``train`` builds
its helper through the patch's hook, for every patch (the capture in a run needs CUDA: the
route refuses CUDA graphs without it)."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from megatron_dualpipe.megatron.schedule.te_graphs import graph_order, schedule_te_cuda_graph_helper
from megatron_dualpipe.runtime.deferrable import DeferrableLinear
from megatron_dualpipe.runtime.weight_grad_store import WeightGradStore
from megatron_dualpipe.schedules.cuda_graphs import (
    CudaGraphOrderError,
    cuda_graph_order,
    max_wgrads_waiting,
)
from megatron_dualpipe.schedules.ir import Kind, Schedule
from megatron_dualpipe.schedules.registry import SCHEDULES
from tests.te_graph_stand_in import StandInTE

HIDDEN, SEQ, MBS = 4, 3, 2


class _Layer(nn.Linear):
    """A graphable layer: Megatron's helper asks it for its static inputs."""

    def __init__(self) -> None:
        super().__init__(HIDDEN, HIDDEN)

    def get_layer_static_inputs(self, seq_length: int, micro_batch_size: int) -> dict:
        return {"hidden_states": torch.zeros(seq_length, micro_batch_size, HIDDEN)}


def _helper(
    monkeypatch: pytest.MonkeyPatch,
    schedule: Schedule,
    rank: int,
    wgrad: bool,
    ours: bool = True,
    depth: int = 1,
) -> Any:
    """Our helper (``ours``, else Megatron's own) over ``schedule``'s chunks on ``rank``
    (``depth`` layers each),
    built without Megatron's ``__init__`` (which needs TE), its attributes as ``__init__``
    sets them."""
    from megatron.core.pipeline_parallel import schedules as megatron_schedules
    from megatron.core.transformer import cuda_graphs

    m = schedule.placement.num_microbatches
    te = StandInTE()
    monkeypatch.setattr(cuda_graphs, "make_graphed_callables", te, raising=False)
    monkeypatch.setattr(cuda_graphs, "get_num_microbatches", lambda: m)
    monkeypatch.setattr(cuda_graphs, "is_te_min_version", lambda v, *a, **k: v <= "2.8.0")
    monkeypatch.setattr(cuda_graphs, "log_on_each_pipeline_stage", lambda **_: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *_: 0)
    pp, chunks = schedule.num_ranks, schedule.placement.num_chunks
    # Megatron's own order is built by Megatron's functions from these (ours then replaces
    # it); for Megatron's helper alone, as its interleaved schedule would see them.
    virtual = None if ours else chunks
    pp_group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    p2p = SimpleNamespace(pp_group=pp_group, virtual_pipeline_model_parallel_size=virtual)
    state = megatron_schedules.parallel_state
    monkeypatch.setattr(state, "get_pipeline_model_parallel_world_size", lambda: pp)
    monkeypatch.setattr(state, "get_pipeline_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(state, "get_virtual_pipeline_model_parallel_world_size", lambda: virtual)
    cls = (
        schedule_te_cuda_graph_helper(lambda p, n: schedule, pp_size=pp, rank=rank, wgrad=wgrad)
        if ours
        else cuda_graphs.TECudaGraphHelper
    )
    helper = cls.__new__(cls)
    layers = [[_Layer() for _ in range(depth)] for _ in range(chunks)]
    config = SimpleNamespace(
        overlap_moe_expert_parallel_comm=False,
        microbatch_group_size_per_vp_stage=pp,
        cuda_graph_retain_backward_graph=False,
        cuda_graph_warmup_steps=3,
        fp8=False,
        fp4=False,
        sequence_parallel=False,
        cuda_graph_scope=[],
        cuda_graph_modules=[],
        multi_latent_attention=False,
        delay_wgrad_compute=wgrad,
        fine_grained_activation_offloading=False,
    )
    vars(helper).update(
        model=[None] * chunks,
        config=config,
        seq_length=SEQ,
        micro_batch_size=MBS,
        optimizers=[],
        num_model_chunks=chunks,
        num_microbatches=None,
        chunks_with_decoder=[SimpleNamespace(decoder=SimpleNamespace(layers=x)) for x in layers],
        num_layers_per_chunk=[depth] * chunks,
        callables_per_chunk=layers,
        callables_per_chunk_is_mtp=[[False] * depth] * chunks,
        flattened_callables=[x for chunk in layers for x in chunk],
        flattened_callables_is_mtp=[False] * chunks * depth,
        _graphs_created=False,
        _capture_finished=False,
        pp_group=pp_group,
        tp_group=None,
        dp_cp_group=None,
        p2p_communicator=p2p,
    )
    monkeypatch.setattr(helper, "_start_capturing", lambda: 0.0)
    monkeypatch.setattr(helper, "_finish_capturing", lambda start: None)
    return helper, te, layers


def _step(
    schedule: Schedule,
    rank: int,
    layers: list[list[_Layer]],
    graphed: bool,
    wgrad: bool,
    tails: list[nn.Module] | None = None,
) -> tuple[dict[tuple[int, int], torch.Tensor], list[torch.Tensor]]:
    """Run ``rank``'s compute actions in order; each (chunk, micro-batch) has its own input
    and loss, through the chunk's layers in turn (then ``tails[chunk]``, a layer deferring
    its dW to the action's W through a weight-gradient store, as our executor runs one).
    Graphed: a forward replays its chunk's graph of its own forward count, a backward (and
    W) the graph of its micro-batch, which must be the chunk's next (FIFO)."""
    losses: dict[tuple[int, int], torch.Tensor] = {}
    graph_of: dict[tuple[int, int], int] = {}
    counts = {kind: [0] * len(layers) for kind in "FBW"}
    store = WeightGradStore()

    def next_graph(kind: str, key: tuple[int, int]) -> int:
        index = counts[kind][key[0]]
        counts[kind][key[0]] += 1
        if kind != "F":
            assert graph_of[key] == index, f"{kind} of {key} is not its chunk's next graph"
        return index

    for action in schedule.ranks[rank]:
        for half in action.computes:
            key = (half.chunk, half.microbatch)
            chunk = layers[half.chunk]
            if half.kind is Kind.F:
                x = torch.randn(
                    SEQ,
                    MBS,
                    HIDDEN,
                    generator=torch.Generator().manual_seed(1000 * half.chunk + half.microbatch),
                ).requires_grad_()
                graph_of[key] = next_graph("F", key)
                for layer in chunk:
                    x = layer.cuda_graphs[graph_of[key]](x) if graphed else layer(x)
                if tails is not None:
                    with store.active():
                        x = tails[half.chunk](x)
                losses[key] = (x**2).mean()
                continue
            if half.kind in (Kind.B, Kind.BW):
                next_graph("B", key)
                with store.capture(key, lane=half.chunk):
                    losses[key].backward()
            if half.kind in (Kind.W, Kind.BW):
                store.run(key, lane=half.chunk)
            if graphed and wgrad and half.kind in (Kind.W, Kind.BW):
                (layer,) = chunk  # TE: wgrad graphs only with one layer per chunk
                layer.cuda_graphs[next_graph("W", key)].backward_dw()
    modules = [x for chunk in layers for x in chunk] + list(tails or [])
    return losses, [p.grad.clone() for x in modules for p in x.parameters()]


def _cases() -> list[tuple[str, int, int, bool, int]]:
    """Without wgrad graphs at PP 2, 4, 8 (one and two layers per chunk); with them
    where TE can capture the order (one layer per chunk, as TE requires)."""
    cases = []
    for name in ("zb1p", "dualpipe", "dualpipev"):
        for pp in (2, 4, 8):
            cases += [(name, pp, 2 * pp, False, 1), (name, pp, 3 * pp, False, 2)]
        if name != "zb1p":
            cases.append((name, 2, 4, True, 1))
    return [c for c in cases if SCHEDULES[c[0]].is_legal(c[1], c[2])]


@pytest.mark.parametrize(("name", "pp", "m", "wgrad", "depth"), _cases(), ids=str)
def test_megatron_s_helper_captures_our_order_and_replay_follows_capture(
    monkeypatch: pytest.MonkeyPatch, name: str, pp: int, m: int, wgrad: bool, depth: int
) -> None:
    schedule = SCHEDULES[name].generate(pp, m)
    for rank in range(pp):
        helper, te, layers = _helper(monkeypatch, schedule, rank, wgrad, depth=depth)
        eager_layers = [[_Layer() for _ in chunk] for chunk in layers]
        for eager, graphed in zip(sum(eager_layers, []), sum(layers, []), strict=True):
            eager.load_state_dict(graphed.state_dict())
        helper.create_cudagraphs()
        order, per_chunk = graph_order(schedule, rank, wgrad=wgrad)
        assert helper.num_microbatches == per_chunk
        assert all(len(x.cuda_graphs) == per_chunk for chunk in layers for x in chunk)
        losses, grads = _step(schedule, rank, layers, graphed=True, wgrad=wgrad)
        assert te.replayed == te.captured, f"rank {rank}: replay left the capture order"
        assert len(te.captured) == depth * len(order)
        eager_losses, eager_grads = _step(schedule, rank, eager_layers, graphed=False, wgrad=False)
        assert {k: v.item() for k, v in losses.items()} == {
            k: v.item() for k, v in eager_losses.items()
        }
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_an_order_te_would_miscapture_is_refused_before_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """zb1p defers several W of its one chunk: with wgrad graphs TE would capture the
    latest backward's wgrad graph for each (the stand-in then fails replaying the others);
    the helper refuses first, naming the entry."""
    schedule = SCHEDULES["zb1p"].generate(4, 8)
    rank = next(r for r in range(4) if max_wgrads_waiting(cuda_graph_order(schedule, r)) > 1)
    helper, te, _ = _helper(monkeypatch, schedule, rank, wgrad=True)
    with pytest.raises(CudaGraphOrderError, match="would never be captured"):
        helper.create_cudagraphs()
    assert te.captured == []


def test_the_stand_in_miscaptures_as_te_does_where_two_wgrads_wait() -> None:
    """What the refusal saves: TE's own check counts wgrads and passes ``[1, 1, -1, -1,
    -1.5, -1.5]``, then captures graph 1's wgrad twice and graph 0's never."""
    te = StandInTE()
    layer = _Layer()
    graphs = te(
        (layer,),
        [(torch.zeros(1),)] * 2,
        _order=[1, 1, -1, -1, -1.5, -1.5],
        _num_layers_per_chunk=[1],
    )
    assert te.captured == [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 1), ("W", 1)]
    with pytest.raises(RuntimeError, match="wgrad graph 0, never captured"):
        graphs[0].backward_dw()


def test_megatron_s_own_helper_captures_an_order_dualpipev_does_not_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the override (Megatron's ``TECudaGraphHelper`` as installed) the graphs are
    captured in Megatron's interleaved order and dualpipev's step replays them in another,
    which graphs sharing TE's memory pool must not: a buffer TE handed back (Megatron asks
    TE to, from 2.7 on) is written by a graph replayed before its reader, which autograd
    sees as an in-place change of a tensor it saved."""
    schedule = SCHEDULES["dualpipev"].generate(4, 8)
    helper, te, layers = _helper(monkeypatch, schedule, 0, wgrad=False, ours=False)
    helper.create_cudagraphs()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _step(schedule, 0, layers, graphed=True, wgrad=False)
    assert te.handed_back
    assert te.replayed != te.captured[: len(te.replayed)]


#: dualpipev's rank at PP 4 whose last Ws run after other backwards (B1.6 B0.6 B1.7 B0.7
#: W1.6 ...).
RANK = 3


def _with_deferring_tails(
    monkeypatch: pytest.MonkeyPatch, helper_class: type | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], StandInTE]:
    """dualpipev rank 3 at PP 4 (whose last Ws wait behind other backwards) with a
    deferring linear layer after each chunk's graphed layer, graphed through our helper
    (``helper_class``: a stand-in for it) and eagerly; the gradients of both steps, and
    the stand-in TE."""
    schedule = SCHEDULES["dualpipev"].generate(4, 8)
    helper, te, layers = _helper(monkeypatch, schedule, RANK, wgrad=False)
    if helper_class is not None:
        helper.__class__ = helper_class
    torch.manual_seed(0)
    tails = [DeferrableLinear(HIDDEN, HIDDEN) for _ in layers]
    eager_layers = [[_Layer() for _ in chunk] for chunk in layers]
    eager_tails = [DeferrableLinear(HIDDEN, HIDDEN) for _ in tails]
    pairs = zip(sum(eager_layers, []) + eager_tails, sum(layers, []) + tails, strict=True)
    for eager, graphed in pairs:
        eager.load_state_dict(graphed.state_dict())
    helper.create_cudagraphs()
    _, grads = _step(schedule, RANK, layers, graphed=True, wgrad=False, tails=tails)
    _, eager_grads = _step(
        schedule, RANK, eager_layers, graphed=False, wgrad=False, tails=eager_tails
    )
    return grads, eager_grads, te


def test_a_deferred_w_reads_a_graphs_output_as_the_eager_step_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layer after each graph keeps the graph's output (its input) for its W, which
    dualpipev runs after other graphs replayed: our helper has TE keep every graph's
    buffers (no ``_reuse_graph_input_output_buffers``), and every gradient is the eager
    step's."""
    grads, eager_grads, te = _with_deferring_tails(monkeypatch, None)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert te.handed_back == []


def test_with_megatron_s_buffer_reuse_a_deferred_w_reads_another_graphs_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What leaving the keyword out saves: with Megatron's keywords as it passes them
    (TE >= 2.7: hand buffers back), the deferred W reads a buffer the stand-in TE handed
    back and a later graph wrote (NaN)."""
    from megatron.core.transformer import cuda_graphs

    schedule = SCHEDULES["dualpipev"].generate(4, 8)
    ours = schedule_te_cuda_graph_helper(lambda p, n: schedule, pp_size=4, rank=RANK, wgrad=False)

    class WithReuse(ours):  # our order, Megatron's keywords
        _get_cuda_graph_input_data = cuda_graphs.TECudaGraphHelper._get_cuda_graph_input_data

    grads, eager_grads, te = _with_deferring_tails(monkeypatch, WithReuse)
    assert te.handed_back
    assert all(g.isfinite().all() for g in eager_grads)
    assert not all(g.isfinite().all() for g in grads)


def _route_helper(monkeypatch: pytest.MonkeyPatch, build: Any) -> Any:
    """``build`` called as Megatron-LM's ``train`` calls ``TECudaGraphHelper`` on pipeline
    rank 1 of 4 (Megatron's ``__init__``, which needs TE, stood in for)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import cuda_graphs

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(cuda_graphs.TECudaGraphHelper, "__init__", lambda self, *a, **k: None)
    return build(
        model="model", config="config", seq_length=8, micro_batch_size=1, optimizers=[None]
    )


def _captures_dualpipev_rank_1(monkeypatch: pytest.MonkeyPatch, helper: Any) -> bool:
    """Whether ``helper`` puts dualpipev's rank-1 order (PP 4, 8 micro-batches) in place of
    Megatron's before Megatron lays out its buffers."""
    from megatron.core.transformer import cuda_graphs

    order = [1, -1] * 8  # Megatron's, replaced in place by ours
    helper.num_model_chunks, helper.num_microbatches = 2, 8
    monkeypatch.setattr(cuda_graphs.TECudaGraphHelper, "_get_sample_arguments", lambda *a: None)
    helper._get_sample_arguments(order)
    return order == graph_order(SCHEDULES["dualpipev"].generate(4, 8), 1, wgrad=False)[0]


@pytest.mark.megatron
def test_the_megatron_lm_hook_gives_our_helper_where_te_can_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``megatron_lm.cuda_graph_helper`` (what the patched ``train`` builds its helper with)
    gives Megatron's class back unless ``--cuda-graph-impl transformer_engine`` runs under
    one of our schedules, and there a helper capturing the run's schedule for the pipeline
    rank; ``apply`` leaves Megatron-LM's module alone."""

    from megatron.core.transformer import cuda_graphs

    from megatron_dualpipe import megatron_lm
    from tests.test_cuda_graph_keys import NEW_NAMES, _lm_args

    megatrons = cuda_graphs.TECudaGraphHelper
    key = "cuda_graph_modules" if NEW_NAMES else "cuda_graph_scope"
    te = {"cuda_graph_impl": "transformer_engine", key: ["moe_router"]}
    for megatrons_own in (
        _lm_args(),  # cuda_graph_impl local
        _lm_args(pipeline_schedule="1f1b", **te),
        _lm_args(pipeline_schedule=None, **te),
    ):
        assert megatron_lm.cuda_graph_helper(megatrons_own, megatrons) is megatrons
    args = _lm_args(**te)
    build = megatron_lm.cuda_graph_helper(args, megatrons)
    assert build is not megatrons

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    training = types.ModuleType("megatron.training.training")
    training.TECudaGraphHelper = megatrons
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    megatron_lm.apply(args)
    assert training.TECudaGraphHelper is megatrons

    helper = _route_helper(monkeypatch, build)
    assert isinstance(helper, megatrons) and type(helper) is not megatrons
    assert _captures_dualpipev_rank_1(monkeypatch, helper)


def _patched_graph_helper_block(out: Path) -> ast.If:
    """The ``if args.cuda_graph_impl == "transformer_engine":`` block of ``train`` that
    builds ``cuda_graph_helper``, in the installed wheel's ``megatron/training`` patched as
    ``megatron-dualpipe patch-megatron-lm`` patches it (skips where the wheel ships none)."""
    from megatron_dualpipe.megatron.compat.lm_patch import (
        MegatronLMPatchError,
        make_patched_training,
    )

    try:
        training, _ = make_patched_training(out)
    except MegatronLMPatchError as err:
        if "ships no megatron/training" in str(err):
            pytest.skip(str(err))
        raise
    tree = ast.parse((training / "training.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    blocks = [
        node
        for node in ast.walk(train)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "args.cuda_graph_impl == 'transformer_engine'"
        and any(
            isinstance(target, ast.Name) and target.id == "cuda_graph_helper"
            for statement in node.body
            if isinstance(statement, ast.Assign)
            for target in statement.targets
        )
    ]
    assert len(blocks) == 1, f"{len(blocks)} blocks of train build cuda_graph_helper"
    return blocks[0]


@pytest.mark.megatron
@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b"])
def test_the_patched_train_builds_its_helper_through_the_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, schedule: str
) -> None:
    """The patched ``train``'s own lines that build ``cuda_graph_helper`` (the installed
    wheel's, 0.17 and newer), run with our hooks module as their ``dualpipe_lm``: our helper
    under dualpipev, capturing its order for the rank; Megatron's own class under 1F1B."""
    from megatron.core.transformer import cuda_graphs

    from megatron_dualpipe import megatron_lm
    from tests.test_cuda_graph_keys import NEW_NAMES, _lm_args

    block = _patched_graph_helper_block(tmp_path)
    key = "cuda_graph_modules" if NEW_NAMES else "cuda_graph_scope"
    megatrons = cuda_graphs.TECudaGraphHelper
    args = _lm_args(
        pipeline_schedule=schedule, cuda_graph_impl="transformer_engine", **{key: ["moe_router"]}
    )
    args.seq_length = 8
    names = {
        "args": args,
        "model": "model",
        "config": "config",
        "optimizer": None,
        "TECudaGraphHelper": megatrons,
        "dualpipe_lm": megatron_lm,
    }

    def run_train_s_lines(**_: Any) -> Any:
        exec(compile(ast.Module([block], type_ignores=[]), "training.py", "exec"), names)
        return names["cuda_graph_helper"]

    helper = _route_helper(monkeypatch, run_train_s_lines)
    assert isinstance(helper, megatrons)
    if schedule == "1f1b":
        assert type(helper) is megatrons
    else:
        assert type(helper) is not megatrons, "train builds Megatron's own helper"
        assert _captures_dualpipev_rank_1(monkeypatch, helper)


@pytest.mark.megatron
@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0"])
def test_every_patch_builds_trains_helper_through_the_hook(tag: str) -> None:
    """Each tag's patch replaces ``train``'s ``TECudaGraphHelper(...)`` by the class
    ``dualpipe_lm.cuda_graph_helper`` gives (read from the patch's hunks: not every tag's
    ``megatron/training`` is installed)."""
    from tests.test_megatron_lm import PATCHES, _parse_patch

    hunks = _parse_patch((PATCHES / f"megatron-lm-{tag}.patch").read_text())[
        "megatron/training/training.py"
    ]
    bodies = [body for *_, body in hunks if any("cuda_graph_helper(" in line for line in body)]
    assert len(bodies) == 1, f"{tag}: no hunk builds train's helper through the hook"
    assert "-        cuda_graph_helper = TECudaGraphHelper(" in bodies[0]
    assert any(
        line.startswith("+") and "dualpipe_lm.cuda_graph_helper(args, TECudaGraphHelper)" in line
        for line in bodies[0]
    )
