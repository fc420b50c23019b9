#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The SSH-mode tests start a real sshd on loopback; the high-availability tests a 3-member etcd cluster
# (Debian's etcd-server); the partition test cuts a veth link with `ip`;
# the HTML report test renders the report in headless Chromium; the status view test draws it in a
# tmux pane. Installed here when this runs as root
# on Debian or Ubuntu (as CI does); elsewhere those tests skip and say why (-rs below lists the reasons).
# On CI (CI=true) a part that is missing or fails to start fails its tests instead (tests/parts.py).
missing=()
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || missing+=(iproute2)
command -v chromium >/dev/null || missing+=(chromium)
command -v tmux >/dev/null || missing+=(tmux)
command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || missing+=(etcd-server)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} for the SSH, etcd, partition, HTML report and status view tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null 2>&1 ||
        echo "could not install ${missing[*]}: those tests will skip (fail on CI)"
fi
bash scripts/setup.sh
# The MindSpore tests need mindspore (the CPU build, about 2.8 GB, numpy<2) in an interpreter of its own:
# .msvenv, made once (Python 3.11) and kept (.msvenv/ready says it is complete). It installs while the first
# tests run, which it hardly slows (it mostly waits on the disk); those tests wait for it
# (FTRUN_TEST_MINDSPORE_INSTALL), and skip, saying why, if it failed (its output: .msvenv.log); on CI they fail.
# FTRUN_TEST_MINDSPORE=0 leaves it out.
installer=""
if [ "${FTRUN_TEST_MINDSPORE:-1}" = 1 ] && [ ! -e .msvenv/ready ]; then
    echo "installing mindspore 2.10.0 into .msvenv for the MindSpore tests (beside the first tests; .msvenv.log)"
    rm -rf .msvenv
    { { python3.11 -m venv .msvenv && .msvenv/bin/pip install -q --disable-pip-version-check mindspore==2.10.0 \
        'numpy<2' && touch .msvenv/ready; } > .msvenv.log 2>&1 || rm -rf .msvenv; } &
    installer=$!
    export FTRUN_TEST_MINDSPORE_INSTALL=$installer
fi
# The Trainer, Lightning and DeepSpeed tests (tests/integration/test_frameworks.py) need transformers, accelerate,
# lightning and deepspeed: installed the same way into .frameworks (scripts/frameworks.txt, pinned, --no-deps, so
# that .venv's torch and numpy stay as they are; about 260 MB), which the tests' workers find on PYTHONPATH
# (FTRUN_TEST_FRAMEWORKS_INSTALL; its output: .frameworks.log). .frameworks/ready is the list it was installed
# from: a list that changed since installs anew. FTRUN_TEST_FRAMEWORKS=0 leaves them out.
frameworks=""
if [ "${FTRUN_TEST_FRAMEWORKS:-1}" = 1 ] && ! cmp -s scripts/frameworks.txt .frameworks/ready; then
    echo "installing transformers, accelerate, lightning and deepspeed into .frameworks for their tests (beside the first tests)"
    rm -rf .frameworks
    { { .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .frameworks \
        -r scripts/frameworks.txt && cp scripts/frameworks.txt .frameworks/ready; } > .frameworks.log 2>&1 ||
        rm -rf .frameworks; } &
    frameworks=$!
    export FTRUN_TEST_FRAMEWORKS_INSTALL=$frameworks
fi
# The lint (ruff) and the type check (mypy) of ftrun/, configured in pyproject.toml. A finding fails the
# run, but the tests still run, so that one stray import does not hide them.
checks=0
.venv/bin/ruff check ftrun || checks=1
.venv/bin/mypy || checks=1
# Two test processes, each taking whole files (a module's reference run is made once): most of the
# suite's time is workers starting and waiting on each other, which overlaps well. "-n 0" runs one. The
# files go out slowest first (tests/conftest.py's SLOWEST_FIRST), not by their number of tests, so that the
# two workers end together.
# The slowest tests are listed at the end: the suite must stay within 25 minutes on 2 cores. -rs: every
# skip's reason is in the log, not only their count.
code=0
.venv/bin/python -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=20 "$@" || code=$?
[ -z "$installer" ] || wait "$installer" || true  # never left running
[ -z "$frameworks" ] || wait "$frameworks" || true
[ "$code" = 0 ] || exit "$code"
[ "$checks" = 0 ] || { echo "ruff or mypy found problems (above)"; exit 1; }
