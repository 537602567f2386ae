from __future__ import annotations

import os

from .run import main

# ``paramctl drill`` runs this module as a program of its own; its name shows in the help.
raise SystemExit(main(prog=os.environ.get("PARAMS_DRILL_PROG", "python -m deploy.drills")))
