"""Calculator worker process (stdlib only, started with `python -I -S`): one JSON request per stdin line,
one JSON reply per stdout line. Evaluates arithmetic by walking the AST (no eval), so the only ways a call
can go wrong are an error (returned) or running too long (the parent kills and respawns this process)."""

import ast
import json
import operator
import sys

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPR_CHARS = 256


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expr: str) -> str:
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    value = _eval(ast.parse(expr.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def main() -> None:
    try:  # a runaway power must fail with MemoryError here, not exhaust the machine
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    except (ImportError, ValueError, OSError):
        pass
    for line in sys.stdin:
        try:
            expr = json.loads(line)["expr"]
            reply = {"ok": True, "value": evaluate(str(expr))}
        except Exception as e:  # noqa: BLE001 - every error is a tool outcome
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
