"""``BitPlan``: a setting for every compressed slot of a model, keyed by slot id, as JSON.

A plan is one use of ``ActQConfig.slots`` (per-slot settings): every slot gets exactly the
setting the plan names, and a plan that does not name exactly the model's slots is refused with
the first missing or extra slot id. Codec slots take ``{"codec", "bits", "group_size"}`` (as in
``ActQConfig``); few-bit slots (``...:act``) take ``{"bits": 1..4}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "hf_actq.bitplan/1"


@dataclass
class BitPlan:
    """``slots``: slot id -> setting. ``target_bits``: the average it was allocated for.
    ``info``: how it was made (sensitivities, bytes, budget, time), for reports."""

    slots: dict[str, dict]
    target_bits: float | None = None
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "target_bits": self.target_bits,
            "slots": self.slots,
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, data: dict) -> BitPlan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a bit plan: expected a dict with format {FORMAT!r}")
        slots = data.get("slots")
        if not isinstance(slots, dict) or not all(isinstance(v, dict) for v in slots.values()):
            raise ValueError("a bit plan's 'slots' must map slot ids to settings")
        return cls(dict(slots), data.get("target_bits"), dict(data.get("info") or {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BitPlan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as error:
            raise ValueError(f"bit plan {str(path)!r} does not exist") from error
        except json.JSONDecodeError as error:
            raise ValueError(f"bit plan {str(path)!r} is not valid JSON ({error})") from error
        return cls.from_dict(data)

    def check_slots(self, slots) -> None:
        """Raise ValueError unless the plan names exactly ``slots`` (the model's slot ids)."""
        wanted = list(slots)
        missing = [s for s in wanted if s not in self.slots]
        extra = [s for s in self.slots if s not in set(wanted)]
        if missing or extra:
            what = (
                f"has no setting for slot {missing[0]!r}"
                if missing
                else f"names slot {extra[0]!r}, which this model does not have"
            )
            raise ValueError(
                f"bit plan does not match the model: it {what} ({len(missing)} missing, "
                f"{len(extra)} extra of {len(wanted)} slots); was it made for another model or "
                "another ActQConfig?"
            )

    def summary(self, kinds: dict[str, str]) -> dict[str, dict[str, int]]:
        """Slots per kind and setting, e.g. ``{"attention": {"uniform 4": 12, ...}}``."""
        table: dict[str, dict[str, int]] = {}
        for slot, setting in self.slots.items():
            counts = table.setdefault(kinds.get(slot, "other"), {})
            label = describe(setting)
            counts[label] = counts.get(label, 0) + 1
        return table


def describe(setting: dict) -> str:
    codec = setting.get("codec")
    if codec is None:
        return f"few-bit {setting['bits']}"
    if codec == "exact":
        return "exact"
    group = setting.get("group_size") or 1
    return f"{codec} {setting['bits']}" + (f"/{group}" if group > 1 else "")
