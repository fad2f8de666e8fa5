"""The market's web console in a real browser (headless Chromium from Debian, through Selenium) against a
real market server on loopback: a tenant signs in, funds through the test rail, places a demand, sees it
matched with a provider's listing and its lease settle (the provider and the clock are driven through the
API, as the e2e market tests drive them); the provider sees its earnings; another tenant's direct URLs
are refused; a form posted without its CSRF token is refused. Each page's screenshot is saved in the
folder `console-screenshots` under $RUNYARD_ARTIFACTS (CI keeps it), else under the test's tmp dir."""

from __future__ import annotations

import pytest

from runyard.market.server import ServerThread
from tests.browser import chrome, click_to_new_page, screenshot_dir

from .helpers import HOUR, listing, new_party, open_market, operator_client

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("browser")]


class Page:
    """The browser, the console's address and the screenshot folder."""

    def __init__(self, driver, url: str, shots):
        self.driver, self.url, self.shots, self.n = driver, url, shots, 0

    def open(self, path: str) -> None:
        self.driver.get(self.url + path)

    def text(self, element_id: str) -> str:
        return self.driver.find_element("id", element_id).text

    def fill(self, element_id: str, value: str) -> None:
        box = self.driver.find_element("id", element_id)
        box.clear()
        box.send_keys(value)

    def click(self, element_id: str) -> None:
        """Click a button or link that loads a page, and wait until the new page has loaded."""
        click_to_new_page(self.driver, element_id)

    def shot(self, name: str) -> None:
        self.n += 1
        path = self.shots / f"{self.n:02d}-{name}.png"
        assert self.driver.save_screenshot(str(path)), path

    def sign_in(self, token: str) -> None:
        self.open("/console/sign-in")
        self.fill("token", token)
        self.click("sign-in")

    def sign_out(self) -> None:
        self.click("sign-out")
        assert self.driver.current_url.endswith("/console/sign-in")


@pytest.fixture
def browser(tmp_path):
    driver = chrome(tmp_path)
    try:
        yield driver
    finally:
        driver.quit()


def test_a_tenant_and_a_provider_trade_through_the_console(browser, url_factory, tmp_path):
    market = open_market(url_factory("sqlite", migrated=True), fee_bps=200)
    with ServerThread(market) as server:
        page = Page(browser, server.url, screenshot_dir(tmp_path, "console-screenshots"))
        ops = operator_client(market, server.url)
        provider = new_party(server.url, "fast-gpus", "provider", operator=ops)
        tenant = new_party(server.url, "lab-one", "tenant", operator=ops)
        other = new_party(server.url, "lab-two", "tenant", operator=ops)

        page.open("/console/tenant")  # not signed in: sent to the sign-in form
        assert browser.current_url.endswith("/console/sign-in")
        page.shot("sign-in")
        page.sign_in(tenant.client.token)
        assert browser.current_url.endswith("/console/tenant")
        assert page.text("who") == "lab-one (tenant, verified)"
        assert tenant.client.token not in browser.current_url
        cookie = browser.get_cookie("runyard_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["value"] != tenant.client.token
        page.shot("tenant-empty")

        # Funds through the test rail.
        page.fill("fund-amount", "50000")
        page.click("fund")
        assert "deposit of 50,000 received" in page.text("notice")
        assert "50,000" in page.text("balances")
        page.shot("tenant-funded")

        # A demand nothing fits yet: open, its escrow held.
        page.fill("accelerator_kinds", "h100-80gb")
        page.fill("device_count", "2")
        page.fill("duration_h", "1")
        page.fill("max_price", "300")
        page.click("place-demand")
        assert page.text("demand-state") == "open"
        assert "waiting for a listing" in page.text("matching")
        demand_url = browser.current_url
        page.shot("demand-open")

        # The provider lists capacity (through the API): the demand matches it.
        provider.client.create_listing(**listing(price_per_device_hour=250))
        browser.get(demand_url)
        assert page.text("demand-state") == "matched"
        page.shot("demand-matched")
        page.click("lease-link")
        lease_id = int(browser.current_url.rsplit("/", 1)[1])
        assert page.text("lease-state") == "offered"
        page.shot("lease-offered")

        # The provider accepts and runs it, reports an hour on 2 devices; the tenant acknowledges; the window
        # closes and the dispute window passes: the lease settles.
        provider.client.accept_lease(lease_id)
        started = provider.client.start_lease(lease_id)["started_at"]
        ops.advance_clock(HOUR)
        record = provider.client.report_usage(lease_id, 1, started, started + HOUR, 2 * HOUR)
        tenant.client.acknowledge(record["id"])
        ops.sweep()
        ops.advance_clock(700)
        ops.sweep()
        browser.refresh()
        assert page.text("lease-state") == "settled"
        assert "7200 acknowledged 7200" in page.text("records")  # the usage record: 2 device-hours
        # 2 device-hours at 250 = 500; 2% fee = 10; the provider gets 490.
        assert page.text("lease-payments") == "490 · 10 · 0"
        page.shot("lease-settled")
        page.open("/console/tenant")
        assert "settled" in page.text("leases")
        page.shot("tenant-after")
        page.sign_out()

        # The provider sees its earnings.
        page.sign_in(provider.client.token)
        assert browser.current_url.endswith("/console/provider")
        assert page.text("earnings-earned") == "490"
        assert "settled" in page.text("leases")
        page.shot("provider")
        page.sign_out()

        # Another tenant: the first one's pages are refused, as the API refuses them.
        page.sign_in(other.client.token)
        for path in (f"/console/leases/{lease_id}", demand_url.split(server.url, 1)[1]):
            page.open(path)
            assert "no " in page.text("error-message") and "of yours" in page.text("error-message")
            assert page.text("error").startswith("404")
        page.shot("other-tenant-refused")
        page.open("/console/provider")
        assert page.text("error").startswith("403")

        # A form whose CSRF field is gone (as a cross-site form would be) is refused and places nothing.
        page.open("/console/tenant")
        browser.execute_script("document.querySelector('#demand-form input[name=csrf]').remove()")
        page.fill("max_price", "300")
        page.click("place-demand")
        assert page.text("error").startswith("403") and "CSRF" in page.text("error-message")
        assert other.client.demands() == []
        page.shot("csrf-refused")
        page.sign_out()

        # The operator's page: the verification queue, disputes and the audit.
        new_party(server.url, "lab-three", "tenant").client.request_verification("papers")
        page.sign_in(ops.token)
        assert "lab-three" in page.text("pending")
        assert page.text("audit-result") == "every invariant holds"
        page.shot("operator")
    assert page.n == 12  # every screenshot was written
    market.store.dispose()
