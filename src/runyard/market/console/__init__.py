"""The market's web console at /console: server-rendered pages for tenants, providers and operators.

Pages and forms call the API's own handlers (`api.HANDLERS`, passed in by `api.create_app`) with the
signed-in account's principal, and show what the API's response models would return, so a page never
shows what the API would refuse. See docs/console.md.
"""

from runyard.market.console.app import create_console

__all__ = ["create_console"]
