"""``hf-actq`` console command."""

from __future__ import annotations

import sys

COMMANDS = {
    "memory": "measure activation and peak memory per recipe on a model (default)",
    "demo": "train a tiny BERT with exact and few-bit GELU side by side",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: hf-actq [COMMAND] [OPTIONS]\n\ncommands:")
        for name, help_text in COMMANDS.items():
            print(f"  {name:8s} {help_text}")
        return 0
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "memory"
    if command not in COMMANDS:
        print(f"hf-actq: unknown command {command!r}; choose from {', '.join(COMMANDS)}")
        return 2
    if command == "memory":
        from hf_actq.report.cli import main as memory_main

        return memory_main(argv)
    from hf_actq import demo

    return demo.main(argv)


if __name__ == "__main__":
    sys.exit(main())
