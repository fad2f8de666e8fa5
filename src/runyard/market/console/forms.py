"""The console's forms, read into the API's own request bodies (`models`): a form field that is not a
number where one is needed is refused naming the field, and the body is then checked by the same
pydantic model the API checks, so a form can ask for nothing a JSON request could not."""

from __future__ import annotations

from pydantic import ValidationError

from runyard.market import models as m
from runyard.market.errors import BadRequest

Form = dict[str, list[str]]


def first(form: Form, name: str) -> str | None:
    values = form.get(name)
    return values[0] if values else None


def text(form: Form, name: str) -> str:
    value = (first(form, name) or "").strip()
    if not value:
        raise BadRequest(f"the form's {name!r} field is empty")
    return value


def whole(form: Form, name: str) -> int:
    value = text(form, name)
    try:
        return int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise BadRequest(f"the form's {name!r} field: {value[:40]!r} is not a whole number") from None


def words(form: Form, name: str) -> list[str]:
    """A comma-separated field as a list (empty entries dropped)."""
    return [w.strip() for w in (first(form, name) or "").split(",") if w.strip()]


def key(form: Form) -> str:
    """The idempotency key the form was rendered with."""
    return text(form, "idempotency_key")


def amount(form: Form) -> int:
    value = whole(form, "amount")
    if value <= 0:
        raise BadRequest("the form's 'amount' field must be above 0 (minor units)")
    return value


def demand(form: Form) -> m.DemandIn:
    hours = text(form, "duration_h")
    try:
        duration_s = round(float(hours) * 3600)
    except ValueError:
        raise BadRequest(f"the form's 'duration_h' field: {hours[:40]!r} is not a number of hours") from None
    requirement: dict = {
        "accelerator_kinds": words(form, "accelerator_kinds"),
        "device_count": whole(form, "device_count"),
        "duration_s": duration_s,
        "start_classes": form.get("start_classes", []),
    }
    if words(form, "allowed_regions"):
        requirement["allowed_regions"] = words(form, "allowed_regions")
    return m.DemandIn.model_validate(
        {"requirement": requirement, "max_price_per_device_hour": whole(form, "max_price_per_device_hour")}
    )


def decision(form: Form) -> m.DecisionIn:
    approve = text(form, "approve")
    if approve not in ("yes", "no"):
        raise BadRequest(f"the form's 'approve' field is {approve[:20]!r}; expected yes or no")
    return m.DecisionIn(approve=approve == "yes", reason=text(form, "reason"))


def resolution(form: Form) -> m.ResolveIn:
    device_seconds = whole(form, "device_seconds") if (first(form, "device_seconds") or "").strip() else None
    return m.ResolveIn.model_validate(
        {"outcome": text(form, "outcome"), "reason": text(form, "reason"), "device_seconds": device_seconds}
    )


def credit(form: Form) -> m.CreditIn:
    return m.CreditIn(account=text(form, "account"), amount=amount(form), reason=text(form, "reason"))


def invalid(exc: ValidationError) -> BadRequest:
    """A model's refusal as the API words it (field: problem), for the error page."""
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return BadRequest(problems)
