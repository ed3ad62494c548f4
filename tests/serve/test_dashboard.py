"""The dashboard in a real browser: headless Chromium (Debian's, driven by Selenium) loads ``/``
from a served synthetic model while a request generates; the charts and the heat map get data,
the figures shown are ``/metrics``'s, nothing is fetched from elsewhere, and the page works at
1280 px and on a phone, dark and light. Screenshots are written as test artefacts."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moefixtures import tiny_spec
from moepack.checkpoint.synth import synth_model
from served import Served, logit_bias

pytest.importorskip("llama_cpp.server", reason="moepack[serve] is installed by ./dev test")
pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")  # fmt: skip
WAIT = 120.0


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, DRIVER) if not os.path.exists(p)]
    if missing or _no_selenium():
        why = f"{', '.join(missing) or 'selenium'} missing"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: .ci/run installs chromium, chromium-driver and selenium")
        pytest.skip(f"{why}: apt-get install chromium chromium-driver (as .ci/run does)")


def _no_selenium() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = tiny_spec(layers=4, experts=32, top_k=4, hidden=256, expert_ffn=256, weight_type="Q8_0")
    return synth_model(tmp_path_factory.mktemp("dash") / "m.gguf", spec).paths[0]


@pytest.fixture(scope="module")
def server(model) -> Iterator[Served]:
    with Served(model, "--threads", 1, "--prefetch", "--watch-routing") as s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tmp_path_factory.mktemp("chromium-profile")
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument("--window-size=1280,1700")  # the whole page, heat map included
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _until(what: str, check: Any, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"the page never showed {what}"
        time.sleep(0.2)


def _polls(driver: Any) -> int:
    return int(driver.execute_script("return Number(document.body.dataset.polls || 0)"))


def _shown(driver: Any) -> dict[str, dict[str, str | None]]:
    return driver.execute_script(
        "const o = {}; for (const t of document.querySelectorAll('.tile'))"
        " o[t.dataset.metric] = {value: t.dataset.value ?? null, scale: t.dataset.scale ?? null,"
        " text: t.querySelector('.v').textContent}; return o;"
    )


def _close(text: str, value: float) -> bool:
    """The text the page shows is ``value`` rounded as the page rounds (3 figures or so)."""
    shown = float(text)
    return abs(shown - value) <= max(0.006 * abs(value), 0.0051 if abs(value) < 10 else 0.051)


def test_the_dashboard_shows_the_server_live_in_a_real_browser(server, model, browser, tmp_path):
    c = server.client()
    done = threading.Event()
    texts: list[str] = []

    def generate() -> None:  # a long request, generating while the page watches
        stream = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "the quick brown fox"}],
            max_tokens=3500, temperature=0, stream=True, logit_bias=logit_bias(model, endless=True),
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                texts.append(chunk.choices[0].delta.content)
        done.set()

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    _until("a generation in flight", lambda: server.metrics()["moepack_requests_in_flight"] >= 1)
    browser.get(server.base + "/")
    _until("three polls", lambda: _polls(browser) >= 3)
    # while it generates: decode throughput is charted, and the heat map has routing
    _until("decode tok/s charted", lambda: browser.execute_script(
        "return Number(document.querySelector('[data-chart=\"tokens per second\"]')"
        ".dataset.points || 0) > 0"))  # fmt: skip
    in_flight = browser.execute_script(
        "return document.querySelector('[data-metric=\"moepack_requests_in_flight\"]')"
        ".dataset.value"
    )
    assert in_flight is not None and float(in_flight) >= 1
    heat = _until("routing on the heat map", lambda: browser.execute_script(
        "const h = document.getElementById('heat'); return Number(h.dataset.total || 0) > 0"
        " && {total: Number(h.dataset.total), layers: Number(h.dataset.layers),"
        " width: h.width, height: h.height}"))  # fmt: skip
    assert heat["layers"] == 4 and heat["width"] > 0 and heat["height"] > 0
    browser.save_screenshot(str(tmp_path / "dashboard-1280-generating.png"))
    worker.join(timeout=600)
    assert done.is_set() and texts

    # once idle: the figures shown are /metrics's
    server.wait_idle()
    seen = _polls(browser)
    _until("two polls after the request", lambda: _polls(browser) >= seen + 2)
    shown = _shown(browser)
    metrics = server.metrics()
    stable = [k for k in shown if "resident" not in k]  # the page cache moves on its own
    compared = 0
    for key in stable:
        got = shown[key]
        if key not in metrics:
            assert got["value"] is None, (key, got)  # absent from /metrics: none shown
            continue
        assert got["value"] is not None, key
        assert float(got["value"]) == metrics[key], (key, got, metrics[key])
        assert _close(str(got["text"]), metrics[key] * float(got["scale"] or 1)), (key, got)
        compared += 1
    assert compared >= 12, shown
    assert metrics['moepack_tokens_total{phase="decode"}'] >= 1000
    assert metrics['moepack_time_to_first_token_seconds{window="last"}'] > 0
    resident = shown["moepack_expert_bytes_resident"]["value"]
    assert resident is not None and 0 < float(resident) <= metrics["moepack_expert_bytes"]
    charts = browser.execute_script(
        "const o = {}; for (const c of document.querySelectorAll('.chart'))"
        " o[c.dataset.chart] = Number(c.dataset.points || 0); return o;"
    )
    assert len(charts) == 8 and all(n > 0 for n in charts.values()), charts
    # the request's line on stderr: its route, tokens, time to first token, why it stopped
    (logged,) = [r for r in server.requests() if "/v1/chat/completions" in r]
    assert logged.startswith("req_") and " openai POST /v1/chat/completions 200: " in logged
    assert "generated 3500," in logged and "stop length" in logged
    assert re.search(r"ttft \d+\.\d\d s, decode \d+\.\d tok/s, .* hit \d+%", logged), logged
    # the same numbers through /metrics.json, which the page reads
    status, text = server.get("/metrics.json")
    assert status == 200
    data = json.loads(text)
    assert data["server"] == {"alias": "m", "prefetch": "overlap", "routing": True}
    assert data["metrics"]["moepack_generations_total"] == metrics["moepack_generations_total"]
    assert len(data["routing"]["counts"]) == 4 and len(data["routing"]["counts"][0]) == 32

    # nothing came from anywhere but the server
    urls = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert urls and all(u.startswith(server.base + "/") for u in urls), urls

    # dark and light, 1280 px and a phone
    theme = browser.execute_script("return document.documentElement.dataset.theme")
    background = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    browser.find_element("id", "theme").click()
    other = browser.execute_script("return document.documentElement.dataset.theme")
    assert {theme, other} == {"dark", "light"}
    assert browser.execute_script("return getComputedStyle(document.body).backgroundColor") != (
        background
    )
    browser.save_screenshot(str(tmp_path / f"dashboard-1280-{other}.png"))
    browser.set_window_size(390, 844)
    _until("a poll at phone width", lambda: _polls(browser) >= seen + 4)
    width = browser.execute_script(
        "return [document.documentElement.scrollWidth, window.innerWidth]"
    )
    assert width[0] <= width[1], width  # nothing wider than the phone
    browser.save_screenshot(str(tmp_path / "dashboard-phone.png"))
    browser.set_window_size(1280, 1700)
    for name in ("dashboard-1280-generating.png", "dashboard-phone.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    print(f"dashboard screenshots in {tmp_path}")
