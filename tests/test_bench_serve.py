"""`flylocal bench serve`: servers side by side (flylocal.front.bench.serve).

The fast tests measure servers that speak OpenAI's streamed API from a thread here (the
servers a user points the command at: any OpenAI-compatible one), so what the command sends,
counts and reports is checked without llama.cpp; the slow test starts flylocal's own servers
on SmolLM2 and checks that they answer, are compared and are stopped."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flylocal.errors import FlylocalError
from flylocal.front.bench import serve as sb

ROOT = Path(__file__).resolve().parents[1]


class Fake:
    """An OpenAI-compatible streaming server on a loopback port: `words` chunks an answer, each
    after `delay` seconds; every request body is kept in `bodies`; `usage` False sends none;
    `fail` answers every completion with 500; its first `calibrating` answers say, as a flylocal
    server's report does, that its cost curves are still being measured."""

    def __init__(self, words=4, delay=0.0, usage=True, fail=False, calibrating=0):
        self.words, self.delay, self.usage, self.fail, self.bodies = words, delay, usage, fail, []
        self.calibrating = calibrating
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                body = b'{"data": []}' if self.path == "/v1/models" else b"{}"
                self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append((self.path, req))
                if fake.fail:
                    self.send_response(500)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"boom")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                raw = self.path == "/v1/completions"
                for i in range(fake.words):
                    time.sleep(fake.delay)
                    choice = {"text": f" w{i}"} if raw else {"delta": {"content": f" w{i}"}}
                    self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                    self.wfile.flush()
                if fake.usage:
                    usage = {"choices": [], "usage": {"completion_tokens": 2 * fake.words, "prompt_tokens": 5}}
                    if len(fake.bodies) <= fake.calibrating:
                        usage["usage"]["flylocal"] = {"rounds": 3, "calibrating": True}
                    self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    made = []

    def make(**kw):
        made.append(Fake(**kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def parse(spec, **kw):
    args = dict(target="smollm2-135m-instruct", target_path="/m/t.gguf", draft_path=None, ctx=2048, threads=None,
                llama_server=None, model=None)
    return sb.parse_server(spec, **{**args, **kw})


def test_configurations_by_name_url_checkout_and_command():
    fly = parse("fly-pld")
    assert fly.flylocal and fly.own_model and fly.url is None
    assert fly.command[fly.command.index("--drafter") + 1] == "pld" and "--parallel" in fly.command
    assert fly.command[fly.command.index("--verifier") + 1] == "fly"
    mla = parse("fly-mla", draft_path="/m/d.gguf")
    assert mla.command[mla.command.index("--draft") + 1] == "/m/d.gguf"
    with pytest.raises(FlylocalError, match="needs a draft model"):
        parse("strict-mla")
    serial = parse("serial=flylocal --parallel 1")
    assert serial.command.count("--parallel") == 1 and serial.command[serial.command.index("--parallel") + 1] == "1"
    here = parse(f"before=flylocal@{ROOT} --drafter none")
    assert here.cwd == str(ROOT) and here.env["PYTHONPATH"] == str(ROOT)
    with pytest.raises(FlylocalError, match="no checkout"):
        parse("before=flylocal@/nowhere/at/all")
    ollama = parse("ollama=http://127.0.0.1:11434/v1/#llama3.2:1b")
    assert (ollama.url, ollama.model, ollama.own_model, ollama.flylocal) == ("http://127.0.0.1:11434", "llama3.2:1b",
                                                                             False, False)
    ngram = parse("llama-server-ngram", llama_server="/bin/llama-server", threads=2)
    assert ngram.command[:3] == ["/bin/llama-server", "-m", "/m/t.gguf"] and "ngram-mod" in ngram.command
    assert ngram.command[ngram.command.index("-np") + 1] == "{clients}" and "-t" in ngram.command
    with pytest.raises(FlylocalError, match="--llama-server PATH"):
        parse("llama-server")
    cmd = parse("lcp=python -m llama_cpp.server --model {target} --port {port}")
    assert cmd.command == ["sh", "-c", "python -m llama_cpp.server --model /m/t.gguf --port {port}"] and cmd.own_model
    with pytest.raises(FlylocalError, match=r"\{port\}"):
        parse("x=python -m something")
    with pytest.raises(FlylocalError, match="unknown configuration 'fast'"):
        parse("fast")


def test_questions_take_the_groups_in_turn_with_turns_words_and_repeats(tmp_path):
    convs = sb.conversations(None, None, 2, 0, 1, None, 1)
    groups = [label.split()[0] for label, _ in convs]
    assert groups == ["multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag"] * 2
    assert all(len(turns) == 1 for _, turns in convs)
    held = sb.conversations(None, "multi-turn", 1, 3, 2, None, 1)
    assert len(held) == 1 and len(held[0][1]) == 2
    assert held[0][0] not in [label for label, _ in sb.conversations(None, "multi-turn", 3, 0, 1, None, 1)]
    long = sb.conversations(None, "qa", 2, 0, 1, 300, 2)
    assert len(long) == 4 and long[:2] == long[2:]
    assert all(len(turns[0].split()) >= 300 and turns[0].startswith("Background:\n") for _, turns in long)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(5)))
    assert [turns for _, turns in sb.conversations(str(mine), None, None, 0, 1, None, 1)] == \
        [[f"Say {i}."] for i in range(5)]
    with pytest.raises(FlylocalError, match="no questions left"):
        sb.conversations(str(mine), None, None, 9, 1, None, 1)


