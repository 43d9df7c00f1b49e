"""The router classes of the installed transformers, their keys and the codes they match.

    python -m moe_kernels.integrations.router_codes [FOLDER ...]
    python -m moe_kernels.integrations.router_codes --source NAME [FOLDER ...]

The first lists every router class that apply_moe_kernels would look at (the same
`_looks_like_router` and `_router_methods` as the patch) in the `modeling_*` modules of
`transformers.models.<FOLDER>` (every model folder when none is given; importing them all takes a
while): its folder, class and method, its key (code_key.py), and the router code of
transformers.py's `_CODES` that it matches, or "unknown" (then apply_moe_kernels leaves it alone
and reports it as skipped). The second prints the normalised source (the syntax tree that is
keyed, written back as Python: no comments, no docstrings) and the key of each router method of
the class NAME, so that a developer adding a family, or checking a new transformers release, can
compare it with the code a family forward was written for and copy the key into `_CODES`
(docs/routers.md, "Adding a family / a new transformers release").
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pkgutil
import sys

import torch

from moe_kernels.integrations.code_key import normalised_tree
from moe_kernels.integrations.transformers import _looks_like_router, _recognise


def model_folders() -> list[str]:
    """The model folders of the installed transformers (transformers.models.<folder>)."""
    import transformers.models

    return sorted(info.name for info in pkgutil.iter_modules(transformers.models.__path__) if info.ispkg)


def router_classes(folder: str):
    """The router classes (by `_looks_like_router`) defined in the folder's modeling_* modules, in
    the order of their modules and definitions. A module that fails to import (an optional
    dependency missing) raises."""
    package = importlib.import_module(f"transformers.models.{folder}")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
        if not info.name.startswith("modeling_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for cls in vars(module).values():
            is_module_class = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            if is_module_class and cls.__module__ == module.__name__ and _looks_like_router(cls):
                yield cls


def _scan(folders):
    """(folder, class) of every router class in the folders; folders whose modules fail to import
    are reported on stderr and left out."""
    for folder in folders:
        try:
            classes = list(router_classes(folder))
        except Exception as error:  # an optional dependency of one model (torchaudio, ...)
            print(f"# {folder}: not imported ({type(error).__name__}: {error})", file=sys.stderr)
            continue
        for cls in classes:
            yield folder, cls


def list_codes(folders) -> int:
    """Print one line per router method: folder, class.method, key, code (or unknown)."""
    import transformers

    print(f"# transformers {transformers.__version__}: folder, router class.method, key, code")
    methods = recognised = 0
    for folder, cls in _scan(folders):
        for method, _, key, code in _recognise(cls):
            methods += 1
            recognised += code is not None
            print(f"{folder}  {cls.__name__}.{method}  {key}  {code.name if code else 'unknown'}")
    print(f"# {methods} router methods: {recognised} recognised, {methods - recognised} unknown")
    return 0


def print_source(name: str, folders) -> int:
    """Print the normalised source and the key of each router method of the classes named `name`."""
    import transformers

    found = False
    for _, cls in _scan(folders):
        if cls.__name__ != name:
            continue
        for method, original, key, code in _recognise(cls):
            found = True
            print(f"# transformers {transformers.__version__}: {cls.__module__}.{cls.__name__}.{method}")
            print(f"# key {key}: {code.name if code else 'unknown'}")
            if key is not None:  # None: no source to read (a builtin, a function made by exec)
                print(ast.unparse(normalised_tree(inspect.getsource(original))))
            print()
    if not found:
        print(f"no router class {name!r} with a router method in the folders searched", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_kernels.integrations.router_codes",
        description="Router classes of the installed transformers: their keys and the codes they match.",
    )
    parser.add_argument("folders", nargs="*", metavar="FOLDER", help="model folders (default: all)")
    parser.add_argument("--source", metavar="NAME", help="print the normalised source and key of class NAME")
    args = parser.parse_args(argv)
    folders = args.folders or model_folders()
    if args.source:
        return print_source(args.source, folders)
    return list_codes(folders)


if __name__ == "__main__":
    sys.exit(main())
