"""A job whose first attempt leaves a process behind and dies, as a killed launcher leaves its workers.

Attempt 0 starts a sleeper in its own session (so neither the shim's process group nor a parent-death
signal reaches it), records its pid in RUN_DIR/orphan.pid, and kills itself with SIGKILL. A later
attempt records whether that sleeper was still alive when it started (RUN_DIR/seen.json) and succeeds.
Standard library only.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

run_dir = Path(os.environ["RUNYARD_RUN_DIR"])
if int(os.environ.get("RUNYARD_RESTART_COUNT", "0")) == 0:
    # Not runyard.system.processes.popen_dying_with_me: this sleeper is the orphan the test is about (no parent-death signal).
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    (run_dir / "orphan.pid").write_text(str(sleeper.pid))
    os.kill(os.getpid(), signal.SIGKILL)
pid = int((run_dir / "orphan.pid").read_text())
stat = Path(f"/proc/{pid}/stat")
alive = stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
(run_dir / "seen.json").write_text(json.dumps({"orphan_alive": alive}))
