"""The status page in a real headless Chromium, against a coordinator with a live job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from rallypoint.cli.fake_imds import FakeImds
from rallypoint.client import ElasticClient, JobSpec, ShardFile, StacksReport, Timeline
from rallypoint.trainer import upload

from .._coordinator import Coordinator
from .._support import FILE, Stepping, cli, join_all, save_by_hand

pytestmark = pytest.mark.e2e

TOKEN = "page-token"
# Debian's packages (.ci/run installs them): nothing is downloaded at test time.
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Where screenshots are kept after the run (build/ is the build's own, and ignored).
ARTIFACTS = Path(
    os.environ.get("RALLYPOINT_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "build/artifacts"
)

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
    return [r for r in rows if len(r) == 9]  # not the "none" placeholder


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


# A node as torchrun's agent is one: joins, holds its heartbeat watch, joins again when
# the generation ends, and prints its credential for its "workers" (the test, which
# saves checkpoints for it as a worker with RALLYPOINT_CREDENTIAL would). With an IMDS
# URL it runs the PreemptionWatcher, and on a notice waits for the emergency version
# (a line on stdin) before it leaves and acknowledges, as a training loop does.
TIMELINE_NODE = """
import sys
from datetime import timedelta
from rallypoint.client import ElasticClient
url, job, node, token, port, imds = sys.argv[1:7]
c = ElasticClient(url, job, node, token)
watcher = None
if imds:
    from rallypoint.trainer import PreemptionWatcher
    watcher = PreemptionWatcher(
        c, imds_url=imds, vm_name=node, poll_interval=timedelta(seconds=0.1)
    ).start()
print("ready", flush=True)
while True:
    a = c.join("127.0.0.1", int(port))
    print("joined", a.generation, c.credential, flush=True)
    # A held watch, so that a SIGKILL cuts it; short where the watcher is asked often.
    hold = timedelta(seconds=0.5 if watcher else 2)
    while c.heartbeat(wait=hold).action == "continue":
        if watcher is not None and watcher.should_stop():
            print("notice", flush=True)
            sys.stdin.readline()
            watcher.finish()
"""


class Node:
    """One node's process, read line by line."""

    def __init__(self, url: str, name: str, port: int, imds: str = "") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TIMELINE_NODE, url, "tl", name, TOKEN, str(port), imds],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def expect(self, word: str) -> list[str]:
        """The rest of the next line that starts with ``word`` (the test's timeout
        bounds the wait)."""
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.split()[0] == word:
                return line.split()[1:]
        raise AssertionError(f"{self.name} exited ({self.proc.wait()}) before {word!r}")

    def joined(self, generation: int) -> str:
        """Its credential, once it joined ``generation``."""
        number, credential = self.expect("joined")
        assert int(number) == generation, f"{self.name} joined {number}, not {generation}"
        return credential


def save(url: str, members: dict[str, str], generation: int, step: int, persist: bool) -> int:
    """Every member's rank saves ``step``: in storage if ``persist``, else in its node's
    memory and its peer's (the next member). Returns the version."""
    names = sorted(members)
    info = None
    for i, name in enumerate(names):
        worker = ElasticClient(url, "tl", name, TOKEN, credential=members[name])
        begun = worker.begin_checkpoint(
            step, [FILE], generation=generation, persist=persist, persist_every=1000, memory=True
        )
        data = f"{name}@{step}".encode()
        if begun.persist:
            upload(begun.upload_urls[FILE], data)
        shard = ShardFile(name=FILE, size=len(data), checksum="xxh3-128:0")
        peer = names[(i + 1) % len(names)]
        info = worker.report_checkpoint(
            begun.version,
            [shard],
            generation=generation,
            storage=begun.persist,
            memory=[name, peer],
        )
    assert info is not None and info.state == "committed"
    return info.version


def drawing(driver: WebDriver) -> dict[str, list[dict[str, Any]]]:
    """The timeline's marks as the browser has them, read in one script (the page swaps
    its content every 2 s)."""
    found: dict[str, list[dict[str, Any]]] = driver.execute_script(
        """
        const svg = document.querySelector('#timeline svg');
        const read = (selector) => [...(svg ? svg.querySelectorAll(selector) : [])].map(g => ({
          cls: g.getAttribute('class'), ...g.dataset,
          title: g.querySelector('title') ? g.querySelector('title').textContent : ''}));
        return {generations: read('g.generation'), restarts: read('g.restart'),
                checkpoints: read('g.checkpoint'), pointers: read('g.pointer')};
        """
    )
    return found


