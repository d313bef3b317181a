"""The recipe READMEs' commands parse as written: every ``run.py`` invocation in a bash block of
``recipes/*/README.md`` (``python`` or ``accelerate launch``) is parsed by that script's own
argument dataclasses, so a renamed or mistyped flag in a quick start fails here, not on a
user's first try. Nothing is downloaded or trained."""

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _commands():
    for readme in sorted(RECIPES.glob("*/README.md")):
        for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                words = shlex.split(command, comments=True)
                scripts = [w for w in words if re.fullmatch(r"recipes/\w+/run\.py", w)]
                if scripts:
                    script = scripts[0]
                    yield pytest.param(
                        script, words[words.index(script) + 1 :], id=readme.parent.name
                    )


def _load(script: str):
    path = RECIPES.parent / script
    sys.path.insert(0, str(RECIPES))  # the scripts import recipes/common
    spec = importlib.util.spec_from_file_location(f"readme_{path.parent.name}_run", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_readmes_have_run_commands():
    assert {param.id for param in _commands()} == {"glue", "llama_lora"}


@pytest.mark.parametrize(("script", "arguments"), list(_commands()))
def test_every_run_command_in_a_recipe_readme_parses(script, arguments):
    from hf_actq.integrations.arguments import parse_arguments

    module = _load(script)
    arguments = [a.replace("$MINILM", "model-dir") for a in arguments]
    if "--bf16" in arguments:
        arguments += ["--use_cpu", "true"]  # bf16 asks for a GPU or use_cpu: this machine's
    model_args, *_, actq, training_args = parse_arguments(module.ARGUMENTS, arguments)
    assert model_args.model_name_or_path and training_args.output_dir
    assert actq is not None
