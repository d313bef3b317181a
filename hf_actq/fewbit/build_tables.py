"""Build the shipped few-bit tables: ``python -m hf_actq.fewbit.build_tables [--output PATH]``."""

from __future__ import annotations

import argparse
import json
import time

from hf_actq.fewbit.activations import ACTIVATIONS
from hf_actq.fewbit.dp import MAX_BITS, optimal_tables
from hf_actq.fewbit.tables import SHIPPED_SETTINGS, TABLES_PATH


def shipped_table_names() -> list[str]:
    """One entry per distinct derivative (gelu_new and gelu_fast share gelu_tanh's table)."""
    return sorted({spec.table_name for spec in ACTIVATIONS.values() if spec.table_name})


def build(names=None) -> dict:
    tables = {}
    for name in names or shipped_table_names():
        solved = optimal_tables(name, tuple(range(1, MAX_BITS + 1)), **SHIPPED_SETTINGS)
        tables[name] = {str(bits): table.to_dict() for bits, table in solved.items()}
    settings = dict(SHIPPED_SETTINGS, interval=list(SHIPPED_SETTINGS["interval"]))
    return {"settings": settings, "tables": tables}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", default=str(TABLES_PATH))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data = build()
    with open(args.output, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    for name, by_bits in data["tables"].items():
        errors = "  ".join(f"{b}-bit {t['error']:.4f}" for b, t in by_bits.items())
        print(f"{name:12s} {errors}")
    print(f"wrote {args.output} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
