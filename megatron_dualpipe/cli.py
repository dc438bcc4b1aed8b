"""The ``megatron-dualpipe`` command: ``simulate``, ``train``, ``preprocess``,
``make-tokenizer``, ``bench`` and ``patch-megatron-lm``.

Importing this module imports neither torch nor megatron: ``simulate`` is pure Python, and
``train``, ``preprocess`` and ``bench`` import what they need when they run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from . import __version__
from .bench import SECTIONS
from .errors import DualPipeError
from .progress import Progress
from .schedules.comm_plan import LAYOUTS, comm_plan
from .schedules.cost import CostModel
from .schedules.ir import Schedule, ScheduleError
from .schedules.limits import (
    MAX_TIMELINE_SIZE,
    nccl_check_size_problem,
    optimize_size_problem,
    schedule_size,
    size_problem,
)
from .schedules.nccl_rules import EAGER_LIMIT, STREAMS, CommDeadlockError, check_nccl
from .schedules.profile_trace import TraceCosts
from .schedules.registry import SCHEDULES, generate, spec
from .schedules.simulate import SimResult, simulate
from .schedules.validate import check, validate

__all__ = ["main"]

_DEFAULT_COST = "F=1,B=1,W=1"
#: ``simulate --pp`` without --config when not given.
_DEFAULT_PP = 4


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a pipeline schedule under a cost model",
        description="Generate, validate and simulate a schedule; print its figures. With "
        "--config, the balance advisor: derive each stage's costs from the config's model, "
        "simulate, and propose the layer split with the shortest step within the memory cap.",
    )
    p.add_argument(
        "--schedule",
        default=None,
        choices=[*SCHEDULES, "all"],
        help="the schedule to simulate, or all side by side (default: dualpipev; with "
        "--config, the config's pipeline_schedule)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline-parallel ranks (default: 4; with --config, the config's "
        "pipeline_model_parallel_size, changed with --set)",
    )
    p.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches (default: 2 x PP + 2)"
    )
    p.add_argument(
        "--chunks", type=int, default=2, help="stages per rank for interleaved-1f1b (default: 2)"
    )
    p.add_argument(
        "--cost",
        default=_DEFAULT_COST,
        help=f"F, B (dX) and W (dW) times, optionally FB=1.6 or overlap=0.8 for an overlapped "
        f"forward + backward pair (default: {_DEFAULT_COST})",
    )
    p.add_argument(
        "--cost-per",
        choices=["rank", "stage"],
        default=None,
        help="costs are for one rank's share of the model (compare schedules at equal model "
        "size; schedules with more, smaller stages scale them down) or for one stage as given "
        "(default: rank; with --profile: stage, the profile's layer or action)",
    )
    p.add_argument("--latency", type=float, default=0.0, help="time of one P2P hop (default: 0)")
    p.add_argument("--load", type=Path, help="simulate a schedule from a text or JSON file")
    p.add_argument("--grid", action="store_true", help="print a text timeline")
    p.add_argument("--png", type=Path, help="write a PNG timeline")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    p.add_argument("--json", type=Path, help="write the figures and the timeline as JSON")
    p.add_argument("--save", type=Path, help="write the generated schedule in text form")
    p.add_argument(
        "--check-nccl",
        action="store_true",
        help="also run the schedule's communication plan under NCCL's ordering rules "
        "(streams in issue order, receives and large sends hold theirs, the step's data- "
        "and expert-parallel collectives on them too) and name any deadlock cycle; see "
        "docs/runtime.md",
    )
    p.add_argument(
        "--streams",
        choices=STREAMS,
        default="shared",
        help="with --check-nccl: every communicator of a rank on one stream (the worst case, "
        "as PyTorch's stream pool allows) or a stream each (default: shared)",
    )
    p.add_argument(
        "--comm-layout",
        choices=LAYOUTS,
        default="lock-step",
        help="with --check-nccl: the plan the runtime runs (lock-step: one batch per "
        "exchange point on one pipeline communicator) or a design before it (per-channel: "
        "a two-rank communicator per channel; per-kind: one per message kind) "
        "(default: lock-step)",
    )
    p.add_argument(
        "--no-prepost",
        action="store_true",
        help="with --check-nccl and an older layout: receives posted when needed, not one "
        "run ahead",
    )
    p.add_argument(
        "--message-mib",
        type=float,
        default=None,
        metavar="MIB",
        help="with --check-nccl: the size of every message (default: unknown, so every send "
        f"waits for its receive; at most {EAGER_LIMIT // 2**20} MiB a send completes eagerly)",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="balance advisor: a training config (e.g. configs/deepseek_v3_pp16.yaml) whose "
        "model, batch sizes and pipeline settings give the per-stage costs; see docs/advisor.md",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --config: override a config key (repeatable)",
    )
    p.add_argument(
        "--memory-cap",
        type=float,
        default=None,
        metavar="N",
        help="with --config: the most memory a rank may use, in GiB (parameters, gradients, "
        "optimizer state and saved activations); default: the peak of the config's split. "
        "With --optimize: live activations per rank, a whole number of stages x micro-batches "
        "of the schedule's placement; default: the peak of the best hand-made schedule",
    )
    p.add_argument(
        "--optimize",
        action="store_true",
        help="reorder the schedule's work for these costs: start from the best hand-made "
        "schedule of its placement, search within the memory cap and the time limit, and "
        "print before and after with a proven lower bound (see docs/optimizer.md)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=10.0,
        help="with --optimize: seconds to search (default 10)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="TRACE",
        help="take the costs from a PyTorch profiler trace (Chrome JSON, plain or .gz): print "
        "per layer the F, B and W compute, the all-to-all of each direction, an F&B pair's "
        "wall time against its parts and the compute streams' busy share, then simulate on "
        "the cost model they give (in ms; with --config, over the config's split); see "
        "docs/BENCHMARKS.md",
    )


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark every schedule: simulated grid and measured runs",
        description="Simulate every schedule (ours and torch.distributed.pipelining's) on a "
        "grid of PP, micro-batches and cost profiles, then measure ours, Megatron's and "
        "torch's runtimes side by side on sleep-op stages; print tables as it goes.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="about two minutes: PP 4 and 8 in the grid, fewer measured rounds, no separate "
        "torch-peers section",
    )
    p.add_argument("--json", type=Path, help="write every section's figures as JSON")
    p.add_argument("--out", type=Path, help="folder for BENCHMARKS.md and the figures")
    p.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        help="run only this section (repeatable); default: all",
    )


def _add_train(sub: argparse._SubParsersAction) -> None:
    try:
        from .megatron.training.config import config_keys  # pure Python: no torch, no megatron
    except DualPipeError as err:  # an unsupported megatron-core: train says so when run
        keys = f"(not listed here: {err})"
    else:
        keys = ", ".join(key.name for key in config_keys())
    p = sub.add_parser(
        "train",
        help="pretrain a GPT on megatron-core with a pipeline schedule",
        description="Train the model of a YAML config (keys mirror Megatron-LM's flags). "
        "Without torchrun or srun and without a GPU, forks world_size CPU ranks itself.",
        epilog=f"config keys (YAML or --set; each key's meaning and default: python "
        f"scripts/pretrain_gpt_dualpipe.py --help, which takes them as Megatron-LM's flags): "
        f"{keys}",
    )
    p.add_argument("--config", type=Path, required=True, help="e.g. configs/tiny_gpt_cpu.yaml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeatable), e.g. --set pipeline_schedule=1f1b",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile with torch.profiler as Megatron-LM's --profile --use-pytorch-profiler "
        "(the steps after profile_step_start up to profile_step_end, on profile_ranks; set "
        "them with --set): one Chrome trace per profiled rank, a span per pipeline action, "
        "for simulate --profile",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the pipeline ranks' model chunks at full size on the meta device in a "
        "fake world of the config's size (nothing allocated, no GPU) and print per rank the "
        "layers, parameters beside the memory model, process groups and messages",
    )
    p.add_argument(
        "--ranks",
        metavar="R,...",
        help="with --dry-run: the pipeline ranks to build (default: every one)",
    )


def _add_preprocess(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenize a jsonl corpus into Megatron's indexed dataset (.bin/.idx)",
        description='Tokenize every line\'s "text" of a jsonl file with a Hugging Face '
        "tokenizer directory, append the end-of-document token, and write Megatron's indexed "
        "dataset PREFIX_text_document.bin/.idx (what Megatron-LM's tools/preprocess_data.py "
        "writes); train on it with data_path: PREFIX_text_document.",
    )
    p.add_argument("--input", type=Path, required=True, help="the corpus, one JSON object a line")
    p.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        metavar="DIR",
        help="a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)",
    )
    p.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="where to write: PREFIX_KEY_document.bin and .idx for each key (folders are made)",
    )
    _add_json_keys(p, "the keys whose strings are documents, one dataset each")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="tokenizing processes (default 1); the output does not depend on it",
    )
    p.add_argument(
        "--max-document-chars",
        type=int,
        metavar="N",
        help="refuse a document of more characters (default: 4,000,000, about 0.8 GB to tokenize)",
    )


def _run_preprocess(args: argparse.Namespace) -> None:
    from .megatron.known_warnings import silence_known_warnings
    from .megatron.training.preprocess import preprocess  # imports torch and megatron

    silence_known_warnings()
    given = args.max_document_chars
    limit = {} if given is None else {"max_document_chars": given}
    with _unwind_on_stop_signals(), Progress(delay_s=0.5) as bar:
        bar.phase(f"tokenizing {args.input}")
        began = time.monotonic()

        def progress(done: int, total: int) -> None:
            seconds = max(time.monotonic() - began, 1e-9)
            bar.total, bar.done = total, done
            bar.note = f"{done / seconds / 1e6:.1f} MB/s"

        result = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            json_keys=args.json_keys,
            workers=args.workers,
            progress=progress,
            **limit,
        )
    seconds = max(result.seconds, 1e-9)
    for written in result.written:
        print(
            f"wrote {written.prefix}.bin and {written.prefix}.idx: {written.documents:,} "
            f"documents, {written.tokens:,} tokens (each document ends in the end-of-document "
            f"token); train on it with data_path: {written.prefix}"
        )
    print(
        f"{result.bytes_read / 1e6:,.1f} MB in {result.seconds:.1f} s with {result.workers} "
        f"worker(s): {result.written[0].documents / seconds:,.0f} documents/s, "
        f"{result.bytes_read / seconds / 1e6:.1f} MB/s"
    )


def _add_json_keys(p: argparse.ArgumentParser, what: str) -> None:
    """Megatron-LM's ``--json-keys`` (default: text)."""
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], metavar="KEY", help=f"{what} (default: text)"
    )


