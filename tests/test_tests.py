"""The suite's own rule: every test asserts something, directly, through ``pytest.raises`` and
the like, or through a helper of its module that asserts (tests/test_docs.py checks that no file
reaches outside the repository)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Those of the main venv, and of the GPU checks, transformers' venv and vLLM's.
TEST_FILES = sorted(path for pattern in ("", "gpu/", "peer/", "vllm/") for path in TESTS.glob(f"{pattern}test_*.py"))
# pytest's and numpy's checks, and fuzz_oracle's judge and judge_video (raise a Finding, an AssertionError).
CHECKING_CALLS = (
    "raises", "warns", "fail", "assert_array_equal", "assert_allclose", "assert_equal", "judge", "judge_video",
)  # fmt: skip


def asserts(node: ast.AST, checking: set[str]) -> bool:
    """Whether ``node`` holds an ``assert``, a pytest/numpy check, or a call of a checking helper."""
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            return True
        if isinstance(child, ast.Raise) and "AssertionError" in ast.unparse(child):
            return True
        if isinstance(child, ast.Call):
            func = child.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in CHECKING_CALLS or name.startswith("assert_") or name in checking:
                return True
    return False


def checking_helpers(module: ast.Module) -> set[str]:
    """Functions of the module (at any depth) that assert, directly or through one another."""
    functions = {f.name: f for f in ast.walk(module) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    checking: set[str] = set()
    while True:
        more = {name for name, f in functions.items() if name not in checking and asserts(f, checking)}
        if not more:
            return checking
        checking |= more


def unasserted(path: Path) -> list[str]:
    module = ast.parse(path.read_text())
    checking = checking_helpers(module)
    tests = [f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
    return [f.name for f in tests if not asserts(f, checking - {f.name})]


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_every_test_asserts_something(path: Path) -> None:
    assert not unasserted(path)
