"""Headless Chromium for the web consoles' browser tests: Debian's `chromium` and `chromedriver`
(.ci/setup_browser.sh installs them), driven by Selenium pointed at those binaries, so nothing is
downloaded while the tests run. Without them the tests skip saying so, except in CI (CI=true), where
they fail. Screenshots go to $RUNYARD_ARTIFACTS/<folder> (CI keeps it), else under the test's tmp dir."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _missing() -> str | None:
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.exists(p) or shutil.which(Path(p).name))]
    if absent:
        return f"{' and '.join(absent)} not installed (run .ci/setup_browser.sh: Debian's chromium, chromium-driver)"
    try:
        import selenium  # noqa: F401  (the dev extra's; absent in the role venvs)
    except ImportError:
        return "selenium is not installed (pip install 'runyard[dev]')"
    return None


def chrome(tmp_path: Path):
    """A headless Chromium WebDriver, or a skip (a failure in CI) naming what is missing."""
    reason = _missing()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1800", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    driver_path = CHROMEDRIVER if os.path.exists(CHROMEDRIVER) else shutil.which("chromedriver")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    return driver


def screenshot_dir(tmp_path: Path, folder: str) -> Path:
    base = os.environ.get("RUNYARD_ARTIFACTS")
    out = Path(base) / folder if base else tmp_path / folder
    out.mkdir(parents=True, exist_ok=True)
    return out


MARK = "__runyardPreviousPage"  # set on the page a click leaves; a new document does not have it


def click_to_new_page(driver, element_id: str, timeout_s: float = 20) -> None:
    """Click a button or link that loads a page, and return once the new document has replaced the old and
    finished loading. Waiting for the old <html> element to go stale is not enough: Chromium answers a lookup
    made while the next page is still loading with "Node with given id does not belong to the document" (a
    plain WebDriverException, not a stale-element one), so the wait ignores those and checks a mark instead."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script(f"window.{MARK} = true;")
    driver.find_element("id", element_id).click()

    def loaded(d) -> bool:
        return d.execute_script(f"return window.{MARK} === undefined && document.readyState === 'complete';")

    WebDriverWait(driver, timeout_s, ignored_exceptions=(WebDriverException,)).until(loaded)
