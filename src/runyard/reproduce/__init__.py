"""Reproduce a run anywhere: the environment lock that travels with a run, the environment rebuilt from
it, the rerun, and the comparison of two run directories.

- `installed`: what an installed distribution is (version, wheel tags, the digest of its files).
- `archives`: where a distribution's archive can honestly be found, and the proof that it is the one.
- `lock`: write and read a run's lock (`env/requirements.txt`, pip's hash-checking format, and
  `env/environment.json`, the facts pip's format has no field for).
- `source`: runyard's own source: its digest, and a wheel built from the recorded commit or the tree.
- `build`: a virtual environment from a lock, cached by the lock's hash; refusals before any work.
- `bundle`: a wheelhouse beside the lock, so the environment rebuilds with no package index.
- `datacheck`, `rerun`, `compare`, `report`, `reproduce`: the `runyard reproduce` verb's steps.
"""
