#!/usr/bin/env python
"""Megatron-LM's own memory estimate for a megatron-dualpipe config under 1F1B, beside
megatron-dualpipe's memory model, term by term.

Runs ``megatron/training/theoretical_memory_usage.py`` (Megatron-LM's formula, shipped in
the megatron-core 0.19 wheel with ``megatron/training``) on the config's model and
parallel sizes with ``pipeline_schedule`` set to 1f1b, and walks from each of its two
figures to ours (``megatron_dualpipe.planner.memory_bridge``). It needs a Python whose
megatron-core has ``megatron.training``:

    .ci/venv312/bin/python scripts/megatron_memory_formula.py configs/deepseek_v3_pp16.yaml
    ... --set fp8=null --set recompute_granularity=null     (the config without them)
    ... --json OUT.json                                       (the figures, for the tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_dualpipe.errors import DualPipeError  # noqa: E402
from megatron_dualpipe.planner.advisor import stages_for  # noqa: E402
from megatron_dualpipe.planner.config_advice import ConfigModel  # noqa: E402
from megatron_dualpipe.planner.memory_bridge import TOLERANCE, bridges  # noqa: E402
from megatron_dualpipe.planner.model_cost import ModelShape  # noqa: E402
from megatron_dualpipe.schedules.registry import spec  # noqa: E402

MIB = 2**20


def megatron_args(values: dict) -> argparse.Namespace:
    """Megatron-LM's validated arguments, as far as its formula reads them, for a training
    config's values over Megatron-LM's defaults (ffn 4h, the vocabulary as given, the
    expert tensor-parallel size of the tensor-parallel size)."""
    h, heads = values["hidden_size"], values["num_attention_heads"]
    ffn = values["ffn_hidden_size"] or 4 * h
    tp, pp = values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"]
    world = values["world_size"] or tp * pp
    shape = ModelShape.from_values(values, "config")
    # The keys Megatron-LM's arguments name as the config does (alphabetical).
    same = (
        "add_bias_linear",
        "expert_model_parallel_size",
        "kv_lora_rank",
        "micro_batch_size",
        "moe_router_topk",
        "moe_shared_expert_intermediate_size",
        "mtp_num_layers",
        "multi_latent_attention",
        "normalization",
        "num_experts",
        "num_layers",
        "num_query_groups",
        "q_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "recompute_granularity",
        "seq_length",
        "sequence_parallel",
        "swiglu",
        "untie_embeddings_and_output_weights",
        "use_distributed_optimizer",
        "v_head_dim",
    )
    return argparse.Namespace(
        hidden_size=h,
        num_attention_heads=heads,
        kv_channels=h // heads,
        group_query_attention=values["num_query_groups"] is not None,
        ffn_hidden_size=ffn,
        padded_vocab_size=values["vocab_size"],
        moe_layer_freq=[int(shape.is_moe(i)) for i in range(shape.num_layers)],
        moe_ffn_hidden_size=values["moe_ffn_hidden_size"] or ffn,
        moe_latent_size=None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        expert_tensor_parallel_size=tp,
        world_size=world,
        data_parallel_size=world // (tp * pp),
        **{key: values[key] for key in same},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a megatron-dualpipe training config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--json", type=Path, help="write the figures and the bridges here")
    args = parser.parse_args(argv)
    from megatron.training import theoretical_memory_usage as formula

    try:
        model = ConfigModel.read(args.config, [*args.overrides, "pipeline_schedule=1f1b"])
        settings = model.memory_settings()
    except DualPipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    shape, setup = model.shape, model.setup
    values = {**dataclasses.asdict(setup), **dataclasses.asdict(settings)}
    values |= dataclasses.asdict(shape)
    mlm = megatron_args(values)
    m = setup.num_microbatches
    pp = setup.pipeline_model_parallel_size
    weights = formula.compute_weight_and_optimizer_memory(mlm)
    if mlm.sequence_parallel and mlm.recompute_granularity == "selective":
        raise SystemExit("the bridge follows the formula's path without sequence parallelism")
    activations = formula.compute_activation_memory_without_sp(mlm, num_microbatches=m)
    schedule = spec("1f1b").generate(pp, m)
    stages = stages_for(shape, setup, pp)
    found = bridges(
        shape,
        setup,
        schedule,
        stages,
        settings,
        megatron_weights=weights,
        megatron_activations=activations,
    )
    print(
        f"{args.config} under 1f1b, PP={pp}, {m} micro-batches: "
        "Megatron-LM's theoretical_memory_usage beside megatron-dualpipe's memory model (MiB)"
    )
    for bridge in found:
        print(f"\n{bridge.what}, pipeline rank {bridge.rank}:")
        print(f"  {bridge.megatron / MIB:12.1f}  Megatron-LM's formula")
        for step in bridge.steps:
            print(f"  {step.bytes / MIB:+12.1f}  {step.label}")
        print(f"  {bridge.ours / MIB:12.1f}  megatron-dualpipe's memory model")
        verdict = "within" if abs(bridge.residual) <= TOLERANCE else "OUTSIDE"
        print(f"  residual {bridge.residual:+.2e} ({verdict} the tolerance {TOLERANCE:g})")
    if args.json:
        data = [dataclasses.asdict(b) | {"residual": b.residual} for b in found]
        args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    return 0 if all(abs(b.residual) <= TOLERANCE for b in found) else 1


if __name__ == "__main__":
    sys.exit(main())
