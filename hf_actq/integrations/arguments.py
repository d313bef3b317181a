"""Command lines for recipes: ``ActQConfig`` parsed by ``HfArgumentParser`` next to a script's
own dataclasses and ``TrainingArguments``, so that one definition serves the library and every
recipe (as PEFT's ``LoraConfig`` does).

    model_args, data_args, actq, training_args = parse_arguments(
        (ModelArguments, DataArguments, ActQConfig, TrainingArguments)
    )

``--recipe fewbit|uniform|alam|checkpoint`` starts from that named recipe and the fields given
explicitly on the command line override it (``--recipe alam --bits 0.5``), as in
``ActQConfig(recipe=..., **given)``; without ``--recipe`` the fields are taken as given. A single
``.json`` argument holds all fields instead (its keys are the explicit ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence

from hf_actq.config import ActQConfig


def parse_arguments(dataclass_types: Sequence[type], args: Sequence[str] | None = None) -> tuple:
    """The parsed instances of ``dataclass_types`` (one of them ``ActQConfig``), in order; the
    ``ActQConfig`` built from the fields given, as described above."""
    from transformers import HfArgumentParser

    args = list(sys.argv[1:] if args is None else args)
    # The parser fills every field with its default; the config is built from the given ones
    # alone, so it parses a twin without validation (a recipe's own values, such as alam's
    # fractional bits, would not pass beside the defaults of the other fields).
    types = [_unvalidated() if t is ActQConfig else t for t in dataclass_types]
    parser = HfArgumentParser(types)
    if len(args) == 1 and args[0].endswith(".json"):
        with open(args[0], encoding="utf-8") as file:
            data = json.load(file)
        parsed = parser.parse_dict(data)
        given = set(data)
    else:
        parsed = parser.parse_args_into_dataclasses(args=args)
        given = _given_fields(_unvalidated(), args)
    return tuple(
        ActQConfig(**{name: getattr(p, name) for name in given if hasattr(p, name)})
        if isinstance(p, _unvalidated())
        else p
        for p in parsed
    )


@functools.cache
def _unvalidated() -> type:
    """``ActQConfig``'s fields (names, types, defaults, help) as a plain dataclass."""
    twin = dataclasses.make_dataclass(
        "ActQConfig",
        [(f.name, f.type, _copied(f)) for f in dataclasses.fields(ActQConfig)],
    )
    twin.__module__ = ActQConfig.__module__  # where the parser resolves the type hints
    return twin


def _copied(f: dataclasses.Field) -> dataclasses.Field:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def _given_fields(dataclass_type: type, args: Sequence[str]) -> set[str]:
    """The fields of ``dataclass_type`` that ``args`` set explicitly: parsed again with every
    default suppressed, so only options present on the command line appear."""
    from transformers import HfArgumentParser

    probe = HfArgumentParser(dataclass_type, allow_abbrev=False)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = probe.parse_known_args(list(args))
    return set(vars(namespace))
