"""flylocal's llama-server endpoints against llama-server's own, on the same model and the same
requests: /tokenize (with and without pieces), /detokenize, /apply-template, and the prompt
/infill builds (with and without input_extra; compared as the number of tokens evaluated and,
as the greedy token that follows it). Prints one line per check: same, or both answers.

With no --target, the model is the tests' SmolLM2 with FIM ids (tests/fim_model.py).

    .venv/bin/python scripts/bench/parity.py --llama-server PATH [--target FIM.gguf]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from harness import ROOT, flylocal_serve, servers

sys.path.insert(0, str(ROOT / "tests"))

from fim_model import fim_smollm2  # noqa: E402

TEXTS = ["Hello world", "def f(x):\n    return x * 2\n", "Ünïcödé 日本語 <|im_start|> text", "  spaces\t\ttabs\n\n"]
MESSAGES = [[{"role": "user", "content": "Hi"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."},
             {"role": "assistant", "content": "The Nile."}, {"role": "user", "content": "Another?"}]]
INFILL = [{"input_prefix": "def area(w, h):\n    return ", "input_suffix": "\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"},
          {"input_prefix": "x = 1\ny = ", "input_suffix": "\nprint(x + y)\n", "prompt": "x",
           "input_extra": [{"filename": "a.py", "text": "X = 3\n"}, {"filename": "b.py", "text": "Y = 4\n"}]}]


def post(url: str, path: str, body: dict) -> dict:
    import httpx

    r = httpx.post(url + path, json=body, timeout=120)
    return {"status": r.status_code, **(r.json() if r.headers.get("content-type", "").startswith("application/json")
                                        else {"text": r.text})}


def checks(urls: dict[str, str]):
    ours, theirs = urls["flylocal"], urls["llama-server"]
    for text in TEXTS:
        for body in ({"content": text}, {"content": text, "with_pieces": True},
                     {"content": text, "add_special": True, "parse_special": False}):
            yield f"/tokenize {body}", post(ours, "/tokenize", body), post(theirs, "/tokenize", body)
        ids = post(theirs, "/tokenize", {"content": text})["tokens"]
        yield f"/detokenize of {text!r}", post(ours, "/detokenize", {"tokens": ids}), \
            post(theirs, "/detokenize", {"tokens": ids})
    for messages in MESSAGES:
        yield f"/apply-template {len(messages)} messages", post(ours, "/apply-template", {"messages": messages}), \
            post(theirs, "/apply-template", {"messages": messages})
    for body in INFILL:        # the prompt: its length, and the greedy token that follows it
        a = post(ours, "/infill", body | {"n_predict": 1, "temperature": 0})
        b = post(theirs, "/infill", body | {"n_predict": 1, "temperature": 0})
        files = len(body.get("input_extra", []))
        yield f"/infill, {files} files: prompt tokens", a.get("tokens_evaluated"), b.get("tokens_evaluated")
        yield f"/infill, {files} files: the first token", a.get("content"), b.get("content")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--target")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = args.target or fim_smollm2(tmp)
        commands = {"flylocal": flylocal_serve("--target", target, "--ctx", "4096", "--parallel", "1",
                                               "--batch-size", "2048", "--drafter", "none", "--verifier", "strict"),
                    "llama-server": [args.llama_server, "-m", target, "--port", "{port}", "--host", "127.0.0.1",
                                     "-c", "4096", "-np", "1", "-b", "2048", "--no-webui", "--jinja"]}
        same = differ = 0
        with servers(commands) as urls:
            for name, a, b in checks(urls):
                strip = {"status"}
                a = {k: v for k, v in a.items() if k not in strip} if isinstance(a, dict) else a
                b = {k: v for k, v in b.items() if k not in strip} if isinstance(b, dict) else b
                if a == b:
                    same += 1
                    print(f"same  {name}")
                else:
                    differ += 1
                    print(f"DIFF  {name}\n  flylocal:     {str(a)[:300]}\n  llama-server: {str(b)[:300]}")
    print(f"{same} same, {differ} different")
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