def _add_make_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tokenizer",
        help="train a byte-level BPE tokenizer on a corpus, offline, for preprocess and train",
        description="Train a byte-level BPE (GPT-2's recipe, with the tokenizers library) on "
        "the documents of a jsonl corpus (or a .txt file, a document a line) and save it with "
        "transformers' save_pretrained: the directory preprocess --tokenizer and train's "
        "tokenizer_model take. Nothing is downloaded.",
    )
    p.add_argument("--input", type=Path, required=True, help="the corpus (jsonl, or .txt)")
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="the tokenizer folder")
    p.add_argument("--vocab-size", type=int, default=32000, metavar="N", help="default 32000")
    _add_json_keys(p, "the keys whose strings are documents")
    p.add_argument("--eod", default="<|endoftext|>", metavar="TOKEN", help="its end-of-document "
                   "token (default: <|endoftext|>)")  # fmt: skip
    p.add_argument("--min-frequency", type=int, default=0, metavar="N", help="the fewest "
                   "occurrences of a pair merged (default: the tokenizers library's)")  # fmt: skip


def _run_make_tokenizer(args: argparse.Namespace) -> None:
    from .megatron.training.make_tokenizer import make_tokenizer

    with _unwind_on_stop_signals(), Progress(delay_s=0.5) as bar:
        bar.phase(f"training a BPE on {args.input}")
        options = {k: getattr(args, k) for k in ("vocab_size", "json_keys", "eod", "min_frequency")}
        made = make_tokenizer(args.input, args.output, **options)
    print(
        f"wrote {made.directory}: a byte-level BPE of {made.vocab_size:,} tokens trained on "
        f"{made.documents:,} documents, end-of-document token {args.eod}; use it with "
        f"preprocess --tokenizer {made.directory} and train's tokenizer_model: {made.directory}"
    )


