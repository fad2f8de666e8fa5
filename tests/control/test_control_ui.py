"""`runyard control ui`: the control plane's web console over a real daemon (a process on loopback, real
jobs). Over HTTP: who may see what (the daemon's token, a session, CSRF, a loopback Host), and pages that
show what the daemon's API answers. In headless Chromium (skipped without it; CI installs it): signing in
and each page, with screenshots in `control-ui-screenshots` under $RUNYARD_ARTIFACTS (else the tmp dir)."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from runyard.control.ui import create_ui, failures_by_class
from runyard.system.http_thread import AppThread, free_port
from runyard.system.web_sessions import COOKIE_NAME
from tests.browser import chrome, click_to_new_page, screenshot_dir

from .helpers import job

pytestmark = pytest.mark.slow


def csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


@pytest.fixture
def console(daemon_factory):
    """A daemon with one job that succeeded, one that failed (user error), one waiting; its console."""
    daemon = daemon_factory("--cpu-slots", "1", "--user-retries", "0", "--no-preemption")  # the waiting job waits
    c = daemon.client
    ok, bad = c.submit([job("fine", "--steps", "2"), job("broken", "--exit", "1")])
    c.wait(ok["id"])
    c.wait(bad["id"])
    holder = c.submit([job("holder", "--steps", "400", "--step-s", "0.1")])[0]
    c.wait(holder["id"], states=("running",))
    waiting = c.submit([job("waiting", "--steps", "1", priority=3)])[0]
    with AppThread(create_ui(c, c.token), name="control-ui") as server:
        yield {"url": server.url, "client": c, "ok": ok, "bad": bad, "waiting": waiting, "holder": holder}
    c.cancel(holder["id"])


def signed_in(url: str, token: str) -> httpx.Client:
    browser = httpx.Client(base_url=url)
    r = browser.post("/sign-in", data={"csrf": csrf(browser.get("/sign-in").text), "token": token})
    assert r.status_code == 303 and r.headers["location"] == "/", r.text
    return browser


def test_the_console_needs_the_token_a_session_csrf_and_a_loopback_host(console):
    url, token = console["url"], console["client"].token
    anonymous = httpx.Client(base_url=url)
    for page in ("/", "/jobs", f"/jobs/{console['ok']['id']}"):
        r = anonymous.get(page)
        assert (r.status_code, r.headers["location"]) == (303, "/sign-in"), page
    form = anonymous.get("/sign-in")
    assert "HttpOnly" in form.headers["set-cookie"] and "SameSite=strict" in form.headers["set-cookie"]
    assert anonymous.post("/sign-in", data={"csrf": csrf(form.text), "token": "wrong"}).status_code == 401
    assert anonymous.post("/sign-in", data={"token": token}).status_code == 403  # no CSRF token
    assert anonymous.get("/", headers={"Host": "evil.example:80"}).status_code == 403  # DNS rebinding
    browser = signed_in(url, token)
    assert token not in browser.cookies[COOKIE_NAME]
    assert browser.get("/", headers={"Host": "evil.example"}).status_code == 403
    assert browser.post("/sign-out", data={}).status_code == 403  # no CSRF token: still signed in
    assert browser.get("/").status_code == 200
    page = browser.get("/").text
    assert browser.post("/sign-out", data={"csrf": csrf(page)}).status_code == 303
    assert browser.get("/").status_code == 303


def test_pages_show_the_queue_jobs_logs_devices_and_failures(console):
    browser = signed_in(console["url"], console["client"].token)
    page = browser.get("/").text
    assert "0 of 1 free" in page and "cpu" in page  # the holder has the one slot
    queue = page[page.index('id="queue"'):page.index('id="active-section"')]
    assert f'/jobs/{console["waiting"]["id"]}' in queue and "fine" not in queue
    failures = page[page.index('id="failures"'):page.index('id="recent-section"')]
    assert "user_error" in failures and f'/jobs/{console["bad"]["id"]}' in failures
    detail = browser.get(f"/jobs/{console['bad']['id']}").text
    assert 'id="job-state">failed<' in detail and "user_error" in detail
    shown = console["client"].job(console["bad"]["id"])
    assert all(t["to_state"] in detail for t in shown["history"])
    log = console["client"].logs(console["ok"]["id"])["text"]
    assert log.strip() and log.strip().splitlines()[-1] in browser.get(f"/jobs/{console['ok']['id']}").text
    assert browser.get("/jobs/999999").status_code == 404
    assert all(f"/jobs/{j['id']}" in browser.get("/jobs").text for j in console["client"].jobs())


def test_failures_are_counted_by_class():
    jobs = [{"id": 1, "state": "failed", "failure": "user_error", "failures": [[10.0, "infra"], [20.0, "user_error"]]},
            {"id": 2, "state": "failed", "failure": "bad_spec", "failures": [], "ended_at": 5.0},
            {"id": 3, "state": "running", "failure": None, "failures": [[30.0, "infra"]]}]  # fmt: skip
    assert failures_by_class(jobs) == [("infra", 2, [1, 3]), ("user_error", 1, [1]), ("bad_spec", 1, [2])]


def test_the_cli_refuses_a_non_loopback_address(tmp_path):
    out = subprocess.run([sys.executable, "-m", "runyard", "control", "ui", "--state-dir", str(tmp_path),
                          "--host", "0.0.0.0", "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "invalid choice" in out.stderr


def test_the_console_in_a_browser(console, tmp_path):
    driver = chrome(tmp_path)
    shots = screenshot_dir(tmp_path, "control-ui-screenshots")
    try:
        driver.get(console["url"] + "/")
        assert driver.current_url.endswith("/sign-in")
        driver.find_element("id", "token").send_keys(console["client"].token)
        click_to_new_page(driver, "sign-in")
        assert driver.find_element("id", "device-summary").text.startswith("0 of 1 free")
        assert "waiting" in driver.find_element("id", "queue").text
        assert "user_error" in driver.find_element("id", "failures").text
        driver.save_screenshot(str(shots / "01-overview.png"))
        driver.get(f"{console['url']}/jobs/{console['bad']['id']}")
        assert driver.find_element("id", "job-state").text == "failed"
        driver.save_screenshot(str(shots / "02-failed-job.png"))
        driver.get(f"{console['url']}/jobs/{console['ok']['id']}")
        assert driver.find_element("id", "log").text.strip()
        driver.save_screenshot(str(shots / "03-job-log.png"))
        driver.get(f"{console['url']}/jobs")
        driver.save_screenshot(str(shots / "04-jobs.png"))
    finally:
        driver.quit()
    assert len(list(shots.glob("*.png"))) == 4
