"""Fill-in-the-middle completion speed, as an editor waits on it: copy-heavy cases (a line
inside a function whose names repeat above and below the cursor), each sent to /infill of
flylocal's default and of plain decoding (and of llama-server's /infill with
--llama-server), the servers taking turns; the time to the whole completion, its median per
server and the per-case ratios with a 95% interval.

With no --target, the model is SmolLM2 with three of its control tokens named FIM's in its
GGUF (the tests' FIM model, written to a temporary folder): no model of the registry has FIM
tokens. Its middles are noise; what it measures is how fast a middle comes.

    .venv/bin/python scripts/bench/fim.py [--target FIM.gguf] [--llama-server PATH] [--repeat 3] [--n-predict 48]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from harness import ROOT, flylocal_serve, interval, median, servers

sys.path.insert(0, str(ROOT / "tests"))

from fim_model import fim_smollm2  # noqa: E402

CASES = [
    ("class Account:\n    def __init__(self, owner, balance):\n        self.owner = owner\n        self.balance = "
     "balance\n\n    def deposit(self, amount):\n        self.balance = self.balance + amount\n\n"
     "    def withdraw(self, amount):\n        self.balance = ",
     "\n\n    def report(self):\n        return f\"{self.owner}: {self.balance}\"\n"),
    ("def parse_config(config_path, config_defaults):\n    config_values = dict(config_defaults)\n"
     "    with open(config_path) as config_file:\n        for config_line in config_file:\n            ",
     "\n    return config_values\n\n\ndef save_config(config_path, config_values):\n    with open(config_path, \"w\") "
     "as config_file:\n        for key, value in config_values.items():\n            config_file.write(f\"{key}={value}\\n\")\n"),
    ("function renderUserList(userList, userFilter) {\n  const visibleUsers = userList.filter(userFilter);\n"
     "  const userItems = visibleUsers.map((user) => `<li>${user.name}</li>`);\n  return ",
     ";\n}\n\nfunction renderUserCount(userList, userFilter) {\n  const visibleUsers = userList.filter(userFilter);\n"
     "  return `${visibleUsers.length} users`;\n}\n"),
    ("SELECT orders.order_id, orders.customer_id, customers.customer_name\nFROM orders\nJOIN customers ON ",
     "\nWHERE orders.order_date >= '2024-01-01'\nORDER BY orders.order_id;\n"),
    ("def matrix_add(left_matrix, right_matrix):\n    return [[left_matrix[row][col] + right_matrix[row][col] for col "
     "in range(len(left_matrix[0]))] for row in range(len(left_matrix))]\n\n\ndef matrix_sub(left_matrix, "
     "right_matrix):\n    return ",
     "\n\n\ndef matrix_mul(left_matrix, right_matrix):\n    return [[sum(left_matrix[row][k] * right_matrix[k][col] "
     "for k in range(len(right_matrix))) for col in range(len(right_matrix[0]))] for row in range(len(left_matrix))]\n"),
    ("struct Point { double x; double y; };\n\ndouble point_distance(struct Point a, struct Point b) {\n"
     "    double dx = a.x - b.x;\n    double dy = ",
     ";\n    return sqrt(dx * dx + dy * dy);\n}\n"),
]


def timed(url: str, prefix: str, suffix: str, n_predict: int) -> tuple[float, int]:
    """(seconds to the whole middle, its tokens)."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/infill", json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": n_predict,
                                          "temperature": 0, "cache_prompt": True}, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["tokens_predicted"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="a GGUF with FIM tokens (default: the tests' SmolLM2 with FIM ids)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server, to compare its /infill")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or fim_smollm2(tmp)
        common = ("--target", target, "--threads", str(args.threads), "--parallel", "1", "--ctx", "2048")
        commands = {"default": flylocal_serve(*common), "plain": flylocal_serve(*common, "--drafter", "none",
                                                                                   "--verifier", "strict")}
        if args.llama_server:
            commands["llama-server"] = [args.llama_server, "-m", target, "--port", "{port}", "--host", "127.0.0.1",
                                        "-c", "2048", "-np", "1", "-t", str(args.threads), "--no-webui"]
        with servers(commands) as urls:
            seconds: dict[str, list[float]] = {name: [] for name in urls}
            tokens: dict[str, list[int]] = {name: [] for name in urls}
            for _ in range(args.repeat):
                for prefix, suffix in CASES:
                    for name, url in urls.items():
                        s, n = timed(url, prefix, suffix, args.n_predict)
                        seconds[name].append(s)
                        tokens[name].append(n)
    print(f"{len(CASES)} copy-heavy cases x {args.repeat}, /infill, n_predict {args.n_predict}, greedy; seconds to "
          f"the whole middle")
    print("| server | median s | tokens | / plain: median (95% interval) |\n| --- | --- | --- | --- |")
    for name in seconds:
        ratios = [p / s for p, s in zip(seconds["plain"], seconds[name])]          # > 1: faster than plain
        lo, hi = interval(ratios)
        print(f"| {name} | {median(seconds[name]):.3f} | {sum(tokens[name])} | "
              f"{median(ratios):.2f}x ({lo:.2f}-{hi:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
