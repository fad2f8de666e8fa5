"""Result delivery by the market agent: what leaves the run directory and whose files it replaces."""

from __future__ import annotations

import json

import pytest

from runyard.control.delivery import DELIVERY_MARKER, deliver_results, delivery_target


def _run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "report.json").write_text('{"ok": true}')
    (run / "manifest.json").write_text("{}")
    (run / "stages" / "s1" / "checkpoints").mkdir(parents=True)
    (run / "stages" / "s1" / "checkpoints" / "step-1.pt").write_bytes(b"weights")
    (run / "stages" / "s1" / "metrics.jsonl").write_text("{}\n")
    return run


def test_delivery_copies_results_but_not_checkpoints(tmp_path):
    run = _run_dir(tmp_path)
    dest = tmp_path / "out"
    assert deliver_results(run, dest, {"lease_id": 1, "tenant": 7}) == 3
    assert (dest / "eval" / "report.json").read_text() == '{"ok": true}'
    assert not (dest / "stages" / "s1" / "checkpoints").exists()
    assert json.loads((dest / DELIVERY_MARKER).read_text())["tenant"] == 7


def test_a_symlinked_directory_does_not_deliver_files_from_outside_the_run(tmp_path):
    run = _run_dir(tmp_path)
    secret = tmp_path / "provider-secrets"
    secret.mkdir()
    (secret / "key.pem").write_text("PRIVATE")
    (run / "export").symlink_to(secret, target_is_directory=True)
    dest = tmp_path / "out"
    deliver_results(run, dest, {"lease_id": 1, "tenant": 7})
    assert not (dest / "export" / "key.pem").exists()
    assert (dest / "eval" / "report.json").exists()


def test_another_tenants_delivery_is_never_replaced(tmp_path):
    run = _run_dir(tmp_path)
    dest = tmp_path / "out"
    deliver_results(run, dest, {"lease_id": 1, "tenant": 7})
    with pytest.raises(ValueError, match="another tenant"):
        delivery_target(str(dest), tenant=8)
    with pytest.raises(ValueError, match="another tenant"):
        deliver_results(run, dest, {"lease_id": 2, "tenant": 8})
    assert json.loads((dest / DELIVERY_MARKER).read_text())["lease_id"] == 1
    # The same tenant may have a later lease's results replace its earlier ones.
    deliver_results(run, dest, {"lease_id": 3, "tenant": 7})
    assert json.loads((dest / DELIVERY_MARKER).read_text())["lease_id"] == 3


def test_delivery_target_refuses_what_it_cannot_deliver_to(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    for bad, why in [
        ("https://bucket/x", "only to local paths"),
        ("relative/dir", "absolute"),
        (f"{tmp_path}/a/../b", "absolute"),
        (str(tmp_path / "full"), "not an earlier runyard delivery"),
    ]:
        with pytest.raises(ValueError, match=why):
            delivery_target(bad, tenant=1)
    assert delivery_target(f"file://{tmp_path}/new", tenant=1) == tmp_path / "new"


def test_results_go_only_inside_the_providers_delivery_folders(tmp_path):
    root = tmp_path / "deliveries"
    root.mkdir()
    assert delivery_target(str(root / "tenant-1" / "run"), tenant=1, roots=(root,)) == root / "tenant-1" / "run"
    with pytest.raises(ValueError, match="outside this provider's delivery folders"):
        delivery_target(str(tmp_path / "elsewhere"), tenant=1, roots=(root,))
    (root / "escape").symlink_to(tmp_path)  # a link inside the root that points out of it
    with pytest.raises(ValueError, match="outside this provider's delivery folders"):
        delivery_target(str(root / "escape" / "x"), tenant=1, roots=(root,))
