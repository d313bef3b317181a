"""``ActQConfig``: what ``hf_actq.apply`` compresses and how, validated, with named recipes."""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from hf_actq.codecs.packed import Codec
from hf_actq.codecs.settings import SETTING_KEYS, check_fields, codec_for_setting

DROPOUT_MODES = ("seed", "mask")
RECIPES = ("fewbit", "uniform", "alam", "checkpoint")
# The fields that are True or False.
SWITCHES = (
    "activations",
    "linear",
    "norm",
    "gated_mlp",
    "attention",
    "dropout",
    "share_norm_outputs",
    "fused_loss",
    "adaptive",
    "allocate_activations",
    "compress_checkpointed",
)


# The codecs in words, for ``ActQConfig.describe``.
CODEC_WORDS = {
    "uniform": "stochastic rounding",
    "aq": "average quantization (ALAM)",
    "blpa": "sign-preserving rounding (BLPA)",
    "smaq": "SmaQ",
    "rotated": "rotated stochastic rounding",
}


def _help(text: str, **extra):
    return {"help": text, **extra}


@dataclass
class ActQConfig:
    """What ``hf_actq.apply(model, config)`` compresses and how; every field is validated.

    Start from a named recipe and override what you need::

        ActQConfig.from_recipe("checkpoint")          # layers recomputed from 4-bit inputs
        ActQConfig.from_recipe("uniform", bits=3)     # the same as ActQConfig(bits=3)
        ActQConfig(recipe="fewbit")                   # 3-bit activation derivatives only

    ``ActQConfig()`` is the "uniform" recipe at 4 bits: the inputs of linear, norm, gated-MLP
    and attention ops are kept at 4-bit stochastic rounding, pointwise activations (GELU,
    SiLU, ...) keep a 4-bit few-bit derivative, and dropout masks are regenerated from a seed
    (``dropout_mode="mask"``: 1 bit an element). ``ActQConfig(bits=3)`` is the same at 3 bits.

    ``bits`` is the precision of the compressed slots: 1..8 for "uniform" and "blpa"; with
    ``codec="aq"`` it may be below 1 (0.5 is ALAM's "AQ 0.5-bit": groups of 4 at 2 bits).
    ``activation_bits`` defaults to ``bits`` clamped to 1..4. Per-slot settings (``slots``) and
    bit plans (``plan``) give single slots their own precision; ``adaptive`` makes ``bits`` a
    target average that the adaptive pass (ALAM's GradNormVar and greedy allocation,
    :mod:`hf_actq.adaptive`) spreads over the slots. ``config.describe()`` says in a few
    words what a config keeps.
    """

    # 4 bits: the width whose accuracy the GLUE recipe shows (3 seeds, every task within the
    # unpatched model's spread); "fewbit" keeps 3, shown the same way for its derivatives.
    bits: float = field(
        default=4, metadata=_help("Precision of the compressed slots (average, when adaptive).")
    )
    codec: Literal["uniform", "aq", "blpa", "smaq", "rotated"] = field(
        default="uniform",
        metadata=_help(
            "Quantizer for non-activation slots: uniform stochastic rounding, "
            "ALAM's average quantization (aq), sign-preserving (blpa), SmaQ, or rotated "
            "(uniform stochastic rounding after random signs and a 128-point Hadamard "
            "rotation: the same bytes, finer rounding where a few features are large; "
            "2-8 bits)."
        ),
    )
    activation_bits: int | None = field(
        default=None, metadata=_help("Few-bit derivative bits, 1..4 (default: bits, clamped).")
    )
    group_size: int | None = field(
        default=None, metadata=_help("AQ group size (1, 2, 4, 8, 16; default: from bits).")
    )
    block_size: int = field(
        default=128, metadata=_help("Values sharing one min/scale: 32, 64, 128 or 256.")
    )
    activations: bool = field(default=True, metadata=_help("Few-bit activation derivatives."))
    linear: bool = field(default=True, metadata=_help("Compress linear layers' inputs."))
    norm: bool = field(default=True, metadata=_help("Compress LayerNorm/RMSNorm inputs."))
    gated_mlp: bool = field(default=True, metadata=_help("Fused, compressed gated MLPs."))
    attention: bool = field(default=True, metadata=_help("Compress attention q, k, v (probs)."))
    dropout: bool = field(default=True, metadata=_help("Dropout masks as seeds or 1-bit masks."))
    dropout_mode: Literal["seed", "mask"] = field(
        default="seed", metadata=_help("Keep dropout masks as an RNG seed or 1 bit per element.")
    )
    key_layout: Literal["head", "sequence"] = field(
        default="head",
        metadata=_help(
            "How attention's K is laid out when packed: 'head' ([batch, heads, seq, head_dim], "
            "so an AQ group or a block runs along head_dim) or 'sequence' (the transposed K the "
            "score matmul reads, as ALAM's code packs it: groups run along the sequence)."
        ),
    )
    share_norm_outputs: bool = field(
        default=True,
        metadata=_help(
            "Norms share with the layers they feed. Exact norms (norm=False) keep their "
            "output, which the next linear keeps anyway, instead of their input, and rebuild "
            "the normalized input from it in backward (exact up to the output's rounding); "
            "compressed norms let the next linears with the same codec rebuild their input from "
            "the norm's packed normalized input instead of packing it again; likewise a gated "
            "MLP's product, rebuilt from its packed operands, for a down projection that runs "
            "as its own module (PEFT LoRA's lora_A)."
        ),
    )
    fused_loss: bool = field(
        default=True,
        metadata=_help(
            "Registered causal and encoder-decoder LMs (T5, BART): the head and loss as a "
            "chunked linear + cross-entropy while "
            "training with labels (no [tokens, vocab] logits kept; exact up to rounding); the "
            "output's logits are then None unless the call passes return_logits=True."
        ),
    )
    skip_modules: list[str] = field(
        default_factory=list, metadata=_help("Regexes on module paths to leave unpatched.")
    )
    # A JSON string is accepted too, so that command lines (HfArgumentParser) can give it.
    slots: dict[str, dict] | str | None = field(
        default_factory=dict,
        metadata=_help(
            "Per-slot settings: slot id ('model.layers.0.mlp:up') or 're:<regex>' "
            "-> {'codec', 'bits', 'group_size', 'block_size'} ({'bits': 1..4} for ':act' slots, "
            "or a codec setting for a standalone activation's input); "
            "a dict or its JSON."
        ),
    )
    plan: str | None = field(
        default=None,
        metadata=_help("A bit plan (JSON path or BitPlan) giving every slot its setting."),
    )
    adaptive: bool = field(
        default=False,
        metadata=_help(
            "Treat bits as a target average of code bits and allocate per slot as ALAM's code "
            "does (each tensor at AQ 0.5 bit with two seeds and at 8 bits, per-parameter "
            "gradient norms, the ladder exact/8/4/2/AQ 0.5); the calibration runs on a batch "
            "(ActQCallback does it)."
        ),
    )
    allocate_activations: bool = field(
        default=True,
        metadata=_help(
            "Adaptive plans only. True: a standalone activation's input (GELU's) is allocated "
            "like any other tensor, as ALAM does. False: the activation keeps its few-bit "
            "derivative code (activation_bits), which counts toward the budget, and the plan "
            "spreads the rest over the other tensors."
        ),
    )
    checkpoint_bits: int | None = field(
        default=None,
        metadata=_help(
            "Packed activation checkpointing: turn on the model's gradient checkpointing and "
            "keep each checkpointed layer's input at this many bits (1-8, stochastic rounding "
            "as checkpoint_codec says) instead of full precision; backward recomputes the layer "
            "from it. "
            "None: checkpointing as the model has it."
        ),
    )
    checkpoint_codec: Literal["rotated", "uniform"] = field(
        default="rotated",
        metadata=_help(
            "With checkpoint_bits: how a checkpointed layer's input is rounded. 'rotated': "
            "stochastic rounding after fixed random signs and a 128-point Hadamard rotation, "
            "which spreads outlier features so that blocks round finer (4x less error on "
            "MiniLM's layer inputs at 4 bits). 'uniform': the same bytes, unrotated."
        ),
    )
    compress_checkpointed: bool = field(
        default=True,
        metadata=_help(
            "With checkpoint_bits: also compress what the recompute of a checkpointed layer "
            "keeps (one layer at a time: it lowers the step's peak, and adds its rounding to "
            "the gradient). False leaves the checkpointed layers stock."
        ),
    )
    calibration_examples: int = field(
        default=8, metadata=_help("Examples of the batch the adaptive pass measures.")
    )
    calibration_step: int = field(
        default=0,
        metadata=_help(
            "The training step before which ActQCallback makes the first adaptive plan (ALAM's "
            "code: 1, after the first step); the steps before it keep the even spread."
        ),
    )
    calibration_seconds: float = field(
        default=300.0,
        metadata=_help(
            "Time cap of one adaptive pass, in seconds. The plan then depends on the machine's "
            "speed; calibration_slots does not."
        ),
    )
    calibration_slots: int | None = field(
        default=None,
        metadata=_help(
            "Saved tensors one adaptive pass measures at most, every kind in turn and spread "
            "over depth (None: all); the others take their kind's median sensitivity. The same "
            "count gives the same plan on any machine."
        ),
    )
    recalibrate_at: float = field(
        default=0.1,
        metadata=_help("Fraction of training at which ActQCallback re-plans (0: never)."),
    )
    recipe: Literal["fewbit", "uniform", "alam", "checkpoint"] | None = field(
        default=None,
        metadata=_help(
            "A named recipe (fewbit, uniform, alam, checkpoint): the config starts from it and "
            "the fields given explicitly override it (ActQConfig.from_recipe)."
        ),
    )

    def __post_init__(self):
        check_fields(self.codec, self.bits, self.group_size, self.block_size)
        if self.activation_bits is None:
            self.activation_bits = int(min(4, max(1, round(self.bits))))
        if isinstance(self.activation_bits, bool) or self.activation_bits not in (1, 2, 3, 4):
            raise ValueError(
                f"activation_bits must be an integer in 1..4, got {self.activation_bits!r}"
            )
        if self.dropout_mode not in DROPOUT_MODES:
            raise ValueError(
                f"dropout_mode must be one of {', '.join(DROPOUT_MODES)}, got {self.dropout_mode!r}"
            )
        if isinstance(self.skip_modules, str):
            self.skip_modules = [self.skip_modules]
        if not isinstance(self.skip_modules, (list, tuple)) or not all(
            isinstance(pattern, str) for pattern in self.skip_modules
        ):
            raise ValueError(
                f"skip_modules must be a list of regexes on module paths, got {self.skip_modules!r}"
            )
        self.skip_modules = list(self.skip_modules)
        for pattern in self.skip_modules:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"skip_modules: {pattern!r} is not a valid regex ({error})"
                ) from error
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.checkpoint_bits is not None and (
            isinstance(self.checkpoint_bits, bool) or self.checkpoint_bits not in range(1, 9)
        ):
            raise ValueError(
                f"checkpoint_bits must be None or an integer in 1..8, got {self.checkpoint_bits!r}"
            )
        if self.checkpoint_bits is not None:
            self.checkpoint_bits = int(self.checkpoint_bits)  # command lines give 4.0
        if self.checkpoint_codec not in ("uniform", "rotated"):
            raise ValueError(
                f"checkpoint_codec must be 'uniform' or 'rotated', got {self.checkpoint_codec!r}"
            )
        if self.codec == "rotated" and self.adaptive:
            raise ValueError(
                "codec='rotated' is for fixed bits: an adaptive plan picks each slot's codec "
                "itself; give codec='uniform' or 'aq' with adaptive=True"
            )
        if not self.allocate_activations and not self.adaptive:
            raise ValueError(
                "allocate_activations=False changes only adaptive plans (adaptive=True); "
                "without one every activation keeps its few-bit derivative code already"
            )
        if self.checkpoint_bits is not None and self.adaptive:
            raise ValueError(
                "checkpoint_bits cannot be combined with adaptive=True: the adaptive pass "
                "measures slots that a checkpointed layer fills only in its recompute; give "
                "the slots a plan or fixed bits, or drop checkpoint_bits"
            )
        if self.key_layout not in ("head", "sequence"):
            raise ValueError(f"key_layout must be 'head' or 'sequence', got {self.key_layout!r}")
        if (
            isinstance(self.calibration_step, bool)
            or not isinstance(self.calibration_step, int)
            or self.calibration_step < 0
        ):
            raise ValueError(
                f"calibration_step must be an integer >= 0, got {self.calibration_step!r}"
            )
        if not _is_positive_int(self.calibration_examples):
            raise ValueError(
                f"calibration_examples must be a positive integer, got {self.calibration_examples!r}"
            )
        if (
            isinstance(self.calibration_seconds, bool)
            or not isinstance(self.calibration_seconds, (int, float))
            or not self.calibration_seconds > 0  # NaN too
        ):
            raise ValueError(
                "calibration_seconds must be a positive number of seconds (math.inf: no cap), "
                f"got {self.calibration_seconds!r}"
            )
        if self.calibration_slots is not None and not _is_positive_int(self.calibration_slots):
            raise ValueError(
                "calibration_slots must be a positive integer (None: every tensor), "
                f"got {self.calibration_slots!r}"
            )
        if (
            isinstance(self.recalibrate_at, bool)
            or not isinstance(self.recalibrate_at, (int, float))
            or not 0 <= self.recalibrate_at < 1
        ):
            raise ValueError(f"recalibrate_at must be in [0, 1), got {self.recalibrate_at!r}")
        if self.slots is None:
            self.slots = {}
        if isinstance(self.slots, str):
            try:
                self.slots = json.loads(self.slots)
            except json.JSONDecodeError as error:
                raise ValueError(
                    "slots must be a dict or its JSON, e.g. "
                    f"'{json.dumps({'re::input$': {'bits': 4}})}'; "
                    f"could not parse {self.slots!r} ({error})"
                ) from error
        if not isinstance(self.slots, dict):
            raise ValueError(f"slots must be a dict of slot id -> setting, got {self.slots!r}")
        for key, setting in self.slots.items():
            self._check_setting(key, setting)
        if self.plan is not None and not isinstance(self.plan, str):
            from hf_actq.adaptive.plan import BitPlan

            if isinstance(self.plan, dict):
                self.plan = BitPlan.from_dict(self.plan)
            if not isinstance(self.plan, BitPlan):
                raise ValueError(
                    f"plan must be a path to a plan's JSON or a BitPlan, got {type(self.plan).__name__}"
                )

    def _check_setting(self, key, setting) -> None:
        if not isinstance(key, str):
            raise ValueError(f"slots: keys are slot ids or 're:<regex>', got {key!r}")
        if key.startswith("re:"):
            try:
                re.compile(key[3:])
            except re.error as error:
                raise ValueError(f"slots: {key!r} is not a valid regex ({error})") from error
        elif ":" not in key:
            raise ValueError(
                f"slots: {key!r} is not a slot id ('<module path>:<slot>', e.g. "
                "'model.layers.0.mlp:up') or a 're:<regex>'"
            )
        try:
            if key.endswith(":act") and not (isinstance(setting, dict) and "codec" in setting):
                check_activation_setting(setting)
            else:
                self.check_setting(setting)
        except ValueError as error:
            raise ValueError(f"slots[{key!r}]: {error}") from None

    def check_setting(self, setting) -> None:
        """ValueError unless ``setting`` is a codec slot's setting this config can build."""
        self.codec_for_setting(setting)

    # Recipes -----------------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, name: str, **overrides) -> ActQConfig:
        """ "fewbit": few-bit activation derivatives only, at ``bits`` (default 3; the paper's
        setting; the outputs, logits included, are the stock model's bit for bit).
        "uniform": every slot at ``bits``-bit stochastic rounding (default 4), activations
        few-bit.
        "alam": ALAM as published: average quantization at ``bits`` on average (default 1),
        spread over the slots by sensitivity (``adaptive=False`` spreads it evenly), calibrated
        after the first step on one example, K packed along the sequence, norms keeping their
        own input.
        "checkpoint": packed activation checkpointing: each layer keeps only its input, at
        ``bits`` (default 4; ``checkpoint_bits`` of the config; rotated before rounding unless
        ``checkpoint_codec="uniform"``), and is recomputed in backward;
        the layers run stock inside and the rest of the model (embeddings, pooler, heads) is
        kept at 8 bits.

        The same as ``ActQConfig(recipe=name, **overrides)``: the fields given override the
        recipe's."""
        return cls(recipe=name, **overrides)

    # Dict round trip ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = asdict(self)
        if self.plan is not None and not isinstance(self.plan, str):
            data["plan"] = self.plan.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ActQConfig:
        """The config of ``to_dict()``'s output, or of any dict of fields (a recipe it names
        starts it, as in ``ActQConfig(**data)``)."""
        if not isinstance(data, dict):
            raise ValueError(f"from_dict takes a dict of ActQConfig fields, got {data!r}")
        return cls(**data)

    def replace(self, **changes) -> ActQConfig:
        return replace(self, **changes)

    # Derived -----------------------------------------------------------------------------------
    def describe(self) -> str:
        """What this config keeps for backward, in a few words ("4-bit stochastic rounding,
        4-bit activation derivatives"): the memory report's rows and the callback's log say it."""
        derivatives = f"{self.activation_bits}-bit activation derivatives"
        if not self.activations:
            derivatives = "stock activations"
        if self.checkpoint_bits is not None:
            rotated = "rotated " if self.checkpoint_codec == "rotated" else ""
            return (
                f"layers recomputed from {self.checkpoint_bits}-bit {rotated}inputs; "
                f"the rest {self.bits:g}-bit"
            )
        if not any(getattr(self, kind) for kind in ("linear", "norm", "gated_mlp", "attention")):
            return f"{derivatives} only"
        codec = CODEC_WORDS.get(self.codec, self.codec)
        if self.adaptive or self.plan is not None:
            unit = "bit" if self.bits == 1 else "bits"
            planned = f"{codec}, {self.bits:g} {unit} on average, planned per tensor"
            if self.adaptive and self.allocate_activations:
                return planned
            return f"{planned}; {derivatives}"
        return f"{self.bits:g}-bit {codec}; {derivatives}"

    def default_setting(self) -> dict:
        """The setting of a slot the config gives no setting of its own."""
        return dict(zip(SETTING_KEYS, (self.codec, self.bits, self.group_size, self.block_size)))

    def make_codec(self) -> Codec:
        """The codec for non-activation slots."""
        return codec_for_setting(self.default_setting(), self.default_setting())

    def skips(self, path: str) -> bool:
        return any(re.search(pattern, path) for pattern in self.skip_modules)

    # Per-slot settings -------------------------------------------------------------------------
    def setting_for(self, slot: str) -> dict | None:
        """The per-slot setting of ``slot``: its exact id first, then the first matching regex."""
        if slot in self.slots:
            return self.slots[slot]
        for key, setting in self.slots.items():
            if key.startswith("re:") and re.search(key[3:], slot):
                return setting
        return None

    def codec_for_setting(self, setting: dict) -> Codec:
        """The codec a setting gives a codec slot (``ExactCodec`` for ``"codec": "exact"``);
        what the setting leaves out is the config's (``hf_actq.codecs.settings``)."""
        return codec_for_setting(setting, self.default_setting())


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_activation_setting(setting) -> None:
    """ValueError unless ``setting`` is a few-bit slot's (``...:act``) setting: ``{"bits": 1..4}``
    (a standalone activation's slot may take a codec setting instead, checked as any other)."""
    if not isinstance(setting, dict) or set(setting) != {"bits"}:
        raise ValueError(
            f"a few-bit slot's setting is {{'bits': 1..4}} (or, for a standalone activation, "
            f"a codec setting), got {setting!r}"
        )
    bits = setting["bits"]
    if isinstance(bits, bool) or bits not in (1, 2, 3, 4):
        raise ValueError(f"a few-bit slot's bits must be an integer in 1..4, got {bits!r}")


