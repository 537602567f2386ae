from __future__ import annotations

from paramserver.server.cli import main

raise SystemExit(main())
