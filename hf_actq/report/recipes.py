"""Recipe strings of the memory report (``"uniform:bits=4"``) and the configs they name."""

from __future__ import annotations

from hf_actq.config import ActQConfig

CHUNKED_LOSS = "chunked-loss"  # the stock model but for the causal-LM loss
# The stock model under transformers' own (non-reentrant) gradient checkpointing: what a user
# gets with ``gradient_checkpointing=True``, the comparison a practitioner asks for first.
STOCK_CHECKPOINTING = "stock-checkpointing"
_CHUNKED_LOSS_OFF = ("activations", "linear", "norm", "gated_mlp", "attention", "dropout")


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
            off = dict.fromkeys(_CHUNKED_LOSS_OFF, False)
            return spec, ActQConfig(**off, share_norm_outputs=False)
        return spec, None
    values = {}
    for item in filter(None, overrides.split(",")):
        key, equals, text = item.partition("=")
        if not equals:
            raise ValueError(f"recipe override {item!r} in {spec!r} must look like key=value")
        values[key.strip()] = _parse_value(text.strip())
    return spec, ActQConfig.from_recipe(name, **values)


def describe_recipe(config) -> str:
    """What a parsed recipe (``parse_recipe(spec)[1]``) keeps for backward, in a few words."""
    if config is None:
        return "the unpatched model"
    if config == STOCK_CHECKPOINTING:
        return "unpatched; layers recomputed (gradient_checkpointing=True)"
    if config.fused_loss and not any(getattr(config, kind) for kind in _CHUNKED_LOSS_OFF):
        return "unpatched but the LM head and loss, chunked"
    return config.describe()


def _parse_value(text: str):
    if text in ("True", "true", "False", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
