"""The chat page (docs/serving.md, "The chat page, inside") in a real browser: Debian's headless Chromium,
driven by selenium through chromium-driver, against `flylocal serve` on SmolLM2 over loopback.

The page is the server's own client: every check here goes through what a person does (type,
press Enter or Esc, click) and reads what the page shows. With FLYLOCAL_SCREENSHOTS=DIR the
compare test leaves the page's four looks there (light and dark, desktop and 375 px wide):
docs/page/ holds the ones made so.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import httpx
import pytest

from conftest import SMOL, SMOL_Q4_0, prompt
from test_server import free_port, start, stop, wait_ready

pytestmark = pytest.mark.slow      # a real model behind a real server, and a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
KEY = "page-key-456"
XSS = "<img src=x onerror=alert(1)><script>alert(2)</script>"
# With the draft model drafting 10 tokens, FLy accepts loose tokens on this prompt and parts from
# strict within 64 tokens (SmolLM2 Q4_1 and its Q4_0 requant, exact build).
FOCUS = prompt("chat-focus")
WAIT = 180.0                       # seconds an answer may take on a slow, busy machine


def need_browser() -> None:
    if CHROMIUM and DRIVER:
        return
    if os.environ.get("CI"):
        pytest.fail("chromium and chromium-driver are missing: .ci/run installs them (apt-get install chromium "
                    "chromium-driver)")
    pytest.skip("NOT EXERCISED: no chromium and chromedriver here (apt-get install chromium chromium-driver)")


def serve(*args: str):
    port = free_port()
    proc = start("--target", SMOL, "--draft", SMOL_Q4_0, "--ctx", "2048", *args, port=port)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    return proc, url


def chrome(*extra: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"             # selenium never looks for a driver on the network
    profile = tempfile.mkdtemp(prefix="flylocal-chrome-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--window-size=1280,900", f"--user-data-dir={profile}", *extra):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.profile_dir = profile
    return driver


def quit_chrome(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def site():
    need_browser()
    proc, url = serve()
    driver = chrome()
    try:
        yield driver, url, proc
    finally:
        quit_chrome(driver)
        stop(proc)


def fresh(driver, url: str) -> None:
    """The page as a first visit sees it: no conversations, default settings."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url + "/")
    until(driver, lambda: driver.execute_script("return document.readyState") == "complete")


def until(driver, condition, timeout: float = WAIT, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page did not get there in {timeout:g} s; it shows: "
                                 + driver.find_element("id", "messages").text[-500:])
        time.sleep(every)


def settings(driver, **values) -> None:
    """Set controls by id (drafter="model", k="10", ...), as a person would."""
    from selenium.webdriver.support.ui import Select

    if driver.find_element("id", "settings").get_attribute("hidden") is not None:
        driver.find_element("id", "toggle-settings").click()
    for name, value in values.items():
        field = driver.find_element("id", name.replace("_", "-"))
        if field.tag_name == "select":
            Select(field).select_by_value(value)
        elif field.get_attribute("type") == "checkbox":
            if field.is_selected() != bool(value):
                field.click()
        else:
            field.clear()
            field.send_keys(value)


def type_and_send(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "input")
    box.click()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def answers(driver):
    return driver.find_elements("css selector", "#messages .answer")


def finished(driver, n: int = 1):
    """The last `n` answers, once each has its final stats line."""
    def done():
        found = answers(driver)
        if len(found) < n:
            return None
        last = found[-n:]
        if any("streaming" in a.get_attribute("class") for a in last):
            return None
        if not all(a.find_element("css selector", ".stats").text for a in last):
            return None
        return last
    return until(driver, done)


def body_text(answer) -> str:
    return answer.find_element("css selector", ".body").text


