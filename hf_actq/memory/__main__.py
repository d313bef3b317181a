import sys

from hf_actq.memory.cli import main

sys.exit(main())
