#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The SSH-mode tests start a real sshd on loopback. Installed here when this runs as root on Debian
# or Ubuntu (as CI does); elsewhere those tests skip and say why.
if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing openssh-server for the SSH tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server; } >/dev/null 2>&1 ||
        echo "could not install openssh-server: the SSH tests will skip"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