def test_context_pads_with_other_questions_whole_texts_to_about_n_tokens():
    from flylocal.front.bench.prompts import data_dir, load_prompts

    texts = {p.text for p in load_prompts(str(data_dir() / "spec_bench"))}
    words = lambda text: len(text.split())                               # noqa: E731
    for n in (1000, 6000):
        convs = sb.conversations(None, None, 1, 2, 1, None, 1, n, words)
        backgrounds = set()
        for label, (turn,) in convs:
            assert n - 60 <= words(turn) <= n + 5 or words(turn.split("\n\n")[-1]) > n - 60, label
            docs = turn.split("\n\n")
            assert docs[0] == "Background:"
            question, others = docs[-1], docs[1:-1]
            whole = [d for d in others if d in texts]
            assert len(whole) >= len(others) - 1                           # only the last may be cut
            assert len(set(others)) == len(others) and question not in others
            backgrounds.add(others[0])
        assert len(backgrounds) == len(convs)        # no two questions share a prefix a cache could reuse
    again = sb.conversations(None, None, 1, 2, 1, None, 3, 2000, words)
    once = sb.conversations(None, None, 1, 2, 1, None, 1, 2000, words)
    assert len(again) == 3 * len(once) and again[:len(once)] == once
    assert [label for label, _ in again] == [label for label, _ in once] * 3
    assert [t[0].split("\n\n")[-1] for _, t in again] == [t[0].split("\n\n")[-1] for _, t in once] * 3
    firsts = [t[0].split("\n\n")[1] for _, t in again]
    assert len(set(firsts)) == len(again)                # a repeat is a fresh prefill, never a cached one
    assert all(2000 - 60 <= words(t[0]) <= 2000 + 5 for _, t in again)
    with pytest.raises(FlylocalError, match="give one"):
        sb.main(server_specs=["a=http://127.0.0.1:9"], base=None, target="smollm2-135m-instruct", draft=None,
                llama_server=None, model=None, prompts=None, category=None, per_category=None, skip=0, turns=1,
                prompt_words=10, context=100, clients=[1], per_client=1, max_tokens=8, repeat=1, raw=False,
                natural=True, ctx=4096, threads=None, pause=0, stagger=0, fixed_order=False, api_key=None,
                timeout=5, json_out=None, say=print)


def test_a_request_past_the_training_context_is_said_before_the_run():
    # llama-server caps its context at the model's training context and refuses longer
    # requests (HTTP 400 on every one at --context 8192 for an 8,192-token model): said first.
    line = sb.past_training(8208, 128, 8192, "smollm2")
    assert "8,336 tokens" in line and "8,192 smollm2 was trained on" in line and "--context 8000 or less" in line
    assert sb.past_training(8000, 128, 8192, "smollm2") is None          # 8,128: within it
    assert sb.past_training(8208, 128, None, "x") is None                # no training context given


