"""One server, several models (docs/serving.md, "Every model from one server"), on real models:
the lists front-ends read, a conversation that switches model between turns, loads on demand
within --models-memory (no thrash when two fit; a switch unloads the other when one fits),
keep_alive as ollama defines it, llama-server's /models endpoints, a damaged file that fails
alone, a model field that never names a path, --models-config's one-line errors, /api/pull and
/api/delete, and a conversation continued from the disk tier after its model was unloaded.
The scheduler's own properties are tested on a fake backend (test_roster.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from conftest import GEMMA, SMOL, SMOL_Q4_0
from test_server import free_port, log, start, stop, wait_ready

pytestmark = pytest.mark.slow      # real models behind a real server

JSON = {"Content-Type": "application/json"}
COMMON = ("--ctx", "512", "--verifier", "strict", "--parallel", "1", "--cache-ram", "64")
TWO_FIT, ONE_FITS = "2600", "1700"       # MiB: SmolLM2 with its draft and Gemma together; either alone


def post(url: str, path: str, body: dict, timeout: float = 180) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=JSON, timeout=timeout)


def ask(url: str, model: str, messages: list, **extra) -> dict:
    r = post(url, "/api/chat", {"model": model, "messages": messages, "stream": False,
                                "options": {"num_predict": 12}} | extra)
    assert r.status_code == 200, r.text
    return r.json()


def gone(url: str, name: str, timeout: float = 30) -> bool:
    """Whether `name` leaves /api/ps within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while name in [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def loads(proc, name: str) -> list[float]:
    """The seconds of each load of `name` the server's log gives."""
    return [float(s) for s in re.findall(rf"loaded {re.escape(name)} in ([\d.]+) s", log(proc))]


@pytest.fixture(scope="module")
def several():
    """SmolLM2 (loaded at start, with its paired draft), Gemma and SmolLM2's Q4_0, within a
    budget that holds the first two together."""
    port = free_port()
    proc = start("--model", SMOL, "--model", GEMMA, "--model", SMOL_Q4_0, "--models-memory", TWO_FIT, *COMMON,
                 port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        yield url, proc
    finally:
        stop(proc)


def test_the_lists_front_ends_read_name_every_model_and_say_which_are_loaded(several):
    url, proc = several
    tags = [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]]
    assert tags == [SMOL, GEMMA, SMOL_Q4_0]                   # Open WebUI's and Continue's menus
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert set(models) == set(tags) and models[SMOL]["status"]["value"] == "loaded"
    assert models[SMOL]["flylocal"]["draft"].endswith(SMOL_Q4_0 + ".gguf")    # `models pairs`' first
    router = httpx.get(url + "/models").json()["data"]     # llama-server's router list
    assert [m["id"] for m in router] == tags
    post(url, "/api/generate", {"model": SMOL_Q4_0, "prompt": "", "keep_alive": 0})     # out, if another test loaded it
    assert gone(url, SMOL_Q4_0)
    show = post(url, "/api/show", {"model": SMOL_Q4_0})       # read from the file: nothing loads for it
    assert show.status_code == 200 and "completion" in show.json()["capabilities"]
    assert SMOL_Q4_0 not in [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]


def test_one_conversation_switches_model_between_turns(several):
    """Open WebUI's /api/chat stream (its model menu picks the model per turn) and Continue's
    (a system prompt, num_ctx, keep_alive 1800), as their readers read them: each turn is
    answered by the model it names, the answer that model gives the same turn alone."""
    from test_frontends import continue_reads, ndjson, webui_reads

    url, proc = several
    system = {"role": "system", "content": "You are a helpful assistant."}
    turns, asked = [{"role": "user", "content": "Name a color."}], []
    for model, client in ((SMOL, "webui"), (GEMMA, "continue"), (SMOL, "continue"), (GEMMA, "webui")):
        if client == "webui":
            body = {"model": model, "messages": turns, "stream": True, "options": {"num_predict": 12}}
            read = webui_reads(ndjson(post(url, "/api/chat", body)))
        else:
            body = {"model": model, "messages": [system] + turns,
                    "options": {"num_predict": 12, "num_ctx": 4096}, "keep_alive": 1800}
            read = continue_reads(ndjson(post(url, "/api/chat", body)))
        alone = ask(url, model, body["messages"])
        assert alone["model"] == model and read["content"] == alone["message"]["content"], (model, client)
        asked.append(read["content"])
        turns = turns + [{"role": "assistant", "content": read["content"]}, {"role": "user", "content": "Another."}]
    assert asked[0] != ask(url, GEMMA, [{"role": "user", "content": "Name a color."}])["message"]["content"]
    # Both fit the budget: each was loaded once, none unloaded the other.
    assert len(loads(proc, GEMMA)) == 1 and f"to make room for {GEMMA}" not in log(proc)
    assert {SMOL, GEMMA} <= {m["name"] for m in httpx.get(url + "/api/ps").json()["models"]}


def test_two_models_answer_at_the_same_time(several):
    """Each loaded model has its own worker: two streams, one per model, overlap."""
    import threading

    url, _ = several
    spans = {}

    def stream(model):
        body = {"model": model, "messages": [{"role": "user", "content": "Count from one to fifty."}],
                "options": {"num_predict": 48}}
        times = []
        with httpx.stream("POST", url + "/api/chat", json=body, headers=JSON, timeout=180) as r:
            for line in r.iter_lines():
                if line:
                    times.append(time.monotonic())
        spans[model] = (times[0], times[-1])

    ask(url, GEMMA, [{"role": "user", "content": "Hi"}], options={"num_predict": 1})      # loaded first
    threads = [threading.Thread(target=stream, args=(m,)) for m in (SMOL, GEMMA)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    (a0, a1), (b0, b1) = spans[SMOL], spans[GEMMA]
    assert a0 < b1 and b0 < a1, spans           # each gave tokens while the other was still giving them


def test_a_load_whose_client_left_is_finished_and_not_started_again(several):
    """ollama 7408: the load a request started goes on when its client leaves, and the next
    request finds the model loaded."""
    url, proc = several
    post(url, "/api/generate", {"model": SMOL_Q4_0, "prompt": "", "keep_alive": 0})
    before = len(loads(proc, SMOL_Q4_0))
    with pytest.raises(httpx.TimeoutException):       # the client leaves while the model loads
        httpx.post(url + "/api/chat", headers=JSON, timeout=0.05,
                   json={"model": SMOL_Q4_0, "messages": [{"role": "user", "content": "hi"}], "keep_alive": "5m"})
    deadline = time.monotonic() + 60
    while len(loads(proc, SMOL_Q4_0)) == before:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert ask(url, SMOL_Q4_0, [{"role": "user", "content": "Hi"}], options={"num_predict": 2})["done"]
    assert len(loads(proc, SMOL_Q4_0)) == before + 1


def test_keep_alive_as_ollama_defines_it(several):
    url, _ = several
    r = post(url, "/api/generate", {"model": SMOL_Q4_0, "prompt": "", "keep_alive": "10m"})     # load it
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    ps = {m["name"]: m for m in httpx.get(url + "/api/ps").json()["models"]}
    at = datetime.fromisoformat(ps[SMOL_Q4_0]["expires_at"].replace("Z", "+00:00"))
    assert timedelta(minutes=9) < at - datetime.now(timezone.utc) <= timedelta(minutes=10, seconds=5)
    assert datetime.fromisoformat(ps[SMOL]["expires_at"].replace("Z", "+00:00")).year > 2100    # loaded at start
    r = post(url, "/api/generate", {"model": SMOL_Q4_0, "prompt": "", "keep_alive": 0})         # unload it
    assert r.json()["done_reason"] == "unload"
    deadline = time.monotonic() + 30
    while SMOL_Q4_0 in [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # unloading a model not loaded loads nothing (ollama's way)
    loaded_before = len(loads(several[1], SMOL_Q4_0))
    r = post(url, "/api/generate", {"model": SMOL_Q4_0, "prompt": "", "keep_alive": 0})
    assert r.json()["done_reason"] == "unload" and len(loads(several[1], SMOL_Q4_0)) == loaded_before
    # num_ctx is a hint: a request with another one is answered by the model loaded, no reload
    before = len(loads(several[1], GEMMA))
    ask(url, GEMMA, [{"role": "user", "content": "Hi"}], options={"num_ctx": 8192, "num_predict": 4})
    assert len(loads(several[1], GEMMA)) == before


def test_llama_server_load_and_unload_endpoints(several):
    url, _ = several
    assert post(url, "/models/load", {"model": SMOL_Q4_0}).json() == {"success": True}
    status = {m["id"]: m["status"]["value"] for m in httpx.get(url + "/models").json()["data"]}
    assert status[SMOL_Q4_0] == "loaded"
    assert post(url, "/models/unload", {"model": SMOL_Q4_0}).json() == {"success": True}
    deadline = time.monotonic() + 30
    while {m["id"]: m["status"]["value"] for m in httpx.get(url + "/models").json()["data"]}[SMOL_Q4_0] != "unloaded":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert post(url, "/models/load", {"model": "nonesuch"}).status_code == 404


def test_a_model_field_never_names_a_path(several, tmp_path):
    url, _ = several
    from conftest import model_path

    copy = tmp_path / "elsewhere.gguf"
    shutil.copy(model_path(SMOL_Q4_0), copy)
    for name in (str(copy), "/etc/passwd", "../" + SMOL, "hf:x/y"):
        r = post(url, "/api/chat", {"model": name, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "not found" in r.json()["error"], (name, r.text)


def test_embeddings_name_any_model(several):
    url, _ = several
    dims = {m: len(post(url, "/api/embed", {"model": m, "input": "hello"}).json()["embeddings"][0])
            for m in (SMOL, GEMMA)}
    assert dims == {SMOL: 576, GEMMA: 640}


def test_a_budget_that_holds_one_unloads_the_other_at_each_switch():
    port = free_port()
    proc = start("--model", SMOL, "--model", GEMMA, "--models-memory", ONE_FITS, *COMMON, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        for model in (GEMMA, SMOL, GEMMA):
            assert ask(url, model, [{"role": "user", "content": "Hi"}], options={"num_predict": 2})["model"] == model
        # SmolLM2 loaded at start ("ready"), again after Gemma; Gemma twice: each switch unloaded the other
        assert len(loads(proc, GEMMA)) == 2 and len(loads(proc, SMOL)) == 1
        assert log(proc).count("to make room for") == 3
        assert all(s > 0 for s in loads(proc, GEMMA))
    finally:
        stop(proc)


def test_a_damaged_file_fails_alone_with_its_name(tmp_path):
    from conftest import model_path

    broken = tmp_path / "broken.gguf"
    shutil.copy(model_path(SMOL_Q4_0), broken)
    port = free_port()
    proc = start("--model", SMOL, "--model", str(broken), *COMMON, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        with open(broken, "r+b") as f:             # damaged after the server started
            f.truncate(broken.stat().st_size // 2)
        r = post(url, "/api/chat", {"model": "broken", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and str(broken) in r.json()["error"], r.text
        assert ask(url, SMOL, [{"role": "user", "content": "Hi"}], options={"num_predict": 2})["done"]
        shutil.copy(model_path(SMOL_Q4_0), broken)  # mended: the next request loads it
        assert ask(url, "broken", [{"role": "user", "content": "Hi"}], options={"num_predict": 2})["done"]
        assert "Traceback" not in log(proc)
    finally:
        stop(proc)


@pytest.mark.parametrize("toml,said", [
    ('[models."%s"]\nspeed = 2\n' % SMOL, f"model '{SMOL}': unknown key 'speed'"),
    ('[models."%s"]\nctx = "lots"\n' % SMOL, f"model '{SMOL}': ctx:"),
    ('[models."nonesuch"]\nctx = 512\n', "model 'nonesuch' is not one this server serves"),
    ('[models."%s"]\nverifier = "maybe"\n' % SMOL, f"model '{SMOL}': verifier:"),
    ("models = [", "not TOML"),
])
def test_a_bad_models_config_is_one_line_before_anything_loads(tmp_path, toml, said):
    config = tmp_path / "models.toml"
    config.write_text(toml)
    r = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--model", SMOL, "--models-config", str(config),
                        "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and str(config) in lines[0], r.stderr


def test_a_models_config_gives_a_model_its_own_settings(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text(f'[models."{GEMMA}"]\ndraft = "none"\nverifier = "fly"\nctx = 256\nkeep_alive = "0"\n')
    port = free_port()
    proc = start("--model", SMOL, "--model", GEMMA, "--models-config", str(config), *COMMON, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        out = ask(url, GEMMA, [{"role": "user", "content": "Hi"}], options={"num_predict": 2})
        assert out["flylocal"]["verifier"] == "fly"
        show = post(url, "/api/show", {"model": GEMMA}).json()
        assert "num_ctx 256" in show["parameters"].replace("  ", " ") or "256" in show["parameters"]
        deadline = time.monotonic() + 30                   # its own keep_alive: 0
        while GEMMA in [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        stop(proc)


GEMMA_Q2_K = "gemma-3-270m-q2_k"    # the smallest Gemma: no draft of its vocabulary is smaller


def test_under_drafter_mla_a_model_without_a_draft_drafts_by_lookup_and_the_others_are_served():
    # Before, the whole server refused to start ("model gemma-3-270m-q2_k: --drafter mla needs
    # a draft model"), SmolLM2 with its draft included.
    port = free_port()
    proc = start("--model", SMOL, "--model", GEMMA_Q2_K, "--drafter", "mla", "--draft", SMOL_Q4_0, *COMMON, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        assert f"{GEMMA_Q2_K}: no draft model shares its vocabulary: it drafts by prompt lookup" in log(proc)
        assert f"{SMOL}: no draft" not in log(proc)
        assert ask(url, SMOL, [{"role": "user", "content": "Hi"}])["flylocal"]["drafter"] == "mla"
        assert ask(url, GEMMA_Q2_K, [{"role": "user", "content": "Hi"}])["flylocal"]["drafter"] == "pld"
    finally:
        stop(proc)


def test_a_models_own_drafter_without_a_draft_is_still_refused_naming_it(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text(f'[models."{GEMMA_Q2_K}"]\ndrafter = "mla"\n')
    r = subprocess.run([sys.executable, "-m", "flylocal", "serve", "--model", SMOL, "--model", GEMMA_Q2_K,
                        "--models-config", str(config), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"model {GEMMA_Q2_K}: --drafter mla needs a draft model" in r.stderr.strip().splitlines()[-1], r.stderr


def test_pull_fetches_a_registry_model_and_delete_removes_only_what_flylocal_fetched(tmp_path):
    """A private models folder (never the user's): the base model linked in, its Q4_0 pulled
    (derived offline, as `flylocal models fetch` does), served, then deleted; a file of another
    tool's is never deleted."""
    from conftest import model_path

    cache = tmp_path / "models"
    cache.mkdir()
    os.link(model_path(SMOL), cache / f"{SMOL}.gguf")
    other = tmp_path / "theirs.gguf"
    shutil.copy(model_path(SMOL_Q4_0), other)
    env = os.environ | {"FLYLOCAL_MODELS": str(cache)}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flylocal", "serve", "--port", str(port), "--threads", "1",
                             "--model", SMOL, "--model", str(other), *COMMON], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "log", "w"), text=True)
    proc.log_file = open(tmp_path / "log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        with httpx.stream("POST", url + "/api/pull", json={"model": SMOL_Q4_0}, headers=JSON, timeout=300) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}, lines
        assert any("digest" in e and e["completed"] == e["total"] > 0 for e in lines)
        assert (cache / f"{SMOL_Q4_0}.gguf").exists()
        assert ask(url, SMOL_Q4_0, [{"role": "user", "content": "Hi"}], options={"num_predict": 2})["done"]
        assert httpx.request("DELETE", url + "/api/delete", json={"model": SMOL_Q4_0}, headers=JSON).status_code == 200
        assert not (cache / f"{SMOL_Q4_0}.gguf").exists()
        assert SMOL_Q4_0 not in [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]]
        refused = httpx.request("DELETE", url + "/api/delete", json={"model": "theirs"}, headers=JSON)
        assert refused.status_code == 403 and other.exists()
        assert post(url, "/api/pull", {"model": "no-such-model"}).status_code == 404
    finally:
        stop(proc)


def test_pull_and_delete_need_the_key_and_no_manage_refuses_them():
    port = free_port()
    proc = start("--model", SMOL, "--no-manage", "--api-key", "k-123", *COMMON, port=port)
    url = f"http://127.0.0.1:{port}"
    key = JSON | {"Authorization": "Bearer k-123"}
    try:
        wait_ready(proc, url)
        assert post(url, "/api/pull", {"model": SMOL_Q4_0}).status_code == 401
        assert httpx.request("DELETE", url + "/api/delete", json={"model": SMOL}, headers=JSON).status_code == 401
        assert httpx.post(url + "/api/pull", json={"model": SMOL_Q4_0}, headers=key).status_code == 403
        assert httpx.request("DELETE", url + "/api/delete", json={"model": SMOL}, headers=key).status_code == 403
    finally:
        stop(proc)


def test_a_conversation_continues_from_disk_after_its_model_was_unloaded(tmp_path):
    """--prompt-cache DIR: an unloaded model's slots go to the disk tier, and the conversation
    continued after it loads again has its prompt (at least 95%) restored, not prefilled."""
    port = free_port()
    proc = start("--model", SMOL, "--model", GEMMA, "--prompt-cache", str(tmp_path / "cache"), *COMMON, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        text = " ".join(f"Item {i} is on shelf {i % 7}." for i in range(40))
        turns = [{"role": "user", "content": text + " Which shelf holds item 3?"}]
        first = ask(url, GEMMA, turns)
        assert post(url, "/api/generate", {"model": GEMMA, "prompt": "", "keep_alive": 0}).json()["done_reason"] == "unload"
        deadline = time.monotonic() + 30
        while GEMMA in [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        second = ask(url, GEMMA, turns + [first["message"], {"role": "user", "content": "And item 4?"}])
        assert len(loads(proc, GEMMA)) == 2
        assert second["flylocal"]["prompt_reused"] >= 0.95 * second["prompt_eval_count"], second["flylocal"]
    finally:
        stop(proc)


def test_the_pages_model_menu_lists_every_model_and_the_one_chosen_answers(several):
    """Headless Chromium: the page's menu lists the three models, the one loaded at start
    first; a message sent with another chosen is answered by it."""
    from selenium.webdriver.support.ui import Select
    from test_page import api_answer, chrome, finished, fresh, need_browser, quit_chrome, settings, stored, \
        type_and_send, until

    need_browser()
    url, _ = several
    driver = chrome()
    try:
        fresh(driver, url)
        menu = lambda: Select(driver.find_element("id", "model"))     # noqa: E731
        until(driver, lambda: len(menu().options) == 3)
        assert [o.get_attribute("value") for o in menu().options] == [SMOL, GEMMA, SMOL_Q4_0]
        assert menu().first_selected_option.get_attribute("value") == SMOL
        settings(driver, model=GEMMA, max_tokens="8")
        type_and_send(driver, "Name a color.")
        finished(driver)
        kept = stored(driver)[0]["messages"][1]["answer"]
        assert kept["text"] == api_answer(url, "Name a color.", model=GEMMA, max_tokens=8)
        assert kept["text"] != api_answer(url, "Name a color.", model=SMOL, max_tokens=8)
    finally:
        quit_chrome(driver)


@pytest.mark.parametrize("args,said", [
    (("--keep-alive", "soon"), "--keep-alive"),
    (("--target", SMOL, "--model", GEMMA), "--target serves one model"),
    (("--models-memory", "lots"), "--models-memory"),
    (("--model", "nonesuch-model"), "nonesuch-model"),
])
def test_bad_serve_options_are_one_line(args, said):
    r = subprocess.run([sys.executable, "-m", "flylocal", "serve", *args, "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and said in lines[0] and "Traceback" not in r.stderr, r.stderr
