"""What a slot gets: the one resolution of per-slot settings that every patcher uses."""

from __future__ import annotations

from hf_actq.codecs.packed import Codec
from hf_actq.config import ActQConfig
from hf_actq.ops.fewbit_activation import ActivationTable


def slot_codec(config: ActQConfig, slot_id: str, default: Codec | None) -> Codec | None:
    """The codec of codec slot ``slot_id``: its per-slot setting's, else ``default``."""
    setting = config.setting_for(slot_id)
    return default if setting is None else config.codec_for_setting(setting)


def slot_activation(found, config: ActQConfig, slot_id: str) -> ActivationTable:
    """The few-bit table of activation slot ``slot_id`` (``found``: the activation's name and
    parameters)."""
    setting = config.setting_for(slot_id) or {}
    # A codec setting keeps the input instead: the table is the config's, used on no code.
    bits = (
        config.activation_bits
        if "codec" in setting
        else setting.get("bits", config.activation_bits)
    )
    try:
        return ActivationTable(found[0], bits, found[1])
    except ValueError as error:
        raise ValueError(f"slots[{slot_id!r}]: few-bit slots take bits 1..4 ({error})") from error
