"""Router recognition by code: a reformatted router keeps its key, a changed one loses it (and is
skipped, not patched); every model folder that `_CODES` lists is recognised in the installed
transformers; the router_codes script lists and prints keys."""

import ast
import importlib.util
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from packaging.version import Version

transformers = pytest.importorskip("transformers")
from hf_tiny import tiny_config  # noqa: E402
from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter  # noqa: E402

from moe_kernels.integrations import router_codes  # noqa: E402
from moe_kernels.integrations.code_key import code_key, source_key  # noqa: E402
from moe_kernels.integrations.transformers import _CODES, _recognise, apply_moe_kernels  # noqa: E402

# A real router with strings, keywords, a comment, annotations and branches to reformat and change.
SOURCE = textwrap.dedent(inspect.getsource(Cohere2MoeTopKRouter.forward))
DEF_LINE = SOURCE.split("\n", 1)[0] + "\n"


def edit(source, old, new):
    assert old in source, f"{old!r} is not in the Cohere2-MoE router's source any more: pick another edit"
    return source.replace(old, new)


# Reformattings a release may make: each keeps the key.
REFORMATS = {
    "comment added": lambda s: edit(s, DEF_LINE, DEF_LINE + "    # a comment the release added\n"),
    "docstring added": lambda s: edit(s, DEF_LINE, DEF_LINE + '    """Route the tokens."""\n'),
    "docstring changed": lambda s: edit(
        REFORMATS["docstring added"](s), '"""Route the tokens."""', "'''Route each token\n    to its experts.'''"
    ),
    "quotes": lambda s: edit(s, '"', "'"),
    "line breaks": lambda s: edit(
        s, "F.linear(hidden_states, self.weight)", "F.linear(\n        hidden_states,\n        self.weight,\n    )"
    ),
    "rewritten by ast.unparse": lambda s: ast.unparse(ast.parse(s)),  # canonical spacing, quotes, parentheses
    "indented as a method": lambda s: textwrap.indent(s, "    "),
}

# Changes to the computation: each gives another key.
CHANGES = {
    "constant": lambda s: edit(s, "dim=1,", "dim=-1,"),
    "string constant": lambda s: edit(s, '== "sigmoid"', '== "Sigmoid"'),
    "operator": lambda s: edit(s, "router_scores / torch.sum", "router_scores * torch.sum"),
    "name": lambda s: edit(s, "hidden_states.dtype", "router_logits.dtype"),
    "keyword": lambda s: edit(s, "keepdims=True", "keepdim=True"),
    "statement removed": lambda s: edit(s, "router_scores = router_scores.to(hidden_states.dtype)\n", ""),
    "string statement, not a docstring": lambda s: edit(
        s, "router_scores = router_scores.to(", '"a string statement"\n    router_scores = router_scores.to('
    ),
}


def test_the_source_is_one_verified_code():
    assert _CODES[source_key(SOURCE)].name == "cohere2_moe"
    assert code_key(Cohere2MoeTopKRouter.forward) == source_key(SOURCE)


@pytest.mark.parametrize("reformat", list(REFORMATS))
def test_reformatted_router_keeps_its_key(reformat):
    source = REFORMATS[reformat](SOURCE)
    assert source != SOURCE
    assert source_key(source) == source_key(SOURCE)


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_router_gets_another_key(change):
    source = CHANGES[change](SOURCE)
    ast.parse(source)  # still Python
    assert source_key(source) != source_key(SOURCE)
    assert source_key(source) not in _CODES


