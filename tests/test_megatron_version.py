"""The supported megatron-core releases (``>=0.16.1,<0.20``): one sentence at import of the
adapter for any other, before anything of megatron runs; each version gate agrees with the
installed megatron-core; the differences the code takes in its stride (GTP-sharded weights
refused by the deferrable linear, layer specs whose MLP is a ``functools.partial``)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import megatron.core
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_dualpipe.errors import DualPipeError
from megatron_dualpipe.megatron.compat import version
from megatron_dualpipe.megatron.compat.version import (
    SUPPORTED_MEGATRON_CORE,
    TESTED_MEGATRON_CORE,
    MegatronVersionError,
    installed_megatron_core,
    unsupported_megatron_core,
)
from megatron_dualpipe.megatron.grads.deferral import (
    DeferrableColumnParallelLinear,
    WeightGradDeferralError,
    deferrable_layer_spec,
)
from tests import tiny_models as tm
from tests.multiproc import run_workers

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
REFUSAL_020 = (
    "megatron-dualpipe supports megatron-core >=0.16.1,<0.20 but megatron-core 0.20.0 is "
    "installed: pip install 'megatron-core>=0.16.1,<0.20' (the releases tested are 0.16.1, "
    "0.17.1, 0.18.2 and 0.19.2)"
)


def test_the_installed_release_is_a_tested_one() -> None:
    assert SUPPORTED_MEGATRON_CORE == ">=0.16.1,<0.20"
    assert megatron.core.__version__.startswith(installed_megatron_core())
    assert installed_megatron_core() in TESTED_MEGATRON_CORE


def test_a_git_commit_in_the_version_is_not_part_of_the_release(monkeypatch) -> None:
    """megatron-core 0.19 installed inside a git work tree (CI's .ci/venv312 is) appends
    that tree's commit to ``__version__``."""
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+90aaa6a")
    assert installed_megatron_core() == "0.19.2"
    assert version.megatron_lm_tag() == "core_v0.19.0"


@pytest.mark.parametrize(
    "release", ["0.16.1", "0.16.2", "0.17.0", "0.17.1", "0.18.2", "0.19.0", "0.19.2", "0.19.9"]
)
def test_every_release_in_the_range_is_accepted(release: str) -> None:
    assert unsupported_megatron_core(release) is None


@pytest.mark.parametrize(
    "release", ["0.15.0", "0.16.0", "0.16.1rc0", "0.20.0rc1", "0.20.0", "1.0.0", "dev"]
)
def test_every_release_outside_it_is_one_sentence(release: str) -> None:
    sentence = unsupported_megatron_core(release)
    assert sentence is not None and sentence.count(": ") == 1 and "\n" not in sentence
    assert f"megatron-core {release} is installed" in sentence
    if release == "0.20.0":
        assert sentence == REFUSAL_020


def _fake_megatron_core(tmp_path: Path, minor: int, patch: int = 0) -> dict[str, str]:
    """An environment whose ``megatron.core`` is a stand-in of release 0.<minor>.<patch> that
    fails loudly if anything imports it (the refusal must come from reading its version)."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text('raise SystemExit("megatron.core was imported")\n')
    (core / "package_info.py").write_text(
        f'MAJOR = 0\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ""\n'
        "raise SystemExit('package_info.py was run')\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_importing_the_adapter_refuses_an_unsupported_release_before_megatron_runs(
    tmp_path: Path,
) -> None:
    env = _fake_megatron_core(tmp_path, minor=20)
    code = (
        "try:\n"
        "    import megatron_dualpipe.megatron.model.placement\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"MegatronVersionError {REFUSAL_020}\n"


@pytest.mark.parametrize(("minor", "runs"), [(16, False), (17, False), (18, False), (19, True)])
def test_megatron_lm_s_loop_runs_where_0_19_is_installed(
    tmp_path: Path, minor: int, runs: bool
) -> None:
    """Read from the release on disk (``train``'s gate, and the ``route`` marker's): the
    stand-in stops the process if it is imported."""
    env = _fake_megatron_core(tmp_path, minor=minor, patch=1)
    code = (
        "from megatron_dualpipe.megatron.compat.version import route_training_installed\n"
        "print(route_training_installed())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, f"{runs}\n", "")


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_dualpipe", *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_train_says_the_sentence_and_exits_2(tmp_path: Path) -> None:
    env = _fake_megatron_core(tmp_path, minor=20)
    out = _cli(env, "train", "--config", "configs/tiny_gpt_cpu.yaml")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"megatron-dualpipe: error: {REFUSAL_020}\n"
    simulate = _cli(env, "simulate", "--schedule", "dualpipev")
    assert simulate.returncode == 0, simulate.stderr  # pure Python: no adapter, no refusal


def test_the_refusal_is_a_dualpipe_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron.core, "__version__", "0.20.0")
    with pytest.raises(MegatronVersionError) as caught:
        version.refuse_unsupported_at_import()
    assert str(caught.value) == REFUSAL_020
    assert isinstance(caught.value, DualPipeError)


# --------------------------------------------------------------------------------------
# Each gate answers what the installed megatron-core does.


def test_the_layer_plan_gate_names_the_installed_attention_node() -> None:
    source = inspect.getsource(TransformerLayerSchedulePlan._build_callable_nodes)
    name = version.layer_plan_attention_node()
    assert f"self.{name} = create_node(" in source
    other = {"attn", "pre_dispatch_computation"} - {name}
    assert f"self.{other.pop()} = create_node(" not in source


def test_the_mtp_tracker_gate_names_what_megatron_records() -> None:
    MTPLossLoggingHelper.tracker.clear()
    fields = version.mtp_tracker_fields()
    values = [torch.tensor(float(i + 2)) for i in range(len(fields))]
    try:
        version.save_mtp_metrics(values, 1, 2, avg_group=None)
        tracker = MTPLossLoggingHelper.tracker
        assert [tracker[f].tolist() for f in fields] == [[0.0, v.item()] for v in values]
        version.clean_mtp_tracker()
        assert [tracker[f].tolist() for f in fields] == [[0.0, 0.0]] * len(fields)
    finally:
        MTPLossLoggingHelper.tracker.clear()


def _save_common_state(rank: int, world_size: int, directory: str) -> list[str]:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save({"iteration": 7}, directory)
    return sorted(p.name for p in Path(directory).iterdir())


@pytest.mark.multiproc
def test_the_common_state_gate_says_where_megatron_writes_it(tmp_path: Path) -> None:
    (written,) = run_workers(_save_common_state, 1, args=(str(tmp_path),), timeout_s=60.0)
    assert ("common.pt" not in written) is version.common_state_in_dcp()
    assert {"metadata.json", ".metadata"} <= set(written)
    assert megatron.core.dist_checkpointing.load_common_state_dict(str(tmp_path)) == {
        "iteration": 7
    }


# --------------------------------------------------------------------------------------
# Differences taken without a gate.


def test_the_deferrable_spec_reaches_every_linear_layer() -> None:
    """0.18 made a layer spec's MLP a ``functools.partial`` of its builder: the deferrable
    spec replaces the classes inside it too (dense and MoE layers)."""
    for num_experts in (None, 4):
        text = repr(deferrable_layer_spec(get_gpt_layer_local_spec(num_experts=num_experts)))
        assert "DeferrableColumnParallelLinear" in text and "DeferrableRowParallelLinear" in text
        assert "layers.ColumnParallelLinear'" not in text
        assert "layers.RowParallelLinear'" not in text


def _gtp_sharded_forward(rank: int, world_size: int) -> str:
    parallel_state.initialize_model_parallel(distributed_timeout_minutes=0.1)
    try:
        config = tm.tiny_gpt_config(num_layers=1)
        layer = DeferrableColumnParallelLinear(
            4, 4, config=config, init_method=torch.nn.init.zeros_, bias=False
        )
        try:
            layer._deferrable_linear(
                torch.ones(2, 1, 4), layer.weight, None, False, False, False, gtp_remat_size=2
            )
        except WeightGradDeferralError as err:
            return str(err)
        return "no error"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.multiproc
def test_the_deferrable_linear_refuses_gtp_sharded_weights() -> None:
    (said,) = run_workers(_gtp_sharded_forward, 1, timeout_s=60.0)
    assert said == (
        "DeferrableColumnParallelLinear: weights sharded over 2 GTP ranks (Megatron-LM's "
        "--tensor-parallel-num-weight-shards) are not supported by weight-gradient deferral: "
        "leave the weights unsharded"
    )
