from __future__ import annotations

from .run import main

raise SystemExit(main())
