"""The README's Python calls run as written, and the signatures it shows are the real ones
(keyword-only markers included)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from msa_megatron import MSAConfig, msa_attention, select_blocks
from msa_megatron.megatron import get_gpt_layer_msa_spec

README = Path(__file__).resolve().parents[2] / "README.md"


def _text() -> str:
    return README.read_text()


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", _text(), flags=re.S)


def _block_with(word: str) -> str:
    (block,) = [b for b in _python_blocks() if word in b]
    return block


def _shown_signature(name: str) -> str:
    """The README's ```name(...)``` text (in backticks, possibly over several lines)."""
    flat = " ".join(_text().split())
    match = re.search(rf"`{name}\(([^`]*?)\)(?:`| ->)", flat)
    assert match, f"README shows no signature of {name}"
    return match.group(1).replace('"', "'")


def _real_signature(function) -> str:
    """``a, b=None, *, c=1`` from the function (annotations dropped)."""
    parts, star = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


@pytest.mark.parametrize("function", [get_gpt_layer_msa_spec, msa_attention, select_blocks],
                         ids=lambda f: f.__name__)
def test_readme_signature_is_the_real_one(function):
    assert _shown_signature(function.__name__) == _real_signature(function)


def test_readme_layer_spec_call_runs():
    """The README's "In a megatron-core model" block, up to the spec (the model needs a
    config the README leaves out): its imports and its ``get_gpt_layer_msa_spec`` call."""
    block = _block_with("get_gpt_layer_msa_spec(")
    lines = [line for line in block.splitlines()
             if line.startswith(("from ", "import ")) or line.startswith("spec = ")]
    assert any(line.startswith("spec = get_gpt_layer_msa_spec(") for line in lines), block
    scope: dict = {}
    exec("\n".join(lines), scope)  # noqa: S102 - the README's own lines
    spec = scope["spec"]
    assert isinstance(spec, ModuleSpec)
    cfg = spec.submodules.self_attention.params["msa_config"]
    assert cfg == MSAConfig(block_size=128, top_k=16, mode="dense")


def test_readme_keyword_only_options_are_refused_positionally():
    """What the README's signature says: only ``msa_config`` may be positional."""
    with pytest.raises(TypeError):
        get_gpt_layer_msa_spec(MSAConfig(), False)  # noqa: FBT003


def test_readme_op_example_runs():
    block = _block_with("msa_attention(q, k, v")
    scope: dict = {}
    torch.manual_seed(0)
    exec(block, scope)  # noqa: S102 - the README's own example
    assert scope["out"].shape == scope["q"].shape
    assert scope["blocks"].shape == (1000, 2, 4) and scope["blocks"].dtype == torch.int32
    assert "# [1000, 2, 4]" in block
    assert scope["k_idx"].grad is not None and scope["q"].grad is None
