"""The web page in a real browser (headless Chromium through selenium): ingest, ask, watch the
answer stream in, see the reuse numbers and the heat map of recomputed tokens."""

import os
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import CORPUS
from test_server import Server

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.serving.server import create_app

QUESTION = "What is the code in the kitchen drawer?"


def _driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not browser or not driver:
        if os.environ.get("CI"):
            raise FileNotFoundError("chromium and chromium-driver are not installed (.ci/run installs them)")
        pytest.skip("no chromium / chromedriver here (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1400"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture()
def page(tiny_pair, tmp_path):
    engine = CacheClipEngine(*tiny_pair, tmp_path / "store", EngineConfig(
        chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=3, packets=None))
    server = Server(create_app(engine, default_max_tokens=8))
    browser = _driver()
    yield server, engine, browser
    browser.quit()
    server.stop()
    engine.close()


def test_ingest_ask_stream_and_heat_map_in_chromium(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import Select, WebDriverWait

    server, engine, browser = page
    wait = WebDriverWait(browser, 60)
    browser.get(server.url + "/")
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#mode option"))
    browser.find_element(By.ID, "docs").send_keys("\n\n".join(CORPUS))
    browser.find_element(By.ID, "ingest").click()
    wait.until(ready.text_to_be_present_in_element((By.ID, "ingested"), "chunks"))
    assert len(engine.index) > 0
    browser.find_element(By.ID, "question").send_keys(QUESTION)
    Select(browser.find_element(By.ID, "mode")).select_by_value("cacheclip")
    browser.find_element(By.ID, "compare").click()
    browser.find_element(By.ID, "ask").click()
    wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1")
    shown = browser.find_element(By.ID, "answer").text
    expected = engine.chat([{"role": "user", "content": QUESTION}], max_new_tokens=128).text
    assert shown == expected.strip()
    chunks = browser.find_elements(By.CSS_SELECTOR, "#chunks .chunk")
    assert chunks and browser.find_elements(By.CSS_SELECTOR, "#chunks mark")  # the heat map
    stats = browser.find_element(By.ID, "stats").text
    assert "effective fraction" in stats and "TTFT / full" in stats
    shot = os.environ.get("CACHECLIP_SCREENSHOT")
    if shot:
        browser.save_screenshot(str(Path(shot)))
    assert httpx.get(server.url + "/health").json()["running"] == 0


def test_the_page_asks_for_the_key_once_on_a_guarded_server(tiny_pair, tmp_path):
    """`serve --api-key/--admin-key`: the page loads without a key (it is static), asks for one on
    the first 401, and sends it with every request after (ingest, then the streamed question)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import WebDriverWait

    from cacheclip_rag.serving.access import Keys

    engine = CacheClipEngine(*tiny_pair, tmp_path / "store", EngineConfig(
        chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=3, packets=None))
    server = Server(create_app(engine, default_max_tokens=8, keys=Keys("question-key", "admin-key")))
    browser = _driver()
    try:
        wait = WebDriverWait(browser, 60)
        browser.get(server.url + "/")
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#mode option"))  # /health needs no key
        assert not browser.find_element(By.ID, "auth").is_displayed()
        browser.find_element(By.ID, "docs").send_keys("\n\n".join(CORPUS))
        browser.find_element(By.ID, "ingest").click()
        wait.until(lambda b: b.find_element(By.ID, "auth").is_displayed())
        assert "admin key" in browser.find_element(By.ID, "authmsg").text
        browser.find_element(By.ID, "authkey").send_keys("admin-key")
        browser.find_element(By.ID, "authgo").click()
        wait.until(ready.text_to_be_present_in_element((By.ID, "ingested"), "chunks"))
        assert len(engine.index) > 0
        browser.find_element(By.ID, "question").send_keys(QUESTION)
        browser.find_element(By.ID, "ask").click()
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1")
        assert not browser.find_element(By.ID, "auth").is_displayed()  # asked once
        assert browser.find_element(By.ID, "answer").text
    finally:
        browser.quit()
        server.stop()
        engine.close()
