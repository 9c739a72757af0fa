"""Count code-only lines of a package: lines holding a Python token other than a comment,
outside docstrings (tokenize + ast)."""

import ast
import io
import pathlib
import sys
import tokenize


def code_lines(src: str) -> int:
    tree = ast.parse(src)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
        tokenize.ENCODING,
    }
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in skip:
            continue
        for ln in range(tok.start[0], tok.end[0] + 1):
            if ln not in doc:
                lines.add(ln)
    return len(lines)


root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "distsgd")
total = 0
per = []
for p in sorted(root.rglob("*.py")):
    n = code_lines(p.read_text())
    per.append((n, str(p)))
    total += n
if "-v" in sys.argv:
    for n, p in sorted(per):
        print(n, p)
print("total", total)
