"""The "On DeepSeek's H800 costs" section of docs/BENCHMARKS.md, from DeepSeek's published
training profile, by this project's own commands.

    git clone https://github.com/deepseek-ai/profile-data    # train.json: no licence, so
    python bench/deepseek_h800.py profile-data/train.json    # it is read, never committed

runs ``megatron-dualpipe simulate --profile TRACE`` (the per-layer figures) and
``simulate --profile TRACE --config configs/deepseek_v3_pp16.yaml --schedule all`` at the
config's 120 micro-batches and at 32, 64 and 128 (and at PP=8, with ``--set``, at 32, 64
and 128), and writes their output into the section
(replacing the one there; ``python -m bench --out docs`` keeps it). ``--print`` writes the
section to stdout instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.suite import DEEPSEEK_TITLE, replace_section  # noqa: E402

CONFIG = "configs/deepseek_v3_pp16.yaml"
MICROBATCHES = (120, 32, 64, 128)
#: An H800's 80 GB, in GiB: the memory cap of every split.
MEMORY_CAP_GIB = 74.5
#: The second profile: the same model at PP=8, 8 + 6 x 8 + 5 layers as the config's split.
PP8_SETS = (
    "pipeline_model_parallel_size=8",
    "decoder_first_pipeline_num_layers=8",
    "decoder_last_pipeline_num_layers=5",
)
PP8_MICROBATCHES = (32, 64, 128)
#: The schedules the compute-bound paragraph names, beside the fastest.
NAMED = ("dualpipev", "dualpipe", "interleaved-1f1b-a2a")


def _run(args: list[str], trace: Path) -> tuple[str, dict]:
    """One ``megatron-dualpipe`` command with ``$TRACE`` for the trace: its stdout (less
    the ``wrote`` line) and its ``--json`` figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        argv = [str(trace) if a == "$TRACE" else a for a in args] + ["--json", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "megatron_dualpipe", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        figures = json.loads(out.read_text(encoding="utf-8"))
    lines = [line for line in done.stdout.splitlines() if not line.startswith("wrote ")]
    return "\n".join(lines).replace(str(trace), "$TRACE"), figures


def _command(args: list[str]) -> str:
    return "megatron-dualpipe " + " ".join(args)


def _phase_table(phases: dict) -> str:
    rows = ["| phase | GPU ms | count | by stream | CPU ms |", "|:--|--:|--:|:--|--:|"]
    for name, p in phases.items():
        streams = ", ".join(f"{k}: {v:.3f}" for k, v in p["streams"].items())
        rows.append(f"| {name} | {p['ms']:.3f} | {p['count']} | {streams} | {p['cpu_ms']:.3f} |")
    return "\n".join(rows)


def _bound_paragraph(rows: dict[int, list[dict]]) -> str:
    """Each micro-batch count's compute bound, the fastest schedule's step over it and
    the :data:`NAMED` schedules', and where dualpipev's rest goes."""
    lines = []
    for m, found in sorted(rows.items()):
        by_name = {r["schedule"]: r for r in found}
        best = min(found, key=lambda r: r["step_ms"])
        bound = best["compute_bound_ms"]
        named = ", ".join(
            f"{n} {by_name[n]['step_ms'] / bound:.2f}x" for n in NAMED if n in by_name
        )
        v = by_name.get("dualpipev")
        rest = ""
        if v is not None:
            exposed = sum(v["exposed_a2a_ms"]) / len(v["exposed_a2a_ms"])
            idle = sum(v["idle_ms"]) / len(v["idle_ms"])
            split = v["split_bound_ms"]
            rest = (
                f"; dualpipev's rank waits on average {exposed:.0f} ms for all-to-all and "
                f"idles {idle:.0f} ms; its split's bound {split:.0f} ms ({split / bound:.2f}x "
                f"the even one), its step {v['step_ms'] / split:.2f}x that"
            )
        megatron = by_name.get("interleaved-1f1b-a2a")
        if v is not None and megatron is not None:
            rest += (
                f"; dualpipev over Megatron's interleaved-1f1b-a2a: "
                f"{v['step_ms'] / megatron['step_ms']:.3f}"
            )
        lines.append(
            f"- {m} micro-batches: bound {bound:.0f} ms; fastest {best['schedule']} at "
            f"{best['step_ms'] / bound:.2f}x it ({100 * bound / best['step_ms']:.0f}% of the "
            f"bound); {named}{rest}."
        )
    return (
        "Against the compute bound (the `bound (ms)` and `vs bound` columns: the step's "
        "F, B and W compute without their all-to-all, shared evenly over the 16 ranks, "
        "what no schedule and no split can beat; docs/schedules.md says how it is "
        "counted):\n\n" + "\n".join(lines) + "\n\nNo schedule comes near it yet: "
        "a pass outside an F&B pair waits for its own all-to-all (the `exposed a2a` "
        "column: the warm-up, the cool-down and the V's turn run lone passes), and ranks "
        "idle where the split cannot even out the embedding, the heads, the MTP block "
        "and the loss at layer granularity within the memory cap (the idle ranges). The "
        "`split bound` columns separate the two: the busiest rank's compute on the split a "
        "row runs, what no schedule beats on that split; a row's step over it is what its "
        "schedule costs, the split's bound over the even bound what its split costs (in the "
        "V, rank 0 holds the embedding, the MTP block, both heads and the losses)."
    )


def section(trace: Path) -> str:
    """The section's markdown."""
    layer_args = ["simulate", "--profile", "$TRACE", "--schedule", "dualpipe", "--pp", "16"]
    layer_args += ["--microbatches", "32"]
    layer_text, layer = _run(layer_args, trace)
    report = layer_text.split("\ndualpipe:")[0]
    parts = [
        "DeepSeek published a PyTorch profiler trace of DualPipe's overlapped forward and "
        "backward pair on an H800 (github deepseek-ai/profile-data, `train.json`: two 4-layer "
        "MoE chunks of DeepSeek-V3, EP64, TP1, 4K sequence, balanced routing, no pipeline "
        "communication). `simulate --profile` reads its phase spans (`attn(F)`, `mlp(B)`, "
        "`dispatch(F)`, `combine(B)`, ...), and for each the GPU kernels its launches started, "
        "stream by stream. The trace is not in this repository (it has no licence); this "
        "section is written by `python bench/deepseek_h800.py TRACE` with "
        "TRACE=profile-data/train.json.",
        f"**Per layer**, `{_command(layer_args)}` (its profile figures):",
        f"```\n{report}\n```",
        "Each phase as the trace spells it (its `--json` `phases`): GPU ms per occurrence, "
        "occurrences, ms by stream, the span's own CPU ms:",
        _phase_table(layer["phases"]),
    ]
    per = layer["per_unit"]
    parts.append(
        f"F is the forward's compute ({per['F']:.2f} ms) with its all-to-all "
        f"({per['a2a_forward']:.2f} ms: a lone forward waits for its own), B the input "
        f"gradient's ({per['B']:.2f} ms) with its all-to-all ({per['a2a_backward']:.2f} ms), "
        f"W the weight gradient's. The pair takes {per['pair_wall']:.2f} ms a layer against "
        f"{per['pair_parts']:.2f} ms of parts: the all-to-all hides behind compute entirely "
        f"(the pair is no longer than its compute alone, "
        f"{per['F'] + per['B'] + per['W']:.2f} ms), and the compute streams are busy "
        f"{100 * per['compute_busy']:.0f}% of it. Kernel times of DeepEP's kernels include "
        "their waits for the other ranks, so the all-to-all figures are upper bounds."
    )
    formulas = []
    rows: dict[int, list[dict]] = {}
    for m in MICROBATCHES:
        tables, figures = _tables(trace, 16, m, ())
        parts += tables
        formulas.append((m, figures["deepseek_formula"]))
        rows[m] = [r for r in figures["schedules"] if r["step_ms"] is not None]
    f = formulas[0][1]
    chunk = f["chunk_ms"]
    idle = {m: x["simulated_idle_ms"] for m, x in formulas}
    parts.append(
        "How to read it. Stages compute for their FLOPs at the profiled layer's compute ms "
        "per FLOP (a stage of four MoE layers is four profiled layers; the embedding, the "
        "output layer, the MTP block and the loss at the same rate), and their MoE layers "
        "(the MTP block's included) exchange tokens for the profiled layer's all-to-all each: "
        "a lone pass waits for its own, an F&B pair lasts as long as the busier of its "
        "compute and its all-to-all (on the profiled pair: "
        f"{max(per['F'] + per['B'] + per['W'], per['a2a_forward'] + per['a2a_backward']):.2f} "
        f"ms against its measured {per['pair_wall']:.2f} ms). Each schedule runs the split "
        "the balance advisor finds for it on those "
        "times (`split`: advised), within 74.5 GiB (80 GB) per rank by the memory model, "
        "Megatron's and torch's at the split found for them, each under its own order; the "
        "config's split (4 + 14 x 4 + 1 layers) where none is faster (`config's`). Megatron's "
        "interleaved 1F1B with its all-to-all overlap is tried at 2, 3 and 4 virtual stages "
        "per rank, each at its own advised split, and its row is the fastest (the line under "
        "each table says what the others took: 2 was the fastest at every count here); it "
        "needs the micro-batches to be a multiple of PP, so at 120 it is n/a."
    )
    parts.append(_bound_paragraph(rows))
    # The per-layer run is dualpipe on equal one-layer stages: x k for equal chunks of the
    # middle chunk's k layers.
    k = round(chunk["F"] / (per["F"] + per["a2a_forward"]))
    equal = [k * (layer["makespan"] - r["busy"]) for r in layer["ranks"]]
    spread = "; ".join(
        f"{x['mean']:.0f} ms on average ({x['min']:.0f} to {x['max']:.0f}) at {m} micro-batches"
        for m, x in idle.items()
    )
    lone = chunk["F"] + chunk["dX"]
    parts.append(
        f"DeepSeek's formula for DualPipe's bubble, (PP/2-1)(F&B+B-3W) with B the full "
        f"backward, on a middle chunk (F={chunk['F']:.1f}, B={chunk['B_full']:.1f}, "
        f"W={chunk['W']:.1f}, F&B={chunk['F&B']:.1f} ms) gives {f['formula_ms']:.0f} ms of "
        f"idle per rank. The simulation, on equal chunks of those costs (the per-layer run "
        f"above, x {k}: the middle chunk's layers; it takes the profile's pair as measured, "
        f"{per['pair_wall']:.2f} ms a layer, where the splits below take it by streams), "
        f"idles {sum(equal) / len(equal):.0f} ms "
        f"on average ({min(equal):.0f} to {max(equal):.0f}); on the split it runs, {spread}. "
        "Why they "
        "differ: (1) the formula is exact where the pair is at least as long as a lone "
        "forward and a lone input gradient (docs/schedules.md, tested at F = dX = dW: every "
        "rank when F&B = F+B+W, the most idle rank down to F&B = F+dX); here the pair "
        f"({chunk['F&B']:.1f} ms) is "
        f"far shorter than F+dX ({lone:.1f} ms), because the pair hides both all-to-alls "
        "and a lone pass waits for its own. The warm-up and cool-down run lone passes, so "
        "ranks differ: the ends idle less than the formula says, the middle ranks more. "
        "(2) The stages are not equal: the first holds the embedding, the last the output "
        "layer, the MTP block and the loss, so the ranks holding them idle less and the "
        "others more, the more so the more micro-batches, and the step is longer than on "
        "equal chunks. The "
        "formula is a closed form for equal chunks with little overlap; the simulation "
        "times this split with this overlap."
    )
    parts += _at_pp8(trace)
    return "\n\n".join(parts)


def _tables(trace: Path, pp: int, m: int, sets: tuple[str, ...]) -> tuple[list[str], dict]:
    """``simulate --schedule all`` over the config (with ``sets``) at ``m`` micro-batches:
    its title, table and the lines under it, and its ``--json`` figures."""
    args = ["simulate", "--profile", "$TRACE", "--config", CONFIG]
    args += [arg for item in sets for arg in ("--set", item)]
    args += ["--schedule", "all", "--microbatches", str(m), "--memory-cap", str(MEMORY_CAP_GIB)]
    text, figures = _run(args, trace)
    body = text[text.index(CONFIG) :].split("\n", 1)[1]
    body, _, plan = body.partition("\n\nplan: ")  # the plan under the table
    table, formula = body.rsplit("\n", 1)
    title = f"**DeepSeek-V3 at PP={pp}, {m} micro-batches** (ms), `{_command(args)}`:"
    parts = [title, table, f"`{formula}`"]
    if plan:
        parts.append(f"```\nplan: {plan}\n```")
    return parts, figures


def _at_pp8(trace: Path) -> list[str]:
    """The second profile: the same model, costs and cap at PP=8, and what it shows."""
    parts = [
        "### The same model at PP=8",
        "The same trace's costs, the same model and the same 74.5 GiB cap over 8 pipeline "
        "ranks instead of 16 (the config's split becomes 8 + 6 x 8 + 5 layers), to see what "
        "holds beyond the headline configuration:",
    ]
    lines, behind = [], []
    for m in PP8_MICROBATCHES:
        tables, figures = _tables(trace, 8, m, PP8_SETS)
        parts += tables
        by_name = {r["schedule"]: r for r in figures["schedules"] if r["step_ms"] is not None}
        megatron = by_name["interleaved-1f1b-a2a"]["step_ms"]
        said = []
        for name in ("dualpipev", "dualpipe"):
            row = by_name[name]
            split = ""
            if row["config_split"]:
                split = f" (at the config's split{': ' + row['note'] if row['note'] else ''})"
            said.append(f"{name} {megatron / row['step_ms']:.3f}x{split}")
        lines.append(f"- {m} micro-batches: " + ", ".join(said) + ".")
        if by_name["dualpipev"]["step_ms"] > megatron:
            behind.append(str(m))
    verdict = "dualpipev, the default, is ahead of it at every count."
    if behind:
        verdict = (
            f"dualpipev, the default, is behind it at {', '.join(behind)} micro-batches: "
            "interleaved 1F1B's bubble shrinks with the pipeline, while the lone forwards "
            "and backwards of dualpipev's warm-up and cool-down still wait for their own "
            "all-to-all (the `exposed a2a` column); overlapped pairs beyond F&B could hide it, "
            "placed where they delay no send another rank waits for; they are not built yet."
        )
    parts.append(
        "Each schedule's speed over Megatron's interleaved-1f1b-a2a (its step over ours):\n\n"
        + "\n".join(lines)
        + f"\n\n{verdict}"
    )
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="DeepSeek's train.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    parser.add_argument("--print", action="store_true", help="print the section instead")
    args = parser.parse_args()
    text = section(args.trace.resolve())
    if args.print:
        print(f"## {DEEPSEEK_TITLE}\n\n{text}")
        return
    doc = args.doc.read_text(encoding="utf-8")
    args.doc.write_text(replace_section(doc, DEEPSEEK_TITLE, text), encoding="utf-8")
    print(f"wrote the section {DEEPSEEK_TITLE!r} into {args.doc}")


if __name__ == "__main__":
    main()