def _add_patch_megatron_lm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "patch-megatron-lm",
        help="make the patched megatron/training of the installed megatron-core wheel",
        description="Copy the megatron/training that the installed megatron-core wheel ships "
        "(0.17 and newer) to OUT/megatron/training and apply the megatron/training hunks of "
        "the patch of its Megatron-LM tag (patches/megatron-lm-<tag>.patch). With OUT first "
        "on PYTHONPATH, scripts/pretrain_gpt_megatron_lm.py runs Megatron-LM's pretrain() "
        "with --pipeline-schedule.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("megatron-lm-patched"),
        metavar="DIR",
        help="where to write megatron/training (default: ./megatron-lm-patched)",
    )


def _run_patch_megatron_lm(args: argparse.Namespace) -> None:
    from .megatron.lm_patch import make_patched_training  # reads files: imports no megatron

    training, patch = make_patched_training(args.out)
    out = args.out.resolve()
    print(
        f"wrote {training}, patched with {patch.name}; run Megatron-LM's loop with it first on "
        f"the path: PYTHONPATH={out} torchrun --nproc-per-node N "
        "scripts/pretrain_gpt_megatron_lm.py --pipeline-schedule dualpipev ..."
    )


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (a closed terminal or ssh session) arrived: unwind like Ctrl-C,
    so the embedded launcher kills its ranks."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated(signum)


