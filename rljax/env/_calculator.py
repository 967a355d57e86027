"""A calculator tool that never evaluates model text as code.

The expression is parsed with :mod:`ast` (``mode="eval"``) and the tree is walked by a
small interpreter that knows only numeric literals, ``+ - * / // % **``, unary ``+ -``
and parentheses. Any other node (names, calls, attributes, subscripts, comprehensions,
lambdas, strings) is rejected before anything runs; sizes are bounded (expression length,
exponent, digits of intermediate results) so ``9**9**9`` is an error, not a hang.
"""

from __future__ import annotations

import ast
import operator

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 80

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or is out of the calculator's bounds."""


def _check_size(x):
    if isinstance(x, int) and abs(x) >= 10**MAX_DIGITS:
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    return x


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (not isinstance(right, int) or abs(right) > MAX_EXPONENT):
            raise CalculatorError(f"exponent must be an integer with |exponent| <= {MAX_EXPONENT}")
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result out of range") from None
    raise CalculatorError(f"not arithmetic: {type(node).__name__} is not allowed (numbers, + - * / // % ** and "
                          "parentheses only)")


def calculate(expression: str):
    """The value of an arithmetic ``expression`` (int or float); :class:`CalculatorError` otherwise."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree)


def calculator(args: str) -> str:
    """The calculator tool: ``args`` is an expression; returns the value as text."""
    value = calculate(args)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)
