"""`make lab` (python -m bench.lab): real vLLM engines behind each router in turn."""

import sys

from bench.lab.run import main

sys.exit(main())
