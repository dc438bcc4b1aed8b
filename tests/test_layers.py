"""The layers hold: what each package may import (read from the source), and what really
loads when torch and megatron cannot be imported at all.

1. ``schedules/`` and ``planner/`` are pure Python: no torch, no megatron, nothing of the
   layers above them (``planner/torch_schedules.py`` alone imports torch's
   ``torch.distributed.pipelining``, only inside the functions that import its
   schedules); nothing of the core (schedules, runtime, the adapter but our own trainer,
   the Megatron-LM hooks) imports the planner.
2. ``runtime/`` imports torch but never megatron, and nothing of ``megatron_dualpipe.megatron``.
3. Only ``megatron_dualpipe/megatron/`` imports ``megatron`` (entry points and the
   checkout's ``bench/`` reach Megatron through it), and no module of the installed package
   imports ``tests`` or ``bench`` (the test scaffolding, such as ``tests/tiny_models.py``
   and ``tests/nccl_emulation.py``, and the benchmark are not installed); ``bench/`` may
   import any of ``megatron_dualpipe``, never ``tests``.
4. With torch and megatron blocked, the CLI's ``simulate`` works and the config layer loads.
5. ``runtime/`` never prints (nor writes to ``sys.stdout``/``sys.stderr``): it logs.
6. Each command's module of ``cli/`` imports no other command's (nor ``cli.command``).
7. The core looks a schedule up by name (the registry's ``spec``, ``generate``,
   ``SCHEDULES[...]``, the adapter's ``schedule_spec`` and ``pipeline_setup``) only where a
   run starts: every other function takes the resolved spec or ``PipelineSetup``.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_dualpipe"
BENCH = ROOT / "bench"


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed source of ``path``, read once per session."""
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def _imports(path: Path) -> frozenset[str]:
    """Absolute names of every module ``path`` imports, at any depth (lazy ones too)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if folder else sorted(PACKAGE.rglob("*.py"))


def _violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in sorted(_imports(path))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


_NOT_PURE = ("torch", "megatron", "megatron_dualpipe.runtime", "megatron_dualpipe.megatron")
#: The planner's one way to torch: torch.distributed.pipelining's schedules, imported into
#: our IR (``simulate --profile --config --schedule all`` and the benchmark compare them).
_PLANNER_TORCH = PACKAGE / "planner" / "torch_schedules.py"


def test_schedules_and_the_planner_are_pure_python() -> None:
    pure = [p for p in _modules("schedules") + _modules("planner") if p != _PLANNER_TORCH]
    assert _violations(pure, _NOT_PURE) == []


def _eager_imports(path: Path) -> list[str]:
    """Modules ``path`` imports when it loads: its imports outside any function."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.append("." * child.level + (child.module or ""))
            elif not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child)

    visit(_tree(path))
    return found


def test_the_planner_reaches_torch_only_lazily_for_torchs_schedules() -> None:
    """``planner/torch_schedules.py`` imports torch.distributed.pipelining and nothing else
    of the forbidden, and only inside functions: the planner loads without torch."""
    found = _violations([_PLANNER_TORCH], _NOT_PURE)
    assert found and all(" imports torch.distributed.pipelining" in v for v in found), found
    assert [n for n in _eager_imports(_PLANNER_TORCH) if n.split(".")[0] == "torch"] == []


def test_nothing_of_the_core_imports_the_planner() -> None:
    """The planner is a wing: the schedules, the runtime, the Megatron adapter and the
    Megatron-LM hooks import nothing of it (what the route loads is held below)."""
    core = _modules("schedules") + _modules("runtime") + [PACKAGE / "megatron_lm.py"]
    core += _modules("megatron")
    assert _violations(core, ("megatron_dualpipe.planner",)) == []


#: Megatron-LM's loop (the route): its hooks, its launcher, its pretrain_gpt.
_ROUTE = (
    "megatron_lm.py", "megatron/lm_args.py", "megatron/lm_launch.py", "megatron/lm_dry_run.py",
    "megatron/pretrain_gpt.py",
)  # fmt: skip


