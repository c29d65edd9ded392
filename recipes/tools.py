"""Tools for ``task=grpo`` with ``task.tools`` (the bundled example's calculator).

A tool is a plain Python function with type hints and a Google-style docstring: transformers
turns it into the JSON schema the chat template shows the model (``get_json_schema``), and the
model calls it by name with JSON arguments (:mod:`recipes.tool_calling`). Name your own in the
config by import path: ``task.tools=[recipes.tools.calculator,my_pkg.tools:lookup]``.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

# What the calculator evaluates: numbers, + - * / // % ** and parentheses; nothing else (no
# names, calls or attributes), so a model's expression cannot run code.
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100  # 10**100 is fine; 9**9**9 would take the process's memory


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. (12 + 30) * 4
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, Fraction):
        value = value.numerator if value.denominator == 1 else float(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float | Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value) if isinstance(node.value, int) else node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")
