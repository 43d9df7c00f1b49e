"""The key of a router's code: what apply_moe_kernels recognises a transformers router by.

The key is the sha256 (first 16 hex digits) of the syntax tree of the method's source, with its
docstrings dropped. Comments, blank lines, line breaks, parentheses and quote styles leave no
trace in the tree, so a release that only reformats a router keeps its key. Everything else does:
a different statement, name, operator, constant, annotation or decorator gives a different key,
so a router whose code changed is never matched to a forward written for the old code.

The tree is written out by `dump` below, not `ast.dump`: fields that are None or empty are left
out, so a field that a newer Python adds to a node (3.12's `type_params` on a function, always
empty here) does not change the key, and `ast.dump`'s own output (3.13 leaves out empty fields by
default) does not matter. The same source gives the same key on every supported Python.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

_BODIES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def normalised_tree(source: str) -> ast.Module:
    """The syntax tree of `source` (dedented) without its docstrings: the first statement of a
    module, class or function body when it is a string constant, and nothing else."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        if isinstance(node, _BODIES) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    node.body = node.body[1:]
    return tree


def dump(node) -> str:
    """A node, its fields in their order and its constants' reprs; fields that are None or []
    are left out (see the module docstring), positions are never written."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={dump(value)}" for name, value in ast.iter_fields(node) if value is not None and value != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(dump(item) for item in node)}]"
    return repr(node)  # a constant: 1, 1.0 and True differ, 'a' and "a" do not


def source_key(source: str) -> str:
    """The key of a function's source text (indented or not)."""
    return hashlib.sha256(dump(normalised_tree(source)).encode()).hexdigest()[:16]


def code_key(fn) -> str | None:
    """The key of a function's code, or None where its source cannot be read or parsed."""
    try:
        return source_key(inspect.getsource(fn))
    except (OSError, TypeError, SyntaxError):
        return None
