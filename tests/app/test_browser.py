"""End to end in headless Chromium (Debian's `chromium` and `chromium-driver`) through Selenium: type a
prompt, click Generate, wait for the output, check coloured spans of both models, save a screenshot; click
Stop during a generation and find it aborted with every block back and its cost shown; run side by side and
find both answers starting at the same height with the comparison line under them."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from app.controls import DEFAULT_MAX_TOKENS
from tests.service.conftest import stalled

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 60  # bounded wait for the page and for the generation
SCREENSHOT_COPY = Path("/tmp/app_screenshot.png")

pytestmark = pytest.mark.skipif(not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()),
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver); CI installs them")


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1200"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=DriverService(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_generate_in_the_browser_colours_tokens_of_both_models(browser, app_url, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    browser.get(app_url)
    prompt = wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, "#prompt textarea")))
    prompt.send_keys("Write a haiku about routers.")
    browser.find_element(By.CSS_SELECTOR, "#generate").click()
    # the app starts at schedule:every=2 (see conftest), so both models write; the run ends with a finish
    wait.until(lambda d: "length" in d.find_element(By.CSS_SELECTOR, "#generate-metrics").text)
    small = browser.find_elements(By.CSS_SELECTOR, "#generate-output span.tr-tok.tr-small")
    large = browser.find_elements(By.CSS_SELECTOR, "#generate-output span.tr-tok.tr-large")
    assert len(small) == len(large) == DEFAULT_MAX_TOKENS // 2  # every other one from the large model
    colours = {e.value_of_css_property("background-color") for e in small[:3] + large[:3]}
    assert len(colours) == 2
    assert large[0].get_attribute("title").startswith("large · score 1.000")
    assert "large share 50%" in browser.find_element(By.CSS_SELECTOR, "#generate-metrics").text
    shot = tmp_path / "app.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
    SCREENSHOT_COPY.write_bytes(shot.read_bytes())


def test_stop_in_the_browser_aborts_and_frees_every_block(browser, app_url, svc):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    browser.get(app_url)
    prompt = wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, "#prompt textarea")))
    prompt.send_keys("Write a haiku about routers.")  # greedy on the tiny pair: longer than the default cap
    browser.find_element(By.CSS_SELECTOR, "#generate").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#generate-output span.tr-tok"))
    with stalled(svc):  # no step runs: the request is surely still in the engine when Stop lands
        assert "elapsed" in browser.find_element(By.CSS_SELECTOR, "#generate-metrics").text
        browser.find_element(By.CSS_SELECTOR, "#generate-stop").click()
        wait.until(lambda d: "stopped" in d.find_element(By.CSS_SELECTOR, "#generate-metrics").text)
        # the page's event is cancelled; Stop itself shows the cost so far (estimated from the tokens written)
        assert "cost ~$0.0" in browser.find_element(By.CSS_SELECTOR, "#generate-metrics").text
        wait.until(lambda d: svc.stats() and all(seq.aborted for seq in svc.runtime.active.values()))
    svc.generate("hi", max_tokens=2)  # one more request passes step boundaries in both subservers
    svc.generate("hi", policy="all-large", max_tokens=2)
    stats = svc.stats()
    assert stats["active_requests"] == 0
    assert all(stats[m]["free_blocks"] == stats[m]["total_blocks"] for m in ("small", "large"))
    shown = browser.find_elements(By.CSS_SELECTOR, "#generate-output span.tr-tok")
    assert 0 < len(shown) < DEFAULT_MAX_TOKENS


def test_side_by_side_answers_start_level_with_a_line_under_them(browser, app_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    browser.get(app_url)
    wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, "button#tab-side-by-side-button"))).click()
    prompt = wait.until(ready.element_to_be_clickable((By.CSS_SELECTOR, "#sbs-prompt textarea")))
    prompt.send_keys("Count to ten.")
    browser.find_element(By.CSS_SELECTOR, "#sbs-run").click()
    wait.until(lambda d: "For this prompt" in d.find_element(By.CSS_SELECTOR, "#sbs-comparison").text)
    left, right = (browser.find_element(By.CSS_SELECTOR, f"#{side}-output") for side in ("left", "right"))
    assert left.location["y"] == right.location["y"]  # one side has a threshold slider, the other none
    assert browser.find_element(By.CSS_SELECTOR, "#sbs-comparison").location["y"] > left.location["y"]