def api_answer(url: str, text: str, headers=None, **fields) -> str:
    r = httpx.post(url + "/v1/chat/completions", headers=headers or {}, timeout=WAIT,
                   json={"messages": [{"role": "user", "content": text}], **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def no_alert(driver) -> bool:
    from selenium.common.exceptions import NoAlertPresentException

    try:
        driver.switch_to.alert
    except NoAlertPresentException:
        return True
    return False


# ----- the tests -----

def test_a_message_streams_coloured_tokens_then_its_stats(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, drafter="model", k="10", max_tokens="64")
    type_and_send(driver, FOCUS)
    seen_streaming = until(driver, lambda: driver.execute_script(
        "const a = document.querySelector('#messages .answer.streaming');"
        "return a ? a.querySelectorAll('.tok').length : 0;"))
    assert seen_streaming > 0                      # coloured spans while the answer streams
    [answer] = finished(driver)
    stats = answer.find_element("css selector", ".stats").text
    for part in (" tokens", "tok/s", "mean accepted length", "loose", "cached prompt tokens", "fly + model"):
        assert part in stats, stats
    spans = answer.find_elements("css selector", ".body .tok")
    kinds = {s.get_attribute("class").split()[-1] for s in spans}
    assert {"tok-A", "tok-T"} <= kinds               # the draft model's tokens, and the target's
    loose = int(stats.split("loose ")[1].split()[0])
    loose_spans = answer.find_elements("css selector", ".body .tok-L")
    assert (loose > 0) == bool(loose_spans)
    for span in loose_spans:                          # hovering shows the target's own choice
        assert "the target's own choice here was" in span.get_attribute("title")
    # the page kept the answer the API gives for the same request (exact build: one answer),
    # a token of it for each the stats line counts (64, unless the model ended first)
    kept = stored(driver)[0]["messages"][1]["answer"]
    assert kept["text"] == api_answer(url, FOCUS, max_tokens=64, drafter="model", k=10)
    assert f"{len(kept['tokens'])} tokens" in stats and 0 < len(kept["tokens"]) <= 64
    assert sum(t[1] for t in kept["tokens"]) == len(kept["text"])


def stored(driver) -> list:
    return json.loads(driver.execute_script("return localStorage.getItem('flylocal.conversations')"))


def test_stop_mid_stream_then_the_next_message_is_answered(site):
    from selenium.webdriver.common.keys import Keys

    driver, url, _ = site
    fresh(driver, url)
    settings(driver, drafter="pld", max_tokens="400")
    before = cancelled(url)
    type_and_send(driver, prompt("story-robot"))
    until(driver, lambda: len(driver.find_elements("css selector", "#messages .answer.streaming .tok")) >= 3)
    driver.find_element("tag name", "body").send_keys(Keys.ESCAPE)
    [stopped] = finished(driver)
    assert "stopped" in stopped.find_element("css selector", ".stats").text
    shown = body_text(stopped)
    assert shown
    settings(driver, max_tokens="16")
    type_and_send(driver, "Say hello.")
    last = finished(driver, 2)
    stats = last[-1].find_element("css selector", ".stats").text
    assert "tok/s" in stats and "stopped" not in stats and body_text(last[-1])
    assert body_text(last[0]) == shown                # what was shown stays
    assert until(driver, lambda: cancelled(url) == before + 1, timeout=30)


def test_a_reader_who_scrolled_up_stays_there_while_the_answer_grows(site):
    from selenium.webdriver import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.keys import Keys

    driver, url, _ = site
    fresh(driver, url)
    driver.set_window_size(375, 600)
    try:
        settings(driver, drafter="pld", max_tokens="400")
        driver.find_element("id", "toggle-settings").click()          # the panel closed again
        type_and_send(driver, prompt("story-robot"))
        box = driver.find_element("id", "messages")
        where = "return [arguments[0].scrollTop, arguments[0].scrollHeight - arguments[0].clientHeight];"
        tokens = "return document.querySelectorAll('#messages .answer.streaming .tok').length;"
        # while the reader stays at the end, the end stays in sight as the answer grows past the window
        until(driver, lambda: driver.execute_script(tokens) and driver.execute_script(where, box)[1] > 150)
        top, end = driver.execute_script(where, box)
        assert end - top < 48, (top, end)
        ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(box), 0, -5000).perform()
        until(driver, lambda: driver.execute_script(where, box)[0] == 0, timeout=10)
        grown = driver.execute_script(tokens) + 20

        def grown_or_ended():           # (tokens drawn while streaming, scroll position), read at once
            n, top = driver.execute_script(
                "return [document.querySelectorAll('#messages .answer.streaming .tok').length, arguments[0].scrollTop];",
                box)
            return (n, top) if n >= grown or not n else None
        drawn, top = until(driver, grown_or_ended)
        assert drawn >= grown, "the answer ended before 20 more tokens were drawn: nothing was tested"
        assert top == 0                                              # they read on where they were
        driver.find_element("tag name", "body").send_keys(Keys.ESCAPE)
        finished(driver)
        assert driver.execute_script(where, box)[0] == 0
        settings(driver, max_tokens="16")
        driver.find_element("id", "toggle-settings").click()
        type_and_send(driver, "Say hello.")                          # a new message brings them to the end
        finished(driver, 2)
        top, end = driver.execute_script(where, box)
        assert end - top < 48, (top, end)
    finally:
        driver.set_window_size(1280, 900)


def cancelled(url: str) -> float:
    page = httpx.get(url + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in page.splitlines()
                      if line.startswith("flylocal_cancelled_generations_total")))


