from __future__ import annotations

import sys

from backends.sim.cli import main

sys.exit(main())