#: Signals ``train`` and ``preprocess`` unwind on, as on Ctrl-C, unless started with them
#: ignored.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _unwind_on_stop_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`_Terminated` (Ctrl-C's unwinding:
    launched ranks killed, partial files removed), unless the command was started with them
    ignored; the previous handlers are back on leaving it."""
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler != signal.SIG_IGN:  # nohup's SIGHUP stays ignored: the run goes on
            signal.signal(signum, _terminate)
    try:
        yield
    finally:  # a signal while the error is printed must not interrupt the printing
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run_dry_run(args: argparse.Namespace) -> None:
    from .megatron.known_warnings import silence_known_warnings

    silence_known_warnings()
    from .megatron.training import load_config
    from .megatron.training.config import config_source
    from .megatron.training.dry_run import dry_run, dry_run_lines, parse_ranks

    cfg = load_config(args.config, args.overrides)
    ranks = parse_ranks(args.ranks, cfg.pipeline_model_parallel_size)
    source = config_source(args.config, args.overrides)
    print("\n".join(dry_run_lines(dry_run(cfg, ranks, source=source))))


def _run_train(args: argparse.Namespace) -> None:
    if args.dry_run:
        _run_dry_run(args)
        return
    from .megatron.training import ConfigError, load_config, train  # train imports torch
    from .megatron.training.config import config_source

    if args.ranks is not None:
        raise ConfigError("--ranks chooses the ranks of a dry run: add --dry-run")
    profiling = ["profile=true", "use_pytorch_profiler=true"] if args.profile else []
    overrides = [*profiling, *args.overrides]
    with _unwind_on_stop_signals():
        train(load_config(args.config, overrides), source=config_source(args.config, overrides))


def _load(path: Path) -> Schedule:
    """The schedule in ``path`` (text form, or JSON for ``.json``); one sentence for a file
    that cannot be read or holds no schedule."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ScheduleError(f"--load: cannot read {path} ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ScheduleError(
            f"--load: {path} is not a schedule (not UTF-8 text): write one with simulate --save"
        ) from None
    if path.suffix != ".json":
        try:
            return Schedule.from_text(text)
        except ScheduleError as err:
            raise ScheduleError(
                f"--load: {path} is not a schedule ({err}): write one with simulate --save"
            ) from None
    try:
        return Schedule.from_json(json.loads(text))
    except json.JSONDecodeError as err:
        raise ScheduleError(
            f"--load: {path} is not JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ScheduleError(
            f"--load: {path} holds JSON but not a schedule ({type(err).__name__}: {err}): "
            "write one with simulate --json"
        ) from None


def _check_outputs(paths: dict[str, Path | None]) -> None:
    """Refuse, before any work, an output (flag: path) this process cannot create: its
    folder missing or unwritable, or the path a folder."""
    for flag, path in paths.items():
        if path is None:
            continue
        if path.is_dir():
            raise ScheduleError(f"{flag}: {path} is a folder: name a file in it")
        probe = path.parent / f".{path.name}.{os.getpid()}.probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ScheduleError(
                f"{flag}: cannot write {path} ({err.strerror or err}): name a file in a folder "
                "you can write to"
            ) from None


def _check_size(args: argparse.Namespace, mbs: int) -> None:
    """Refuse, before any work, what this command cannot simulate in a minute and 2 GB."""
    problem = size_problem(args.pp, mbs, args.chunks, doing="to simulate here")
    if problem is not None:
        raise ScheduleError(f"{problem}: lower --pp or --microbatches")
    wanted = [f"--{name}" for name in ("json", "png", "trace", "grid") if getattr(args, name)]
    if wanted and schedule_size(args.pp, mbs, args.chunks) > MAX_TIMELINE_SIZE:
        raise ScheduleError(
            f"{', '.join(wanted)} keep every action's times, several GB at PP={args.pp} x {mbs} "
            f"micro-batches: drop {'them' if len(wanted) > 1 else 'it'} for the figures alone, "
            f"or keep PP x micro-batches at most {MAX_TIMELINE_SIZE:,}"
        )


def _cost_for(schedule: Schedule, args: argparse.Namespace) -> CostModel:
    """The cost model of ``--cost`` and ``--latency`` for ``schedule``'s stages."""
    cost = CostModel.parse(args.cost, latency=args.latency)
    if (args.cost_per or ("stage" if args.profile else "rank")) == "rank":
        p = schedule.placement
        cost = cost.per_stage(p.num_ranks, p.num_model_stages)
    return cost


def _simulate_one(schedule: Schedule, args: argparse.Namespace, bar: Progress) -> SimResult:
    if args.load or schedule.num_ranks * schedule.num_microbatches <= MAX_TIMELINE_SIZE:
        bar.phase(f"checking {schedule.name}", total=schedule.num_ranks)
        # The simulation below is the dry run.
        check(schedule, dry_run=False, progress=partial(setattr, bar, "done"))
    bar.phase(f"simulating {schedule.name}", total=sum(map(len, schedule.ranks)))
    timeline = any((args.grid, args.png, args.trace, args.json))
    progress = partial(setattr, bar, "done")
    return simulate(schedule, _cost_for(schedule, args), timeline=timeline, progress=progress)


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Schedules are millions of acyclic tuples: the cyclic collector would walk them over
    and over (twice the time at PP=1000) and find nothing."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _suffixed(path: Path, name: str, many: bool) -> Path:
    return path.with_name(f"{path.stem}_{name}{path.suffix}") if many else path