@pytest.mark.slow
def test_what_the_route_loads_holds_nothing_of_the_planner() -> None:
    """What really loads with the route's modules (its checkpoint reading among them):
    nothing of the planner."""
    modules = [f"megatron_dualpipe.{n[:-3].replace('/', '.')}" for n in _ROUTE]
    modules += [f"megatron_dualpipe.megatron.checkpoint.{n}" for n in ("files", "lock")]
    modules += ["megatron_dualpipe.megatron.data.file_checks"]
    code = (
        f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron_dualpipe.planner')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_runtime_never_imports_megatron() -> None:
    assert _violations(_modules("runtime"), ("megatron", "megatron_dualpipe.megatron")) == []


def test_only_the_adapter_package_imports_megatron() -> None:
    outside = [p for p in _modules("") if PACKAGE / "megatron" not in p.parents]
    assert _violations(outside, ("megatron",)) == []


def test_the_installed_package_never_imports_the_tests_nor_the_bench() -> None:
    assert _violations(_modules(""), ("tests", "bench")) == []


def test_the_bench_reaches_megatron_through_the_adapter_and_never_imports_the_tests() -> None:
    """The checkout's ``bench/`` may import any of ``megatron_dualpipe`` (it is not installed),
    but megatron only through ``megatron_dualpipe.megatron``, and not the test scaffolding."""
    paths = sorted(BENCH.rglob("*.py"))
    assert BENCH / "suite.py" in paths
    assert _violations(paths, ("megatron", "tests")) == []


# Which sibling rooms of ``megatron_dualpipe/megatron/`` each room may import.
_ROOMS = ("schedule", "model", "grads", "compat", "checkpoint", "data")
_ROOM_MAY_IMPORT = {
    "compat": (),
    "checkpoint": ("compat",),
    "data": (),
    "model": ("compat", "grads", "schedule"),
    "grads": ("compat", "model", "schedule"),
    "schedule": ("compat", "model", "grads"),
}


def _room_violations(room: str, paths: list[Path]) -> list[str]:
    allowed = (room, *_ROOM_MAY_IMPORT[room])
    forbidden = tuple(f"megatron_dualpipe.megatron.{r}" for r in _ROOMS if r not in allowed)
    return _violations(paths, forbidden)


@pytest.mark.parametrize("room", sorted(_ROOM_MAY_IMPORT))
def test_each_adapter_room_imports_only_its_allowed_siblings(room: str) -> None:
    assert _room_violations(room, _modules(f"megatron/{room}")) == []


# The command line (``cli/``): ``command`` (the top parser) imports every command's module;
# a command's module imports ``common`` and the layers below, never another command.
_CLI_SHARED = ("__init__", "__main__", "command", "common")


def _cli_command_violations() -> list[str]:
    commands = [p for p in _modules("cli") if p.stem not in _CLI_SHARED]
    found = []
    for path in commands:
        others = tuple(f"megatron_dualpipe.cli.{p.stem}" for p in commands if p != path)
        found += _violations([path], (*others, "megatron_dualpipe.cli.command"))
    return found


def test_each_command_module_imports_no_other_command() -> None:
    assert _cli_command_violations() == []


def test_the_command_rule_sees_a_command_importing_another() -> None:
    """A command module that imports another command's module is found."""
    fake = PACKAGE / "cli" / "_command_probe.py"
    fake.write_text("def run(args):\n    from .simulate import run as simulate\n")
    try:
        found = _cli_command_violations()
    finally:
        fake.unlink()
    assert "megatron_dualpipe/cli/_command_probe.py imports megatron_dualpipe.cli.simulate" in found


#: The functions of the core that may turn a schedule's name into its spec: where a run
#: or a direct user of the adapter starts.
NAME_LOOKUPS_ALLOWED = {
    "megatron_dualpipe/megatron_lm.py": {"_run", "schedule_of_run"},
    "megatron_dualpipe/megatron/schedule/checks.py": {"schedule_spec", "pipeline_setup"},
    "megatron_dualpipe/megatron/schedule/registry.py": {"get_forward_backward_func", "install"},
    "megatron_dualpipe/megatron/schedule/forward_backward.py": {"__init__"},
    "megatron_dualpipe/megatron/model/seeding.py": {"__init__"},  # 1F1B's layout, emulated
}
_LOOKUPS = ("spec", "schedule_spec", "pipeline_setup", "generate")


def _name_lookups(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every lookup of a schedule by name in ``path``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = child.name
            func = child.func if isinstance(child, ast.Call) else None
            if isinstance(func, ast.Name) and func.id in _LOOKUPS:
                found.append((function, child.lineno))
            # registry.spec(...), checks.schedule_spec(...): a module's lookup by attribute
            # (``.generate`` on a resolved spec is not one)
            if isinstance(func, ast.Attribute) and func.attr in _LOOKUPS[:-1]:
                found.append((function, child.lineno))
            if isinstance(func, ast.Attribute) and ast.unparse(func) == "SCHEDULES.get":
                found.append((function, child.lineno))
            if isinstance(child, ast.Subscript) and ast.unparse(child.value) == "SCHEDULES":
                found.append((function, child.lineno))
            visit(child, inner)

    visit(_tree(path), "<module>")
    return found


def _core_name_lookups() -> list[str]:
    paths = [p for folder in ("runtime", "megatron", "schedules") for p in _modules(folder)]
    paths.append(PACKAGE / "megatron_lm.py")
    out = []
    for path in paths:
        name = str(path.relative_to(ROOT))
        if name == "megatron_dualpipe/schedules/registry.py":
            continue  # the registry itself
        allowed = NAME_LOOKUPS_ALLOWED.get(name, set())
        out += [f"{name}:{line} in {f}" for f, line in _name_lookups(path) if f not in allowed]
    return out


def test_the_core_looks_a_schedule_up_by_name_only_where_a_run_starts() -> None:
    assert _core_name_lookups() == []


def test_the_lookup_rule_sees_a_lookup_in_a_hook(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def hook(args):\n    return schedule_spec(args.pipeline_schedule).chunks\n"
        "def other(name):\n    return registry.spec(name), SCHEDULES.get(name)\n"
        "def fine(found, pp):\n    return found.generate(pp, 2 * pp)\n"
    )
    found = _name_lookups(probe)
    assert found == [("hook", 2), ("other", 4), ("other", 4)]


def _prints(node: ast.AST) -> bool:
    """A call of ``print`` or of ``sys.<stream>.write``."""
    if not isinstance(node, ast.Call):
        return False
    name = ast.unparse(node.func)
    return name == "print" or (name.startswith("sys.") and name.endswith(".write"))


def test_runtime_logs_and_never_prints() -> None:
    """The runtime reports through logging (as torch's pipelining does); entry points decide
    what users see."""
    printing = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _modules("runtime")
        for node in ast.walk(_tree(path))
        if _prints(node)
    ]
    assert printing == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The rules above can fail: a lazy relative import of megatron code is found."""
    fake = PACKAGE / "schedules" / "_layer_probe.py"
    fake.write_text("def f():\n    from ..megatron.schedule import checks\n    import torch\n")
    try:
        found = _violations([fake], ("torch", "megatron_dualpipe.megatron"))
    finally:
        fake.unlink()
    assert found == [
        "megatron_dualpipe/schedules/_layer_probe.py imports megatron_dualpipe.megatron.schedule",
        "megatron_dualpipe/schedules/_layer_probe.py imports "
        "megatron_dualpipe.megatron.schedule.checks",
        "megatron_dualpipe/schedules/_layer_probe.py imports torch",
    ]


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron", "transformer_engine"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
"""


def test_the_optimiser_without_scipy_is_one_sentence() -> None:
    """SciPy is the planner's extra: without it the optimiser says what to install."""
    block = _BLOCK.replace('("torch", "megatron", "transformer_engine")', '("scipy",)')
    code = (
        "from megatron_dualpipe.cli import main\n"
        "raise SystemExit(main(['simulate', '--schedule', 'dualpipev', '--pp', '2', "
        "'--microbatches', '4', '--optimize']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", block + code], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == (
        "megatron-dualpipe: error: the schedule optimiser needs SciPy (its HiGHS solver), "
        "which is not installed: pip install 'megatron-dualpipe[planner]' (or pip install scipy)"
    )


@pytest.mark.parametrize(
    "code",
    [
        "import megatron_dualpipe, megatron_dualpipe.schedules, megatron_dualpipe.cli",
        "import megatron_dualpipe.megatron_lm, megatron_dualpipe.megatron.lm_args",
        "from megatron_dualpipe.cli import main\n"
        "assert main(['simulate', '--schedule', 'all', '--pp', '4']) == 0\n"
        "assert main(['simulate', '--schedule', 'dualpipev', '--pp', '2', '--grid']) == 0\n"
        "assert main(['simulate', '--config', 'tests/data/tiny_deepseek_cpu.yaml']) == 0",
        "from megatron_dualpipe.planner.config_advice import ConfigModel\n"
        "ConfigModel.read('configs/tiny_gpt_cpu.yaml', ['pipeline_schedule=dualpipe'])",
        # train reads its config, and refuses one that does not read, before torch loads
        "from megatron_dualpipe.megatron.lm_launch import read_config\n"
        "read_config('configs/tiny_gpt_cpu.yaml', ['pipeline_schedule=dualpipe'])\n"
        "from megatron_dualpipe.cli import main\n"
        "assert main(['train', '--config', 'no-such.yaml']) == 2\n"
        "assert main(['train', '--config', 'configs/tiny_gpt_cpu.yaml', '--set', 'x']) == 2",
    ],
)
def test_torch_free_paths_load_with_torch_blocked(code: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