def test_the_timeline_follows_a_kill_a_rejoin_and_a_notice(
    coordinator: Coordinator, browser: WebDriver
) -> None:
    url = coordinator.url
    operator = ElasticClient(url, "tl", "operator", TOKEN)
    # A round with all 3 seals at once; last_call only bounds how late the third may be.
    operator.create_job(
        2, 3, last_call=timedelta(seconds=5), heartbeat_timeout=timedelta(seconds=30)
    )
    nodes: dict[str, Node] = {}
    with FakeImds() as imds:
        try:
            # node-c (with the watcher, which imports torch) first: a, b and c seal one
            # generation of 3, not one of 2 that c's late join ends.
            nodes["node-c"] = Node(url, "node-c", 32002, imds.url)
            nodes["node-c"].expect("ready")
            for i, name in enumerate(("node-a", "node-b")):
                nodes[name] = Node(url, name, 32000 + i)
            gen1 = {name: node.joined(1) for name, node in nodes.items()}
            save(url, gen1, 1, 10, persist=True)  # v1
            save(url, gen1, 1, 20, persist=False)  # v2, in memory

            # A kill: the survivors regroup at once.
            nodes["node-b"].proc.send_signal(signal.SIGKILL)
            nodes["node-b"].proc.wait()
            gen2 = {name: nodes[name].joined(2) for name in ("node-a", "node-c")}
            save(url, gen2, 2, 30, persist=False)  # v3

            # The node comes back: a newcomer ends generation 2.
            nodes["node-b"] = Node(url, "node-b", 32001)
            gen3 = {name: node.joined(3) for name, node in nodes.items()}
            save(url, gen3, 3, 40, persist=True)  # v4
            bad = save(url, gen3, 3, 50, persist=False)  # v5
            operator.quarantine(bad, "loss spiked")

            # The page, opened now and never reloaded, follows what comes next.
            sign_in(browser, url)
            browser.get(f"{url}/jobs/tl")
            WebDriverWait(browser, 10, poll_frequency=0.2).until(
                lambda d: len(drawing(d)["generations"]) == 3
            )

            # A notice: the emergency version, then the node leaves and acknowledges.
            imds.schedule("node-c")
            nodes["node-c"].expect("notice")
            save(url, gen3, 3, 60, persist=True)  # v6, durable
            assert nodes["node-c"].proc.stdin is not None
            nodes["node-c"].proc.stdin.write("saved\n")
            nodes["node-c"].proc.stdin.flush()
            assert nodes["node-c"].proc.wait(30) == 0
            assert imds.acknowledged
            gen4 = {name: nodes[name].joined(4) for name in ("node-a", "node-b")}
            save(url, gen4, 4, 70, persist=False)  # v7: the latest, in memory

            WebDriverWait(browser, 15, poll_frequency=0.2).until(
                lambda d: len(drawing(d)["checkpoints"]) == 7
            )
            marks = drawing(browser)
            assert [(g["generation"], g["worldSize"]) for g in marks["generations"]] == [
                ("1", "3"),
                ("2", "2"),
                ("3", "3"),
                ("4", "2"),
            ]
            assert marks["generations"][-1]["cls"] == "generation running"
            # The kill is noticed by the dropped watch connection or, on a loaded
            # machine, by the heartbeat timeout: either is a lost node, as recorded.
            title = marks["generations"][0]["title"]
            assert "(node lost): node node-b " in title, title
            assert [(r["generation"], r["cause"]) for r in marks["restarts"]] == [
                ("1", "lost"),
                ("2", "joined"),
                ("3", "preempted"),
            ]
            assert "node node-c left: preempted (Preempt)" in marks["restarts"][2]["title"]
            assert [(c["version"], c["tier"], c["cls"]) for c in marks["checkpoints"]] == [
                ("1", "durable", "checkpoint durable collected"),
                ("2", "memory", "checkpoint memory collected"),
                ("3", "memory", "checkpoint memory collected"),
                ("4", "durable", "checkpoint durable"),
                ("5", "memory", "checkpoint memory quarantined"),
                ("6", "durable", "checkpoint durable"),
                ("7", "memory", "checkpoint memory"),
            ]
            assert [(p["cls"], p["version"]) for p in marks["pointers"]] == [
                ("pointer latest", "7"),
                ("pointer durable", "6"),
            ]

            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            browser.set_window_size(1100, 1000)
            browser.find_element(By.ID, "timeline").screenshot(
                str(ARTIFACTS / "status-page-timeline.png")
            )
            browser.save_screenshot(str(ARTIFACTS / "status-page.png"))
            loaded = browser.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)"
            )
            assert all(str(name).startswith(url) for name in loaded), loaded

            # The same history for terminals, and as JSON.
            flags = ["--url", url, "--token", TOKEN]
            shown = cli("jobs", "show", "tl", "--timeline", *flags)
            assert shown.returncode == 0, shown.stderr
            lines = shown.stdout.splitlines()
            assert lines[0] == "job tl: generation 4 sealed, world size 2 (nodes 2:3)"
            assert lines[1] == (
                "latest checkpoint: v7 (step 70, generation 4, in memory); "
                "newest durable: v6 (step 60, generation 3)"
            )
            events = [line.split(None, 2)[2] for line in lines[lines.index("") + 3 :]]
            ended = [e for e in events if " ended " in e]
            assert ended[0].startswith("generation 1 ended [lost]: node node-b ")
            assert ended[1:] == [
                "generation 2 ended [joined]: node node-b joined",
                "generation 3 ended [preempted]: node node-c left: preempted (Preempt)",
            ]
            assert "checkpoint v5 step 50 (generation 3) committed: memory, quarantined" in events
            assert "checkpoint v1 step 10 (generation 1) committed: durable, collected" in events
            assert "checkpoint v7 step 70 (generation 4) committed: memory, latest" in events
            as_json = cli("jobs", "show", "tl", "--timeline", "--json", *flags)
            parsed = Timeline.model_validate_json(as_json.stdout)
            assert [g.cause for g in parsed.generations] == ["lost", "joined", "preempted", None]
        finally:
            for node in nodes.values():
                node.proc.kill()
                node.proc.wait()