def _check_distinct_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, two output flags naming one file (one would replace the
    other without a word)."""
    given = [(f"--{n}", getattr(args, n)) for n in ("png", "trace", "json", "save")]
    seen: dict[Path, str] = {}
    for flag, path in given:
        if path is None:
            continue
        where = Path(path).resolve()
        if where in seen:
            raise ScheduleError(
                f"{seen[where]} and {flag} both name {path}: one would overwrite the other; "
                "give each its own file"
            )
        seen[where] = flag


def _write_outputs(
    results: list[SimResult], args: argparse.Namespace, extra: dict | None = None
) -> None:
    from .schedules.export import to_grid, to_png, write_chrome_trace

    many = len(results) > 1
    for r in results:
        name = r.schedule.name
        if args.grid:
            print(to_grid(r))
        if args.png:
            to_png(r, str(_suffixed(args.png, name, many)))
            print(f"wrote {_suffixed(args.png, name, many)}")
        if args.trace:
            write_chrome_trace(r, str(_suffixed(args.trace, name, many)))
            print(f"wrote {_suffixed(args.trace, name, many)}")
    if args.json:
        payload = [r.to_json() for r in results]
        if extra and many:
            payload = {**extra, "schedules": payload}
        elif extra:
            payload[0].update(extra)
        args.json.write_text(json.dumps(payload if many else payload[0]), encoding="utf-8")
        print(f"wrote {args.json}")


class _StatusLine:
    """One line of progress on stderr, rewritten in place, when stderr is a terminal and
    ``CI`` is unset; silent otherwise. Call :meth:`clear` before printing results."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty() and not os.environ.get("CI")
        self.last = 0.0

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.enabled and now - self.last > 0.1:
            self.last = now
            sys.stderr.write(f"\r\x1b[K{text[: shutil.get_terminal_size().columns - 1]}")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _run_advisor(args: argparse.Namespace) -> None:
    """``simulate --config``: the balance advisor (pure Python, as the rest of simulate)."""
    from .schedules.advisor import GIB, PipelineSetup, advise
    from .schedules.config_values import override_origins, read_values
    from .schedules.memory import MemorySettings
    from .schedules.model_cost import ModelShape
    from .schedules.nccl_memory import NcclBuffers
    from .schedules.report import advice_report, memory_report, nccl_memory_report

    if args.pp is not None:
        raise ScheduleError(
            f"--pp does not apply with --config (the advisor runs the config's "
            f"pipeline_model_parallel_size): drop it, or set --set "
            f"pipeline_model_parallel_size={args.pp}"
        )
    others = {"--load": args.load, "--grid": args.grid, "--trace": args.trace, "--save": args.save}
    given = [flag for flag, value in others.items() if value]
    if given or args.latency or args.cost != _DEFAULT_COST or args.schedule == "all":
        flag = given[0] if given else "--schedule all" if args.schedule == "all" else "--cost"
        raise ScheduleError(
            f"{flag} does not apply with --config (the advisor takes one schedule and derives "
            "its costs from the model): drop it"
        )
    source, origins = override_origins(args.config, args.overrides)
    values = {**_train_defaults(), **read_values(args.config, args.overrides)}
    shape = ModelShape.from_values(values, source, origins)
    setup = PipelineSetup.from_values(values, source, origins)
    settings = MemorySettings.from_values(values, source, origins)
    status = _StatusLine()
    try:
        advice = advise(
            shape,
            setup,
            schedule=args.schedule,
            microbatches=args.microbatches,
            memory_cap=None if args.memory_cap is None else args.memory_cap * GIB,
            settings=settings,
            progress=status,
        )
    finally:
        status.clear()
    print(advice_report(advice, shape.summary(), source))
    print(memory_report(advice, setup, settings))
    print(nccl_memory_report(advice.schedule, NcclBuffers.from_env(os.environ)))
    problem = _train_refuses(args, advice.changes())
    if problem:
        print(f"note: megatron-dualpipe train does not take the config with these lines: {problem}")
    _write_advice(advice, args)


def _train_defaults() -> dict:
    """The trainer's defaults for the keys it has (its config module imports no torch), so
    that the advisor models what ``train`` builds."""
    import dataclasses

    from .megatron.training.config import TrainConfig

    return {
        f.name: f.default
        for f in dataclasses.fields(TrainConfig)
        if f.default is not dataclasses.MISSING
    }


