import numpy as np

from runyard.serve.drift import DriftMonitor, DriftReference, js_divergence, psi


def test_divergences_are_zero_for_equal_and_large_for_disjoint():
    a = np.array([10, 20, 30, 0])
    assert js_divergence(a, a) < 1e-9 and abs(psi(a, a)) < 1e-9
    assert js_divergence(np.array([100, 0]), np.array([0, 100])) > 0.9


def test_monitor_flags_token_drift_only_when_inputs_change(tmp_path):
    rng = np.random.default_rng(0)
    reference_probs = np.r_[np.full(50, 0.018), np.full(50, 0.002)]
    counts = rng.multinomial(200_000, reference_probs / reference_probs.sum())
    DriftReference([int(c) for c in counts]).save(tmp_path)
    reference = DriftReference.load(tmp_path)

    same = DriftMonitor(reference, window=200, min_requests=20, baseline=20)
    for _ in range(100):
        same.observe(
            rng.choice(
                100, size=int(rng.integers(10, 30)), p=reference_probs / reference_probs.sum()
            ).tolist()
        )
    report = same.report()
    assert report.token_js is not None and report.token_js < 0.05 and not report.drifting

    shifted = DriftMonitor(reference, window=200, min_requests=20, baseline=20)
    for _ in range(100):
        shifted.observe(rng.integers(50, 100, size=20).tolist())  # only the rare half of the vocabulary
    assert shifted.report().drifting


def test_monitor_flags_length_drift_against_its_baseline():
    reference = DriftReference([1] * 10)
    monitor = DriftMonitor(reference, window=50, min_requests=10, baseline=50, token_js_threshold=1.0)
    for _ in range(50):
        monitor.observe([1, 2, 3, 4, 5])  # baseline: short prompts
    assert monitor.report().length_psi < 0.01 and not monitor.report().drifting
    for _ in range(50):
        monitor.observe(list(range(10)) * 50)  # window now all long prompts
    report = monitor.report()
    assert report.length_psi > 0.25 and report.drifting


def test_too_few_requests_reports_nothing():
    monitor = DriftMonitor(DriftReference([1, 1]), min_requests=5)
    monitor.observe([0, 1])
    report = monitor.report()
    assert report.token_js is None and not report.drifting
