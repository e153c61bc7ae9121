"""The layouts of configs/recipes/: for each recipe and GPU count, the planner's fastest layout
that fits 80 GB GPUs (recipes/planner.py), and whether the recipe's own layout for that count
fits. What the recipes' ``layouts`` were chosen from:

    .venv/bin/python bench/plan_recipes.py [--gpus 1 2 4 8 16 32 64] [--recipe NAME ...] [--json]
    .venv/bin/python bench/plan_recipes.py --write   # each recipe's ``layouts``: the best per count

Each recipe is estimated on its model YAML of the same name in configs/ (the published shapes)
under its family's Mantis train config (``Recipe.mantis_config``), with the recipe applied by name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent


def recipe_config(name: str, gpus: int | None, *extra: str):
    """The run config of recipe ``name`` on its model YAML (``gpus``: with its layout)."""
    from recipes.model_recipes import load
    from recipes.run_config import load_run_config

    recipe = load(REPO / "configs" / "recipes" / f"{name}.yaml")
    return load_run_config(recipe.mantis_config(), [f"model.base=configs/{name}.yaml",
                                                    f"recipe={name}", *extra], world=gpus)


#: what a recipe's layout sets (the global batch stays the recipe's, grad_accum follows it)
LAYOUT_KEYS = ("parallel.", "train.micro_batch_size", "model.recompute",
               "task_encoder.fixed_length", "train.distributed_optimizer")


def write_layouts(path: Path, best: dict, gpu_gib: float) -> None:
    """Replace the ``layouts:`` block at the end of recipe ``path`` with ``best`` (GPUs -> the
    planner's suggestion): one flow mapping per count."""
    text = path.read_text()
    text = text[: text.index("layouts:")] if "layouts:" in text else text
    lines = [f"layouts:  # GPUs -> layout (bench/plan_recipes.py --write: the planner's fastest "
             f"that fits {gpu_gib:g} GiB)"]
    for gpus, suggestion in sorted(best.items()):
        nested: dict = {}
        for item in suggestion.overrides:
            key, value = item.split("=", 1)
            if not key.startswith(LAYOUT_KEYS) or item == "train.distributed_optimizer=true":
                continue
            section, leaf = key.split(".", 1)
            nested.setdefault(section, {})[leaf] = value
        body = ", ".join(f"{section}: {{{', '.join(f'{k}: {v}' for k, v in leaves.items())}}}"
                         for section, leaves in nested.items())
        lines.append(f"  {gpus}: {{{body}}}  # {suggestion.gib:.1f} GiB")
    path.write_text(text.rstrip("\n") + "\n" + "\n".join(lines) + "\n")


def main() -> int:
    from contract.console import KnownWarnings
    from recipes.estimate import GIB, Layout, estimate_layout, fits, run_table, uses_bf16
    from recipes.model_recipes import all_recipes
    from recipes.planner import suggest_layouts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--recipe", nargs="*", default=None)
    parser.add_argument("--gpu-memory", type=float, default=78.0,
                        help="GiB per GPU (an 80 GB H100: about 78-79 GiB to torch)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true",
                        help="Replace each recipe's layouts with the best layout per GPU count.")
    args = parser.parse_args()
    KnownWarnings(enabled=True)
    rows = []
    for recipe in all_recipes():
        if args.recipe and recipe.name not in args.recipe:
            continue
        tick = time.perf_counter()
        base = recipe_config(recipe.name, None)
        table = run_table(base)
        fastest = {}
        for gpus in args.gpus:
            found = suggest_layouts(base, gpus, args.gpu_memory, table=table, bf16_state=False)
            if found:
                fastest[gpus] = found[0]
            chosen = recipe.layout_for(gpus)
            own = None
            if chosen is not None:
                ours = recipe_config(recipe.name, gpus)
                estimates = estimate_layout(table, ours, gpus, Layout.of(ours),
                                            uses_bf16(ours.train, True))
                own = {"gpus": chosen[0], "gib": round(max(e.total for e in estimates) / GIB, 1),
                       "fits": fits(estimates, args.gpu_memory)}
            rows.append({"recipe": recipe.name, "gpus": gpus, "layouts_that_fit": len(found),
                         "best": found[0].as_dict() if found else None, "recipe_layout": own})
            if not args.json:
                line = found[0].line() if found else "none fits"
                mine = (f"recipe layout ({own['gpus']} GPUs): {own['gib']} GiB "
                        f"{'fits' if own['fits'] else 'DOES NOT FIT'}" if own else "no layout")
                print(f"{recipe.name:22s} {gpus:3d} GPUs: {len(found):4d} fit; best {line}; "
                      f"{mine}", flush=True)
        if args.write:
            write_layouts(recipe.path, fastest, args.gpu_memory)
        if not args.json:
            print(f"{recipe.name}: {time.perf_counter() - tick:.1f} s", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