def test_a_reader_token_sees_its_own_jobs_timeline_only(coordinator: Coordinator) -> None:
    url = coordinator.url
    for job in ("mine", "theirs"):
        ElasticClient(url, job, "n", TOKEN).join(
            "127.0.0.1", 1, spec=JobSpec(min_nodes=1, max_nodes=1, last_call=timedelta(0))
        )
    reader = ElasticClient(url, "mine", "op", TOKEN).create_token("reader").token
    auth = {"Authorization": f"Bearer {reader}"}

    own = httpx.get(f"{url}/v1/jobs/mine/timeline", headers=auth)
    assert own.status_code == 200
    assert [g.generation for g in Timeline.model_validate_json(own.content).generations] == [1]
    drawn = httpx.get(f"{url}/jobs/mine/timeline.svg", headers=auth)
    assert drawn.status_code == 200 and drawn.headers["content-type"] == "image/svg+xml"
    assert drawn.text.startswith("<svg xmlns=") and 'data-generation="1"' in drawn.text
    assert drawn.headers["content-security-policy"] == "default-src 'none'"

    for path in ("/v1/jobs/theirs/timeline", "/jobs/theirs/timeline.svg"):
        refused = httpx.get(url + path, headers=auth)
        assert refused.status_code == 403, path
        assert refused.json()["code"] == "forbidden", path
    page = httpx.get(f"{url}/jobs/theirs", headers=auth)
    assert page.status_code == 403 and "timeline-svg" not in page.text
    anonymous = httpx.get(f"{url}/jobs/mine/timeline.svg")
    assert anonymous.status_code == 401 and anonymous.json()["code"] == "unauthorized"
    admin = {"Authorization": f"Bearer {TOKEN}"}
    missing = httpx.get(f"{url}/jobs/nojob/timeline.svg", headers=admin)
    assert missing.status_code == 404 and missing.json()["code"] == "unknown_job"
    bad = httpx.get(f"{url}/jobs/bad$id/timeline.svg", headers=admin)
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_id"

    # The pages allow only their own inline style and script, and requests back here.
    policy = httpx.get(f"{url}/jobs/mine", headers=auth).headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "script-src 'nonce-" in policy and "unsafe-inline" not in policy


# What py-spy dump prints of a process stopped in its all-reduce (cut short).
STACKS = """Process 4242: python train.py
Python v3.12.3 (/usr/bin/python3.12)

Thread 4242 (idle): "MainThread"
    allreduce (torch/distributed/distributed_c10d.py:2806)
    step (train.py:41)
    <module> (train.py:60)
"""