def _with_recipe(name, given: dict) -> dict:
    """The fields of recipe ``name`` with the ``given`` ones over them."""
    if name == "fewbit":
        # Nothing but the activation derivatives changes: no fused loss (it drops the logits).
        off = ("linear", "norm", "gated_mlp", "attention", "dropout", "fused_loss")
        return {"bits": 3, **dict.fromkeys(off, False), **given}
    if name == "uniform":
        return dict(given)
    if name == "alam":
        # As ALAM's code runs it: its sensitivity on one example after the first step, its
        # ladder and accounting, K packed along the sequence, and no norm output shared with
        # the next linears (its calibration would measure a slot training never packs).
        base = {
            "codec": "aq",
            "bits": 1,
            "adaptive": True,
            "calibration_examples": 1,
            "calibration_step": 1,
            "key_layout": "sequence",
            "share_norm_outputs": False,
        }
        return {**base, **given}
    if name == "checkpoint":
        # ``bits`` is the checkpointed inputs' precision unless checkpoint_bits is given. The
        # other slots are few and outside the repeated layers (embeddings, pooler, heads): 8
        # bits costs little there, and at 4 bits they alone cost MiniLM's gradient 0.05 of
        # cosine.
        given = dict(given)
        layers = given.pop("bits", 4) if "checkpoint_bits" not in given else 4
        return {"bits": 8, "checkpoint_bits": layers, "compress_checkpointed": False, **given}
    raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")


