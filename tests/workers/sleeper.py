"""Workers that never finish: write their pid (and a grandchild's) and sleep. IGNORE_TERM=1 ignores SIGTERM."""

import os
import signal
import subprocess
import sys
import time

out_dir = os.environ["OUT_DIR"]
if os.environ.get("IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
with open(os.path.join(out_dir, f"pids{os.environ['RANK']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
while True:
    time.sleep(1)