def table(driver: WebDriver, element_id: str) -> list[dict[str, Any]]:
    """A table's rows (class and cells' text), read in one script."""
    rows: list[dict[str, Any]] = driver.execute_script(
        "return [...document.querySelectorAll('#' + arguments[0] + ' tbody tr')]"
        ".map(tr => ({cls: tr.className, cells: [...tr.cells].map(td => td.innerText)}))",
        element_id,
    )
    return [r for r in rows if len(r["cells"]) > 1]  # not the "none" placeholder


def test_the_page_shows_progress_a_straggler_and_a_hang_with_its_stacks(
    coordinator: Coordinator, browser: WebDriver
) -> None:
    url = coordinator.url
    nodes = [ElasticClient(url, "health", n, TOKEN) for n in ("node-a", "node-b", "node-c")]
    join_all(nodes, JobSpec(min_nodes=3, max_nodes=3, heartbeat_timeout=timedelta(seconds=10)))
    rank = {n.node_id: n.assignment.rank for n in nodes if n.assignment is not None}
    sign_in(browser, url)
    browser.set_window_size(1100, 1300)
    browser.get(f"{url}/jobs/health")
    # node-c's own share of each step takes 5 times the others': it is the straggler.
    with Stepping(nodes, own={"node-c": 0.5}) as stepping:
        # The page, never reloaded by the test, names it within its 3 windows of 5 s.
        WebDriverWait(browser, 30, poll_frequency=0.2).until(
            lambda d: any("straggler" in r["cls"] for r in table(d, "members"))
        )
        rows = {r["cells"][1]: r for r in table(browser, "members")}
        assert rows["node-c"]["cls"] == "alive straggler"
        assert rows["node-c"]["cells"][8] == "0.20 straggler"
        assert rows["node-a"]["cells"][8] == rows["node-b"]["cells"][8] == "1.00"
        assert all(int(r["cells"][5]) > 0 and r["cells"][6] == "train" for r in rows.values())
        assert text_of(browser, "health") == (
            "hang limit 3.0s (floor); phase limit 600 s; "
            f"stragglers: node-c (rank {rank['node-c']}, score 0.20); hangs so far: 0"
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "status-page-straggler.png"))
        stepping.freeze("node-b")
        stepping.ended()

    # The hang: a row of its own, and a restart of its own on the timeline.
    WebDriverWait(browser, 15, poll_frequency=0.2).until(lambda d: table(d, "hangs"))
    (row,) = table(browser, "hangs")
    assert row["cells"][:4] == ["1", "node-b", str(rank["node-b"]), "train"]
    assert row["cells"][-1] == "not sent yet"
    marks = drawing(browser)
    assert [(r["generation"], r["cause"]) for r in marks["restarts"]] == [("1", "hung")]
    assert "restart (rank hung) at " in marks["restarts"][0]["title"]
    legend: list[str] = browser.execute_script(
        "return [...document.querySelectorAll('#timeline svg g.legend text')]"
        ".map(t => t.textContent)"
    )
    assert "rank hung" in legend

    # node-b's agent sends the stacks it took before it stopped the process.
    node_b = nodes[1]
    node_b.report_stacks(
        1,
        StacksReport(
            rank=rank["node-b"], pid=4242, stacks=STACKS, taken_by="py-spy 0.4.1 (not suspended)"
        ),
    )
    WebDriverWait(browser, 15, poll_frequency=0.2).until(
        lambda d: [r["cells"][-1] for r in table(d, "hangs")] == ["py-spy 0.4.1 (not suspended)"]
    )
    assert "hangs so far: 1" in text_of(browser, "health")
    browser.find_element(By.LINK_TEXT, "1").click()
    WebDriverWait(browser, 10, poll_frequency=0.1).until(lambda d: text_of(d, "stacks"))
    assert text_of(browser, "reason").startswith(
        f"rank {rank['node-b']} on node node-b hung: no progress for 3."
    )
    assert text_of(browser, "stacks") == STACKS
    assert text_of(browser, "taken-by").startswith("Taken by py-spy 0.4.1 (not suspended)")
    (facts,) = table(browser, "hang")
    assert facts["cells"][:3] == ["node-b", str(rank["node-b"]), "4242"]
    browser.save_screenshot(str(ARTIFACTS / "status-page-hang.png"))
    browser.find_element(By.LINK_TEXT, "job health").click()
    WebDriverWait(browser, 10, poll_frequency=0.1).until(lambda d: table(d, "hangs"))