def test_html_in_answers_and_messages_is_shown_as_text(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, verifier="strict", drafter="pld", max_tokens="40")
    message = "Write this HTML line back: " + XSS
    type_and_send(driver, message)
    [answer] = finished(driver)
    assert XSS in body_text(answer)                                  # the model wrote it back ...
    assert driver.find_element("css selector", "#messages .user").text == message
    assert driver.find_elements("css selector", "#messages img, #messages script") == []   # ... as text
    assert len(driver.find_elements("tag name", "script")) == 1                          # app.js alone
    assert no_alert(driver)
    # A stored answer renders through the same code: fenced code, lists, inline code.
    stored = {"id": "x", "title": "stored", "messages": [
        {"role": "user", "content": XSS},
        {"role": "assistant", "answer": {"text": f"- item {XSS}\n\n`{XSS}`\n\n```html\n{XSS}\n```\n",
                                         "tokens": [], "usage": None, "seconds": 1, "stopped": False,
                                         "error": None}}]}
    driver.execute_script("localStorage.setItem('flylocal.conversations', arguments[0]);"
                          "localStorage.setItem('flylocal.current', 'x');", json.dumps([stored]))
    driver.refresh()
    answer = until(driver, lambda: answers(driver))[-1]
    assert answer.find_elements("css selector", ".body li")
    assert answer.find_elements("css selector", ".body pre code")
    assert body_text(answer).count(XSS) == 3
    assert driver.find_elements("css selector", "#messages img, #messages script") == []
    assert no_alert(driver)
    errors = [e for e in driver.get_log("browser") if "Content Security Policy" in e.get("message", "")]
    assert errors == []                        # nothing even tried to run and was blocked


def test_a_reload_keeps_the_conversation(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, max_tokens="16")
    type_and_send(driver, "Name a colour.")
    [answer] = finished(driver)
    text, stats = body_text(answer), answer.find_element("css selector", ".stats").text
    driver.refresh()
    [again] = until(driver, lambda: answers(driver))
    assert body_text(again) == text and again.find_element("css selector", ".stats").text == stats
    assert driver.find_element("css selector", "#messages .user").text == "Name a colour."
    assert [e.text for e in driver.find_elements("css selector", "#conversations .open")] == ["Name a colour."]
    type_and_send(driver, "Another one.")                  # the conversation goes on after a reload
    finished(driver, 2)
    assert len(driver.find_elements("css selector", "#conversations li")) == 1


def test_compare_shows_both_answers_and_where_they_first_differ(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, drafter="model", k="10", max_tokens="64", compare=True)
    type_and_send(driver, FOCUS)
    strict_view, fly_view = finished(driver, 2)
    heads = [v.find_element("css selector", ".head").text for v in (strict_view, fly_view)]
    assert heads[0].startswith("strict \u00b7 ") and heads[1].startswith("fly \u00b7 ") and heads[0].endswith(" s")
    note = driver.find_element("css selector", ".compare-turn .note").text
    strict = api_answer(url, FOCUS, max_tokens=64, drafter="model", k=10, verifier="strict")
    compared = stored(driver)[0]["messages"][1]["compare"]
    assert compared[0]["text"] == strict
    # Where the two part depends on this machine's numerics: the note says what the texts call for.
    if compared[0]["text"] != compared[1]["text"]:
        assert "first differ at token" in note, note
        assert len(driver.find_elements("css selector", ".compare .diverge")) == 2
    else:
        assert "the same" in note and not driver.find_elements("css selector", ".compare .diverge"), note
    assert not strict_view.find_elements("css selector", ".tok-L")     # strict is never loose
    screenshots(driver)


