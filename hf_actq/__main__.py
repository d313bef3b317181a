"""``hf-actq`` console command."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "train a tiny BERT with exact and few-bit GELU side by side (default)",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: hf-actq [COMMAND] [OPTIONS]\n\ncommands:")
        for name, help_text in COMMANDS.items():
            print(f"  {name:8s} {help_text}")
        return 0
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "demo"
    if command not in COMMANDS:
        print(f"hf-actq: unknown command {command!r}; choose from {', '.join(COMMANDS)}")
        return 2
    from hf_actq import demo

    return demo.main(argv)


if __name__ == "__main__":
    sys.exit(main())
