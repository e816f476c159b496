"""The run report: `report.html` with PNG plots, built from a workflow run's result files.

`collect.py` reads what the stages wrote (per-epoch metrics, summaries, validations, the
evaluation); `render.py` draws the plots (matplotlib, Agg backend) and writes the HTML,
with the recipe and overrides the run was drawn with (`RecipeShown`).
Neither changes any result file.
"""

from rl_core.report.collect import RunData, collect_run
from rl_core.report.render import RecipeShown, build_report

__all__ = ["RecipeShown", "RunData", "build_report", "collect_run"]