def screenshots(driver) -> None:
    folder = os.environ.get("FLYLOCAL_SCREENSHOTS")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    for scheme in ("light", "dark"):
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                               {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
        for name, width, height, mobile in (("desktop", 1280, 900, False), ("375px", 375, 812, True)):
            driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                                   {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
            time.sleep(0.3)
            driver.save_screenshot(os.path.join(folder, f"page-{scheme}-{name}.png"))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


def test_with_a_key_the_page_asks_once_and_then_works_under_a_lan_name():
    """A server reached by a name of the local network (--allowed-host): the browser resolves
    the name to loopback here, and nothing else reaches the server."""
    need_browser()
    proc, url = serve("--api-key", KEY, "--allowed-host", "flylocal.lan")
    port = url.rsplit(":", 1)[1]
    driver = chrome("--host-resolver-rules=MAP flylocal.lan 127.0.0.1, MAP other.lan 127.0.0.1")
    try:
        driver.get(f"http://other.lan:{port}/")         # a name the server was not given: refused
        assert "does not name this server" in driver.find_element("tag name", "body").text
        url = f"http://flylocal.lan:{port}"
        fresh(driver, url)
        dialog = driver.find_element("id", "key-dialog")
        until(driver, lambda: dialog.get_attribute("open") is not None, timeout=30)
        field = driver.find_element("id", "key")
        field.send_keys("wrong")
        driver.find_element("id", "key-use").click()
        until(driver, lambda: driver.find_element("id", "key-error").text == "That key was refused.", timeout=30)
        field.clear()
        field.send_keys(KEY)
        driver.find_element("id", "key-use").click()
        until(driver, lambda: dialog.get_attribute("open") is None, timeout=30)
        assert driver.find_element("id", "model").text == SMOL
        settings(driver, max_tokens="12")
        type_and_send(driver, "Hello!")
        [answer] = finished(driver)
        assert "12 tokens" in answer.find_element("css selector", ".stats").text
        driver.refresh()                                  # kept for the tab: not asked again
        until(driver, lambda: driver.find_element("id", "model").text == SMOL, timeout=30)
        assert driver.find_element("id", "key-dialog").get_attribute("open") is None
    finally:
        quit_chrome(driver)
        stop(proc)


# ----- what a reload, a narrow screen, a refused setting, a broken store and a second tab must not break -----

def test_a_compare_turn_is_still_one_after_a_reload(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, drafter="pld", max_tokens="8", compare=True)
    type_and_send(driver, "Name a colour.")
    before = [(body_text(a), a.find_element("css selector", ".head").text) for a in finished(driver, 2)]
    note = driver.find_element("css selector", ".compare-turn .note").text
    driver.refresh()
    [turn] = until(driver, lambda: driver.find_elements("css selector", "#messages .compare-turn"), timeout=30)
    after = [(body_text(a), a.find_element("css selector", ".head").text)
             for a in turn.find_elements("css selector", ".answer")]
    assert after == before and before[0][1].startswith("strict \u00b7 ") and before[1][1].startswith("fly \u00b7 ")
    assert turn.find_element("css selector", ".note").text == note
    assert "[object Object]" not in driver.find_element("id", "messages").text


def test_on_a_narrow_screen_the_sidebar_never_hides_its_toggle_and_new_chat_closes_it(site):
    driver, url, _ = site
    fresh(driver, url)
    driver.set_window_size(375, 812)
    try:
        assert driver.execute_script("return innerWidth") <= 700            # the narrow layout
        toggle, sidebar = driver.find_element("id", "toggle-sidebar"), driver.find_element("id", "sidebar")

        def shown(node) -> bool:     # the point a click lands on is the node's, not something over it
            return driver.execute_script(
                "const r = arguments[0].getBoundingClientRect();"
                "return r.width > 0 && arguments[0].contains(document.elementFromPoint(r.left + r.width / 2,"
                " r.top + r.height / 2));", node)

        def settled(is_open: bool) -> bool:                # the slide finished, the sidebar in or out
            return driver.execute_script(
                "const s = arguments[0], r = s.getBoundingClientRect();"
                "return s.getAnimations().length === 0 && s.classList.contains('open') === arguments[1]"
                " && (arguments[1] ? r.left === 0 : r.right <= 0);", sidebar, is_open)

        toggle.click()
        until(driver, lambda: settled(True), timeout=10)
        assert shown(toggle) and shown(driver.find_element("id", "new-chat"))
        assert toggle.get_attribute("aria-expanded") == "true"
        toggle.click()                                                       # it closes it again
        until(driver, lambda: settled(False), timeout=10)
        toggle.click()
        until(driver, lambda: settled(True), timeout=10)
        driver.find_element("id", "new-chat").click()
        until(driver, lambda: settled(False), timeout=10)
        assert toggle.get_attribute("aria-expanded") == "false" and shown(toggle)
    finally:
        driver.set_window_size(1280, 900)


def test_a_setting_the_server_refuses_is_not_kept_and_its_default_is_offered(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, k="999", max_tokens="8")           # the page allows it; the server's batch does not
    type_and_send(driver, "Say hello.")
    offer = driver.find_element("id", "refused")
    until(driver, offer.is_displayed, timeout=60)
    assert "k 999" in offer.text, offer.text
    assert not answers(driver)                                    # refused: no turn
    kept = lambda: json.loads(driver.execute_script("return localStorage.getItem('flylocal.settings')"))
    assert kept().get("k", "") == "" and kept()["max-tokens"] == "8"
    driver.refresh()
    until(driver, lambda: driver.execute_script("return document.readyState") == "complete")
    assert driver.find_element("id", "k").get_attribute("value") == ""      # not back after a reload
    assert driver.find_element("id", "max-tokens").get_attribute("value") == "8"
    settings(driver, k="999")
    type_and_send(driver, "Say hello.")
    offer = driver.find_element("id", "refused")
    until(driver, offer.is_displayed, timeout=60)
    use = driver.find_element("id", "use-default")
    assert "auto" in use.text, use.text                            # k's default: the server chooses
    use.click()
    assert driver.find_element("id", "k").get_attribute("value") == "" and not offer.is_displayed()
    assert driver.find_element("id", "input").get_attribute("value") == "Say hello."    # the message came back
    driver.find_element("id", "send").click()
    [answer] = finished(driver)
    assert body_text(answer) and "error" not in answer.find_element("css selector", ".stats").text


def test_a_broken_stored_conversation_is_repaired_and_the_page_works(site):
    driver, url, _ = site
    fresh(driver, url)
    answer = {"text": "Blue.", "tokens": [["T", 5]], "usage": None, "seconds": 1, "stopped": False, "error": None}
    store = [None, 7, {"id": "x", "title": "kept", "messages": [
        None, {"role": "user", "content": "Name a colour."}, None, {"role": "assistant", "answer": answer},
        {"role": "assistant", "answer": None}, "junk", {"role": "user"}]}]
    driver.execute_script("localStorage.setItem('flylocal.conversations', arguments[0]);"
                          "localStorage.setItem('flylocal.current', 'x');", json.dumps(store))
    driver.refresh()
    [shown] = until(driver, lambda: answers(driver), timeout=30)
    assert body_text(shown) == "Blue."
    assert driver.find_element("css selector", "#messages .user").text == "Name a colour."
    settings(driver, max_tokens="8")
    type_and_send(driver, "Another one.")
    until(driver, lambda: len(answers(driver)) == 2, timeout=30)
    finished(driver)
    [kept] = stored(driver)
    assert [m["role"] for m in kept["messages"]] == ["user", "assistant", "user", "assistant"]
    driver.find_element("id", "new-chat").click()                 # New chat works too
    until(driver, lambda: not answers(driver), timeout=10)


def test_two_tabs_each_start_a_conversation_and_both_are_kept(site):
    driver, url, _ = site
    fresh(driver, url)
    settings(driver, max_tokens="8")
    driver.find_element("id", "input").click()                    # the setting is kept (change on blur)
    first = driver.current_window_handle
    driver.switch_to.new_window("window")
    second = driver.current_window_handle
    try:
        driver.get(url + "/")                                     # both tabs open before either sends
        until(driver, lambda: driver.execute_script("return document.readyState") == "complete")
        listed = lambda: sorted(e.text for e in driver.find_elements("css selector", "#conversations .open"))
        driver.switch_to.window(first)
        type_and_send(driver, "Name a colour.")
        finished(driver)
        driver.switch_to.window(second)
        type_and_send(driver, "Name a fruit.")
        finished(driver)
        titles = ["Name a colour.", "Name a fruit."]
        assert sorted(c["title"] for c in stored(driver)) == titles
        assert listed() == titles
        driver.switch_to.window(first)
        until(driver, lambda: listed() == titles, timeout=10)     # the other tab's save shows here too
        driver.refresh()
        until(driver, lambda: listed() == titles, timeout=30)
    finally:
        if driver.current_window_handle != second:
            driver.switch_to.window(second)
        driver.close()
        driver.switch_to.window(first)
