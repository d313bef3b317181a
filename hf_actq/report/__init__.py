"""Memory reports (``hf-actq memory``): one training step of a model per recipe, measured side by
side, and the presets, recipe strings and command line around it.

``measure.py`` runs the steps, ``models.py`` builds the models, ``recipes.py`` reads recipe
strings, ``results.py`` holds the measurements and writes them (JSON, Markdown), ``plots.py`` draws
them, ``presets.py`` names model shapes, ``cli.py`` is the command.
"""

from hf_actq.report.measure import measure_model
from hf_actq.report.models import build_model, default_task
from hf_actq.report.presets import PRESETS, preset_config
from hf_actq.report.recipes import CHUNKED_LOSS, STOCK_CHECKPOINTING, parse_recipe
from hf_actq.report.results import Measurement, MemoryReport, RecipeResult

__all__ = [
    "CHUNKED_LOSS",
    "STOCK_CHECKPOINTING",
    "PRESETS",
    "Measurement",
    "MemoryReport",
    "RecipeResult",
    "build_model",
    "default_task",
    "measure_model",
    "parse_recipe",
    "preset_config",
]
