"""Command lines for recipes: ``ActQConfig`` parsed by ``HfArgumentParser`` next to a script's
own dataclasses and ``TrainingArguments``, so that one definition serves the library and every
recipe (as PEFT's ``LoraConfig`` does).

    model_args, data_args, actq, training_args = parse_arguments(
        (ModelArguments, DataArguments, ActQConfig, TrainingArguments)
    )

``--recipe fewbit|uniform|alam|checkpoint`` starts from that named recipe (``ActQConfig.from_recipe``) and
the fields given explicitly on the command line override it (``--recipe alam --bits 2``);
without ``--recipe`` the fields are taken as given. A single ``.json`` argument holds all
fields instead (its keys are the explicit ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from hf_actq.config import ActQConfig


def parse_arguments(dataclass_types: Sequence[type], args: Sequence[str] | None = None) -> tuple:
    """The parsed instances of ``dataclass_types`` (one of them ``ActQConfig``), in order; the
    ``ActQConfig`` resolved against its ``recipe`` as described above."""
    from transformers import HfArgumentParser

    args = list(sys.argv[1:] if args is None else args)
    parser = HfArgumentParser(dataclass_types)
    if len(args) == 1 and args[0].endswith(".json"):
        with open(args[0], encoding="utf-8") as file:
            data = json.load(file)
        parsed = parser.parse_dict(data)
        given = set(data)
    else:
        parsed = parser.parse_args_into_dataclasses(args=args)
        given = _given_fields(ActQConfig, args)
    return tuple(_resolve_recipe(p, given) if isinstance(p, ActQConfig) else p for p in parsed)


def _given_fields(dataclass_type: type, args: Sequence[str]) -> set[str]:
    """The fields of ``dataclass_type`` that ``args`` set explicitly: parsed again with every
    default suppressed, so only options present on the command line appear."""
    from transformers import HfArgumentParser

    probe = HfArgumentParser(dataclass_type, allow_abbrev=False)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = probe.parse_known_args(list(args))
    return set(vars(namespace))


def _resolve_recipe(config: ActQConfig, given: set[str]) -> ActQConfig:
    if config.recipe is None:
        return config
    names = {f.name for f in dataclasses.fields(ActQConfig)} - {"recipe"}
    overrides = {name: getattr(config, name) for name in given & names}
    return ActQConfig.from_recipe(config.recipe, **overrides)