def router_with_forward(source, tmp_path, label):
    """A Cohere2-MoE router whose class's forward is `source`, loaded from a file (as transformers'
    are: inspect reads the source from it)."""
    path = tmp_path / f"router_{label.replace(' ', '_').replace(',', '')}.py"
    path.write_text("import torch\nimport torch.nn.functional as F\n\n" + textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = type(Cohere2MoeTopKRouter.__name__, (Cohere2MoeTopKRouter,), {"forward": module.forward})
    return cls(tiny_config("cohere2_moe"))


@pytest.mark.parametrize("label", ["docstring changed", "rewritten by ast.unparse", "constant", "operator"])
def test_only_unchanged_code_is_patched(label, tmp_path):
    reformatted = label in REFORMATS
    router = router_with_forward((REFORMATS if reformatted else CHANGES)[label](SOURCE), tmp_path, label)
    report = apply_moe_kernels(torch.nn.ModuleDict({"router": router}), experts=False, few_tokens=False)
    if reformatted:
        assert report["patched"] == {"router": "cohere2_moe"} and not report["skipped"], report
    else:  # never a stale forward for changed code
        assert not report["patched"] and "unknown router code" in report["skipped"]["router"], report
        assert "forward" not in vars(router)


# (code, model folder) -> (the first transformers release whose router of that folder has another code
# that the code's forward does not reproduce, what changed): skipped from that release on, saying so.
# None so far: no listed router changed its code in 5.24.
CHANGED: dict[tuple[str, str], tuple[str, str]] = {}


def listed_families():
    """(code, model folder) for every folder named in a `_CODES` families string."""
    return [(code.name, folder.strip()) for code in _CODES.values() for folder in code.families.split(",")]


@pytest.mark.parametrize("code, folder", listed_families(), ids=lambda value: value)
def test_listed_family_is_recognised(code, folder):
    version = transformers.__version__
    if importlib.util.find_spec(f"transformers.models.{folder}") is None:
        pytest.skip(f"{folder} is not a model folder of transformers {version}")
    if (code, folder) in CHANGED and Version(version) >= Version(CHANGED[code, folder][0]):
        since, what = CHANGED[code, folder]
        pytest.skip(f"{folder}'s router is not the {code} code from transformers {since} on ({what}): skipped")
    methods = {
        f"{cls.__name__}.{method}": found.name if found else f"unknown (key {key})"
        for cls in router_codes.router_classes(folder)
        for method, _, key, found in _recognise(cls)
    }
    assert code in methods.values(), (
        f"transformers {version}: no router class of {folder} is recognised as the {code} code; its router "
        f"methods: {methods or 'none'}. The router's code changed or moved: run `python -m "
        f"moe_kernels.integrations.router_codes {folder}` and `... --source CLASS {folder}`, compare with the "
        f"{code} forward in moe_kernels/integrations/transformers.py, and follow docs/routers.md, "
        "'Adding a family / a new transformers release'."
    )


def test_a_changed_family_fails_loudly_or_is_skipped_saying_why(monkeypatch):
    key = code_key(Cohere2MoeTopKRouter.forward)
    monkeypatch.delitem(_CODES, key)  # as if transformers had changed the router's code
    with pytest.raises(AssertionError) as failure:
        test_listed_family_is_recognised("cohere2_moe", "cohere2_moe")
    message = str(failure.value)
    for part in (transformers.__version__, "cohere2_moe", "Cohere2MoeTopKRouter.forward", key, "router_codes"):
        assert part in message, part
    monkeypatch.setitem(CHANGED, ("cohere2_moe", "cohere2_moe"), ("5.0", "a new branch"))
    with pytest.raises(pytest.skip.Exception, match="from transformers 5.0 on \\(a new branch\\)"):
        test_listed_family_is_recognised("cohere2_moe", "cohere2_moe")


def test_script_lists_a_family():
    out = subprocess.run(
        [sys.executable, "-m", "moe_kernels.integrations.router_codes", "cohere2_moe"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    key = code_key(Cohere2MoeTopKRouter.forward)
    assert f"transformers {transformers.__version__}" in out
    assert f"cohere2_moe  Cohere2MoeTopKRouter.forward  {key}  cohere2_moe\n" in out
    assert "# 1 router methods: 1 recognised, 0 unknown" in out


def test_script_prints_the_normalised_source_and_key(capsys):
    assert router_codes.main(["--source", "Cohere2MoeTopKRouter", "cohere2_moe"]) == 0
    out = capsys.readouterr().out
    key = code_key(Cohere2MoeTopKRouter.forward)
    assert f"# key {key}: cohere2_moe\n" in out
    printed = out.split(": cohere2_moe\n", 1)[1]
    assert "#" not in printed  # the comments are gone
    assert source_key(printed) == key  # the printed source keys as the class's own
    assert router_codes.main(["--source", "NoSuchRouter", "cohere2_moe"]) == 1
