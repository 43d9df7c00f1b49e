"""Router recognition by code: a reformatted router keeps its key, a changed one loses it (and is
skipped, not patched)."""

import ast
import importlib.util
import inspect
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
from hf_tiny import tiny_config  # noqa: E402
from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter  # noqa: E402

from moe_kernels.integrations.code_key import code_key, source_key  # noqa: E402
from moe_kernels.integrations.transformers import _CODES, apply_moe_kernels  # noqa: E402

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