def _train_refuses(args: argparse.Namespace, changes: dict) -> str | None:
    """Why ``train``'s config loader refuses the config with ``changes``, or None."""
    from .megatron.training.config import ConfigError, load_config

    applied = [
        f"{k}={'null' if v is None else str(v).lower() if v is False else v}"
        for k, v in changes.items()
    ]
    try:
        load_config(args.config, [*args.overrides, *applied])
    except ConfigError as err:
        return str(err)
    return None


def _write_advice(advice, args: argparse.Namespace) -> None:
    from .schedules.export import to_png

    if args.png:
        for label, candidate in (("before", advice.before), ("after", advice.after)):
            path = _suffixed(args.png, label, True)
            title = f"{advice.schedule.name}, {label}"
            to_png(advice.simulate(candidate), str(path), title=title, unit="FLOP")
            print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps(advice.to_json()), encoding="utf-8")
        print(f"wrote {args.json}")


def _run_optimize(args: argparse.Namespace, extra: dict | None = None) -> None:
    """``simulate --optimize``: optimise one schedule's placement and report it."""
    from .schedules.optimize import optimize, summary, summary_json  # imports SciPy

    cap = args.memory_cap
    if cap is not None and (cap != int(cap) or cap < 1):
        raise ScheduleError(
            f"with --optimize, --memory-cap is a whole number of activations per rank, got {cap}"
        )
    if args.load:
        base = _load(args.load)
        validate(base, dry_run=False)
    elif args.schedule == "all":
        raise ScheduleError("--optimize takes one schedule: name it with --schedule, not all")
    else:
        too_large = optimize_size_problem(args.pp, _microbatches(args), args.chunks)
        if too_large is not None:
            raise ScheduleError(f"{too_large}: lower --pp or --microbatches")
        try:
            base = _generate(args.schedule or "dualpipev", args, _microbatches(args))
        except ScheduleError as err:
            raise ScheduleError(f"{err}: change --microbatches or --pp") from None
    p = base.placement
    print(
        f"optimising the {p.kind} placement of {base.name}: PP={p.num_ranks} "
        f"micro-batches={p.num_microbatches} stages={p.num_stages}, time limit "
        f"{args.time_limit:g} s"
    )
    result = optimize(
        p,
        _cost_for(base, args),
        memory_cap=None if cap is None else int(cap),
        time_limit=args.time_limit,
        warm_starts=[base.compute_only()] if args.load else (),
        progress=lambda line: print(f"  {line}", flush=True),
        generated=() if args.load else [base],
        timeline=any((args.grid, args.png, args.trace, args.json)),
    )
    from .schedules.report import rank_table

    one_f_one_b = generate("1f1b", p.num_ranks, p.num_microbatches)
    reference = simulate(one_f_one_b, _cost_for(one_f_one_b, args), timeline=False)
    print(summary(result, reference))
    print(rank_table(result.result))
    _write_outputs([result.result], args, {**summary_json(result, reference), **(extra or {})})
    if args.save:
        args.save.write_text(result.schedule.to_text(), encoding="utf-8")
        print(f"wrote {args.save}")


def _read_profile(args: argparse.Namespace) -> TraceCosts:
    """``--profile``: read the trace, print its figures, and make its cost model the
    ``--cost`` of what follows."""
    from .schedules.profile_trace import read_profile

    if args.cost != _DEFAULT_COST:
        raise ScheduleError("--cost and --profile both give the costs: drop one")
    if args.load and args.config:
        raise ScheduleError("--load does not apply with --profile and --config: drop it")
    profile = read_profile(args.profile)
    print(profile.report())
    args.cost = profile.cost_text()
    return profile


