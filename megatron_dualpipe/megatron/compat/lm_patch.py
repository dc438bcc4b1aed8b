"""The patched ``megatron/training`` of an installed megatron-core wheel, and the check that
the one a run imports is patched.

:func:`make_patched_training` copies the wheel's ``megatron/training`` (0.17 and newer ship
it) to ``<out>/megatron/training`` and applies the ``megatron/training`` hunks of the
release's tag's patch; :func:`unpatched_training_problem` says, in one sentence, when the
``megatron.training`` a run imports is not patched. Nothing imports megatron until that
check runs. How and why: docs/megatron-versions.md, "Megatron-LM's patches".
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from ...errors import DualPipeError
from .version import MEGATRON_LM_TAGS, version_on_disk

__all__ = [
    "PATCHES",
    "MegatronLMPatchError",
    "make_patched_training",
    "outside_any_work_tree",
    "patch_of",
    "unpatched_training_problem",
]

#: The patches of a checkout of this project (setup.py does not install them).
PATCHES = Path(__file__).resolve().parents[3] / "patches"


class MegatronLMPatchError(DualPipeError, RuntimeError):
    """The patched ``megatron/training`` cannot be made; one sentence saying why."""


def patch_of(tag: str) -> Path:
    """``patches/megatron-lm-<tag>.patch`` of this checkout."""
    return PATCHES / f"megatron-lm-{tag}.patch"


def _wheel_training() -> tuple[Path, str, str]:
    """The installed wheel's ``megatron/training``, its megatron-core release and its tag."""
    version = version_on_disk()
    if version is None:
        raise MegatronLMPatchError(
            "no megatron-core is installed: pip install 'megatron-core==0.19.2' (its wheel "
            "ships megatron/training)"
        )
    spec = importlib.util.find_spec("megatron")  # a top-level name: nothing is imported
    locations = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    wheel = next(p for p in locations if (p / "core").is_dir())
    tag = MEGATRON_LM_TAGS[".".join(version.split(".")[:2])]
    training = wheel / "training"
    if not (training / "training.py").is_file():
        raise MegatronLMPatchError(
            f"the megatron-core {version} installed at {wheel} ships no megatron/training "
            f"(0.17 and newer do): apply {patch_of(tag)} to a Megatron-LM checkout of tag "
            f"{tag} instead (git apply), or pip install 'megatron-core==0.19.2'"
        )
    return training, version, tag


def make_patched_training(out: Path) -> tuple[Path, Path]:
    """Copy the installed wheel's ``megatron/training`` to ``out/megatron/training`` and
    apply its tag's patch there (the ``megatron/training`` hunks; the patch's
    ``pretrain_gpt.py`` hunks are for a Megatron-LM checkout). Returns the copy and the
    patch. Raises :class:`MegatronLMPatchError` before writing anything when the copy
    exists, the patch or ``git`` is missing, or the patch does not apply."""
    training, version, tag = _wheel_training()
    patch = patch_of(tag)
    target = out / "megatron" / "training"
    if not patch.is_file():
        raise MegatronLMPatchError(
            f"{patch} is not there: run this command from a checkout of megatron-dualpipe "
            "(pip install -e .), which holds the patches"
        )
    if target.exists():
        raise MegatronLMPatchError(
            f"{target} exists already: remove it, or choose another --out"
        )
    git = shutil.which("git")
    if git is None:
        raise MegatronLMPatchError(
            f"applying {patch.name} needs git, which is not on PATH: install git"
        )
    # with the wheel's bytecode: valid for the files the patch leaves (same size and mtime),
    # so that importing the copy compiles only the patched ones
    shutil.copytree(training, target)
    for check in (["--check"], []):
        done = subprocess.run(
            [git, "apply", *check, "--include=megatron/training/*", str(patch)],
            cwd=out, env=outside_any_work_tree(out), capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(target)
            raise MegatronLMPatchError(
                f"{patch.name} does not apply to the megatron/training of megatron-core "
                f"{version} ({done.stderr.strip().splitlines()[0]}): that patch is for "
                f"Megatron-LM tag {tag}"
            )
    return target, patch


def outside_any_work_tree(folder: Path) -> dict[str, str]:
    """The environment for ``git apply`` in ``folder`` as in a folder of no git work tree.
    Inside one (``folder`` in a checkout, or a venv's site-packages there), git takes the
    patch's paths from the work tree's top and skips those outside ``folder``: every one,
    with exit status 0. ``GIT_CEILING_DIRECTORIES`` stops git's search for a work tree at
    ``folder``."""
    return {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(folder).resolve().parent)}


def unpatched_training_problem() -> str | None:
    """One sentence when the ``megatron.training`` this process imports is not patched for
    ``--pipeline-schedule`` (its ``training.py`` lacks the patch's hooks), else None.
    Imports ``megatron.training.training``."""
    from megatron.training import training

    from ... import megatron_lm

    if getattr(training, "dualpipe_lm", None) is megatron_lm:
        return None
    where = Path(training.__file__).parent
    tag = MEGATRON_LM_TAGS.get(".".join((version_on_disk() or "0.19").split(".")[:2]), "")
    return (
        f"the megatron/training at {where} is not patched for --pipeline-schedule (it would "
        "train Megatron's own schedule whatever the flag says): make a patched copy with "
        "`megatron-dualpipe patch-megatron-lm --out DIR` and put DIR first on PYTHONPATH, "
        f"or apply patches/{patch_of(tag).name} to a Megatron-LM checkout of {tag}"
    )