def test_a_conversation_sends_each_turn_after_the_answers_before_it(fakes):
    fake = fakes(words=3)
    server = sb.Server("x", url=fake.url, model="m", own_model=True)
    plan = sb.Plan([server], [], max_tokens=7, banned=(2, 5))
    replies = sb.converse(plan, server, fake.url, ["one?", "two?"])
    assert [r.tokens for r in replies] == [6, 6] and all(r.counted and r.error is None for r in replies)
    assert replies[0].text == " w0 w1 w2" and replies[0].start < replies[0].first <= replies[0].last <= replies[0].end
    (p1, b1), (p2, b2) = fake.bodies
    assert p1 == p2 == "/v1/chat/completions" and b1["max_tokens"] == 7 and b1["model"] == "m"
    assert b1["logit_bias"] == {"2": -100, "5": -100} and b1["temperature"] == 0 and b1["stream"]
    assert b2["messages"] == [{"role": "user", "content": "one?"}, {"role": "assistant", "content": " w0 w1 w2"},
                              {"role": "user", "content": "two?"}]
    raw = sb.Plan([server], [], raw=True)
    sb.converse(raw, sb.Server("y", url=fake.url, own_model=False), fake.url, ["one?", "two?"])
    (p3, b3), (p4, b4) = fake.bodies[2:]
    assert p3 == "/v1/completions" and "logit_bias" not in b3 and "model" not in b3
    assert b4["prompt"] == "Question: one?\nAnswer: w0 w1 w2\nQuestion: two?\nAnswer:"


def test_a_failure_is_counted_not_raised_and_chunks_stand_in_for_usage(fakes):
    plan = sb.Plan([], [])
    bad = fakes(fail=True)
    r = sb.request(bad.url, "/v1/chat/completions", {}, 5)
    assert r.error.startswith("HTTP 500") and math.isnan(sb.rates([r])["rate"]) and sb.rates([r])["errors"]
    gone = sb.request("http://127.0.0.1:9", "/v1/chat/completions", {}, 5)
    assert "ConnectionRefusedError" in gone.error
    quiet = fakes(words=5, usage=False)
    replies = sb.converse(plan, sb.Server("q", url=quiet.url), quiet.url, ["hi"])
    assert replies[0].tokens == 5 and not replies[0].counted


def test_a_wave_of_clients_runs_them_at_once(fakes):
    fake = fakes(words=4, delay=0.05)
    server = sb.Server("x", url=fake.url)
    plan = sb.Plan([server], [], stagger=0.0)
    t0 = time.perf_counter()
    replies = sb.wave(plan, server, fake.url, 4, [["a"], ["b"], ["c"], ["d"]])
    took = time.perf_counter() - t0
    assert len(replies) == 4 and {b["messages"][0]["content"] for _, b in fake.bodies} == {"a", "b", "c", "d"}
    # four answers of 0.2 s each: one after another would take 0.8 s
    assert took < 0.6 or max(r.start for r in replies) < min(r.end for r in replies)
    fig = sb.rates(replies)
    assert fig["tokens"] == 32 and fig["requests"] == 4 and not fig["errors"] and len(fig["ttft"]) == 4
    assert fig["rate"] == pytest.approx(32 / fig["wall"])


def wave_fig(rate, decode=None, errors=(), first=0.1):
    return {"tokens": 10, "wall": 10 / rate, "rate": rate, "decode": decode or rate, "ttft": [first], "first": first,
            "errors": list(errors), "requests": 1, "counted": True}


def test_the_report_sets_each_server_against_the_base_wave_by_wave():
    servers = [sb.Server("llama-server", command=["x"]),
               sb.Server("plain", command=["--drafter", "none"], flylocal=True),
               sb.Server("fly-pld", command=["--drafter", "pld"], flylocal=True)]
    plan = sb.Plan(servers, [], base="llama-server")
    got = {"labels": ["qa 1", "rag 2", "qa 3"],
           "llama-server": [wave_fig(10), wave_fig(10), wave_fig(10)],
           "plain": [wave_fig(11), wave_fig(9), wave_fig(10)],
           "fly-pld": [wave_fig(20), wave_fig(15), wave_fig(float("nan"), errors=["HTTP 500: boom"])]}
    text = sb.report(plan, {1: got}, 1)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1 |" in rows["llama-server"]
    assert "1.75 (1.50-2.00), worst 1.50 (rag 2)" in rows["fly-pld"] and rows["fly-pld"].endswith("| 1 |")
    assert "1.00 (0.90-1.10), worst 0.90 (rag 2)" in rows["plain"]
    assert "fly-pld / plain: 1.74 (1.67-1.82), worst 1.67 (rag 2)" in text          # flylocal's plain one
    assert "fly-pld / llama-server (the best of the other servers here)" in text
    assert "fly-pld: 1 request failed, the first: HTTP 500: boom" in text
    assert text.startswith("3 waves of 1 client x 1 conversation of 1 turn")
    assert "interrupted" in sb.report(plan, {1: got, "interrupted": True}, 1)


