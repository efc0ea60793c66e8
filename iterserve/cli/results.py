"""Where the bench and simulate commands write their results: one JSON file per run, its folder made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {path}")
