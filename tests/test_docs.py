"""Every Python example in the README and docs/ runs as written, on a tiny model.

Each ```python block carries, on the line above it, ``<!-- example: NAME -->``: the names it
uses that the page defines in prose (``model``, ``x``, ``args``, ...), set up here by the
fixture ``NAME``. ``...train...`` stands for training: one step runs there. A block that builds
an ``ActQConfig`` gets it applied to the model and stepped; a block that builds a ``Trainer``
trains it for a step. A block without an annotation fails the test: none goes unrun.
"""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_actq
from hf_actq.testing import CausalRows, short_training, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PAGES += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "recipes").glob("*/README.md"))]
_BLOCK = re.compile(r"(?:<!-- example: (\w+)[^>]*-->\n)?```python\n(.*?)```", re.S)


def _examples():
    for page in PAGES:
        for number, match in enumerate(_BLOCK.finditer((ROOT / page).read_text()), 1):
            yield pytest.param(match[1], match[2], id=f"{page}#{number}")


def _batch():
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _namespace(fixture: str, tmp_path) -> dict:
    namespace = {"hf_actq": hf_actq, "ActQConfig": hf_actq.ActQConfig, "torch": torch}
    if fixture in ("causal_lm", "trainer"):
        torch.manual_seed(0)
        model = tiny_llama()
        batch = _batch()

        def train():
            model.train()
            model(**batch).loss.backward()

        namespace.update(model=model, batch=batch, train=train)
    if fixture == "trainer":
        from transformers import Trainer

        namespace.update(
            Trainer=Trainer, args=short_training(str(tmp_path), steps=1), ds=CausalRows(4)
        )
    if fixture == "tensors":
        generator = torch.Generator().manual_seed(0)
        namespace.update(
            x=torch.randn(4, 256, generator=generator),
            mask=torch.rand(4, 256, generator=generator) > 0.5,
        )
    if fixture == "modules":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        model = nn.Module()
        model.fc, model.norm, model.act = nn.Linear(32, 32), LlamaRMSNorm(32), nn.GELU()
        namespace["model"] = model
    return namespace


@pytest.mark.parametrize(("fixture", "code"), list(_examples()))
def test_every_example_in_the_docs_runs_as_written(fixture, code, tmp_path):
    assert fixture is not None, "annotate the block with <!-- example: NAME --> (see the module)"
    namespace = _namespace(fixture, tmp_path)
    code = code.replace("...train...", "train()")
    # The last expression's value, if the block ends in one (a config to try on the model).
    *body, last = code.rstrip().split("\n\n")
    exec("\n\n".join(body), namespace)
    try:
        value = eval(compile(last, "<example>", "eval"), namespace)
    except SyntaxError:
        exec(last, namespace)
        value = None
    if isinstance(value, hf_actq.ActQConfig):
        handle = hf_actq.apply(namespace["model"], value)
        namespace["train"]()
        handle.revert()
    if "trainer" in namespace:
        namespace["trainer"].train()
    if fixture == "modules":
        out = namespace["model"].act(namespace["model"].norm(namespace["model"].fc(_x32())))
        out.sum().backward()


def _x32():
    return torch.randn(2, 5, 32, requires_grad=True)


def test_every_page_with_examples_is_read():
    assert sum(1 for _ in _examples()) >= 9


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading():
    headings = {
        page: {_anchor(h) for h in re.findall(r"^#+ (.*)$", (ROOT / page).read_text(), re.M)}
        for page in PAGES
    }
    broken, checked = [], 0
    for page in PAGES:
        for link in re.findall(r"\]\(([^)\s]+)\)", (ROOT / page).read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = ((ROOT / page).parent / path).resolve() if path else ROOT / page
            checked += 1
            if not target.exists():
                broken.append(f"{page}: {link} (no such file)")
            elif anchor and target.suffix == ".md":
                key = str(target.relative_to(ROOT))
                if anchor not in headings.get(key, set()):
                    broken.append(f"{page}: {link} (no such heading)")
    assert checked > 50 and not broken, broken


def test_no_line_of_prose_starts_a_list_by_accident():
    # The pages' lists are "- " items; a wrapped line of prose that begins with "+ " or "* "
    # (a formula broken at its operator) renders as a list item instead.
    starts = []
    for page in PAGES:
        in_code = False
        for number, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and re.match(r"\s*[*+] ", line):
                starts.append(f"{page}:{number}: {line[:60]}")
    assert not starts, starts
