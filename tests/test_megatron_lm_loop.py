"""Megatron-LM's own training loop, run for real: ``megatron.training.pretrain`` from the
installed megatron-core wheel (0.19 ships ``megatron/training``), copied to a temporary
folder and patched with the ``megatron/training`` hunks of
``patches/megatron-lm-core_v0.19.0.patch``, driven by ``scripts/pretrain_gpt_megatron_lm.py``
with ``--mock-data`` on 2 and 4 forked CPU ranks over gloo (the script applies
:mod:`~megatron_dualpipe.megatron.compat.cpu_compat_training` without a GPU).

Megatron-LM seeds each pipeline rank differently (``seed + 100 * pp_rank``), so a schedule
that places layers elsewhere starts from other random weights: every run here starts from
one checkpoint, saved by Megatron's 1F1B after its first iteration (the MoE model from its
own). From it, with dropout and gradient clipping off, ``--pipeline-schedule`` zb1p and
dualpipev print 1F1B's digits at every iteration and evaluation, and dualpipe (two model
copies, each summing half the micro-batches' gradients) agrees within one part in a
million; a checkpoint that dualpipev saves mid-run resumes under 1F1B with 1F1B's digits.
The same holds under each flag combination of :data:`COMBINATIONS` (the flags production
runs use), against Megatron's 1F1B with the same flags.

Every run of one world size goes through one set of forked ranks, one run after the other
(Megatron-LM's ``destroy_global_state`` between them, as its in-process restart does): the
imports, the JIT warm-up's compilation and the tokenizer's load are paid once per rank, not
once per run. A run that fails is recorded with its error and the next one starts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import megatron.core
import pytest
import torch.distributed as dist

from megatron_dualpipe.megatron.compat.version import installed_megatron_core
from tests.multiproc import run_workers

#: The timeout is the first test's, whose setup runs every run of its world size.
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.multiproc,
    pytest.mark.slow,
    pytest.mark.route,
    pytest.mark.timeout(1800),
]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt_megatron_lm.py"
PATCH = ROOT / "patches" / "megatron-lm-core_v0.19.0.patch"
WHEEL_TRAINING = Path(megatron.core.__file__).resolve().parents[1] / "training"
ITERATIONS = 5
REL_TOL = 1e-6
#: Megatron's own 1F1B runs against their checked-in losses (``--write-golden`` writes
#: them): for the versions CI installs (megatron-core 0.19.2, torch 2.13.0 on CPU).
GOLDEN = ROOT / "tests" / "golden" / "route_1f1b_losses.json"
#: The golden losses' tolerance, relative: the printed seventh digit, and float32 sums
#: that another CPU's kernels may add in another order.
GOLDEN_REL_TOL = 1e-5
SCHEDULES = ("1f1b", "zb1p", "dualpipev", "dualpipe")
#: A tiny GPT at PP=2 (4 micro-batches: dualpipe and dualpipev need 2 x PP), fp32, no
#: dropout, no clipping, no fused kernels; a validation every 2 iterations; batches read
#: in the rank's own process.
ARGS = (
    "--pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 32 --num-attention-heads 4 "
    "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERATIONS} --lr 1e-3 --lr-decay-iters {ITERATIONS} --clip-grad 0 "
    "--hidden-dropout 0 --attention-dropout 0 --seed 1234 --untie-embeddings-and-output-weights "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local "
    "--no-persist-layer-norm --no-gradient-accumulation-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-masked-softmax-fusion --no-rope-fusion "
    "--distributed-backend gloo --log-interval 1 --eval-interval 2 --eval-iters 1 "
    "--num-workers 0"
).split()
#: At 4 ranks (PP=2 x DP=2): one sample per micro-batch, so a step keeps 4 micro-batches
#: and the 8 samples of the 2-rank runs.
FOUR_RANKS = ["--micro-batch-size", "1"]
#: At 4 ranks, PP=4 (8 layers: dualpipev's V has 8 stages; 8 micro-batches of one sample).
PP4 = [*FOUR_RANKS, "--pipeline-model-parallel-size", "4", "--num-layers", "8"]
#: A MoE model: every layer 4 experts, top-2, the all-to-all dispatcher, no linear biases
#: (megatron-core's SequentialMLP with biases fails autograd's in-place check).
MOE = [
    *("--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"),
    *("--disable-bias-linear", "--moe-aux-loss-coeff", "0.01"),
]
#: A layout per schedule, as the balance advisor prints one (a repeat in brackets), of
#: the even split the plain runs take (one decoder layer per stage of dualpipev's V).
LAYOUTS = {"dualpipev": "Et|(t|)*2tL", "dualpipe": "Ett|ttL"}


def _layout(layout: str) -> list[str]:
    return ["--pipeline-model-parallel-layout", layout]


#: One MTP layer (Megatron-Core refuses it with learned absolute positions: RoPE).
MTP = [
    *("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"),
    *("--position-embedding-type", "rope"),
]
#: The MoE router of NVIDIA's DeepSeek-V3 launch script, small.
DEEPSEEK_ROUTER = [
    *("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"),
    *("--moe-shared-expert-intermediate-size", "32", "--moe-router-dtype", "fp32"),
    *("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.0001"),
    *("--calculate-per-token-loss", "--recompute-granularity", "selective"),
]
#: Multi-latent attention (DeepSeek's) on the local spec, with RoPE.
MLA = [
    *("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16"),
    *("--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"),
    *("--position-embedding-type", "rope", "--rope-type", "rope"),
]
SCHEDULE_LINE = re.compile(r"pipeline schedule: .*")
LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: (\d\.\d{6}E[-+]\d\d) \|")
MTP_LOSS = re.compile(r"iteration +(\d+)/ +\d+ \|.*\| mtp_1 loss: (\d\.\d{6}E[-+]\d\d) \|")
VALIDATION = re.compile(
    r"validation loss at iteration (\d+) \| lm loss value: (\d\.\d{6}E[-+]\d\d)"
)

if not WHEEL_TRAINING.is_dir() or not installed_megatron_core().startswith("0.19."):
    pytest.skip(
        f"megatron-core {installed_megatron_core()} is installed: this test runs the "
        "megatron/training that the 0.19 wheel ships",
        allow_module_level=True,
    )


@dataclass(frozen=True)
class Combination:
    """Flags production runs use, run under every schedule against Megatron's 1F1B with
    the same flags, from the shared checkpoint of its model, on ``world_size`` ranks; or,
    where Megatron-LM forbids them, ``refused``: its one sentence, under every schedule."""

    name: str
    flags: tuple[str, ...]
    world_size: int = 2
    moe: bool = False
    refused: str | None = None

    def argv(self, schedule: str, start: Path) -> list[str]:
        ours = [] if schedule == "1f1b" else ["--pipeline-schedule", schedule]
        sized = FOUR_RANKS if self.world_size == 4 else []
        return [*sized, *(MOE if self.moe else []), *self.flags, "--load", str(start), *ours]


#: Without Apex or Transformer Engine (CPU), megatron-core's distributed optimizer cannot
#: describe a fresh optimizer's state for loading (``assert len(steps) == 1`` in its
#: ``state_dict``), nor does a checkpoint of fp32 parameters hold bf16's fp32 copy: such
#: runs load the checkpoint's weights only (1F1B as ours).
WEIGHTS_ONLY = "--no-load-optim"
#: The all-to-all overlap of F&B pairs (MoE, EP=2, bf16), against the same schedule without.
EP_OVERLAP = ("--expert-model-parallel-size", "2", "--bf16", WEIGHTS_ONLY)
#: A flag that another run already takes has no run of its own: the distributed optimizer
#: runs within overlap-param-gather; selective recomputation and the per-token loss within
#: the DeepSeek router's runs (:func:`test_mtp_with_deepseeks_router_as_1f1b`).
COMBINATIONS = (
    Combination("overlap-grad-reduce", ("--overlap-grad-reduce",)),
    Combination(
        "overlap-param-gather",
        ("--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather",
         WEIGHTS_ONLY),
        4,
    ),  # fmt: skip
    Combination("bf16", ("--bf16", WEIGHTS_ONLY)),
    Combination("moe-ep2", ("--expert-model-parallel-size", "2"), 4, moe=True),
    Combination(
        "recompute-full",
        ("--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"),
    ),  # fmt: skip
    Combination(
        "overlap-param-gather-alone",
        ("--overlap-param-gather",),
        refused="AssertionError: --overlap-param-gather only supported with distributed "
        "optimizer, megatron fsdp, or dist_muon",
    ),
)


@dataclass
class Printed:
    """What one run printed: its training and validation losses by iteration, and the
    error that stopped it (None: it finished)."""

    train: dict[int, str] = field(default_factory=dict)
    validation: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    #: The log's "pipeline schedule: ..." lines, over all ranks.
    schedule_lines: list[str] = field(default_factory=list)
    #: The MTP layer's training loss by iteration (runs with --mtp-num-layers 1).
    mtp: dict[int, str] = field(default_factory=dict)

    def add(self, other: Printed) -> None:
        self.train.update(other.train)
        self.mtp.update(other.mtp)
        self.validation.update(other.validation)
        self.error = self.error or other.error
        self.seconds = max(self.seconds, other.seconds)
        self.schedule_lines += other.schedule_lines

    def losses(self) -> tuple[dict[int, str], dict[int, str]]:
        assert self.error is None, self.error
        return self.train, self.validation


@pytest.fixture(scope="module")
def patched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the wheel's megatron/training with the patch's hunks for it applied."""
    root = tmp_path_factory.mktemp("megatron-lm")
    shutil.copytree(
        WHEEL_TRAINING, root / "megatron" / "training", ignore=shutil.ignore_patterns("__pycache__")
    )
    for check in (["--check"], []):
        done = subprocess.run(
            ["git", "apply", *check, "--include=megatron/training/*", str(PATCH)],
            cwd=root, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    return root


def _one_run(script: object, argv: list[str]) -> Printed:
    """``script.main(argv)``: its printed losses, or the error that stopped it (a refusal's
    ``error:`` line, or the exception)."""
    printed, errors = io.StringIO(), io.StringIO()
    error = None
    began = time.monotonic()
    with (
        contextlib.redirect_stdout(printed),
        contextlib.redirect_stderr(errors),
        _logging_to(printed),
    ):
        try:
            script.main(argv)
        except SystemExit as stop:  # --exit-interval ends the run with exit code 0
            if stop.code not in (0, None):
                said = [line for line in errors.getvalue().splitlines() if "error:" in line]
                error = said[-1] if said else f"exit code {stop.code}"
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = f"{type(exc).__name__}: {exc}"[:1500]
    text = printed.getvalue()
    return Printed(
        {int(i): loss for i, loss in LOSS.findall(text)},
        {int(i): loss for i, loss in VALIDATION.findall(text)},
        error,
        time.monotonic() - began,
        SCHEDULE_LINE.findall(text),
        {int(i): loss for i, loss in MTP_LOSS.findall(text)},
    )


@contextlib.contextmanager
def _logging_to(stream: io.StringIO) -> Iterator[None]:
    """Log records of INFO and above go to ``stream`` meanwhile, as Megatron-LM's
    ``logging.basicConfig(level=INFO)`` sends them to stdout (under pytest, whose handlers
    the forked ranks inherit, that call does nothing)."""
    root = logging.getLogger()
    handler, level = logging.StreamHandler(stream), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _rank(rank: int, world_size: int, copy: str, runs: list[list[str]]) -> list[Printed]:
    """One rank of ``pretrain``, once per argument list, one after the other."""
    sys.path.insert(0, copy)  # megatron.training resolves to the patched copy
    spec = importlib.util.spec_from_file_location("pretrain_gpt_megatron_lm", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from megatron.training.training import destroy_global_state

    found = []
    for argv in runs:
        found.append(_one_run(script, argv))
        destroy_global_state()
        _destroy_process_groups_but_the_default()
    assert sys.modules["megatron.training"].__file__.startswith(copy)  # the patched copy ran
    return found


def _destroy_process_groups_but_the_default() -> None:
    """Destroy the groups a run made (Megatron's and our channels: over gloo, each holds
    threads and sockets, and thirty runs' worth made a rank of 1,700 threads): Megatron's
    ``destroy_model_parallel`` forgets them, destroying only its explicit gloo groups.
    torch lists the groups only in ``distributed_c10d``'s private ``_world``."""
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_group()
    for group in list(distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)


def _pretrain(patched: Path, world_size: int, runs: Sequence[Sequence[str]]) -> list[Printed]:
    """Run ``pretrain`` once per argument list (after :data:`ARGS`) on ``world_size``
    forked ranks; each run's printed losses, over all ranks."""
    # Megatron's dataset index, built by the first run, read from its cache by the others
    cache = ["--data-cache-path", str(patched / "data-cache")]
    argvs = [ARGS + cache + list(extra) for extra in runs]
    per_rank = run_workers(
        _rank, world_size, args=(str(patched), argvs), timeout_s=120.0 + 60.0 * len(runs),
        pg_timeout_s=60.0,
    )  # fmt: skip
    merged = [Printed() for _ in runs]
    for printed in per_rank:
        for total, one in zip(merged, printed, strict=True):
            total.add(one)
    return merged


def _save_at(ckpt: Path, iteration: int) -> list[str]:
    return ["--save", str(ckpt), "--save-interval", "100", "--exit-interval", str(iteration)]


def _ours(schedule: str) -> list[str]:
    return [] if schedule == "1f1b" else ["--pipeline-schedule", schedule]


@dataclass(frozen=True)
class Checkpoints:
    start: Path  # Megatron's 1F1B after one iteration: where every run below starts
    resumed: dict[str, Path]  # saved at iteration 3 under dualpipev and 1f1b


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    root = tmp_path_factory.mktemp("checkpoints")
    return Checkpoints(root / "start", {s: root / s for s in ("dualpipev", "1f1b")})


@pytest.fixture(scope="module")
def two_ranks(patched: Path, checkpoints: Checkpoints) -> dict[tuple[str, str], Printed]:
    """Every 2-rank run, in one set of ranks: the shared checkpoint, the four schedules
    from it, the resume of a dualpipev and a 1F1B checkpoint under 1F1B, and each 2-rank
    combination under each schedule."""
    start = checkpoints.start
    runs: dict[tuple[str, str], list[str]] = {("start", "1f1b"): _save_at(start, 1)}
    for schedule in SCHEDULES:
        runs[("plain", schedule)] = ["--load", str(start), *_ours(schedule)]
    for schedule, saved in checkpoints.resumed.items():
        first = ["--load", str(start), *_ours(schedule), *_save_at(saved, 3)]
        runs[("saved at 3", schedule)] = first
        runs[("resumed", schedule)] = ["--load", str(saved)]
    for combination in COMBINATIONS:
        if combination.world_size == 2:
            for schedule in SCHEDULES:
                runs[(combination.name, schedule)] = combination.argv(schedule, start)
    for schedule, layout in LAYOUTS.items():
        runs[("layout", schedule)] = [*_layout(layout), "--load", str(start), *_ours(schedule)]
    for schedule in ("1f1b", "dualpipev"):  # from scratch: no checkpoint
        runs[("fresh", schedule)] = _ours(schedule)
    mtp_start = checkpoints.start.parent / "mtp"
    runs[("mtp start", "1f1b")] = [*MTP, *_save_at(mtp_start, 1)]
    for schedule in SCHEDULES:
        runs[("mtp", schedule)] = [*MTP, "--load", str(mtp_start), *_ours(schedule)]
    mla_start = checkpoints.start.parent / "mla"
    runs[("mla start", "1f1b")] = [*MLA, *_save_at(mla_start, 1)]
    for schedule in ("1f1b", "dualpipev"):
        runs[("mla", schedule)] = [*MLA, "--load", str(mla_start), *_ours(schedule)]
    found = dict(zip(runs, _pretrain(patched, 2, list(runs.values())), strict=True))
    assert (start / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    for key, printed in found.items():
        print(f"\n{key}: {printed}")
    return found


@pytest.fixture(scope="module")
def four_ranks(
    patched: Path, checkpoints: Checkpoints, two_ranks: dict, tmp_path_factory
) -> dict[tuple[str, str], Printed]:
    """Every 4-rank run, in one set of ranks: the MoE model's shared checkpoint, then each
    4-rank combination (PP=2 x DP=2) under each schedule (the dense ones from the 2-rank
    checkpoint, which dist_checkpointing reshards over the data-parallel ranks); and at
    PP=4, a 1F1B checkpoint after one iteration and the first steps from it under 1F1B,
    dualpipev and dualpipe."""
    moe_start = tmp_path_factory.mktemp("moe") / "start"
    pp4_start = tmp_path_factory.mktemp("pp4") / "start"
    runs = {("moe start", "1f1b"): [*FOUR_RANKS, *MOE, "--expert-model-parallel-size", "2",
                                    *_save_at(moe_start, 1)]}  # fmt: skip
    runs[("pp4 start", "1f1b")] = [*PP4, *_save_at(pp4_start, 1)]
    for schedule in ("1f1b", "dualpipev", "dualpipe"):
        runs[("pp4", schedule)] = [*PP4, "--load", str(pp4_start), *_ours(schedule)]
    deepseek = [*FOUR_RANKS, *MOE, "--expert-model-parallel-size", "2", *MTP, *DEEPSEEK_ROUTER]
    deepseek_start = tmp_path_factory.mktemp("deepseek") / "start"
    runs[("deepseek start", "1f1b")] = [*deepseek, *_save_at(deepseek_start, 1)]
    for schedule in SCHEDULES:
        runs[("deepseek", schedule)] = [*deepseek, "--load", str(deepseek_start), *_ours(schedule)]
    for schedule in ("1f1b", "dualpipev"):  # from scratch: no checkpoint
        runs[("fresh moe mtp", schedule)] = [*deepseek, *_ours(schedule)]
    for schedule in ("dualpipev", "dualpipe"):
        plain = [*FOUR_RANKS, *MOE, *EP_OVERLAP, "--load", str(moe_start), *_ours(schedule)]
        runs[("ep-overlap off", schedule)] = plain
        runs[("ep-overlap on", schedule)] = [*plain, "--overlap-moe-expert-parallel-comm"]
    for combination in COMBINATIONS:
        if combination.world_size == 4:
            start = moe_start if combination.moe else checkpoints.start
            for schedule in SCHEDULES:
                runs[(combination.name, schedule)] = combination.argv(schedule, start)
    found = dict(zip(runs, _pretrain(patched, 4, list(runs.values())), strict=True))
    for key, printed in found.items():
        print(f"\n{key}: {printed}")
    return found


def _assert_as_1f1b(schedule: str, ours: Printed, megatrons: Printed) -> None:
    """zb1p and dualpipev: 1F1B's digits; dualpipe: within a millionth."""
    train, validation = megatrons.losses()
    assert sorted(train) == list(range(2, ITERATIONS + 1))
    assert sorted(validation) == [2, 4]
    if schedule != "dualpipe":
        assert ours.losses() == (train, validation)
        return
    for mine, theirs in zip(ours.losses(), (train, validation), strict=True):
        assert sorted(mine) == sorted(theirs)
        for i, loss in theirs.items():
            assert abs(float(mine[i]) - float(loss)) <= REL_TOL * float(loss), i


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_each_schedule_from_the_shared_checkpoint_as_1f1b(two_ranks: dict, schedule: str) -> None:
    _assert_as_1f1b(schedule, two_ranks[("plain", schedule)], two_ranks[("plain", "1f1b")])


def test_a_dualpipev_checkpoint_resumes_under_1f1b(two_ranks: dict) -> None:
    """Against 1F1B resumed from its own checkpoint of iteration 3: Megatron-LM's resume is
    not bit-exact against the uninterrupted run here (1F1B alone: iteration 5 prints
    4.746881E+00 resumed, 4.733436E+00 uninterrupted), the same under both schedules."""
    uninterrupted = two_ranks[("plain", "1f1b")].losses()[0]
    saved = {s: two_ranks[("saved at 3", s)].losses() for s in ("dualpipev", "1f1b")}
    resumed = {s: two_ranks[("resumed", s)].losses() for s in ("dualpipev", "1f1b")}
    assert saved["dualpipev"] == saved["1f1b"]
    assert saved["1f1b"][0] == {i: uninterrupted[i] for i in (2, 3)}
    assert sorted(resumed["dualpipev"][0]) == [4, 5]
    assert resumed["dualpipev"] == resumed["1f1b"]
    assert resumed["dualpipev"][0][4] == uninterrupted[4]


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
@pytest.mark.parametrize("combination", COMBINATIONS, ids=lambda c: f"{c.name}-{c.world_size}")
def test_each_combination_as_1f1b_with_the_same_flags(
    request: pytest.FixtureRequest, combination: Combination, schedule: str
) -> None:
    found = request.getfixturevalue("two_ranks" if combination.world_size == 2 else "four_ranks")
    megatrons, ours = found[(combination.name, "1f1b")], found[(combination.name, schedule)]
    if combination.refused is not None:
        for printed in (megatrons, ours):
            assert (printed.error, printed.train) == (combination.refused, {})
        return
    _assert_as_1f1b(schedule, ours, megatrons)


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_first_steps_at_pp4_after_megatrons_set_up_as_1f1b(
    four_ranks: dict, schedule: str
) -> None:
    """PP=4 on 4 ranks: Megatron-LM's ``initialize_model_parallel`` with our embedding ranks
    leaves the pipeline's ranks holding different numbers of groups; the steps run on its
    pipeline group, as on a cluster, with 1F1B's losses."""
    _assert_as_1f1b(schedule, four_ranks[("pp4", schedule)], four_ranks[("pp4", "1f1b")])


@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_a_layout_gives_the_digits_of_the_split_it_spells(two_ranks: dict, schedule: str) -> None:
    """``--pipeline-model-parallel-layout`` under our placements (dualpipev's 2 x PP stages,
    which Megatron-LM reads as a virtual pipeline): the layout of the even split gives the
    digits of the run without one."""
    assert two_ranks[("layout", schedule)].losses() == two_ranks[("plain", schedule)].losses()


def _assert_mtp_as_1f1b(schedule: str, ours: Printed, megatrons: Printed) -> None:
    """The lm loss as :func:`_assert_as_1f1b` has it, and the MTP loss the same way."""
    _assert_as_1f1b(schedule, ours, megatrons)
    assert sorted(megatrons.mtp) == list(range(2, ITERATIONS + 1))
    if schedule != "dualpipe":
        assert ours.mtp == megatrons.mtp
        return
    for i, loss in megatrons.mtp.items():
        assert abs(float(ours.mtp[i]) - float(loss)) <= REL_TOL * float(loss), i


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_mtp_as_1f1b(two_ranks: dict, schedule: str) -> None:
    """One MTP layer, dense, fp32: its loss as 1F1B's (the MTP block's copy of the word
    embedding is kept one with the embedding: under 1F1B through Megatron-LM's embedding
    group, which holds the MTP ranks (the script's lacked them, so its 1F1B trained the
    copy apart); under our placements by the rank that holds both)."""
    _assert_mtp_as_1f1b(schedule, two_ranks[("mtp", schedule)], two_ranks[("mtp", "1f1b")])


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_mtp_with_deepseeks_router_as_1f1b(four_ranks: dict, schedule: str) -> None:
    """MoE at EP=2 with the router of NVIDIA's DeepSeek-V3 script (sigmoid scores, expert
    bias, a shared expert, sequence aux loss, fp32 router), one MTP layer, per-token loss,
    selective recomputation: the lm and MTP losses as 1F1B's."""
    ours, megatrons = four_ranks[("deepseek", schedule)], four_ranks[("deepseek", "1f1b")]
    _assert_mtp_as_1f1b(schedule, ours, megatrons)


def test_from_scratch_dualpipev_prints_1f1bs_digits(two_ranks: dict, four_ranks: dict) -> None:
    """No checkpoint: Megatron-LM seeds each pipeline rank apart, and dualpipev's chunks
    get the values 1F1B gives their layers (seeded and built as 1F1B's rank; the dense GPT
    at 2 ranks, and MoE at EP=2 with the DeepSeek router and MTP at 4): the same digits,
    iteration 1 included."""
    for runs, name in ((two_ranks, "fresh"), (four_ranks, "fresh moe mtp")):
        fresh, megatrons = runs[(name, "dualpipev")], runs[(name, "1f1b")]
        assert sorted(megatrons.train) == list(range(1, ITERATIONS + 1)), name
        assert fresh.losses() == megatrons.losses(), name
        assert fresh.mtp == megatrons.mtp, name


def test_mla_on_the_local_spec_as_1f1b(two_ranks: dict) -> None:
    """Multi-latent attention with ``--transformer-impl local``: Megatron's local spec gives
    MLA an attention that takes no ``k_channels`` (the build failed); the script builds
    ``train``'s repaired spec, and dualpipev gives 1F1B's digits."""
    _assert_as_1f1b("dualpipev", two_ranks[("mla", "dualpipev")], two_ranks[("mla", "1f1b")])


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_ep_overlap_gives_the_losses_of_the_same_schedule_without_it(
    four_ranks: dict, schedule: str
) -> None:
    """``--overlap-moe-expert-parallel-comm`` runs each F&B pair through Megatron's schedule
    plans (Megatron-LM's ``forward_step(..., return_schedule_plan=True)``), interleaving the
    two micro-batches layer by layer: the same losses as the pairs run one after the
    other."""
    overlapped = four_ranks[("ep-overlap on", schedule)]
    assert overlapped.losses() == four_ranks[("ep-overlap off", schedule)].losses()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_schedule_in_use_is_logged_once(two_ranks: dict, schedule: str) -> None:
    said = (
        "pipeline schedule: Megatron's own (forward_backward_pipelining_without_interleaving)"
        if schedule == "1f1b"
        else f"pipeline schedule: {schedule} (megatron-dualpipe's)"
    )
    assert two_ranks[("plain", schedule)].schedule_lines == [said]


#: Runs left out of the golden losses: bf16's rounding depends on which of its kernels the
#: CPU has (oneDNN's AVX512-BF16 and AMX paths, or emulation).
NOT_GOLDEN = frozenset(c.name for c in COMBINATIONS if "--bf16" in c.flags)


def _megatrons_losses(found: dict[tuple[str, str], Printed]) -> dict[str, dict[str, dict]]:
    """Each fp32 Megatron 1F1B run that finished: its printed losses by kind and
    iteration."""
    return {
        run: {
            kind: {str(i): loss for i, loss in sorted(losses.items())}
            for kind, losses in (
                ("train", printed.train), ("validation", printed.validation), ("mtp", printed.mtp)
            )
        }
        for (run, schedule), printed in found.items()
        if schedule == "1f1b" and printed.error is None and run not in NOT_GOLDEN
    }  # fmt: skip


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_megatrons_own_1f1b_prints_the_checked_in_losses(
    request: pytest.FixtureRequest, ranks: str
) -> None:
    """The reference every schedule above is held to, held itself: each 1F1B run of a world
    size (the shared checkpoints' first iterations, the plain runs, every fp32 combination,
    from scratch) prints the losses of tests/golden/route_1f1b_losses.json within
    :data:`GOLDEN_REL_TOL`, so a change that moved Megatron's run and ours alike (the data,
    the model's build, the seeds, the CPU compatibility layer) is caught too."""
    found = _megatrons_losses(request.getfixturevalue(ranks))
    if request.config.getoption("--write-golden"):
        golden = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.exists() else {}
        golden[ranks] = found
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        pytest.skip(f"wrote {GOLDEN.name}[{ranks}]: review the diff")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))[ranks]
    assert sorted(found) == sorted(golden)
    for run, kinds in golden.items():
        for kind, losses in kinds.items():
            printed = found[run][kind]
            assert sorted(printed) == sorted(losses), (run, kind)
            for i, loss in losses.items():
                off = abs(float(printed[i]) - float(loss))
                assert off <= GOLDEN_REL_TOL * float(loss), (run, kind, i, printed[i], loss)
