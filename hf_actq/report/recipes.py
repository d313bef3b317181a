"""Recipe strings of the memory report (``"uniform:bits=4"``) and the configs they name."""

from __future__ import annotations

from hf_actq.config import ActQConfig

CHUNKED_LOSS = "chunked-loss"  # the stock model but for the causal-LM loss
# The stock model under transformers' own (non-reentrant) gradient checkpointing: what a user
# gets with ``gradient_checkpointing=True``, the comparison a practitioner asks for first.
STOCK_CHECKPOINTING = "stock-checkpointing"


def parse_recipe(spec: str) -> tuple[str, ActQConfig | None]:
    """ "baseline", "chunked-loss", "stock-checkpointing", "fewbit", "uniform:bits=4",
    "alam:bits=0.5,dropout_mode=mask" -> config (``STOCK_CHECKPOINTING`` itself for that one:
    no hf_actq config)."""
    name, _, overrides = spec.partition(":")
    if name == STOCK_CHECKPOINTING:
        if overrides:
            raise ValueError(f"the {name} recipe takes no overrides")
        return spec, STOCK_CHECKPOINTING
    if name in ("baseline", CHUNKED_LOSS):
        if overrides:
            raise ValueError(f"the {name} recipe takes no overrides")
        if name == CHUNKED_LOSS:
            off = ("activations", "linear", "norm", "gated_mlp", "attention", "dropout")
            return spec, ActQConfig(**dict.fromkeys(off, False), share_norm_outputs=False)
        return spec, None
    values = {}
    for item in filter(None, overrides.split(",")):
        key, equals, text = item.partition("=")
        if not equals:
            raise ValueError(f"recipe override {item!r} in {spec!r} must look like key=value")
        values[key.strip()] = _parse_value(text.strip())
    return spec, ActQConfig.from_recipe(name, **values)


def _parse_value(text: str):
    if text in ("True", "true", "False", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