def test_a_question_asked_again_is_judged_by_the_median_of_its_waves():
    servers = [sb.Server("plain", command=["--drafter", "none"], flylocal=True),
               sb.Server("fly-pld", command=["--drafter", "pld"], flylocal=True)]
    plan = sb.Plan(servers, [], base="plain")
    got = {"labels": ["qa 1", "rag 2", "qa 1", "rag 2", "qa 1", "rag 2"],
           "plain": [wave_fig(10)] * 6,
           "fly-pld": [wave_fig(r) for r in (12, 11, 8, 10.5, 13, 10.8)]}
    row = next(line for line in sb.report(plan, {1: got}, 1).splitlines() if line.startswith("| fly-pld"))
    assert "worst 1.08 (rag 2, the median of 3)" in row            # not the one slow wave of qa 1 (0.80)
    once = {"labels": got["labels"][:2], "plain": got["plain"][:2], "fly-pld": got["fly-pld"][:2]}
    row = next(line for line in sb.report(plan, {1: once}, 1).splitlines() if line.startswith("| fly-pld"))
    assert "worst 1.10 (rag 2) |" in row


def test_the_first_token_is_set_against_the_base_wave_by_wave_its_worst_the_latest():
    servers = [sb.Server("llama-server", command=["x"]),
               sb.Server("plain", command=["--drafter", "none"], flylocal=True),
               sb.Server("fly-mla", command=["--drafter", "mla"], flylocal=True)]
    plan = sb.Plan(servers, [], base="llama-server")
    # each wave's question longer than the last, its first token later: the ratios are level but
    # one wave's, though the two servers' times lie far apart from wave to wave
    got = {"labels": ["qa 1", "rag 2", "math 3", "qa 4"],
           "llama-server": [wave_fig(10, first=f) for f in (1.0, 2.0, 3.0, 4.0)],
           "plain": [wave_fig(10, first=f) for f in (1.0, 2.0, 3.0, 4.0)],
           "fly-mla": [wave_fig(10, first=f) for f in (1.0, 2.6, 3.0, 4.0)]}
    text = sb.report(plan, {1: got}, 1)
    row = next(line for line in text.splitlines() if line.startswith("| fly-mla"))
    assert "| 1.00 (1.00-1.30), worst 1.30 (rag 2) |" in row            # the latest, not the lowest
    assert "; first token 1.00 (1.00-1.30), worst 1.30 (rag 2)" in next(
        line for line in text.splitlines() if line.startswith("fly-mla / plain: "))
    fig = sb.rates([sb.Reply(start=0.0, first=t, last=t + 1.0, end=t + 1.0, tokens=8) for t in (0.5, 0.9, 0.7)])
    assert fig["first"] == pytest.approx(0.7)                      # a wave's first token: its median request's
    assert math.isnan(sb.rates([sb.Reply(start=0.0, error="HTTP 500")])["first"])


def test_warm_up_goes_on_while_a_server_measures_its_cost_curves_and_no_longer(fakes, monkeypatch):
    """A flylocal server whose curves are not yet cached measures them a slice before each
    request: its first requests say so (`calibrating`). The timed waves start once it has
    stopped, or, bounded, say that it has not."""
    server = sb.Server("fly-pld", command=["x"], flylocal=True)
    plan = sb.Plan([server], [], max_tokens=128)
    said = []
    fresh = fakes(calibrating=3)
    assert sb.warm_up(plan, server, fresh.url, said.append) == 4 and not said
    assert [body["max_tokens"] for _, body in fresh.bodies] == [sb.WARM_TOKENS] * 4      # short, uncounted
    cached = fakes()
    assert sb.warm_up(plan, server, cached.url, said.append) == 1 and not said
    monkeypatch.setattr(sb, "WARM_S", 0.0)
    stuck = fakes(calibrating=100)
    assert sb.warm_up(plan, server, stuck.url, said.append) == 1
    assert said == ["fly-pld: still measuring its cost curves after 1 warm-up request (0 s): its first timed "
                    "requests wait up to 0.1 s each for a slice"]


def bench_serve(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "flylocal", "bench", "serve", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300, **kw)


def test_the_command_compares_servers_already_running(fakes):
    fast, slow = fakes(words=6, delay=0.002), fakes(words=6, delay=0.02)
    done = bench_serve("--server", f"fast={fast.url}#m1", "--server", f"slow={slow.url}", "--per-category", "1",
                       "--category", "qa,rag", "--max-tokens", "6", "--pause", "0", "--base", "slow")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| fast") or line.startswith("| slow")]
    assert len(rows) == 2 and rows[1].split(" | ")[4] == "1"
    assert done.stdout.startswith("2 waves of 1 client") and "Traceback" not in done.stderr
    assert {b["model"] for _, b in fast.bodies} == {"m1"} and all("model" not in b for _, b in slow.bodies)
    assert all("logit_bias" not in b for _, b in fast.bodies + slow.bodies)      # not their model's ids
    assert done.stderr.count("wave ") == 2