def _run_profile_config(args: argparse.Namespace, profile: TraceCosts) -> None:
    """``simulate --profile --config``: the profile's costs over the config's split, for
    the config's schedule or every schedule (ours, Megatron's, torch's), in ms."""
    from .bench.catalog import SCHEDULES as ENTRIES
    from .schedules.advisor import PipelineSetup
    from .schedules.config_values import override_origins, read_values
    from .schedules.model_cost import ModelShape
    from .schedules.profile_config import config_costs
    from .schedules.profile_report import ProfileRow, deepseek_bubble, profile_table

    if args.optimize or args.memory_cap is not None:
        raise ScheduleError(
            "--optimize and --memory-cap do not apply with --profile and --config: drop them "
            "(or --config, to optimise on the profile's costs)"
        )
    source, origins = override_origins(args.config, args.overrides)
    values = {**_train_defaults(), **read_values(args.config, args.overrides)}
    shape = ModelShape.from_values(values, source, origins)
    setup = PipelineSetup.from_values(values, source, origins)
    pp = setup.pipeline_model_parallel_size
    mbs = args.microbatches or setup.num_microbatches
    wanted = [args.schedule or setup.pipeline_schedule] if args.schedule != "all" else None
    rows = []
    for entry in ENTRIES:
        if wanted is not None and entry.name not in wanted:
            continue
        try:
            schedule = entry.build(pp, mbs)
            validate(schedule)
        except ScheduleError as err:
            rows.append(ProfileRow(entry.name, entry.source, note=str(err)))
            continue
        except ModuleNotFoundError as err:  # torch's schedules, where torch is not installed
            rows.append(ProfileRow(entry.name, entry.source, note=f"needs {err.name}"))
            continue
        costs = config_costs(profile, shape, setup, schedule.placement, args.latency)
        result = simulate(schedule, costs.cost)
        rows.append(ProfileRow.of(entry.name, entry.source, result, costs))
    if not rows:
        raise ScheduleError(f"{wanted[0]} is not a schedule here: see --schedule's choices")
    print(f"{source}: PP={pp}, {mbs} micro-batches, the profile's costs in ms")
    print(profile_table(rows))
    formula = deepseek_bubble(rows, pp)
    if formula:
        print(formula["line"])
    if args.json:
        payload = {
            **profile.to_json(),
            "pp": pp,
            "microbatches": mbs,
            "schedules": [r.to_json() for r in rows],
        }
        if formula:
            payload["deepseek_formula"] = {k: v for k, v in formula.items() if k != "line"}
        args.json.write_text(json.dumps(payload), encoding="utf-8")
        print(f"wrote {args.json}")


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse, before any work, a number flag that is not finite or out of its range."""
    for flag in ("pp", "microbatches", "chunks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ScheduleError(f"--{flag} must be a whole number >= 1, got {value}")
    one = args.schedule not in (None, "all") and spec(args.schedule).chunks is None
    if one and args.chunks < 2:
        raise ScheduleError(
            f"{args.schedule} needs --chunks >= 2 (use 1f1b for one chunk), got {args.chunks}"
        )
    ranges = {
        "latency": (0.0, False),
        "time_limit": (0.0, True),
        "memory_cap": (0.0, True),
        "message_mib": (0.0, False),
    }
    for name, (least, strictly) in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        if not math.isfinite(value) or value < least or (strictly and value == least):
            bound = f"{'>' if strictly else '>='} {least:g}"
            flag = "--" + name.replace("_", "-")
            raise ScheduleError(f"{flag} must be a finite number {bound}, got {value}")


def _run_simulate(args: argparse.Namespace) -> None:
    _check_numbers(args)
    _check_distinct_outputs(args)
    _check_outputs({f"--{n}": getattr(args, n) for n in ("png", "trace", "json", "save")})
    profile = _read_profile(args) if args.profile else None
    extra = None if profile is None else profile.to_json()
    if profile is not None and args.config:
        _run_profile_config(args, profile)
        return
    if args.config:
        if args.optimize:
            raise ScheduleError(
                "--optimize does not apply with --config (the advisor chooses the layer split, "
                "the optimiser reorders a schedule's work): drop one"
            )
        _run_advisor(args)
        return
    args.pp = _DEFAULT_PP if args.pp is None else args.pp
    if args.optimize:
        with _no_cyclic_gc():
            _run_optimize(args, extra)
        return
    if args.overrides or args.memory_cap is not None:
        raise ScheduleError(
            "--set and --memory-cap apply to the advisor: add --config CONFIG (or, for "
            "--memory-cap, --optimize)"
        )
    args.schedule = args.schedule or "dualpipev"
    if args.check_nccl and not args.load:
        too_large = nccl_check_size_problem(args.pp, _microbatches(args), args.chunks)
        if too_large is not None:
            raise ScheduleError(f"{too_large}: lower --pp or --microbatches")
    with _no_cyclic_gc(), Progress() as bar:
        schedules, skipped = _schedules(args, bar)
        results = [_simulate_one(s, args, bar) for s in schedules]
    _report(results, skipped, schedules, args, extra)
    if args.check_nccl:
        _check_nccl(schedules, args)


def _check_nccl(schedules: list[Schedule], args: argparse.Namespace) -> None:
    """``--check-nccl``: each schedule's communication plan under NCCL's rules."""
    from .schedules.report import nccl_line

    size = None if args.message_mib is None else int(args.message_mib * 2**20)
    failed = []
    for schedule in schedules:
        plan = comm_plan(
            schedule, layout=args.comm_layout, prepost=not args.no_prepost, message_bytes=size
        )
        try:
            outcome = check_nccl(plan, streams=args.streams)
        except CommDeadlockError as err:
            outcome = err
            failed.append(schedule.name)
        print(nccl_line(schedule.name, plan, size, args.streams, outcome))
    if failed:
        raise ScheduleError(
            f"{', '.join(failed)} would deadlock on NCCL with the {args.comm_layout} plan "
            f"and {args.streams} streams: see the cycle above"
        )


def _microbatches(args: argparse.Namespace) -> int:
    """``--microbatches``, by default 2 PP + 2."""
    return args.microbatches if args.microbatches is not None else 2 * args.pp + 2


def _generate(name: str, args: argparse.Namespace, mbs: int) -> Schedule:
    """Schedule ``name`` at ``--pp`` and ``mbs`` micro-batches (``--chunks`` where the
    schedule's chunk count is not fixed)."""
    options = {"chunks": args.chunks} if spec(name).chunks is None else {}
    return generate(name, args.pp, mbs, **options)


def _schedules(args: argparse.Namespace, bar: Progress) -> tuple[list[Schedule], dict[str, str]]:
    """The schedules to simulate, and why any of ``--schedule all`` do not apply."""
    if args.load:
        bar.phase(f"reading {args.load}")
        return [_load(args.load)], {}
    mbs = _microbatches(args)
    _check_size(args, mbs)
    names = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    schedules, skipped = [], {}
    for name in names:
        bar.phase(f"generating {name} for PP={args.pp} x {mbs} micro-batches")
        try:
            schedules.append(_generate(name, args, mbs))
        except ScheduleError as err:
            if len(names) == 1:
                raise ScheduleError(f"{err}: change --microbatches or --pp") from None
            skipped[name] = str(err)
    return schedules, skipped


def _report(
    results: list[SimResult],
    skipped: dict[str, str],
    schedules: list[Schedule],
    args: argparse.Namespace,
    extra: dict | None = None,
) -> None:
    """Print the table and write the files asked for (``extra``: more figures for --json)."""
    from .schedules.report import comparison_table, rank_table

    if len(results) == 1:
        print(rank_table(results[0]))
    else:
        print(comparison_table(results, skipped))
    _write_outputs(results, args, extra)
    if args.save:
        args.save.write_text(schedules[0].to_text(), encoding="utf-8")
        print(f"wrote {args.save}")


def _run_bench(args: argparse.Namespace) -> None:
    from .bench import run  # the bench sections import torch only when they run

    _check_outputs({"--json": args.json})
    if args.out is not None:
        if args.out.exists() and not args.out.is_dir():
            raise ScheduleError(
                f"--out: {args.out} is a file: name a folder for BENCHMARKS.md and the figures"
            )
        _check_outputs({"--out": args.out / "BENCHMARKS.md"} if args.out.is_dir() else {})
    sections = tuple(args.only) if args.only else None
    run(quick=args.quick, json_path=args.json, out_dir=args.out, sections=sections)


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: this process's command line) and return its
    exit status. Run as the command, it leaves its objects out of the interpreter's last
    garbage collections (``gc.freeze``): torch's and Megatron's module graphs made the exit
    take 4 to 10 s on a loaded machine, after the work was done."""
    code = _main(argv)
    if argv is None:
        gc.freeze()
    return code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-dualpipe",
        description="DualPipe and DualPipeV pipeline schedules for Megatron-Core: simulate a "
        "schedule, train a GPT with one, benchmark them all. Each command's --help says more.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)
    _add_train(sub)
    _add_preprocess(sub)
    _add_make_tokenizer(sub)
    _add_bench(sub)
    _add_patch_megatron_lm(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "simulate":
            _run_simulate(args)
        elif args.command == "train":
            _run_train(args)
        elif args.command == "preprocess":
            _run_preprocess(args)
        elif args.command == "make-tokenizer":
            _run_make_tokenizer(args)
        elif args.command == "bench":
            _run_bench(args)
        elif args.command == "patch-megatron-lm":
            _run_patch_megatron_lm(args)
    except KeyboardInterrupt:
        # The embedded launchers kill every rank they started on the way out.
        print(f"megatron-dualpipe: {args.command} interrupted", file=sys.stderr)
        return 130
    except _Terminated as stop:
        name = signal.Signals(stop.signum).name
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"megatron-dualpipe: {args.command} terminated ({name})", file=sys.stderr)
        return 128 + stop.signum
    except BrokenPipeError:  # the reader of our output went away (| head)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the interpreter's final flush
        return 1
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in ("torch", "megatron"):
            raise
        print(
            f"megatron-dualpipe: error: {args.command} needs torch and megatron-core, and "
            f"{err.name} is not installed: from the megatron-dualpipe checkout (it is not on "
            "PyPI), pip install -e '.[megatron]' (or install your own CUDA build of torch "
            "first)",
            file=sys.stderr,
        )
        return 2
    except (DualPipeError, OSError) as err:
        print(f"megatron-dualpipe: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
