"""Two ``make demo`` outputs side by side: is every logged loss and val_loss of every run identical
(to the last digit of the float), and are the evals' scores and budget counters equal?

    python bench/compare_demos.py BEFORE_DEMO_DIR AFTER_DEMO_DIR

Prints one line per run (values compared, the first difference if any) and per eval; exits 1 when
anything differs. What a renovation that must not change behaviour is checked with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def losses(run: Path) -> list[tuple]:
    """(step, key, value) of every loss / val_loss record of a run's metrics.jsonl."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out += [(record.get("step"), key, record[key]) for key in ("loss", "val_loss")
                if key in record]
    return out


def scores(folder: Path) -> dict:
    """An eval's scores.json without what names the folder or times the run (scores, counts,
    budget counters), and its predictions."""
    summary = json.loads((folder / "scores.json").read_text())
    kept = {k: v for k, v in summary.items() if k not in ("checkpoint", "data", "generation")}
    kept["generation"] = {k: v for k, v in summary.get("generation", {}).items()
                          if not k.endswith(("_s", "_seconds"))}  # timings differ run to run
    return {**kept, "predictions": [json.loads(line)["prediction"] for line in
                                    (folder / "predictions.jsonl").read_text().splitlines()]}


def main(before: Path, after: Path) -> int:
    differ = 0
    for run in sorted((before / "runs").iterdir()):
        old, new = losses(run), losses(after / "runs" / run.name)
        first = next((f"{a} vs {b}" for a, b in zip(old, new) if a != b), None)
        same = first is None and len(old) == len(new)
        differ += not same
        print(f"{run.name}: {len(old)} values, {'identical' if same else 'DIFFER: ' + str(first)}")
    for folder in sorted((before / "eval").iterdir()):
        same = scores(folder) == scores(after / "eval" / folder.name)
        differ += not same
        print(f"eval {folder.name}: {'identical' if same else 'DIFFER'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