@pytest.mark.parametrize("args, says", [
    (["--server", "a=http://127.0.0.1:9", "--base", "b"], "--base 'b' is none of the servers: a"),
    (["--server", "a=http://127.0.0.1:9", "--server", "a=http://127.0.0.1:10"], "'a' is used twice"),
    (["--server", "nope"], "unknown configuration 'nope'"),
    (["--server", "a=http://127.0.0.1:9", "--clients", "0"], "not a comma-separated list of client counts"),
    (["--server", "a=http://127.0.0.1:9", "--prompts", "/no/such/file"], "prompts not found"),
    (["--server", "a=flylocal \"--drafter"], "--server a: No closing quotation"),
    (["--server", "a=http://127.0.0.1:9", "--llama-server", "/no/such/llama-server"], "no such program"),
    (["--server", "a=http://127.0.0.1:9", "--json", "/no/such/folder/waves.json"], "cannot write there"),
])
def test_bad_options_get_one_line(args, says):
    done = bench_serve(*args)
    assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_server_that_does_not_come_up_is_left_out_and_a_missing_base_ends_it(fakes):
    fake = fakes(words=2)
    done = bench_serve("--server", f"ok={fake.url}", "--server", "dead=sh -c 'echo cannot start {port}; exit 3'",
                       "--per-category", "1", "--category", "qa", "--max-tokens", "2", "--pause", "0")
    assert done.returncode == 0, done.stderr
    assert "dead: exited (3), left out: cannot start" in done.stderr and "| dead" not in done.stdout
    done = bench_serve("--server", f"ok={fake.url}", "--server", "dead=sh -c 'exit 3 # {port}'", "--base", "dead",
                       "--per-category", "1", "--category", "qa", "--max-tokens", "2")
    assert done.returncode == 1 and "the base server 'dead' did not come up" in done.stderr


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_the_servers_and_prints_the_waves_measured(fakes, tmp_path, how):
    fake = fakes(words=3, delay=0.01)
    pidfile, folder = tmp_path / "pid", tmp_path / "site"
    folder.mkdir()
    (folder / "health").write_text("ok")       # GET /health: 200, so the server counts as up
    proc = subprocess.Popen([sys.executable, "-m", "flylocal", "bench", "serve", "--server", f"a={fake.url}",
                             "--server", f"b=sh -c 'echo $$ > {pidfile}; exec python3 -m http.server {{port}} "
                             f"--bind 127.0.0.1 --directory {folder}'", "--base", "a", "--per-category", "3",
                             "--max-tokens", "3", "--pause", "0.3"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(fake.bodies) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(how)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "interrupted: the figures above are of the waves measured before" in out and "| a |" in out
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"     # gone (or dead, awaiting its reaper)


@pytest.mark.slow
def test_flylocal_servers_are_started_compared_and_stopped(tmp_path):
    out = tmp_path / "waves.json"
    done = bench_serve("--server", "autoregressive", "--server", "strict-pld", "--server",
                       f"here=flylocal@{ROOT} --drafter pld --verifier strict --parallel 1",
                       "--category", "multi-turn,qa",
                       "--per-category", "1", "--clients", "1,2", "--max-tokens", "12", "--ctx", "2048",
                       "--threads", "1", "--pause", "0", "--turns", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "2 waves of 1 client" in done.stdout and "1 wave of 2 clients" in done.stdout
    data = json.loads(out.read_text())
    for count, waves in (("1", 2), ("2", 1)):
        for name in ("autoregressive", "strict-pld", "here"):
            figs = data[count][name]
            # a multi-turn question (2 requests) and a qa one (1), every answer full length: the
            # model's end-of-generation tokens banned
            assert len(figs) == waves and not any(f["errors"] for f in figs) and all(f["rate"] > 0 for f in figs)
            assert sum(f["requests"] for f in figs) == 3 and sum(f["tokens"] for f in figs) == 36
    rows = [line for line in done.stdout.splitlines() if line.startswith("| strict-pld |")]
    assert len(rows) == 2 and all(row.split(" | ")[4].count("worst") == 1 for row in rows)   # / autoregressive