# Fields that were removed, with the value that meant what the config does now, and why the
# others cannot be honoured. Configs saved before (a run's results) still load where the value
# did not matter (a config that is not adaptive) or meant today's behaviour.
RETIRED_FIELDS = {
    "sensitivity": (
        "alam",
        "our own allocator (sensitivity='gradvar' or 'gradnormvar') was retired on 2026-11-27: "
        "per parameter group it lost to ALAM's at the same bytes and it trained worse on GLUE "
        "(docs/reference.md, 'ALAM as published'); adaptive=True is ALAM's allocation",
    ),
    "chain_bits": (None, "chain_bits floored our retired allocator's candidates"),
}


def _without_retired(kwargs: dict) -> dict:
    """``kwargs`` less retired fields; ValueError for one that would change an adaptive plan."""
    kept = dict(kwargs)
    adaptive = kept.get("adaptive", kept.get("recipe") == "alam")
    for name, (current, why) in RETIRED_FIELDS.items():
        if name in kept:
            value = kept.pop(name)
            if adaptive and value != current:
                raise ValueError(f"{name}={value!r} is no longer supported: {why}")
    return kept


def _resolving_recipes(generated_init):
    """Wrap the dataclass ``__init__`` so that a named recipe is that recipe wherever the config
    is built (``ActQConfig(recipe=...)``, ``from_dict``, ``ActQCallback(recipe=...)``): the
    recipe's fields first, the ones given explicitly over them. ``dataclasses.replace`` and
    ``from_dict(to_dict())`` give every field, so they change nothing. An unknown field is a
    ValueError that names it."""
    signature = inspect.signature(generated_init)
    known = [name for name in signature.parameters if name != "self"]

    @functools.wraps(generated_init)
    def __init__(self, *args, **kwargs):
        kwargs = _without_retired(kwargs)
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown ActQConfig field {unknown[0]!r}{hint}; the fields are {', '.join(known)}"
            )
        if len(args) > len(known):
            raise ValueError(f"ActQConfig takes at most {len(known)} positional fields")
        given = {**dict(zip(known, args)), **kwargs}
        recipe = given.get("recipe")
        if recipe is not None:
            if not isinstance(recipe, str):
                raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
            given = _with_recipe(recipe, given)
        generated_init(self, **given)

    return __init__


ActQConfig.__init__ = _resolving_recipes(ActQConfig.__init__)
