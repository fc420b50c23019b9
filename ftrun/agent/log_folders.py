"""Where a node's files go: the run's folder under --log-dir (the controller's event log and the node's
logs share it), the node's folder for its workers' logs, error files and rank tables."""

from __future__ import annotations

import logging
import os
import tempfile

from ftrun.config import LaunchConfig
from ftrun.folders import private_dirs, run_folder

log = logging.getLogger(__name__)


class LogFolders:
    """The run's and the node's folders, each made once, when first asked for; ``cleanup`` removes what
    the job alone needed."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self._run: str | None = None
        self._temporary: tempfile.TemporaryDirectory | None = None

    def run_folder(self) -> str:
        """This run's folder under --log-dir (torchrun's layout: the one DIR/RUN_ID_XXXXXXXX of the run);
        "" without --log-dir."""
        if self._run is None:
            config = self.config
            self._run = run_folder(config.log_dir, config.run_id, config.log_layout) if config.log_dir else ""
        return self._run

    def node_folder(self, node_rank: int) -> str:
        """The folder of node ``node_rank``'s worker logs and rank tables."""
        config = self.config
        if config.log_dir and config.log_layout == "torchrun":
            return self.run_folder()  # torchrun's: attempt_G/LOCAL_RANK/ right in the run's folder
        if config.log_dir:
            path = os.path.join(self.run_folder(), f"node{node_rank}")
            private_dirs(path)
            return path
        if (config.redirects.default or config.redirects.per_rank or config.tee.default or config.tee.per_rank
                or config.duplicate_stdout_filters or config.duplicate_stderr_filters):
            path = tempfile.mkdtemp(prefix=f"ftrun-{config.run_id}-")  # kept: the user asked for these files
            log.info("worker logs in %s (set --log-dir to choose)", path)
            return path
        # only the workers' error files: gone with the job
        self._temporary = tempfile.TemporaryDirectory(prefix="ftrun-")
        return self._temporary.name

    @property
    def temporary(self) -> str:
        """The node's folder where it goes with the job (only the workers' error files), or ""."""
        return self._temporary.name if self._temporary is not None else ""

    def cleanup(self) -> None:
        """Remove the folder that goes with the job (again: nothing; gone already: nothing)."""
        if self._temporary is not None:
            self._temporary.cleanup()
