"""The status page in a real headless Chromium, against a coordinator with a live job."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from rallypoint.client import ElasticClient, JobSpec

from ._coordinator import Coordinator
from .test_cli import save_by_hand

pytestmark = pytest.mark.e2e

TOKEN = "page-token"
# Debian's packages (.ci/run installs them): nothing is downloaded at test time.
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

NODE = """
import sys
from datetime import timedelta
from rallypoint.client import ElasticClient, JobSpec
c = ElasticClient(sys.argv[1], "live", sys.argv[2], sys.argv[3] or None)
while True:  # a member: join, watch the generation, re-join when it ends
    a = c.join("127.0.0.1", int(sys.argv[4]))
    print("joined", a.generation, flush=True)
    while c.heartbeat(wait=timedelta(seconds=2)).action == "continue":
        pass
"""


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(["--storage", f"local:{tmp_path / 'storage'}", "--token", TOKEN], {}).start()
    yield c
    c.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        # The machine has no internet: Chromium's own background traffic only fails.
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def member_rows(driver: WebDriver) -> list[list[str]]:
    """The members table, read in one script: the page swaps its content every 2 s, so
    elements found one call earlier may be gone by the next."""
    rows: list[list[str]] = driver.execute_script(
        "return [...document.querySelectorAll('#members tbody tr')]"
        ".map(tr => [...tr.querySelectorAll('td')].map(td => td.innerText))"
    )
    return [r for r in rows if len(r) == 5]  # not the "none" placeholder


def text_of(driver: WebDriver, element_id: str) -> str:
    text: str = driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : ''",
        element_id,
    )
    return text


def test_the_page_shows_members_and_follows_a_node_dying(
    coordinator: Coordinator, browser: WebDriver
) -> None:
    url = coordinator.url
    ElasticClient(url, "live", "setup", TOKEN).create_job(
        2, 3, last_call=timedelta(seconds=0.5), heartbeat_timeout=timedelta(seconds=30)
    )
    nodes = {
        name: subprocess.Popen(
            [sys.executable, "-c", NODE, url, name, TOKEN, str(31000 + i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, name in enumerate(("node-a", "node-b", "node-c"))
    }
    try:
        for proc in nodes.values():
            assert proc.stdout is not None and proc.stdout.readline().split()[0] == "joined"

        # Signing in: a wrong token is refused, the right one opens the job list.
        browser.get(f"{url}/")
        browser.find_element(By.ID, "token").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        WebDriverWait(browser, 10, poll_frequency=0.1).until(
            lambda d: "not a valid token of this coordinator" in text_of(d, "token-error")
        )
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.LINK_TEXT, "live"))
        browser.find_element(By.LINK_TEXT, "live").click()

        WebDriverWait(browser, 10).until(lambda d: len(member_rows(d)) == 3)
        rows = member_rows(browser)
        assert sorted(r[0] for r in rows) == ["0", "1", "2"]
        assert {r[1] for r in rows} == set(nodes)
        assert {r[4] for r in rows} == {"alive"}
        assert "generation 1 sealed, world size 3" in text_of(browser, "summary")

        # SIGKILL one node; the page, never reloaded by the test, shows the survivors'
        # new generation and why the first one ended.
        nodes["node-c"].send_signal(signal.SIGKILL)
        nodes["node-c"].wait()
        WebDriverWait(browser, 30, poll_frequency=0.2).until(
            lambda d: {r[1] for r in member_rows(d)} == {"node-a", "node-b"}
        )
        # Read once more: the members above and these two came from one refresh or two.
        WebDriverWait(browser, 10, poll_frequency=0.2).until(
            lambda d: "generation 2 sealed, world size 2" in text_of(d, "summary")
        )
        generations = text_of(browser, "generations")
        assert "node node-c dropped its heartbeat connection" in generations

        # Everything the page loaded came from the coordinator itself.
        loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert all(str(name).startswith(url) for name in loaded), loaded
    finally:
        for proc in nodes.values():
            proc.kill()
            proc.wait()


def sign_in(driver: WebDriver, url: str) -> None:
    driver.get(f"{url}/")
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(driver, 10, poll_frequency=0.1).until(lambda d: d.find_elements(By.ID, "jobs"))


def test_the_page_shows_each_versions_durability_and_the_pointers(
    coordinator: Coordinator, browser: WebDriver
) -> None:
    url = coordinator.url
    node = ElasticClient(url, "tiers", "n", TOKEN)
    node.join("127.0.0.1", 1, spec=JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0)))
    for step in (1, 2, 3):  # only the first persisted: every 3rd after it
        save_by_hand(node, step, every=3)
    node.begin_checkpoint(4)  # begun, never reported
    sign_in(browser, url)
    jobs = text_of(browser, "jobs")
    assert "v3 step 3 (memory)" in jobs
    browser.get(f"{url}/jobs/tiers")
    # One script: the page swaps its content every 2 s.
    rows: list[list[object]] = browser.execute_script(
        "return [...document.querySelectorAll('#checkpoints tbody tr')].map(tr => ["
        "  tr.className, tr.cells[0].innerText,"
        "  [...tr.querySelectorAll('.badge')].map(b => b.className + ':' + b.innerText)"
        "])"
    )
    assert rows == [
        ["pending", "4", ["badge pending:pending"]],
        ["memory", "3", ["badge memory:memory", "badge pointer latest:latest"]],
        ["memory", "2", ["badge memory:memory"]],
        ["durable", "1", ["badge durable:durable", "badge pointer fallback:newest durable"]],
    ]
    assert text_of(browser, "summary").endswith(
        "latest checkpoint: v3 (step 3, generation 1, in memory only); "
        "newest durable: v1 (step 1, generation 1)"
    )


def test_pages_need_the_token_and_escape_what_nodes_send(coordinator: Coordinator) -> None:
    url = coordinator.url
    assert httpx.get(f"{url}/").status_code == 401
    assert httpx.get(f"{url}/jobs/live").status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    node = ElasticClient(url, "esc", "n", TOKEN)
    node.join("127.0.0.1", 1, spec=JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0)))
    node.leave("<script>alert(1)</script>")
    page = httpx.get(f"{url}/jobs/esc", headers=auth)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>alert(1)" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    missing = httpx.get(f"{url}/jobs/nojob", headers=auth)
    assert missing.status_code == 404 and "no job" in missing.text
    assert httpx.get(f"{url}/jobs/bad$id", headers=auth).status_code == 400
