"""The lines of a package that only a CUDA run executes, found in its source.

A *device test* is an expression that asks which device or backend the code runs on:
``torch.cuda.is_available()``, ``dist.is_nccl_available()``, a ``.type`` compared with
``"cuda"`` or ``"cpu"``, ``.is_cuda``, ``get_backend(...)`` compared with ``"nccl"`` or
``"gloo"``, ``bound_device_id``. (A variable named ``backend`` is not one: the NCCL model
takes ``backend="nccl"`` on any machine.) Where an ``if`` (or a conditional
expression) tests one, the side a CUDA run takes is device-only when a CPU run never
takes it: the body when the test holds on CUDA, else the ``else``; and where the CPU side
ends in ``return``, ``raise`` or ``continue`` and has no ``else``, the statements after
the ``if`` in the same block too. A test whose truth on CUDA cannot be told (it mixes
both) counts its whole ``if`` as device-only. Lines are counted once each.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeviceBranch", "device_branches", "source_branches"]

#: String constants whose comparison says "this is a CUDA run" (True) or a CPU one (False).
_MEANING = {"cuda": True, "nccl": True, "cpu": False, "gloo": False}


@dataclass(frozen=True)
class DeviceBranch:
    """Device-only lines of one function (``where``: ``path:qualname``)."""

    where: str
    lines: tuple[int, ...]


def _name(node: ast.AST) -> str:
    """A dotted name for an attribute chain or a name (empty for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    return ""


def _on_cuda(test: ast.expr) -> bool | None:
    """Whether ``test`` holds on a CUDA run (True), on a CPU run (False), either (None:
    mixed), or is no device test (raises LookupError)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _on_cuda(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        found = []
        for value in test.values:
            try:
                found.append(_on_cuda(value))
            except LookupError:
                continue
        if not found:
            raise LookupError
        return found[0] if len(set(found)) == 1 else None
    if isinstance(test, ast.Call):
        name = _name(test.func)
        if name.endswith(("cuda.is_available", "is_nccl_available")):
            return True
        raise LookupError
    if isinstance(test, ast.Attribute) and test.attr == "is_cuda":
        return True
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right, op = test.left, test.comparators[0], test.ops[0]
        names = _name(left) + " " + _name(right)
        constants = [c.value for c in (left, right) if isinstance(c, ast.Constant)]
        if "bound_device_id" in names and None in constants:
            return isinstance(op, ast.IsNot)
        meaning = [_MEANING[c] for c in constants if isinstance(c, str) and c in _MEANING]
        asks = ".type" in names or any(
            isinstance(c, ast.Call) and _name(c.func).endswith("get_backend") for c in (left, right)
        )
        if meaning and asks and isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
            holds = meaning[0]
            return holds if isinstance(op, ast.Eq | ast.In) else not holds
    raise LookupError


def _lines(nodes: list[ast.stmt] | ast.AST) -> set[int]:
    if isinstance(nodes, ast.AST):
        nodes = [nodes]
    out: set[int] = set()
    for node in nodes:
        out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def _ends(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Return | ast.Raise | ast.Continue)


def _block(body: list[ast.stmt]) -> Iterator[int]:
    """Device-only lines of one block of statements (recursing into compound ones)."""
    for index, node in enumerate(body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue  # counted as functions of their own
        if isinstance(node, ast.If):
            try:
                cuda = _on_cuda(node.test)
            except LookupError:
                cuda = "no device test"
            if cuda is None:
                yield from _lines(node)
                continue
            if cuda is True or cuda is False:
                device_side, cpu_side = (
                    (node.body, node.orelse) if cuda else (node.orelse, node.body)
                )
                yield from _lines(device_side) if device_side else ()
                yield from _block(cpu_side)
                if _ends(cpu_side):  # what follows runs on CUDA only
                    yield from _lines(body[index + 1 :]) if body[index + 1 :] else ()
                    return
                continue
        yield from _expression_lines(node)
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from _block(inner)
        for handler in getattr(node, "handlers", []):
            yield from _block(handler.body)


def _expression_lines(node: ast.stmt) -> Iterator[int]:
    """Device-only lines of the conditional expressions in a statement's own expressions
    (not in the statements it holds)."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.expr):
            continue
        for inner in ast.walk(child):
            if not isinstance(inner, ast.IfExp):
                continue
            try:
                cuda = _on_cuda(inner.test)
            except LookupError:
                continue
            yield from _lines(inner if cuda is None else inner.body if cuda else inner.orelse)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, list[ast.stmt]]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node.body
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def source_branches(source: str, where: str) -> list[DeviceBranch]:
    """Every function of one module's ``source`` with device-only lines, module level
    included (as ``<module>``), each named ``where:qualname``."""
    tree = ast.parse(source)
    module_body = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
    found = []
    for name, body in [("<module>", module_body), *_functions(tree)]:
        lines = tuple(sorted(set(_block(body))))
        if lines:
            found.append(DeviceBranch(f"{where}:{name}", lines))
    return found


def device_branches(package: Path) -> list[DeviceBranch]:
    """:func:`source_branches` of every module of ``package`` (a folder)."""
    return [
        branch
        for path in sorted(package.rglob("*.py"))
        for branch in source_branches(
            path.read_text(encoding="utf-8"), path.relative_to(package.parent).as_posix()
        )
    ]
