"""`flylocal bench`: methods side by side on the same prompts (docs/bench.md, "Methods side by side"):
the methods (methods), the prompts (prompts), the interleaved run (run), the report
(report), and llama-cpp-python's own generation as a point of comparison (baseline)."""

from flylocal.front.bench.methods import METHODS, Method, parse_methods
from flylocal.front.bench.prompts import (Prompt, encode_all, group_of, humaneval_prompts, load_prompts, of_categories,
                                          passes, per_group, stop_code)
from flylocal.front.bench.report import Row, machine_info, metrics, write_results
from flylocal.front.bench.run import main, run

__all__ = ["METHODS", "Method", "Prompt", "Row", "encode_all", "group_of", "humaneval_prompts", "load_prompts", "machine_info",
           "main", "metrics", "of_categories", "parse_methods", "passes", "per_group", "run", "stop_code",
           "write_results"]
