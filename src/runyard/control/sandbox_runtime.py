"""The least of the provider's Python runtime a lease job's sandbox must show to run an interpreter.

A lease job runs the provider's own interpreter, virtual environment and runyard, read-only. It is
shown exactly these, each at its own path (`Runtime.binds`), and never a folder around them:

- /usr read-only, which the dynamic linker and the system's libraries need, but NOT /usr/local:
  that is an empty read-only folder inside, since a provider keeps its own tools and builds there;
- the interpreter: the executable and each symbolic link leading to it (not the folder it is in:
  for an interpreter in ~/bin or ~/.local/bin that folder's parent is the provider's home), its
  standard library folder (lib/pythonX.Y, with lib-dynload) and its libpython shared library when it
  is built shared; under /usr that is all inside /usr already, under /usr/local it is bound on the
  empty /usr/local; the base installation's site-packages is hidden (an empty folder) when the
  virtual environment does not use it;
- the virtual environment (sys.prefix, when it is one), whole: it is the job's dependencies; with
  no virtual environment, the site-packages folders the interpreter imports from;
- runyard's package folder only, where it is imported from outside those (an editable install or
  PYTHONPATH: the checkout's src/runyard, never the checkout with its .git, its .env or its venv's
  neighbours), with PYTHONPATH inside naming its parent.

A folder that is or contains a home directory (/root, /home, this user's home), or that holds a
.git, is never bound: `runtime` raises SandboxUnavailable naming it, instead of showing it.

`facts(python)` asks an interpreter where its parts are: this one in-process, another (a lease job's
environment built from its lock) by running it with -I -S, which imports no site and runs no
package's code.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import subprocess
import sys
from dataclasses import dataclass, field

import runyard
from runyard.errors import RunyardError

USR_LOCAL = "/usr/local"

# Where an interpreter's parts are. Run in-process for this interpreter and with `python -I -S -c` for
# another, so both give the same answer for the same interpreter.
FACTS = r"""
import json, os, site, sys, sysconfig
v = sysconfig.get_config_var
lib = os.path.join(v("LIBDIR"), v("INSTSONAME")) if v("Py_ENABLE_SHARED") and v("LIBDIR") and v("INSTSONAME") else None
cfg = os.path.join(sys.prefix, "pyvenv.cfg")
system_site = sys.prefix == sys.base_prefix
if not system_site and os.path.isfile(cfg):
    for line in open(cfg, encoding="utf-8"):
        key, _, value = line.partition("=")
        if key.strip() == "include-system-site-packages":
            system_site = value.strip().lower() == "true"
FACTS_OUT = {"executable": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
             "stdlib": sysconfig.get_path("stdlib"), "dynload": [p for p in sys.path if p.endswith("lib-dynload")],
             "libpython": lib, "site": site.getsitepackages(), "base_site": site.getsitepackages([sys.base_prefix]),
             "system_site": system_site}
"""


class SandboxUnavailable(RunyardError):
    """bubblewrap cannot run lease jobs on this machine; the message says why."""


@dataclass
class Runtime:
    """What the sandbox shows of a runtime: folders and files read-only, symbolic links made inside,
    folders hidden under an empty read-only one, and the PYTHONPATH inside (None: none needed)."""

    ro: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (path, target)
    hidden: list[str] = field(default_factory=list)
    pythonpath: str | None = None

    def merge(self, other: Runtime) -> Runtime:
        return Runtime(_outermost(self.ro + other.ro), list(dict.fromkeys(self.links + other.links)),
                       list(dict.fromkeys(self.hidden + other.hidden)), self.pythonpath or other.pythonpath)


@functools.lru_cache(maxsize=8)
def facts(python: str | None = None) -> dict:
    """Where `python`'s parts are (see FACTS); None: this interpreter."""
    if python is None or python == sys.executable:
        scope: dict = {}
        exec(FACTS, scope)  # noqa: S102 -- our own constant, the same text the subprocess runs
        return scope["FACTS_OUT"]
    try:
        out = subprocess.run([python, "-I", "-S", "-c", FACTS + "print(json.dumps(FACTS_OUT))"],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"cannot ask the interpreter {python} where its parts are: {exc}") from None
    if out.returncode != 0:
        raise SandboxUnavailable(f"the interpreter {python} could not say where its parts are "
                                 f"({out.returncode}): {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def private_roots() -> list[str]:
    """Home directories: no bound folder may be one or contain one."""
    homes = {"/root", "/home", os.path.expanduser("~")}
    with contextlib.suppress(KeyError):
        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    return sorted(os.path.realpath(h) for h in homes if h and os.path.realpath(h) != "/")


def check_shown(path: str) -> None:
    """SandboxUnavailable when `path` is a folder the sandbox must never show whole."""
    real = os.path.realpath(path)
    for home in private_roots():
        if real == home or home.startswith(real.rstrip("/") + "/"):
            raise SandboxUnavailable(f"the runtime folder {path} is or contains the home directory {home}; a lease "
                                     "job must not see it (move the interpreter or virtual environment out of it)")
    if real == "/" or os.path.exists(os.path.join(real, ".git")):
        raise SandboxUnavailable(f"the runtime folder {path} is a source checkout (it holds .git); a lease job "
                                 "must not see it (install runyard, or use its src/ layout)")


def runtime(python: str | None = None, package: bool = True) -> Runtime:
    """What the sandbox shows so that `python` (None: this interpreter) runs; with `package`, this
    process's runyard package too, where the interpreter does not already hold it."""
    f = facts(python)
    out = Runtime()
    venv = f["prefix"] != f["base_prefix"]
    if venv:
        out.ro.append(f["prefix"])
    sites = [*(f["site"] if not venv else []), *(f["base_site"] if f["system_site"] and venv else [])]
    out.ro += [f["stdlib"], *f["dynload"], *(p for p in sites if os.path.isdir(p))]
    if f["libpython"] and os.path.exists(f["libpython"]):
        out.ro += _chain(f["libpython"], out.links)
    out.ro += _chain(python or f["executable"], out.links)
    if venv and not f["system_site"]:
        out.hidden = [p for p in f["base_site"] if os.path.isdir(p) and _inside(p, f["stdlib"]) and _shown(p)]
    if package:
        pkg = os.path.dirname(os.path.realpath(runyard.__file__))
        if not any(_inside(pkg, p) for p in (*sites, f["prefix"] if venv else "\0")):
            out.ro.append(pkg)
            out.pythonpath = os.path.dirname(pkg)
    out.ro = [p for p in _outermost([p for p in out.ro if os.path.exists(p)]) if _shown(p)]
    out.links = [(p, t) for p, t in out.links if _shown(p) and not any(_inside(p, r) for r in out.ro)]
    for path in out.ro:
        if os.path.isdir(path):
            check_shown(path)
    return out


def _chain(path: str, links: list[tuple[str, str]]) -> list[str]:
    """The real file at the end of `path`'s symbolic links; each link on the way goes to `links`."""
    seen = set()
    while os.path.islink(path) and path not in seen:
        seen.add(path)
        target = os.readlink(path)
        links.append((path, target))
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return [path]


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _shown(path: str) -> bool:
    """Not already shown by /usr (which is bound whole, less /usr/local)."""
    return not _inside(path, "/usr") or _inside(path, USR_LOCAL)


def _outermost(paths: list[str]) -> list[str]:
    out: list[str] = []
    for path in sorted(dict.fromkeys(paths), key=len):
        if not any(_inside(path, p) and os.path.isdir(p) for p in out):
            out.append(path)
    return out
