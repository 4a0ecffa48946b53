"""Several runs of one recipe in one launch, one after the other in the same processes (the imports and the
process group paid once)::

    accelerate launch ... tests/scripts/recipe_runs.py RECIPE OPTIONS... [--then OPTIONS...]...

runs ``recipes/RECIPE.py``'s ``main(OPTIONS)`` for each ``--then``-separated set of options, each with an
``--output_dir`` of its own. Exits 1 at the first run that returns no results.
"""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "recipes")
sys.path.insert(0, ROOT)

from tests.trainer_utils import end_process_group, split_runs  # noqa: E402


def main(argv: list[str]) -> int:
    recipe, rest = argv[0], argv[1:]
    sys.path.insert(0, RECIPES)
    spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", os.path.join(RECIPES, f"{recipe}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for run in split_runs(rest):
        if module.main(run) is None:
            return 1
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
