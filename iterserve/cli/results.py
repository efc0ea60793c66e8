"""Where the bench and simulate commands write their results: one JSON file per run, its folder made; and
whether they may draw a timing figure at all."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def write_json(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {path}")


def add_allow_busy_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--allow-busy", action="store_true",
                   help="draw timing figures even when other processes kept the machine busy during the run "
                        "(refused by default; the figure's stamp says busy)")
