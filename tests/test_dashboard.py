"""The live status page in a real browser: headless Chromium (Debian's chromium and chromium-driver, installed by
``make test``) driven by Selenium against a live API and worker. A screenshot is saved to tests/artifacts/."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest

from tests.queue_helpers import start_worker
from tests.test_api_support import ApiServer, flushed, wait_for

pytestmark = pytest.mark.slow
ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMEDRIVER = shutil.which("chromedriver")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1400"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def unless_stale(read):
    """``read()``, or None where the page redrew the element between finding and reading it (or has none yet)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    try:
        return read()
    except (StaleElementReferenceException, NoSuchElementException):
        return None


@pytest.mark.skipif(CHROMEDRIVER is None, reason="no chromedriver: `make test` installs chromium-driver")
def test_status_page_shows_a_live_worker_and_its_numbers_move(redis_server, tiny_model_path):
    from selenium.webdriver.common.by import By
    flushed(redis_server.url)
    worker = start_worker(redis_server.url, str(tiny_model_path), "dash-worker", "--max-num-seqs", "8")
    api = ApiServer(redis_server.url).wait_healthy()
    driver = browser()
    stop = threading.Event()
    try:
        wait_for(lambda: httpx.get(api.url + "/ready").status_code == 200, 120, 0.2, "ready")
        driver.get(api.url + "/dashboard")
        row_text = wait_for(lambda: unless_stale(lambda: driver.find_element(
            By.CSS_SELECTOR, '#workers tr[data-worker="dash-worker"]').text), 30, 0.2, "the worker on the page")
        assert "cpu" in row_text
        idle_tokens = driver.find_element(By.ID, "total-tokens").text

        def load() -> None:
            while not stop.is_set():
                httpx.post(api.url + "/v1/completions", timeout=60,
                           json={"prompt": "Busy", "max_tokens": 64, "ignore_eos": True})

        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        text_of = lambda element_id: unless_stale(lambda: driver.find_element(By.ID, element_id).text)  # noqa: E731
        busy = wait_for(lambda: (r := text_of("total-running")) not in (None, "0", "–") and r,
                        60, 0.2, "running sequences on the page")
        moved = wait_for(lambda: (t := text_of("total-tokens")) not in (None, idle_tokens) and t,
                         60, 0.2, "tokens per second changing on the page")
        assert int(busy) > 0 and moved != idle_tokens
        assert driver.find_element(By.ID, "line").get_attribute("points")  # the chart has points
        shared = list(range(5000, 5040))  # a 40-token prompt twice: the second starts from the prefix cache
        for _ in range(2):
            httpx.post(api.url + "/v1/completions", timeout=60, json={"prompt": shared, "max_tokens": 2})

        def tokens_saved() -> int:  # the table is redrawn every refresh: a row found may be gone when read
            text = unless_stale(lambda: driver.find_element(By.CSS_SELECTOR, '#workers tr[data-worker="dash-worker"]')
                                .find_elements(By.TAG_NAME, "td")[7].text)
            return int((text or "").replace(",", "") or 0)
        assert wait_for(lambda: tokens_saved() >= 40, 30, 0.2, "prompt tokens saved on the page")
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    finally:
        stop.set()
        driver.quit()
        api.stop()
        worker.kill()
